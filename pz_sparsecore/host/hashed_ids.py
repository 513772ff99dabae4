"""Raw ids of hashed tables, made into buffers the preprocessor reads.

A hashed table (`core.hashed`) takes any int64 id (uint64 ids are read as
their 64-bit words) or strings / bytes (`hashed.string_ids`), in every
input form of `ragged_input` and `coo_input`. Before the usual
preprocessing, each of a hashed stack's features' ids is replaced by its
*place*: ids go to their owner shard `p` (`hashed.owners`); among the
distinct (table, id) pairs one local SparseCore sends to `p` (every feature
of the stack together, in order of first appearance: feature after
feature, sample after sample), a pair's place is its rank `r`. (The
owners resolve ids in an order of their own, so the places' order never
changes a result.) The feature then reads as a range
table whose id `r * N + p` lies in partition `p` at local row `r` (the plan
gives a hashed feature no offset and no rotation), so the preprocessor
sorts, merges, limits and counts exactly as for any stack:
`max_unique_ids_per_partition` bounds the distinct raw ids.

The ids themselves travel in `PreprocessedInput.hashed_ids`: per local
SparseCore `k`, partition `p` and place `r < cap` (`cap =
plan.hashed_places`: `r8(max_unique_ids_per_partition)`, times the
minibatches for minibatched buffers) the id's low and high words, its home
slot in its table's region of `p` (`hashed.homes`) and its table's index in
the stack; `[0, 0, -1, 0]` for no id. On the device (`device.hashed`) the
owners find or give each id a row and the places are replaced by those
rows.

Example: N = 2, one SparseCore per device, one local device, `cap` 8.
Ids `[[11, -4], [11, 7]]` with owners 11 -> 1, -4 -> 1, 7 -> 0: partition 1
gets the distinct ids 11 (place 0) and -4 (place 1), partition 0 gets 7
(place 0); the batch reads `[[0 * 2 + 1, 1 * 2 + 1], [1, 0 * 2 + 0]]`,
`hashed_ids[0, 1]` holds the words of 11 at place 0 and of -4 at place 1,
and `hashed_ids[0, 0]` those of 7 at place 0 (table 0, each with its
home).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pz_sparsecore.core import hashed
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.host import _hashed_numba, ragged_input
from pz_sparsecore.host import blocks as blocks_lib


def _string_leaf(leaf: Any) -> Any:
  """`leaf` with strings / bytes replaced by their ids (other leaves as
  they are)."""
  if isinstance(leaf, tuple) and len(leaf) == 2:
    values = np.asarray(leaf[0])
    if values.dtype.kind in "USO" and values.size:
      return (_strings(values), leaf[1])
    return leaf
  if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "US":
    return _strings(leaf)
  if isinstance(leaf, np.ndarray) and leaf.dtype == object:
    if leaf.ndim == 2:
      return _strings(leaf) if _is_text(leaf.flat[0]) else leaf
    if not _text_rows(leaf):
      return leaf
    return np.array([_row(row) for row in leaf] + [None], dtype=object)[:-1]
  if isinstance(leaf, list) and _text_rows(leaf):
    return [_row(row) for row in leaf]
  return leaf


def _text_rows(rows: Any) -> bool:
  """Whether ragged rows hold strings (their first non-empty row tells)."""
  for row in rows:
    array = np.asarray(row)
    if array.size:
      return array.dtype.kind in "US" or _is_text(array.flat[0])
  return False


def _is_text(x: Any) -> bool:
  return isinstance(x, (str, bytes, np.str_, np.bytes_))


def _row(row: Any) -> Any:
  array = np.asarray(row)
  if array.dtype.kind in "US" or (
    array.dtype == object and array.size and _is_text(array.flat[0])
  ):
    return _strings(array)
  return row


def _strings(values: np.ndarray) -> np.ndarray:
  values = np.asarray(values)
  bad = [x for x in values.flat if not _is_text(x)][:1]
  if bad:
    raise ValueError(
      f"mixed strings and {type(bad[0]).__name__} ids ({bad[0]!r})"
    )
  return hashed.string_ids(values.flat).reshape(values.shape)


def raw_ids(name: str, leaf: Any) -> ragged_input.Ragged:
  """One hashed feature's ids as int64 values and row splits.

  Raises:
    ValueError: Naming the feature, for ids that are neither integers nor
      strings / bytes, or a malformed batch.
  """
  try:
    leaf = _string_leaf(leaf)
  except ValueError as e:
    raise ValueError(f"feature {name!r}: {e}") from None
  # Read as "raw ids": any integer values (no per-row checks of ranges).
  ids = ragged_input.to_ragged(name, leaf, "raw ids")
  values = np.asarray(ids.values)
  if values.size and values.dtype.kind not in "iu":
    raise ValueError(
      f"feature {name!r}: ids of a hashed table must be integers or "
      f"strings / bytes, got dtype {values.dtype}"
    )
  if values.dtype == np.uint64:
    values = values.view(np.int64)
  return ragged_input.Ragged(values.astype(np.int64, copy=False), ids.splits)


def prepare(
  plan: plan_lib.Plan,
  leaves: dict[str, tuple[Any, Any]],
  local_device_count: int,
) -> tuple[dict[str, tuple[Any, Any]], dict[str, np.ndarray] | None]:
  """Replaces the hashed features' ids by their places.

  Args:
    plan: The plan.
    leaves: Feature name -> (ids, weights or None), as `fill` takes them.
    local_device_count: Devices of this process.

  Returns:
    The leaves with each hashed feature's ids as `(places, row_splits)`
    (weights as `(values, row_splits)`), and per hashed stack its
    `hashed_ids`, int32 `[L * H_dev]` (None without hashed stacks).

  Raises:
    ValueError: Naming the feature, on a malformed batch, or if one
      SparseCore sends one shard more distinct ids than the shard's rows.
  """
  stacks = [s for s in plan.stacks if s.is_hashed]
  if not stacks:
    return leaves, None
  leaves = dict(leaves)
  out = {}
  for stack in stacks:
    out[stack.name] = _prepare_stack(plan, stack, leaves, local_device_count)
  return leaves, out


def _prepare_stack(plan, stack, leaves, local: int) -> np.ndarray:
  n, s = plan.num_shards, plan.num_sc_per_device
  capacity, cap = stack.rows_per_shard, plan_lib.hashed_places(plan, stack)
  features = list(stack.features)
  members = {t.name: i for i, t in enumerate(stack.tables)}
  id_leaves, weight_leaves = ragged_input.convert_formats(
    features,
    [leaves[f.name][0] for f in features],
    [leaves[f.name][1] for f in features],
  )
  values, splits, num_rows = read_raw_ids(features, id_leaves)
  for f, rows in zip(features, num_rows, strict=True):
    want = local * s * f.samples_per_sc
    if rows != want:
      raise ValueError(
        f"feature {f.name!r}: {rows} samples in this process's batch, its "
        f"{local} devices x {s} SparseCores take {want}"
      )
  first_row = np.concatenate([[0], np.cumsum(num_rows)])
  keys = blocks_lib.aligned_empty(
    (local * s, n, cap, hashed.KEY_WORDS), np.int32
  )
  keys[...] = 0
  keys[..., 2] = -1
  place = np.empty(len(values), np.int64)
  most = _hashed_numba.places(
    values,
    splits,
    first_row,
    np.array([f.samples_per_sc for f in features], np.int64),
    np.array([members[f.spec.table_spec.name] for f in features], np.int64),
    n,
    np.array([rows for _, rows in stack.regions(n)], np.int64),
    keys,
    place,
  )
  bounds = splits[first_row]
  _check_places(
    features,
    bounds,
    place,
    n,
    capacity,
    most,
    f"its {capacity} rows; raise the table's vocabulary_size (its capacity) "
    "or split the batch",
  )
  if plan.minibatches > 1:
    _check_places(
      features,
      bounds,
      place,
      n,
      cap,
      most,
      f"the {cap} that {plan.minibatches} minibatches hold; raise the "
      "stack's limits or split the batch",
    )
  for i, f in enumerate(features):
    a, b = first_row[i], first_row[i + 1]
    ids_of_f = place[bounds[i] : bounds[i + 1]]
    if _is_dense(id_leaves[i]):  # Stays dense (the fastest form to read).
      ids_of_f = ids_of_f.reshape(id_leaves[i].shape)
    else:
      ids_of_f = (ids_of_f, splits[a : b + 1] - bounds[i])
    weights = weight_leaves[i]
    if weights is not None:
      weight = ragged_input.to_ragged(f.name, weights, "weights")
      weights = (weight.values, weight.splits)
    leaves[f.name] = (ids_of_f, weights)
  return keys.reshape(-1)


def read_raw_ids(features, id_leaves) -> tuple[np.ndarray, ...]:
  """The features' raw ids end to end, as `ragged_input.read_ids` returns
  them (int64 values; no range): the compiled reader where it can read
  every batch, else `raw_ids` feature by feature (strings; errors)."""
  reader = ragged_input.READER
  if reader is not None:
    result = reader.read_ids(
      list(id_leaves), np.full(len(id_leaves), -1, np.int64), True
    )
    if not isinstance(result, int):
      return result
  return ragged_input.join_rows(
    [raw_ids(f.name, leaf) for f, leaf in zip(features, id_leaves, strict=True)]
  )


def _is_dense(leaf: Any) -> bool:
  return (
    isinstance(leaf, np.ndarray) and leaf.ndim == 2 and leaf.dtype.kind in "iu"
  )


def _check_places(features, bounds, place, n: int, room: int, most: int, why):
  """Raises if some SparseCore sends a shard more distinct ids than `room`
  (`why` says what bounds it); `bounds`: each feature's first id, and the
  end."""
  if most <= room:
    return
  at = int(np.argmax(place // n >= room))
  f = int(np.searchsorted(bounds, at, side="right")) - 1
  raise ValueError(
    f"feature {features[f].name!r}: one SparseCore's batch sends shard "
    f"{int(place[at] % n)} more distinct ids than {why}"
  )
