"""The positional and logical views of a `SparseCoreEmbed`'s variables.

A stack's table (and each of its optimizer slots) is one variable whose
value is a `NamedArray` with axes `(SHARD_AXIS, ROW_AXIS, embedding_axis)`,
shape `[N, V_shard, D]`; a slot not shaped like the table (a "rowwise_1d"
slot: one value per row; a custom slot of width k) has `SLOT_AXIS` last,
shape `[N, V_shard, 1]` (or `k`). Two other views of the same values exist:

* The *positional* view (`table_arrays`, `slot_arrays`, `assign_arrays`): the
  same arrays unwrapped in that axis order, still sharded on the devices, as
  `device.routing.lookup` and `routing.apply_gradients` take them.
* The *logical* view (`logical_tables`, `logical_slots` and their setters):
  one `[vocab, dim]` numpy array per table, unstacked and unsharded, as a
  user sees it. Reading gathers the stack to the host;
  writing changes only the rows of the tables given. `logical_tables(embed,
  named=True)` gives the tables as Penzai's `EmbeddingTable` holds its
  value: a `NamedArray` `{"vocabulary": vocab, embedding_axis: dim}` (a
  `SparseCoreLookup`'s: its own vocabulary and embedding axes,
  `logical_axes`).

Example: table `ta` (vocab 50, dim 8) alone in its stack on `N = 2` shards is
padded to 64 rows, 32 per shard; MOD sharding puts id `i` on shard `i % 2`
at row `i // 2`, so logical row 7 is positional `[1, 3]` and row 48 is
`[0, 24]` (`layout.physical_row_ids` owns the formula).

The setters validate every given table (names, shapes, finite values) before
writing anything: on a `ValueError` the layer is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np
from penzai import pz

from pz_sparsecore.core import hashed, layout, optimizers
from pz_sparsecore.nn.host import from_host, to_host

if TYPE_CHECKING:
  from pz_sparsecore.nn.embed import EmbedConfig, SparseCoreEmbed

SHARD_AXIS = "sc_shard"
ROW_AXIS = "sc_row"
VOCABULARY_AXIS = "vocabulary"
"""The vocabulary axis of a `SparseCoreEmbed` table's logical view, as
Penzai's `EmbeddingTable` names it by default (a `SparseCoreLookup` keeps
its own, `LookupConfig.vocabulary_axis`)."""
SLOT_AXIS = "sc_slot"
"""The last axis of a slot not shaped like the table (a row-wise slot's
width 1, a custom slot's k): never the embedding axis, which a placement
may shard."""


def slot_axis(config: EmbedConfig, slot: Any) -> str:
  """The last axis of optimizer slot `slot` (an `optimizers.Slot`): the
  embedding axis for a "table" slot, `SLOT_AXIS` otherwise."""
  if slot.shape is optimizers.SlotShape.TABLE:
    return config.embedding_axis
  return SLOT_AXIS


def named_table(
  config: EmbedConfig, value: jax.Array, axis: str | None = None
) -> pz.nx.NamedArray:
  """A positional `[N, V_shard, W]` array as the layer's `NamedArray`.

  Args:
    config: The layer's config (for its embedding axis name).
    value: A table or slot in the positional view.
    axis: The last axis' name: None for the embedding axis (tables and
      "table" slots), else `slot_axis(config, slot)`.

  Returns:
    `value` tagged `(SHARD_AXIS, ROW_AXIS, axis or config.embedding_axis)`.
  """
  return pz.nx.wrap(value).tag(
    SHARD_AXIS, ROW_AXIS, axis or config.embedding_axis
  )


def last_axis(config: EmbedConfig, value: Any) -> str:
  """The last axis of a table or slot variable's `NamedArray`: `SLOT_AXIS`
  for a slot not shaped like the table, else the embedding axis."""
  return SLOT_AXIS if SLOT_AXIS in value.named_shape else config.embedding_axis


def positional_table(config: EmbedConfig, value: Any) -> jax.Array:
  """The inverse of `named_table`: a variable's value as `[N, V_shard, W]`.

  Args:
    config: The layer's config (for its embedding axis name).
    value: A `NamedArray` with the layer's table (or slot) axes.

  Returns:
    The positional array.
  """
  return value.unwrap(SHARD_AXIS, ROW_AXIS, last_axis(config, value))


def table_arrays(embed: SparseCoreEmbed) -> dict[str, jax.Array]:
  """Stack name → the table as a positional `[N, V_shard, D]` array.

  Args:
    embed: The layer (variables bound, mutable or frozen).

  Returns:
    The tables in the positional view.
  """
  return {
    stack: positional_table(embed.config, var.value)
    for stack, var in embed.tables.items()
  }


def slot_arrays(embed: SparseCoreEmbed) -> dict[str, tuple[jax.Array, ...]]:
  """Stack name → the slots as positional arrays, in optimizer order.

  Args:
    embed: The layer (variables bound, mutable or frozen).

  Returns:
    The slots in the positional view.
  """
  return {
    stack: tuple(
      positional_table(embed.config, v.value) for v in slots.values()
    )
    for stack, slots in embed.slots.items()
  }


def assign_arrays(
  embed: SparseCoreEmbed,
  tables: Mapping[str, jax.Array],
  slots: Mapping[str, tuple[jax.Array, ...]],
) -> None:
  """Writes positional arrays into the layer's (mutable) variables.

  Args:
    embed: The layer, with mutable variables bound.
    tables: Stack name → new table (any subset of the stacks).
    slots: Stack name → new slots, in optimizer order.
  """
  for stack, value in tables.items():
    embed.tables[stack].value = named_table(embed.config, value)
  for stack, values in slots.items():
    defs = embed.config.plan.stack(stack).optimizer.definition.slots
    for var, value, slot in zip(
      embed.slots[stack].values(), values, defs, strict=True
    ):
      var.value = named_table(
        embed.config, value, slot_axis(embed.config, slot)
      )


def logical_axes(
  config: EmbedConfig, table: str
) -> tuple[str, tuple[tuple[str, int], ...]]:
  """The axes of a table's logical view, as Penzai's `EmbeddingTable` has
  them.

  Args:
    config: The layer's config.
    table: The table's name.

  Returns:
    `(vocabulary axis, ((embedding axis, size), ...))`: for a
    `SparseCoreLookup`, the axes of the `EmbeddingTable` it stands for
    (`vocabulary_axis`, `embedding_axes`); for a `SparseCoreEmbed`,
    `VOCABULARY_AXIS` and its embedding axis of the table's width.
  """
  vocabulary = getattr(config, "vocabulary_axis", None)
  if vocabulary is not None:  # A `SparseCoreLookup`'s `LookupConfig`.
    return vocabulary, config.embedding_axes
  width = config.plan.tables[table].embedding_dim
  return VOCABULARY_AXIS, ((config.embedding_axis, width),)


def _named_logical(
  config: EmbedConfig, table: str, value: np.ndarray
) -> pz.nx.NamedArray:
  """A logical `[vocab, dim]` table as a `NamedArray` on `logical_axes`."""
  vocabulary, embedding = logical_axes(config, table)
  sizes = [size for _, size in embedding]
  return pz.nx.wrap(value.reshape(value.shape[0], *sizes)).tag(
    vocabulary, *(name for name, _ in embedding)
  )


def logical_tables(
  embed: SparseCoreEmbed, *, named: bool = False
) -> dict[str, np.ndarray] | dict[str, pz.nx.NamedArray]:
  """Table name → `[vocab, dim]` numpy array (or `NamedArray`).

  Args:
    embed: The layer (with several processes, every process calls this).
    named: Return each table as Penzai's `EmbeddingTable` holds its value:
      a `NamedArray` `{"vocabulary": vocab, embedding_axis: dim}` (for a
      `SparseCoreLookup`, its vocabulary axis and embedding axes), holding
      a copy of the numpy array on JAX's default device. The rows live
      MOD-sharded on the layer's devices; `viz.vocabulary_view` reads some
      of them there and says where.

  Returns:
    Every table of the layer, unstacked and unsharded; a hashed table
    (`ids="hashed"`) as `HashedRows`, the ids it holds and their rows (its
    rows a `NamedArray` `{"id": held, embedding_axis: dim}` if `named`).
  """
  plan = embed.config.plan
  stacked = {
    stack: to_host(v)
    for stack, v in table_arrays(embed).items()
    if not plan.stack(stack).is_hashed
  }
  specs = [s for s in plan.feature_specs if not s.table_spec.is_hashed]
  tables = layout.unshard_and_unstack_tables(specs, stacked, plan.num_shards)
  if named:
    tables = {
      name: _named_logical(embed.config, name, value)
      for name, value in tables.items()
    }
  for name, held in hashed_rows(embed).items():
    if named:
      rows = pz.nx.wrap(held.rows).tag("id", embed.config.embedding_axis)
      held = held._replace(rows=rows)
    tables[name] = held
  return {name: tables[name] for name in plan.tables}


class HashedRows(NamedTuple):
  """The ids a hashed table holds and their rows, in ascending id order.

  Attributes:
    ids: int64 `[held]`.
    rows: `[held, dim]` float32 (the table's own width).
    shards: int64 `[held]`, the shard holding each id.
    slots: int64 `[held]`, its row in the table's rows of the shard.
    last_seen: int64 `[held]`, the step it was last seen in training.
    counts: int64 `[held]`, its count (`core.hashed`).
  """

  ids: np.ndarray
  rows: np.ndarray
  shards: np.ndarray
  slots: np.ndarray
  last_seen: np.ndarray
  counts: np.ndarray


def hashed_rows(embed: SparseCoreEmbed) -> dict[str, HashedRows]:
  """Hashed table name -> the ids it holds and their rows (read from every
  shard to the host; with several processes every process calls this)."""
  out = {}
  tables = table_arrays(embed)
  plan = embed.config.plan
  for stack_name, parts in embed.maps.items():
    stack = plan.stack(stack_name)
    ids = to_host(parts["ids"].value)
    seen = to_host(parts["seen"].value)
    table = to_host(tables[stack_name])
    for spec, (first, rows) in zip(
      stack.tables, stack.regions(plan.num_shards), strict=True
    ):
      region = seen[:, first : first + rows, 0] != hashed.EMPTY
      shard, slot = np.nonzero(region)
      slot = slot + first
      held = hashed.ids_of_words(ids[shard, slot, 0], ids[shard, slot, 1])
      order = np.argsort(held, kind="stable")
      shard, slot = shard[order], slot[order]
      out[spec.name] = HashedRows(
        ids=held[order],
        rows=np.asarray(table[shard, slot, : spec.embedding_dim], np.float32),
        shards=shard.astype(np.int64),
        slots=(slot - first).astype(np.int64),
        last_seen=seen[shard, slot, 0].astype(np.int64),
        counts=seen[shard, slot, 1].astype(np.int64),
      )
  return out


def logical_slots(embed: SparseCoreEmbed) -> dict[str, dict[str, np.ndarray]]:
  """Table name → slot name → numpy array in the slot's logical shape.

  Args:
    embed: The layer (with several processes, every process calls this).

  Returns:
    Every optimizer slot of every table, unstacked and unsharded:
    `[vocab, dim]` for a "table" slot, `[vocab]` for a "rowwise_1d" one,
    `[vocab, k]` for a slot of width `k` (`Slot.logical_shape`).
  """
  plan = embed.config.plan
  out: dict[str, dict[str, np.ndarray]] = {}
  for stack, values in slot_arrays(embed).items():
    defs = plan.stack(stack).optimizer.definition.slots
    for slot, value in zip(defs, values, strict=True):
      tables = layout.unshard_and_unstack_tables(
        plan.stack(stack).tables,
        {stack: to_host(value)},
        plan.num_shards,
        slot_shape=slot.shape,
      )
      for name, table in tables.items():
        out.setdefault(name, {})[slot.name] = table
  return out


def _check_logical(
  embed: SparseCoreEmbed,
  values: Mapping[str, Any],
  what: str,
  slot: optimizers.Slot | None = None,
) -> None:
  """Raises unless every value names a table and has its shape (or the
  logical shape of `slot`), finite."""
  tables = embed.config.plan.tables
  unknown = sorted(set(values) - set(tables))
  if unknown:
    raise ValueError(
      f"unknown {what} {unknown}; the layer has {sorted(tables)}"
    )
  for name, value in values.items():
    table = tables[name]
    if table.is_hashed:
      raise ValueError(
        f"{what} {name!r} is hashed: its rows belong to the ids its map "
        "holds (pzsc.hashed_rows), not to positions; train or restore it"
      )
    value = np.asarray(value, dtype=np.float32)
    expected = (table.vocabulary_size, table.embedding_dim)
    if slot is not None:
      expected = slot.logical_shape(*expected)
    if value.shape != expected:
      raise ValueError(
        f"{what} {name!r}: expected shape {expected}, got {value.shape}"
      )
    if not np.all(np.isfinite(value)):
      raise ValueError(f"{what} {name!r}: values must be finite")


def _write_logical(
  embed: SparseCoreEmbed,
  arrays: Mapping[str, Any],
  values: Mapping[str, Any],
  what: str,
  slot: optimizers.Slot | None = None,
) -> dict[str, jax.Array]:
  """New positional arrays (of `arrays`' stacks) with `values` written in
  (tables, or slot `slot` of them)."""
  _check_logical(embed, values, what, slot)
  plan = embed.config.plan
  changed: dict[str, np.ndarray] = {}
  for name, value in values.items():
    table = plan.tables[name]
    stack = plan.stack_of_table[name].name
    if stack not in changed:
      changed[stack] = np.array(to_host(arrays[stack]), dtype=np.float32)
    flat = changed[stack].reshape(-1, changed[stack].shape[-1])
    rows = layout.physical_row_ids(
      table, np.arange(table.vocabulary_size), plan.num_shards
    )
    value = np.asarray(value, np.float32)
    dim = table.embedding_dim
    width = dim if slot is None else slot.width(dim)
    flat[rows, :width] = value.reshape(len(rows), width)
  topo = embed.config.topology
  # Back in each array's dtype (a 16-bit table's values rounded to
  # nearest).
  return {
    k: from_host(v.astype(arrays[k].dtype), topo.table_sharding(k))
    for k, v in changed.items()
  }


def set_logical_tables(
  embed: SparseCoreEmbed, tables: Mapping[str, Any]
) -> None:
  """Writes logical tables (any subset) into the sharded parameters.

  Args:
    embed: The layer, with mutable variables bound.
    tables: Table name → `[vocab, dim]` array.

  Raises:
    ValueError: On an unknown table name or a shape mismatch; nothing is
      written then.
  """
  new = _write_logical(embed, table_arrays(embed), tables, "table")
  assign_arrays(embed, new, {})


def _slot_updates(
  embed: SparseCoreEmbed, slots: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str, jax.Array]]:
  """(stack, slot, new positional array) for every slot given values."""
  plan = embed.config.plan
  current = slot_arrays(embed)
  updates = []
  for stack, stack_slots in embed.slots.items():
    members = {t.name for t in plan.stack(stack).tables}
    defs = plan.stack(stack).optimizer.definition.slots
    for index, (slot, slot_def) in enumerate(
      zip(stack_slots, defs, strict=True)
    ):
      values = {
        t: s[slot]
        for t, s in slots.items()
        if isinstance(s, Mapping) and slot in s and t in members
      }
      if not values:
        continue
      arrays = {stack: current[stack][index]}
      new = _write_logical(
        embed, arrays, values, "slot " + slot + " of table", slot_def
      )
      updates.append((stack, slot_def, new[stack]))
  return updates


def set_logical_slots(
  embed: SparseCoreEmbed, slots: Mapping[str, Mapping[str, Any]]
) -> None:
  """Writes logical slots (table name → slot name → array).

  Args:
    embed: The layer, with mutable variables bound.
    slots: Table name → slot name → array in the slot's logical shape
      (see `logical_slots`; any subset).

  Raises:
    ValueError: On unknown names or shape mismatches; nothing is written.
  """
  updates = _slot_updates(embed, slots)
  plan = embed.config.plan
  known = {
    (t.name, s)
    for stack, stack_slots in embed.slots.items()
    for t in plan.stack(stack).tables
    for s in stack_slots
  }
  for table, table_slots in slots.items():
    for slot in table_slots:
      if (table, slot) not in known:
        raise ValueError(f"unknown slot {slot!r} of table {table!r}")
  for stack, slot, value in updates:
    embed.slots[stack][slot.name].value = named_table(
      embed.config, value, slot_axis(embed.config, slot)
    )
