"""jax-tpu-embedding's `utils/utils`: SparseCores per device, table formats,
MOD sharding of one table.

On TPUs the count is the chip's. On CPU and GPU devices pz_sparsecore runs
"virtual" SparseCores: any count works, and this answers 4 (TPU v5p's), so a
program written for v5p computes the same layouts and buffers here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore.core.buffer_format import ALIGNMENT

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


# Upstream's estimate of a stack's preprocessing limits, calibrated on Zipf-
# like id distributions: a share of every SparseCore's lookups lands on its
# hottest destination, the rest spreads evenly, two standard deviations of
# Poisson noise on top; the COO buffer holds the ids plus 20% and a fixed
# allowance per SparseCore.
_EVEN_NOISE_SIGMAS = 2.0
_UNIQUE_SHARE = 0.5
_BUFFER_MARGIN = 1.2
_BUFFER_ENTRIES_PER_SPARSECORE = 14


def _ceil_to(value: float, multiple: int) -> int:
  return int(math.ceil(value / multiple)) * multiple


def estimate_preprocessing_parameters(
  *,
  global_batch_size: int,
  global_device_count: int,
  num_sc_per_device: int,
  valency: float,
  hot_shard_fraction: float = 0.20,
  headroom_factor: float = 1.25,
) -> dict[str, int]:
  """Starting limits for a stack before FDO has measured any batch.

  With `B` samples per SparseCore (`global_batch_size / devices / S`),
  `N = devices * S` SparseCores and `L = B * valency` lookups per
  SparseCore, the busiest partition expects `hot * L + (1 - hot) * L / N +
  2 * sqrt(L / N)` ids; times `headroom_factor`, rounded up to 8, that is
  `max_ids_per_partition`, and half of it `max_unique_ids_per_partition`.
  A device's COO buffer holds `max(S * max_ids, 1.2 * B * S * valency + 14
  * N)` entries, rounded up to `8 * S`.

  Example: 4096 samples on 4 devices x 4 SparseCores, valency 10: `L =
  2560`, the busiest partition `1.25 * (512 + 128 + 25.3) = 831.6` ->
  `max_ids_per_partition` 832, unique 416, buffer `max(3328, 12512)` ->
  12512 (already a multiple of 32).

  Args:
    global_batch_size: Samples of a step over all devices.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: SparseCores per device (`S`).
    valency: Average ids per sample, summed over the stack's features.
    hot_shard_fraction: The share of a SparseCore's lookups that go to its
      busiest destination.
    headroom_factor: The margin over the expected busiest partition.

  Returns:
    `max_ids_per_partition`, `max_unique_ids_per_partition` and
    `suggested_coo_buffer_size_per_device`.

  Raises:
    ValueError: If a count or the valency is not positive.
  """
  for name, value in (
    ("global_batch_size", global_batch_size),
    ("global_device_count", global_device_count),
    ("num_sc_per_device", num_sc_per_device),
    ("valency", valency),
  ):
    if not value > 0:
      raise ValueError(
        f"estimate_preprocessing_parameters: {name} must be positive, got "
        f"{value!r} (global_batch_size, global_device_count, "
        "num_sc_per_device, and valency must all be positive numbers)"
      )
  samples_per_device = global_batch_size // global_device_count
  samples_per_sc = samples_per_device // num_sc_per_device
  sparsecores = global_device_count * num_sc_per_device
  lookups = samples_per_sc * valency
  busiest = (
    hot_shard_fraction * lookups
    + (1.0 - hot_shard_fraction) * lookups / sparsecores
    + _EVEN_NOISE_SIGMAS * math.sqrt(lookups / sparsecores)
  ) * headroom_factor
  max_ids = _ceil_to(busiest, ALIGNMENT)
  buffer = max(
    num_sc_per_device * max_ids,
    _BUFFER_MARGIN * samples_per_device * valency
    + _BUFFER_ENTRIES_PER_SPARSECORE * sparsecores,
  )
  return {
    "max_ids_per_partition": max_ids,
    "max_unique_ids_per_partition": _ceil_to(
      _UNIQUE_SHARE * busiest, ALIGNMENT
    ),
    "suggested_coo_buffer_size_per_device": _ceil_to(
      buffer, ALIGNMENT * num_sc_per_device
    ),
  }
