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

Implementation: `ragged_input` reads and validates every feature's ids
and `fill` runs the numba kernel that partitions, sorts, merges and writes
every stack's buffers in one launch (`fill`'s docstring); with minibatching,
`minibatching` splits the batch first. Sizes and offsets come from the
`plan.Plan`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import (
  PAD_ID,
  compute_row_pointers_size_per_device,
  compute_theoretical_max_coo_buffer_size,
)
from pz_sparsecore.core.preprocessed import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
)
from pz_sparsecore.core.specs import FeatureSpec
from pz_sparsecore.host import fill as fill_lib
from pz_sparsecore.host import (
  hashed_ids,
  minibatching,
  ragged_input,
  sample_order,
)

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
  _check_device_counts(
    local_device_count, global_device_count, num_sc_per_device
  )
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
  order = sample_order.shapes(plan)
  return PreprocessedInput(
    lhs_row_pointers={k: struct(n, np.int32) for k, n in rp.items()},
    lhs_embedding_ids={k: struct(c, np.int32) for k, c in coo.items()},
    lhs_sample_ids={k: struct(c, np.int32) for k, c in coo.items()},
    lhs_gains={k: struct(c, np.float32) for k, c in coo.items()},
    num_minibatches=struct(1, np.int32) if plan.minibatches > 1 else None,
    sample_order=None
    if order is None
    else {k: struct(n, np.int32) for k, n in order.items()},
    hashed_ids={
      s.name: struct(plan_lib.hashed_ids_per_device(plan, s), np.int32)
      for s in plan.stacks
      if s.is_hashed
    }
    or None,
  )


def _check_device_counts(
  local_device_count: int, global_device_count: int, num_sc_per_device: int
) -> None:
  """Checks the counts in upstream's order (and with its words)."""
  if isinstance(local_device_count, bool) or not isinstance(
    local_device_count, (int, np.integer)
  ):
    raise ValueError(
      f"local_device_count must be a positive integer, got "
      f"{local_device_count!r}"
    )
  if local_device_count <= 0:
    raise ValueError(
      f"local_device_count must be greater than 0, got {local_device_count}"
    )
  buffer_format.num_shards(global_device_count, num_sc_per_device)
  if global_device_count < local_device_count:
    raise ValueError(
      "global_device_count must be greater than or equal to "
      f"local_device_count, got {global_device_count} < {local_device_count}"
    )


def _check_not_empty(feature_specs: Any) -> None:
  if not jax.tree.leaves(
    feature_specs, is_leaf=lambda x: isinstance(x, FeatureSpec)
  ):
    raise ValueError(
      "input_batches cannot be empty: feature_specs "
      f"{feature_specs!r} holds no FeatureSpec; pass at least one feature "
      "and its batch"
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
  _check_device_counts(
    local_device_count, global_device_count, num_sc_per_device
  )
  _check_not_empty(feature_specs)
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
  _check_device_counts(
    local_device_count, plan.num_devices, plan.num_sc_per_device
  )
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
    plan = plan_lib.with_minibatch_buffers(plan)
  leaves, keys = hashed_ids.prepare(plan, leaves, int(local_device_count))
  if enable_minibatching:
    inputs, stats = minibatching.preprocess(
      plan,
      leaves,
      int(local_device_count),
      has_leading_dimension=has_leading_dimension,
      allow_id_dropping=bool(allow_id_dropping),
      all_reduce=all_reduce,
    )
  else:
    call = fill_lib.fill(
      plan, leaves, int(local_device_count), bool(allow_id_dropping)
    )
    fill_lib.check_call_limits(call)
    inputs, stats = fill_lib.results(call, has_leading_dimension)
  if keys:
    shape = (local_device_count, -1) if has_leading_dimension else (-1,)
    keys = {k: v.reshape(shape) for k, v in keys.items()}
    inputs = dataclasses.replace(inputs, hashed_ids=keys)
  return inputs, stats


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
