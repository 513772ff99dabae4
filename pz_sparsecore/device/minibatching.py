"""Minibatching, the device half: one minibatch's buffers, and how many.

The host half (`host.minibatching`) writes minibatched buffers: per device
and stack, segment `k = s * M + m` of SparseCore `s` and minibatch `m`
(row pointers relative to the device's buffer). Here, per device inside
`shard_map`, `minibatch_inputs` cuts minibatch `m`'s segments out (traced
`m`) in the format of `plan.single_minibatch(plan)`, and `num_minibatches`
gives the count the devices loop over, the same on every device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES
from pz_sparsecore.core.preprocessed import PreprocessedInput


def _segment(buffers, k, per_sc, rpp):
  """Segment `k`'s buffers re-based at its start (traced)."""
  rp, ids, sids, gains = buffers
  ends = jax.lax.dynamic_slice(rp, (k * rpp,), (rpp,))
  previous = rp[jnp.maximum(k * rpp - 1, 0)]
  start = jnp.where(k == 0, 0, buffer_format.round_up(previous))

  def take(buf, fill):
    padded = jnp.concatenate([buf, jnp.full((per_sc,), fill, buf.dtype)])
    return jax.lax.dynamic_slice(padded, (start,), (per_sc,))

  return (
    ends - start,
    take(ids, buffer_format.PAD_ID),
    take(sids, buffer_format.PAD_ID),
    take(gains, buffer_format.PAD_GAIN),
  )


def minibatch_inputs(
  plan: plan_lib.Plan, inputs: PreprocessedInput, m: Any
) -> PreprocessedInput:
  """One device's minibatch `m` (traced) of minibatched `inputs`, in the
  buffer format of `plan_lib.single_minibatch(plan)` (per SparseCore, partitions
  relative to its segment)."""
  count = jnp.clip(
    jnp.reshape(inputs.num_minibatches, (-1,))[0], 1, MAX_MINIBATCHES
  )
  rpp = buffer_format.row_pointers_per_sc(plan.num_shards)
  fields = (
    "lhs_row_pointers",
    "lhs_embedding_ids",
    "lhs_sample_ids",
    "lhs_gains",
  )
  out: dict[str, dict[str, Any]] = {field: {} for field in fields}
  for stack in plan_lib.single_minibatch(plan).stacks:
    buffers = [jnp.reshape(getattr(inputs, f)[stack.name], -1) for f in fields]
    segments = [
      _segment(buffers, s * count + m, stack.coo_per_sc, rpp)
      for s in range(plan.num_sc_per_device)
    ]
    for i, field in enumerate(fields):
      out[field][stack.name] = jnp.concatenate([seg[i] for seg in segments])
  return PreprocessedInput(**out)


def num_minibatches(inputs: PreprocessedInput, axis: Any) -> jax.Array:
  """The number of minibatches the devices loop over (traced, inside
  `shard_map` over `axis`): the device's count, kept in `[1, 64]` and made
  the same on every device (the largest), so that hand-built buffers can
  neither index past the segments nor leave one device's collectives
  unanswered by another's."""
  count = jnp.reshape(inputs.num_minibatches, (-1,))[0].astype(jnp.int32)
  return jax.lax.pmax(jnp.clip(count, 1, MAX_MINIBATCHES), axis)
