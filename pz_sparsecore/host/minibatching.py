"""Minibatching: a batch whose ids exceed the limits, split into minibatches
that each keep them (jax-tpu-embedding's `enable_minibatching`).

Every id's embedding row goes to one of 64 buckets, `HighwayHash(col_id) &
63` with upstream's key (`col_id = local_row * N + partition`). The buckets
are the leaves of a binary tree; for every source SparseCore and partition,
`split_of` walks it bottom up and marks the nodes whose two halves together
exceed a limit (`max_ids_per_partition` on the entries, then
`max_unique_ids_per_partition` on the distinct rows). The marks of every
SparseCore, partition and stack, and of every process, are OR-ed into one
split: each marked node separates minibatches, so `M = marks + 1` runs of
consecutive buckets. A row lives in one bucket, so in one minibatch: looking
the minibatches up one after another and updating a table minibatch by
minibatch is the same as doing the batch at once.

When no SparseCore exceeds a limit (the OR of that over all processes
first), `M = 1` and the buffers hold the batch unsplit.

Buffers, per stack and device (`S` SparseCores, `R = max(N, 8)`):

* `lhs_row_pointers`: `64 * S * R` entries; segment `k = s * M + m`
  (SparseCore `s`, minibatch `m`) holds `R` of them: the ends of its `N`
  partitions, as indices into the device's COO buffer (not relative to
  the segment), then its 8-aligned end repeated. Segments past `S * M`
  are empty (they repeat the last end).
* `lhs_embedding_ids`, `lhs_sample_ids`, `lhs_gains`: one run over the
  device's `C` entries. Segment `k` starts where segment `k - 1` ended,
  8-aligned (segment 0 at 0), and each of its partitions starts 8-aligned.
  Inside a minibatch a partition is sorted by (bucket, local row, sample).
  Unused entries hold `PAD_ID` / `PAD_ID` / NaN.
* `C` is 64 times the theoretical maximum without minibatching, or the
  suggested size (rounded up to `8 * S`); ids that find no room are
  dropped and counted.

Stats are those of the whole batch (before any split). With
`allow_id_dropping`, a bucket whose own ids exceed a limit keeps the first
ones, as without minibatching; without it, that raises `ValueError`.

Processes agree on the split through an `AllReduce` (an OR of 64-bit
masks): `JaxAllReduce` uses JAX's collectives over every process of
`jax.distributed`; one process driving several hosts' devices in one call
needs none.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES
from pz_sparsecore.core.preprocessed import PreprocessedInput
from pz_sparsecore.host import _minibatch_numba
from pz_sparsecore.host import blocks as blocks_lib
from pz_sparsecore.host import fill as fill_lib


class AllReduce(Protocol):
  """How the processes preprocessing one global batch agree on a value."""

  def __call__(self, value: int) -> int:
    """The OR of every process's non-negative `value` (below 2**63)."""


class JaxAllReduce:
  """`AllReduce` over every process of `jax.distributed`, with JAX's
  collectives (each process must call it the same number of times)."""

  def __call__(self, value: int) -> int:
    if jax.process_count() == 1:
      return int(value)
    words = np.array([value & 0xFFFFFFFF, value >> 32], np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(words))
    low = int(np.bitwise_or.reduce(gathered.reshape(-1, 2)[:, 0]))
    high = int(np.bitwise_or.reduce(gathered.reshape(-1, 2)[:, 1]))
    return low | high << 32


def groups(split: int) -> list[int]:
  """The bucket bounds of the minibatches of `split`: minibatch `m` holds
  buckets `[bounds[m], bounds[m + 1])`.

  Node `i` of the level of subtrees of `size` buckets (bits in level order,
  leaves' parents first) separates buckets `i * size + size / 2 - 1` and
  the next.
  """
  cuts, bit, size = [], 0, 2
  while size <= MAX_MINIBATCHES:
    for i in range(MAX_MINIBATCHES // size):
      if split >> bit & 1:
        cuts.append(i * size + size // 2)
      bit += 1
    size *= 2
  return [0, *sorted(cuts), MAX_MINIBATCHES]


def preprocess(
  plan: plan_lib.Plan,
  leaves: dict[str, tuple[Any, Any]],
  num_local: int,
  *,
  has_leading_dimension: bool,
  allow_id_dropping: bool,
  all_reduce: AllReduce | None,
) -> tuple[PreprocessedInput, Any]:
  """Minibatched buffers and stats of one process-local batch (see the
  module docstring); the body of `preprocess_sparse_dense_matmul_input`
  with `enable_minibatching=True`."""
  reduce = _all_reduce(plan, num_local, all_reduce)
  call = fill_lib.fill(
    plan, leaves, num_local, allow_id_dropping, unbounded=True
  )
  obs_ids, obs_unique = fill_lib.counts(call)
  limits = np.array(
    [
      [s.spec.max_ids_per_partition, s.spec.max_unique_ids_per_partition]
      for s in plan.stacks
    ],
    np.int64,
  )
  over = bool(
    np.any(obs_ids > limits[:, 0, None, None, None])
    or np.any(obs_unique > limits[:, 1, None, None, None])
  )
  required = bool(reduce(int(over)))
  first = _first_pass(call)
  buckets = _count(call, first, limits, use_buckets=required)
  split = 0
  if required:
    split = reduce(int(np.bitwise_or.reduce(buckets.split, initial=0)))
    _check_buckets(plan, buckets, limits, allow_id_dropping)
  bounds = groups(split)
  out, layout = _write(call, first, buckets, limits, bounds, allow_id_dropping)
  dropped = out.dropped + out.overflowed
  _warn_overflow(plan, out.overflowed.reshape(len(plan.stacks), num_local))
  stats = fill_lib.stats_of(
    call, dropped.reshape(len(plan.stacks), num_local).sum(axis=1)
  )
  return _wrap(call, out, layout, len(bounds) - 1, has_leading_dimension), stats


def _warn_overflow(plan: plan_lib.Plan, overflowed: np.ndarray) -> None:
  """Warns for every stack whose buffer had no room for some entries."""
  for t, stack in enumerate(plan.stacks):
    if overflowed[t].any():
      warnings.warn(
        f"stack {stack.name!r}: the minibatched COO buffer of "
        f"{stack.coo_per_device} entries per device overflowed; "
        f"{int(overflowed[t].sum())} entries were dropped (raise "
        "suggested_coo_buffer_size_per_device)",
        stacklevel=4,
      )


def _all_reduce(
  plan: plan_lib.Plan, num_local: int, all_reduce: AllReduce | None
) -> AllReduce:
  """The all-reduce to use; refuses a partial batch with no way to agree."""
  if all_reduce is not None:
    return all_reduce
  if num_local < plan.num_devices and jax.process_count() == 1:
    raise ValueError(
      f"enable_minibatching with {num_local} of {plan.num_devices} devices "
      "in this call: the callers preprocessing the other devices must agree "
      "on the split; pass all_reduce (an AllReduce OR-ing one int over "
      "them), or run one process per host under jax.distributed"
    )
  return JaxAllReduce()


def _first_pass(call: Any) -> _minibatch_numba.FirstPass:
  plan = call.plan
  s, rpp = (
    plan.num_sc_per_device,
    buffer_format.row_pointers_per_sc(plan.num_shards),
  )
  items_per_stack = call.num_local * s
  # The fill's blocks: stack t's items one after the other from its start.
  coo_start = call.coo.parts(call.coo_per_sc, items_per_stack).reshape(-1)
  rp_start = call.row_pointers.parts(rpp, items_per_stack).reshape(-1)
  out = call.out
  return _minibatch_numba.FirstPass(
    row_pointers=out.row_pointers,
    embedding_ids=out.embedding_ids,
    sample_ids=out.sample_ids,
    gains=out.gains,
    raw_ids=out.raw_ids,
    coo_start=coo_start,
    rp_start=rp_start,
  )


def _count(
  call: Any,
  first: _minibatch_numba.FirstPass,
  limits: np.ndarray,
  use_buckets: bool,
) -> _minibatch_numba.Buckets:
  plan = call.plan
  items = len(first.coo_start)
  n = plan.num_shards
  buckets = _minibatch_numba.Buckets(
    order=np.empty(len(first.gains), np.int32),
    starts=np.empty((items, n, MAX_MINIBATCHES + 1), np.int32),
    unique=np.zeros((items, n, MAX_MINIBATCHES), np.int32),
    split=np.zeros(items, np.int64),
  )
  item_stack = np.repeat(
    np.arange(len(plan.stacks), dtype=np.int64), items // len(plan.stacks)
  )
  fill_lib.run_parallel(
    _minibatch_numba.count_buckets,
    first,
    item_stack,
    n,
    use_buckets,
    limits,
    buckets,
  )
  return buckets


def _check_buckets(
  plan: plan_lib.Plan,
  buckets: _minibatch_numba.Buckets,
  limits: np.ndarray,
  allow_id_dropping: bool,
) -> None:
  """Without dropping, raises if one bucket alone exceeds a limit (no split
  can help it)."""
  if allow_id_dropping:
    return
  num_stacks = len(plan.stacks)
  ids = np.diff(buckets.starts, axis=-1).reshape(
    num_stacks, -1, MAX_MINIBATCHES
  )
  unique = buckets.unique.reshape(num_stacks, -1, MAX_MINIBATCHES)
  for t, stack in enumerate(plan.stacks):
    for counts, limit, what in (
      (ids[t], limits[t, 0], "max_ids_per_partition"),
      (unique[t], limits[t, 1], "max_unique_ids_per_partition"),
    ):
      if counts.max(initial=0) > limit:
        raise ValueError(
          f"stack {stack.name!r}: one minibatching bucket of one SparseCore "
          f"and partition holds {int(counts.max())} "
          f"{'ids' if what == 'max_ids_per_partition' else 'unique ids'}, "
          f"over {what}={int(limit)}, which no split can divide; raise the "
          "limit or pass allow_id_dropping=True"
        )


def _write(
  call: Any,
  first: _minibatch_numba.FirstPass,
  buckets: _minibatch_numba.Buckets,
  limits: np.ndarray,
  bounds: list[int],
  allow_id_dropping: bool,
) -> tuple[_minibatch_numba.Output, dict[str, blocks_lib.Blocks]]:
  plan, num_local = call.plan, call.num_local
  s, n = plan.num_sc_per_device, plan.num_shards
  rpp = buffer_format.row_pointers_per_sc(n)
  rp_dev = MAX_MINIBATCHES * s * rpp
  coo_dev = np.array([st.coo_per_device for st in plan.stacks], np.int64)
  pairs = len(plan.stacks) * num_local
  blocks = {
    "rp": blocks_lib.Blocks.aligned(
      np.full(len(plan.stacks), rp_dev * num_local)
    ),
    "coo": blocks_lib.Blocks.aligned(coo_dev * num_local),
  }
  coo_size = np.repeat(coo_dev, num_local).astype(np.int64)
  layout = _minibatch_numba.Layout(
    first_item=np.arange(pairs, dtype=np.int64) * s,
    rp_start=blocks["rp"].parts(rp_dev, num_local).reshape(-1),
    coo_start=blocks["coo"].parts(coo_dev, num_local).reshape(-1),
    coo_size=coo_size,
    limits=np.repeat(limits, num_local, axis=0),
    groups=np.array(bounds, np.int64),
  )
  out = _minibatch_numba.Output(
    row_pointers=blocks["rp"].empty(np.int32),
    embedding_ids=blocks["coo"].empty(np.int32),
    sample_ids=blocks["coo"].empty(np.int32),
    gains=blocks["coo"].empty(np.float32),
    dropped=np.zeros(pairs, np.int64),
    overflowed=np.zeros(pairs, np.int64),
  )
  fill_lib.run_parallel(
    _minibatch_numba.write_minibatches,
    first,
    buckets,
    layout,
    s,
    n,
    rpp,
    allow_id_dropping,
    out,
  )
  return out, blocks


def _wrap(
  call: Any,
  out: _minibatch_numba.Output,
  where: dict[str, blocks_lib.Blocks],
  num_minibatches: int,
  has_leading_dimension: bool,
) -> PreprocessedInput:
  plan, num_local = call.plan, call.num_local

  def blocks(flat: np.ndarray, key: str) -> dict[str, np.ndarray]:
    return fill_lib.per_stack(
      plan, flat, where[key], num_local, has_leading_dimension
    )

  count = blocks_lib.aligned_empty(num_local, np.int32)
  count[:] = num_minibatches
  return PreprocessedInput(
    lhs_row_pointers=blocks(out.row_pointers, "rp"),
    lhs_embedding_ids=blocks(out.embedding_ids, "coo"),
    lhs_sample_ids=blocks(out.sample_ids, "coo"),
    lhs_gains=blocks(out.gains, "coo"),
    num_minibatches=count.reshape(num_local, 1)
    if has_leading_dimension
    else count,
  )


__all__ = [
  "AllReduce",
  "JaxAllReduce",
  "groups",
]
