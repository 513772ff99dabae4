"""A pipelined training step: step k+1's lookup beside step k's dense work.

A training step has three stages: the SparseCore forward (look the batch's
ids up in the tables), the TensorCore forward and backward (the dense
model's loss, its parameter update and the gradients with respect to the
activations) and the SparseCore backward (the fused row update of the
tables). Run one after the other, each waits for the one before it. The
pipelined step runs, in one program, the three stages of three different
batches, so that nothing inside the step depends on another stage of the
same step and the devices can overlap them::

  pipeline step t, fed batch t:
    1. SparseCore backward of batch t-2 (its gradients, from step t-1);
    2. SparseCore forward of batch t, in the tables just updated;
    3. TensorCore forward and backward of batch t-1 (its activations, from
       step t-1).

The price is one step of staleness in the tables. Write U_j for the tables
after the row updates of batches 0 .. j-1 (U_0: the initial tables).

* Batch k is looked up in U_{k-1} (the updates of batches 0 .. k-2; U_0 for
  k = 0 and 1), where the unpipelined step reads U_k.
* Batch k's gradients come from those activations; its row update lands at
  step k+2, before batch k+2's lookup, on U_k (the optimizer reads the rows
  and slots as they are then), giving U_{k+1}.
* The dense parameters are not stale: batch k's TensorCore stage sees them
  after batches 0 .. k-1, as unpipelined.

A run of K batches takes K+2 pipeline steps (`get_pipeline_train_steps`).
With K = 3::

  step t   input     SC backward   SC forward      TC stage      tables after
  0        batch 0   (zeros)       batch 0 in U_0  (none)        U_0
  1        batch 1   (zeros)       batch 1 in U_0  batch 0       U_0
  2        batch 2   batch 0       batch 2 in U_1  batch 1       U_1
  3        (empty)   batch 1       (empty)         batch 2       U_2
  4        (empty)   batch 2       (empty)         (none)        U_3

Warm-up: at steps 0 and 1 the backward stage applies the placeholder
state's zero gradients over zero buffers. A zero buffer's row pointers end
every partition at 0, so it references no row, and rows a batch does not
reference are never written: tables and optimizer slots (Adagrad's
accumulators, say) stay bit-identical.
Step 0 has no TensorCore stage: pass `fake_tc_step=True`, and its output is
the placeholder (`is_output_valid` says which steps' outputs count). Drain:
steps K and K+1 take an empty batch (`jax.tree.map(jnp.zeros_like, ...)` of
a real one: zero buffers look nothing up and update nothing); step K gives
batch K-1's output, step K+1 (`fake_tc_step=True`) lands its update.

The stages are the caller's functions; this module only shifts their
inputs and outputs from step to step in a `PipelineState`, a pytree that
the jitted step takes and returns (donate it, with the tables, so the
updates stay in place). For `SparseCoreEmbed`, `embed_stages` gives both
SparseCore stages; `pz_sparsecore.compat.lib.nn.embedding_pipelining_utils`
gives jax-tpu-embedding's names and its stage functions over the compat
device calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

_SparseInput = TypeVar("_SparseInput")
_DenseInput = TypeVar("_DenseInput")
_Activations = TypeVar("_Activations")
_Gradients = TypeVar("_Gradients")
_Output = TypeVar("_Output")
_TrainState = TypeVar("_TrainState")
_Variables = TypeVar("_Variables")
_ScFwdAux = TypeVar("_ScFwdAux")
_TcAux = TypeVar("_TcAux")
_ScBwdAux = TypeVar("_ScBwdAux")
_T = TypeVar("_T")

# Steps a batch takes through the pipeline past its own: its TensorCore
# stage one step later, its row update two.
PIPELINE_DEPTH = 2


class PyTreeNode:
  """Base of the frozen pytree dataclasses below (each field a child).

  Subclasses become frozen dataclasses registered with JAX, with
  `replace(**fields)` returning a changed copy.
  """

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    dataclasses.dataclass(frozen=True)(cls)
    jax.tree_util.register_dataclass(cls)

  def replace(self: _T, **fields: Any) -> _T:
    """A copy with `fields` changed."""
    return dataclasses.replace(self, **fields)


class ScFwdStageFun(
  Protocol[_SparseInput, _Activations, _Variables, _ScFwdAux]
):
  """`(sparse_inputs, embedding_variables) -> (activations, sc_fwd_aux)`."""

  def __call__(
    self, sparse_inputs: _SparseInput, embedding_variables: _Variables
  ) -> tuple[_Activations, _ScFwdAux]: ...


class TcStageFun(Protocol[_Activations, _DenseInput, _Gradients, _Output]):
  """`(activations, dense_inputs, train_state, sc_fwd_aux) ->
  (activation gradients, output, new train_state, tc_aux)`."""

  def __call__(
    self,
    embedding_activations: _Activations,
    dense_inputs: _DenseInput,
    train_state: Any,
    sc_fwd_aux: Any = None,
  ) -> tuple[_Gradients, _Output, Any, Any]: ...


class ScBwdStageFun(Protocol[_SparseInput, _Gradients, _Variables, _ScBwdAux]):
  """`(sparse_inputs, gradients, embedding_variables, tc_aux) ->
  (new embedding_variables, sc_bwd_aux)`."""

  def __call__(
    self,
    sparse_inputs: _SparseInput,
    embedding_gradients: _Gradients,
    embedding_variables: _Variables,
    tc_aux: Any = None,
  ) -> tuple[_Variables, _ScBwdAux]: ...


class CurrentStepInput(PyTreeNode, Generic[_SparseInput, _DenseInput]):
  """Batch t: its buffers (looked up now) and dense inputs (used next step).

  Attributes:
    sparse_inputs: The batch's buffers, for the SparseCore forward.
    dense_inputs: The rest of the batch (labels, dense features), for the
      TensorCore stage of the next step.
  """

  sparse_inputs: _SparseInput
  dense_inputs: _DenseInput


class LastStepInput(
  PyTreeNode, Generic[_SparseInput, _DenseInput, _Activations, _ScFwdAux]
):
  """Batch t-1, looked up at the last step, for this step's TensorCore stage
  (and its buffers for the next step's SparseCore backward)."""

  sparse_inputs: _SparseInput
  embedding_activations: _Activations
  dense_inputs: _DenseInput
  sc_fwd_aux: _ScFwdAux


class StepBeforeLastStepInput(
  PyTreeNode, Generic[_SparseInput, _Gradients, _TcAux]
):
  """Batch t-2: its buffers and activation gradients, for this step's
  SparseCore backward."""

  sparse_inputs: _SparseInput
  embedding_gradients: _Gradients
  tc_aux: _TcAux


class PipelineState(
  PyTreeNode,
  Generic[
    _SparseInput,
    _DenseInput,
    _Activations,
    _Gradients,
    _TcAux,
    _ScFwdAux,
    _Output,
  ],
):
  """What one pipeline step hands the next.

  Attributes:
    pipeline_step: int32 scalar, the pipeline step about to run (0-based;
      not the training step).
    last_step_inputs: Batch t-1 (see `LastStepInput`).
    step_before_last_step_inputs: Batch t-2 (see `StepBeforeLastStepInput`).
    placeholder_output: Zeros shaped like the TensorCore stage's output,
      returned by a step without one (`fake_tc_step=True`).
    placeholder_tc_aux: Zeros shaped like its `tc_aux`, likewise.
  """

  pipeline_step: Any
  last_step_inputs: LastStepInput
  step_before_last_step_inputs: StepBeforeLastStepInput
  placeholder_output: _Output
  placeholder_tc_aux: _TcAux


def get_pipeline_train_steps(num_steps: int) -> int:
  """Pipeline steps that train `num_steps` batches (two more: the drain).

  Raises:
    ValueError: If `num_steps` is negative.
  """
  if num_steps < 0:
    raise ValueError(f"num_steps must be >= 0, got {num_steps}")
  return num_steps + PIPELINE_DEPTH


def is_output_valid(pipeline_step: int, num_steps: int) -> bool:
  """Whether step `pipeline_step` of a `num_steps`-batch run has a
  TensorCore stage: steps 1 .. num_steps, whose output is batch
  `pipeline_step - 1`'s."""
  return 1 <= pipeline_step <= num_steps


def _safe_copy(x: _T) -> _T:
  """A copy of a JAX or numpy array (as a JAX array); anything else as is
  (shape structs, abstract values, Python values)."""
  if isinstance(x, (jax.Array, np.ndarray)):
    return jnp.copy(x)
  return x


def _zeros(sharding: jax.sharding.Sharding | None, x: Any) -> jax.Array:
  """Zeros shaped like `x` (an array or a shape struct), placed by
  `sharding` when given (not for scalars, which it cannot split)."""
  if sharding is None or not jnp.shape(x):
    return jnp.zeros_like(x)
  return jnp.zeros(jnp.shape(x), x.dtype, device=sharding)


def _placeholders(tree: Any, sharding: jax.sharding.Sharding | None) -> Any:
  return jax.tree.map(lambda x: _zeros(sharding, x), tree)


def get_pipeline_state_sharding(
  pipeline_state_cls: Callable[..., _T],
  dense_input_sharding: Any,
  sparse_input_sharding: jax.sharding.Sharding,
  pipeline_output_sharding: Any,
  tc_aux_sharding: Any,
) -> _T:
  """The shardings of a `PipelineState`, for the pipelined step's jit.

  Activations and their gradients are placed as the buffers are (split over
  the batch; tables keep the default layout here, so no other format is
  needed). `pipeline_step` is None (unspecified).

  Args:
    pipeline_state_cls: `PipelineState`, or a subscripted alias of it.
    dense_input_sharding: Sharding (or a prefix tree) of the dense inputs;
      also used for the SparseCore forward's aux.
    sparse_input_sharding: Sharding of the buffers.
    pipeline_output_sharding: Sharding (prefix tree) of the TensorCore
      stage's output.
    tc_aux_sharding: Sharding (prefix tree) of its `tc_aux`.

  Returns:
    A `pipeline_state_cls` holding the shardings.
  """
  return pipeline_state_cls(
    pipeline_step=None,
    last_step_inputs=LastStepInput(
      sparse_inputs=sparse_input_sharding,
      embedding_activations=sparse_input_sharding,
      dense_inputs=dense_input_sharding,
      sc_fwd_aux=dense_input_sharding,
    ),
    step_before_last_step_inputs=StepBeforeLastStepInput(
      sparse_inputs=sparse_input_sharding,
      embedding_gradients=sparse_input_sharding,
      tc_aux=tc_aux_sharding,
    ),
    placeholder_output=pipeline_output_sharding,
    placeholder_tc_aux=tc_aux_sharding,
  )


def get_initial_state(
  pipeline_input: CurrentStepInput,
  tc_train_state: Any,
  embedding_variables: Any,
  sc_fwd_function: ScFwdStageFun,
  tc_function: TcStageFun,
  dense_input_sharding: jax.sharding.Sharding | None = None,
  sparse_input_sharding: jax.sharding.Sharding | None = None,
) -> PipelineState:
  """The state before step 0: zeros shaped like every stage's values.

  Only shapes are computed (`jax.eval_shape` of the two stage functions,
  nothing runs), so this also works under abstract evaluation, e.g.
  `jax.eval_shape(functools.partial(get_initial_state, sc_fwd_function=...,
  tc_function=...), pipeline_input, train_state, variables)` for the
  state's shapes.

  Args:
    pipeline_input: The first batch (or any batch of the run's shapes).
    tc_train_state: The TensorCore stage's train state.
    embedding_variables: The SparseCore stages' variables.
    sc_fwd_function: The SparseCore forward (`ScFwdStageFun`).
    tc_function: The TensorCore stage (`TcStageFun`).
    dense_input_sharding: Where to place the zero dense inputs (None: JAX's
      default placement).
    sparse_input_sharding: Where to place the zero buffers, activations
      and gradients.

  Returns:
    The initial `PipelineState`. The placeholder output and aux take JAX's
    default placement; place the state with `get_pipeline_state_sharding`'s
    shardings (`jax.device_put`, or the jitted step's `in_shardings`).
  """
  sparse = _placeholders(pipeline_input.sparse_inputs, sparse_input_sharding)
  dense = _placeholders(pipeline_input.dense_inputs, dense_input_sharding)
  act_shapes, fwd_aux_shapes = jax.eval_shape(
    sc_fwd_function, sparse, embedding_variables
  )
  acts = _placeholders(act_shapes, sparse_input_sharding)
  fwd_aux = _placeholders(fwd_aux_shapes, None)
  grad_shapes, output_shapes, _, tc_aux_shapes = jax.eval_shape(
    tc_function, acts, dense, tc_train_state, fwd_aux
  )
  tc_aux = _placeholders(tc_aux_shapes, None)
  # Each buffer once: a jitted step that donates the state may not receive
  # one buffer in two places.
  return PipelineState(
    pipeline_step=jnp.zeros((), jnp.int32),
    last_step_inputs=LastStepInput(
      sparse_inputs=sparse,
      embedding_activations=acts,
      dense_inputs=dense,
      sc_fwd_aux=fwd_aux,
    ),
    step_before_last_step_inputs=StepBeforeLastStepInput(
      sparse_inputs=jax.tree.map(_safe_copy, sparse),
      embedding_gradients=_placeholders(grad_shapes, sparse_input_sharding),
      tc_aux=tc_aux,
    ),
    placeholder_output=_placeholders(output_shapes, None),
    placeholder_tc_aux=jax.tree.map(_safe_copy, tc_aux),
  )


def step(
  pipeline_input: CurrentStepInput,
  tc_train_state: Any,
  embedding_variables: Any,
  pipeline_state: PipelineState,
  sc_fwd_function: ScFwdStageFun,
  tc_function: TcStageFun,
  sc_bwd_function: ScBwdStageFun,
  *,
  fake_tc_step: bool,
) -> tuple[Any, Any, Any, Any, PipelineState]:
  """One pipeline step (see the module docstring): batch t-2's row update,
  batch t's lookup, batch t-1's TensorCore stage.

  Call it inside `jax.jit` (with `fake_tc_step` static) and donate the
  train state, the variables and the pipeline state.

  Args:
    pipeline_input: Batch t (an empty one while draining).
    tc_train_state: The TensorCore stage's train state.
    embedding_variables: The SparseCore stages' variables.
    pipeline_state: The last step's state (`get_initial_state` at step 0).
    sc_fwd_function: The SparseCore forward.
    tc_function: The TensorCore stage.
    sc_bwd_function: The SparseCore backward.
    fake_tc_step: Skip the TensorCore stage (steps where `is_output_valid`
      is False): the output and aux are the placeholders, the train state
      is unchanged, and the gradients handed on are the state's zeros.

  Returns:
    `(output, sc_bwd_aux, train_state, embedding_variables, pipeline_state)`:
    batch t-1's TensorCore output (the placeholder with `fake_tc_step`),
    the SparseCore backward's aux, and the new states.
  """
  older = pipeline_state.step_before_last_step_inputs
  last = pipeline_state.last_step_inputs
  with jax.named_scope("pipelined_sc_bwd"):
    embedding_variables, sc_bwd_aux = sc_bwd_function(
      older.sparse_inputs,
      older.embedding_gradients,
      embedding_variables,
      older.tc_aux,
    )
  with jax.named_scope("pipelined_sc_fwd"):
    acts, sc_fwd_aux = sc_fwd_function(
      pipeline_input.sparse_inputs, embedding_variables
    )
  with jax.named_scope("pipelined_tc"):
    if fake_tc_step:
      grads, output, tc_aux = (
        older.embedding_gradients,
        pipeline_state.placeholder_output,
        pipeline_state.placeholder_tc_aux,
      )
    else:
      grads, output, tc_train_state, tc_aux = tc_function(
        last.embedding_activations,
        last.dense_inputs,
        tc_train_state,
        last.sc_fwd_aux,
      )
  new_state = pipeline_state.replace(
    pipeline_step=pipeline_state.pipeline_step + 1,
    last_step_inputs=LastStepInput(
      sparse_inputs=pipeline_input.sparse_inputs,
      embedding_activations=acts,
      dense_inputs=pipeline_input.dense_inputs,
      sc_fwd_aux=sc_fwd_aux,
    ),
    step_before_last_step_inputs=StepBeforeLastStepInput(
      sparse_inputs=last.sparse_inputs,
      embedding_gradients=grads,
      tc_aux=tc_aux,
    ),
  )
  return output, sc_bwd_aux, tc_train_state, embedding_variables, new_state


@dataclasses.dataclass(frozen=True)
class EmbedStages:
  """The SparseCore stages of a `SparseCoreEmbed`, on its frozen variables.

  The pipelined step is a plain `jax.jit` over pytrees: the layer's tables
  and slots travel as `variables` (frozen values, in the order of
  `pz.unbind_variables`), which the jitted step donates and returns.

  Attributes:
    stateless: The layer with its variables unbound.
    variables: The layer's variables' values when the stages were made:
      the `embedding_variables` of the first step.
    targets: The layer's own (mutable) variables, which `assign` writes.
  """

  stateless: Any
  variables: tuple[Any, ...]
  targets: tuple[Any, ...]

  def layer(self, variables: tuple[Any, ...]) -> Any:
    """The layer holding `variables` (frozen), e.g. for
    `pzsc.logical_tables`."""
    return pz.bind_variables(self.stateless, variables)

  def sc_fwd(
    self, sparse_inputs: Any, variables: tuple[Any, ...]
  ) -> tuple[dict[str, pz.nx.NamedArray], None]:
    """The lookup: the layer's activations (`NamedArray`s), no aux."""
    return self.layer(variables)(sparse_inputs), None

  def sc_bwd(
    self,
    sparse_inputs: Any,
    grads: Any,
    variables: tuple[Any, ...],
    tc_aux: Any = None,
  ) -> tuple[tuple[Any, ...], None]:
    """The fused update (`SparseCoreEmbed.apply_gradients`).

    `tc_aux` is the training step of the batch the gradients are for (the
    step step-dependent optimizers see), or None for step 0: have the
    TensorCore stage return its train state's step as its aux.
    """
    step = 0 if tc_aux is None else tc_aux
    layer = pz.bind_variables(self.stateless, variables, unfreeze_as_copy=True)
    layer.apply_gradients(sparse_inputs, grads, step)
    return pz.unbind_variables(layer, freeze=True)[1], None

  def assign(self, variables: tuple[Any, ...]) -> None:
    """Writes `variables` (a step's output) into the layer's own variables,
    so the model holds the trained tables."""
    for var, value in zip(self.targets, variables, strict=True):
      var.value = value.value


def embed_stages(embed: Any) -> EmbedStages:
  """The SparseCore forward and backward of `embed` for `step`.

  Args:
    embed: A `SparseCoreEmbed` with its (mutable) variables bound.

  Returns:
    Its `EmbedStages`: `sc_fwd` and `sc_bwd` are `step`'s SparseCore stage
    functions, `variables` its first `embedding_variables`.
  """
  stateless, targets = pz.unbind_variables(embed)
  return EmbedStages(
    stateless=stateless,
    variables=tuple(var.freeze() for var in targets),
    targets=targets,
  )
