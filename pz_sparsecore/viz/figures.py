"""Treescope views of stacked, MOD-sharded tables and their inputs.

Rendering a `SparseCoreEmbed`, a `PreprocessedInput`, a
`SparseDenseMatmulInputStats` or a spec with Treescope (`treescope.show`,
`pz.show`, `treescope.render_to_html`) gives a one-line summary that expands
into per-stack details and the usual attribute tree (see `viz.treescope`).
This module adds the figures; each returns a `TreescopeFigure`, displayable
in a notebook (`_repr_html_`) and turned into a standalone HTML fragment by
`to_html`:

* `shard_map_figure`: per stack, an image of `[devices x SparseCores]` bars
  (one per shard, in shard-major order, grouped by device) by the `V_shard`
  rows of a shard, coloured by the member table that owns each row (each
  table its own colour, `palette.table_colors`), with padding rows in grey,
  and a legend (what a bar and a cell are; per colour the table,
  vocabulary, rows per shard, rotation; padding). Since every table
  occupies the same block of rows in every shard, tables appear as vertical
  stripes; padding shows where `padded_vocab_size` exceeds the vocabulary.
  A shard longer than `MAX_COLUMNS` rows is drawn in bands: each block
  takes at least two cells and the rest in proportion to its rows, so that
  the image fits a page and a 10-row table beside a 1M-row one still shows
  (in the DLRM benchmark's 26-table stack, 254,568 rows per shard become
  125 cells). Treescope's own sharding view cannot draw MOD sharding (its
  shards must be contiguous blocks); this figure draws the physical order
  instead.
* `row_owner_figure`: for one logical table, the owner shard of each of its
  first rows (`(i % N + rotation) % N`, as a digit-box image) and a small
  table `id → shard, device, SparseCore, row in shard, physical row`.
* `stats_heatmap`: per stack, the per-partition counts of a batch's stats,
  `[local devices x partitions]`, divided by `max_ids_per_partition` and
  `max_unique_ids_per_partition`. The colour scale is fixed: green to yellow
  up to the limit, red above it (and "+" beyond twice the limit), and the
  over-limit partitions are listed below the image.
* `table_values_figure`: the table values of a `SparseCoreEmbed` per shard,
  with Treescope's device-sharding picture of the `[N, V_shard, D]` array
  (contiguous over the mesh axis, so Treescope can draw it).

`describe` prints the same summaries as plain text.

Every figure reads a `plan.Plan`: pass a `SparseCoreEmbed` (its
`config.plan`), a `Plan`, or a pytree of feature specs together with
`global_device_count` and `num_sc_per_device` (prepared and planned for
that topology). The stacks, their member tables in row order, the rows per
shard and the COO entries per SparseCore all come from the plan.

Example::

  embed = SparseCoreEmbed.from_config("emb", key, specs, mesh)
  viz.shard_map_figure(embed)          # in a notebook
  html = viz.to_html(viz.stats_heatmap(stats, embed))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import treescope
from penzai import pz
from treescope import figures, rendering_parts

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.core.specs import FeatureSpec, StackedTableSpec, TableSpec
from pz_sparsecore.host import preprocess
from pz_sparsecore.viz import treescope as _treescope
from pz_sparsecore.viz.palette import PADDING_COLOR, table_colors

Figure = Any  # treescope's `TreescopeFigure` (not exported publicly).

MAX_COLUMNS = 128
"""Widest `shard_map_figure` image, in cells; longer shards are drawn in bands.

128 cells of 7 px (the default cell size) make a 910-px image with its
border, which fits a notebook cell or an HTML report 1280 px wide together
with the axis labels, whatever the table size. (A stack of more than 64
tables takes two cells per table, however wide.)"""

_MIN_CELLS_PER_BLOCK = 2
"""Cells a block of rows takes at least in a banded shard map: the first
shows the table, the last its padding if the block has any."""

_LABELLED_EDGE_ROWS = 512
"""Rows at each end of a shard that `table_values_figure` labels when
Treescope truncates the table: `render_array`'s per-axis cutoff, which its
default truncation keeps fewer than at either end of any axis."""

_LIMIT_RATIO_MAX = 2.0
_UNDER_LIMIT_COLORS = ((26, 152, 80), (145, 207, 96), (254, 224, 139))
_OVER_LIMIT_COLORS = ((244, 109, 67), (165, 0, 38))


# ---------------------------------------------------------------------------
# Inputs.


def _embed_class() -> type:
  """`SparseCoreEmbed`, imported on use (the layer loads the kernels)."""
  from pz_sparsecore.nn.embed import SparseCoreEmbed

  return SparseCoreEmbed


def _known_plan(obj: Any) -> plan_lib.Plan | None:
  """The plan of a `SparseCoreEmbed` or a `Plan`; None for anything else."""
  if isinstance(obj, _embed_class()):
    return obj.config.plan
  if isinstance(obj, plan_lib.Plan):
    return obj
  return None


def _plan_of(
  embed_or_specs: Any,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
) -> plan_lib.Plan:
  """The plan a figure draws: a layer's, a plan, or specs planned on G x S.

  Raises:
    ValueError: For feature specs without both topology counts.
  """
  plan = _known_plan(embed_or_specs)
  if plan is not None:
    return plan
  if global_device_count is None or num_sc_per_device is None:
    raise ValueError(
      "pass a SparseCoreEmbed, a Plan, or feature specs together with "
      "global_device_count and num_sc_per_device"
    )
  prepared = layout.prepare_feature_specs_for_training(
    embed_or_specs, global_device_count, num_sc_per_device
  )
  return plan_lib.build(prepared, global_device_count, num_sc_per_device)


def _stacks(plan: plan_lib.Plan, stack: str | None) -> list[StackPlan]:
  """Every stack of `plan`, or only `stack` (ValueError if unknown)."""
  return list(plan.stacks) if stack is None else [plan.stack(stack)]


def _color_css(rgb: tuple[int, int, int]) -> str:
  return "rgb({} {} {})".format(*rgb)


def _lines(*parts: Any) -> Figure:
  """A figure showing `parts` (figures, strings, arrays) one per line."""
  return figures.figure_from_treescope_rendering_part(
    rendering_parts.on_separate_lines(
      [figures.treescope_part_from_display_object(p) for p in parts]
    )
  )


def _heading(text: str) -> Figure:
  return figures.bolded(text)


# ---------------------------------------------------------------------------
# Shard map.


def _owner_index(stack: StackPlan, num_shards: int) -> np.ndarray:
  """`[N, V_shard]`: member table (row order) of each row, -1 for padding."""
  owner = np.full(num_shards * stack.rows_per_shard, -1, np.int32)
  for k, table in enumerate(stack.tables):
    ids = np.arange(table.vocabulary_size)
    owner[layout.physical_row_ids(table, ids, num_shards)] = k
  return owner.reshape(num_shards, -1)


def shard_table_index(
  feature_specs: Any, num_shards: int, stack: str
) -> np.ndarray:
  """Which member table owns each physical row of a stack.

  Args:
    feature_specs: Prepared feature specs, or their `Plan`.
    num_shards: N = devices x SparseCores.
    stack: The stack's name.

  Returns:
    int32 `[N, V_shard]`: the index of the owning table in row order
    (`StackPlan.tables`), or -1 for a padding row.

  Raises:
    ValueError: On an unknown stack, or a plan with another number of shards.
  """
  if isinstance(feature_specs, plan_lib.Plan):
    plan = feature_specs
    if plan.num_shards != num_shards:
      raise ValueError(
        f"the plan has {plan.num_shards} shards, not num_shards={num_shards}"
      )
  else:
    # A stack's rows depend on N alone. 1 device x N SparseCores fits every
    # preparation for N shards: its COO maximum `r8(max_ids) * N * N` is the
    # largest of all G x S = N, so no suggested buffer size exceeds it.
    plan = plan_lib.build(feature_specs, 1, num_shards)
  return _owner_index(plan.stack(stack), num_shards)


def _table_legend(stack: StackPlan, num_shards: int) -> list[Figure]:
  """Per member table its colour, vocabulary and block; then padding's."""
  items = []
  colors = table_colors(len(stack.tables))
  for table, color in zip(stack.tables, colors, strict=True):
    setting = table.setting_in_stack
    rows = _treescope.table_rows_per_shard(table, num_shards)
    start = setting.row_offset_in_shard
    items.append(
      figures.inline(
        figures.with_color("\u25a0 ", _color_css(color)),
        f"{table.name}: vocab {table.vocabulary_size} (padded "
        f"{setting.padded_vocab_size}) x {table.embedding_dim}, "
        f"{rows} rows/shard at [{start}, {start + rows}), "
        f"rotation {setting.shard_rotation}",
      )
    )
  items.append(
    figures.inline(
      figures.with_color("\u25a0 ", _color_css(PADDING_COLOR)),
      "padding: rows of a table's block past its vocabulary, and rows of a "
      "shard past its tables",
    )
  )
  return items


def _block_edges(stack: StackPlan, num_shards: int) -> np.ndarray:
  """Row edges of a shard's blocks, 0 to `V_shard`: each member table's
  block, and any rows outside them (padding) as blocks of their own."""
  edges = {0, stack.rows_per_shard}
  for table in stack.tables:
    start = table.setting_in_stack.row_offset_in_shard
    rows = _treescope.table_rows_per_shard(table, num_shards)
    edges |= {start, start + rows}
  return np.array(sorted(edges))


def _cell_starts(
  stack: StackPlan, num_shards: int, max_columns: int
) -> np.ndarray:
  """The first row in shard of each cell of a shard map's bars.

  A shard of at most `max_columns` rows has a cell per row. A longer one is
  drawn in bands: each block of rows (a member table's, or padding outside
  them) takes `_MIN_CELLS_PER_BLOCK` cells (or one per row if it has fewer
  rows), the rest of `max_columns` goes to the blocks in proportion to their
  rows, and a block's cells split it evenly. So every table shows however
  small, and the image is at most `max(max_columns, 2 x blocks)` cells wide
  whatever the vocabularies: in the DLRM benchmark's stack of 26 tables
  (254,568 rows per shard, 125 cells), the 125,000-row block of the 1M-row
  table takes 39 cells and the 8-row block of a 10-row table 2.
  """
  v_shard = stack.rows_per_shard
  if v_shard <= max_columns:
    return np.arange(v_shard)
  edges = _block_edges(stack, num_shards)
  rows = np.diff(edges)
  cells = np.minimum(rows, _MIN_CELLS_PER_BLOCK)
  spare = max(max_columns - int(cells.sum()), 0)
  cells = np.minimum(cells + spare * rows // v_shard, rows)
  return np.concatenate(
    [
      start + np.arange(count) * size // count
      for start, size, count in zip(edges[:-1], rows, cells, strict=True)
    ]
  )


def _device_axes(embed_or_specs: Any, g: int) -> list[tuple[str, int]]:
  """The mesh axes the shards are laid over, with their sizes: a layer's
  (its shard axis's mesh axes), else one "device" axis of `g`."""
  if isinstance(embed_or_specs, _embed_class()):
    topo = embed_or_specs.config.topology
    return [(a, int(topo.mesh.shape[a])) for a in topo.axes]
  return [("device", g)]


def _shard_map_image(
  plan: plan_lib.Plan,
  stack: StackPlan,
  max_columns: int,
  pixels_per_cell: int,
  device_axes: list[tuple[str, int]],
) -> tuple[Figure, bool]:
  """The `[mesh axes..., SparseCore] x cell` image of one stack's owner
  tables, shards grouped by the mesh axes they live on, and whether its
  cells are bands of rows (`_cell_starts`) rather than single rows."""
  s, n = plan.num_sc_per_device, plan.num_shards
  starts = _cell_starts(stack, n, max_columns)
  banded = len(starts) < stack.rows_per_shard
  # A cell shows the table of its block if any of its rows holds one of the
  # table's ids (they come first in the block), padding only if none does.
  owner = np.maximum.reduceat(_owner_index(stack, n), starts, axis=1)
  padding = len(stack.tables)
  values = np.where(owner < 0, padding, owner)
  k = len(device_axes)
  labels = {i: f"{name} ({size})" for i, (name, size) in enumerate(device_axes)}
  if banded:
    ends = [*starts[1:], stack.rows_per_shard]
    row_label = f"rows in shard ({len(starts)} bands)"
    item_labels = {
      k + 1: [f"rows [{a}, {b})" for a, b in zip(starts, ends, strict=True)]
    }
  else:
    row_label, item_labels = "row in shard", {}
  image = treescope.render_array(
    values.reshape(*(size for _, size in device_axes), s, -1),
    rows=[k, *reversed(range(k))],
    columns=[k + 1],
    continuous=False,
    colormap=[*table_colors(padding), PADDING_COLOR],
    value_item_labels={
      **{k: t.name for k, t in enumerate(stack.tables)},
      padding: "padding",
    },
    axis_labels={**labels, k: f"SparseCore ({s})", k + 1: row_label},
    axis_item_labels=item_labels,
    pixels_per_cell=pixels_per_cell,
  )
  return image, banded


def _replicated_note(embed_or_specs: Any, stack: str) -> list[str]:
  """A line saying the stack is replicated, for a layer that replicates
  it (none otherwise)."""
  config = getattr(embed_or_specs, "config", None)
  topology = getattr(config, "topology", None)
  if topology is None or not topology.is_replicated(stack):
    return []
  return [
    f"replicated: each of the {topology.num_devices} devices holds all "
    f"{config.plan.num_shards} shards below (the layout every copy shares)"
  ]


def _shard_map_key(stack: StackPlan, banded: bool) -> list[str]:
  """What the bars and cells of a shard map mean (above the colour legend)."""
  bar = (
    "each bar: one shard (a SparseCore of a device), its rows 0 to "
    f"{stack.rows_per_shard - 1} left to right"
  )
  if not banded:
    return [
      bar,
      "each cell: one row",
      "colour: the table that owns the row (hover a cell for its indices)",
    ]
  return [
    bar,
    "each cell: a band of rows within one table's block (hover for its rows)",
    f"bands: {_MIN_CELLS_PER_BLOCK} per block, and more in proportion to "
    "its rows",
    "colour: the table that owns the band's rows; grey if all are padding",
  ]


def shard_map_figure(
  embed_or_specs: Any,
  *,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
  stack: str | None = None,
  max_columns: int = MAX_COLUMNS,
  pixels_per_cell: int = 7,
) -> Figure:
  """Which rows of which logical table live on which device / SparseCore.

  Args:
    embed_or_specs: A `SparseCoreEmbed`, a `Plan`, or a pytree of feature
      specs (then `global_device_count` and `num_sc_per_device` are required;
      unstacked tables are prepared as one-table stacks).
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: SparseCores per device.
    stack: Only this stack; all by default.
    max_columns: Shards longer than this are drawn in bands of rows, each
      within one block (a table's rows, or padding outside them); a block
      takes at least two cells, so that every table shows, and a band shows
      its table if any of its rows holds one of the table's ids.
    pixels_per_cell: Cell size of the images.

  Returns:
    A figure: per stack a heading, the `[device, SparseCore] x row` image
    (for a layer, the devices split into the mesh axes its tables are
    sharded over, e.g. `data (2) x model (4)`), at most `max_columns` cells
    wide (or two per block, for a stack of over `max_columns / 2` tables),
    and the legend: what a bar and a cell are, then per colour its table
    (each table its own colour, `palette.table_colors`), then padding's
    grey.

  Raises:
    ValueError: On an unknown stack or missing topology.
  """
  plan = _plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  g, s, n = plan.num_devices, plan.num_sc_per_device, plan.num_shards
  parts: list[Any] = []
  for stack_plan in _stacks(plan, stack):
    image, banded = _shard_map_image(
      plan,
      stack_plan,
      max_columns,
      pixels_per_cell,
      _device_axes(embed_or_specs, g),
    )
    parts += [
      _heading(
        f"stack {stack_plan.name!r}: {n} shards ({g} devices x {s} SC), "
        f"{stack_plan.rows_per_shard} rows/shard x {stack_plan.dim}"
      ),
      *_replicated_note(embed_or_specs, stack_plan.name),
      image,
      *_shard_map_key(stack_plan, banded),
      *_table_legend(stack_plan, n),
    ]
  return _lines(*parts)


def row_placement(
  embed_or_specs: Any,
  table: str,
  ids: Sequence[int] | np.ndarray | None = None,
  *,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
) -> dict[str, np.ndarray]:
  """Where logical rows of a table live (MOD sharding plus rotation).

  Args:
    embed_or_specs: A `SparseCoreEmbed`, a `Plan`, or feature specs plus
      topology.
    table: The logical table's name.
    ids: Logical rows; all rows by default.
    global_device_count: Devices (with feature specs).
    num_sc_per_device: SparseCores per device (with feature specs).

  Returns:
    Arrays shaped like `ids`: "id", "shard", "device", "sparsecore",
    "row_in_shard" and "physical_row" (flat row of the `[N * V_shard, D]`
    stack). For a stack the layer replicates, every device holds every
    shard; "device" is then the device of the shard in the layout.

  Raises:
    ValueError: On an unknown table or an id outside the vocabulary.
  """
  plan = _plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  if table not in plan.tables:
    raise ValueError(
      f"unknown table {table!r}; the tables are {list(plan.tables)}"
    )
  spec = plan.tables[table]
  ids = np.arange(spec.vocabulary_size) if ids is None else np.asarray(ids)
  physical = layout.physical_row_ids(spec, ids, plan.num_shards)
  v_shard = plan.stack_of_table[table].rows_per_shard
  shard = physical // v_shard
  s = plan.num_sc_per_device
  return {
    "id": ids,
    "shard": shard,
    "device": shard // s,
    "sparsecore": shard % s,
    "row_in_shard": physical % v_shard,
    "physical_row": physical,
  }


def row_owner_figure(
  embed_or_specs: Any,
  table: str,
  *,
  num_rows: int = 64,
  num_listed: int = 8,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
) -> Figure:
  """The owner shard of a table's first logical rows.

  Args:
    embed_or_specs: A `SparseCoreEmbed`, a `Plan`, or feature specs plus
      topology.
    table: The logical table's name.
    num_rows: Rows shown in the image (the first ones).
    num_listed: Rows listed in the text table below the image.
    global_device_count: Devices (with feature specs).
    num_sc_per_device: SparseCores per device (with feature specs).

  Returns:
    A figure: a heading, an image `[rows]` of owner shards (hover for the
    device, SparseCore and row) and a table of the first rows.

  Raises:
    ValueError: On an unknown table or missing topology.
  """
  plan = _plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  spec = plan.tables.get(table)
  if spec is None:
    raise ValueError(f"unknown table {table!r}")
  count = min(num_rows, spec.vocabulary_size)
  place = row_placement(plan, table, np.arange(count))
  labels = [
    f"id {i}: shard {sh} (device {d}, SC {c}), row {r}"
    for i, sh, d, c, r in zip(
      place["id"],
      place["shard"],
      place["device"],
      place["sparsecore"],
      place["row_in_shard"],
      strict=True,
    )
  ]
  image = treescope.render_array(
    place["shard"],
    continuous=False,
    axis_labels={0: f"logical row (first {count})"},
    axis_item_labels={0: labels},
  )
  header = "   id  shard  device  SC  row in shard  physical row"
  rows = [
    f"{i:5d}  {sh:5d}  {d:6d}  {c:2d}  {r:12d}  {p:12d}"
    for i, sh, d, c, r, p in list(zip(*(place[k] for k in place), strict=True))[
      :num_listed
    ]
  ]
  setting = spec.setting_in_stack
  n = plan.num_shards
  return _lines(
    _heading(
      f"table {table!r} in stack {setting.stack_name!r}: row i on shard "
      f"(i % {n} + {setting.shard_rotation}) % {n}, at row "
      f"{setting.row_offset_in_shard} + i // {n}"
    ),
    *_replicated_note(embed_or_specs, setting.stack_name),
    image,
    header,
    *rows,
  )


# ---------------------------------------------------------------------------
# Stats.


def _mix(a: tuple[int, ...], b: tuple[int, ...], t: float) -> tuple[int, ...]:
  return tuple(round(x + (y - x) * t) for x, y in zip(a, b, strict=True))


def _limit_colormap(steps: int = 10) -> list[tuple[int, ...]]:
  """Evenly spaced stops over [0, 2]: green to yellow up to 1, red above."""
  under, over = _UNDER_LIMIT_COLORS, _OVER_LIMIT_COLORS
  stops = []
  for i in range(steps + 1):
    t = i / steps * (len(under) - 1)
    k = min(int(t), len(under) - 2)
    stops.append(_mix(under[k], under[k + 1], t - k))
  for i in range(1, steps + 1):
    stops.append(_mix(over[0], over[1], i / steps))
  return stops


def _topology_from_stats(stats: Any, stack: str) -> tuple[int, int]:
  """(G, S) of a single process, from the sizes of one stack's stats."""
  ids = np.asarray(stats.max_ids_per_partition[stack]).size
  per_sc = np.asarray(stats.required_buffer_size_per_sc[stack]).size
  g = ids // per_sc  # L * N / (L * S) = G.
  return g, per_sc // g  # One process: L = G.


def over_limit_partitions(
  counts: np.ndarray, limit: int, num_sc_per_device: int
) -> list[str]:
  """Lines naming each `[local device, partition]` count over `limit`."""
  lines = []
  for d, p in zip(*np.nonzero(counts > limit), strict=True):
    lines.append(
      f"device {d} -> partition {p} (device {p // num_sc_per_device}, "
      f"SC {p % num_sc_per_device}): {counts[d, p]} > {limit}"
    )
  return lines


def _limit_heatmap(
  counts: np.ndarray,
  limit: int,
  plan: plan_lib.Plan,
  pixels_per_cell: int,
) -> Figure:
  """`[local device x partition]` counts / limit on the fixed limit scale."""
  s, n = plan.num_sc_per_device, plan.num_shards
  return treescope.render_array(
    counts / limit,
    rows=[0],
    columns=[1],
    continuous=True,
    around_zero=False,
    vmin=0.0,
    vmax=_LIMIT_RATIO_MAX,
    trim_outliers=False,
    colormap=_limit_colormap(),
    axis_labels={
      0: f"local device ({counts.shape[0]})",
      1: f"partition ({n})",
    },
    axis_item_labels={1: [f"device {p // s}, SC {p % s}" for p in range(n)]},
    pixels_per_cell=pixels_per_cell,
  )


def _stack_stats_parts(
  stats: Any,
  stack: StackPlan,
  plan: plan_lib.Plan,
  pixels_per_cell: int,
) -> list[Any]:
  """One stack's summary line, colour key, heat maps and over-limit list."""
  spec, name = stack.spec, stack.name
  parts: list[Any] = [
    _heading(_treescope.stats_line(stats, name, spec, stack.coo_per_sc)),
    "colour: count / limit, green (0) to yellow (at the limit), then orange "
    "to dark red (twice the limit)",
  ]
  over = []
  for title, counts, limit in (
    ("ids", stats.max_ids_per_partition[name], spec.max_ids_per_partition),
    (
      "unique ids",
      stats.max_unique_ids_per_partition[name],
      spec.max_unique_ids_per_partition,
    ),
  ):
    counts = np.asarray(counts).reshape(-1, plan.num_shards)
    parts.append(f"{title} per partition / limit {limit}:")
    parts.append(_limit_heatmap(counts, limit, plan, pixels_per_cell))
    over += [
      f"{title}: {line}"
      for line in over_limit_partitions(counts, limit, plan.num_sc_per_device)
    ]
  if over:
    parts.append(figures.with_color(f"OVER LIMIT ({len(over)}):", "red"))
    parts += over
  else:
    parts.append("all partitions within the limits")
  return parts


def stats_heatmap(
  stats: Any,
  embed_or_specs: Any,
  *,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
  stack: str | None = None,
  pixels_per_cell: int = 14,
) -> Figure:
  """Per-partition id counts of a batch against the stack limits.

  Args:
    stats: A `SparseDenseMatmulInputStats` (host arrays).
    embed_or_specs: A `SparseCoreEmbed`, a `Plan` or prepared feature specs.
    global_device_count: Devices (with feature specs; inferred from the
      stats for a single process when omitted).
    num_sc_per_device: SparseCores per device (likewise).
    stack: Only this stack; all by default.
    pixels_per_cell: Cell size of the images.

  Returns:
    A figure: per stack a summary line, the colour key, two heat maps
    `[local device x partition]` of count / limit (ids, unique ids) on a
    fixed scale where red means over the limit, and the list of over-limit
    partitions.

  Raises:
    ValueError: If a stack of the stats is not in the specs.
  """
  names = list(stats.max_ids_per_partition) if stack is None else [stack]
  if not names:
    return _lines()
  plan = _known_plan(embed_or_specs)
  if plan is None:
    if global_device_count is None or num_sc_per_device is None:
      global_device_count, num_sc_per_device = _topology_from_stats(
        stats, names[0]
      )
    plan = _plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  parts: list[Any] = []
  for name in names:
    if name not in plan.stack_by_name:
      raise ValueError(f"stats stack {name!r} is not in the feature specs")
    parts += _stack_stats_parts(
      stats, plan.stack_by_name[name], plan, pixels_per_cell
    )
  return _lines(*parts)


# ---------------------------------------------------------------------------
# Table values.


def _row_labels(
  stack: StackPlan, owner: np.ndarray, truncate: bool
) -> list[str] | dict[int, str]:
  """Per row of a shard: its table and its row inside the table's block.

  All rows when Treescope draws them all; else (`truncate`, a shard longer
  than twice `_LABELLED_EDGE_ROWS`) only the rows at either end that it can
  draw, keyed by row: Treescope's hover text looks a row's label up by
  index (`lookup_table[row]` in its JavaScript), which a mapping serves as
  well as a list, and the HTML holds about a thousand labels rather than
  one per row (254,568 per shard in the DLRM benchmark: 8 MB).
  """
  v_shard = owner.shape[1]
  rows = np.arange(v_shard)
  edge = _LABELLED_EDGE_ROWS
  if truncate and v_shard > 2 * edge:
    rows = np.concatenate([rows[:edge], rows[-edge:]])
  labels = {}
  for r, k in zip(rows, owner[:, rows].max(axis=0), strict=True):
    table = stack.tables[k] if k >= 0 else None
    start = table.setting_in_stack.row_offset_in_shard if table else 0
    label = table.name if table else "padding"
    labels[int(r)] = f"{label} (row {r - start} of its block)"
  return list(labels.values()) if len(rows) == v_shard else labels


def _table_values_parts(
  embed: Any, stack: StackPlan, truncate: bool
) -> list[Any]:
  """One stack's heading, values, device sharding and legend."""
  from pz_sparsecore.nn.tables import ROW_AXIS, SHARD_AXIS

  config = embed.config
  n = config.plan.num_shards
  var = embed.tables[stack.name]
  if isinstance(var, pz.ParameterSlot):
    raise ValueError(
      f"stack {stack.name!r}: the table is an unbound {type(var).__name__}; "
      "build the layer with an init_base_rng or restore a checkpoint first"
    )
  value = var.value
  owner = _owner_index(stack, n)
  return [
    _heading(
      f"stack {stack.name!r}: {config.table_label(stack.name)} "
      f"[{n} shards x {stack.rows_per_shard} rows x {stack.dim}]"
    ),
    treescope.render_array(
      value,
      rows=[ROW_AXIS],
      columns=[config.embedding_axis, SHARD_AXIS],
      truncate=truncate,
      axis_item_labels={ROW_AXIS: _row_labels(stack, owner, truncate)},
    ),
    "device sharding:",
    treescope.render_array_sharding(
      value, rows=[SHARD_AXIS], columns=[config.embedding_axis, ROW_AXIS]
    ),
    *_table_legend(stack, n),
  ]


def table_values_figure(
  embed: Any, stack: str | None = None, *, truncate: bool = True
) -> Figure:
  """The values of a layer's stacked tables, per shard, with their sharding.

  Args:
    embed: A `SparseCoreEmbed` whose tables hold values (not slots).
    stack: Only this stack; all by default.
    truncate: Let Treescope truncate large tables.

  Returns:
    A figure: per stack a heading, the `[N, V_shard, D]` values (one panel
    per shard; hover a row for its table and logical row) and Treescope's
    picture of the array's device sharding.

  Raises:
    ValueError: On an unknown stack, or if the tables are unbound
      `ParameterSlot`s.
  """
  parts: list[Any] = []
  for stack_plan in _stacks(embed.config.plan, stack):
    parts += _table_values_parts(embed, stack_plan, truncate)
  return _lines(*parts)


# ---------------------------------------------------------------------------
# Text and HTML.


def _stats_context(
  context: Any,
) -> tuple[dict[str, StackedTableSpec] | None, dict[str, int] | None]:
  """(limits, COO entries per SparseCore) by stack, as far as `context` tells.

  A layer or a plan gives both; prepared feature specs give the limits only
  (they do not say the topology).
  """
  plan = _known_plan(context)
  if plan is not None:
    return (
      {stack.name: stack.spec for stack in plan.stacks},
      {stack.name: stack.coo_per_sc for stack in plan.stacks},
    )
  if context is None:
    return None, None
  return layout.get_stacked_table_specs(context), None


def describe(obj: Any, context: Any = None) -> str:
  """A plain-text summary (the Treescope summary plus its detail lines).

  Args:
    obj: A `SparseCoreEmbed`, `Plan`, `PreprocessedInput`,
      `SparseDenseMatmulInputStats`, `TableSpec`, `FeatureSpec` or
      `StackedTableSpec`.
    context: For stats, the `SparseCoreEmbed` or `Plan` (or prepared feature
      specs, for the limits only) to compare against its limits and buffer
      sizes; for inputs, the layer or plan (for its number of shards).

  Returns:
    Lines of text, the first `Type(summary)`, the others indented by two.

  Raises:
    TypeError: For other objects.
  """
  kind = type(obj).__name__
  if isinstance(obj, (TableSpec, FeatureSpec, StackedTableSpec)):
    return f"{kind}({_treescope.spec_summary(obj)})"
  if isinstance(obj, preprocess.PreprocessedInput):
    plan = _known_plan(context)
    summary = _treescope.inputs_summary(obj)
    details = _treescope.inputs_details(
      obj, None if plan is None else plan.num_shards
    )
  elif isinstance(obj, preprocess.SparseDenseMatmulInputStats):
    summary = _treescope.stats_summary(obj)
    details = _treescope.stats_details(obj, *_stats_context(context))
  elif isinstance(obj, _embed_class()):
    summary = _treescope.embed_summary(obj)
    details = _treescope.embed_details(obj)
  elif isinstance(obj, plan_lib.Plan):
    summary = _treescope.plan_summary(obj)
    details = _treescope.plan_details(obj)
  else:
    raise TypeError(f"describe: unsupported object {kind}")
  return "\n".join([f"{kind}({summary})", *(f"  {d}" for d in details)])


def to_html(
  obj: Any, *, compressed: bool = False, autovisualize: bool = True
) -> str:
  """A self-contained HTML fragment of `obj` (a figure or any value).

  Args:
    obj: A figure from this module (or any `TreescopeFigure`), or any value
      Treescope renders (a layer, inputs, stats, specs, ...).
    compressed: Compress the payload (smaller, but not greppable).
    autovisualize: Draw arrays inside `obj` with Treescope's array view.

  Returns:
    HTML (with inline scripts; JavaScript draws the arrays).
  """
  if hasattr(obj, "treescope_part"):
    return treescope.lowering.render_to_html_as_root(
      obj.treescope_part, compressed=compressed
    )
  visualizer = treescope.ArrayAutovisualizer() if autovisualize else None
  with treescope.active_autovisualizer.set_scoped(visualizer):
    return treescope.render_to_html(
      obj, roundtrip_mode=False, compressed=compressed
    )
