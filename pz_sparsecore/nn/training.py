"""Training Penzai models that contain `SparseCoreEmbed` layers.

`SparseCoreTrainer` mirrors Penzai's `basic_training.StatefulTrainer`: same
`build(root_rng, model, optimizer_def, loss_fn)` and `step(**kwargs) -> aux`,
same loss-function protocol `loss_fn(*, model, state, rng, **kwargs) ->
(loss, new_state, aux)`; `fit(batches, preprocess)` loops `step` over
batches preprocessed ahead in a background thread (`pzsc.prefetch`). What
differs is how the embedding tables learn:

* Inside the differentiated function every `SparseCoreEmbed` of the model
  gets an `ActivationProbe` (see `probe.py`): zero probes added to its
  activations, and a `pz.StateVariable` recording the `PreprocessedInput` it
  was called with. The step differentiates the loss with respect to the
  dense parameters and the probes. The probes' gradient is the gradient with
  respect to the activations; the tables are never differentiated.
* `optimizer_def` (optax) updates the dense parameters only.
* Each stack's own optimizer (from its `TableSpec`) runs through the fused
  FFI update with the trainer's true step, touching only referenced rows.
* Tables, slots, dense parameters and optimizer state are donated, so every
  update happens in place: a step costs O(batch), not O(vocabulary).

The step is three parts: `_loss_and_grads` (the loss, the dense and probe
gradients, the recorded inputs), `_updates` (optax, then the fused update of
every layer that was called) and, with `check_finite`,
`_undone_unless_finite`: a step whose loss, gradients or updated rows and
slots are not finite keeps every variable as it was (the touched rows are
written back, O(batch)).

The same step can be written by hand with `pzsc.variable_jit` (which
returns and donates only the variables the step writes) or Penzai's
`pz.variable_jit` (which donates and returns them all; same result)::

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def train_step(embed, head, inputs, labels, step):
    acts = embed(inputs)                       # dict of NamedArrays
    head_model, head_params = pz.unbind_params(head, freeze=True)

    def loss_of(params, acts):
      logits = pz.bind_variables(head_model, params)(acts)
      return loss(logits, labels)

    loss, (g_params, g_acts) = jax.value_and_grad(loss_of, (0, 1))(
        head_params, acts)
    embed.apply_gradients(inputs, g_acts, step)   # fused, in place
    ...                                           # optax on g_params
    return loss

Each `SparseCoreEmbed` must be called at most once per loss evaluation, on
the `PreprocessedInput` from its `preprocess` (passed in through `kwargs`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz

from pz_sparsecore.device import guard as guard_lib
from pz_sparsecore.device import routing
from pz_sparsecore.device.kernels import ffi
from pz_sparsecore.host import fdo
from pz_sparsecore.host.fill import LimitsExceededError
from pz_sparsecore.host.pipeline import PrefetchError, prefetch
from pz_sparsecore.host.preprocess import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
)
from pz_sparsecore.nn import _touched as touched_lib
from pz_sparsecore.nn import batching
from pz_sparsecore.nn.embed import (
  SparseCoreEmbed,
  find_embeds,
  fits,
  local_device_count,
  recording_stats,
  variable_labels,
)
from pz_sparsecore.nn.placement import committed_to_mesh, place_tables
from pz_sparsecore.nn.probe import ActivationProbe
from pz_sparsecore.nn.respec import update_limits
from pz_sparsecore.nn.tables import slot_arrays, table_arrays
from pz_sparsecore.nn.ties import check_untied


class NonFiniteUpdateError(FloatingPointError):
  """A training step produced a NaN or infinity."""


class NonFiniteInputError(NonFiniteUpdateError):
  """A training step's input (a float array of its keyword arguments) held
  a NaN or infinity."""


_INPUT = "input "
"""The prefix of an input's flag among the step's finite flags."""


def _inputs_of(finite: dict[str, Any]) -> dict[str, Any]:
  """The inputs' flags among a step's finite flags (`_input_flags`)."""
  return {k: v for k, v in finite.items() if k.startswith(_INPUT)}


def _input_flags(kwargs: dict[str, Any]) -> dict[str, jax.Array]:
  """`"input <path>"` → whether that float array of `kwargs` is finite.

  `PreprocessedInput`s are left out (their gains pad with NaN by design).
  """
  flags = {}
  leaves, _ = jax.tree_util.tree_flatten_with_path(
    kwargs, is_leaf=lambda x: isinstance(x, PreprocessedInput)
  )
  for path, leaf in leaves:
    if isinstance(leaf, PreprocessedInput) or not hasattr(leaf, "dtype"):
      continue
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      name = jax.tree_util.keystr(path).removesuffix(".data_array")
      flags[_INPUT + name] = _all_finite(leaf)
  return flags


def _all_finite(x: jax.Array) -> jax.Array:
  """Whether every element of `x` is finite, as a float count of the others
  being 0.

  A flag over a sharded array is an all-reduce across the devices. A
  boolean AND is a collective of its own; a float sum is one XLA's
  all-reduce combiner merges into the dense gradients' (one collective
  fewer a step: about 0.6 ms, 3%, of a 26-table DLRM's step on 8 CPU
  devices). Exact: a sum of zeros and ones is 0 only if every term is.
  """
  return jnp.sum(~jnp.isfinite(x), dtype=jnp.float32) == 0


@pz.pytree_dataclass
class SparseCoreTrainerState(pz.Struct):
  """The trainer's own state.

  Attributes:
    step: Number of steps taken (the step the table optimizers see).
    opt_state: optax state of the dense parameters.
    loss_fn_state: State threaded through the loss function.
  """

  step: int | jax.Array
  opt_state: Any
  loss_fn_state: Any


@dataclasses.dataclass(frozen=True)
class _StepOptions:
  """The step's static arguments (jit hashes them)."""

  loss_fn: Callable[..., Any]
  optimizer_def: optax.GradientTransformation
  check_finite: bool


class _Variables(NamedTuple):
  """The model's frozen variables, by role in the step."""

  dense: tuple[Any, ...]
  frozen: tuple[Any, ...]
  state: tuple[Any, ...]
  tables: tuple[Any, ...]
  slots: tuple[Any, ...]


class _Gradients(NamedTuple):
  """What one differentiated loss evaluation gives.

  `probes` and `inputs` have one entry per `SparseCoreEmbed` (tree order);
  `inputs` is None for a layer the loss did not call.
  """

  loss: jax.Array
  dense: tuple[Any, ...]
  probes: tuple[dict[str, jax.Array], ...]
  inputs: tuple[Any, ...]
  state: tuple[Any, ...]
  loss_fn_state: Any
  aux: Any


def recorded_input(embed: SparseCoreEmbed, probe: ActivationProbe) -> Any:
  """The one input the layer was called with, or None."""
  recorded = probe.record.value
  if len(recorded) > 1:
    raise ValueError(
      f"SparseCoreEmbed {embed.config.name!r} was called "
      f"{len(recorded)} times in one loss evaluation; call it once"
    )
  return recorded[0] if recorded else None


def with_probes(
  model: Any, probes: tuple[dict[str, jax.Array] | None, ...]
) -> tuple[Any, list[ActivationProbe]]:
  """`model` with a probe attached to each of its layers (tree order).

  A probe of None only records (`ActivationProbe.observe` then adds
  nothing), which is how `probe_templates` learns the call shapes.
  """
  attached = [
    ActivationProbe.attach(p, f"{e.config.name}/activation_probe")
    for e, p in zip(find_embeds(model), probes, strict=True)
  ]
  order = iter(attached)
  model = (
    pz.select(model)
    .at_instances_of(SparseCoreEmbed)
    .apply(lambda e: dataclasses.replace(e, activation_probe=next(order)))
  )
  return model, attached


def probe_templates(
  embeds: list[SparseCoreEmbed],
  run: Callable[[tuple[Any, ...]], Any],
  arguments: Any = None,
) -> tuple[dict[str, jax.Array], ...]:
  """One zero probe per feature of each layer, shaped like its activations.

  A layer with fixed shapes (`SparseCoreEmbed` on buffers of its specs'
  batch) takes them from its plan; when some layer's shapes depend on the
  call (`SparseCoreLookup`, or `arguments` holding buffers of another
  batch size), `run` (the loss evaluated with the given probes attached,
  returning the attached probes) is traced once, abstractly, with
  recording probes.
  """
  fixed = [e.fixed_probes() for e in embeds]
  if batching.has_batch(arguments):
    fixed = [None] * len(embeds)
  if all(p is not None for p in fixed):
    return tuple(fixed)

  def shapes():
    attached = run((None,) * len(embeds))
    return tuple(
      a.record.value[0][1] if a.record.value else {} for a in attached
    )

  traced = jax.eval_shape(shapes)
  return tuple(
    p
    if p is not None
    else {k: jnp.zeros(v.shape, v.dtype) for k, v in t.items()}
    for p, t in zip(fixed, traced, strict=True)
  )


def _loss_and_grads(
  stateless_model: Any,
  variables: _Variables,
  state: SparseCoreTrainerState,
  rng: jax.Array,
  options: _StepOptions,
  kwargs: dict[str, Any],
) -> _Gradients:
  """The loss and its gradients wrt the dense parameters and the probes."""
  embeds = find_embeds(stateless_model)

  def run(dense_params, probes):
    state_vars = tuple(v.unfreeze_as_copy() for v in variables.state)
    model = pz.bind_variables(
      stateless_model,
      state_vars
      + dense_params
      + variables.frozen
      + variables.tables
      + variables.slots,
    )
    model, attached = with_probes(model, probes)
    loss, loss_fn_state, aux = options.loss_fn(
      model=model, state=state.loss_fn_state, rng=rng, **kwargs
    )
    return loss, loss_fn_state, aux, state_vars, attached

  def compute(dense_params, probes):
    loss, loss_fn_state, aux, state_vars, attached = run(dense_params, probes)
    inputs = tuple(
      recorded_input(e, p) for e, p in zip(embeds, attached, strict=True)
    )
    # The gradients are filled in below.
    return loss, _Gradients(
      loss=loss,
      dense=(),
      probes=(),
      inputs=inputs,
      state=pz.freeze_variables(state_vars),
      loss_fn_state=loss_fn_state,
      aux=aux,
    )

  probes = probe_templates(
    embeds, lambda probes: run(variables.dense, probes)[-1], kwargs
  )
  grad_fn = jax.grad(compute, argnums=(0, 1), has_aux=True)
  (g_dense, g_probes), out = grad_fn(variables.dense, probes)
  return out._replace(dense=g_dense, probes=g_probes)


def _labelled(
  embed: SparseCoreEmbed,
  tables: dict[str, jax.Array],
  slots: dict[str, tuple[jax.Array, ...]],
) -> dict[str, jax.Array]:
  """Positional tables and slots of a layer by variable label."""
  config = embed.config
  out = {}
  for stack, table in tables.items():
    out[config.table_label(stack)] = table
    for slot, value in zip(embed.slots[stack], slots[stack], strict=True):
      out[config.slot_label(stack, slot)] = value
  return out


def _updates(
  optimizer_def: optax.GradientTransformation,
  state: SparseCoreTrainerState,
  dense_params: tuple[Any, ...],
  grads: _Gradients,
  active: list[tuple[SparseCoreEmbed, Any, dict[str, jax.Array]]],
  guard: bool,
) -> tuple[tuple[Any, ...], Any, dict[str, jax.Array], list[Any]]:
  """optax on the dense parameters; the fused update of every called layer.

  Returns:
    The new dense parameters, optimizer state, by label the new positional
    tables and slots of the layers in `active`, and with `guard` one
    `guard_lib.UpdateGuard` per layer in `active` (else an empty list).
  """
  updates, opt_state = optimizer_def.update(
    grads.dense, state.opt_state, dense_params
  )
  new_dense = optax.apply_updates(dense_params, updates)
  by_label, guards = {}, []
  for embed, inputs, act_grads in active:
    config = embed.config
    tables, slots, *guarded = routing.apply_gradients(
      embed.plan_of(act_grads),
      config.topology,
      table_arrays(embed),
      slot_arrays(embed),
      inputs,
      act_grads,
      state.step,
      guard=guard,
    )
    guards += guarded
    by_label.update(_labelled(embed, tables, slots))
  return new_dense, opt_state, by_label, guards


def _data_flow_rank(name: str) -> int:
  """Where a flag of `_finite_flags` / `_undone_unless_finite` sits in the
  step's data flow (the step's output dict comes back in sorted order)."""
  if name.startswith(_INPUT):
    return 0
  if name == "loss":
    return 1
  return 3 if name.endswith("(updated rows)") else 2


def _finite_flags(
  grads: _Gradients,
  embeds: list[SparseCoreEmbed],
  dense_params: tuple[Any, ...],
  check_finite: bool,
  kwargs: dict[str, Any],
) -> dict[str, jax.Array]:
  """Name → whether an input / the loss / a stack's / a parameter's gradient
  is finite, in data-flow order (the inputs first).

  Without `check_finite`, only the inputs and the loss.
  """
  finite = {**_input_flags(kwargs), "loss": jnp.isfinite(grads.loss)}
  if not check_finite:
    return finite
  for embed, probe_grads in zip(embeds, grads.probes, strict=True):
    for stack in embed.config.plan.stacks:
      flags = [
        _all_finite(probe_grads[f.name])
        for f in stack.features
        if f.name in probe_grads
      ]
      if flags:
        finite[embed.config.table_label(stack.name)] = jnp.all(jnp.stack(flags))
  for var, grad in zip(dense_params, grads.dense, strict=True):
    leaves = jax.tree.leaves(grad)
    finite[var.label] = jnp.all(
      jnp.stack([_all_finite(x) for x in leaves] or [True])
    )
  return finite


def _undone_unless_finite(
  finite: dict[str, jax.Array],
  active: list[tuple[SparseCoreEmbed, Any, dict[str, jax.Array]]],
  guards: list[guard_lib.UpdateGuard],
  new: dict[str, jax.Array],
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Adds the updated rows' flags to `finite`; undoes every layer's update
  unless all flags hold. Returns whether they do, and the tables and slots.

  The fused updates ran in place; taking one back writes the O(batch) rows
  it touched, so a refused step costs what an accepted one does.
  """
  for (embed, _, _), guard in zip(active, guards, strict=True):
    for stack, ok in guard.finite.items():
      finite[f"{embed.config.table_label(stack)} (updated rows)"] = ok
  ok = jnp.all(jnp.stack(list(finite.values())))
  out = dict(new)
  for (embed, _, act_grads), guard in zip(active, guards, strict=True):
    config = embed.config
    tables = {
      s.name: new[config.table_label(s.name)] for s in config.plan.stacks
    }
    slots = {
      s.name: tuple(
        new[config.slot_label(s.name, slot)] for slot in embed.slots[s.name]
      )
      for s in config.plan.stacks
    }
    tables, slots = guard_lib.undo_unless(
      embed.plan_of(act_grads), config.topology, tables, slots, guard, ok
    )
    out.update(_labelled(embed, tables, slots))
  return ok, out


def _rebuild(variables: tuple[Any, ...], new: dict[str, jax.Array]):
  """The frozen variables with the positional values in `new` written in."""
  out = []
  for var in variables:
    if var.label in new:
      named = pz.nx.wrap(new[var.label]).tag(*var.value.named_shape)
      var = dataclasses.replace(var, value=named)
    out.append(var)
  return tuple(out)


def _resolve_hashed_ids(
  stateless_model: Any,
  state_vars: tuple[Any, ...],
  tables: tuple[Any, ...],
  slots: tuple[Any, ...],
  kwargs: dict[str, Any],
  step: jax.Array,
):
  """The step's buffers with hashed tables' ids resolved to rows (inserting
  new ids: `SparseCoreEmbed.resolve_ids`), and the variables that changed:
  `(state_vars, tables, slots, kwargs)`, frozen as they came."""
  groups = (state_vars, tables, slots)
  if not any(e.maps for e in find_embeds(stateless_model)):
    return (*groups, kwargs)
  mutable = tuple(tuple(v.unfreeze_as_copy() for v in g) for g in groups)
  model = pz.bind_variables(stateless_model, sum(mutable, ()))
  embeds = [e for e in find_embeds(model) if e.maps]

  def resolve(leaf: Any) -> Any:
    if not isinstance(leaf, PreprocessedInput) or leaf.hashed_ids is None:
      return leaf
    owners = [e for e in embeds if fits(e, leaf)]
    if len(owners) != 1:
      names = [e.config.name for e in owners] or "no layer"
      raise ValueError(
        "a PreprocessedInput with hashed ids fits "
        f"{names}: the trainer resolves each one with the one layer whose "
        "buffers it matches"
      )
    return owners[0].resolve_ids(leaf, step=step, train=True)

  kwargs = jax.tree.map(
    resolve, kwargs, is_leaf=lambda x: isinstance(x, PreprocessedInput)
  )
  frozen = tuple(tuple(v.freeze() for v in g) for g in mutable)
  return (*frozen, kwargs)


def _trainer_step(
  root_rng: jax.Array,
  state: SparseCoreTrainerState,
  stateless_model: Any,
  dense_params: tuple[Any, ...],
  frozen_params: tuple[Any, ...],
  state_vars: tuple[Any, ...],
  tables: tuple[Any, ...],
  slots: tuple[Any, ...],
  options: _StepOptions,
  kwargs: dict[str, Any],
  touched: dict[str, jax.Array] | None = None,
):
  """One step: gradients, then the (guarded) updates; jitted by `build`.

  `touched` holds the touched-row bitmaps of a trainer that tracks them
  (`_touched.py`), None otherwise."""
  state_vars, tables, slots, kwargs = _resolve_hashed_ids(
    stateless_model, state_vars, tables, slots, kwargs, state.step
  )
  variables = _Variables(dense_params, frozen_params, state_vars, tables, slots)
  rng = jax.random.fold_in(root_rng, state.step)
  grads = _loss_and_grads(
    stateless_model, variables, state, rng, options, kwargs
  )
  # The layers with their (frozen) tables and slots bound.
  embeds = find_embeds(pz.bind_variables(stateless_model, tables + slots))
  active = [
    (embed, inputs, act_grads)
    for embed, inputs, act_grads in zip(
      embeds, grads.inputs, grads.probes, strict=True
    )
    if inputs is not None
  ]
  if touched is not None:
    touched = touched_lib.mark(active, touched)

  finite = _finite_flags(
    grads, embeds, dense_params, options.check_finite, kwargs
  )
  new_dense, opt_state, new, guards = _updates(
    options.optimizer_def,
    state,
    dense_params,
    grads,
    active,
    options.check_finite,
  )
  if options.check_finite:
    ok, new = _undone_unless_finite(finite, active, guards, new)
    new_dense, opt_state = jax.tree.map(
      lambda n, o: jnp.where(ok, n, o),
      (new_dense, opt_state),
      (dense_params, state.opt_state),
    )
  # Outputs follow the donated inputs' positional order (state, dense,
  # state vars, tables, slots): jit pairs donated buffers with outputs of the
  # same shape in order, so any other order hands a table's buffer to a slot
  # (or the reverse) and forces vocabulary-sized copies every step.
  return (
    SparseCoreTrainerState(
      step=state.step + 1,
      opt_state=opt_state,
      loss_fn_state=grads.loss_fn_state,
    ),
    new_dense,
    grads.state,
    _rebuild(tables, new),
    _rebuild(slots, new),
    touched,
    grads.aux,
    finite,
    _done_marker(state.step + 1, finite),
  )


def _done_marker(steps: jax.Array, finite: dict[str, jax.Array]) -> jax.Array:
  """What `step` waits for to bound the steps in flight (not donated by
  the next step, unlike the step counter): the steps taken, negated when
  an input was not finite, so that waiting reads one scalar and the
  per-input flags only when one failed."""
  inputs = list(_inputs_of(finite).values())
  ok = jnp.all(jnp.stack(inputs)) if inputs else True
  return jnp.where(ok, steps, -steps)


class _Grouping:
  """The model's variables sorted into the step's groups, per model object.

  Unbinding the variables and finding the tables and slots walks the whole
  model; the result only changes when the model object does (variables are
  read afresh every step), so it is kept for the last model seen.
  """

  def __init__(self):
    self._model = None
    self._result = None
    self.inputs_checked = False
    # A marker of each dispatched step not yet waited for, oldest first.
    self.in_flight = collections.deque()

  def needs_placing(self, model: Any) -> bool:
    """Whether `model` is new here (its tables' placement unchecked)."""
    return model is not self._model

  def of(self, model: Any) -> tuple[Any, dict[str, list[Any]]]:
    if model is not self._model:
      self._result = _group_variables(model)
      self._model = model
    return self._result


def _assign(var: Any, value: Any) -> None:
  """`var.value = value` for a step's output, whose leaves are already
  arrays: Penzai's setter maps `jnp.asarray` over them (about 0.1 ms of host
  time per variable and step; the step's own dispatch is a few times that).
  The outputs come back in the variables' order, so `update`'s slot check
  is not needed either."""
  if "_raw_value" in vars(var):
    var._raw_value = value
  else:  # Another Penzai's variables: its setter.
    var.value = value


def _validate_inputs(model: Any, kwargs: dict[str, Any]) -> None:
  """Checks every `PreprocessedInput` in `kwargs` with the layers it fits."""
  found = [
    x
    for x in jax.tree.leaves(
      kwargs, is_leaf=lambda x: isinstance(x, PreprocessedInput)
    )
    if isinstance(x, PreprocessedInput)
  ]
  for inputs in found:
    for embed in find_embeds(model):
      if fits(embed, inputs):
        embed.validate(inputs)


def _group_variables(model: Any) -> tuple[Any, dict[str, list[Any]]]:
  """The stateless model and its variables by role in the step."""
  stateless_model, variables = pz.unbind_variables(model)
  table_labels, slot_labels = variable_labels(model)
  groups = {k: [] for k in ("dense", "frozen", "state", "tables", "slots")}
  for var in variables:
    if var.label in table_labels:
      groups["tables"].append(var)
    elif var.label in slot_labels:
      groups["slots"].append(var)
    elif isinstance(var, pz.Parameter):
      trainable = var.metadata.get("trainable", True)
      groups["dense" if trainable else "frozen"].append(var)
    elif isinstance(var, pz.StateVariable):
      groups["state"].append(var)
    else:
      raise ValueError(f"unexpected variable type: {var}")
  return stateless_model, groups


@pz.pytree_dataclass
class SparseCoreTrainer(pz.Struct):
  """A trainer that updates dense parameters with optax and tables in place.

  Attributes:
    root_rng: Base key; each step uses `fold_in(root_rng, step)`.
    model: The model (its variables are updated in place by `step`).
    state: The trainer's state, in a `pz.StateVariable`.
    optimizer_def: optax optimizer of the dense parameters.
    loss_fn: `loss_fn(*, model, state, rng, **kwargs) -> (loss, state, aux)`.
    step_fn: The jitted step.
    check_finite: Whether a step whose loss or gradients are not finite is
      skipped and reported with `NonFiniteUpdateError` (naming the step and
      the tables or parameters).
    grouping: Internal: the model's variables sorted by role, kept between
      steps.
    touched: With `track_touched`, the rows the steps touched since the
      last save or restore, per stack (`_touched.Touched`), which delta
      checkpoints write (`save_checkpoint(..., delta=True)`); else None.
    limit_stats: Internal: the statistics of every batch `fit` has
      preprocessed, per layer, kept from one `fit` call to the next (the
      limits it sets never fall below what earlier batches needed); None
      before the first `fit`.
    validate_inputs: Which steps check the contents of the
      `PreprocessedInput`s in their keyword arguments with
      `SparseCoreEmbed.validate` before running (for buffers built by hand):
      `"first"` (the first step), `True` (every step) or `False`.
    max_steps_in_flight: How many dispatched steps may be unfinished when
      `step` returns (default 2): before returning, `step` waits for the
      oldest beyond that. The host still prepares step k + 1 while the
      devices run step k, but a loop never queues more: on XLA's CPU
      devices, a backlog of steps whose collectives wait for device threads
      held by later steps can stall the collectives until XLA aborts the
      process (`rendezvous.cc: Termination timeout`), seen with unblocked
      loops of 120 steps on a 2 x 4 mesh of CPU devices, more often on a
      loaded machine. With 1, each step waits for the one before it.
  """

  root_rng: jax.Array
  model: Any
  state: pz.StateVariable
  optimizer_def: optax.GradientTransformation = dataclasses.field(
    metadata={"pytree_node": False}
  )
  loss_fn: Callable[..., Any] = dataclasses.field(
    metadata={"pytree_node": False}
  )
  step_fn: Any = dataclasses.field(metadata={"pytree_node": False})
  check_finite: bool = dataclasses.field(
    default=False, metadata={"pytree_node": False}
  )
  grouping: Any = dataclasses.field(
    default=None, metadata={"pytree_node": False}
  )
  validate_inputs: bool | str = dataclasses.field(
    default="first", metadata={"pytree_node": False}
  )
  max_steps_in_flight: int = dataclasses.field(
    default=2, metadata={"pytree_node": False}
  )
  touched: Any = dataclasses.field(
    default=None, metadata={"pytree_node": False}
  )
  limit_stats: Any = dataclasses.field(
    default=None, metadata={"pytree_node": False}
  )

  @classmethod
  def build(
    cls,
    root_rng: jax.Array,
    model: Any,
    optimizer_def: optax.GradientTransformation,
    loss_fn: Callable[..., Any],
    initial_loss_fn_state: Any = None,
    *,
    check_finite: bool = False,
    donate: bool = True,
    validate_inputs: bool | str = "first",
    max_steps_in_flight: int = 2,
    compiler_options: dict[str, Any] | None = None,
    track_touched: bool = False,
  ) -> SparseCoreTrainer:
    """Builds a trainer for `model`.

    Args:
      root_rng: Base PRNG key.
      model: A Penzai model containing `SparseCoreEmbed` layers.
      optimizer_def: optax optimizer for every other trainable parameter.
      loss_fn: The loss function (Penzai's `LossFunction` protocol).
      initial_loss_fn_state: Initial `state` passed to `loss_fn`.
      check_finite: Guard against NaN / infinity: a step whose loss or
        gradients are not finite leaves every variable unchanged and raises
        `NonFiniteUpdateError` naming the step and the tables / parameters.
      donate: Donate variables so updates happen in place.
      validate_inputs: `"first"`, `True` or `False`: which steps check
        their input buffers' contents first (see the attribute).
      max_steps_in_flight: Steps dispatched and not yet finished that
        `step` allows (see the attribute); at least 1.
      compiler_options: XLA options for the step's compilation (`jax.jit`'s
        `compiler_options`). On CPU, `{"xla_cpu_use_fusion_emitters":
        False}` (XLA's classic emitters) compiles the 26-table DLRM's step
        in about half the time (1.6-2.0 s instead of 3.2-3.6) for a step
        5-10% slower on 8 virtual devices, and a dense step up to 40%
        slower on one: worth it for short runs only. That option is
        jaxlib 0.10's: newer XLA has no such option and refuses it
        ("No such compile option").
      track_touched: Keep, per stack, a bitmap of the rows the steps touch
        (one byte per row, set in the step at O(batch) cost), which delta
        checkpoints need (`save_checkpoint(..., delta=True)` or
        `full_every=`).

    Returns:
      The trainer.
    """
    if not isinstance(max_steps_in_flight, int) or max_steps_in_flight < 1:
      raise ValueError(
        f"max_steps_in_flight must be an int >= 1, got {max_steps_in_flight!r}"
      )
    if validate_inputs not in ("first", True, False):
      raise ValueError(
        f'validate_inputs must be "first", True or False, got '
        f"{validate_inputs!r}"
      )
    check_untied(model)
    _, params = pz.unbind_params(model)
    table_labels, _ = variable_labels(model)
    dense = [
      p
      for p in params
      if p.label not in table_labels and p.metadata.get("trainable", True)
    ]
    # Uncommitted arrays (the model's constants and unplaced parameters,
    # optax's counters, the step) would come back from the first step
    # placed on the mesh and make the second step compile again.
    for var in pz.unbind_variables(model)[1]:
      var.value = committed_to_mesh(var.value, model)
    opt_state = committed_to_mesh(
      optimizer_def.init(pz.freeze_params(tuple(dense))), model
    )
    if not isinstance(track_touched, bool):
      raise ValueError(
        f"track_touched must be True or False, got {track_touched!r}"
      )
    donated = [
      "state",
      "dense_params",
      "state_vars",
      "tables",
      "slots",
      "touched",
    ]
    step_fn = jax.jit(
      _trainer_step,
      donate_argnames=donated if donate else (),
      static_argnames=["options"],
      compiler_options=compiler_options,
    )
    return cls(
      root_rng=root_rng,
      model=model,
      state=pz.StateVariable(
        SparseCoreTrainerState(
          # An array from the start, so the first step and the later ones
          # share one compilation.
          step=committed_to_mesh(jnp.zeros((), jnp.int32), model),
          opt_state=opt_state,
          loss_fn_state=committed_to_mesh(initial_loss_fn_state, model),
        ),
        label="SparseCoreTrainer.state",
      ),
      optimizer_def=optimizer_def,
      loss_fn=loss_fn,
      step_fn=step_fn,
      check_finite=check_finite,
      grouping=_Grouping(),
      validate_inputs=validate_inputs,
      max_steps_in_flight=max_steps_in_flight,
      touched=touched_lib.Touched(model) if track_touched else None,
    )

  @property
  def step_options(self) -> _StepOptions:
    """The static arguments `step` passes to `step_fn`."""
    return _StepOptions(self.loss_fn, self.optimizer_def, self.check_finite)

  def step(self, **kwargs: Any) -> Any:
    """Runs one training step; returns the loss function's aux output.

    Raises:
      NonFiniteUpdateError: With `check_finite`, if an input (a float array
        of `kwargs`), the loss or a gradient is not finite, naming the first
        in data-flow order (inputs first); the variables are then unchanged
        (the step counter still advances).
      NonFiniteInputError: Without `check_finite`, when an earlier step is
        waited for (see `max_steps_in_flight`) whose float inputs were not
        finite, naming the step and the inputs; that step and the ones
        after it have run.
      ValueError: If an input buffer fails `SparseCoreEmbed.validate` (on
        the steps `validate_inputs` selects); nothing is changed. Also, on
        a GPU, once a refused kernel call of this or an earlier step has
        run (row pointers whose partition starts decrease: that call
        changed nothing; `check_finite` waits for the step, so its own
        refusals are raised by the same call).
    """
    grouping = self.grouping or _Grouping()
    if self.validate_inputs is True or (
      self.validate_inputs == "first" and not grouping.inputs_checked
    ):
      _validate_inputs(self.model, kwargs)
      grouping.inputs_checked = True
    if grouping.needs_placing(self.model):
      place_tables(self.model)
    stateless_model, groups = grouping.of(self.model)
    # `pz.freeze_variables` on a tuple of variables is each one's `freeze()`
    # (its selector walk cost more host time than the step's dispatch).
    frozen = {k: tuple(var.freeze() for var in v) for k, v in groups.items()}
    # Positional, in `_trainer_step`'s order: keyword arguments would be
    # flattened in sorted order and pair donated buffers with the wrong
    # outputs.
    (
      new_internal,
      new_dense,
      new_state,
      new_tables,
      new_slots,
      new_touched,
      aux,
      finite,
      done,
    ) = self.step_fn(
      self.root_rng,
      self.state.value,
      stateless_model,
      frozen["dense"],
      frozen["frozen"],
      frozen["state"],
      frozen["tables"],
      frozen["slots"],
      self.step_options,
      kwargs,
      None if self.touched is None else self.touched.bitmaps,
    )
    if self.touched is not None:
      self.touched.bitmaps = new_touched
    for group, new in (
      ("dense", new_dense),
      ("state", new_state),
      ("tables", new_tables),
      ("slots", new_slots),
    ):
      for var, value in zip(groups[group], new, strict=True):
        _assign(var, value.value)
    _assign(self.state, new_internal)
    grouping.in_flight.append((done, finite))
    if self.check_finite:
      # Waits for this step (its flags), so for every earlier one too.
      self._wait(len(grouping.in_flight), grouping)
      bad = sorted(
        (k for k, ok in jax.device_get(finite).items() if not bool(ok)),
        key=_data_flow_rank,
      )
      if bad:
        # The old step counter was donated; read the new one.
        step = int(new_internal.step) - 1
        also = f" (also non-finite: {', '.join(bad[1:])})" if bad[1:] else ""
        raise NonFiniteUpdateError(
          f"step {step}: the first non-finite value, in data-flow order "
          f"(inputs, loss, gradients, updated rows), is {bad[0]}{also}; "
          "the update was skipped"
        )
    else:
      self._wait(len(grouping.in_flight) - self.max_steps_in_flight, grouping)
    ffi.raise_device_errors()
    return aux

  def _wait(self, count: int, grouping: _Grouping) -> None:
    """Waits for the `count` oldest steps in flight; raises
    `NonFiniteInputError` if one of them had a non-finite input."""
    for _ in range(max(count, 0)):
      done, finite = grouping.in_flight.popleft()
      # Every device's copy: reading the value waits for one device only.
      done.block_until_ready()
      if self.check_finite:
        continue  # `step` reads this step's flags itself.
      steps = int(done)
      if steps < 0:  # `_done_marker`: an input was not finite.
        inputs = jax.device_get(_inputs_of(finite))
        bad = [k for k, ok in inputs.items() if not bool(ok)]
        raise NonFiniteInputError(
          f"step {-steps - 1}: non-finite values in {', '.join(bad)}; "
          "the step ran with them (its loss and updates are not finite: "
          "restore the variables from before it, or build the trainer with "
          "check_finite=True to have such steps skipped)"
        )

  def wait(self) -> None:
    """Waits for every dispatched step (see `max_steps_in_flight`).

    Raises:
      NonFiniteInputError: As `step`, for the steps waited for.
      ValueError: As `step`, for a refused CUDA kernel call.
    """
    grouping = self.grouping or _Grouping()
    self._wait(len(grouping.in_flight), grouping)
    ffi.raise_device_errors()

  def fit(
    self,
    batches: Iterable[Any],
    preprocess: Callable[[Any], Mapping[str, Any]] | None = None,
    *,
    steps: int | None = None,
    depth: int = 2,
    callback: Callable[[int, Any], None] | None = None,
    refresh_limits_every: int | None = None,
    headroom: float = 1.25,
  ) -> list[Any]:
    """Runs `step` on each batch, preprocessing the next ones meanwhile.

    `preprocess` runs in a background thread (`pzsc.prefetch`), up to
    `depth` batches ahead, so the host work of batch k + 1 overlaps step k.
    Like `step`, this updates the model's variables in place.

    The statistics of every batch the model's layers preprocess in `fit`
    are recorded, and kept by the trainer from one `fit` call to the next
    (an epoch loop of `fit` calls sees every epoch's batches). With
    `refresh_limits_every=n`, each layer's limits are set from the largest
    counts seen so far times `headroom` (`pzsc.update_limits`) where that
    at least halves one (each change compiles the step once more, for the
    new buffer shapes): first from the first batch, preprocessed once more
    before the first step (so the worst-case limits `from_config` starts
    with shrink to the data before anything compiles; in a later `fit`
    call the earlier batches count too, so the limits never fall below
    what they needed and an epoch loop compiles no more once its batches
    have been seen), then every `n` steps.
    A batch refused for its limits (`LimitsExceededError`) is never an
    error in `fit`, with or without `refresh_limits_every`: its counts join
    the statistics, the limits are raised from them (times `headroom`),
    the batch is preprocessed again and the step compiles once more; the
    first time, a `LimitsRaisedWarning` says so. The trainer's `model` is
    replaced in place, so `preprocess` must read the layer from the
    trainer at each call (`trainer.model[...].preprocess`, as in the
    example below), not hold on to a layer.

    Args:
      batches: Raw batches (any iterable; may be infinite with `steps`).
      preprocess: Maps a raw batch to `step`'s keyword arguments, e.g.
        `lambda b: {"inputs": trainer.model.embed.preprocess(b["ids"])[0],
        "labels": b["labels"]}` (host arrays: the step shards them over the
        batch); None when `batches` holds them already.
      steps: Stop after this many steps (None: when `batches` ends). No
        batch past the last step is pulled from `batches`.
      depth: Preprocessed batches that may wait for the step.
      callback: Called as `callback(i, aux)` after step `i` (from 0).
      refresh_limits_every: None (limits as they are unless a batch is
        over them), or the steps between refreshes of the limits from the
        recorded statistics.
      headroom: Factor on the recorded counts at a refresh (at least 1).

    Returns:
      The loss function's aux output of every step, in order.

    Raises:
      PrefetchError: If a batch fails in `batches` or `preprocess` (naming
        the batch; the steps before it were taken). It is also an instance
        of the original exception's type, e.g. `ValueError`.
      ValueError: If `steps` is negative, `refresh_limits_every` is not a
        positive int or None, `headroom` is below 1, or `preprocess`
        returns something other than a mapping of keyword arguments.
      NonFiniteUpdateError: As `step` (`NonFiniteInputError` too: `fit`
        waits for its last steps before it returns).
    """
    if steps is not None and steps < 0:
      raise ValueError(f"steps must be None or >= 0, got {steps}")
    if refresh_limits_every is not None and (
      not isinstance(refresh_limits_every, int) or refresh_limits_every < 1
    ):
      raise ValueError(
        "refresh_limits_every must be None or an int >= 1, got "
        f"{refresh_limits_every!r}"
      )
    if not headroom >= 1.0:
      raise ValueError(f"headroom must be >= 1, got {headroom!r}")
    if steps is not None:
      batches = itertools.islice(batches, steps)
    auxes: list[Any] = []
    if self.limit_stats is None:
      object.__setattr__(self, "limit_stats", _LimitsRefresher())
    limits = self.limit_stats
    limits.headroom = headroom
    every = refresh_limits_every
    with recording_stats(limits.record):
      if every is None:
        self._fit_redoing(iter(batches), preprocess, depth, callback, auxes)
      else:
        self._fit_refreshing(
          iter(batches), preprocess, depth, callback, auxes, every
        )
    self.wait()
    return auxes

  def _fit_redoing(self, source, preprocess, depth, callback, auxes) -> None:
    """`fit` without refreshes: a batch refused for its limits raises them
    and is redone, with the batches pulled after it."""
    redo: list[Any] = []
    refused_at = None
    while True:
      pulled: collections.deque[Any] = collections.deque()

      def feed(first=tuple(redo), pulled=pulled):
        for batch in itertools.chain(first, source):
          pulled.append(batch)
          yield batch

      def stepped(i, aux, pulled=pulled):
        pulled.popleft()
        if callback is not None:
          callback(i, aux)

      try:
        self._fit_run(feed(), preprocess, depth, stepped, auxes)
        return
      except PrefetchError as e:
        refused_at = self._raise_limits_for(e, auxes, refused_at)
        redo = list(pulled)  # The refused batch first.

  def _raise_limits_for(self, error, auxes, refused_at) -> int:
    """After `fit`'s run stopped at `error`: re-raises it unless it refused
    a batch for its limits, and not just after a refresh for it; else
    raises the limits (saying so once) and returns the refused step."""
    if not isinstance(error.__cause__, LimitsExceededError) or (
      refused_at == len(auxes)
    ):
      raise error
    self.limit_stats.refresh(self, must_admit=True)
    self.limit_stats.say_raised(len(auxes), error.__cause__, self.model)
    return len(auxes)

  def _fit_refreshing(
    self, source, preprocess, depth, callback, auxes, every
  ) -> None:
    """`fit` with refreshes every `every` steps (see `fit`)."""
    limits = self.limit_stats
    refused_at = None
    chunk = list(itertools.islice(source, every))
    if chunk and preprocess is not None:
      # Calibration before the first step: the first batch's counts (with
      # those of earlier `fit` calls).
      try:
        preprocess(chunk[0])
        limits.refresh(self, must_admit=False)
      except LimitsExceededError:
        limits.refresh(self, must_admit=True)
    while chunk:
      while chunk:
        try:
          self._fit_run(chunk, preprocess, depth, callback, auxes)
          chunk = []
        except PrefetchError as e:
          refused_at = self._raise_limits_for(e, auxes, refused_at)
          chunk = chunk[e.batch_number :]
      limits.refresh(self, must_admit=False)
      chunk = list(itertools.islice(source, every))

  def _fit_run(
    self,
    batches: Iterable[Any],
    preprocess: Callable[[Any], Mapping[str, Any]] | None,
    depth: int,
    callback: Callable[[int, Any], None] | None,
    auxes: list[Any],
  ) -> None:
    """`fit`'s loop over `batches`, appending to `auxes`."""
    with prefetch(batches, preprocess, depth=depth) as pipeline:
      for kwargs in pipeline:
        i = len(auxes)
        if not isinstance(kwargs, Mapping):
          raise ValueError(
            f"batch {i}: preprocess must return a mapping of step keyword "
            f"arguments, got {type(kwargs).__name__}"
          )
        auxes.append(self.step(**kwargs))
        if callback is not None:
          callback(i, auxes[-1])


class LimitsRaisedWarning(UserWarning):
  """`fit` raised a layer's limits for a batch over them, and redid it."""


class _LimitsRefresher:
  """`fit`'s record of each layer's statistics (kept by the trainer from
  one `fit` call to the next), and the refreshes."""

  def __init__(self, headroom: float = 1.25):
    self.headroom = headroom
    self._lock = threading.Lock()
    self._stats: dict[str, Any] = {}
    self._said = False

  def to_json(self) -> dict[str, Any]:
    """The statistics as JSON types (a checkpoint's `"fit_stats"`)."""
    with self._lock:
      stats = dict(self._stats)
    return {
      name: {
        field.name: {
          stack: np.asarray(value).tolist()
          for stack, value in getattr(s, field.name).items()
        }
        for field in dataclasses.fields(s)
      }
      for name, s in stats.items()
    }

  @classmethod
  def from_json(cls, data: Mapping[str, Any], model: Any) -> _LimitsRefresher:
    """Statistics from `to_json`, for `model`'s layers: a layer's are kept
    where every stack they count is the layer's and was counted on its
    topology (as many partitions and SparseCores), else dropped (limits
    are not converted between topologies, `_ckpt_limits`)."""
    out = cls()
    for embed in find_embeds(model):
      saved = data.get(embed.config.name)
      if saved is None:
        continue
      stats = SparseDenseMatmulInputStats(
        **{
          field: {
            stack: np.asarray(
              value, np.int64 if field == "id_drop_counters" else np.int32
            )
            for stack, value in values.items()
          }
          for field, values in saved.items()
        }
      )
      if _counted_for(stats, embed):
        out._stats[embed.config.name] = stats
    return out

  def say_raised(self, step: int, error: Exception, model: Any) -> None:
    """Warns, once per trainer, that a batch was over the limits."""
    if self._said:
      return
    self._said = True
    limits = {
      e.config.name: {
        s.name: (
          s.spec.max_ids_per_partition,
          s.spec.max_unique_ids_per_partition,
        )
        for s in e.config.plan.stacks
      }
      for e in find_embeds(model)
    }
    warnings.warn(
      f"fit: the batch of step {step} was over the limits ({error}); the "
      "limits were raised from every batch's statistics so far (times "
      f"headroom {self.headroom}) to {limits} (max ids, max unique ids per "
      "partition, per layer and stack) and the batch was redone; the step "
      "compiles once more for the new buffer shapes. Later batches over "
      "the limits are handled alike, without this warning.",
      LimitsRaisedWarning,
      stacklevel=3,
    )

  def record(self, config: Any, stats: Any) -> None:
    with self._lock:
      seen = self._stats.get(config.name)
      self._stats[config.name] = (
        stats if seen is None else fdo.merge_stats(seen, stats)
      )

  def refresh(self, trainer: SparseCoreTrainer, must_admit: bool) -> None:
    """Swaps in layers with limits from the statistics (see
    `_worth_changing`)."""
    with self._lock:
      stats = dict(self._stats)

    def refresh(embed: SparseCoreEmbed) -> SparseCoreEmbed:
      seen = stats.get(embed.config.name)
      if seen is None:
        return embed
      new = update_limits(embed, seen, headroom=self.headroom)
      if _worth_changing(embed.config.plan, new.config.plan, must_admit):
        return new
      return embed

    model = (
      pz.select(trainer.model).at_instances_of(SparseCoreEmbed).apply(refresh)
    )
    if model is not trainer.model:
      # The steps in flight hold their own buffers; the next ones use the
      # new layers.
      object.__setattr__(trainer, "model", model)


def fit_limits_from_json(data: Mapping[str, Any], model: Any) -> Any:
  """`fit`'s statistics from a checkpoint's `"fit_stats"`, for `model`'s
  layers (see `SparseCoreTrainer.limit_stats`)."""
  return _LimitsRefresher.from_json(data, model)


def _counted_for(stats: SparseDenseMatmulInputStats, embed: Any) -> bool:
  """Whether `stats` count stacks of `embed` on its topology (this
  process's devices x its partitions; SparseCores)."""
  plan = embed.config.plan
  stacks = {stack.name for stack in plan.stacks}
  try:
    local = local_device_count(embed.config.topology)
  except ValueError:
    return False
  sizes = {
    "max_ids_per_partition": local * plan.num_shards,
    "max_unique_ids_per_partition": local * plan.num_shards,
    "required_buffer_size_per_sc": local * plan.num_sc_per_device,
  }
  for field, size in sizes.items():
    for stack, value in getattr(stats, field).items():
      if stack not in stacks or np.asarray(value).size != size:
        return False
  return True


def _worth_changing(old: Any, new: Any, must_admit: bool) -> bool:
  """Whether to swap in new limits: always to admit a refused batch (the
  new ones include its counts), otherwise only where one at least halves
  (limits that admit every batch so far stay: each change compiles)."""
  if must_admit:
    return True
  fields = ("max_ids_per_partition", "max_unique_ids_per_partition")
  return any(
    2 * getattr(b.spec, field) <= getattr(a.spec, field)
    for a, b in zip(old.stacks, new.stacks, strict=True)
    for field in fields
  )
