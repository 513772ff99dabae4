"""Preprocessing sparse COO id batches (`host.coo_input` reads them).

`preprocess_sparse_dense_matmul_input_from_sparse_tensor` (also reachable
as `preprocess_sparse_dense_matmul_sparse_coo_input`, the name of
jax-tpu-embedding's binding) takes one `(indices, values, dense_shape)`
triple per feature and returns what
`preprocess.preprocess_sparse_dense_matmul_input` returns for the same rows.
"""

from __future__ import annotations

from typing import Any

import jax

from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.host import coo_input, preprocess, ragged_input


def strategy_name(sharding_strategy: Any) -> str:
  """The name of a sharding strategy given as a string or an enum member."""
  return getattr(sharding_strategy, "name", sharding_strategy)


def preprocess_sparse_dense_matmul_input_from_sparse_tensor(
  indices: Any,
  values: Any,
  dense_shapes: Any,
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  *,
  num_sc_per_device: int,
  sharding_strategy: Any = "MOD",
  has_leading_dimension: bool = False,
  allow_id_dropping: bool = False,
  batch_number: int = 0,
  enable_minibatching: bool = False,
  all_reduce_interface: Any = None,
) -> tuple[
  preprocess.PreprocessedInput, preprocess.SparseDenseMatmulInputStats
]:
  """`preprocess_sparse_dense_matmul_input` for COO id batches.

  Every id weighs 1. The result equals that of the same rows given as a
  ragged batch to `preprocess_sparse_dense_matmul_input` with
  `features_weights=None`.

  Args:
    indices: A pytree like `feature_specs` of integer `[n, 2]` (sample,
      position) arrays, in any order, no position twice.
    values: Like `indices`: the `[n]` ids at those positions (any integer
      dtype).
    dense_shapes: Like `indices`: `[batch, k]` per feature; `batch` is the
      feature's process-local batch (rows with no entry are empty).
    feature_specs: A pytree of prepared `FeatureSpec`s.
    local_device_count: Devices of this process.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: (Virtual) SparseCores per device.
    sharding_strategy: Only "MOD" (or an enum member named MOD).
    has_leading_dimension: Give the buffers a leading device axis.
    allow_id_dropping: Drop ids over the limits instead of raising.
    batch_number: The batch's index (unused; kept for compatibility).
    enable_minibatching: Minibatched buffers (`minibatching`).
    all_reduce_interface: How processes agree on a minibatching split
      (`preprocess_sparse_dense_matmul_input`'s `all_reduce`).

  Returns:
    The `PreprocessedInput` buffers and the `SparseDenseMatmulInputStats`.

  Raises:
    ValueError: As `preprocess_sparse_dense_matmul_input`; on a malformed
      COO batch (naming the feature and the value).
  """
  strategy = strategy_name(sharding_strategy)
  plan = plan_lib.build(
    feature_specs, global_device_count, num_sc_per_device, for_tables=False
  )
  trees = [
    ragged_input.leaves_like(plan.treedef, tree, what)
    for tree, what in (
      (indices, "indices"),
      (values, "values"),
      (dense_shapes, "dense_shapes"),
    )
  ]
  rows = [
    coo_input.coo_rows(spec.name, *leaves)[0]
    for spec, *leaves in zip(plan.feature_specs, *trees, strict=True)
  ]
  return preprocess.preprocess_sparse_dense_matmul_input(
    jax.tree.unflatten(plan.treedef, rows),
    None,
    feature_specs,
    local_device_count,
    global_device_count,
    num_sc_per_device=num_sc_per_device,
    sharding_strategy=strategy,
    has_leading_dimension=has_leading_dimension,
    allow_id_dropping=allow_id_dropping,
    batch_number=batch_number,
    enable_minibatching=enable_minibatching,
    all_reduce=all_reduce_interface,
  )


preprocess_sparse_dense_matmul_sparse_coo_input = (
  preprocess_sparse_dense_matmul_input_from_sparse_tensor
)
"""The same function under the name of jax-tpu-embedding's binding."""


__all__ = [
  "preprocess_sparse_dense_matmul_input_from_sparse_tensor",
  "preprocess_sparse_dense_matmul_sparse_coo_input",
]
