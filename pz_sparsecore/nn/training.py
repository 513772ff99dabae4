"""Training Penzai models that contain `SparseCoreEmbed` layers.

`SparseCoreTrainer` mirrors Penzai's `basic_training.StatefulTrainer`: same
`build(root_rng, model, optimizer_def, loss_fn)` and `step(**kwargs) -> aux`,
same loss-function protocol `loss_fn(*, model, state, rng, **kwargs) ->
(loss, new_state, aux)`. What differs is how the embedding tables learn:

* Every `SparseCoreEmbed` in the model gets a zero *probe* added to its
  activations, and the step differentiates the loss with respect to the
  dense parameters and the probes. The probe's gradient is the gradient with
  respect to the activations; the tables are never differentiated.
* `optimizer_def` (optax) updates the dense parameters only.
* Each stack's own optimizer (from its `TableSpec`) runs through the fused
  FFI update with the trainer's true step, touching only referenced rows.
* Tables, slots, dense parameters and optimizer state are donated, so every
  update happens in place: a step costs O(batch), not O(vocabulary).

The same step can be written by hand with `pz.variable_jit`::

  @functools.partial(pz.variable_jit, donate_variables=True)
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

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from penzai import pz

from pz_sparsecore.nn.embed import ROW_AXIS, SHARD_AXIS, SparseCoreEmbed


class NonFiniteUpdateError(FloatingPointError):
  """A training step produced a NaN or infinity."""


class _Tap:
  """Collects the inputs an embed was called with during one trace."""

  def __init__(self):
    self.inputs = []

  def record(self, inputs: Any) -> None:
    self.inputs.append(inputs)


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


def embeds_of(model: Any) -> list[SparseCoreEmbed]:
  """The `SparseCoreEmbed` layers of a model, in tree order."""
  return pz.select(model).at_instances_of(SparseCoreEmbed).get_sequence()


def _embed_labels(model: Any) -> tuple[set[str], set[str]]:
  tables, slots = set(), set()
  for embed in embeds_of(model):
    for stack, spec in embed.config.stacks.items():
      tables.add(embed.config.table_label(stack))
      for slot in spec.optimizer.slot_names():
        slots.add(embed.config.slot_label(stack, slot))
  return tables, slots


def _positional(value: pz.nx.NamedArray, embed: SparseCoreEmbed) -> jax.Array:
  return value.unwrap(SHARD_AXIS, ROW_AXIS, embed.config.embedding_axis)


def _trainer_step(
  root_rng: jax.Array,
  state: SparseCoreTrainerState,
  stateless_model: Any,
  dense_params: tuple[Any, ...],
  frozen_params: tuple[Any, ...],
  state_vars: tuple[Any, ...],
  tables: tuple[Any, ...],
  slots: tuple[Any, ...],
  loss_fn: Callable[..., Any],
  optimizer_def: optax.GradientTransformation,
  check_finite: bool,
  kwargs: dict[str, Any],
):
  step_rng = jax.random.fold_in(root_rng, state.step)
  embeds = embeds_of(stateless_model)
  probes = tuple(
    {k: jnp.zeros(s.shape, s.dtype) for k, s in e.activation_shapes().items()}
    for e in embeds
  )

  def compute(dense_params, probes):
    taps = [_Tap() for _ in embeds]
    state_vars_mut = tuple(v.unfreeze_as_copy() for v in state_vars)
    model = pz.bind_variables(
      stateless_model,
      state_vars_mut + dense_params + frozen_params + tables + slots,
    )
    index = iter(range(len(embeds)))

    def attach(embed):
      i = next(index)
      return dataclasses.replace(
        embed, activation_probes=probes[i], tap=taps[i]
      )

    model = pz.select(model).at_instances_of(SparseCoreEmbed).apply(attach)
    loss, new_loss_state, aux = loss_fn(
      model=model, state=state.loss_fn_state, rng=step_rng, **kwargs
    )
    for embed, tap in zip(embeds, taps, strict=True):
      if len(tap.inputs) > 1:
        raise ValueError(
          f"SparseCoreEmbed {embed.config.name!r} was called "
          f"{len(tap.inputs)} times in one loss evaluation; call it once"
        )
    recorded = tuple(tap.inputs[0] if tap.inputs else None for tap in taps)
    return loss, (
      pz.freeze_variables(state_vars_mut),
      new_loss_state,
      aux,
      recorded,
      loss,
    )

  grad_fn = jax.grad(compute, argnums=(0, 1), has_aux=True)
  (g_dense, g_probes), (new_state_vars, new_loss_state, aux, recorded, loss) = (
    grad_fn(dense_params, probes)
  )
  by_label = {v.label: v for v in tables + slots}
  active = [
    (embed, inputs, grads)
    for embed, inputs, grads in zip(embeds, recorded, g_probes, strict=True)
    if inputs is not None
  ]
  owner = {}
  for embed, _, _ in active:
    for s, spec in embed.config.stacks.items():
      owner[embed.config.table_label(s)] = embed
      for n in spec.optimizer.slot_names():
        owner[embed.config.slot_label(s, n)] = embed

  def update_all():
    updates, new_opt_state = optimizer_def.update(
      g_dense, state.opt_state, dense_params
    )
    new_dense = optax.apply_updates(dense_params, updates)
    new_by_label = {}
    for embed, inputs, grads in active:
      config = embed.config
      table_values = {
        s: _positional(by_label[config.table_label(s)].value, embed)
        for s in config.stacks
      }
      slot_values = {
        s: tuple(
          _positional(by_label[config.slot_label(s, n)].value, embed)
          for n in spec.optimizer.slot_names()
        )
        for s, spec in config.stacks.items()
      }
      new_tables, new_slots = embed.updated_arrays(
        table_values, slot_values, inputs, grads, state.step
      )
      for s, spec in config.stacks.items():
        new_by_label[config.table_label(s)] = new_tables[s]
        names = spec.optimizer.slot_names()
        for n, value in zip(names, new_slots[s], strict=True):
          new_by_label[config.slot_label(s, n)] = value
    return new_dense, new_opt_state, new_by_label

  finite = {"loss": jnp.isfinite(loss)}
  if check_finite:
    for embed, grads in zip(embeds, g_probes, strict=True):
      for s in embed.config.stacks:
        members = {f.name for f in embed._stack_features(s)}
        finite[embed.config.table_label(s)] = jnp.all(
          jnp.stack([jnp.all(jnp.isfinite(grads[f])) for f in members])
        )
    for var, grad in zip(dense_params, g_dense, strict=True):
      leaves = jax.tree.leaves(grad)
      finite[var.label] = jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves] or [True])
      )
    ok = jnp.all(jnp.stack(list(finite.values())))

    def keep():
      old = {
        label: _positional(by_label[label].value, embed)
        for label, embed in owner.items()
      }
      return dense_params, state.opt_state, old

    new_dense, new_opt_state, new_by_label = jax.lax.cond(ok, update_all, keep)
  else:
    new_dense, new_opt_state, new_by_label = update_all()

  def rebuild(variables):
    out = []
    for var in variables:
      if var.label in new_by_label:
        named = pz.nx.wrap(new_by_label[var.label]).tag(*var.value.named_shape)
        var = dataclasses.replace(var, value=named)
      out.append(var)
    return tuple(out)

  # Outputs follow the donated inputs' positional order (state, dense,
  # state vars, tables, slots): jit pairs donated buffers with outputs of the
  # same shape in order, so any other order hands a table's buffer to a slot
  # (or the reverse) and forces vocabulary-sized copies every step.
  return (
    SparseCoreTrainerState(
      step=state.step + 1,
      opt_state=new_opt_state,
      loss_fn_state=new_loss_state,
    ),
    new_dense,
    new_state_vars,
    rebuild(tables),
    rebuild(slots),
    aux,
    finite,
  )


class _Grouping:
  """The model's variables sorted into the step's groups, per model object.

  Unbinding the variables and finding the tables and slots walks the whole
  model; the result only changes when the model object does (variables are
  read afresh every step), so it is kept for the last model seen.
  """

  def __init__(self):
    self._model = None
    self._result = None

  def of(self, model: Any) -> tuple[Any, dict[str, list[Any]]]:
    if model is not self._model:
      self._result = _group_variables(model)
      self._model = model
    return self._result


def _group_variables(model: Any) -> tuple[Any, dict[str, list[Any]]]:
  """The stateless model and its variables by role in the step."""
  stateless_model, variables = pz.unbind_variables(model)
  table_labels, slot_labels = _embed_labels(model)
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

    Returns:
      The trainer.
    """
    _, params = pz.unbind_params(model)
    table_labels, _ = _embed_labels(model)
    dense = [
      p
      for p in params
      if p.label not in table_labels and p.metadata.get("trainable", True)
    ]
    opt_state = optimizer_def.init(pz.freeze_params(tuple(dense)))
    donated = ["state", "dense_params", "state_vars", "tables", "slots"]
    step_fn = jax.jit(
      _trainer_step,
      donate_argnames=donated if donate else (),
      static_argnames=["loss_fn", "optimizer_def", "check_finite"],
    )
    return cls(
      root_rng=root_rng,
      model=model,
      state=pz.StateVariable(
        SparseCoreTrainerState(
          # An array from the start, so the first step and the later ones
          # share one compilation.
          step=jnp.zeros((), jnp.int32),
          opt_state=opt_state,
          loss_fn_state=initial_loss_fn_state,
        ),
        label="SparseCoreTrainer.state",
      ),
      optimizer_def=optimizer_def,
      loss_fn=loss_fn,
      step_fn=step_fn,
      check_finite=check_finite,
      grouping=_Grouping(),
    )

  def step(self, **kwargs: Any) -> Any:
    """Runs one training step; returns the loss function's aux output.

    Raises:
      NonFiniteUpdateError: With `check_finite`, if the loss or a gradient
        is not finite; the variables are then unchanged (the step counter
        still advances).
    """
    grouping = self.grouping or _Grouping()
    stateless_model, groups = grouping.of(self.model)
    frozen = {k: pz.freeze_variables(tuple(v)) for k, v in groups.items()}
    # Positional, in `_trainer_step`'s order: keyword arguments would be
    # flattened in sorted order and pair donated buffers with the wrong
    # outputs.
    new_internal, new_dense, new_state, new_tables, new_slots, aux, finite = (
      self.step_fn(
        self.root_rng,
        self.state.value,
        stateless_model,
        frozen["dense"],
        frozen["frozen"],
        frozen["state"],
        frozen["tables"],
        frozen["slots"],
        self.loss_fn,
        self.optimizer_def,
        self.check_finite,
        kwargs,
      )
    )
    for var, new in zip(groups["dense"], new_dense, strict=True):
      var.update(new)
    for var, new in zip(groups["state"], new_state, strict=True):
      var.update(new)
    for var, new in zip(groups["tables"], new_tables, strict=True):
      var.update(new)
    for var, new in zip(groups["slots"], new_slots, strict=True):
      var.update(new)
    self.state.value = new_internal
    if self.check_finite:
      bad = [k for k, ok in jax.device_get(finite).items() if not bool(ok)]
      if bad:
        # The old step counter was donated; read the new one.
        step = int(new_internal.step) - 1
        raise NonFiniteUpdateError(
          f"step {step}: non-finite loss or gradient in "
          f"{', '.join(sorted(bad))}; the update was skipped"
        )
    return aux
