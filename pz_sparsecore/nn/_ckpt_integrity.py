"""Checksums of what a checkpoint stores, and errors that name the damage.

Arrays. Every chunk of every stored array carries a CRC-32C of its bytes:
arrays are written as zarr v3 with a `crc32c` codec after the `bytes`
codec (`checksummed_chunks`), so TensorStore computes the checksum as it
encodes a chunk and checks it as it decodes one, on whatever process
reads it and onto any topology. A damaged chunk fails the read, and a
restore reads every array before it assigns any, so the target is
unchanged. On 2 CPU cores they cost about 0.3 s per GiB saved and 1.0 to
1.4 s per GiB restored (`benchmarks/checkpoint.py`, docs/benchmarks.md). The
OCDBT B+tree nodes that hold each array's zarr metadata and the places of
its chunks have CRC-32C checksums of their own. Checkpoints written
without the codec (zarr v2, before it) restore, unchecked.

Manifest. `seal` adds `"crc32"`, the CRC-32 of the manifest's canonical
JSON (sorted keys, no spaces) without it; `read_manifest` recomputes it.

Errors. `read_manifest` and `read_arrays` turn orbax's and TensorStore's
errors (a bare `Exception` around a status message naming internal keys
such as `a0/c/4/0/0`) into a `FileNotFoundError` (a missing file) or a
`ValueError` (a short, damaged or garbled one) naming the checkpoint, the
table (or variable, or trainer leaf), the shard and the file, e.g.::

  ValueError: /ckpt/3: table 'words' of SparseCoreEmbed 'emb', shard 4:
  damaged data (checksum mismatch) in
  /ckpt/3/arrays/ocdbt.process_0/d/7f1bd509bbc7c689ff3f45543f3170a5

The file is found by walking the OCDBT B+tree (`tensorstore.ocdbt.dump`)
to the chunk's entry, which gives its data file, offset and length.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils

from pz_sparsecore.nn._ckpt_delta import ROWS
from pz_sparsecore.nn._ckpt_manifest import TABLE
from pz_sparsecore.nn._ckpt_steps import MANIFEST_FILE

CHECKSUM = "crc32"
"""The manifest's own checksum field."""


_CRC32C = {"name": "crc32c"}

# ---------------------------------------------------------------------------
# Writing checksums.

# orbax 0.12 builds every zarr v3 array's codecs in this one function and
# offers no option to add one, so saves swap in a version that appends
# crc32c to the chunk codecs; the swap is undone when the last save in
# flight ends (tests/test_checkpoint_integrity.py reads the codecs back).
_build = tensorstore_utils._build_zarr3_metadata
_lock = threading.Lock()
_saves = [0]


def _build_checksummed(*args: Any, **kwargs: Any) -> dict[str, Any]:
  metadata = _build(*args, **kwargs)
  (sharding,) = metadata["codecs"]
  sharding["configuration"]["codecs"].append(dict(_CRC32C))
  return metadata


@contextlib.contextmanager
def checksummed_chunks() -> Iterator[None]:
  """Within it, orbax writes zarr v3 arrays with a CRC-32C per chunk."""
  with _lock:
    _saves[0] += 1
    tensorstore_utils._build_zarr3_metadata = _build_checksummed
  try:
    yield
  finally:
    with _lock:
      _saves[0] -= 1
      if not _saves[0]:
        tensorstore_utils._build_zarr3_metadata = _build


def _crc32(manifest: Mapping[str, Any]) -> int:
  text = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
  return zlib.crc32(text.encode())


def seal(manifest: Mapping[str, Any]) -> dict[str, Any]:
  """The manifest with its checksum."""
  body = {k: v for k, v in manifest.items() if k != CHECKSUM}
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


def _owners(stored: Mapping[str, Any]) -> dict[str, tuple[str, bool]]:
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
  owners = _owners(stored)
  if key is None or key.group(1) not in owners:
    what, part = "the arrays", None
    where = None
  else:
    what, sharded = owners[key.group(1)]
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
    return read()
  # orbax raises a bare Exception around TensorStore's error; one that
  # names no file of the checkpoint is raised as it is.
  except Exception as e:  # noqa: BLE001
    error = _translated(e, path, stored)
    if error is None:
      raise
    raise error from None
