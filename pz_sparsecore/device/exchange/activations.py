"""The activation exchange: partial activations cross devices, not rows.

Forward, per device, under `shard_map`:

1. *Route.* In each of its S segments the device cuts, for every owner `q`,
   the window that starts at the (8-aligned) start of partition `q*S` and is
   `W = S * r8(max_ids_per_partition)` entries long, the most those S
   partitions can hold. The windows of the ids, sample ids and gains and
   their S row pointers (rebased to the window start) go to their owners in
   one `all_to_all`, side by side (the gains' bits as int32).
2. *Look up.* The owner runs the FFI kernel over the `G*S` received windows
   against its own S shards, producing partial activations for every source
   device's samples: `[G, S*B_sc, D]`.
3. *Return.* A second `all_to_all` sends each source its partials; the
   source sums the G contributions into its `[S*B_sc, D]` activations and
   slices out each feature (its `n_f` samples at offset `row_offset / N` of
   every SparseCore block, its first `dim_f` columns).

Backward (the fused update), per device: the activation gradients of every
device are gathered (`all_gather`, `[G*S*B_sc, D]`, the same order as the
received windows; every owner needs every source's gradients, so an
`all_to_all` would move the same bytes), the windows are routed again, and
the FFI backward sums every referenced row's gradient over all windows and
applies the optimizer once to the row and its slots, in place. The full
table never leaves its devices; a step moves O(ids + batch x dim x G)
values, which is why the row exchange exists.

Example: G = 2, S = 1, max_ids = 8 (W = 8). Device 0's segment holds
partition 0 in `[0, 3)` and partition 1 in `[8, 10)`: its window for device
0 is entries `[0, 8)` with row pointer `[3]`, for device 1 entries `[8, 16)`
with row pointer `[2]`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core.buffer_format import routing_window
from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.device import kernels
from pz_sparsecore.device.exchange.base import (
  VALUE_BYTES,
  Buffers,
  ExchangeBytes,
  Sizes,
)

NAME = "activations"
CROSSES_DEVICES = True
"""Whether the mode moves data between devices (`auto` picks among those
that do; one device always uses `local`)."""


def route(stack: StackPlan, topo: Any, rp, ids, sids, gains):
  """Sends every owner its windows; returns the received `G*S` windows."""
  g, s = topo.num_devices, topo.num_sc_per_device
  n, w, c = topo.num_shards, stack.window, stack.coo_per_sc
  ends = rp.reshape(s, stack.row_pointers_per_sc)[:, :n]
  window_start = buffer_format.partition_starts(ends, jnp)[:, ::s]  # [S, G]
  pointers = ends.reshape(s, g, s) - window_start[:, :, None]
  index = (
    jnp.arange(s, dtype=jnp.int32)[:, None, None] * (c + w)
    + window_start[:, :, None]
    + jnp.arange(w, dtype=jnp.int32)
  )

  def windows(buf, fill):
    padded = jnp.concatenate(
      [buf.reshape(s, c), jnp.full((s, w), fill, buf.dtype)], axis=1
    )
    return jnp.take(padded.reshape(-1), index).swapaxes(0, 1)  # [G, S, W]

  # One all_to_all of the four buffers side by side: each collective costs
  # XLA a slice per device to compile.
  send = jnp.concatenate(
    [
      pointers.swapaxes(0, 1),
      windows(ids, buffer_format.PAD_ID),
      windows(sids, buffer_format.PAD_ID),
      jax.lax.bitcast_convert_type(
        windows(gains, buffer_format.PAD_GAIN), jnp.int32
      ),
    ],
    axis=2,
  )
  got = jax.lax.all_to_all(send, topo.axis, 0, 0, tiled=True)
  return (
    got[:, :, :s].reshape(-1),
    got[:, :, s : s + w].reshape(-1),
    got[:, :, s + w : s + 2 * w].reshape(-1),
    jax.lax.bitcast_convert_type(got[:, :, s + 2 * w :], gains.dtype).reshape(
      -1
    ),
  )


def kernel_shape(stack: StackPlan, topo: Any) -> dict[str, int]:
  """Kernel sizes of the owner's calls over the `G * S` received windows."""
  return dict(
    num_segments=topo.num_devices * topo.num_sc_per_device,
    samples_per_segment=stack.samples_per_sc,
    num_partitions=topo.num_sc_per_device,
    rows_per_partition=stack.rows_per_shard,
  )


def lookup(
  stack: StackPlan, topo: Any, table: jax.Array, buffers: Buffers
) -> jax.Array:
  """The local samples' activations `[S * B_sc, D]`: the owners' partial
  activations of every source's samples, returned and summed."""
  g, s, b = topo.num_devices, topo.num_sc_per_device, stack.samples_per_sc
  partial = kernels.sparse_dense_matmul(
    *route(stack, topo, *buffers),
    table,
    quantization=stack.quantization,
    **kernel_shape(stack, topo),
  ).reshape(g, s * b, stack.dim)
  return jax.lax.all_to_all(partial, topo.axis, 0, 0, tiled=True).sum(0)


def owner_operands(
  stack: StackPlan, topo: Any, buffers: Buffers, grad: jax.Array
) -> tuple[jax.Array, Buffers, dict[str, int]]:
  """Every device's activation gradients (gathered, in the order of the
  received windows: every owner needs every source's), the received
  windows and the kernel's sizes."""
  grad = jax.lax.all_gather(grad, topo.axis, axis=0, tiled=True)
  return grad, route(stack, topo, *buffers), kernel_shape(stack, topo)


def predicted_bytes(sizes: Sizes) -> ExchangeBytes:
  """Routing `4 G S (S + 3 W)`, forward and backward `4 G B D` each."""
  g, s = sizes.num_devices, sizes.num_sc_per_device
  window = routing_window(s, sizes.max_ids_per_partition)
  values = g * sizes.samples_per_device * sizes.dim
  return ExchangeBytes(
    routing=VALUE_BYTES * g * s * (s + 3 * window),
    forward=VALUE_BYTES * values,
    backward=VALUE_BYTES * values,
  )


def check_windows(segment: Any, starts: np.ndarray, ends: np.ndarray) -> None:
  """Each owner device's partitions fit the routing window."""
  s, window = segment.plan.num_sc_per_device, segment.stack.window
  for owner in range(segment.plan.num_devices):
    first, last = owner * s, owner * s + s - 1
    used = int(max(ends[last], starts[first]) - starts[first])
    if used > window:
      segment.fail(
        segment.stack_features,
        None,
        f"{used} entries (positions {starts[first]}..{ends[last]}) go to "
        f"device {owner}, more than its routing window of {window} "
        f"(num_sc_per_device x r8(max_ids_per_partition)); raise "
        "max_ids_per_partition or preprocess with preprocess()",
      )


def check_partition(segment: Any, partition: int, ids: Any) -> None:
  """Any number of distinct rows: partitions travel whole."""
  del segment, partition, ids
