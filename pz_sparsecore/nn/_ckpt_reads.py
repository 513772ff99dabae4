"""What a restore reads, and how each variable is built from the reads.

`Reads.plan(stored, description, model)` turns a checked manifest into orbax
restore arguments (array key → sharding, global shape, dtype) and, per
variable, the way to build its value:

* a stack whose stored layout equals the model's is read straight into the
  layer's shards (`topology.table_sharding(stack)`);
* any other stack reads every stored stack its tables come from, sharded
  over the model's mesh (`_ckpt_layout.read_sharding`), and `relayout`
  moves the rows on device;
* a dense variable or trainer leaf whose target value is committed to
  devices is read onto the same sharding; anything else (an uncommitted
  value, a variable slot) is read to the host and becomes an uncommitted
  array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from penzai import pz

from pz_sparsecore.core import optimizers
from pz_sparsecore.nn._ckpt_hashed import moved
from pz_sparsecore.nn._ckpt_layout import (
  Source,
  StackLayout,
  read_sharding,
  relayout,
  stack_layout,
)
from pz_sparsecore.nn._ckpt_manifest import TABLE, Description, build_leaf
from pz_sparsecore.nn.embed import (
  EmbedConfig,
  SparseCoreEmbed,
  find_embeds,
  named_table,
)
from pz_sparsecore.nn.tables import slot_axis


@dataclasses.dataclass(frozen=True)
class StackRead:
  """How one stacked variable (a table or a slot) is built from the reads.

  Attributes:
    config: The layer's config.
    stack: The stack's name in the layer.
    target: The model's layout of the stack.
    keys: The stored arrays it comes from.
    sources: None to take `keys[0]` as it is, else the relayout's sources.
    axis: The variable's last axis (`named_table`): None for the
      embedding axis, else a slot's (`tables.slot_axis`).
  """

  config: EmbedConfig
  stack: str
  target: StackLayout
  keys: tuple[str, ...]
  sources: tuple[Source, ...] | None
  axis: str | None = None

  def __call__(self, arrays: Mapping[str, Any]) -> pz.nx.NamedArray:
    stored = [arrays[key] for key in self.keys]
    value = stored[0]
    if self.sources is not None:
      # Rows move between shards as a sharded stack's do; a replicated
      # stack is then copied to every device.
      topology = self.config.topology
      value = relayout(stored, self.sources, self.target, topology.sharding(3))
      if topology.is_replicated(self.stack):
        value = jax.device_put(value, topology.table_sharding(self.stack))
    return named_table(self.config, value, self.axis)


def _leaf_args(entry: Mapping[str, Any], target: Any) -> ocp.RestoreArgs:
  """Committed values are read onto their sharding, others to the host."""
  if isinstance(target, jax.Array) and target.committed:
    return ocp.ArrayRestoreArgs(
      sharding=target.sharding,
      global_shape=tuple(entry["shape"]),
      dtype=target.dtype,
    )
  return ocp.RestoreArgs(restore_type=np.ndarray)


def _sources(
  name: str, target: StackLayout, stacks: Mapping[str, Any]
) -> tuple[list[str], tuple[Source, ...] | None]:
  """The stored stacks model stack `name` comes from, and where each of its
  tables is in them (None when the stored stack has the same layout)."""
  kept = stacks.get(name)
  if kept is not None and StackLayout.from_json(kept["layout"]) == target:
    return [name], None
  where = {}
  for stored, entry in stacks.items():
    layout = StackLayout.from_json(entry["layout"])
    for placement in layout.tables:
      where[placement.name] = (stored, layout.num_shards, placement)
  names = list(dict.fromkeys(where[t.name][0] for t in target.tables))
  sources = tuple(
    Source(names.index(where[t.name][0]), *where[t.name][1:])
    for t in target.tables
  )
  return names, sources


def _stack_args(
  entry: Mapping[str, Any],
  embed: SparseCoreEmbed,
  stack: str,
  dtype: Any,
  direct: bool,
  slot: optimizers.Slot | None,
) -> ocp.ArrayRestoreArgs:
  """Reads a stored stack's table (or slot `slot`) into the layer's shards
  (or copies, for a replicated stack), or for a relayout; the table in
  `dtype`, the model stack's (a cast where `check` allowed one)."""
  layout = StackLayout.from_json(entry["layout"])
  if slot is not None:
    layout = layout.with_width(slot.width(layout.dim))
  topology = embed.config.topology
  sharding, shape = topology.table_sharding(stack), layout.shape
  if not direct:
    sharding, shape = read_sharding(layout, topology)
  return ocp.ArrayRestoreArgs(
    sharding=sharding,
    global_shape=shape,
    # Slots are float32.
    dtype=np.dtype(dtype if slot is None else np.float32),
    strict=shape == layout.shape,
  )


def _embed_reads(
  embed: SparseCoreEmbed, stacks: Mapping[str, Any], args: dict[str, Any]
) -> dict[str, StackRead]:
  """Label → how to build it, for one layer; adds its reads to `args`."""
  config = embed.config
  out = {}
  for stack in config.plan.stacks:
    target = stack_layout(config.plan, stack)
    names, sources = _sources(stack.name, target, stacks)
    labels = {TABLE: (config.table_label(stack.name), None)}
    for slot in stack.optimizer.definition.slots:
      labels[slot.name] = (config.slot_label(stack.name, slot.name), slot)
    for array, (label, slot) in labels.items():
      keys = tuple(stacks[name]["arrays"][array] for name in names)
      for name, key in zip(names, keys, strict=True):
        args[key] = _stack_args(
          stacks[name], embed, stack.name, stack.dtype, sources is None, slot
        )
      layout, axis = target, None
      if slot is not None:
        layout = target.with_width(slot.width(target.dim))
        axis = slot_axis(config, slot)
      out[label] = StackRead(config, stack.name, layout, keys, sources, axis)
  return out


def _leaf_reads(
  stored: list[Any], target: list[Any], values: Mapping[str, Any], args: dict
) -> list[tuple[Mapping[str, Any], str]]:
  """(stored leaf, array key) per leaf; adds the reads to `args`.

  `target` holds the target's entries in the order of `stored`'s, and
  `values` the target's arrays (which give committed values' shardings).
  """
  out = []
  for kept, entry in zip(stored, target, strict=True):
    args[kept["array"]] = _leaf_args(kept["leaf"], values.get(entry["array"]))
    out.append((kept["leaf"], kept["array"]))
  return out


@dataclasses.dataclass
class Reads:
  """Every array to read for a target, and how to build its values.

  Attributes:
    args: Array key → orbax restore arguments.
    stacks: Table and slot labels → how to build them.
    variables: Other variable labels → (stored leaf, array key).
    trainer: The trainer's leaves (stored leaf, array key), or None.
  """

  args: dict[str, Any]
  stacks: dict[str, StackRead]
  variables: dict[str, tuple[Mapping[str, Any], str]]
  trainer: list[tuple[Mapping[str, Any], str]] | None

  @classmethod
  def plan(
    cls, stored: Mapping[str, Any], description: Description, model: Any
  ) -> Reads:
    """The reads of a target whose manifest `check` accepted."""
    leaves = cls.plan_leaves(stored, description)
    args, stacks = dict(leaves.args), {}
    for embed in find_embeds(model):
      layer = stored["embeds"][embed.config.name]
      stacks.update(_embed_reads(embed, layer, args))
    return dataclasses.replace(leaves, args=args, stacks=stacks)

  @classmethod
  def plan_leaves(
    cls, stored: Mapping[str, Any], description: Description
  ) -> Reads:
    """The reads of the dense variables and trainer leaves only (a delta
    checkpoint's, `_ckpt_delta`)."""
    args = {}
    target, values = description.manifest, description.values
    labels = list(target["variables"])
    # A hashed map saved for other shards is read to the host (and moved
    # by `_ckpt_hashed.rehome`).
    elsewhere = {
      target["variables"][label]["array"]
      for label in moved(stored["variables"], target["variables"])
    }
    variables = _leaf_reads(
      [stored["variables"][label] for label in labels],
      [target["variables"][label] for label in labels],
      {k: v for k, v in values.items() if k not in elsewhere},
      args,
    )
    trainer = None
    if target["trainer"] is not None:
      trainer = _leaf_reads(stored["trainer"], target["trainer"], values, args)
    return cls(args, {}, dict(zip(labels, variables, strict=True)), trainer)

  def stored_key(self, label: str) -> str | None:
    """The stored array a table or slot label is read from as it is
    stored (the same layout); None if it is built by a relayout."""
    read = self.stacks[label]
    return read.keys[0] if read.sources is None else None

  def values(self, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """Label → the restored value of every variable."""
    out = {label: read(arrays) for label, read in self.stacks.items()}
    for label, (leaf, key) in self.variables.items():
      out[label] = build_leaf(leaf, arrays[key])
    return out

  def trainer_leaves(self, arrays: Mapping[str, Any]) -> list[Any]:
    """The restored leaves of the trainer's state and key."""
    return [build_leaf(leaf, arrays[key]) for leaf, key in self.trainer]
