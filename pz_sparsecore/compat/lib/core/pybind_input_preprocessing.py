"""jax-tpu-embedding's `lib/core/pybind_input_preprocessing` over pz_sparsecore.

The functions take flat lists of features, weights and (compat or frozen)
specs, as upstream's extension does, and return its tuple:
`(row_pointers, embedding_ids, sample_ids, gains, num_minibatches, stats)`.
"""

from __future__ import annotations

from typing import Any

from pz_sparsecore.compat.lib.core._sharding import ShardingStrategy
from pz_sparsecore.compat.lib.nn import embedding
from pz_sparsecore.compat.lib.nn.embedding import (
  compute_coo_buffer_size_per_device,
  compute_row_pointers_size_per_device,
  compute_theoretical_max_coo_buffer_size,
)

__all__ = [
  "MinibatchingNode",
  "ShardingStrategy",
  "compute_coo_buffer_size_per_device",
  "compute_row_pointers_size_per_device",
  "compute_theoretical_max_coo_buffer_size",
  "preprocess_sparse_dense_matmul_input",
  "preprocess_sparse_dense_matmul_sparse_coo_input",
]


def _as_tuple(result: tuple[Any, Any]) -> tuple[Any, ...]:
  inputs, stats = result
  return (
    inputs.lhs_row_pointers,
    inputs.lhs_embedding_ids,
    inputs.lhs_sample_ids,
    inputs.lhs_gains,
    1
    if inputs.num_minibatches is None
    else int(inputs.num_minibatches.flat[0]),
    stats,
  )


class MinibatchingNode:
  """Upstream's minibatching peer: here, processes agree through JAX's
  collectives (`jax.distributed`), so the addresses and port are unused."""

  def __init__(
    self,
    task_id: int,
    num_tasks: int,
    server_addresses: Any = (),
    port: int = 0,
  ) -> None:
    if not 0 <= task_id < num_tasks:
      raise ValueError(f"task_id {task_id} is not in [0, {num_tasks})")
    self.task_id, self.num_tasks = task_id, num_tasks

  def get_all_reduce_interface(self) -> Any:
    """The `minibatching.AllReduce` to pass as `all_reduce_interface`."""
    return embedding.get_all_reduce_interface()


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
