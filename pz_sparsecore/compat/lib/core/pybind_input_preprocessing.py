"""jax-tpu-embedding's `lib/core/pybind_input_preprocessing` over pz_sparsecore.

The functions take flat lists of features, weights and (compat or frozen)
specs, as upstream's extension does, and return its tuple:
`(row_pointers, embedding_ids, sample_ids, gains, num_minibatches, stats)`.
"""

from __future__ import annotations

import enum
from typing import Any

from pz_sparsecore import buffer_format
from pz_sparsecore.compat.lib.nn import embedding

__all__ = [
  "ShardingStrategy",
  "compute_coo_buffer_size_per_device",
  "compute_row_pointers_size_per_device",
  "compute_theoretical_max_coo_buffer_size",
  "preprocess_sparse_dense_matmul_input",
  "preprocess_sparse_dense_matmul_sparse_coo_input",
]


class ShardingStrategy(enum.Enum):
  """How table rows are spread over SparseCores (MOD only)."""

  MOD = 1


def _as_tuple(result: tuple[Any, Any]) -> tuple[Any, ...]:
  inputs, stats = result
  return (
    inputs.lhs_row_pointers,
    inputs.lhs_embedding_ids,
    inputs.lhs_sample_ids,
    inputs.lhs_gains,
    1,
    stats,
  )


def preprocess_sparse_dense_matmul_input(
  features: Any,
  feature_weights: Any = None,
  feature_specs: Any = None,
  local_device_count: int = 1,
  global_device_count: int = 1,
  **kwargs: Any,
) -> tuple[Any, ...]:
  """Preprocesses flat lists of features (see `embedding`'s function)."""
  return _as_tuple(
    embedding.preprocess_sparse_dense_matmul_input(
      list(features),
      None if feature_weights is None else list(feature_weights),
      list(feature_specs),
      local_device_count,
      global_device_count,
      **kwargs,
    )
  )


def preprocess_sparse_dense_matmul_sparse_coo_input(
  indices: Any,
  values: Any,
  dense_shapes: Any,
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  **kwargs: Any,
) -> tuple[Any, ...]:
  """Preprocesses flat lists of COO features."""
  return _as_tuple(
    embedding.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      list(indices),
      list(values),
      list(dense_shapes),
      list(feature_specs),
      local_device_count,
      global_device_count,
      **kwargs,
    )
  )


def compute_row_pointers_size_per_device(
  *, global_device_count: int, num_sc_per_device: int, **kwargs: Any
) -> int:
  """Row pointers per device: `max(N, 8)` per SparseCore."""
  del kwargs
  return buffer_format.compute_row_pointers_size_per_device(
    global_device_count, num_sc_per_device
  )


def compute_theoretical_max_coo_buffer_size(
  *,
  max_ids_per_partition: int,
  global_device_count: int,
  num_sc_per_device: int,
  **kwargs: Any,
) -> int:
  """The largest COO buffer per device the limit can need."""
  del kwargs
  return buffer_format.compute_theoretical_max_coo_buffer_size(
    max_ids_per_partition, global_device_count, num_sc_per_device
  )


def compute_coo_buffer_size_per_device(
  feature_specs: Any,
  *,
  global_device_count: int,
  num_sc_per_device: int,
  **kwargs: Any,
) -> dict[str, int]:
  """Stack name -> COO buffer length per device."""
  del kwargs
  return embedding.compute_coo_buffer_size_per_device(
    list(feature_specs), global_device_count, num_sc_per_device
  )
