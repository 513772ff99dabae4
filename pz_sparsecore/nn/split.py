"""Hand-written training steps, converting models, and tied tables.

A SparseCore table never takes a dense gradient (`TableGradientError`):
its optimizer runs fused and in place on the rows a batch referenced. A
hand-written step therefore splits the model into its tables and its dense
rest, differentiates the dense part, and lets the tables update themselves::

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def train_step(model, tokens, targets, step, opt_state):
    rest, dense = pzsc.split_tables(model)
    loss, grads = pzsc.value_and_grad(loss_of, step=step)(
        rest, dense, tokens, targets)    # tables updated in place here
    updates, opt_state = optimizer.update(grads, opt_state, dense)
    ...                                  # write optax's updates into dense
    return loss, opt_state

where `loss_of(model, tokens, targets)` calls the model as usual.
`SparseCoreTrainer` does the same inside its step.

`convert_lookups(model, mesh=..., optimizer=...)` converts every
`pz.nn.EmbeddingLookup` of a model (what the one-line `pz.select(...)
.apply(SparseCoreLookup.from_lookup)` does) and refuses a lookup whose table
an `EmbeddingDecode` shares: converting it would untie the model silently.
`ties.check_untied` makes the same check on a converted model; the
trainer, `split_tables` and `pzsc.variable_jit` run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from penzai import pz

from pz_sparsecore.device import routing
from pz_sparsecore.nn.embed import find_embeds, variable_labels
from pz_sparsecore.nn.lookup import SparseCoreLookup
from pz_sparsecore.nn.tables import assign_arrays, slot_arrays, table_arrays
from pz_sparsecore.nn.ties import (
  TiedTableError,
  check_untied,
  decode_tables,
  tie_message,
)
from pz_sparsecore.nn.training import (
  probe_templates,
  recorded_input,
  with_probes,
)

__all__ = [
  "convert_lookups",
  "split_tables",
  "value_and_grad",
]


def convert_lookups(model: Any, **from_lookup_kwargs: Any) -> Any:
  """Every `pz.nn.EmbeddingLookup` of `model` as a `SparseCoreLookup`.

  Args:
    model: A Penzai model (variables bound).
    **from_lookup_kwargs: `SparseCoreLookup.from_lookup`'s keyword
      arguments (`mesh`, `optimizer`, ...).

  Returns:
    The converted model.

  Raises:
    TiedTableError: If an `EmbeddingDecode` shares a lookup's table.
  """
  lookups = pz.select(model).at_instances_of(pz.nn.EmbeddingLookup)
  labels = {
    getattr(lk.table.embeddings, "label", None) for lk in lookups.get_sequence()
  }
  for path, label in decode_tables(model):
    if label in labels:
      raise TiedTableError(tie_message(label, path))
  return lookups.apply(
    lambda lk: SparseCoreLookup.from_lookup(lk, **from_lookup_kwargs)
  )


def split_tables(model: Any) -> tuple[Any, tuple[Any, ...]]:
  """The model's dense rest and its trainable dense parameters.

  Like `pz.unbind_params(model, freeze=True)`, but only the trainable
  parameters that are not SparseCore tables are unbound: the tables and
  their slots stay bound in `rest`, where `value_and_grad` updates them.

  Args:
    model: A Penzai model with `SparseCoreEmbed` / `SparseCoreLookup`
      layers (variables bound).

  Returns:
    `(rest, dense)`: `pz.bind_variables(rest, dense)` is the model again;
    `dense` holds frozen `pz.ParameterValue`s, ready for `jax.grad` and
    optax.

  Raises:
    TiedTableError: As `check_untied`.
  """
  check_untied(model)
  tables, _ = variable_labels(model)
  return pz.unbind_params(
    model,
    lambda p: p.label not in tables and p.metadata.get("trainable", True),
    freeze=True,
  )


def value_and_grad(
  loss_fn: Callable[..., Any], *, step: jax.Array | int, has_aux: bool = False
) -> Callable[..., Any]:
  """`jax.value_and_grad` over a model's dense part; tables update in place.

  Args:
    loss_fn: `loss_fn(model, *args, **kwargs) -> loss` (or `(loss, aux)`
      with `has_aux`), calling the model as usual; each SparseCore layer at
      most once.
    step: The training step the tables' optimizers see.
    has_aux: As `jax.value_and_grad`'s.

  Returns:
    `f(rest, dense, *args, **kwargs) -> (value, grads)`, `rest` and `dense`
    from `split_tables`: `value` is `loss_fn`'s output, `grads` the
    gradient with respect to `dense`. Before returning, `f` applies every
    called table's fused update to the variables bound in `rest` (use it
    inside `pzsc.variable_jit(..., donate_variables=True)` so the update
    happens in the donated buffers).
  """

  def run(rest, dense, probes, args, kwargs):
    model, attached = with_probes(pz.bind_variables(rest, dense), probes)
    return loss_fn(model, *args, **kwargs), attached

  def wrapped(rest: Any, dense: Any, *args: Any, **kwargs: Any):
    embeds = find_embeds(rest)
    probes = probe_templates(
      embeds, lambda p: run(rest, dense, p, args, kwargs)[1], (args, kwargs)
    )

    def compute(dense, probes):
      out, attached = run(rest, dense, probes, args, kwargs)
      loss = out[0] if has_aux else out
      inputs = tuple(
        recorded_input(e, a) for e, a in zip(embeds, attached, strict=True)
      )
      return loss, (out, inputs)

    grad_fn = jax.grad(compute, argnums=(0, 1), has_aux=True)
    (g_dense, g_probes), (out, inputs) = grad_fn(dense, probes)
    for embed, recorded, grads in zip(embeds, inputs, g_probes, strict=True):
      if recorded is None:
        continue
      tables, slots = routing.apply_gradients(
        embed.plan_of(grads),
        embed.config.topology,
        table_arrays(embed),
        slot_arrays(embed),
        recorded,
        grads,
        step,
      )
      assign_arrays(embed, tables, slots)
    return out, g_dense

  return wrapped
