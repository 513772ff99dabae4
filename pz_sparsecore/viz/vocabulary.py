"""A table in vocabulary order, as Penzai's `EmbeddingTable` holds it.

A `SparseCoreEmbed` (and a `SparseCoreLookup`, its one-table form) keeps
each stack in *physical* order: one `[N, V_shard, D]` `NamedArray` with axes
`("sc_shard", "sc_row", embedding)`, id `i` of a member table at shard
`(i % N + rotation) % N`, row `row_offset + i // N`
(`layout.compute_physical_row_ids` owns the formula). Penzai's
`EmbeddingTable` keeps `{vocabulary: V, **embedding_axes}` instead.
`vocabulary_view` gives that view of one table, all rows or some, so that a
converted lookup can be read (and compared) as the `EmbeddingLookup` it
replaced, and a layer's table as an `EmbeddingTable`; its axes are
`tables.logical_axes` (a lookup's own, else `{"vocabulary": K,
embedding_axis: dim}`)::

  lookup = pzsc.SparseCoreLookup.from_lookup(dense, mesh=mesh, optimizer=opt)
  pzsc.viz.vocabulary_view(lookup)  # == dense.table.embeddings.value
  pzsc.viz.vocabulary_view(lookup, rows=slice(0, 16))  # {vocabulary: 16, ...}
  pzsc.viz.vocabulary_view(embed, [0, 7], table="movies")
  pzsc.viz.vocabulary_view_figure(embed, [0, 7], table="movies")

Example: vocabulary 1000, embedding `{"embedding": 16}`, N = 8 shards of 128
rows on 8 devices, rotation 0. Token 13 lives at shard 5, row 1;
`rows=[0, 7, 8, 999]` reads shards 0, 7, 0, 7 at rows 0, 0, 1, 124 and
returns `{vocabulary: 4, embedding: 16}`.

The rows are gathered on the devices in one jitted call: each device picks
the requested rows it holds and the results are summed over the mesh, so
only the requested rows move (a 2^24-row table can be sampled without
gathering it).

Where the result lives. A `jax.Array` splits an axis into equal contiguous
blocks, one per device; MOD sharding puts consecutive ids on different
devices. So the rows of the view stay on the devices that hold them where
such blocks say it, and the view is otherwise a copy on every device:

* a stack every device holds whole (a replicated placement): replicated,
  like the table;
* ids in equal consecutive blocks, block `d` held by the `d`-th device of
  the shard axis (above, `rows=range(8)`: id `d` on device `d`): sharded as
  the table is, each row on its device;
* ids all on one device (above, `rows=[13, 21]`, both on device 5): on that
  device (with one process);
* any other ids (above, `rows=None` or `[0, 7, 8, 999]`): a copy on every
  device, which Treescope reports as "Replicated across 8 CPU devices";
  that is where the copy is, not the table. `vocabulary_view_figure` draws
  the device of each row, and `viz.row_placement` lists it.

`vocabulary_view_figure` draws the view with its ids: the heading lists
them, the hover label of a row names its id, shard, device, SparseCore and
row in the shard, and a picture of the same layout as the values colours
each cell by the device that holds it (Treescope's device colours:
device `d` is the digitbox of `d + 1`, as in its sharding view), with the
legend and a line saying where the view's own values are.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
from treescope import figures

from pz_sparsecore.core import layout
from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.core.specs import TableSpec
from pz_sparsecore.viz import figures as figures_lib
from pz_sparsecore.viz import placement
from pz_sparsecore.viz._common import device_legend

__all__ = ["vocabulary_view", "vocabulary_view_figure"]

Figure = Any  # treescope's `TreescopeFigure` (not exported publicly).

_LISTED_IDS = 12
"""Ids a figure's heading lists in full; more are shown as the first ones,
an ellipsis and the last two."""


@dataclasses.dataclass(frozen=True)
class _Table:
  """One logical table of a layer, as the view reads it.

  Attributes:
    layer: The `SparseCoreEmbed` (or `SparseCoreLookup`).
    what: How messages name it: a lookup's label, else `table 'name'`.
    spec: The table's prepared spec.
    stack: Its stack's plan.
    value: The stack's table, positional `[N, V_shard, D]`.
    vocabulary_axis: The view's vocabulary axis.
    embedding_axes: The view's embedding axes, `(name, size)`.
  """

  layer: Any
  what: str
  spec: TableSpec
  stack: StackPlan
  value: jax.Array
  vocabulary_axis: str
  embedding_axes: tuple[tuple[str, int], ...]


def _table_of(layer: Any, table: str | None) -> _Table:
  """The table `table` of `layer` (its only one by default).

  Raises:
    ValueError: If `layer` is not a `SparseCoreEmbed`, `table` is not one
      of its tables (or None with several), or the table is unbound.
  """
  from pz_sparsecore.nn.embed import SparseCoreEmbed
  from pz_sparsecore.nn.lookup import LookupConfig
  from pz_sparsecore.nn.tables import logical_axes, positional_table

  if not isinstance(layer, SparseCoreEmbed):
    raise ValueError(
      "vocabulary_view takes a SparseCoreEmbed or a SparseCoreLookup, got "
      f"{type(layer).__name__}"
    )
  config = layer.config
  names = list(config.plan.tables)
  if table is None and len(names) == 1:
    table = names[0]
  if table not in names:
    given = "no table" if table is None else f"table {table!r}"
    raise ValueError(
      f"vocabulary_view of layer {config.name!r}: {given}; pass table= one "
      f"of {names}"
    )
  stack = config.plan.stack_of_table[table]
  if isinstance(config, LookupConfig):
    what = repr(config.label)
  else:
    what = f"table {table!r}"
  var = layer.tables[stack.name]
  if isinstance(var, pz.ParameterSlot):
    raise ValueError(
      f"vocabulary_view of {what}: the table is an unbound ParameterSlot; "
      "build the layer with an init_base_rng or restore a checkpoint first"
    )
  vocabulary_axis, embedding_axes = logical_axes(config, table)
  return _Table(
    layer=layer,
    what=what,
    spec=config.plan.tables[table],
    stack=stack,
    value=positional_table(config, var.value),
    vocabulary_axis=vocabulary_axis,
    embedding_axes=tuple(embedding_axes),
  )


@functools.partial(jax.jit, static_argnums=3)
def _gather(
  table: jax.Array, shard: jax.Array, row: jax.Array, width: int
) -> jax.Array:
  """Rows `(shard, row)` of a `[N, V_shard, D]` table, `[K, width]`."""
  # Indexing the shard and row axes directly (not a reshape to `[N *
  # V_shard, D]`) lets XLA gather locally and all-reduce the K rows.
  return table[shard, row, :width]


def _row_ids(source: _Table, rows: Any) -> np.ndarray:
  """`rows` as checked int32 token ids.

  Raises:
    ValueError: Naming the table, for rows that are not a slice or a 1-D
      integer array, or ids outside `[0, vocabulary_size)`.
  """
  vocab = source.spec.vocabulary_size
  if rows is None:
    rows = slice(None)
  if isinstance(rows, slice):
    return np.arange(*rows.indices(vocab), dtype=np.int32)
  ids = np.asarray(rows)
  if ids.ndim != 1 or not (
    ids.size == 0 or np.issubdtype(ids.dtype, np.integer)
  ):
    raise ValueError(
      f"vocabulary_view of {source.what}: rows must be None, a slice or a "
      f"1-D integer array of token ids, got {ids.dtype} of shape {ids.shape}"
    )
  bad = (ids < 0) | (ids >= vocab)
  if bad.any():
    where = int(np.argmax(bad))
    raise ValueError(
      f"vocabulary_view of {source.what}: token id {int(ids[where])} at "
      f"position {where} of rows is outside [0, {vocab})"
    )
  return ids.astype(np.int32)


def _shards_and_rows(
  source: _Table, ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """The shard and the row in it of each id."""
  n = source.layer.config.plan.num_shards
  physical = layout.physical_row_ids(source.spec, ids, n)
  return np.divmod(physical, source.stack.rows_per_shard)


def _holders(source: _Table) -> tuple[list[tuple[int, ...]], str]:
  """Per shard the ids of the devices holding it, and their kind."""
  return placement._shard_holders(
    source.layer, source.layer.config.plan, source.stack
  )


def _result_sharding(
  source: _Table, shards: np.ndarray, ndim: int
) -> jax.sharding.Sharding:
  """Where the view of rows on `shards` lives: where the table holds them
  when an array can say so (the module docstring's cases), else a copy on
  every device of the mesh."""
  topology = source.layer.config.topology
  name = source.stack.name
  copies = jax.sharding.NamedSharding(
    topology.mesh, jax.sharding.PartitionSpec()
  )
  if topology.is_replicated(name):
    return topology.table_sharding(name, ndim)
  count, g = shards.size, topology.num_devices
  if not count:
    return copies
  position = shards // topology.num_sc_per_device
  if count % g == 0 and np.array_equal(
    position, np.arange(count) // (count // g)
  ):
    return topology.sharding(ndim)
  held = {_holders(source)[0][k] for k in np.unique(shards)}
  # One process: moving the rows onto one device of a multi-process mesh
  # would need every process to take part.
  if len(held) == 1 and jax.process_count() == 1:
    (devices,) = held
    if len(devices) == 1:
      by_id = {d.id: d for d in np.asarray(topology.mesh.devices).flat}
      return jax.sharding.SingleDeviceSharding(by_id[devices[0]])
  return copies


def _view(source: _Table, ids: np.ndarray) -> pz.nx.NamedArray:
  """Rows `ids` of the table, on `_result_sharding`'s devices."""
  shard, row = _shards_and_rows(source, ids)
  values = _gather(
    source.value,
    jnp.asarray(shard, jnp.int32),
    jnp.asarray(row, jnp.int32),
    source.spec.embedding_dim,
  )
  names = [name for name, _ in source.embedding_axes]
  sizes = [size for _, size in source.embedding_axes]
  values = values.reshape(ids.size, *sizes)
  values = jax.device_put(values, _result_sharding(source, shard, values.ndim))
  return pz.nx.wrap(values).tag(source.vocabulary_axis, *names)


def vocabulary_view(
  layer: Any, rows: Any = None, *, table: str | None = None
) -> pz.nx.NamedArray:
  """A table in vocabulary order, as Penzai's `EmbeddingTable` holds it.

  Args:
    layer: A `SparseCoreLookup`, or a `SparseCoreEmbed`, with its tables
      bound (`pz.Parameter`s).
    rows: None for the whole vocabulary; a slice of it; or a 1-D integer
      array of token ids (in any order, repeats allowed). Only these rows
      are gathered.
    table: The logical table's name; may be left out for a layer of one
      table (a `SparseCoreLookup`).

  Returns:
    A `NamedArray` with axes `{vocabulary_axis: K, **embedding_axes}`
    (`tables.logical_axes`), `K` the number of rows: for a lookup made by
    `from_lookup`, with `rows=None`, the values of the `EmbeddingLookup`'s
    table. Its values stay on the devices holding the rows where an array
    can say so, and are otherwise a copy on every device (see the module
    docstring); `vocabulary_view_figure` draws where each row lives.

  Raises:
    ValueError: If `layer` is not a `SparseCoreEmbed`, `table` is unknown
      (or None for a layer of several tables), the table is unbound, or
      (naming the table) for bad `rows` or ids outside `[0, vocab_size)`.
  """
  source = _table_of(layer, table)
  return _view(source, _row_ids(source, rows))


def _ids_text(ids: np.ndarray) -> str:
  """The ids, all of them or the first and last ones."""
  if ids.size <= _LISTED_IDS:
    return ", ".join(str(i) for i in ids)
  head = ", ".join(str(i) for i in ids[: _LISTED_IDS - 2])
  return f"{head}, ..., {ids[-2]}, {ids[-1]}"


def _where_text(values: jax.Array) -> str:
  """Where the view's own values live, in Treescope's words."""
  devices = values.sharding.device_set
  kind = "/".join(sorted({d.platform.upper() for d in devices}))
  if len(devices) == 1:
    (device,) = devices
    return f"on {kind} {device.id}, the device holding these rows"
  if values.is_fully_replicated:
    return f"a copy on each of {len(devices)} {kind} devices (Replicated)"
  return f"sharded as the table, each row on the {kind} device holding it"


def vocabulary_view_figure(
  layer: Any,
  rows: Any = None,
  *,
  table: str | None = None,
  truncate: bool = True,
  pixels_per_cell: int = 7,
) -> Figure:
  """`vocabulary_view` drawn with its ids and the devices holding them.

  Args:
    layer: As `vocabulary_view`.
    rows: As `vocabulary_view`.
    table: As `vocabulary_view`.
    truncate: Let Treescope truncate a long view (as it does an array).
    pixels_per_cell: Cell size of the pictures.

  Returns:
    A figure: a heading listing the ids, the id -> device rule, where the
    view's own values live, the values `[ids x embedding]` (hover a row
    for its id, shard, device, SparseCore and row in the shard) and a
    picture of the same layout, cell for cell, coloured by the device
    holding each cell (Treescope's device colours; beside the values where
    the cell is wide enough, else below), and the legend of the devices
    drawn.

  Raises:
    ValueError: As `vocabulary_view`.
  """
  source = _table_of(layer, table)
  ids = _row_ids(source, rows)
  view = _view(source, ids)
  shard, row = _shards_and_rows(source, ids)
  plan = layer.config.plan
  n, s = plan.num_shards, plan.num_sc_per_device
  shard_values, labels = figures_lib._device_values(layer, plan, source.stack)
  codes = np.asarray(shard_values, np.int64)[shard]
  names = [name for name, _ in source.embedding_axes]
  values = view.unwrap(source.vocabulary_axis, *names)
  shown = figures_lib._edge_items(ids.size, truncate)
  id_labels = figures_lib._item_labels(
    shown,
    ids.size,
    lambda j: (
      f"id {ids[j]}: {labels[int(codes[j])]}, shard {shard[j]} (SC "
      f"{shard[j] % s}), row {row[j]}"
    ),
  )
  setting = source.spec.setting_in_stack
  picture = figures_lib._values_and_devices(
    values,
    codes.reshape(-1, *([1] * len(names))),
    rows=[0],
    columns=list(range(len(names), 0, -1)),
    truncate=truncate,
    axis_labels={
      0: f"{source.vocabulary_axis} ({ids.size} ids)",
      **{
        i + 1: f"{a} ({size})"
        for i, (a, size) in enumerate(source.embedding_axes)
      },
    },
    axis_item_labels={0: id_labels},
    device_labels=labels,
    pixels_per_cell=pixels_per_cell,
  )
  return figures_lib._lines(
    figures.bolded(
      f"{source.what} in vocabulary order, {ids.size} rows: ids "
      f"{_ids_text(ids)}"
    ),
    f"id i -> shard (i % {n} + {setting.shard_rotation}) % {n} -> device "
    f"shard // {s}, row {setting.row_offset_in_shard} + i // {n}",
    f"this view's values: {_where_text(view.data_array)}",
    "the values, a row per id (hover a row for its id and where it lives),",
    "and in the same layout, cell for cell, the device holding each cell:",
    picture,
    *device_legend({v: labels[v] for v in set(codes.tolist())}),
  )
