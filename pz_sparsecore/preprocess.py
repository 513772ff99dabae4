"""Host-side input preprocessing: ragged id batches to CSR-wrapped COO buffers.

`preprocess_sparse_dense_matmul_input` turns a pytree of id batches (one per
`FeatureSpec`) into the per-device buffers the lookup kernels read, with the
layout and semantics of jax-tpu-embedding's preprocessor. Notation: `L` local
devices, `G` global devices, `S` SparseCores per device, `N = G * S` shards
(partitions), `r8(x)` = `x` rounded up to a multiple of 8.

Who processes which sample ("split-then-stack"). Every feature's local rows
are cut into `L` device blocks and each block into `S` SparseCore slices of
`n_f` rows. Inside one SparseCore the slices of all features of a stack are
concatenated in `row_offset` order: row `r` of feature `f`'s slice becomes
sample `row_offset_f / N + r`.

Who owns an id. Id `e` of a table with rotation `c` and `row_offset_in_shard`
`o` lives in partition `p = (e + c) % N` (the SparseCore that holds that
shard; its device is `p // S`) at local row `e // N + o`.

Buffers. Per stack, per local device, per local SparseCore `s`:

* `lhs_row_pointers`: `max(N, 8)` entries per SparseCore, `R_dev = max(N, 8)
  * S` per device. Entry `p` is the (unaligned) end of partition `p` inside
  the SparseCore's segment; partition `p` starts at `r8(rp[p - 1])` (0 for
  `p = 0`). Slots after the `N`-th repeat the final aligned offset.
* `lhs_embedding_ids` (local row), `lhs_sample_ids`, `lhs_gains`: `C_dev`
  entries per device, one segment of `C_dev / S` per SparseCore, holding the
  partitions in order, each sorted by (local row, sample), each starting at a
  multiple of 8. Duplicate (sample, id) pairs are merged and their gains
  added; a gain is the id's weight (default 1) over its sample's combiner
  divisor (sum: 1, mean: the sum of the weights, sqrtn: the root of the sum of
  their squares, all over the sample's raw ids, duplicates included). Every
  unused slot holds `PAD_ID` / `PAD_ID` / NaN.

`C_dev` is `r8(max_ids_per_partition) * S * N` (nothing can overflow), or
`suggested_coo_buffer_size_per_device` rounded up to a multiple of `8 * S`.

Example: `G = L = 2`, `S = 1` (so `N = 2`), one table of 16 ids, "sum",
limits 8, so `R_dev = 8` and `C_dev = 16`. Batch `[[3, 8, 3], [5, 0, 2],
[7, 7, 1], [4, 9, 6]]` with weights `[[1, 2, 3], [1] * 3, [.5, .5, 1],
[1] * 3]`. Device 0 holds samples 0 and 1. Partition 0 (even ids) gets rows
8 // 2 = 4 (sample 0), 0 and 2 // 2 = 1 (sample 1); partition 1 gets row 1
twice from sample 0 (merged, gain 1 + 3) and row 2 from sample 1::

  row_pointers   [3, 10, 16, 16, 16, 16, 16, 16]
  embedding_ids  [0, 1, 4, P, P, P, P, P,  1, 2, P, P, P, P, P, P]
  sample_ids     [1, 1, 0, P, P, P, P, P,  0, 1, P, P, P, P, P, P]
  gains          [1, 1, 2, n, n, n, n, n,  4, 1, n, n, n, n, n, n]

Limits and stats. For every source SparseCore and partition the preprocessor
counts the merged (sample, id) pairs and the distinct ids it sends, before
any dropping; the stats report their maximum over the device's SparseCores
(`[L * N]`) and the buffer each SparseCore needed (`sum_p r8(pairs_p)`,
`[L * S]`). If a count exceeds `max_ids_per_partition` or
`max_unique_ids_per_partition`, the call raises `ValueError`, unless
`allow_id_dropping=True`: then a partition keeps the pairs whose position
among its pairs is within `max_ids_per_partition` and whose id is among its
first `max_unique_ids_per_partition` distinct ids. A segment that fills up
(only possible with a small suggested size) stops there: the remaining pairs
are dropped and later row pointers equal the segment end. Dropped raw ids
are counted in `id_drop_counters`.

Unlike upstream, all input errors raise `ValueError` naming the feature and
the value, every output byte is defined, inputs are never modified, and ids
of any integer dtype are read correctly.

Implementation: the per-SparseCore work runs in one numba kernel
(`_preprocess_kernels.fill_buffers`), parallel over (stack, device,
SparseCore) work items: radix sort by physical row, then one walk that
merges, counts, drops and writes. Python only converts and validates the
inputs (vectorised), a chunk of stacks at a time, while the kernel (which
releases the GIL) processes the previous chunk.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import warnings
from typing import Any

import jax
import numpy as np

from pz_sparsecore import _preprocess_kernels as _kernels
from pz_sparsecore import layout
from pz_sparsecore import plan as plan_lib
from pz_sparsecore.specs import FeatureSpec, StackedTableSpec

PAD_ID = _kernels.PAD_ID
"""Padding value of `lhs_embedding_ids` and `lhs_sample_ids` (2**31 - 1)."""

ALIGNMENT = layout.ROW_ALIGNMENT
"""Every partition of a COO segment starts at a multiple of this."""

_INT32_MAX = np.iinfo(np.int32).max
_PIPELINE_CHUNKS = 8
# Serialises kernel launches: numba's fallback threading layer (workqueue)
# aborts on concurrent parallel regions, and the kernels are parallel anyway.
_KERNEL_LOCK = threading.Lock()
_COMBINER_CODES = {
  "sum": _kernels.COMBINER_SUM,
  "mean": _kernels.COMBINER_MEAN,
  "sqrtn": _kernels.COMBINER_SQRTN,
}


# ---------------------------------------------------------------------------
# Outputs.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreprocessedInput:
  """The CSR-wrapped COO buffers of one batch, per stack name.

  Shapes are `[L, R_dev]` / `[L, C_dev]` with `has_leading_dimension=True`,
  else flat `[L * R_dev]` / `[L * C_dev]`.

  Attributes:
    lhs_row_pointers: int32 partition ends, `max(N, 8)` per SparseCore.
    lhs_embedding_ids: int32 row of the id inside its owner's shard.
    lhs_sample_ids: int32 SparseCore-local sample of the id.
    lhs_gains: float32 weight of the entry.
  """

  lhs_row_pointers: dict[str, Any]
  lhs_embedding_ids: dict[str, Any]
  lhs_sample_ids: dict[str, Any]
  lhs_gains: dict[str, Any]

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_inputs(self, path, subtree_renderer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseDenseMatmulInputStats:
  """Per-stack statistics of one batch, measured before any dropping.

  Attributes:
    max_ids_per_partition: int32 `[L * N]`: for local device `d` and
      partition `p`, the most (sample, id) pairs one of the device's
      SparseCores sends to `p`.
    max_unique_ids_per_partition: int32 `[L * N]`: the same for distinct ids.
    required_buffer_size_per_sc: int32 `[L * S]`: COO entries each
      SparseCore needs, `sum_p r8(pairs_p)`.
    id_drop_counters: The number of raw ids dropped (limits or overflow).
  """

  max_ids_per_partition: dict[str, Any]
  max_unique_ids_per_partition: dict[str, Any]
  required_buffer_size_per_sc: dict[str, Any]
  id_drop_counters: dict[str, Any]

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_stats(self, path, subtree_renderer)


# ---------------------------------------------------------------------------
# Buffer sizes.


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def compute_row_pointers_size_per_device(
  global_device_count: int, num_sc_per_device: int
) -> int:
  """Row pointers per device: `max(N, 8) * num_sc_per_device`.

  Raises:
    ValueError: If `N = global_device_count * num_sc_per_device` is not a
      power of two.
  """
  n = layout.num_shards(global_device_count, num_sc_per_device)
  return max(n, ALIGNMENT) * num_sc_per_device


def compute_theoretical_max_coo_buffer_size(
  max_ids_per_partition: int, global_device_count: int, num_sc_per_device: int
) -> int:
  """The COO buffer per device that no batch can overflow.

  Returns:
    `r8(max_ids_per_partition) * S * N`.
  """
  n = layout.num_shards(global_device_count, num_sc_per_device)
  return _round_up(max_ids_per_partition, ALIGNMENT) * num_sc_per_device * n


def _coo_size(
  stacked: StackedTableSpec, global_device_count: int, num_sc_per_device: int
) -> int:
  c_max = compute_theoretical_max_coo_buffer_size(
    stacked.max_ids_per_partition, global_device_count, num_sc_per_device
  )
  suggested = stacked.suggested_coo_buffer_size_per_device
  if suggested is None:
    return c_max
  size = _round_up(suggested, ALIGNMENT * num_sc_per_device)
  if size > c_max:
    raise ValueError(
      f"stack {stacked.stack_name!r}: suggested_coo_buffer_size_per_device="
      f"{suggested} (rounded to {size}) exceeds the theoretical maximum "
      f"{c_max} = r8(max_ids_per_partition={stacked.max_ids_per_partition})"
      f" x {num_sc_per_device} SparseCores x "
      f"{global_device_count * num_sc_per_device} partitions"
    )
  return size


def compute_coo_buffer_size_per_device(
  feature_specs: Any, global_device_count: int, num_sc_per_device: int
) -> dict[str, int]:
  """The COO buffer length per device of every stack.

  Args:
    feature_specs: A pytree of prepared `FeatureSpec`s.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: (Virtual) SparseCores per device.

  Returns:
    Stack name -> `C_dev`.

  Raises:
    ValueError: If the specs are not prepared or a suggested size exceeds
      the theoretical maximum.
  """
  stacks = _group_by_stack(_flatten_specs(feature_specs)[0])
  return {
    name: _coo_size(
      group[0].table_spec.stacked_table_spec,
      global_device_count,
      num_sc_per_device,
    )
    for name, group in stacks.items()
  }


def eval_preprocess_sparse_dense_matmul_input_shape(
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  *,
  num_sc_per_device: int,
  has_leading_dimension: bool = False,
) -> PreprocessedInput:
  """The shapes and dtypes `preprocess_sparse_dense_matmul_input` returns.

  Args:
    feature_specs: A pytree of prepared `FeatureSpec`s.
    local_device_count: Devices of this process.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: (Virtual) SparseCores per device.
    has_leading_dimension: Whether the buffers get a leading device axis.

  Returns:
    A `PreprocessedInput` of `jax.ShapeDtypeStruct`s.
  """
  _check_topology(local_device_count, global_device_count, num_sc_per_device)
  rp_size = compute_row_pointers_size_per_device(
    global_device_count, num_sc_per_device
  )
  coo_sizes = compute_coo_buffer_size_per_device(
    feature_specs, global_device_count, num_sc_per_device
  )
  num_local = local_device_count

  def shape(size: int) -> tuple[int, ...]:
    return (num_local, size) if has_leading_dimension else (num_local * size,)

  def struct(size: int, dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape(size), dtype)

  return PreprocessedInput(
    lhs_row_pointers={k: struct(rp_size, np.int32) for k in coo_sizes},
    lhs_embedding_ids={k: struct(c, np.int32) for k, c in coo_sizes.items()},
    lhs_sample_ids={k: struct(c, np.int32) for k, c in coo_sizes.items()},
    lhs_gains={k: struct(c, np.float32) for k, c in coo_sizes.items()},
  )


# ---------------------------------------------------------------------------
# Validation and conversion of the inputs.


def _check_topology(
  local_device_count: int, global_device_count: int, num_sc_per_device: int
) -> int:
  n = layout.num_shards(global_device_count, num_sc_per_device)
  if (
    isinstance(local_device_count, bool)
    or not isinstance(local_device_count, (int, np.integer))
    or not 0 < local_device_count <= global_device_count
  ):
    raise ValueError(
      f"local_device_count must be an integer in [1, global_device_count="
      f"{global_device_count}], got {local_device_count!r}"
    )
  return n


def _is_feature_spec(x: Any) -> bool:
  return isinstance(x, FeatureSpec)


def _flatten_specs(feature_specs: Any) -> tuple[list[FeatureSpec], Any]:
  leaves, treedef = jax.tree.flatten(feature_specs, is_leaf=_is_feature_spec)
  if not leaves:
    raise ValueError("feature_specs holds no FeatureSpec")
  names = set()
  for leaf in leaves:
    if not isinstance(leaf, FeatureSpec):
      raise ValueError(
        f"feature_specs must hold FeatureSpec leaves, got {type(leaf).__name__}"
      )
    if leaf.name in names:
      raise ValueError(f"feature name {leaf.name!r} is used twice")
    names.add(leaf.name)
    table = leaf.table_spec
    if table.stacked_table_spec is None or leaf.id_transformation is None:
      raise ValueError(
        f"feature {leaf.name!r}: its specs are not prepared (table "
        f"{table.name!r} has no stacked_table_spec); call "
        "layout.prepare_feature_specs_for_training first"
      )
  return leaves, treedef


def _group_by_stack(specs: list[FeatureSpec]) -> dict[str, list[FeatureSpec]]:
  """Features by stack name (first-appearance order), by `row_offset`."""
  stacks: dict[str, list[FeatureSpec]] = {}
  for spec in specs:
    name = spec.table_spec.setting_in_stack.stack_name
    stacks.setdefault(name, []).append(spec)
  return {
    name: sorted(group, key=lambda f: f.id_transformation.row_offset)
    for name, group in stacks.items()
  }


def _leaves_like(treedef: Any, tree: Any, what: str) -> list[Any]:
  """The subtrees of `tree` at the leaf positions of `treedef`."""
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"{what} must have the same tree structure as feature_specs "
      f"({treedef}): {e}"
    ) from e


@dataclasses.dataclass
class _Ragged:
  """One feature's batch as flat values and row splits (int64 `[B + 1]`)."""

  values: np.ndarray
  splits: np.ndarray

  @property
  def num_rows(self) -> int:
    return len(self.splits) - 1


def _describe(leaf: Any) -> str:
  if isinstance(leaf, np.ndarray):
    return f"array of shape {leaf.shape} and dtype {leaf.dtype}"
  return type(leaf).__name__


def _concat_rows(name: str, rows: Any, what: str) -> _Ragged:
  """Concatenates ragged rows (an object array or a list of 1-D arrays)."""
  try:
    lengths = np.fromiter(map(len, rows), np.int64, count=len(rows))
  except TypeError as e:
    raise ValueError(
      f"feature {name!r}: every row of ragged {what} must be a 1-D array: {e}"
    ) from e
  splits = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=splits[1:])
  if len(lengths) == 0:
    return _Ragged(np.zeros(0, np.int32), splits)
  try:
    values = np.concatenate(rows)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"feature {name!r}: every row of ragged {what} must be a 1-D array: {e}"
    ) from e
  if values.ndim != 1 or len(values) != splits[-1]:
    raise ValueError(f"feature {name!r}: rows of ragged {what} must be 1-D")
  if values.dtype.kind not in "iu" and what == "ids":
    # Empty rows made with np.array([]) are float64; ignore their dtype.
    nonempty = [r for r in rows if len(r)]
    values = np.concatenate(nonempty) if nonempty else np.zeros(0, np.int32)
    if values.dtype.kind not in "iu":
      for i, row in enumerate(rows):
        row = np.asarray(row)
        if row.size and row.dtype.kind not in "iu":
          raise ValueError(
            f"feature {name!r}: ids must be integers, got dtype {row.dtype} "
            f"at sample {i}"
          )
  return _Ragged(values, splits)


def _to_ragged(name: str, leaf: Any, what: str) -> _Ragged:
  """Converts one feature (or weight) leaf to values and row splits."""
  if isinstance(leaf, tuple):
    if len(leaf) != 2:
      raise ValueError(
        f"feature {name!r}: a tuple of {what} must be (values, row_splits), "
        f"got {len(leaf)} items"
      )
    values = np.asarray(leaf[0])
    splits = np.asarray(leaf[1])
    if values.ndim != 1:
      raise ValueError(
        f"feature {name!r}: the values of (values, row_splits) {what} must "
        f"be 1-D, got shape {values.shape}"
      )
    if splits.ndim != 1 or len(splits) < 1 or splits.dtype.kind not in "iu":
      raise ValueError(
        f"feature {name!r}: row_splits of {what} must be a 1-D integer array "
        f"starting at 0, got {_describe(splits)}"
      )
    splits = splits.astype(np.int64)
    if (
      splits[0] != 0
      or splits[-1] != len(values)
      or np.any(splits[1:] < splits[:-1])
    ):
      raise ValueError(
        f"feature {name!r}: row_splits of {what} must rise from 0 to "
        f"len(values)={len(values)}, got {splits[0]} .. {splits[-1]}"
      )
    return _Ragged(values, splits)
  if isinstance(leaf, list):
    return _concat_rows(name, leaf, what)
  if isinstance(leaf, np.ndarray) and leaf.dtype == object:
    if leaf.ndim != 1:
      raise ValueError(
        f"feature {name!r}: a ragged object array of {what} must be 1-D, got "
        f"shape {leaf.shape}"
      )
    return _concat_rows(name, leaf, what)
  try:
    array = np.asarray(leaf)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"feature {name!r}: cannot read {what} from {_describe(leaf)}: {e}"
    ) from e
  if array.ndim != 2:
    raise ValueError(
      f"feature {name!r}: dense {what} must be 2-D [batch, k], got shape "
      f"{array.shape} (use x[:, None] for one id per sample, or a ragged "
      "format)"
    )
  batch, k = array.shape
  return _Ragged(array.reshape(-1), np.arange(batch + 1, dtype=np.int64) * k)


def _sample_of(splits: np.ndarray, index: int) -> int:
  return int(np.searchsorted(splits, index, side="right")) - 1


def _check_ids(name: str, ids: _Ragged, vocab: int) -> None:
  values = ids.values
  if values.dtype.kind not in "iu":
    raise ValueError(
      f"feature {name!r}: ids must be integers, got dtype {values.dtype}"
    )
  if not values.size:
    return
  if values.min() >= 0 and values.max() < vocab:
    return
  bad = int(np.flatnonzero((values < 0) | (values >= vocab))[0])
  raise ValueError(
    f"feature {name!r}: id {values[bad]} outside [0, {vocab}) at sample "
    f"{_sample_of(ids.splits, bad)}"
  )


def _check_weights(name: str, weights: _Ragged, ids: _Ragged) -> np.ndarray:
  """Float32 weights aligned with `ids`, validated."""
  if weights.values.dtype.kind not in "iuf":
    raise ValueError(
      f"feature {name!r}: weights must be real numbers, got dtype "
      f"{weights.values.dtype}"
    )
  if weights.num_rows != ids.num_rows:
    raise ValueError(
      f"feature {name!r}: {weights.num_rows} rows of weights for "
      f"{ids.num_rows} rows of ids"
    )
  if not np.array_equal(weights.splits, ids.splits):
    row = int(np.flatnonzero(weights.splits != ids.splits)[0]) - 1
    lengths = np.diff(ids.splits), np.diff(weights.splits)
    raise ValueError(
      f"feature {name!r}: sample {row} has {lengths[0][row]} ids but "
      f"{lengths[1][row]} weights"
    )
  with np.errstate(over="ignore", invalid="ignore"):
    values = weights.values.astype(np.float32)
  if values.size and not np.isfinite(values).all():
    bad = int(np.flatnonzero(~np.isfinite(values))[0])
    raise ValueError(
      f"feature {name!r}: weight {weights.values[bad]} is not finite (as "
      f"float32) at sample {_sample_of(ids.splits, bad)}"
    )
  return values


def _gather_ids(
  specs: list[FeatureSpec], leaves: list[Any]
) -> tuple[np.ndarray, list[_Ragged]]:
  """All features' ids in one flat int32/int64 array, range checked.

  Returns the flat ids and, per feature, a `_Ragged` whose `values` is its
  slice of them. The fast path concatenates every row of every feature at
  once; anything unusual (float or mixed dtypes, malformed rows) goes
  through the per-feature conversion, which names the offending feature.
  """
  pieces: list[Any] = []
  splits: list[np.ndarray] | None = []
  for spec, leaf in zip(specs, leaves, strict=True):
    if isinstance(leaf, list) or (
      isinstance(leaf, np.ndarray) and leaf.dtype == object and leaf.ndim == 1
    ):
      try:
        lengths = np.fromiter(map(len, leaf), np.int64, count=len(leaf))
      except TypeError:
        splits = None
        break
      split = np.zeros(len(lengths) + 1, np.int64)
      np.cumsum(lengths, out=split[1:])
      pieces.extend(leaf)
    else:
      ids = _to_ragged(spec.name, leaf, "ids")
      split = ids.splits
      pieces.append(ids.values)
    splits.append(split)
  values = None
  if splits is not None and pieces:
    try:
      values = np.concatenate(pieces)
    except (ValueError, TypeError):
      values = None
  if (
    values is None
    or values.ndim != 1
    or values.dtype.kind not in "iu"
    or len(values) != sum(int(s[-1]) for s in splits)
  ):
    # Slow path: convert feature by feature (raises naming the feature).
    ragged = [
      _to_ragged(s.name, x, "ids") for s, x in zip(specs, leaves, strict=True)
    ]
    for spec, ids in zip(specs, ragged, strict=True):
      _check_ids(spec.name, ids, spec.table_spec.vocabulary_size)
    parts = [r.values.astype(np.int64, copy=False) for r in ragged]
    values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    splits = [r.splits for r in ragged]
  ragged = []
  start = 0
  for split in splits:
    end = start + int(split[-1])
    ragged.append(_Ragged(values[start:end], split))
    start = end
  for spec, ids in zip(specs, ragged, strict=True):
    _check_ids(spec.name, ids, spec.table_spec.vocabulary_size)
  if values.dtype not in (np.int32, np.int64):
    values = values.astype(np.int64)
  return values, ragged


# ---------------------------------------------------------------------------
# The preprocessor.


def preprocess_sparse_dense_matmul_input(
  features: Any,
  features_weights: Any,
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  *,
  num_sc_per_device: int,
  sharding_strategy: str = "MOD",
  has_leading_dimension: bool = False,
  allow_id_dropping: bool = False,
  batch_number: int = 0,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Builds the lookup buffers and stats of one process-local batch.

  Args:
    features: A pytree like `feature_specs` whose leaves are id batches:
      dense `[batch, k]` integer arrays, 1-D object arrays or lists of 1-D
      integer arrays (one per sample, possibly empty), or
      `(values, row_splits)` tuples. Any integer dtype.
    features_weights: None, or a pytree like `features` with float weights
      of the same shape (or None leaves for unweighted features).
    feature_specs: A pytree of `FeatureSpec`s prepared with
      `layout.prepare_feature_specs_for_training`.
    local_device_count: Devices of this process (`L`); the batch is this
      process's share of the global batch.
    global_device_count: Devices the tables are sharded over (`G`).
    num_sc_per_device: (Virtual) SparseCores per device (`S`); `G * S` must
      be a power of two.
    sharding_strategy: Only "MOD".
    has_leading_dimension: Give the buffers a leading device axis `[L, ...]`
      instead of flattening them.
    allow_id_dropping: Drop ids over the limits instead of raising.
    batch_number: The batch's index (unused; kept for compatibility).

  Returns:
    The `PreprocessedInput` buffers and the `SparseDenseMatmulInputStats`,
    each a dict per stack name.

  Raises:
    ValueError: On malformed or out-of-range inputs, mismatched trees, specs
      that are not prepared, a batch that does not split over the devices
      and SparseCores, or (without `allow_id_dropping`) limits exceeded.
  """
  del batch_number
  if sharding_strategy != "MOD":
    raise ValueError(
      f"sharding_strategy must be 'MOD', got {sharding_strategy!r}"
    )
  _check_topology(local_device_count, global_device_count, num_sc_per_device)
  return preprocess_for_plan(
    plan_lib.build(feature_specs, global_device_count, num_sc_per_device),
    features,
    features_weights,
    local_device_count,
    has_leading_dimension=has_leading_dimension,
    allow_id_dropping=allow_id_dropping,
  )


def preprocess_for_plan(
  plan: plan_lib.Plan,
  features: Any,
  features_weights: Any,
  local_device_count: int,
  *,
  has_leading_dimension: bool = False,
  allow_id_dropping: bool = False,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """`preprocess_sparse_dense_matmul_input` for an already built plan.

  Args:
    plan: The plan of the feature specs (`plan.build`).
    features: Id batches structured like the plan's feature specs.
    features_weights: None, or matching weights.
    local_device_count: Devices of this process.
    has_leading_dimension: Give the buffers a leading device axis.
    allow_id_dropping: Drop ids over the limits instead of raising.

  Returns:
    The buffers and stats, as `preprocess_sparse_dense_matmul_input`.
  """
  global_device_count = plan.num_devices
  num_sc_per_device = plan.num_sc_per_device
  _check_topology(local_device_count, global_device_count, num_sc_per_device)
  num_local, num_sc = int(local_device_count), int(num_sc_per_device)
  specs, treedef = list(plan.feature_specs), plan.treedef
  feature_leaves = _leaves_like(treedef, features, "features")
  if features_weights is None:
    weight_leaves = [None] * len(specs)
  else:
    weight_leaves = _leaves_like(treedef, features_weights, "features_weights")
  leaf_of = {spec.name: i for i, spec in enumerate(specs)}
  groups = list(_group_by_stack(specs).values())
  plan = _Plan.build(
    groups, num_local, global_device_count, num_sc, bool(allow_id_dropping)
  )
  out = plan.allocate()

  # Convert, validate and launch the kernel chunk by chunk of stacks: the
  # kernel (which releases the GIL) runs on one chunk while Python converts
  # the next.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    launched = []
    try:
      for t0, t1 in _chunks(len(groups)):
        chunk = [f for group in groups[t0:t1] for f in group]
        leaves = [feature_leaves[leaf_of[f.name]] for f in chunk]
        weights = [weight_leaves[leaf_of[f.name]] for f in chunk]
        args = plan.kernel_args(t0, t1, chunk, leaves, weights, out)
        launched.append(pool.submit(_run_kernel, args))
    finally:
      concurrent.futures.wait(launched)
    for future in launched:
      future.result()
  return plan.results(out, has_leading_dimension)


def _run_kernel(args: tuple[Any, ...]) -> None:
  with _KERNEL_LOCK:
    _kernels.fill_buffers(*args)


def _chunks(num_stacks: int) -> list[tuple[int, int]]:
  """Stack ranges converted (and processed) together."""
  size = max(1, -(-num_stacks // _PIPELINE_CHUNKS))
  return [(t, min(t + size, num_stacks)) for t in range(0, num_stacks, size)]


@dataclasses.dataclass
class _Plan:
  """Per-stack sizes and limits, and the kernel's view of each chunk."""

  groups: list[list[FeatureSpec]]
  num_local: int
  num_sc: int
  num_shards: int
  global_device_count: int
  coo_sizes: dict[str, int]
  combiner: np.ndarray
  max_ids: np.ndarray
  max_unique: np.ndarray
  shard_rows: np.ndarray
  key_bits: np.ndarray
  coo_offset: np.ndarray
  rp_offset: np.ndarray
  allow_id_dropping: bool

  @classmethod
  def build(
    cls,
    groups: list[list[FeatureSpec]],
    num_local: int,
    global_device_count: int,
    num_sc: int,
    allow_id_dropping: bool,
  ) -> _Plan:
    n = global_device_count * num_sc
    stacked = [g[0].table_spec.stacked_table_spec for g in groups]
    for group, spec in zip(groups, stacked, strict=True):
      _check_stack(group, spec, n, global_device_count, num_sc)
    coo_sizes = {
      s.stack_name: _coo_size(s, global_device_count, num_sc) for s in stacked
    }
    coo_dev = np.array(list(coo_sizes.values()), np.int64)
    coo_offset = np.zeros(len(groups) + 1, np.int64)
    np.cumsum(coo_dev * num_local, out=coo_offset[1:])
    rp_dev = max(n, ALIGNMENT) * num_sc
    return cls(
      groups=groups,
      num_local=num_local,
      num_sc=num_sc,
      num_shards=n,
      global_device_count=global_device_count,
      coo_sizes=coo_sizes,
      combiner=np.array([_COMBINER_CODES[s.combiner] for s in stacked]),
      max_ids=np.array([s.max_ids_per_partition for s in stacked]),
      max_unique=np.array([s.max_unique_ids_per_partition for s in stacked]),
      shard_rows=np.array([s.stack_vocab_size // n for s in stacked]),
      key_bits=np.array(
        [int(s.stack_vocab_size - 1).bit_length() for s in stacked]
      ),
      coo_offset=coo_offset,
      rp_offset=np.arange(len(groups) + 1) * (rp_dev * num_local),
      allow_id_dropping=allow_id_dropping,
    )

  @property
  def items_per_stack(self) -> int:
    return self.num_local * self.num_sc

  def allocate(self) -> dict[str, np.ndarray]:
    """Every output array; each stack's buffers are slices of these."""
    items = len(self.groups) * self.items_per_stack
    coo = int(self.coo_offset[-1])
    return {
      "rp": np.empty(int(self.rp_offset[-1]), np.int32),
      "ids": np.empty(coo, np.int32),
      "sids": np.empty(coo, np.int32),
      "gains": np.empty(coo, np.float32),
      "obs_ids": np.empty((items, self.num_shards), np.int32),
      "obs_unique": np.empty((items, self.num_shards), np.int32),
      "required": np.empty(items, np.int32),
      "dropped": np.empty(items, np.int64),
      "overflowed": np.empty(items, np.int64),
    }

  def kernel_args(
    self,
    t0: int,
    t1: int,
    chunk: list[FeatureSpec],
    leaves: list[Any],
    weight_leaves: list[Any],
    out: dict[str, np.ndarray],
  ) -> tuple[Any, ...]:
    """Converts and validates stacks `[t0, t1)`; the kernel's arguments."""
    n, num_sc_local = self.num_shards, self.items_per_stack
    values, ragged = _gather_ids(chunk, leaves)
    weights = [
      None
      if leaf is None
      else _check_weights(
        spec.name, _to_ragged(spec.name, leaf, "weights"), ids
      )
      for spec, ids, leaf in zip(chunk, ragged, weight_leaves, strict=True)
    ]
    rows_per_sc = np.array(
      [
        _rows_per_sc(spec, ids.num_rows, self.num_local, self.num_sc, n)
        for spec, ids in zip(chunk, ragged, strict=True)
      ],
      np.int64,
    )
    weighted = np.array([w is not None for w in weights])
    flat_weights = np.empty(len(values) if weighted.any() else 0, np.float32)
    row_splits = np.empty(sum(r.num_rows for r in ragged) + 1, np.int64)
    row_base = np.zeros(len(chunk), np.int64)
    value_pos = row_pos = 0
    for i, r in enumerate(ragged):
      size = len(r.values)
      if weights[i] is not None:
        flat_weights[value_pos : value_pos + size] = weights[i]
      row_splits[row_pos : row_pos + r.num_rows] = r.splits[:-1] + value_pos
      row_base[i] = row_pos
      value_pos += size
      row_pos += r.num_rows
    row_splits[row_pos] = value_pos

    transforms = [f.id_transformation for f in chunk]
    groups = self.groups[t0:t1]
    feature_ptr = np.zeros(len(groups) + 1, np.int64)
    np.cumsum([len(g) for g in groups], out=feature_ptr[1:])
    item_size = np.zeros((len(groups), num_sc_local), np.int64)
    stack_weighted = np.zeros(len(groups), np.bool_)
    samples_per_sc = np.zeros(len(groups), np.int64)
    for t in range(len(groups)):
      for i in range(feature_ptr[t], feature_ptr[t + 1]):
        item_size[t] += np.diff(ragged[i].splits[:: rows_per_sc[i]])
        stack_weighted[t] |= weighted[i]
        samples_per_sc[t] += rows_per_sc[i]
    if item_size.max(initial=0) >= 2**31:
      raise ValueError("more than 2**31 ids on one SparseCore")
    items = slice(t0 * num_sc_local, t1 * num_sc_local)
    return (
      values,
      flat_weights,
      row_splits,
      row_base,
      rows_per_sc,
      np.array([t.row_offset // n for t in transforms], np.int64),
      np.array([t.col_offset // n for t in transforms], np.int64),
      np.array([t.col_shift % n for t in transforms], np.int64),
      weighted,
      feature_ptr,
      np.arange(len(chunk), dtype=np.int64),
      self.combiner[t0:t1],
      self.max_ids[t0:t1],
      self.max_unique[t0:t1],
      self.shard_rows[t0:t1],
      self.key_bits[t0:t1],
      np.array(list(self.coo_sizes.values())[t0:t1]) // self.num_sc,
      self.coo_offset[t0:t1],
      self.rp_offset[t0:t1],
      stack_weighted,
      samples_per_sc,
      item_size.reshape(-1),
      self.num_local,
      self.num_sc,
      n,
      n.bit_length() - 1,
      max(n, ALIGNMENT),
      self.allow_id_dropping,
      out["rp"],
      out["ids"],
      out["sids"],
      out["gains"],
      out["obs_ids"][items],
      out["obs_unique"][items],
      out["required"][items],
      out["dropped"][items],
      out["overflowed"][items],
    )

  def results(
    self,
    out: dict[str, np.ndarray],
    has_leading_dimension: bool,
  ) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Checks the limits and wraps the outputs per stack."""
    num_stacks, n = len(self.groups), self.num_shards
    shape = (num_stacks, self.num_local, self.num_sc, n)
    obs_ids = out["obs_ids"].reshape(shape)
    obs_unique = out["obs_unique"].reshape(shape)
    required = out["required"].reshape(num_stacks, -1)
    dropped = out["dropped"].reshape(num_stacks, -1).sum(axis=1)
    overflowed = out["overflowed"].reshape(num_stacks, -1).sum(axis=1)
    names = list(self.coo_sizes)
    for t, name in enumerate(names):
      _check_limits(
        name,
        self.groups[t],
        obs_ids[t],
        obs_unique[t],
        int(self.max_ids[t]),
        int(self.max_unique[t]),
        self.allow_id_dropping,
      )
      if overflowed[t]:
        warnings.warn(
          f"stack {name!r}: the COO buffer of {self.coo_sizes[name]} entries "
          f"per device overflowed; {int(overflowed[t])} ids were dropped "
          f"(the batch needs {int(required[t].max()) * self.num_sc}; raise "
          "suggested_coo_buffer_size_per_device)",
          stacklevel=3,
        )

    def per_stack(key: str, offsets: np.ndarray) -> dict[str, np.ndarray]:
      flat = out[key]
      blocks = {}
      for t, name in enumerate(names):
        block = flat[offsets[t] : offsets[t + 1]]
        if has_leading_dimension:
          block = block.reshape(self.num_local, -1)
        blocks[name] = block
      return blocks

    buffers = PreprocessedInput(
      lhs_row_pointers=per_stack("rp", self.rp_offset),
      lhs_embedding_ids=per_stack("ids", self.coo_offset),
      lhs_sample_ids=per_stack("sids", self.coo_offset),
      lhs_gains=per_stack("gains", self.coo_offset),
    )
    stats = SparseDenseMatmulInputStats(
      max_ids_per_partition={
        name: obs_ids[t].max(axis=1).reshape(-1) for t, name in enumerate(names)
      },
      max_unique_ids_per_partition={
        name: obs_unique[t].max(axis=1).reshape(-1)
        for t, name in enumerate(names)
      },
      required_buffer_size_per_sc={
        name: required[t].copy() for t, name in enumerate(names)
      },
      id_drop_counters={name: int(dropped[t]) for t, name in enumerate(names)},
    )
    return buffers, stats


def _check_stack(
  group: list[FeatureSpec],
  stacked: StackedTableSpec,
  n: int,
  global_device_count: int,
  num_sc: int,
) -> None:
  """Checks that a stack was prepared for `n` shards and is self-consistent."""
  name = stacked.stack_name
  if stacked.stack_vocab_size % n:
    raise ValueError(
      f"stack {name!r}: stack_vocab_size {stacked.stack_vocab_size} does not"
      f" split over {n} shards; were the specs prepared for "
      f"{global_device_count} devices x {num_sc} SparseCores?"
    )
  if stacked.stack_vocab_size // n > _INT32_MAX:
    raise ValueError(f"stack {name!r}: too many rows per shard")
  for spec in group:
    padded = spec.table_spec.setting_in_stack.padded_vocab_size
    if padded % (ALIGNMENT * n):
      raise ValueError(
        f"feature {spec.name!r}: table {spec.table_spec.name!r} was prepared "
        f"for another topology: its padded vocabulary {padded} does not "
        f"split over {n} shards (of a multiple of {ALIGNMENT} rows)"
      )
  samples = sum(f.sample_count for f in group)
  if stacked.total_sample_count != samples:
    raise ValueError(
      f"stack {name!r}: total_sample_count {stacked.total_sample_count} is "
      f"not the sum {samples} of its features' sample counts"
    )


def _rows_per_sc(
  spec: FeatureSpec, batch: int, num_local: int, num_sc: int, n: int
) -> int:
  """Rows of `spec`'s local batch per SparseCore, validated."""
  if batch == 0:
    raise ValueError(f"feature {spec.name!r}: empty batch")
  if batch % (num_local * num_sc):
    raise ValueError(
      f"feature {spec.name!r}: batch of {batch} rows does not divide over"
      f" {num_local} local devices x {num_sc} SparseCores"
    )
  rows = batch // (num_local * num_sc)
  if rows * n != spec.sample_count:
    raise ValueError(
      f"feature {spec.name!r}: {batch} local rows give {rows} samples per "
      f"SparseCore, i.e. {rows * n} global samples, but its spec has "
      f"output_shape {spec.output_shape} ({spec.sample_count} samples)"
    )
  return rows


def _check_limits(
  name: str,
  group: list[FeatureSpec],
  obs_ids: np.ndarray,
  obs_unique: np.ndarray,
  max_ids: int,
  max_unique: int,
  allow_id_dropping: bool,
) -> None:
  """Raises (or warns, when dropping) if a stack's counts exceed its limits.

  `obs_ids` and `obs_unique` are `[L, S, N]` counts per source SparseCore
  and partition.
  """
  for counts, limit, field in (
    (obs_ids, max_ids, "max_ids_per_partition"),
    (obs_unique, max_unique, "max_unique_ids_per_partition"),
  ):
    if counts.max(initial=0) <= limit:
      continue
    d, s, p = np.unravel_index(int(np.argmax(counts)), counts.shape)
    message = (
      f"stack {name!r} (features {[f.name for f in group]}): local device "
      f"{d}, SparseCore {s} sends {int(counts[d, s, p])} "
      f"{'ids' if counts is obs_ids else 'unique ids'} to partition {p}, over"
      f" {field}={limit}"
    )
    if not allow_id_dropping:
      raise ValueError(
        message + "; raise the limit (e.g. from FDO stats with "
        "update_preprocessing_parameters) or pass allow_id_dropping=True"
      )
    warnings.warn(message + "; ids were dropped", stacklevel=3)


__all__ = [
  "ALIGNMENT",
  "PAD_ID",
  "PreprocessedInput",
  "SparseDenseMatmulInputStats",
  "compute_coo_buffer_size_per_device",
  "compute_row_pointers_size_per_device",
  "compute_theoretical_max_coo_buffer_size",
  "eval_preprocess_sparse_dense_matmul_input_shape",
  "preprocess_sparse_dense_matmul_input",
]
