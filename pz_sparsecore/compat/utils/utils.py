"""jax-tpu-embedding's `utils/utils`: SparseCores per device, table formats,
MOD sharding of one table.

On TPUs the count is the chip's. On CPU and GPU devices pz_sparsecore runs
"virtual" SparseCores: any count works, and this answers 4 (TPU v5p's), so a
program written for v5p computes the same layouts and buffers here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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


def _xp(table: Any) -> Any:
  return np if isinstance(table, np.ndarray) else jnp


def _check_mod(sharding_strategy: str) -> None:
  if sharding_strategy != "MOD":
    raise ValueError("Currently only MOD sharding strategy is supported")


def shard_emb_table(
  table: Any,
  *,
  num_devices: int,
  num_sc_per_device: int,
  sharding_strategy: str = "MOD",
) -> Any:
  """MOD-shards one `[vocab, dim]` table: `[num_devices, S * vocab / N,
  dim]`, row `r` on shard `r % N` at place `r // N` (N = devices x S),
  device `c` holding shards `c * S` to `c * S + S - 1`.

  Raises:
    ValueError: Unless the strategy is MOD and N divides the vocabulary.
  """
  _check_mod(sharding_strategy)
  xp = _xp(table)
  vocab, dim = table.shape
  n = num_devices * num_sc_per_device
  if vocab % n:
    raise ValueError(
      f"a table of {vocab} rows does not split over {num_devices} devices x "
      f"{num_sc_per_device} SparseCores ({n} shards)"
    )
  rows = xp.reshape(table, (vocab // n, num_devices, num_sc_per_device, dim))
  return xp.reshape(xp.transpose(rows, (1, 2, 0, 3)), (num_devices, -1, dim))


def unshard_emb_table(
  sharded_table: Any, num_sc_per_device: int, sharding_strategy: str = "MOD"
) -> Any:
  """The `[vocab, dim]` table of `shard_emb_table`'s `[devices, S * vocab /
  N, dim]`.

  Raises:
    ValueError: Unless the strategy is MOD and S divides the rows per
      device.
  """
  _check_mod(sharding_strategy)
  xp = _xp(sharded_table)
  devices, per_device, dim = sharded_table.shape
  if per_device % num_sc_per_device:
    raise ValueError(
      f"{per_device} rows per device do not split over "
      f"{num_sc_per_device} SparseCores"
    )
  shards = xp.reshape(sharded_table, (devices, num_sc_per_device, -1, dim))
  return xp.reshape(xp.transpose(shards, (2, 0, 1, 3)), (-1, dim))
