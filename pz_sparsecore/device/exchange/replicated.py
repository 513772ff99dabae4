"""The replicated placement: every device holds the whole stack.

A small stack costs little memory on every device and saves the exchange:
its `[N, V_shard, D]` array (the same MOD layout, buffers, limits and
checkpoints as a sharded stack's) is replicated over the shard axis
instead of split over it.

Forward, per device: the kernel reads the device's own `S` segments against
all `N` partitions, which are local; nothing crosses devices.

Backward (the fused update), per device:

1. *Local sums.* The device sums its entries' gradients per row,
   `sum(gain * grad)` (the backward kernel's SGD step with learning rate -1
   on a zero table, as the row exchange does), into a `[N * V_shard, D]`
   array, and marks the rows its entries reference.
2. *All-reduce.* Both are summed over the devices (`psum`): every device
   now holds each row's gradient over the whole batch and which rows the
   batch references, `4 N V_shard (D + 1)` bytes, however large the batch.
3. *Update.* Every device runs the fused update on its copy with one
   entry per referenced row (one segment in the buffer format: partition
   `p` holds its referenced rows in order, gain 1, the row's sum as its
   sample's gradient): the optimizer runs once per referenced row and
   never touches the others, the same arithmetic on every device, so the
   copies stay equal.

The traffic is a stack's size, not its batch's: the placement pays for
small tables that many ids hit (`replication`'s cost model weighs it
against the sharded exchanges); its price is `G - 1` more copies of the
rows and slots.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.device import kernels
from pz_sparsecore.device.exchange import local
from pz_sparsecore.device.exchange.base import (
  VALUE_BYTES,
  Buffers,
  ExchangeBytes,
  Sizes,
  own_buffer_shape,
)
from pz_sparsecore.device.kernels import reference

NAME = "replicated"
CROSSES_DEVICES = True
"""Whether the mode moves data between devices."""
SHARDED = False
"""A placement, not a way to exchange a sharded stack: `auto` never picks
it; a layer's placement does (`Topology.replicated`)."""


# The forward is the local one: the device's `S` segments against all `N`
# partitions, which its copy holds.
kernel_shape = local.kernel_shape
lookup = local.lookup


def owner_operands(
  stack: StackPlan, topo: Any, buffers: Buffers, grad: jax.Array
) -> tuple[jax.Array, Buffers, dict[str, int]]:
  """Every row's gradient over all devices, summed, and buffers with one
  entry per row the batch references, for the same update on every copy."""
  n, v, d = topo.num_shards, stack.rows_per_shard, stack.dim
  s = topo.num_sc_per_device
  rp, ids, sids, gains = buffers
  # SGD with learning rate -1 from zero rows: each row becomes exactly
  # sum(gain * grad) over the device's entries that reference it.
  sums, _ = kernels.sparse_dense_matmul_grad(
    grad,
    rp,
    ids,
    sids,
    gains,
    jnp.zeros((n, v, d), jnp.float32),
    (),
    optimizer="sgd",
    hyperparameters=jnp.full((1,), -1.0, jnp.float32),
    **kernel_shape(stack, topo),
  )
  shape = own_buffer_shape(stack, topo.num_devices, s)
  valid, row, _ = reference.decode_entries(rp, ids, sids, shape)
  referenced = (
    jnp.zeros((n * v,), jnp.int32)
    .at[jnp.where(valid, row, n * v)]
    .set(1, mode="drop")
  )
  sums = jax.lax.psum(sums.reshape(n * v, d), topo.axis)
  referenced = jax.lax.psum(referenced, topo.axis).reshape(n, v) > 0
  # One segment: partition p's referenced rows in order from the 8-aligned
  # end of partition p - 1 (at most n * v entries: v is a multiple of 8).
  counts = jnp.sum(referenced, axis=1, dtype=jnp.int32)
  aligned = buffer_format.round_up(counts)
  starts = jnp.cumsum(aligned) - aligned
  rank = jnp.cumsum(referenced, axis=1, dtype=jnp.int32) - 1
  dest = jnp.where(referenced, starts[:, None] + rank, n * v).reshape(-1)
  local_row = jnp.tile(jnp.arange(v, dtype=jnp.int32), n)

  def entries(values, fill):
    return (
      jnp.full((n * v,), fill, values.dtype).at[dest].set(values, mode="drop")
    )

  ends = starts + counts
  pointers = jnp.concatenate(
    [ends, jnp.full((max(n, 8) - n,), ends[-1], jnp.int32)]
  )
  update_buffers = (
    pointers,
    entries(local_row, buffer_format.PAD_ID),
    entries(jnp.arange(n * v, dtype=jnp.int32), buffer_format.PAD_ID),
    entries(jnp.ones((n * v,), jnp.float32), buffer_format.PAD_GAIN),
  )
  return (
    sums,
    update_buffers,
    dict(
      num_segments=1,
      samples_per_segment=n * v,
      num_partitions=n,
      rows_per_partition=v,
    ),
  )


def predicted_bytes(sizes: Sizes) -> ExchangeBytes:
  """No routing, no forward; the backward all-reduces `4 R (D + 1)`
  (`R = sizes.table_rows`, the stack's rows: `N * V_shard`)."""
  if sizes.table_rows <= 0:
    raise ValueError("the replicated placement's bytes need table_rows")
  return ExchangeBytes(
    routing=0,
    forward=0,
    backward=VALUE_BYTES * sizes.table_rows * (sizes.dim + 1),
  )


# No windows: every partition is read where it lies, as on one device.
check_windows = local.check_windows
check_partition = local.check_partition
