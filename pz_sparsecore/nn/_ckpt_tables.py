"""Stacked tables and slots, written and read a chunk at a time.

A checkpoint stores every stack's table and slots (the largest arrays by
far: a 100M x 64 bfloat16 table is 11.9 GiB; of a delta, their touched
rows and the rows' addresses) in an orbax item of their own, `tables`, as
uncompressed zarr v2 arrays on the file system: one folder per array key
(`tables/a0/`), its `.zarray` metadata (written by TensorStore, so any zarr
v2 reader that knows the dtype opens it) and one file per chunk
(`tables/a0/3.0.0`), the chunks those of the manifest's digests
(`_ckpt_integrity.block_shape` with `edges`: a device's shard cut to at
most 32 MiB, the last chunk of a cut axis padded; orbax's own chunks must
divide the shard, so a prime number of rows is stored row by row). The
manifest lists the keys stored there (`"tables"`); checkpoints without
that field hold everything in the `arrays` item.

Why not orbax's own arrays. orbax copies a device's whole shard to the
host and hands it to TensorStore, which holds its own copy of the chunks
until they are written: a save held about 1.6 times a table's bytes
beside it and a restore 2.3 times at its peak, so a 100M x 64 bfloat16
table (11.9 GiB) could neither be saved nor restored on a 24 GiB machine.
Here:

* a save writes each chunk straight from the device's buffer (on CPU
  devices, whose buffers are host memory, without a copy; on accelerators
  from a one-chunk transfer), a few chunks in flight;
* a restore gives each device a zeroed buffer of its shard and writes each
  chunk into it in place (a jitted `dynamic_update_slice` that donates the
  buffer), a few chunks in flight, so it holds the table once plus those
  chunks.

Every chunk is checked against its CRC-32 as it is read, before anything
is assigned; a missing, short or damaged chunk file raises an error naming
the table, the shard and the file. The bytes in flight are at most
`max_host_bytes` (at least one chunk), by default 256 MiB.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.handlers import async_checkpoint_handler

from pz_sparsecore.nn._ckpt_delta import ROWS
from pz_sparsecore.nn._ckpt_integrity import (
  DIGESTS,
  block_crc,
  block_shape,
  blocks,
  chunk_name,
  host_piece,
  owners,
  pieces,
)

ITEM = "tables"
"""The orbax item (and the manifest's field listing its keys)."""

_IN_FLIGHT = 256 * 2**20
"""Default bytes of chunks in flight between storage and devices."""

_THREADS = max(2, os.cpu_count() or 1)


def stored_keys(manifest: Mapping[str, Any]) -> list[str]:
  """The array keys of every stack's table and slots in a manifest (of a
  delta: their touched rows, and the rows' addresses)."""
  out = []
  for stacks in manifest["embeds"].values():
    for entry in stacks.values():
      out.extend(entry["arrays"].values())
      if ROWS in entry:
        out.append(entry[ROWS])
  return out


def _window(limit: int | None, chunk: int) -> int:
  """How many chunks of `chunk` bytes may be in flight."""
  return max(1, (limit or _IN_FLIGHT) // max(chunk, 1))


def _ordered(jobs: list[Any], run, window: int) -> Iterator[Any]:
  """`run(job)` of every job in threads, at most `window` pending, in
  order."""
  with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
    pending = []
    for job in jobs:
      if len(pending) >= window:
        yield pending.pop(0).result()
      pending.append(pool.submit(run, job))
    for f in pending:
      yield f.result()


# ---------------------------------------------------------------------------
# Saving.


def _zarr_dtype(dtype: Any) -> str:
  """zarr v2's name of a dtype (TensorStore's for bfloat16)."""
  dtype = np.dtype(dtype)
  return "bfloat16" if dtype.name == "bfloat16" else dtype.str


def _numpy_dtype(text: str) -> np.dtype:
  return np.dtype(jnp.bfloat16) if text == "bfloat16" else np.dtype(text)


def _metadata(folder: str, shape: tuple[int, ...], dtype: Any, block) -> None:
  """Writes the zarr v2 metadata of an array (no chunks)."""
  ts.open(
    {
      "driver": "zarr",
      "kvstore": {"driver": "file", "path": folder + "/"},
      "metadata": {
        "shape": list(shape),
        "chunks": list(block),
        "dtype": _zarr_dtype(dtype),
        "compressor": None,
        "order": "C",
        "fill_value": None,
        "dimension_separator": ".",
      },
    },
    create=True,
  ).result()


def _write_chunk(job: tuple[str, Any, tuple[slice, ...], list[int]]) -> None:
  """Writes a chunk of a piece: a view of a host piece, else a transfer
  of the chunk alone."""
  file, data, slices, block = job
  values = np.ascontiguousarray(np.asarray(data[slices]))
  if list(values.shape) != block:  # An edge chunk: zarr stores it whole.
    full = np.zeros(block, values.dtype)
    full[tuple(slice(0, n) for n in values.shape)] = values
    values = full
  with open(file, "wb") as f:
    f.write(memoryview(values.reshape(-1).view(np.uint8)))


def write(
  directory: str,
  arrays: Mapping[str, Any],
  chunk_bytes: int,
  max_host_bytes: int | None,
) -> None:
  """Writes this process's chunks of `arrays` under `directory` (and, on
  process 0, each array's metadata)."""
  jobs, largest = [], 1
  for key, value in arrays.items():
    folder = os.path.join(directory, key)
    os.makedirs(folder, exist_ok=True)
    shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
    block = block_shape(value, chunk_bytes, edges=True)
    largest = max(largest, int(np.prod(block)) * dtype.itemsize)
    if jax.process_index() == 0:
      _metadata(folder, shape, dtype, block)
    for origin, data in pieces(value, written=True):
      data = host_piece(data)
      for index, slices, _ in blocks(origin, data.shape, block, list(shape)):
        file = os.path.join(folder, chunk_name(index))
        jobs.append((file, data, slices, block))
  for _ in _ordered(jobs, _write_chunk, _window(max_host_bytes, largest)):
    pass


class TablesHandler(async_checkpoint_handler.AsyncCheckpointHandler):
  """The orbax handler of the `tables` item (saves only: `read` reads)."""

  def __init__(
    self, chunk_bytes: int = 32 * 2**20, max_host_bytes: int | None = None
  ):
    self._chunk_bytes = chunk_bytes
    self._max_host_bytes = max_host_bytes

  async def async_save(
    self, directory: Any, args: TablesSave | None = None
  ) -> list[future.Future] | None:
    arrays = {} if args is None else args.arrays
    path = os.fspath(directory)
    limit = self._max_host_bytes

    async def commit() -> None:
      write(path, arrays, self._chunk_bytes, limit)

    return [future.CommitFutureAwaitingContractedSignals(commit(), name=ITEM)]

  def save(self, directory: Any, args: TablesSave | None = None) -> None:
    for f in ocp.asyncio_utils.run_sync(self.async_save(directory, args)):
      f.result()

  def restore(self, directory: Any, args: Any = None) -> Any:
    raise NotImplementedError("tables are read by _ckpt_tables.read")


@ocp.args.register_with_handler(TablesHandler, for_save=True, for_restore=True)
class TablesSave(ocp.args.CheckpointArgs):
  """The stacks' arrays to save (array key → value)."""

  def __init__(self, arrays: Mapping[str, Any]):
    self.arrays = dict(arrays)


# ---------------------------------------------------------------------------
# Reading.


_ALIGN = 4096
"""Alignment of the host buffers: a CPU device takes an aligned buffer
without a copy (`jax.device_put`)."""


def _aligned(shape: list[int], dtype: np.dtype) -> np.ndarray:
  """An uninitialized C-order host array, its data `_ALIGN`-aligned."""
  size = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(size + _ALIGN, np.uint8)
  start = -raw.ctypes.data % _ALIGN
  return raw[start : start + size].view(dtype).reshape(shape)


def _part(index: tuple[int, ...], block: list[int], sharded: bool) -> str:
  if not sharded:
    return f"chunk {tuple(index)}"
  first, last = index[0] * block[0], (index[0] + 1) * block[0] - 1
  return f"shard {first}" if first == last else f"shards {first}-{last}"


class _Array:
  """One stored array: its metadata, and its errors' wording."""

  def __init__(self, path: str, key: str, stored: Mapping[str, Any]):
    self.path, self.key = path, key
    self.folder = os.path.join(path, ITEM, key)
    self.what, self.sharded = owners(stored).get(key, (f"array {key!r}", False))
    meta = os.path.join(self.folder, ".zarray")
    try:
      with open(meta) as f:
        zarray = json.load(f)
      self.shape = tuple(zarray["shape"])
      self.block = list(zarray["chunks"])
      self.dtype = _numpy_dtype(zarray["dtype"])
    except FileNotFoundError:
      raise FileNotFoundError(
        f"{path}: {self.what}: missing metadata file {meta}"
      ) from None
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(
        f"{path}: {self.what}: damaged metadata file {meta} ({e})"
      ) from None
    entry = (stored.get(DIGESTS) or {}).get(key)
    if entry is not None and (
      tuple(entry["shape"]) != self.shape
      or list(entry["block"]) != self.block
      or entry["dtype"] != self.dtype.name
    ):
      raise ValueError(
        f"{path}: {self.what}: metadata file {meta} does not match the "
        f"manifest (shape {list(self.shape)}, chunks {self.block}, dtype "
        f"{self.dtype.name}; manifest {entry['shape']}, {entry['block']}, "
        f"{entry['dtype']})"
      )
    self.crcs = None if entry is None else entry["crc32"]

  def valid(self, index: tuple[int, ...]) -> list[int]:
    """The shape of a chunk's values (an edge chunk's are fewer)."""
    return [
      min(b, n - i * b)
      for i, b, n in zip(index, self.block, self.shape, strict=True)
    ]

  def read(
    self, index: tuple[int, ...], into: np.ndarray | None = None
  ) -> np.ndarray:
    """A chunk's values (clipped to the array), checked; read straight
    into `into` (a C-contiguous array of a whole chunk) if given."""
    file = os.path.join(self.folder, chunk_name(index))
    chunk = np.empty(self.block, self.dtype) if into is None else into
    part = _part(index, self.block, self.sharded)
    where = f"{self.path}: {self.what}, {part}"
    try:
      with open(file, "rb", buffering=0) as f:
        got = f.readinto(memoryview(chunk.reshape(-1).view(np.uint8)))
        extra = len(f.read(1))
    except FileNotFoundError:
      raise FileNotFoundError(f"{where}: missing data file {file}") from None
    if got != chunk.nbytes or extra:
      size = os.path.getsize(file)
      state = "truncated" if size < chunk.nbytes else "damaged"
      raise ValueError(
        f"{where}: {state} data ({size} bytes, {chunk.nbytes} needed) in {file}"
      )
    values = chunk[tuple(slice(0, n) for n in self.valid(index))]
    digest = None if self.crcs is None else self.crcs.get(chunk_name(index))
    if self.crcs is not None and block_crc(values) != digest:
      raise ValueError(f"{where}: damaged data (checksum mismatch) in {file}")
    return values


def _patch(host: np.ndarray, origin: list[int], rows: np.ndarray, data):
  """Writes flat rows `rows` (of `[N * V_shard]`) of a stack to `data` in
  a device's piece `host` at `origin`, where the piece holds them."""
  per_shard = host.shape[1]
  shard, row = rows // per_shard, rows % per_shard
  # The global array's rows per shard are the piece's unless the read
  # splits the rows (a relayout read, which is never patched).
  shard, row = shard - origin[0], row - origin[1]
  held = (shard >= 0) & (shard < host.shape[0]) & (row >= 0)
  held &= row < host.shape[1]
  host[shard[held], row[held]] = np.asarray(data)[held]


def read(
  path: str,
  stored: Mapping[str, Any],
  key: str,
  args: ocp.ArrayRestoreArgs,
  max_host_bytes: int | None,
  patch: tuple[np.ndarray, Any] | None = None,
) -> jax.Array:
  """Reads stored array `key` of checkpoint `path` onto `args.sharding`
  (or, for `args` without one, to the host: a numpy array).

  Each device's piece is filled on the host, chunk by chunk (a chunk that
  is a contiguous part of one piece is read straight into it), then put on
  its device (a CPU device takes the buffer without a copy).
  `args.global_shape` may exceed the stored shape (a read for a relayout):
  the rest reads as zeros. Values are cast to `args.dtype`. `patch`:
  flat rows of the stack (`[N * V_shard]`, the stored layout) and their
  values (a delta chain's), written over the rows read, on the host, before
  the pieces go to their devices.

  Raises:
    FileNotFoundError: If a file of the array is missing.
    ValueError: If one is short or damaged (checksum mismatch).
  """
  array = _Array(path, key, stored)
  sharding = getattr(args, "sharding", None)
  if sharding is None:  # To the host, whole.
    shape, dtype = array.shape, array.dtype
    regions = {None: tuple(slice(0, n) for n in shape)}
  else:
    shape = tuple(args.global_shape)
    dtype = np.dtype(args.dtype or array.dtype)
    regions = sharding.addressable_devices_indices_map(shape)
  hosts, origins, wanted = {}, {}, {}
  for device, index in regions.items():
    bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    origin = [lo for lo, _ in bounds]
    host = _aligned([hi - lo for lo, hi in bounds], dtype)
    if any(hi > n for (_, hi), n in zip(bounds, array.shape, strict=True)):
      host.fill(0)  # Beyond the stored array.
    hosts[device], origins[device] = host, origin
    local = [
      max(0, min(hi, n) - lo)
      for (lo, hi), n in zip(bounds, array.shape, strict=True)
    ]
    for chunk, _, _ in blocks(origin, local, array.block, list(array.shape)):
      wanted.setdefault(chunk, []).append(device)
  jobs = []
  for chunk, devices in wanted.items():
    lo = [i * b for i, b in zip(chunk, array.block, strict=True)]
    valid = array.valid(chunk)
    copies = []
    for device in devices:
      origin, host = origins[device], hosts[device]
      into, take = [], []
      for c, n, o, size in zip(lo, valid, origin, host.shape, strict=True):
        a, b = max(c, o), min(c + n, o + size)
        into.append(slice(a - o, b - o))
        take.append(slice(a - c, b - c))
      copies.append((host, tuple(into), tuple(take)))
    direct = None
    host, into, _ = copies[0]
    if (
      len(copies) == 1
      and dtype == array.dtype
      and valid == array.block
      and host[into].shape == tuple(valid)
      and host[into].flags.c_contiguous
    ):
      direct = host[into]
    jobs.append((chunk, direct, copies))

  def run(job) -> None:
    chunk, direct, copies = job
    values = array.read(chunk, direct)
    if direct is None:
      for host, into, take in copies:
        host[into] = values[take]

  chunk = int(np.prod(array.block)) * array.dtype.itemsize
  for _ in _ordered(jobs, run, _window(max_host_bytes, chunk)):
    pass
  if patch is not None:
    if shape != array.shape:
      raise ValueError(f"{key}: a relayout read cannot be patched")
    for device, host in hosts.items():
      _patch(host, origins[device], *patch)
  if sharding is None:
    return hosts[None]
  return jax.make_array_from_single_device_arrays(
    shape,
    sharding,
    [jax.device_put(hosts[device], device) for device in regions],
  )


def read_all(
  path: str,
  stored: Mapping[str, Any],
  args: Mapping[str, ocp.ArrayRestoreArgs],
  max_host_bytes: int | None,
  patches: Mapping[str, tuple[np.ndarray, Any]],
) -> dict[str, jax.Array]:
  """`read` of every key of `args`, with its patch if `patches` has one."""
  return {
    key: read(path, stored, key, arg, max_host_bytes, patches.get(key))
    for key, arg in args.items()
  }
