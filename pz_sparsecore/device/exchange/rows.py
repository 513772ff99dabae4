"""The row exchange: distinct rows cross devices, not partial activations.

Per device, under `shard_map` over the sharding axis (`G` devices, `S`
SparseCores each, `N = G * S` partitions, `Wu = S * cap` with
`cap = r8(max_unique_ids_per_partition)`):

1. *Distinct rows.* In each local segment `k` the entries of a partition are
   sorted by row, so an entry starts a new distinct row when its row differs
   from the previous entry's. Partition `p` (owner `q = p // S`, local
   partition `j = p % S`) keeps its first `cap` distinct rows; they are
   packed into the window of `(k, q)`, partition after partition, each
   starting at a multiple of 8, as the buffer format lays partitions out.
   Every entry learns its slot `k * Wu + i`, `i` its row's place in the
   window.
2. *Forward.* The windows (`[G, S, Wu]` ids plus `[G, S, S]` row pointers)
   go to their owners in one `all_to_all`; the owner reads the rows with the
   forward kernel (gain 1, one "sample" per slot) and returns them
   (`[G, S, Wu, D]`). The source runs the forward kernel again over its own
   entries against the returned rows, viewed as a table of `G` partitions
   of `S * Wu` rows with the entries' slots as ids: the activations.
3. *Backward.* The source sums each slot's gradient `sum(gain * grad)` over
   its entries (the backward kernel's SGD step with learning rate -1 on a
   zero table is exactly that sum), sends the sums and the windows again,
   and the owner applies the fused update over the `G * S` received windows
   with gain 1: every row's gradient is summed over all sources before the
   optimizer runs once on it.

Traffic per device is `O(G * Wu * D)`: with limits that follow the load it
stays near the local distinct ids times D whatever G is.

Example: G = 2, S = 1, cap = 8. Segment 0 holds partition 0 rows
`[3, 3, 5]` in entries `[0, 3)` and partition 1 rows `[2, 7, 7]` in
`[8, 11)`. The window for owner 0 is `[3, 5, PAD x 6]` with row pointer
`[2]`, for owner 1 `[2, 7, PAD x 6]` with `[2]`; the entries' slots are
`[0, 0, 1]` and `[0, 1, 1]`: the source reads the rows owner `q` returned
as partition `q` of the returned rows, so slots count from 0 per owner.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.device import kernels
from pz_sparsecore.device.exchange.base import (
  VALUE_BYTES,
  Buffers,
  ExchangeBytes,
  Sizes,
  own_buffer_shape,
)
from pz_sparsecore.device.kernels import reference

NAME = "rows"
CROSSES_DEVICES = True
"""Whether the mode moves data between devices (`auto` picks among those
that do; one device always uses `local`)."""


class Routing(NamedTuple):
  """One device's row-exchange routing of one stack.

  Attributes:
    window_ids: int32 `[G, S, Wu]`, per owner and local segment, the
      distinct rows asked of it (`PAD_ID` in gaps).
    window_pointers: int32 `[G, S, S]`, their row pointers (per owner
      partition, relative to the window).
    entry_ids: int32 `[S * C]`, per local entry its slot in the returned
      rows of its owner (`k * Wu + position`), or `PAD_ID`.
    group_pointers: int32 `[S * G]`, per segment the end of each owner's
      last partition: the owners' entry ranges.
  """

  window_ids: jax.Array
  window_pointers: jax.Array
  entry_ids: jax.Array
  group_pointers: jax.Array


def route(stack: StackPlan, g: int, s: int, rp, ids, sids) -> Routing:
  """Finds the distinct rows of the local segments and packs the windows."""
  n, c, v = g * s, stack.coo_per_sc, stack.rows_per_shard
  wu = stack.unique_window
  cap = wu // s
  shape = own_buffer_shape(stack, g, s)
  valid, table_row, _ = reference.decode_entries(rp, ids, sids, shape)
  valid, table_row = valid.reshape(s, c), table_row.reshape(s, c)
  previous = jnp.pad(table_row[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  new = (valid & (table_row != previous)).astype(jnp.int32)
  part = jnp.where(valid, table_row // v, n)  # n: no partition.
  segment = jnp.arange(s, dtype=jnp.int32)[:, None]
  counts = jnp.zeros((s, n + 1), jnp.int32).at[segment, part].add(new)
  before = jnp.cumsum(counts, axis=1) - counts
  rank = jnp.cumsum(new, axis=1) - 1 - jnp.take_along_axis(before, part, 1)
  kept = jnp.minimum(counts[:, :n], cap).reshape(s, g, s)
  aligned = buffer_format.round_up(kept)
  starts = (jnp.cumsum(aligned, axis=2) - aligned).reshape(s, n)
  slot = jnp.take_along_axis(jnp.pad(starts, ((0, 0), (0, 1))), part, 1) + rank
  ok = valid & (rank < cap)
  owner = part // s
  dest = jnp.where(
    (new > 0) & ok, (segment * g + owner) * wu + slot, s * g * wu
  )
  window_ids = (
    jnp.full((s * g * wu,), buffer_format.PAD_ID, jnp.int32)
    .at[dest.reshape(-1)]
    .set((table_row % v).reshape(-1), mode="drop")
    .reshape(s, g, wu)
  )
  ends = jnp.clip(rp.reshape(s, -1)[:, :n], 0, c).reshape(s, g, s)
  return Routing(
    window_ids=window_ids.swapaxes(0, 1),
    window_pointers=(starts.reshape(s, g, s) + kept).swapaxes(0, 1),
    entry_ids=jnp.where(ok, segment * wu + slot, buffer_format.PAD_ID).reshape(
      -1
    ),
    group_pointers=ends[:, :, -1].reshape(-1),
  )


def exchange(routing: Routing, axis) -> tuple[jax.Array, jax.Array]:
  """Each owner's received windows: `[G * S * S]` pointers, `[G*S*Wu]` ids.

  One `all_to_all` of both side by side (every collective costs XLA a
  slice per device to compile)."""
  s = routing.window_pointers.shape[-1]
  sent = jnp.concatenate([routing.window_pointers, routing.window_ids], axis=2)
  got = jax.lax.all_to_all(sent, axis, 0, 0, tiled=True)
  return got[:, :, :s].reshape(-1), got[:, :, s:].reshape(-1)


def owner_buffers(pointers: jax.Array, ids: jax.Array, wu: int):
  """The received windows as kernel buffers: one slot per sample, gain 1."""
  segments = ids.shape[0] // wu
  slots = jnp.tile(jnp.arange(wu, dtype=jnp.int32), segments)
  return pointers, ids, slots, jnp.ones(ids.shape, jnp.float32)


def owner_shape(stack: StackPlan, g: int, s: int) -> dict[str, int]:
  """Kernel sizes of the owner's calls over the `G * S` received windows."""
  return dict(
    num_segments=g * s,
    samples_per_segment=stack.unique_window,
    num_partitions=s,
    rows_per_partition=stack.rows_per_shard,
  )


def _source_shape(stack: StackPlan, g: int, s: int) -> dict[str, int]:
  """Kernel sizes of the source's calls against the returned rows."""
  return dict(
    num_segments=s,
    samples_per_segment=stack.samples_per_sc,
    num_partitions=g,
    rows_per_partition=s * stack.unique_window,
  )


def lookup(
  stack: StackPlan, topo: Any, table: jax.Array, buffers: Buffers
) -> jax.Array:
  """The local samples' activations `[S * B_sc, D]` by the row exchange."""
  g, s, axis = topo.num_devices, topo.num_sc_per_device, topo.axis
  rp, ids, sids, gains = buffers
  routing = route(stack, g, s, rp, ids, sids)
  wu = stack.unique_window
  received = owner_buffers(*exchange(routing, axis), wu)
  # The owners read their rows (quantized, for a quantized stack); the
  # sources then combine the rows they get back.
  rows = kernels.sparse_dense_matmul(
    *received,
    table,
    quantization=stack.quantization,
    **owner_shape(stack, g, s),
  ).reshape(g, s, wu, stack.dim)
  returned = jax.lax.all_to_all(rows, axis, 0, 0, tiled=True)
  return kernels.sparse_dense_matmul(
    routing.group_pointers,
    routing.entry_ids,
    sids,
    gains,
    returned.reshape(g, s * wu, stack.dim),
    **_source_shape(stack, g, s),
  )


def owner_operands(
  stack: StackPlan, topo: Any, buffers: Buffers, grad: jax.Array
) -> tuple[jax.Array, Buffers, dict[str, int]]:
  """What the owner's fused update reads: `(grad, buffers, sizes)`.

  Args:
    stack: The stack's plan.
    topo: The topology (devices, SparseCores, the sharding axis).
    buffers: The local row pointers, ids, sample ids and gains.
    grad: `[S * B_sc, D]` gradient of the local samples' activations.

  Returns:
    The per-slot gradient sums every source sent this owner, the received
    windows as kernel buffers, and the kernel's sizes.
  """
  g, s, axis = topo.num_devices, topo.num_sc_per_device, topo.axis
  rp, ids, sids, gains = buffers
  routing = route(stack, g, s, rp, ids, sids)
  wu = stack.unique_window
  zeros = jnp.zeros((g, s * wu, stack.dim), jnp.float32)
  # SGD with learning rate -1 from zero rows: each slot's row becomes
  # exactly sum(gain * grad) over the entries that reference it.
  sums, _ = kernels.sparse_dense_matmul_grad(
    grad,
    routing.group_pointers,
    routing.entry_ids,
    sids,
    gains,
    zeros,
    (),
    optimizer="sgd",
    hyperparameters=jnp.full((1,), -1.0, jnp.float32),
    **_source_shape(stack, g, s),
  )
  sent = jax.lax.all_to_all(
    sums.reshape(g, s, wu, stack.dim), axis, 0, 0, tiled=True
  )
  buffers = owner_buffers(*exchange(routing, axis), wu)
  return sent.reshape(-1, stack.dim), buffers, owner_shape(stack, g, s)


def predicted_bytes(sizes: Sizes) -> ExchangeBytes:
  """Routing `4 G S (S + Wu)`, forward and backward `4 G S Wu D` each."""
  g, s = sizes.num_devices, sizes.num_sc_per_device
  window = buffer_format.routing_window(s, sizes.max_unique_ids_per_partition)
  values = g * s * window * sizes.dim
  return ExchangeBytes(
    routing=VALUE_BYTES * g * s * (s + window),
    forward=VALUE_BYTES * values,
    backward=VALUE_BYTES * values,
  )


def check_windows(segment: Any, starts: Any, ends: Any) -> None:
  """Partitions need not fit a routing window: distinct rows travel."""
  del segment, starts, ends


def check_partition(segment: Any, partition: int, ids: np.ndarray) -> None:
  """The partition's distinct rows fit the row exchange's window."""
  cap = segment.stack.unique_window // segment.plan.num_sc_per_device
  distinct = int(np.count_nonzero(np.diff(ids))) + 1
  if distinct > cap:
    segment.fail(
      segment.stack_features,
      partition,
      f"{distinct} distinct rows, more than the row exchange's window of "
      f"{cap} (r8(max_unique_ids_per_partition)); raise "
      "max_unique_ids_per_partition or preprocess with preprocess()",
    )
