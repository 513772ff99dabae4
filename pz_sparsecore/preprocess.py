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

Buffers. Per stack, per local device, per local SparseCore, in the format
of `buffer_format` (8-aligned partitions, row pointers holding their
unaligned ends, padding `PAD_ID` / `PAD_ID` / NaN): `lhs_row_pointers`
(`R_dev = max(N, 8) * S` per device) and `lhs_embedding_ids` (local row),
`lhs_sample_ids`, `lhs_gains` (`C_dev` per device). Each partition is sorted
by (local row, sample). Duplicate (sample, id) pairs are merged and their
gains added; a gain is the id's weight (default 1) over its sample's
combiner divisor (sum: 1, mean: the sum of the weights, sqrtn: the root of
the sum of their squares, all over the sample's raw ids, duplicates
included). `C_dev` is `r8(max_ids_per_partition) * S * N` (nothing can
overflow), or `suggested_coo_buffer_size_per_device` rounded up to a
multiple of `8 * S`.

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

Implementation: `ragged_input` reads and validates every feature's ids into
one flat array (its compiled reader walks object arrays and lists with no
Python-level loop: a few milliseconds for millions of ids);
`_fill_numba.fill_buffers` then does the per-SparseCore work of every stack
in one numba kernel launch, parallel over (stack, device, SparseCore) work
items: radix sort by physical row, then one walk that merges, counts, drops
and writes. The sizes and offsets come from the `plan.Plan`.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pz_sparsecore import _fill_numba, buffer_format, ragged_input
from pz_sparsecore import plan as plan_lib
from pz_sparsecore.buffer_format import (
  PAD_ID,
  compute_row_pointers_size_per_device,
  compute_theoretical_max_coo_buffer_size,
)

# Serialises kernel launches: numba's fallback threading layer (workqueue)
# aborts on concurrent parallel regions, and the kernels are parallel anyway.
_KERNEL_LOCK = threading.Lock()
_COMBINER_CODES = {
  "sum": _fill_numba.COMBINER_SUM,
  "mean": _fill_numba.COMBINER_MEAN,
  "sqrtn": _fill_numba.COMBINER_SQRTN,
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
    num_minibatches: None, or for minibatched buffers (`minibatching`)
      int32 `[L]` (`[L, 1]` with a leading dimension): every device's
      number of minibatches, the same on all.
  """

  lhs_row_pointers: dict[str, Any]
  lhs_embedding_ids: dict[str, Any]
  lhs_sample_ids: dict[str, Any]
  lhs_gains: dict[str, Any]
  num_minibatches: Any = None

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

  max_ids_per_partition: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )
  max_unique_ids_per_partition: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )
  required_buffer_size_per_sc: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )
  id_drop_counters: dict[str, Any] = dataclasses.field(default_factory=dict)

  def get_required_buffer_size_per_device(
    self, stack_name: str, num_sc_per_device: int | None = None
  ) -> int | None:
    """COO entries one device needs for `stack_name`, or None if unknown.

    The largest per-SparseCore need times the SparseCores per device
    (`num_sc_per_device`, by default the number of recorded values).
    """
    if stack_name not in self.required_buffer_size_per_sc:
      return None
    values = np.asarray(self.required_buffer_size_per_sc[stack_name])
    num_sc = num_sc_per_device or values.size
    return int(np.max(values) * num_sc) if values.size else None

  def set_required_buffer_size_per_device(
    self,
    stack_name: str,
    required_buffer_size_per_device: int,
    num_sc_per_device: int | None = None,
  ) -> None:
    """Records `required_buffer_size_per_device` for `stack_name`.

    Stored per SparseCore (the size divided evenly over `num_sc_per_device`
    values, by default as many as already recorded for the stack).

    Raises:
      ValueError: If the stack has no recorded value and `num_sc_per_device`
        is not given.
    """
    current = self.required_buffer_size_per_sc.get(stack_name)
    num_sc = num_sc_per_device or (0 if current is None else np.size(current))
    if not num_sc:
      raise ValueError(
        "num_sc_per_device must be provided if the table is not present "
        f"(stack {stack_name!r} has no required_buffer_size_per_sc yet)."
      )
    self.required_buffer_size_per_sc[stack_name] = np.full(
      num_sc, required_buffer_size_per_device / num_sc
    )

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_stats(self, path, subtree_renderer)


# ---------------------------------------------------------------------------
# Buffer sizes.


def compute_coo_buffer_size_per_device(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int,
  minibatches: int = 1,
) -> dict[str, int]:
  """The COO buffer length per device of every stack.

  Args:
    feature_specs: A pytree of prepared `FeatureSpec`s.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: (Virtual) SparseCores per device.
    minibatches: 64 (`buffer_format.MAX_MINIBATCHES`) for minibatched
      buffers, else 1.

  Returns:
    Stack name -> `C_dev`.

  Raises:
    ValueError: If the specs are not prepared or a suggested size exceeds
      the theoretical maximum.
  """
  plan = plan_lib.build(
    feature_specs,
    global_device_count,
    num_sc_per_device,
    for_tables=False,
    minibatches=minibatches,
  )
  return {stack.name: stack.coo_per_device for stack in plan.stacks}


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
  return input_shapes(
    plan_lib.build(
      feature_specs, global_device_count, num_sc_per_device, for_tables=False
    ),
    local_device_count,
    has_leading_dimension=has_leading_dimension,
  )


def input_shapes(
  plan: plan_lib.Plan,
  local_device_count: int,
  *,
  has_leading_dimension: bool = False,
) -> PreprocessedInput:
  """The shapes and dtypes `preprocess_for_plan` returns for `plan`.

  Args:
    plan: The plan of the feature specs.
    local_device_count: Devices of this process.
    has_leading_dimension: Whether the buffers get a leading device axis.

  Returns:
    A `PreprocessedInput` of `jax.ShapeDtypeStruct`s.
  """
  num_local = local_device_count

  def struct(per_device: int, dtype: Any) -> jax.ShapeDtypeStruct:
    shape = (
      (num_local, per_device)
      if has_leading_dimension
      else (num_local * per_device,)
    )
    return jax.ShapeDtypeStruct(shape, dtype)

  segments = plan.num_sc_per_device * plan.minibatches
  rp = {s.name: s.row_pointers_per_sc * segments for s in plan.stacks}
  coo = {s.name: s.coo_per_device for s in plan.stacks}
  return PreprocessedInput(
    lhs_row_pointers={k: struct(n, np.int32) for k, n in rp.items()},
    lhs_embedding_ids={k: struct(c, np.int32) for k, c in coo.items()},
    lhs_sample_ids={k: struct(c, np.int32) for k, c in coo.items()},
    lhs_gains={k: struct(c, np.float32) for k, c in coo.items()},
    num_minibatches=struct(1, np.int32) if plan.minibatches > 1 else None,
  )


def _check_topology(
  local_device_count: int, global_device_count: int, num_sc_per_device: int
) -> None:
  buffer_format.num_shards(global_device_count, num_sc_per_device)
  if (
    isinstance(local_device_count, bool)
    or not isinstance(local_device_count, (int, np.integer))
    or not 0 < local_device_count <= global_device_count
  ):
    raise ValueError(
      f"local_device_count must be an integer in [1, global_device_count="
      f"{global_device_count}], got {local_device_count!r}"
    )


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
  enable_minibatching: bool = False,
  all_reduce: Any = None,
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
    enable_minibatching: Lay the buffers out in minibatches
      (`minibatching`): a batch whose ids exceed the limits is split in
      minibatches that each keep them, instead of raising or dropping.
    all_reduce: With minibatching over several processes, how they agree
      on the split (`minibatching.AllReduce`); None uses JAX's collectives
      over all processes when there are several.

  Returns:
    The `PreprocessedInput` buffers and the `SparseDenseMatmulInputStats`,
    each a dict per stack name. With minibatching, the buffers have
    `num_minibatches` set.

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
    plan_lib.build(
      feature_specs,
      global_device_count,
      num_sc_per_device,
      for_tables=False,
      minibatches=buffer_format.MAX_MINIBATCHES if enable_minibatching else 1,
    ),
    features,
    features_weights,
    local_device_count,
    has_leading_dimension=has_leading_dimension,
    allow_id_dropping=allow_id_dropping,
    enable_minibatching=enable_minibatching,
    all_reduce=all_reduce,
  )


def preprocess_for_plan(
  plan: plan_lib.Plan,
  features: Any,
  features_weights: Any,
  local_device_count: int,
  *,
  has_leading_dimension: bool = False,
  allow_id_dropping: bool = False,
  enable_minibatching: bool = False,
  all_reduce: Any = None,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """`preprocess_sparse_dense_matmul_input` for an already built plan.

  Args:
    plan: The plan of the feature specs (`plan.build`).
    features: Id batches structured like the plan's feature specs.
    features_weights: None, or matching weights.
    local_device_count: Devices of this process.
    has_leading_dimension: Give the buffers a leading device axis.
    allow_id_dropping: Drop ids over the limits instead of raising.
    enable_minibatching: Minibatched buffers (`minibatching`).
    all_reduce: How processes agree on the minibatching split.

  Returns:
    The buffers and stats, as `preprocess_sparse_dense_matmul_input`.

  Raises:
    ValueError: As `preprocess_sparse_dense_matmul_input`.
  """
  _check_topology(local_device_count, plan.num_devices, plan.num_sc_per_device)
  names = [spec.name for spec in plan.feature_specs]
  ids = ragged_input.leaves_like(plan.treedef, features, "features")
  if features_weights is None:
    weights = [None] * len(names)
  else:
    weights = ragged_input.leaves_like(
      plan.treedef, features_weights, "features_weights"
    )
  leaves = dict(zip(names, zip(ids, weights, strict=True), strict=True))
  if enable_minibatching:
    from pz_sparsecore import minibatching

    return minibatching.preprocess(
      plan_lib.minibatched(plan),
      leaves,
      int(local_device_count),
      has_leading_dimension=has_leading_dimension,
      allow_id_dropping=bool(allow_id_dropping),
      all_reduce=all_reduce,
    )
  call = fill(plan, leaves, int(local_device_count), bool(allow_id_dropping))
  _check_call_limits(call)
  return _results(call, has_leading_dimension)


def fill(
  plan: plan_lib.Plan,
  leaves: dict[str, tuple[Any, Any]],
  num_local: int,
  allow_id_dropping: bool,
  *,
  unbounded: bool = False,
) -> _Call:
  """Runs the numba fill on validated inputs; returns the call's outputs.

  Args:
    plan: The plan.
    leaves: Feature name -> (ids, weights or None).
    num_local: Local devices.
    allow_id_dropping: Drop pairs over the limits.
    unbounded: Lift the limits and size every SparseCore segment for all
      its ids (nothing is dropped, nothing raises), and count the raw ids
      merged into each entry: the first pass of minibatching.
  """
  features = [f for stack in plan.stacks for f in stack.features]
  batch = ragged_input.read_batch(
    features,
    [leaves[f.name][0] for f in features],
    [leaves[f.name][1] for f in features],
  )
  items_per_stack = num_local * plan.num_sc_per_device
  rows_per_sc = np.array(
    [
      _rows_per_sc(f, int(rows), plan, items_per_stack)
      for f, rows in zip(features, batch.num_rows, strict=True)
    ],
    np.int64,
  )
  first_feature = ragged_input.splits_from_lengths(
    [len(s.features) for s in plan.stacks]
  )
  item_size = _item_sizes(batch, rows_per_sc, first_feature, items_per_stack)
  coo_per_sc = np.array([s.coo_per_sc for s in plan.stacks], np.int64)
  if unbounded:
    # Every partition of a segment wastes at most 7 entries to alignment.
    largest = item_size.reshape(len(plan.stacks), -1).max(axis=1)
    coo_per_sc = buffer_format.round_up(largest + 7 * plan.num_shards)
  call = _Call.allocate(
    plan, num_local, allow_id_dropping, coo_per_sc, unbounded
  )
  args = (
    _fill_numba.Batch(
      values=batch.values,
      weights=batch.weights,
      row_splits=batch.row_splits,
      item_size=item_size,
    ),
    _feature_arrays(features, batch, rows_per_sc),
    _stack_arrays(call, first_feature, batch.weighted, rows_per_sc),
    _scalars(call),
    call.out,
  )
  with _KERNEL_LOCK:
    _fill_numba.fill_buffers(*args)
  return call


# ---------------------------------------------------------------------------
# The kernel's arguments.


@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's plan and options, and every output array.

  Each stack's buffers are the slices `[offset[t], offset[t + 1])` of the
  flat output arrays; the per-item stats hold `T * L * S` rows.
  """

  plan: plan_lib.Plan
  num_local: int
  allow_id_dropping: bool
  coo_per_sc: np.ndarray
  unbounded: bool
  coo_offset: np.ndarray
  row_pointer_offset: np.ndarray
  out: _fill_numba.Outputs

  @classmethod
  def allocate(
    cls,
    plan: plan_lib.Plan,
    num_local: int,
    allow_id_dropping: bool,
    coo_per_sc: np.ndarray,
    unbounded: bool,
  ) -> _Call:
    coo_offset = ragged_input.splits_from_lengths(
      coo_per_sc * plan.num_sc_per_device * num_local
    )
    rp_dev = compute_row_pointers_size_per_device(
      plan.num_devices, plan.num_sc_per_device
    )
    rp_offset = np.arange(len(plan.stacks) + 1, dtype=np.int64) * (
      rp_dev * num_local
    )
    items = len(plan.stacks) * num_local * plan.num_sc_per_device
    coo = int(coo_offset[-1])
    out = _fill_numba.Outputs(
      row_pointers=np.empty(int(rp_offset[-1]), np.int32),
      embedding_ids=np.empty(coo, np.int32),
      sample_ids=np.empty(coo, np.int32),
      gains=np.empty(coo, np.float32),
      obs_ids=np.empty((items, plan.num_shards), np.int32),
      obs_unique=np.empty((items, plan.num_shards), np.int32),
      required=np.empty(items, np.int32),
      dropped=np.empty(items, np.int64),
      overflowed=np.empty(items, np.int64),
      raw_ids=np.empty(coo if unbounded else 0, np.int32),
    )
    return cls(
      plan,
      num_local,
      allow_id_dropping,
      coo_per_sc,
      unbounded,
      coo_offset,
      rp_offset,
      out,
    )

  @property
  def items_per_stack(self) -> int:
    return self.num_local * self.plan.num_sc_per_device


def _rows_per_sc(
  feature: plan_lib.FeaturePlan,
  batch: int,
  plan: plan_lib.Plan,
  items_per_stack: int,
) -> int:
  """Rows of `feature`'s local batch per SparseCore, validated."""
  spec, num_sc = feature.spec, plan.num_sc_per_device
  if batch == 0:
    raise ValueError(f"feature {spec.name!r}: empty batch")
  if batch % items_per_stack:
    raise ValueError(
      f"feature {spec.name!r}: batch of {batch} rows does not divide over"
      f" {items_per_stack // num_sc} local devices x {num_sc} SparseCores"
    )
  rows, n = batch // items_per_stack, plan.num_shards
  if plan.for_tables and rows * n != spec.sample_count:
    raise ValueError(
      f"feature {spec.name!r}: {batch} local rows give {rows} samples per "
      f"SparseCore, i.e. {rows * n} global samples, but its spec has "
      f"output_shape {spec.output_shape} ({spec.sample_count} samples)"
    )
  return rows


def _item_sizes(
  batch: ragged_input.FlatBatch,
  rows_per_sc: np.ndarray,
  first_feature: np.ndarray,
  items_per_stack: int,
) -> np.ndarray:
  """The ids of every work item (stack, local device, SparseCore)."""
  sizes = np.zeros((len(first_feature) - 1, items_per_stack), np.int64)
  for t in range(len(sizes)):
    for f in range(first_feature[t], first_feature[t + 1]):
      r0 = batch.first_row[f]
      splits = batch.row_splits[r0 : r0 + batch.num_rows[f] + 1]
      sizes[t] += np.diff(splits[:: rows_per_sc[f]])
  if sizes.max(initial=0) >= 2**31:
    raise ValueError("more than 2**31 ids on one SparseCore")
  return sizes.reshape(-1)


def _int_array(items: Any, value: Callable[[Any], int]) -> np.ndarray:
  return np.array([value(item) for item in items], np.int64)


def _feature_arrays(
  features: list[plan_lib.FeaturePlan],
  batch: ragged_input.FlatBatch,
  rows_per_sc: np.ndarray,
) -> _fill_numba.Features:
  return _fill_numba.Features(
    first_row=batch.first_row,
    rows_per_sc=rows_per_sc,
    sample_offset=_int_array(features, lambda f: f.sample_offset),
    row_offset_in_shard=_int_array(features, lambda f: f.row_offset_in_shard),
    shard_rotation=_int_array(features, lambda f: f.shard_rotation),
    weighted=batch.weighted,
  )


def _stack_arrays(
  call: _Call,
  first_feature: np.ndarray,
  feature_weighted: np.ndarray,
  rows_per_sc: np.ndarray,
) -> _fill_numba.Stacks:
  """Per-stack arrays; a stack's samples are its features' rows (upstream's
  `batch_size_per_sc`, the plan's `samples_per_sc` when it sizes tables)."""
  stacks = call.plan.stacks
  max_ids = _int_array(stacks, lambda s: s.spec.max_ids_per_partition)
  max_unique = _int_array(stacks, lambda s: s.spec.max_unique_ids_per_partition)
  if call.unbounded:
    max_ids[:] = max_unique[:] = np.iinfo(np.int32).max
  return _fill_numba.Stacks(
    first_feature=first_feature,
    combiner=_int_array(stacks, lambda s: _COMBINER_CODES[s.spec.combiner]),
    max_ids=max_ids,
    max_unique=max_unique,
    rows_per_shard=_int_array(stacks, lambda s: s.rows_per_shard),
    key_bits=_int_array(
      stacks, lambda s: int(s.spec.stack_vocab_size - 1).bit_length()
    ),
    coo_per_sc=call.coo_per_sc,
    coo_offset=call.coo_offset[:-1],
    row_pointer_offset=call.row_pointer_offset[:-1],
    samples_per_sc=np.add.reduceat(rows_per_sc, first_feature[:-1]),
    weighted=np.logical_or.reduceat(feature_weighted, first_feature[:-1]),
  )


def _scalars(call: _Call) -> _fill_numba.Scalars:
  n = call.plan.num_shards
  return _fill_numba.Scalars(
    num_local_devices=call.num_local,
    num_sc=call.plan.num_sc_per_device,
    num_shards=n,
    log2_shards=n.bit_length() - 1,
    row_pointers_per_sc=buffer_format.row_pointers_per_sc(n),
    allow_id_dropping=call.allow_id_dropping,
    count_raw_ids=call.unbounded,
  )


# ---------------------------------------------------------------------------
# Limits and results.


def counts(call: _Call) -> tuple[np.ndarray, np.ndarray]:
  """The (sample, id) pairs and distinct ids every source SparseCore sends
  every partition, before any dropping: two `[T, L, S, N]` arrays."""
  plan = call.plan
  shape = (
    len(plan.stacks),
    call.num_local,
    plan.num_sc_per_device,
    plan.num_shards,
  )
  return call.out.obs_ids.reshape(shape), call.out.obs_unique.reshape(shape)


def _check_call_limits(call: _Call) -> None:
  """Raises or warns where a stack's counts exceed its limits or its
  buffer overflowed."""
  plan, out = call.plan, call.out
  obs_ids, obs_unique = counts(call)
  required = out.required.reshape(len(plan.stacks), -1)
  overflowed = out.overflowed.reshape(len(plan.stacks), -1).sum(axis=1)
  for t, stack in enumerate(plan.stacks):
    _check_limits(stack, obs_ids[t], obs_unique[t], call.allow_id_dropping)
    if overflowed[t]:
      warnings.warn(
        f"stack {stack.name!r}: the COO buffer of {stack.coo_per_device} "
        f"entries per device overflowed; {int(overflowed[t])} ids were "
        f"dropped (the batch needs "
        f"{int(required[t].max()) * plan.num_sc_per_device}; raise "
        "suggested_coo_buffer_size_per_device)",
        stacklevel=3,
      )


def per_stack(
  plan: plan_lib.Plan,
  flat: np.ndarray,
  offsets: np.ndarray,
  num_local: int,
  has_leading_dimension: bool,
) -> dict[str, np.ndarray]:
  """Stack name -> its block `flat[offsets[t]:offsets[t + 1]]`, shaped
  `[L, -1]` with a leading dimension."""
  blocks = {}
  for t, stack in enumerate(plan.stacks):
    block = flat[offsets[t] : offsets[t + 1]]
    if has_leading_dimension:
      block = block.reshape(num_local, -1)
    blocks[stack.name] = block
  return blocks


def stats_of(
  call: _Call, dropped: np.ndarray | None = None
) -> SparseDenseMatmulInputStats:
  """The call's stats; `dropped` (raw ids per stack) replaces the fill's."""
  plan, out = call.plan, call.out
  num_stacks = len(plan.stacks)
  obs_ids, obs_unique = counts(call)
  required = out.required.reshape(num_stacks, -1)
  if dropped is None:
    dropped = out.dropped.reshape(num_stacks, -1).sum(axis=1)
  names = [stack.name for stack in plan.stacks]
  return SparseDenseMatmulInputStats(
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


def _results(
  call: _Call, has_leading_dimension: bool
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Wraps the outputs per stack."""
  out = call.out

  def blocks(flat: np.ndarray, offsets: np.ndarray) -> dict[str, Any]:
    return per_stack(
      call.plan, flat, offsets, call.num_local, has_leading_dimension
    )

  buffers = PreprocessedInput(
    lhs_row_pointers=blocks(out.row_pointers, call.row_pointer_offset),
    lhs_embedding_ids=blocks(out.embedding_ids, call.coo_offset),
    lhs_sample_ids=blocks(out.sample_ids, call.coo_offset),
    lhs_gains=blocks(out.gains, call.coo_offset),
  )
  return buffers, stats_of(call)


def _check_limits(
  stack: plan_lib.StackPlan,
  obs_ids: np.ndarray,
  obs_unique: np.ndarray,
  allow_id_dropping: bool,
) -> None:
  """Raises (or warns, when dropping) if a stack's counts exceed its limits.

  `obs_ids` and `obs_unique` are `[L, S, N]` counts per source SparseCore
  and partition.
  """
  for counts, limit, field in (
    (obs_ids, stack.spec.max_ids_per_partition, "max_ids_per_partition"),
    (
      obs_unique,
      stack.spec.max_unique_ids_per_partition,
      "max_unique_ids_per_partition",
    ),
  ):
    if counts.max(initial=0) <= limit:
      continue
    d, s, p = np.unravel_index(int(np.argmax(counts)), counts.shape)
    message = (
      f"stack {stack.name!r} (features {[f.name for f in stack.features]}): "
      f"local device {d}, SparseCore {s} sends {int(counts[d, s, p])} "
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
  "PAD_ID",
  "PreprocessedInput",
  "SparseDenseMatmulInputStats",
  "compute_coo_buffer_size_per_device",
  "compute_row_pointers_size_per_device",
  "compute_theoretical_max_coo_buffer_size",
  "eval_preprocess_sparse_dense_matmul_input_shape",
  "input_shapes",
  "preprocess_for_plan",
  "preprocess_sparse_dense_matmul_input",
]
