"""Which device holds each id of a table: a picture in vocabulary order.

A logical table's ids `0 .. padded_vocab_size - 1` are wrapped into rows of
`W` ids (`W` a multiple of the shard count N), and each cell is coloured by
the device that holds the id, as Treescope's sharding view colours a device:
its "digitbox" of `device.id + 1` (a set of devices, e.g. the copies of a
replicated stack, as that view draws it: the digits of each member, or
1234567 for seven or more). MOD sharding puts id `i` on shard
`(i % N + rotation) % N`, on device `shard // S` (S SparseCores per device,
devices in the mesh's order over the shard axis), at row
`row_offset_in_shard + i // N` of the shard (`layout.compute_physical_row_ids`
owns the formula). Since `W` is a multiple of N, the column of a cell fixes
its shard: the devices show as vertical stripes, and a rotation shifts them.
Padding ids (`vocabulary_size` up to `padded_vocab_size`: rows the table
reserves and no token uses) are white (digitbox 0).

Example: vocabulary 1000 on 8 devices x 1 SparseCore, rotation 3. The table
pads to 1024 ids (128 rows per shard); `W = 64`, so the picture has 16 rows
of 64 ids, and column `c` holds ids `c, 64 + c, ...`, all on shard
`(c % 8 + 3) % 8`: columns 0, 8, 16, ... are device 3 (digitbox 4), columns
5, 13, ... device 0. Id 13 is on shard `(5 + 3) % 8 = 0`, device 0, row
`13 // 8 = 1`; ids 1000-1023 (the last 24 cells) are padding.

A table of more than `MAX_ROWS` rows shows its first and last rows with one
grey row between them standing for the rows left out (Treescope's mark of a
truncated axis), so a 100M-id table draws as quickly as a small one: only
the shown cells are computed.

`placement_grid` returns the cells (ids, values, which devices each value
stands for); `placement_figure` draws them with the id -> device rule and a
legend; `view_part` gives the block of lines a layer's Treescope view
shows when expanded (`viz.treescope.render_embed`): the pictures of its
first `MAX_TABLES_IN_VIEW` tables, in a foldable of their own that is
expanded whenever the layer is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import treescope
from jax.sharding import Mesh
from treescope import figures, rendering_parts

from pz_sparsecore.core import hashed, layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.viz._common import device_legend, is_concrete, plan_of

__all__ = [
  "MAX_ROWS",
  "PADDING_VALUE",
  "PlacementGrid",
  "placement_figure",
  "placement_grid",
]

Figure = Any  # treescope's `TreescopeFigure` (not exported publicly).

PADDING_VALUE = 0
"""The cell value of a padding id: the digitbox of 0, a white square (a
device `d` is `d + 1`, so no device draws white)."""

TARGET_COLUMNS = 64
"""Ids per row of the picture, rounded down to a multiple of N (at least N):
64 cells of 7 px fit beside the axis labels in a notebook cell."""

MAX_ROWS = 16
"""Rows of the wrapped picture drawn at most: the first and the last half."""

MAX_TABLES_IN_VIEW = 4
"""Tables whose picture a layer's Treescope view shows; the others are named
with the call that draws them."""

_MANY_DEVICES = 7
_MANY_DEVICES_VALUE = 1234567
"""Treescope's sharding view draws a shard on seven or more devices as the
digitbox of 1234567 (its digitbox holds seven digits)."""


@dataclasses.dataclass(frozen=True)
class PlacementGrid:
  """The cells of one table's placement picture.

  Attributes:
    table: The logical table's name.
    stack: Its stack's name.
    vocabulary_size: Ids of the table.
    padded_vocab_size: Ids it reserves (a multiple of 8 x N).
    num_shards: N, devices x SparseCores.
    num_sc_per_device: S.
    rotation: The table's shard rotation.
    row_offset: Its first row in every shard.
    columns: W, ids per row (a multiple of N).
    num_rows: Rows of the whole wrapped picture.
    rows: `[R]` the rows shown, first to last; -1 for the row standing for
      those left out.
    ids: `[R, W]` the id of each cell; -1 for none (the row standing for the
      left-out rows, cells past `padded_vocab_size`).
    values: `[R, W]` int32 digitbox values: the devices holding the id (a
      key of `devices`), `PADDING_VALUE` for a padding id or no id.
    shards: `[R, W]` the shard of each cell's id (0 where no id).
    shard_rows: `[R, W]` its row in the shard (0 where no id).
    shard_values: Per shard, the value of the devices holding it.
    devices: Value -> the devices it stands for: device ids for a layer,
      positions `shard // S` for a plan or specs.
    labels: Value -> legend text, as Treescope's sharding view writes it
      (`"CPU 0"`, `"CPU 0,4"`; `"device 0"` without devices).
    replicated: Whether every device holds every id.
    mesh_axes: The mesh axes the shards are laid over (a layer's), else ().
    replica_axes: A layer's other mesh axes, along which each shard has a
      copy on every device; else ().
  """

  table: str
  stack: str
  vocabulary_size: int
  padded_vocab_size: int
  num_shards: int
  num_sc_per_device: int
  rotation: int
  row_offset: int
  columns: int
  num_rows: int
  rows: np.ndarray
  ids: np.ndarray
  values: np.ndarray
  shards: np.ndarray
  shard_rows: np.ndarray
  shard_values: tuple[int, ...]
  devices: dict[int, tuple[int, ...]]
  labels: dict[int, str]
  replicated: bool
  mesh_axes: tuple[str, ...]
  replica_axes: tuple[str, ...]

  @property
  def omitted_rows(self) -> int:
    """Rows of the wrapped picture left out (0 if all are shown)."""
    return self.num_rows - int((self.rows >= 0).sum())

  def rule(self) -> str:
    """`id i -> shard (i % N + r) % N -> device shard // S, row o + i // N`."""
    n, s = self.num_shards, self.num_sc_per_device
    text = (
      f"id i -> shard (i % {n} + {self.rotation}) % {n} -> device shard // "
      f"{s}, row {self.row_offset} + i // {n} of the shard"
    )
    where = []
    if len(self.mesh_axes) > 1:
      where.append(f"devices in the mesh's order over {self.mesh_axes}")
    if self.replica_axes and not self.replicated:
      where.append(f"a copy on each device along {self.replica_axes}")
    return f"{text} ({'; '.join(where)})" if where else text


# ---------------------------------------------------------------------------
# Devices.


def _digitbox_value(device_ids: Sequence[int]) -> int:
  """The value Treescope's sharding view draws for a shard on these devices
  (in its order): `d + 1` for one device, the digits of each for a few,
  1234567 for seven or more."""
  if len(device_ids) >= _MANY_DEVICES:
    return _MANY_DEVICES_VALUE
  count = len(device_ids)
  return sum(10 ** (count - i - 1) * (d + 1) for i, d in enumerate(device_ids))


def _topology(embed_or_specs: Any) -> Any:
  """A layer's topology; None for a plan or specs."""
  config = getattr(embed_or_specs, "config", None)
  return getattr(config, "topology", None)


def _shard_holders(
  embed_or_specs: Any, plan: plan_lib.Plan, stack: plan_lib.StackPlan
) -> tuple[list[tuple[int, ...]], str]:
  """Per shard the devices holding it, and their kind (`"CPU"`).

  A layer's devices are read off its table's sharding (every device a
  shard of `[N, V_shard, D]` is on, in the sharding's order, as Treescope
  reads them); without a concrete mesh they are the positions `k // S`,
  of kind `"device"`.
  """
  n, s = plan.num_shards, plan.num_sc_per_device
  topology = _topology(embed_or_specs)
  if topology is None or not isinstance(topology.mesh, Mesh):
    return [(k // s,) for k in range(n)], "device"
  sharding = topology.table_sharding(stack.name)
  holders: list[list[int]] = [[] for _ in range(n)]
  kinds = set()
  shape = (n, stack.rows_per_shard, stack.dim)
  for device, index in sharding.devices_indices_map(shape).items():
    kinds.add(device.platform.upper())
    for k in range(n)[index[0]]:
      holders[k].append(device.id)
  return [tuple(h) for h in holders], "/".join(sorted(kinds))


def _device_values(
  holders: list[tuple[int, ...]], kind: str
) -> tuple[tuple[int, ...], dict[int, tuple[int, ...]], dict[int, str]]:
  """Per shard its value; value -> devices; value -> legend text."""
  shard_values, devices, labels = [], {}, {}
  for held in holders:
    value = _digitbox_value(held)
    shard_values.append(value)
    if value not in devices:
      devices[value] = held
      labels[value] = f"{kind} {','.join(str(d) for d in held)}"
  ordered = sorted(devices)
  return (
    tuple(shard_values),
    {v: devices[v] for v in ordered},
    {v: labels[v] for v in ordered},
  )


# ---------------------------------------------------------------------------
# The grid.


def default_columns(num_shards: int, padded_vocab_size: int) -> int:
  """W: the largest multiple of N up to `TARGET_COLUMNS` (at least N), and
  no more than the table's ids."""
  per_row = num_shards * max(1, TARGET_COLUMNS // num_shards)
  return min(per_row, padded_vocab_size)


def _shown_rows(num_rows: int, max_rows: int) -> np.ndarray:
  """All rows, or the first and last halves of `max_rows` around a -1."""
  if num_rows <= max_rows:
    return np.arange(num_rows)
  head = max(1, max_rows // 2)
  tail = max(1, max_rows - head)
  return np.concatenate(
    [np.arange(head), [-1], np.arange(num_rows - tail, num_rows)]
  )


def placement_grid(
  embed_or_specs: Any,
  table: str,
  *,
  columns: int | None = None,
  max_rows: int = MAX_ROWS,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
) -> PlacementGrid:
  """The cells of `table`'s placement picture, in vocabulary order.

  Args:
    embed_or_specs: A `SparseCoreEmbed` or `SparseCoreLookup` (its devices,
      from its mesh), a `Plan`, or feature specs plus topology.
    table: The logical table's name.
    columns: W, ids per row: a multiple of N; default `default_columns`.
    max_rows: Rows drawn at most; longer pictures show their first and last
      rows.
    global_device_count: Devices (with feature specs).
    num_sc_per_device: SparseCores per device (with feature specs).

  Returns:
    The grid: ids, values and what they stand for.

  Raises:
    ValueError: On an unknown table, a `columns` that is not a positive
      multiple of N, `max_rows` under 2, or missing topology.
  """
  plan = plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  if table not in plan.tables:
    raise ValueError(
      f"unknown table {table!r}; the tables are {list(plan.tables)}"
    )
  if max_rows < 2:
    raise ValueError(f"max_rows must be at least 2, got {max_rows}")
  spec, stack = plan.tables[table], plan.stack_of_table[table]
  setting, n = spec.setting_in_stack, plan.num_shards
  padded = setting.padded_vocab_size
  w = default_columns(n, padded) if columns is None else columns
  if w <= 0 or w % n:
    raise ValueError(
      f"columns must be a positive multiple of the {n} shards, got {w}"
    )
  num_rows = -(-padded // w)
  rows = _shown_rows(num_rows, max_rows)
  ids = rows[:, None] * w + np.arange(w)
  ids = np.where((rows[:, None] >= 0) & (ids < padded), ids, -1)
  flat = layout.compute_physical_row_ids(
    n,
    spec.stacked_table_spec.stack_vocab_size,
    setting.shard_rotation,
    setting.row_offset_in_shard,
    np.maximum(ids, 0),
  )
  shard, shard_row = np.divmod(flat, stack.rows_per_shard)
  shard, shard_row = (np.where(ids >= 0, x, 0) for x in (shard, shard_row))
  holders, kind = _shard_holders(embed_or_specs, plan, stack)
  shard_values, devices, labels = _device_values(holders, kind)
  held = (ids >= 0) & (ids < spec.vocabulary_size)
  values = np.where(held, np.asarray(shard_values)[shard], PADDING_VALUE)
  topology = _topology(embed_or_specs)
  return PlacementGrid(
    table=table,
    stack=stack.name,
    vocabulary_size=spec.vocabulary_size,
    padded_vocab_size=padded,
    num_shards=n,
    num_sc_per_device=plan.num_sc_per_device,
    rotation=setting.shard_rotation,
    row_offset=setting.row_offset_in_shard,
    columns=w,
    num_rows=num_rows,
    rows=rows,
    ids=ids,
    values=values.astype(np.int32),
    shards=shard,
    shard_rows=shard_row,
    shard_values=shard_values,
    devices=devices,
    labels=labels,
    replicated=bool(topology and topology.is_replicated(stack.name)),
    mesh_axes=tuple(topology.axes) if topology is not None else (),
    replica_axes=_replica_axes(topology),
  )


def _replica_axes(topology: Any) -> tuple[str, ...]:
  """A layer's mesh axes of more than one device that its shard axis does
  not use (none without a layer)."""
  if topology is None:
    return ()
  mesh = topology.mesh
  return tuple(
    a for a in mesh.axis_names if a not in topology.axes and mesh.shape[a] > 1
  )


# ---------------------------------------------------------------------------
# Drawing.


def _row_labels(grid: PlacementGrid) -> list[str]:
  """Per shown row: its ids and their first row in the shards (or the
  count of rows left out)."""
  w, vocab = grid.columns, grid.vocabulary_size
  labels = []
  for k, row in enumerate(grid.rows):
    if row < 0:
      first = int(grid.rows[k - 1] + 1) * w
      last = int(grid.rows[k + 1]) * w - 1
      labels.append(f"{grid.omitted_rows} rows left out: ids {first}-{last}")
      continue
    ids = grid.ids[k][grid.ids[k] >= 0]
    label = f"ids {ids[0]}-{ids[-1]}; shard row {grid.shard_rows[k, 0]}"
    if grid.columns > grid.num_shards:
      label += " + the column's"
    if ids[-1] >= vocab:
      label += f"; padding from id {max(ids[0], vocab)}"
    labels.append(label)
  return labels


def _column_labels(grid: PlacementGrid) -> list[str]:
  """Per column: the shard of its ids, where that lives, and (W > N) how
  many rows past the row's first shard row its ids sit (row 0's ids all
  exist: W is at most the padded vocabulary)."""
  s = grid.num_sc_per_device
  labels = []
  for c in range(grid.columns):
    k = int(grid.shards[0, c])
    label = (
      f"shard {k}: {grid.labels[grid.shard_values[k]]}, SparseCore {k % s}"
    )
    if grid.columns > grid.num_shards:
      step = grid.shard_rows[0, c] - grid.shard_rows[0, 0]
      label += f"; shard row + {step}"
    labels.append(label)
  return labels


def _image(grid: PlacementGrid, pixels_per_cell: int) -> Figure:
  """The digitbox picture of `grid`, Treescope's array view."""
  # Short enough for Treescope to draw it beside the rows, turned; the
  # left-out rows are told under the picture (`_notes`).
  rows_label = f"id // {grid.columns}"
  padding = {PADDING_VALUE: "padding: reserved, no id"}
  return treescope.render_array(
    grid.values,
    valid_mask=grid.ids >= 0,
    rows=[0],
    columns=[1],
    continuous=False,
    truncate=False,
    value_item_labels={**grid.labels, **padding},
    axis_labels={0: rows_label, 1: f"id % {grid.columns}"},
    axis_item_labels={0: _row_labels(grid), 1: _column_labels(grid)},
    pixels_per_cell=pixels_per_cell,
  )


def _heading(grid: PlacementGrid) -> str:
  padding = grid.padded_vocab_size - grid.vocabulary_size
  text = (
    f"table {grid.table!r} in stack {grid.stack!r}: {grid.vocabulary_size} ids"
  )
  if padding:
    text += (
      f" and {padding} padding (ids {grid.vocabulary_size}-"
      f"{grid.padded_vocab_size - 1})"
    )
  return text


def _notes(grid: PlacementGrid) -> list[str]:
  """The lines under a picture: the left-out rows, the replication."""
  notes = []
  if grid.omitted_rows:
    notes.append(
      f"{grid.omitted_rows} rows ({grid.omitted_rows * grid.columns} ids) "
      "left out: the grey row"
    )
  if grid.replicated:
    notes.append(
      "replicated: every device holds every id (each holds all "
      f"{grid.num_shards} shards)"
    )
  return notes


MAX_HASHED_SLOTS = 256
"""Slots of each shard a hashed table's picture draws at most."""


def _hashed_lines(embed: Any, name: str) -> tuple[list[Any], dict[int, str]]:
  """A hashed table's heading, rule, picture (per shard its slots, held ones
  in their device's colour, free ones white) and notes; and its legend's
  labels. Its ids have no vocabulary order: where each lives is its owner's
  choice (`core.hashed`)."""
  plan = embed.config.plan
  stack = plan.stack_of_table[name]
  n, s = plan.num_shards, plan.num_sc_per_device
  member = [t.name for t in stack.tables].index(name)
  first, c = stack.regions(n)[member]
  holders, kind = _shard_holders(embed, plan, stack)
  values, _, labels = _device_values(holders, kind)
  rule = (
    f"id x -> shard mix64(x) % {n} -> device shard // {s}; on its shard, "
    f"in the table's rows [{first}, {first + c}), the first free of the "
    f"{hashed.window(c)} slots from (mix64(x) >> 32) % {c}, or an evicted "
    "one"
  )
  seen = getattr(embed.maps[stack.name]["seen"], "value", None)
  if not is_concrete(seen):
    return [f"hashed table {name!r}: no map values to draw", rule], labels
  held = np.asarray(seen)[:, first : first + c, 0] != hashed.EMPTY
  shown = min(c, MAX_HASHED_SLOTS)
  grid = np.where(
    held[:, :shown], np.asarray(values)[:, None], PADDING_VALUE
  ).astype(np.int64)
  image = treescope.render_array(
    grid,
    rows=[0],
    columns=[1],
    continuous=False,
    truncate=False,
    value_item_labels={**labels, PADDING_VALUE: "free slot"},
    axis_labels={0: "shard", 1: "slot"},
    pixels_per_cell=7,
  )
  per_shard = held.sum(axis=1)
  heading = (
    f"hashed table {name!r} in stack {stack.name!r}: {int(per_shard.sum())} "
    f"ids held in {n} shards x {c} slots"
  )
  notes = [f"ids held per shard: {', '.join(map(str, per_shard))}"]
  if shown < c:
    notes.insert(0, f"the first {shown} of the {c} slots of each shard drawn")
  return [heading, rule, image, *notes], labels


def _table_names(plan: plan_lib.Plan, table: str | None) -> list[str]:
  return list(plan.tables) if table is None else [table]


def placement_figure(
  embed_or_specs: Any,
  table: str | None = None,
  *,
  columns: int | None = None,
  max_rows: int = MAX_ROWS,
  pixels_per_cell: int = 7,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
) -> Figure:
  """Which device holds each id of a table, in vocabulary order.

  Args:
    embed_or_specs: A `SparseCoreEmbed` or `SparseCoreLookup` (devices named
      from its mesh, e.g. "CPU 0"), a `Plan`, or feature specs together with
      `global_device_count` and `num_sc_per_device` (devices by position).
    table: One logical table; every table by default.
    columns: Ids per row (a multiple of N); default: the largest multiple
      of N up to 64 (at least N).
    max_rows: Rows drawn at most; longer tables show their first and last
      rows and a grey row standing for the rest.
    pixels_per_cell: Cell size of the images.
    global_device_count: Devices (with feature specs).
    num_sc_per_device: SparseCores per device (with feature specs).

  Returns:
    A figure: per table a heading, the rule `id i -> shard (i % N +
    rotation) % N -> device shard // S`, the picture (each cell the
    digitbox of the device holding the id, as Treescope's sharding view
    draws it; hover a cell for its ids, shard, SparseCore and row), then
    one legend.

  Raises:
    ValueError: On an unknown table, bad `columns` or missing topology.
  """
  plan = plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  # A layer names its devices; specs are planned once, here.
  source = embed_or_specs if _topology(embed_or_specs) is not None else plan
  parts: list[Any] = []
  labels: dict[int, str] = {}
  for name in _table_names(plan, table):
    if plan.tables[name].is_hashed and hasattr(source, "maps"):
      lines, more = _hashed_lines(source, name)
      parts += [figures.bolded(lines[0]), *lines[1:]]
      labels.update(more)
      continue
    grid = placement_grid(source, name, columns=columns, max_rows=max_rows)
    parts += [
      figures.bolded(_heading(grid)),
      grid.rule(),
      _image(grid, pixels_per_cell),
      *_notes(grid),
    ]
    labels.update(grid.labels)
  parts += device_legend(labels, padding=True)
  return figures.figure_from_treescope_rendering_part(
    rendering_parts.on_separate_lines(
      [figures.treescope_part_from_display_object(p) for p in parts]
    )
  )


def _comment_line(content: Any) -> rendering_parts.RenderableTreePart:
  """`# content` in Treescope's comment colour (content: text or figure)."""
  return rendering_parts.comment_color(
    rendering_parts.siblings(
      "# ", figures.treescope_part_from_display_object(content)
    )
  )


def view_part(
  embed: Any, path: str | None
) -> rendering_parts.RenderableTreePart:
  """The placement lines of a layer's expanded Treescope view.

  A foldable block of comment lines, expanded whenever the layer is: what
  the colours mean; per table (the first `MAX_TABLES_IN_VIEW`) its heading,
  the id -> device rule and the picture; the call that draws the other
  tables; the legend. Being a foldable of its own, it adds nothing to the
  height Treescope's default expansion counts for the layer, so the layer
  expands (inside a model) as it would without it.

  Args:
    embed: A `SparseCoreEmbed` or `SparseCoreLookup`.
    path: Its Treescope path (the root's is `""` or None), for the call
      naming it.

  Returns:
    The block, for `viz.treescope.summarized_node`'s details.
  """
  tables = embed.config.plan.tables
  names = list(tables)
  lines: list[Any] = []
  labels: dict[int, str] = {}
  for name in names[:MAX_TABLES_IN_VIEW]:
    if tables[name].is_hashed:
      part, more = _hashed_lines(embed, name)
    else:
      grid = placement_grid(embed, name)
      part = [_heading(grid), grid.rule(), _image(grid, 7), *_notes(grid)]
      more = grid.labels
    lines += part
    labels.update(more)
  rest = names[MAX_TABLES_IN_VIEW:]
  if rest:
    where = f"model{path}" if path else "layer"
    lines.append(
      f"{len(rest)} more tables ({rest[0]} to {rest[-1]}): "
      f"pzsc.viz.placement_figure({where}, {rest[0]!r})"
    )
  lines += device_legend(labels, padding=True)
  lines = [_comment_line(line) for line in lines]
  # The last line after the others, as a node's closing line: a line break
  # after it would leave a blank line before the next one.
  expanded = rendering_parts.siblings(
    rendering_parts.on_separate_lines(lines[:-1]), lines[-1]
  )
  label = (
    "ids in vocabulary order, each coloured by the device holding it (as in "
    "Treescope's sharding view):"
  )
  return rendering_parts.build_custom_foldable_tree_node(
    label=_comment_line(label),
    contents=rendering_parts.fold_condition(
      collapsed=rendering_parts.comment_color(
        rendering_parts.text(f" {len(names[:MAX_TABLES_IN_VIEW])} tables")
      ),
      expanded=expanded,
    ),
    expand_state=rendering_parts.ExpandState.EXPANDED,
  ).renderable
