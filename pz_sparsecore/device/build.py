"""Lookup buffers built on the device, inside the traced call.

`build_inputs(plan, topology, ids)` turns a flat batch of token ids, one id
per sample, into the same CSR-wrapped COO buffers the host preprocessor
writes (`pz_sparsecore.core.buffer_format`), as global arrays sharded over
the topology's shard axis. A model then stays an ordinary function of its
token ids: no host step, any shape, under `jit` or eagerly, inside Penzai's
sampling loops.

Per SparseCore segment (device `d`, SparseCore `s`, its `M` consecutive
samples of the batch), with `N` shards, for a feature alone in its stack:

1. each valid id `e` (`0 <= e < vocabulary_size`) goes to partition
   `p = (e % N + rotation) % N` at local row `e // N + row_offset`
   (`layout.compute_physical_row_ids`); an invalid id (padding, or out of
   range) gets partition `N`, sorted last and never written, so its
   sample's activation is zero and it takes no gradient;
2. the entries are sorted by `(partition, local row)` with a stable sort, so
   samples stay in order within a row, as the host's `(row, sample)` order;
3. partition `p` starts at the 8-aligned end of partition `p - 1`; its
   entries are scattered there, with gain 1 (one id per sample: every
   combiner divides by 1), and the row pointers hold the unaligned ends.

The windows are sized from the static shape: the plan's
`max_ids_per_partition` is `M` unless the caller gives smaller limits, so
no batch of that shape can overflow them. With smaller limits, entries past
a partition's window are not written (dropped), and the function reports
how many, for the caller to refuse or to count.

Example, `N = 2`, one segment of `M = 4` samples with ids `[5, 2, 5, -1]`:
partitions `[1, 0, 1, 2]`, local rows `[2, 1, 2, *]`; sorted: `(0, 1, s1)`,
`(1, 2, s0)`, `(1, 2, s2)`; partition 0 holds `[1]` at 0, partition 1
holds `[2, 2]` at 8; row pointers `[1, 10, 16, 16, 16, 16, 16, 16]`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import buffer_format, layout
from pz_sparsecore.core.plan import Plan, StackPlan
from pz_sparsecore.core.preprocessed import PreprocessedInput
from pz_sparsecore.device.topology import Topology

NO_ID = -1
"""The id of a sample without one (padding up to a multiple of N)."""


def _segment(
  stack: StackPlan, num_shards: int, ids: jax.Array
) -> tuple[jax.Array, ...]:
  """One segment's `(row_pointers, ids, sample_ids, gains, dropped)`."""
  feature = stack.features[0]
  table = stack.tables[0]
  setting = table.setting_in_stack
  n, m = num_shards, ids.shape[0]
  valid = (ids >= 0) & (ids < table.vocabulary_size)
  safe = jnp.where(valid, ids, 0)
  row = layout.compute_physical_row_ids(
    n,
    stack.spec.stack_vocab_size,
    setting.shard_rotation,
    setting.row_offset_in_shard,
    safe,
  )
  part = jnp.where(valid, row // stack.rows_per_shard, n).astype(jnp.int32)
  local = (row % stack.rows_per_shard).astype(jnp.int32)
  sample = jnp.arange(m, dtype=jnp.int32) + feature.sample_offset
  part, local, sample = jax.lax.sort(
    (part, local, sample), num_keys=2, is_stable=True
  )
  bounds = jnp.arange(n + 1, dtype=jnp.int32)
  first = jnp.searchsorted(part, bounds, side="left").astype(jnp.int32)
  counts = first[1:] - first[:-1]
  limit = stack.spec.max_ids_per_partition
  kept = jnp.minimum(counts, limit)
  aligned = buffer_format.round_up(kept)
  starts = jnp.concatenate(
    [jnp.zeros((1,), jnp.int32), jnp.cumsum(aligned)[:-1]]
  ).astype(jnp.int32)
  ends = starts + kept
  tail = starts[-1] + aligned[-1]
  # Not `.at[:n].set`: a static slice's scatter carries an empty index
  # constant, hoisted into the shard_map as an input it never reads, which
  # crashes jaxlib 0.11's Shardy canonicalizer (a segfault at compile time).
  rest = stack.row_pointers_per_sc - n
  rp = ends
  if rest:
    rp = jnp.concatenate([ends, jnp.full((rest,), tail, jnp.int32)])
  p = jnp.minimum(part, n - 1)
  rank = jnp.arange(m, dtype=jnp.int32) - first[p]
  write = (part < n) & (rank < limit)
  size = stack.coo_per_sc
  pos = jnp.where(write, starts[p] + rank, size)
  pad = buffer_format.PAD_ID
  out_ids = jnp.full((size,), pad, jnp.int32).at[pos].set(local, mode="drop")
  out_sids = jnp.full((size,), pad, jnp.int32).at[pos].set(sample, mode="drop")
  gains = jnp.full((size,), buffer_format.PAD_GAIN, jnp.float32)
  gains = gains.at[pos].set(1.0, mode="drop")
  dropped = jnp.sum(counts - kept)
  return rp, out_ids, out_sids, gains, dropped


def check_buildable(plan: Plan) -> None:
  """Raises unless every stack of `plan` is one table with one feature.

  Raises:
    ValueError: Naming the stack, for a shared or stacked table.
  """
  for stack in plan.stacks:
    if len(stack.tables) != 1 or len(stack.features) != 1:
      raise ValueError(
        f"stack {stack.name!r}: buffers are built on the device for one "
        f"feature of one table; it has tables "
        f"{[t.name for t in stack.tables]} and features "
        f"{[f.name for f in stack.features]} (preprocess those on the host)"
      )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _build(plan: Plan, topology: Topology, ids: dict[str, jax.Array]):
  n, s = plan.num_shards, plan.num_sc_per_device

  def body(ids):
    out = {}
    for stack in plan.stacks:
      segments = ids[stack.features[0].name].reshape(s, -1)
      parts = jax.vmap(lambda x, stack=stack: _segment(stack, n, x))(segments)
      *buffers, dropped = parts
      out[stack.name] = (
        *(b.reshape(-1) for b in buffers),
        jax.lax.psum(jnp.sum(dropped), topology.axis)[None],
      )
    return out

  names = {stack.features[0].name for stack in plan.stacks}
  built = jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=({name: P(topology.axis) for name in names},),
    out_specs=P(topology.axis),
    check_vma=False,
  )(ids)
  fields = zip(*(built[stack.name] for stack in plan.stacks), strict=True)
  names = [stack.name for stack in plan.stacks]
  rp, eids, sids, gains, dropped = (
    dict(zip(names, field, strict=True)) for field in fields
  )
  inputs = PreprocessedInput(
    lhs_row_pointers=rp,
    lhs_embedding_ids=eids,
    lhs_sample_ids=sids,
    lhs_gains=gains,
  )
  return inputs, {name: d[0] for name, d in dropped.items()}


def build_inputs(
  plan: Plan, topology: Topology, ids: dict[str, jax.Array]
) -> tuple[PreprocessedInput, dict[str, jax.Array]]:
  """The buffers of one id per sample, built on the device.

  Args:
    plan: A plan whose stacks each hold one table and one feature
      (`check_buildable`), for the batch's padded sample count.
    topology: The mesh and shard axis the tables live on.
    ids: Feature name → `[samples]` int32 ids in global sample order
      (`samples` = the feature's sample count, a multiple of N); ids
      outside `[0, vocabulary_size)` (e.g. `NO_ID`) are no id.

  Returns:
    `(inputs, dropped)`: the buffers as global arrays `[G * size]` sharded
    over the shard axis, and per stack the number of ids over the plan's
    `max_ids_per_partition` that were not written (0 unless the limits are
    smaller than the batch).
  """
  check_buildable(plan)
  return _build(plan, topology, ids)
