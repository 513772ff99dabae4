"""The local exchange: one device holds every shard, nothing crosses.

The device's own buffers go straight to the kernels: its `S` segments
against its `N = S` partitions.
"""

from __future__ import annotations

from typing import Any

import jax

from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.device import kernels
from pz_sparsecore.device.exchange.base import Buffers, ExchangeBytes, Sizes

NAME = "local"
CROSSES_DEVICES = False
"""Whether the mode moves data between devices (`auto` picks among those
that do; one device always uses `local`)."""


def kernel_shape(stack: StackPlan, topo: Any) -> dict[str, int]:
  """Kernel sizes of the device's segments against its own shards."""
  return dict(
    num_segments=topo.num_sc_per_device,
    samples_per_segment=stack.samples_per_sc,
    num_partitions=topo.num_shards,
    rows_per_partition=stack.rows_per_shard,
  )


def lookup(
  stack: StackPlan,
  topo: Any,
  table: jax.Array,
  buffers: Buffers,
  sample_order: jax.Array | None = None,
) -> jax.Array:
  """The device's activations `[S * B_sc, D]` (`sample_order`: the
  preprocessor's, see `kernels.sparse_dense_matmul`)."""
  return kernels.sparse_dense_matmul(
    *buffers,
    table,
    quantization=stack.quantization,
    sample_order=sample_order,
    **kernel_shape(stack, topo),
  )


def owner_operands(
  stack: StackPlan, topo: Any, buffers: Buffers, grad: jax.Array
) -> tuple[jax.Array, Buffers, dict[str, int]]:
  """The fused update reads the device's own gradient and buffers."""
  return grad, buffers, kernel_shape(stack, topo)


def predicted_bytes(sizes: Sizes) -> ExchangeBytes:
  """Nothing crosses devices."""
  del sizes
  return ExchangeBytes(0, 0, 0)


def check_windows(segment: Any, starts: Any, ends: Any) -> None:
  """No windows: every partition is read where it lies."""
  del segment, starts, ends


def check_partition(segment: Any, partition: int, ids: Any) -> None:
  """No windows: any number of distinct rows."""
  del segment, partition, ids
