"""Checksums of what a checkpoint stores, and errors that name the damage.

Arrays. Arrays are stored as zarr v2 chunks (uncompressed): the stacks'
tables and slots as chunk files of their own (`_ckpt_tables`), the other
arrays in orbax's OCDBT files. The manifest holds the CRC-32 of every chunk
(`"digests"`: per array its shape, dtype, chunk shape and `{chunk index:
CRC-32}`). A save hashes the host bytes of the chunks each process writes
(`chunk_digests`: a device's shard cut into chunks of at most 32 MiB,
`block_shape`), in parallel threads; the processes' digests are gathered
into the manifest (a sync point of the save, `_ckpt_agree`). A table's
chunk is checked as `_ckpt_tables` reads it. Of the other arrays, a
restore hashes the values it has read, before it assigns any (`verify`,
from `read_arrays`): a chunk
that one piece holds whole (the same topology) in place; a chunk split
across devices (another topology) copied together from its pieces; one
only partly read by this process or read with a cast (`cast_tables`) read
again from the checkpoint by itself. A zarr v2 chunk is its values' bytes
in C order (an edge chunk's file pads them to a whole chunk, unchecked), so
its CRC-32 is that of the stored values: any changed byte of a chunk's
values that is read fails the check. A truncated or missing data file
fails the read itself. The OCDBT B+tree nodes that hold each array's zarr
metadata and the places of its chunks have CRC-32C checksums of their own.
On CPU devices the hashes read the arrays' own buffers; on accelerators
a copy of one chunk at a time (`host_piece`), one more transfer of the
table beside the write's.

CRC-32 is computed by ISA-L (`isal`: carry-less multiplies, 12 GB/s on
one core here) or, without it, zlib (the same values, 4 GB/s). f427531's
zarr v3 `crc32c` codec, checked by TensorStore as it decodes, cost about
0.3 s per GiB saved and 1 s per GiB restored on 2 cores: TensorStore's
build computes CRC-32C in software (`absl::crc_internal::CRC32::Extend`,
about 3 GB/s), and TensorStore's own reads of sharded zarr v3 chunks took
0.1 s per GiB more than of zarr v2's; its checkpoints still restore,
checked by TensorStore, and those written before either restore
unchecked. docs/benchmarks.md (`benchmarks/checkpoint.py`) has the
figures.

Manifest. `seal` adds `"crc32"`, the CRC-32 of the manifest's canonical
JSON (sorted keys, no spaces) without it; `read_manifest` recomputes it.

Errors. `read_manifest` and `read_arrays` turn orbax's and TensorStore's
errors (a bare `Exception` around a status message naming internal keys
such as `a0/4.0.0`) into a `FileNotFoundError` (a missing file) or a
`ValueError` (a short, damaged or garbled one) naming the checkpoint, the
table (or variable, or trainer leaf), the shard and the file, e.g.::

  ValueError: /ckpt/3: table 'words' of SparseCoreEmbed 'emb', shard 4:
  damaged data (checksum mismatch) in
  /ckpt/3/arrays/ocdbt.process_0/d/7f1bd509bbc7c689ff3f45543f3170a5

The file is found by walking the OCDBT B+tree (`tensorstore.ocdbt.dump`)
to the chunk's entry, which gives its data file, offset and length.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import re
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from orbax.checkpoint._src.arrays import subchunking

try:  # CRC-32 with carry-less multiplies: 3x zlib's speed, same values.
  from isal.isal_zlib import crc32 as _crc32_bytes
except ImportError:  # pragma: no cover
  from zlib import crc32 as _crc32_bytes

from pz_sparsecore.nn._ckpt_delta import ROWS
from pz_sparsecore.nn._ckpt_manifest import TABLE
from pz_sparsecore.nn._ckpt_steps import MANIFEST_FILE

CHECKSUM = "crc32"
"""The manifest's own checksum field."""


DIGESTS = "digests"
"""The manifest's field of the arrays' block checksums (`chunk_digests`)."""

_THREADS = os.cpu_count() or 1
_SMALL_RUN = 1 << 16
"""Bytes below which a block's strided runs are copied before hashing."""

# ---------------------------------------------------------------------------
# Block checksums of the arrays.

Digests = dict[str, dict[str, Any]]
"""Array key → {"shape", "dtype", "block", "crc32": {block index: CRC-32}}."""


def block_crc(block: np.ndarray) -> int:
  """CRC-32 of a block's bytes in C order (strided blocks run by run)."""
  if block.flags.c_contiguous:
    return _crc32_bytes(block.reshape(-1).view(np.uint8))
  axis = block.ndim
  while axis and block[(0,) * (axis - 1)].flags.c_contiguous:
    axis -= 1
  run = block[(0,) * axis]
  if run.nbytes < _SMALL_RUN:
    return _crc32_bytes(np.ascontiguousarray(block).reshape(-1).view(np.uint8))
  crc = 0
  for index in np.ndindex(block.shape[:axis]):
    crc = _crc32_bytes(block[index].reshape(-1).view(np.uint8), crc)
  return crc


def chunk_name(index: tuple[int, ...]) -> str:
  return ".".join(map(str, index)) or "0"


def pieces(value: Any, written: bool) -> list[tuple[tuple[int, ...], Any]]:
  """(origin, host array) of each distinct piece this process holds of an
  array; `written`: only those it writes (replica 0; a host value on
  process 0)."""
  if not isinstance(value, jax.Array):
    if written and jax.process_index() != 0:
      return []
    value = np.asarray(value)
    return [((0,) * value.ndim, value)]
  out, seen = [], set()
  for shard in value.addressable_shards:
    if written and shard.replica_id != 0:
      continue
    origin = tuple(
      s.indices(n)[0] for s, n in zip(shard.index, value.shape, strict=True)
    )
    if origin not in seen:
      seen.add(origin)
      out.append((origin, shard.data))
  return out


def blocks(
  origin: tuple[int, ...],
  shape: tuple[int, ...],
  block: list[int],
  stored: list[int],
) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...], bool]]:
  """Block index, its slices into a piece at `origin` of `shape`, and
  whether the piece holds the whole block, for each block it meets."""
  ranges = []
  for o, n, b, size in zip(origin, shape, block, stored, strict=True):
    stop = min(o + n, size)
    ranges.append(range(o // b, -(-stop // b)) if stop > o else range(0))
  for index in itertools.product(*ranges):
    whole, slices = True, []
    for i, o, n, b, size in zip(
      index, origin, shape, block, stored, strict=True
    ):
      lo, hi = i * b, min((i + 1) * b, size)
      whole &= o <= lo and hi <= o + n
      slices.append(slice(lo - o, hi - o))
    yield index, tuple(slices), whole


def host_piece(data: Any) -> Any:
  """A device piece as a host array where a CPU device's buffer is one (a
  view, no copy); an accelerator's stays a device array, of which each
  chunk is then transferred by itself."""
  if isinstance(data, jax.Array):
    device = next(iter(data.sharding.device_set))
    if device.platform != "cpu":
      return data
  return np.asarray(data)


def block_shape(value: Any, chunk_bytes: int, edges: bool = False) -> list[int]:
  """The chunk shape an array is stored in: its write shape (a device's
  shard) split to at most `chunk_bytes` (one item at least).

  orbax's arrays (`edges` False): orbax's choice, whose chunks divide the
  write shape (a piece of a prime number of rows is stored row by row).
  The `tables` item's (`edges` True): the last axes whole as far as they
  fit, the next one cut to fit (an edge chunk at its end, zarr pads it),
  the first axes one item; a cut of the first axis divides the write shape
  (pieces are split along it).
  """
  shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
  write = shape
  if isinstance(value, jax.Array):
    write = value.sharding.shard_shape(shape)
  if not edges:
    return list(
      subchunking.choose_chunk_shape(shape, write, dtype, chunk_bytes)
    )
  block, size = list(write), dtype.itemsize
  for axis in reversed(range(len(write))):
    if size * write[axis] <= chunk_bytes:
      size *= write[axis]
      continue
    fit = max(1, chunk_bytes // size)
    if axis == 0 and len(write) > 1 and write != shape:
      fit = max(d for d in range(1, fit + 1) if write[0] % d == 0)
    block[axis] = fit
    block[:axis] = [1] * axis
    break
  return [max(1, b) for b in block]


def chunk_digests(
  arrays: Mapping[str, Any],
  chunk_bytes: int,
  edges: frozenset[str] = frozenset(),
) -> Digests:
  """CRC-32s of the blocks of the arrays this process writes.

  An array's blocks are the chunks orbax stores it in (its write shape,
  a device's shard, split to at most `chunk_bytes`), so the checksum of a
  block is that of a stored chunk's bytes. Blocks are hashed in parallel
  threads (ISA-L's CRC-32, or zlib's).

  Args:
    arrays: Array key → value (a `jax.Array` or a host array), as saved.
    chunk_bytes: orbax's `chunk_byte_size`.
    edges: The keys stored in the `tables` item (`block_shape`'s `edges`).

  Returns:
    This process's part; `merged` joins every process's.
  """
  out, jobs = {}, []
  for key, value in arrays.items():
    shape, dtype = tuple(np.shape(value)), np.dtype(value.dtype)
    block = block_shape(value, chunk_bytes, key in edges)
    crcs = {}
    out[key] = {
      "shape": list(shape),
      "dtype": dtype.name,
      "block": block,
      "crc32": crcs,
    }
    for origin, data in pieces(value, written=True):
      data = host_piece(data)
      for index, slices, _ in blocks(origin, data.shape, block, list(shape)):
        jobs.append((crcs, chunk_name(index), data, slices))

  def hashed(job) -> int:
    _, _, data, slices = job
    return block_crc(np.asarray(data[slices]))

  with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
    for (crcs, name, _, _), crc in zip(
      jobs, pool.map(hashed, jobs), strict=True
    ):
      crcs[name] = crc
  return out


def merged(parts: list[Digests]) -> Digests:
  """Every process's `chunk_digests` in one."""
  out = {}
  for part in parts:
    for key, entry in part.items():
      kept = out.setdefault(key, {**entry, "crc32": {}})
      kept["crc32"].update(entry["crc32"])
  for entry in out.values():
    entry["crc32"] = dict(sorted(entry["crc32"].items()))
  return out


def _crc32(manifest: Mapping[str, Any]) -> int:
  text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
  return zlib.crc32(text.encode())


def seal(
  manifest: Mapping[str, Any], digests: Digests | None = None
) -> dict[str, Any]:
  """The manifest with the arrays' block checksums and its own."""
  body = {k: v for k, v in manifest.items() if k != CHECKSUM}
  if digests is not None:
    body[DIGESTS] = digests
  return {**body, CHECKSUM: _crc32(body)}


# ---------------------------------------------------------------------------
# Reading: the manifest.


def read_manifest(read: Callable[[], Any], path: str) -> dict[str, Any]:
  """Reads and verifies the manifest of checkpoint `path`.

  Args:
    read: Reads the manifest (orbax's JSON restore).
    path: The checkpoint.

  Returns:
    The manifest, without its checksum.

  Raises:
    FileNotFoundError: If the manifest is missing.
    ValueError: If it is not JSON or its checksum does not match.
  """
  file = os.path.join(path, MANIFEST_FILE)
  missing = FileNotFoundError(
    f"{path}: the manifest {file} is missing (an older checkpoint restores "
    "with step=, pz_sparsecore.list_checkpoints lists them)"
  )
  if not os.path.isfile(file):  # orbax says KeyError without its folder.
    raise missing
  try:
    stored = read()
  except FileNotFoundError:
    raise missing from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(
      f"{path}: the manifest {file} is damaged (not JSON: {e})"
    ) from None
  if not isinstance(stored, dict):
    raise ValueError(f"{path}: the manifest {file} is damaged (not an object)")
  if CHECKSUM not in stored:  # Written before manifests had checksums.
    return stored
  body = {k: v for k, v in stored.items() if k != CHECKSUM}
  if stored[CHECKSUM] != _crc32(body):
    raise ValueError(f"{path}: the manifest {file} is damaged (checksum)")
  return body


# ---------------------------------------------------------------------------
# Reading: the arrays.


def owners(stored: Mapping[str, Any]) -> dict[str, tuple[str, bool]]:
  """Array key → (what it holds, whether its first axis is the shards)."""
  out = {}
  for layer, stacks in stored["embeds"].items():
    for stack, entry in stacks.items():
      tables = [t["name"] for t in entry["layout"]["tables"]]
      what = f"table {tables[0]!r}"
      if len(tables) > 1:
        what = f"tables {', '.join(map(repr, tables))} (stack {stack!r})"
      # A delta's stacks hold rows, not shards (`_ckpt_delta`).
      rows = entry.get(ROWS)
      if rows is not None:
        out[rows] = (
          f"row addresses of {what} of SparseCoreEmbed {layer!r}",
          False,
        )
      for array, key in entry["arrays"].items():
        slot = "" if array == TABLE else f"slot {array!r} of "
        if rows is not None:
          slot = f"touched rows of {slot}"
        out[key] = (f"{slot}{what} of SparseCoreEmbed {layer!r}", rows is None)
  for label, entry in stored["variables"].items():
    out[entry["array"]] = (f"variable {label!r}", False)
  for entry in stored["trainer"] or ():
    out[entry["array"]] = (f"trainer state {entry['path']}", False)
  return out


_KEY = re.compile(r'"(a\d+)/([^"]*)" in OCDBT database')
_FILE = re.compile(r'local file "([^"]*[^/"])"')
_STATUS = re.compile(r"^([A-Z_]+: [^\[\n]*)", re.M)
_VALUE = re.compile(r"^value:([^:]*):([^:]+):(\d+):(\d+)$")


def _messages(error: BaseException) -> str:
  """The messages of an error and its causes."""
  out = []
  while error is not None and len(out) < 8:
    out.append(str(error))
    error = error.__cause__ or error.__context__
  return "\n".join(out)


def _entry(directory: str, key: str) -> dict[str, Any] | None:
  """The OCDBT B+tree entry of `key` in the database at `directory`.

  A child node's keys omit the prefix its parents' entries name
  (`subtree_common_prefix`); an entry covers the keys from its own to the
  next entry's.
  """
  base = ts.KvStore.open({"driver": "file", "path": directory + "/"}).result()
  want = key.encode()
  location = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
  prefix = b""
  while True:
    node = ts.ocdbt.dump(base, location).result()
    if node["height"] == 0:
      for entry in node["entries"]:
        if prefix + entry["key"] == want:
          return entry
      return None
    below = [e for e in node["entries"] if prefix + e["key"] <= want]
    if not below:
      return None
    location = below[-1]["location"]
    prefix += below[-1].get("subtree_common_prefix", b"")


def _where(arrays: str, key: str) -> tuple[str, int] | None:
  """The data file of a stored chunk and the bytes it needs, if found."""
  try:
    entry = _entry(arrays, key)
  except (ValueError, OSError, KeyError, IndexError):
    return None  # The B+tree itself is damaged: the message names a file.
  match = _VALUE.match((entry or {}).get("indirect_value", ""))
  if match is None:
    return None
  base, file, offset, length = match.groups()
  return os.path.join(arrays, base, file), int(offset) + int(length)


def _chunk_shape(arrays: str, array: str) -> list[int] | None:
  """The stored chunk shape of an array (None if unreadable)."""
  store = ts.KvStore.open(
    {"driver": "ocdbt", "base": {"driver": "file", "path": arrays + "/"}}
  )
  try:
    for name in ("zarr.json", ".zarray"):
      value = store.result().read(f"{array}/{name}").result().value
      if value:
        meta = json.loads(value)
        grid = meta.get("chunk_grid", {}).get("configuration", {})
        return grid.get("chunk_shape") or meta.get("chunks")
  except (ValueError, OSError, KeyError, AttributeError):
    return None
  return None


def _part(arrays: str, array: str, chunk: str, sharded: bool) -> str:
  """`shard 4`, `shards 0-3` or `chunk (0, 1)` from a zarr chunk key."""
  index = [int(i) for i in re.findall(r"\d+", chunk.removeprefix("c"))]
  if not index:
    return "metadata"
  shape = _chunk_shape(arrays, array) if sharded else None
  if not shape:
    return f"chunk {tuple(index)}"
  first, last = index[0] * shape[0], (index[0] + 1) * shape[0] - 1
  return f"shard {first}" if first == last else f"shards {first}-{last}"


def _damage(text: str, file: str | None, needed: int | None) -> str:
  if file is not None and needed is not None:
    size = os.path.getsize(file)
    if size < needed:
      return f"truncated data ({size} bytes, {needed} needed)"
  if "Digest mismatch" in text or "checksum" in text.lower():
    return "damaged data (checksum mismatch)"
  return "unreadable data"


def _translated(
  error: BaseException, path: str, stored: Mapping[str, Any]
) -> OSError | ValueError | None:
  """A short error for a failed read of checkpoint `path`'s arrays."""
  text = _messages(error)
  arrays = os.path.join(path, "arrays")
  key = _KEY.search(text)
  named = owners(stored)
  if key is None or key.group(1) not in named:
    what, part = "the arrays", None
    where = None
  else:
    what, sharded = named[key.group(1)]
    part = _part(arrays, key.group(1), key.group(2), sharded)
    where = _where(arrays, f"{key.group(1)}/{key.group(2)}")
  named = _FILE.search(text)
  file, needed = where or (named and named.group(1), None)
  subject = what if part is None else f"{what}, {part}"
  if file is None:
    if key is None:
      return None
    # No data file to name (orbax's own metadata is damaged): the
    # checkpoint's arrays folder and TensorStore's status, without its spec.
    status = _STATUS.search(text)
    status = status.group(1) if status else "unreadable"
    return ValueError(f"{path}: {subject}: in {arrays}: {status}")
  if not os.path.exists(file):
    return FileNotFoundError(f"{path}: {subject}: missing data file {file}")
  return ValueError(
    f"{path}: {subject}: {_damage(text, file, needed)} in {file}"
  )


def read_arrays(
  read: Callable[[], Any], path: str, stored: Mapping[str, Any]
) -> Any:
  """Reads a checkpoint's arrays; a missing or damaged file raises.

  Args:
    read: Reads the arrays (orbax's restore), raising on any damage.
    path: The checkpoint.
    stored: Its manifest.

  Returns:
    What `read` returns.

  Raises:
    FileNotFoundError: If a data file is missing.
    ValueError: If one is truncated or damaged.
  """
  try:
    arrays = read()
  # orbax raises a bare Exception around TensorStore's error; one that
  # names no file of the checkpoint is raised as it is.
  except Exception as e:  # noqa: BLE001
    error = _translated(e, path, stored)
    if error is None:
      raise
    raise error from None
  verify(arrays, path, stored)
  return arrays


def _stored_block(
  path: str, key: str, entry: Mapping[str, Any], index: tuple[int, ...]
) -> np.ndarray:
  """A block read from the stored array itself (as it is stored)."""
  spec = {
    "driver": "zarr",
    "kvstore": {
      "driver": "ocdbt",
      "base": {"driver": "file", "path": os.path.join(path, "arrays/")},
      "path": f"{key}/",
    },
  }
  store = ts.open(spec, open=True).result()
  slices = tuple(slice(lo, hi) for lo, hi in _bounds(entry, index))
  return store[slices].read().result()


def _bounds(
  entry: Mapping[str, Any], index: tuple[int, ...]
) -> list[tuple[int, int]]:
  """[start, stop) of a block along each axis."""
  return [
    (i * b, min((i + 1) * b, n))
    for i, b, n in zip(index, entry["block"], entry["shape"], strict=True)
  ]


def _assembled(
  entry: Mapping[str, Any],
  index: tuple[int, ...],
  parts: list[tuple[tuple[int, ...], np.ndarray]],
) -> np.ndarray | None:
  """A block from the pieces that share it, if they hold all of it."""
  bounds = _bounds(entry, index)
  out = np.empty([hi - lo for lo, hi in bounds], parts[0][1].dtype)
  held = 0
  for origin, data in parts:
    into, take = [], []
    for (lo, hi), o, n in zip(bounds, origin, data.shape, strict=True):
      a, b = max(lo, o), min(hi, o + n)
      into.append(slice(a - lo, b - lo))
      take.append(slice(a - o, b - o))
    out[tuple(into)] = data[tuple(take)]
    held += out[tuple(into)].size
  return out if held == out.size else None


def verify(arrays: Mapping[str, Any], path: str, stored: Mapping[str, Any]):
  """Checks the arrays read from checkpoint `path` against its digests.

  Every block this process read is hashed from the values read, in the
  stored dtype: in place where one piece holds it whole (a restore onto
  the same topology), else copied together from the pieces that share it
  (a restore onto another topology splits blocks across devices). A block
  only partly read by this process, or read with a cast, is read again
  from the checkpoint by itself. A checkpoint without digests (written
  before them) is not checked here.

  Raises:
    ValueError: Naming the table (or variable, or leaf), the shard and the
      data file of the first block whose checksum does not match.
  """
  digests = stored.get(DIGESTS)
  if digests is None:
    return
  jobs = []
  for key, value in arrays.items():
    entry = digests.get(key)
    if entry is None:
      continue
    shape, whole_blocks, split = list(entry["shape"]), set(), {}
    for origin, data in pieces(value, written=False):
      data = np.asarray(data)
      same = data.dtype.name == entry["dtype"]
      for index, slices, whole in blocks(
        origin, data.shape, entry["block"], shape
      ):
        if whole and same:
          if index not in whole_blocks:
            whole_blocks.add(index)
            jobs.append((key, index, data[slices]))
        else:
          split.setdefault(index, []).append((origin, data) if same else None)
    for index, parts in split.items():
      if index not in whole_blocks:
        jobs.append((key, index, None if None in parts else parts))

  def check(job: tuple[str, tuple[int, ...], Any]) -> bool:
    key, index, block = job
    entry = digests[key]
    if isinstance(block, list):
      block = _assembled(entry, index, block)
    if block is None:
      block = _stored_block(path, key, entry, index)
    return block_crc(block) == entry["crc32"].get(chunk_name(index))

  with concurrent.futures.ThreadPoolExecutor(_THREADS) as pool:
    for (key, index, _), good in zip(jobs, pool.map(check, jobs), strict=True):
      if not good:
        raise _mismatch(path, stored, key, index) from None


def _mismatch(
  path: str, stored: Mapping[str, Any], key: str, index: tuple[int, ...]
) -> ValueError:
  """The error of a block of array `key` whose checksum does not match."""
  arrays = os.path.join(path, "arrays")
  what, sharded = owners(stored).get(key, (f"array {key!r}", False))
  entry = stored[DIGESTS][key]
  start = [i * b for i, b in zip(index, entry["block"], strict=True)]
  chunk = _chunk_shape(arrays, key) or entry["block"]
  name = chunk_name(
    tuple(s // max(c, 1) for s, c in zip(start, chunk, strict=True))
  )
  part = _part(arrays, key, name, sharded)
  where = _where(arrays, f"{key}/{name}")
  file = where[0] if where else arrays
  return ValueError(
    f"{path}: {what}, {part}: damaged data (checksum mismatch) in {file}"
  )
