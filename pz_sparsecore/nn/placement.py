"""Keeping tables sharded when a model is placed with Penzai's tools.

Penzai places a model by mapping axis names to mesh axes
(`pz.toolshed.sharding_util.name_to_name_device_put`, `sharded_init`,
`name_to_name_sharding`). A SparseCore table's axes are `"sc_shard"`,
`"sc_row"` and a column axis (`"sc_embedding"` for a `SparseCoreLookup`,
the layer's embedding axis for a `SparseCoreEmbed`); a model's own mapping
names none of the first two, so Penzai's placement would replicate every
table and slot on every device.

* `complete_mapping(model, mapping)` adds the tables' entries to a model's
  mapping (`"sc_shard"` → the mesh axes the tables are sharded over,
  `"sc_row"` → None), so Penzai's placement keeps them sharded.
* `place_tables(model)` finds tables and slots whose arrays are not laid out
  as their layer expects, warns, and puts them back (one transfer each). The
  trainer runs it on its first step, `pzsc.variable_jit` on each new
  argument structure, and a `SparseCoreLookup` on every eager call.

Example, a `("data", "model")` mesh of 2 x 4 and the mapping
`{"batch": "data", "neurons": "model"}`: `complete_mapping` returns
`{"batch": "data", "neurons": "model", "sc_shard": ("data", "model"),
"sc_row": None}`, and Penzai's placement of the model's variables with it
leaves each device one eighth of every table::

  mapping = pzsc.complete_mapping(model, {"batch": "data", "neurons": "model"})
  stateless, values = pz.unbind_variables(model, freeze=True)
  values = sharding_util.name_to_name_device_put(values, mesh, mapping)
  model = pz.bind_variables(stateless, [v.unfreeze_as_copy() for v in values])
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz

from pz_sparsecore.nn.embed import SparseCoreEmbed, find_embeds
from pz_sparsecore.nn.tables import (
  ROW_AXIS,
  SHARD_AXIS,
  last_axis,
  named_table,
  positional_table,
)

__all__ = [
  "TablePlacementWarning",
  "complete_mapping",
  "committed_to_mesh",
  "place_tables",
]


class TablePlacementWarning(UserWarning):
  """A table or slot was found placed unlike its layer's layout."""


def complete_mapping(
  model: Any, axis_name_to_mesh_name: Mapping[str, Any]
) -> dict[str, Any]:
  """A model's placement mapping with its SparseCore tables' entries added.

  Args:
    model: A model with `SparseCoreEmbed` / `SparseCoreLookup` layers.
    axis_name_to_mesh_name: The model's mapping (Penzai's `sharding_util`).

  Returns:
    A new mapping with `"sc_shard"` → the tables' shard mesh axes and
    `"sc_row"` → None.

  Raises:
    ValueError: If the mapping already sends `"sc_shard"` or `"sc_row"`
      elsewhere, or the model's layers shard their tables over different
      mesh axes.
  """
  out = dict(axis_name_to_mesh_name)
  axes = {e.config.topology.axes for e in find_embeds(model)}
  if len(axes) > 1:
    raise ValueError(
      f"the model's SparseCore layers shard their tables over different "
      f"mesh axes {sorted(axes)}; one mapping cannot place them all"
    )
  for name, want in ((SHARD_AXIS, next(iter(axes), None)), (ROW_AXIS, None)):
    if name in out and _axes(out[name]) != _axes(want):
      raise ValueError(
        f"the mapping sends {name!r} to {out[name]!r}; the model's tables "
        f"need {want!r}"
      )
    out[name] = want
  return out


def _axes(value: Any) -> tuple[str, ...]:
  if value is None:
    return ()
  return (value,) if isinstance(value, str) else tuple(value)


def _misplaced(
  embed: SparseCoreEmbed, stack: str, var: Any
) -> jax.Array | None:
  """The variable's array if it is concrete and not laid out as expected."""
  if not isinstance(var, pz.Parameter | pz.StateVariable):
    return None
  value = getattr(var, "value", None)
  if not isinstance(value, pz.nx.NamedArray | pz.nx.NamedArrayView):
    return None
  array = positional_table(embed.config, value)
  if isinstance(array, jax.core.Tracer) or not isinstance(array, jax.Array):
    return None
  want = embed.config.topology.table_sharding(stack)
  if array.sharding.is_equivalent_to(want, 3):
    return None
  return array


def place_tables(model: Any) -> list[str]:
  """Puts back every table and slot not laid out as its layer expects.

  Args:
    model: A model (variables bound; frozen or traced values are skipped).

  Returns:
    The labels that were re-placed (a `TablePlacementWarning` names them).
  """
  moved = []
  for embed in find_embeds(model):
    variables = list(embed.tables.items())
    variables += [
      (stack, v) for stack, slots in embed.slots.items() for v in slots.values()
    ]
    for stack, var in variables:
      array = _misplaced(embed, stack, var)
      if array is None:
        continue
      want = embed.config.topology.table_sharding(stack)
      var.value = named_table(
        embed.config,
        jax.device_put(array, want),
        last_axis(embed.config, var.value),
      )
      moved.append(var.label)
  if moved:
    warnings.warn(
      f"SparseCore tables and slots {moved} were not sharded as their "
      "layer lays them out (a placement mapping without 'sc_shard' "
      "replicates them); they were put back. Place the model with "
      "pzsc.complete_mapping(model, mapping) to keep them sharded",
      TablePlacementWarning,
      stacklevel=3,
    )
  return moved


def committed_to_mesh(tree: Any, model: Any) -> Any:
  """`tree` with its uncommitted arrays put on `model`'s mesh, replicated.

  Arrays a model creates without placing them (Penzai's scales and
  epsilons, optax's step counters) are uncommitted: passed to a jitted call
  over the mesh they are copied to every device on every call, and they
  come back replicated, which makes the second call compile again. Put once
  on the mesh of the model's first SparseCore layer, they stay put.

  Args:
    tree: Any pytree (frozen variables, optimizer state, array leaves).
    model: The model whose SparseCore layers give the mesh; without any,
      `tree` is returned as it is.

  Returns:
    The new tree.
  """
  embeds = find_embeds(model)
  if not embeds:
    return tree
  replicated = NamedSharding(embeds[0].config.topology.mesh, P())

  def place(leaf):
    if isinstance(leaf, np.ndarray) or (
      isinstance(leaf, jax.Array) and not leaf.committed
    ):
      return jax.device_put(leaf, replicated)
    return leaf

  return jax.tree.map(place, tree)
