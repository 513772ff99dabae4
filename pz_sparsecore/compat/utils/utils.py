"""jax-tpu-embedding's `utils/utils`: SparseCores per device, table formats.

On TPUs the count is the chip's. On CPU and GPU devices pz_sparsecore runs
"virtual" SparseCores: any count works, and this answers 4 (TPU v5p's), so a
program written for v5p computes the same layouts and buffers here.
"""

from __future__ import annotations

import jax

NUM_SC_PER_DEVICE_MAP = {
  "TPU v5": 4,
  "TPU v5p": 4,
  "TPU v6 lite": 2,
  "TPU7x": 2,
}
VIRTUAL_SC_PER_DEVICE = 4


def num_sparsecores_per_device(device: jax.Device | None = None) -> int:
  """SparseCores of `device` (default: the first device).

  Raises:
    ValueError: For a TPU without SparseCores, or an object with no
      `device_kind`.
  """
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", None)
  if kind is None:
    raise ValueError(f"Cannot determine device kind for device: {device}")
  if kind in NUM_SC_PER_DEVICE_MAP:
    return NUM_SC_PER_DEVICE_MAP[kind]
  if getattr(device, "platform", None) == "tpu":
    raise ValueError(f"Unknown sparsecore count for device kind: {kind}")
  return VIRTUAL_SC_PER_DEVICE


def embedding_table_format_with_sharding(
  sharding: jax.sharding.NamedSharding,
) -> jax.sharding.NamedSharding:
  """The placement of stacked tables, for `out_shardings` of a train step.

  Upstream adds the TPU SparseCore's tiled memory layout. Here tables keep
  XLA's default row-major layout, which the kernels read in place (a tiled
  one would make XLA copy the table before each kernel), so the sharding is
  the format.
  """
  return sharding


def embedding_table_format(
  mesh: jax.sharding.Mesh, partition_spec: jax.sharding.PartitionSpec
) -> jax.sharding.NamedSharding:
  """`embedding_table_format_with_sharding` of `NamedSharding(mesh, spec)`."""
  return embedding_table_format_with_sharding(
    jax.sharding.NamedSharding(mesh, partition_spec)
  )
