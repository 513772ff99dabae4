"""jax-tpu-embedding's `lib/nn/embedding_pipelining_utils` over pz_sparsecore.

The pipelined step (batch t-2's row update, batch t's lookup and batch
t-1's dense stage in one step, one step of staleness in the tables) is
`pz_sparsecore.nn.pipelining`, whose docstring states the schedule; this
module gives it upstream's names and upstream's default SparseCore stages,
`embedding.tpu_sparse_dense_matmul(_grad)` in a `jax.shard_map` over a 1-D
mesh. The state classes are frozen pytree dataclasses with `replace`, as
upstream's Flax `PyTreeNode`s (Flax is not needed). See docs/compat.md,
"Pipelining".
"""

from __future__ import annotations

import functools
import types
from typing import Any, TypeAlias

import jax

from pz_sparsecore.compat.lib.nn import embedding, embedding_spec
from pz_sparsecore.nn.pipelining import (
  CurrentStepInput,
  LastStepInput,
  PipelineState,
  ScBwdStageFun,
  ScFwdStageFun,
  StepBeforeLastStepInput,
  TcStageFun,
  get_initial_state,
  get_pipeline_state_sharding,
  get_pipeline_train_steps,
  is_output_valid,
  step,
)
from pz_sparsecore.nn.pipelining import _safe_copy as _safe_copy

__all__ = [
  "CurrentStepInput",
  "DefaultEmbeddingActivations",
  "DefaultEmbeddingGradients",
  "DefaultScBwdAux",
  "DefaultScFwdAux",
  "DefaultSparseInputs",
  "DefaultTcAux",
  "LastStepInput",
  "NestedArray",
  "NestedEmbeddingVariables",
  "NestedFeatureSpecs",
  "PipelineState",
  "ScBwdStageFun",
  "ScFwdStageFun",
  "ShardedLastStepInput",
  "ShardedStepBeforeLastStepInput",
  "Sharding",
  "StepBeforeLastStepInput",
  "TcStageFun",
  "get_default_sc_bwd_function",
  "get_default_sc_fwd_function",
  "get_initial_state",
  "get_pipeline_state_sharding",
  "get_pipeline_train_steps",
  "is_output_valid",
  "step",
]

Sharding: TypeAlias = jax.sharding.Sharding
ShardedLastStepInput: TypeAlias = LastStepInput
ShardedStepBeforeLastStepInput: TypeAlias = StepBeforeLastStepInput

NestedArray = embedding.Nested[jax.Array]
NestedFeatureSpecs = embedding.Nested[embedding_spec.FeatureSpec]
NestedEmbeddingVariables = embedding.Nested[embedding.EmbeddingVariables]

DefaultSparseInputs = embedding.PreprocessedInput
DefaultEmbeddingActivations = NestedArray | None
DefaultEmbeddingGradients = jax.Array | None
DefaultScFwdAux = types.NoneType
DefaultTcAux = types.NoneType
DefaultScBwdAux = types.NoneType


def _mesh_axis(global_mesh: jax.sharding.Mesh) -> str:
  """The one axis of `global_mesh`: the tables' and the batch's."""
  if len(global_mesh.shape) != 1:
    raise ValueError(
      f"global_mesh must be 1d, got {len(global_mesh.shape)} axes "
      f"{tuple(global_mesh.axis_names)}"
    )
  return global_mesh.axis_names[0]


def _on_mesh(fn: Any, mesh: jax.sharding.Mesh, num_args: int, out: Any):
  """`fn` in a `shard_map`: the buffers and gradients split over the axis,
  the tables and slots split by rows (`P(axis, None)`)."""
  axis = _mesh_axis(mesh)
  rows = jax.sharding.PartitionSpec(axis, None)
  batch = jax.sharding.PartitionSpec(axis)
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=(*(batch,) * (num_args - 1), rows),
    out_specs=rows if out == "rows" else batch,
    check_vma=False,
  )


def get_default_sc_fwd_function(
  feature_specs: NestedFeatureSpecs, global_mesh: jax.sharding.Mesh
) -> ScFwdStageFun:
  """The SparseCore forward over `embedding.tpu_sparse_dense_matmul`.

  Args:
    feature_specs: The (prepared) compat feature specs.
    global_mesh: A 1-D mesh: the tables' shard axis.

  Returns:
    `(buffers, variables) -> (activations like feature_specs, None)`.

  Raises:
    ValueError: If the mesh is not 1-D.
  """
  lookup = _on_mesh(
    functools.partial(
      embedding.tpu_sparse_dense_matmul,
      global_device_count=global_mesh.size,
      feature_specs=feature_specs,
      sharding_strategy="MOD",
    ),
    global_mesh,
    2,
    "batch",
  )

  def sc_fwd(sparse_inputs: Any, embedding_variables: Any) -> tuple[Any, None]:
    return lookup(sparse_inputs, embedding_variables), None

  return sc_fwd


def get_default_sc_bwd_function(
  feature_specs: NestedFeatureSpecs, global_mesh: jax.sharding.Mesh
) -> ScBwdStageFun:
  """The SparseCore backward over `embedding.tpu_sparse_dense_matmul_grad`
  (at optimizer step 0, as upstream's: its `tc_aux` is ignored).

  Args:
    feature_specs: The (prepared) compat feature specs.
    global_mesh: A 1-D mesh: the tables' shard axis.

  Returns:
    `(buffers, gradients, variables, tc_aux) -> (new variables, None)`.

  Raises:
    ValueError: If the mesh is not 1-D.
  """
  update = _on_mesh(
    functools.partial(
      embedding.tpu_sparse_dense_matmul_grad,
      feature_specs=feature_specs,
      sharding_strategy="MOD",
    ),
    global_mesh,
    3,
    "rows",
  )

  def sc_bwd(
    sparse_inputs: Any,
    embedding_gradients: Any,
    embedding_variables: Any,
    tc_aux: Any = None,
  ) -> tuple[Any, None]:
    del tc_aux
    return update(embedding_gradients, sparse_inputs, embedding_variables), None

  return sc_bwd
