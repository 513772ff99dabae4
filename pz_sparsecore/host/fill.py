"""The numba fill of one batch: read ids, partition, sort, merge, write.

`fill` reads and validates every feature's ids into one flat array
(`ragged_input`: its compiled reader walks object arrays and lists with no
Python-level loop), then `_fill_numba.fill_buffers` does the per-SparseCore
work of every stack in one numba kernel launch, parallel over (stack,
device, SparseCore) work items: radix sort by physical row, then one walk
that merges, counts, drops and writes. The sizes and offsets come from the
`plan.Plan`; the format and a worked example are in `host.preprocess`.
`results` wraps the outputs per stack, `check_call_limits` raises (or warns
when dropping) over the limits. Minibatching (`host.minibatching`) runs the
same fill unbounded as its first pass.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import (
  compute_row_pointers_size_per_device,
)
from pz_sparsecore.core.preprocessed import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
)
from pz_sparsecore.host import _fill_numba, coo_input, ragged_input
from pz_sparsecore.host import blocks as blocks_lib
from pz_sparsecore.host import sample_order as order_lib

# Serialises kernel launches: numba's fallback threading layer (workqueue)
# aborts on concurrent parallel regions, and the kernels are parallel anyway.
_KERNEL_LOCK = threading.Lock()
_COMBINER_CODES = {
  "sum": _fill_numba.COMBINER_SUM,
  "mean": _fill_numba.COMBINER_MEAN,
  "sqrtn": _fill_numba.COMBINER_SQRTN,
}


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
  first_feature = coo_input.splits_from_lengths(
    [len(s.features) for s in plan.stacks]
  )
  _check_local_batch(plan, rows_per_sc, first_feature)
  item_size = _item_sizes(batch, rows_per_sc, first_feature, items_per_stack)
  coo_per_sc = np.array([s.coo_per_sc for s in plan.stacks], np.int64)
  if unbounded:
    # Every partition of a segment wastes at most 7 entries to alignment.
    largest = item_size.reshape(len(plan.stacks), -1).max(axis=1)
    coo_per_sc = buffer_format.round_up(largest + 7 * plan.num_shards)
  call = _Call.allocate(
    plan, num_local, allow_id_dropping, coo_per_sc, unbounded
  )
  stacks = _stack_arrays(call, first_feature, batch.weighted, rows_per_sc)
  if call.sample_order:
    out = call.out
    out.order_starts[:], out.order_pairs[:], out.order_first[:] = (
      order_lib.item_bases(plan, num_local, item_size, stacks.samples_per_sc)
    )
  args = (
    _fill_numba.Batch(
      values=batch.values,
      weights=batch.weights,
      row_splits=batch.row_splits,
      item_size=item_size,
    ),
    _feature_arrays(features, batch, rows_per_sc),
    stacks,
    _scalars(call),
    call.out,
  )
  run_parallel(_fill_numba.fill_buffers, *args)
  return call


def run_parallel(kernel: Callable[..., Any], *args: Any) -> Any:
  """Runs a parallel numba kernel of the host stage: one at a time in the
  process (`_KERNEL_LOCK`; numba's workqueue layer, its fallback, aborts the
  process on parallel regions launched from two threads at once), numba's
  threads started by `_launch_threads`."""
  with _KERNEL_LOCK:
    _launch_threads()
    return kernel(*args)


@functools.cache
def _launch_threads() -> None:
  """Starts numba's worker threads with `OMP_WAIT_POLICY=PASSIVE` unless
  the process sets the variable itself (then as it says); called under
  `_KERNEL_LOCK` before the first kernel.

  numba's OpenMP layer (GNU libgomp, which reads the variable once, when
  numba loads it) keeps its idle workers spinning after each parallel loop
  by default. The step that follows a preprocess wants the same cores for
  XLA: on 2 cores the spinning made a 26-table DLRM's preprocessing then
  step 12-38% slower (docs/benchmarks.md). Passive workers sleep instead;
  the variable is removed again once the threads are up, so child
  processes do not inherit it. Once per process (`functools.cache`; a
  failed start is tried again).
  """
  import numba

  ours = "OMP_WAIT_POLICY" not in os.environ
  if ours:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
  try:
    numba.get_num_threads()  # Loads the threading layer and starts it.
  finally:
    if ours:
      del os.environ["OMP_WAIT_POLICY"]


# ---------------------------------------------------------------------------
# The kernel's arguments.


@dataclasses.dataclass(frozen=True)
class _Call:
  """One call's plan and options, and every output array.

  Each stack's buffers are its blocks (`coo`, `row_pointers`) of the flat
  output arrays, aligned for `device_put` (`host.blocks`); the per-item
  stats hold `T * L * S` rows.
  """

  plan: plan_lib.Plan
  num_local: int
  allow_id_dropping: bool
  coo_per_sc: np.ndarray
  unbounded: bool
  coo: blocks_lib.Blocks
  row_pointers: blocks_lib.Blocks
  out: _fill_numba.Outputs

  @property
  def sample_order(self) -> bool:
    """Whether the fill writes the forward's sample order (`order_lib`)."""
    return _writes_sample_order(self.plan, self.unbounded)

  @classmethod
  def allocate(
    cls,
    plan: plan_lib.Plan,
    num_local: int,
    allow_id_dropping: bool,
    coo_per_sc: np.ndarray,
    unbounded: bool,
  ) -> _Call:
    coo = blocks_lib.Blocks.aligned(
      coo_per_sc * plan.num_sc_per_device * num_local
    )
    rp_dev = compute_row_pointers_size_per_device(
      plan.num_devices, plan.num_sc_per_device
    )
    rp = blocks_lib.Blocks.aligned(
      np.full(len(plan.stacks), rp_dev * num_local)
    )
    items = len(plan.stacks) * num_local * plan.num_sc_per_device
    order = blocks_lib.aligned_empty(
      order_lib.layout(plan, num_local).blocks.total
      if _writes_sample_order(plan, unbounded)
      else 0,
      np.int32,
    )
    out = _fill_numba.Outputs(
      row_pointers=rp.empty(np.int32),
      embedding_ids=coo.empty(np.int32),
      sample_ids=coo.empty(np.int32),
      gains=coo.empty(np.float32),
      obs_ids=np.empty((items, plan.num_shards), np.int32),
      obs_unique=np.empty((items, plan.num_shards), np.int32),
      required=np.empty(items, np.int32),
      dropped=np.empty(items, np.int64),
      overflowed=np.empty(items, np.int64),
      raw_ids=np.empty(coo.total if unbounded else 0, np.int32),
      order_rows=order,
      order_gains=order.view(np.float32),
      order_starts=np.zeros(items, np.int64),
      order_pairs=np.full(items, -1, np.int64),
      order_first=np.zeros(items, np.int64),
      order_ok=np.zeros(items, np.bool_),
    )
    return cls(
      plan,
      num_local,
      allow_id_dropping,
      coo_per_sc,
      unbounded,
      coo,
      rp,
      out,
    )

  @property
  def items_per_stack(self) -> int:
    return self.num_local * self.plan.num_sc_per_device


def _writes_sample_order(plan: plan_lib.Plan, unbounded: bool) -> bool:
  """A one-device plan's fill writes the sample order, but not the
  unbounded first pass of minibatching."""
  return order_lib.applies(plan) and not unbounded


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


def _check_local_batch(
  plan: plan_lib.Plan, rows_per_sc: np.ndarray, first_feature: np.ndarray
) -> None:
  """Refuses a stack whose samples per device exceed
  `buffer_format.MAX_LOCAL_BATCH_PER_DEVICE`."""
  per_device = np.add.reduceat(rows_per_sc, first_feature[:-1])
  per_device *= plan.num_sc_per_device
  limit = buffer_format.MAX_LOCAL_BATCH_PER_DEVICE
  for stack, samples in zip(plan.stacks, per_device, strict=True):
    if samples > limit:
      raise ValueError(
        f"stack {stack.spec.stack_name!r}: a local batch of {samples} samples"
        " per device (its features' rows, summed) exceeds the maximum limit "
        f"supported by the SparseCore CooFormat sorting key ({limit}); split "
        "the batch over more devices or steps"
      )


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
    coo_offset=call.coo.starts,
    row_pointer_offset=call.row_pointers.starts,
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
    sample_order=call.sample_order,
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


class LimitsExceededError(ValueError):
  """A batch sends a partition more ids, or distinct ids, than its stack's
  limits allow (and ids may not be dropped); nothing was produced.

  Attributes:
    stats: The batch's statistics, measured before any dropping: limits
      from them (`pzsc.update_limits(target, error.stats)`, with headroom)
      admit the batch.
  """

  def __init__(self, message: str, stats: SparseDenseMatmulInputStats):
    super().__init__(message)
    self.stats = stats


def check_call_limits(call: _Call) -> None:
  """Raises (`LimitsExceededError`) or warns where a stack's counts exceed
  its limits, or warns where its buffer overflowed."""
  plan, out = call.plan, call.out
  obs_ids, obs_unique = counts(call)
  required = out.required.reshape(len(plan.stacks), -1)
  overflowed = out.overflowed.reshape(len(plan.stacks), -1).sum(axis=1)
  for t, stack in enumerate(plan.stacks):
    _check_limits(stack, obs_ids[t], obs_unique[t], call)
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
  blocks: blocks_lib.Blocks,
  num_local: int,
  has_leading_dimension: bool,
) -> dict[str, np.ndarray]:
  """Stack name -> its block of `flat`, shaped `[L, -1]` with a leading
  dimension."""
  out = {}
  for t, stack in enumerate(plan.stacks):
    block = blocks.block(flat, t)
    if has_leading_dimension:
      block = block.reshape(num_local, -1)
    out[stack.name] = block
  return out


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


def results(
  call: _Call, has_leading_dimension: bool
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Wraps the outputs per stack."""
  out = call.out

  def blocks(flat: np.ndarray, where: blocks_lib.Blocks) -> dict[str, Any]:
    return per_stack(
      call.plan, flat, where, call.num_local, has_leading_dimension
    )

  order = None
  if call.sample_order:
    order_lib.finish(
      call.plan,
      call.num_local,
      out.order_rows,
      out.order_pairs,
      out.order_ok,
      out.dropped,
    )
    order = blocks(
      out.order_rows, order_lib.layout(call.plan, call.num_local).blocks
    )
  buffers = PreprocessedInput(
    lhs_row_pointers=blocks(out.row_pointers, call.row_pointers),
    lhs_embedding_ids=blocks(out.embedding_ids, call.coo),
    lhs_sample_ids=blocks(out.sample_ids, call.coo),
    lhs_gains=blocks(out.gains, call.coo),
    sample_order=order,
  )
  return buffers, stats_of(call)


def _check_limits(
  stack: plan_lib.StackPlan,
  obs_ids: np.ndarray,
  obs_unique: np.ndarray,
  call: _Call,
) -> None:
  """Raises (or warns, when dropping) if a stack's counts exceed its limits.

  `obs_ids` and `obs_unique` are `[L, S, N]` counts per source SparseCore
  and partition; the error carries `call`'s stats.
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
    if not call.allow_id_dropping:
      raise LimitsExceededError(
        message + "; raise the limit (e.g. pzsc.update_limits(target, "
        "error.stats, headroom=1.25) with this error's stats, or FDO stats "
        "with update_preprocessing_parameters) or pass "
        "allow_id_dropping=True",
        stats_of(call),
      )
    warnings.warn(message + "; ids were dropped", stacklevel=3)
