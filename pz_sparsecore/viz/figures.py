"""Treescope views of stacked, MOD-sharded tables and their inputs.

Rendering a `SparseCoreEmbed`, a `PreprocessedInput`, a
`SparseDenseMatmulInputStats` or a spec with Treescope (`treescope.show`,
`pz.show`, `treescope.render_to_html`) gives a one-line summary that expands
into per-stack details and the usual attribute tree (see `viz.treescope`).
This module adds the figures; each returns a `TreescopeFigure`, displayable
in a notebook (`_repr_html_`) and turned into a standalone HTML fragment by
`to_html`:

* `shard_map_figure`: per stack, one bar per shard (G devices x S
  SparseCores: shard `k` is SparseCore `k % S` of device `k // S`; the S
  bars of a device one cell apart, devices two), each the `V_shard` rows of
  the shard, coloured by the member table that owns each row (each table
  its own colour, `palette.table_colors`, none near a device colour), with
  padding rows in grey. The first cell of each bar shows the device holding
  the shard in the colour Treescope's sharding view draws it in (device d:
  digit d + 1). Hovering a bar names its device and SparseCore;
  hovering a cell, the ids it holds (shard k holds the ids i of a table
  with `(i % N + rotation) % N == k`, its q-th at row `row_offset + q`), so
  that even a one-table stack, all one colour, says where each id lives.
  Then the key (what a bar, a cell, a colour are) and the legends: per
  table its colour, block and id -> shard rule; padding; devices. Since
  every table occupies the same block of rows in every shard, tables
  appear as vertical stripes; padding shows where `padded_vocab_size`
  exceeds the vocabulary. A shard longer than `MAX_COLUMNS` rows is drawn
  in bands: each block takes at least two cells and the rest in proportion
  to its rows, so that the image fits a page and a 10-row table beside a
  1M-row one still shows (in the DLRM benchmark's 26-table stack, 254,568
  rows per shard become 78 cells). Treescope's own sharding view
  cannot draw MOD sharding (its shards must be contiguous blocks); this
  figure draws the physical order instead. `shard_map_data` returns what
  it draws as plain data.
* `row_owner_figure`: for one logical table, the owner shard of each of its
  first rows (`(i % N + rotation) % N`, as a digit-box image) and a small
  table `id → shard, device, SparseCore, row in shard, physical row`.
* `stats_heatmap`: per stack, the per-partition counts of a batch's stats,
  a row per partition (grouped by the device it is on) and a column per
  local device, coloured by count / `max_ids_per_partition` (and
  `max_unique_ids_per_partition`) and printed beside the image in the same
  layout. The colour scale is fixed and labelled with counts: green to
  yellow up to the limit, red above it (and "+" beyond twice the limit),
  so a uniform batch reads as its numbers; the over-limit partitions are
  listed below.
* `table_values_figure`: the table values of a `SparseCoreEmbed` per shard
  (`[N, V_shard, D]`, a panel per shard), and beside them, in the same
  layout cell for cell, the device holding each cell, coloured as
  Treescope's sharding view colours devices.

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
from treescope._internal import arrayviz_impl  # What `render_array` draws.

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.core.specs import FeatureSpec, StackedTableSpec, TableSpec
from pz_sparsecore.host import preprocess
from pz_sparsecore.viz import treescope as _treescope
from pz_sparsecore.viz._common import (
  device_legend,
  embed_class,
  known_plan,
  plan_of,
)
from pz_sparsecore.viz.palette import PADDING_COLOR, digit_colors, table_colors

Figure = Any  # treescope's `TreescopeFigure` (not exported publicly).

MAX_COLUMNS = 80
"""Widest `shard_map_figure` image, in cells; longer shards are drawn in bands.

80 cells of 10 px (the size `shard_map_figure` picks for them) make an
820-px image with its border, which fits a notebook cell or an HTML report
1280 px wide together with the device column and the axis labels, whatever
the table size. (A stack of more than 40 tables takes two cells per table,
however wide.)"""

_MIN_CELLS_PER_BLOCK = 2
"""Cells a block of rows takes at least in a banded shard map: the first
shows the table, the last its padding if the block has any."""

_SHARD_MAP_SIZE_PX = (880, 720)
"""Width and height a shard map's bars fill at most with their default cell
size (`_PIXELS_PER_CELL_RANGE` permitting)."""

_PIXELS_PER_CELL_RANGE = (7, 14)
"""Default cell sizes of a shard map: Treescope's own (7 px; its digitboxes
need at least 7) up to twice that, for short shards and few devices."""

_MAX_LABELLED_CELLS = 16_384
"""Cells of a shard map that get a hover label of their own (the ids they
hold): the HTML holds one label per cell, about 50 bytes each. A larger map
labels each cell with its table's name."""


_BLANK_COLOR = (255, 255, 255)
"""The cell between a bar's device and its rows: the page's white."""

_TRUNCATION = dict(
  maximum_size=10_000, cutoff_size_per_axis=512, minimum_edge_items=5
)
"""How `table_values_figure` and `vocabulary_view_figure` let Treescope
truncate their pictures (`render_array`'s defaults): at most 10,000 cells,
an axis longer than 512 cut to its ends."""

_LABELLED_EDGE_ROWS = _TRUNCATION["cutoff_size_per_axis"]
"""Rows at each end of a shard that `table_values_figure` labels when
Treescope truncates the table: `render_array`'s per-axis cutoff, which its
truncation keeps fewer than at either end of any axis."""

_VALUES_WIDTH_PX = 800
"""Width `table_values_figure`'s shards fill at most side by side (the cell
size shrinks to fit, down to one pixel): with the axis labels, a notebook
cell or a report page 1280 px wide holds it."""

_LIMIT_RATIO_MAX = 2.0
_UNDER_LIMIT_COLORS = ((26, 152, 80), (145, 207, 96), (254, 224, 139))
_OVER_LIMIT_COLORS = ((244, 109, 67), (165, 0, 38))


# ---------------------------------------------------------------------------
# Inputs.


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


_PADDING_TEXT = (
  "padding: rows of a table's block past its vocabulary, and rows of a "
  "shard past its tables"
)


def _table_entries(
  stack: StackPlan, num_shards: int
) -> list[tuple[tuple[int, int, int], str]]:
  """Per member table its colour and legend text: vocabulary, block, and
  the MOD-sharding rule that places its ids."""
  n = num_shards
  entries = []
  colors = table_colors(len(stack.tables))
  for table, color in zip(stack.tables, colors, strict=True):
    setting = table.setting_in_stack
    rows = _treescope.table_rows_per_shard(table, n)
    start, rotation = setting.row_offset_in_shard, setting.shard_rotation
    entries.append(
      (
        color,
        f"{table.name}: vocab {table.vocabulary_size} (padded "
        f"{setting.padded_vocab_size}) x {table.embedding_dim}, "
        f"{rows} rows/shard at [{start}, {start + rows}), "
        f"rotation {rotation}; id i on shard (i % {n} + {rotation}) % {n}, "
        f"row {start} + i // {n}",
      )
    )
  return entries


def _swatch(color: Sequence[int], text: str) -> Figure:
  """A legend line: a square in `color`, then `text`."""
  return figures.inline(
    figures.with_color("\u25a0 ", _color_css(tuple(color))), text
  )


def _table_legend(stack: StackPlan, num_shards: int) -> list[Figure]:
  """Per member table its colour, vocabulary, block and rule; then
  padding's."""
  return [
    *(_swatch(c, text) for c, text in _table_entries(stack, num_shards)),
    _swatch(PADDING_COLOR, _PADDING_TEXT),
  ]


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
  (254,568 rows per shard, 78 cells), the 125,000-row block of the 1M-row
  table takes 15 cells and the 8-row block of a 10-row table 2.
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


def _device_values(
  embed_or_specs: Any, plan: plan_lib.Plan, stack: StackPlan
) -> tuple[list[int], dict[int, str]]:
  """Per shard the digitbox value of the devices holding it, and each
  value's legend text, as `viz.placement` reads them (a layer's from its
  table's sharding, `"CPU 0"`; otherwise positions, `"device 0"`)."""
  from pz_sparsecore.viz import placement

  holders, kind = placement._shard_holders(embed_or_specs, plan, stack)
  values, _, labels = placement._device_values(holders, kind)
  return [int(v) for v in values], {int(v): t for v, t in labels.items()}


def _mesh_axes(embed_or_specs: Any) -> list[tuple[str, int]]:
  """A layer's mesh axes of its shard axis, with their sizes; else none."""
  if not isinstance(embed_or_specs, embed_class()):
    return []
  topo = embed_or_specs.config.topology
  return [(a, int(topo.mesh.shape[a])) for a in topo.axes]


def _device_labels(
  g: int,
  s: int,
  values: list[int],
  labels: dict[int, str],
  axes: list[tuple[str, int]],
) -> list[str]:
  """Per device of the layout: its number, its coordinates on a mesh of
  several axes, and the devices holding its shards when they are named."""
  out = []
  for d in range(g):
    text = f"device {d}"
    if len(axes) > 1:
      coords = np.unravel_index(d, [size for _, size in axes])
      where = ", ".join(
        f"{name} {int(i)}" for (name, _), i in zip(axes, coords, strict=True)
      )
      text += f" ({where})"
    held = labels[values[d * s]]
    if held != f"device {d}":
      text += f": {held}"
    out.append(text)
  return out


def _ids_on_shard(
  table: TableSpec, num_shards: int, shard: int
) -> tuple[int, int]:
  """(first, count): shard `shard` holds the table's ids `first + N q` for
  q < count (MOD sharding: id i on shard `(i % N + rotation) % N`), the
  q-th at row `row_offset_in_shard + q`."""
  n = num_shards
  first = (shard - table.setting_in_stack.shard_rotation) % n
  return first, max(0, -(-(table.vocabulary_size - first) // n))


def _example_line(stack: StackPlan, num_shards: int, s: int) -> list[str]:
  """The rule worked out for the stack's first table on shard 1 (or 0)."""
  table, n = stack.tables[0], num_shards
  k = min(1, n - 1)
  first, count = _ids_on_shard(table, n, k)
  if not count:
    return []
  ids = ", ".join(str(first + n * q) for q in range(min(count, 3)))
  if count > 3:
    ids += f", ..., {first + n * (count - 1)}"
  start = table.setting_in_stack.row_offset_in_shard
  return [
    f"e.g. shard {k} (device {k // s}, SparseCore {k % s}) holds "
    f"ids {ids} of {table.name}, at rows {start} to {start + count - 1}"
  ]


def _cell_label(
  stack: StackPlan, num_shards: int, shard: int, start: int, end: int
) -> str:
  """What rows `[start, end)` of shard `shard` hold: a table's ids (MOD
  sharding: shard k holds the ids i with `(i % N + rotation) % N == k`, its
  q-th at row `row_offset + q`), or padding."""
  n = num_shards
  for table in stack.tables:
    setting = table.setting_in_stack
    offset = setting.row_offset_in_shard
    rows = _treescope.table_rows_per_shard(table, n)
    if not offset <= start < offset + rows:
      continue
    first, count = _ids_on_shard(table, n, shard)
    q0, q1 = start - offset, min(end, offset + rows) - offset
    held = min(q1, count)
    if held <= q0:
      return f"padding: {table.name}'s rows past its vocabulary"
    ids = [first + n * q for q in (q0, held - 1)]
    if held - q0 == 1:
      text = f"{table.name}: id {ids[0]}"
    else:
      text = (
        f"{table.name}: ids {ids[0]} to {ids[1]} in steps of {n} "
        f"({held - q0} ids)"
      )
    if held < q1:
      text += f", then {q1 - held} padding rows"
    return text
  return "padding: rows of the shard past its tables"


def _cells(
  stack: StackPlan, num_shards: int, starts: np.ndarray
) -> tuple[np.ndarray, list[tuple[int, int, int]], list[str]]:
  """A shard map's `[N, cells]` values, their colours and hover labels.

  Each cell its own value, labelled with the ids it holds, up to
  `_MAX_LABELLED_CELLS` cells; beyond, a cell's value is its table's (or
  padding's), labelled with the table's name.
  """
  n, v_shard = num_shards, stack.rows_per_shard
  # A cell shows the table of its block if any of its rows holds one of the
  # table's ids (they come first in the block), padding only if none does.
  owner = np.maximum.reduceat(_owner_index(stack, n), starts, axis=1)
  padding = len(stack.tables)
  owner = np.where(owner < 0, padding, owner)
  palette = [*table_colors(padding), PADDING_COLOR]
  if owner.size > _MAX_LABELLED_CELLS:
    names = [t.name for t in stack.tables]
    return owner, palette, [*names, "padding"]
  ends = [*starts[1:], v_shard]
  labels = [
    _cell_label(stack, n, k, int(a), int(b))
    for k in range(n)
    for a, b in zip(starts, ends, strict=True)
  ]
  colors = [palette[i] for i in owner.ravel()]
  return np.arange(owner.size).reshape(owner.shape), colors, labels


def _pixels_per_cell(columns: int, g: int, s: int) -> int:
  """Cells as large as fit `_SHARD_MAP_SIZE_PX`, within
  `_PIXELS_PER_CELL_RANGE`: bars of `columns` cells (and the image's
  one-cell border), `S` bars per device one cell apart, devices two apart
  (Treescope's gaps between the groups of its axes)."""
  width, height = _SHARD_MAP_SIZE_PX
  rows = g * (2 * s - 1) + 2 * (g - 1)
  low, high = _PIXELS_PER_CELL_RANGE
  fit = min(width // (columns + 2), height // (rows + 2))
  return max(low, min(high, fit))


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


def _shard_map_key(data: dict[str, Any]) -> list[str]:
  """What the bars, their device cells and row cells of a shard map mean
  (above the legends); true for any devices, SparseCores and mesh."""
  g, s, n = data["num_devices"], data["num_sc_per_device"], data["num_shards"]
  grouping = "one per device" if s == 1 else f"{s} per device"
  lines = [
    f"each bar: one shard ({n}: {g} devices x {s} SparseCore"
    f"{'s' if s > 1 else ''}, {grouping}):"
    f" its device, a blank, then its {data['rows_per_shard']} rows, row 0 "
    "first",
    "device: coloured as Treescope's sharding view colours it (device d: "
    "digit d + 1; legend below)",
  ]
  if data["banded"]:
    lines += [
      "each cell: a band of rows within one table's block; "
      f"{_MIN_CELLS_PER_BLOCK} bands per block, more in proportion to its "
      "rows",
      "hover: a bar for its device and SparseCore, a cell for its rows and "
      "the ids they hold",
    ]
  else:
    lines += [
      "each cell: one row",
      "hover: a bar for its device and SparseCore, a cell for the id it holds",
    ]
  lines.append("colour: the table whose ids the cell holds; grey: padding")
  return lines


def _mesh_note(axes: list[tuple[str, int]]) -> list[str]:
  """How the devices are numbered over a mesh of several axes."""
  if len(axes) <= 1:
    return []
  names = " x ".join(f"{name} ({size})" for name, size in axes)
  return [f"devices numbered over the mesh axes {names}, the last fastest"]


def _stack_shard_map(
  embed_or_specs: Any,
  plan: plan_lib.Plan,
  stack: StackPlan,
  max_columns: int,
  pixels_per_cell: int | None,
) -> dict[str, Any]:
  """`shard_map_data` of one stack."""
  g, s, n = plan.num_devices, plan.num_sc_per_device, plan.num_shards
  starts = _cell_starts(stack, n, max_columns)
  ends = [*starts[1:], stack.rows_per_shard]
  values, cells_colors, cell_labels = _cells(stack, n, starts)
  devices, device_text = _device_values(embed_or_specs, plan, stack)
  axes = _mesh_axes(embed_or_specs)
  if pixels_per_cell is None:
    pixels_per_cell = _pixels_per_cell(len(starts) + 2, g, s)
  data = {
    "stack": stack.name,
    "heading": (
      f"stack {stack.name!r}: {n} shards ({g} devices x {s} SC), "
      f"{stack.rows_per_shard} rows/shard x {stack.dim}"
    ),
    "notes": [
      *_replicated_note(embed_or_specs, stack.name),
      *_mesh_note(axes),
    ],
    "num_devices": g,
    "num_sc_per_device": s,
    "num_shards": n,
    "rows_per_shard": stack.rows_per_shard,
    "banded": len(starts) < stack.rows_per_shard,
    "pixels_per_cell": int(pixels_per_cell),
    "cell_rows": [[int(a), int(b)] for a, b in zip(starts, ends, strict=True)],
    "shard_devices": devices,
    "device_labels": _device_labels(g, s, devices, device_text, axes),
    "sparsecore_labels": [f"SparseCore {c}" for c in range(s)],
    "cells": values.tolist(),
    "colors": [list(c) for c in cells_colors],
    "cell_labels": cell_labels,
    "tables": [
      {"name": t.name, "color": list(color), "text": text}
      for t, (color, text) in zip(
        stack.tables, _table_entries(stack, n), strict=True
      )
    ],
    "padding": {"color": list(PADDING_COLOR), "text": _PADDING_TEXT},
    "devices": [
      {
        "value": v,
        "label": device_text[v],
        "color": list(digit_colors(v)[0]),
      }
      for v in sorted(device_text)
    ],
  }
  data["key"] = [*_shard_map_key(data), *_example_line(stack, n, s)]
  return data


def shard_map_data(
  embed_or_specs: Any,
  *,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
  stack: str | None = None,
  max_columns: int = MAX_COLUMNS,
  pixels_per_cell: int | None = None,
) -> list[dict[str, Any]]:
  """What `shard_map_figure` draws, as plain data (JSON-ready).

  Arguments as `shard_map_figure`'s.

  Returns:
    Per stack a dict: "stack", "heading", "notes" and "key" (the text
    lines); "num_devices" G, "num_sc_per_device" S, "num_shards" N,
    "rows_per_shard"; "banded" and "cell_rows" (per cell of a bar its rows
    `[start, end)`); "pixels_per_cell"; "cells" (`[N][cells]` values, shard
    `k` on device `k // S`, SparseCore `k % S`), "colors" and
    "cell_labels" (per value its colour and hover text: the ids the cell
    holds, or padding); "shard_devices" (per shard the digitbox value of
    the devices holding it), "device_labels" (per device) and
    "sparsecore_labels" (per SparseCore), the bars' hover labels;
    "tables" (name, colour, legend text), "padding" and "devices" (each
    digitbox value and its devices), the legends.

  Raises:
    ValueError: On an unknown stack or missing topology.
  """
  plan = plan_of(embed_or_specs, global_device_count, num_sc_per_device)
  return [
    _stack_shard_map(embed_or_specs, plan, one, max_columns, pixels_per_cell)
    for one in _stacks(plan, stack)
  ]


def _shard_map_image(data: dict[str, Any]) -> Figure:
  """The bars of a shard map: `[device, SparseCore, bar, cell]`, the bar's
  first cell its device's colour, then a blank cell, then its rows.

  One bar per shard: the innermost row axis has one entry, so Treescope
  outlines each bar and leaves a cell between the bars of a device and two
  between devices.
  """
  g, s = data["num_devices"], data["num_sc_per_device"]
  colors = [tuple(c) for c in data["colors"]]
  labels = dict(enumerate(data["cell_labels"]))
  device_code = {}
  for d in data["devices"]:
    device_code[d["value"]] = len(colors)
    labels[len(colors)] = d["label"]
    colors.append(tuple(d["color"]))
  blank = len(colors)
  colors.append(_BLANK_COLOR)
  labels[blank] = "(between the device and the rows)"
  devices = np.asarray([device_code[v] for v in data["shard_devices"]])
  cells = np.asarray(data["cells"], np.int32)
  image = np.concatenate(
    [devices[:, None], np.full_like(devices, blank)[:, None], cells], axis=1
  )
  if data["banded"]:
    cells_label = f"device | rows in shard ({len(data['cell_rows'])} bands)"
    rows = [f"rows [{a}, {b})" for a, b in data["cell_rows"]]
  else:
    cells_label = "device | row in shard"
    rows = [f"row {a}" for a, _ in data["cell_rows"]]
  return treescope.render_array(
    image.reshape(g, s, 1, -1).astype(np.int32),
    rows=[2, 1, 0],
    columns=[3],
    continuous=False,
    colormap=colors,
    value_item_labels=labels,
    axis_labels={
      0: f"device ({g})",
      1: f"SparseCore ({s})",
      2: "bar",
      3: cells_label,
    },
    axis_item_labels={
      0: data["device_labels"],
      1: data["sparsecore_labels"],
      3: ["device", "", *rows],
    },
    pixels_per_cell=data["pixels_per_cell"],
  )


def shard_map_figure(
  embed_or_specs: Any,
  *,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
  stack: str | None = None,
  max_columns: int = MAX_COLUMNS,
  pixels_per_cell: int | None = None,
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
    pixels_per_cell: Cell size of the images; by default as large as fits
      about 880 x 720 px, from 7 to 14.

  Returns:
    A figure: per stack a heading, one bar per shard (G devices x S
    SparseCores, the bars of a device together, each hover-labelled with
    its device and SparseCore), each first the device holding the shard in
    Treescope's colour for it, then at most `max_columns` cells (or two
    per block, for a stack of over `max_columns / 2` tables), each cell
    hover-labelled with the ids it holds; then what a
    bar, a cell and a colour are, and the legends: per table its colour and
    the id -> shard rule, padding's grey, and the devices. A one-table
    stack's bars are all its colour: its `placement_figure` follows, its
    ids in vocabulary order coloured by device. `shard_map_data` gives the
    shard map as plain data.

  Raises:
    ValueError: On an unknown stack or missing topology.
  """
  parts: list[Any] = []
  for data in shard_map_data(
    embed_or_specs,
    global_device_count=global_device_count,
    num_sc_per_device=num_sc_per_device,
    stack=stack,
    max_columns=max_columns,
    pixels_per_cell=pixels_per_cell,
  ):
    parts += [
      _heading(data["heading"]),
      *data["notes"],
      _shard_map_image(data),
      *data["key"],
      *(_swatch(t["color"], t["text"]) for t in data["tables"]),
      _swatch(data["padding"]["color"], data["padding"]["text"]),
      *device_legend(
        {d["value"]: d["label"] for d in data["devices"]}, cells=True
      ),
    ]
    if len(data["tables"]) == 1:
      # Every bar of a one-table stack is the table's colour: which ids a
      # device holds shows in vocabulary order instead.
      from pz_sparsecore.viz.placement import placement_figure

      (table,) = data["tables"]
      parts += [
        f"{table['name']}'s ids in vocabulary order, coloured by the device "
        "holding each (viz.placement_figure):",
        placement_figure(
          embed_or_specs,
          table["name"],
          global_device_count=global_device_count,
          num_sc_per_device=num_sc_per_device,
        ),
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
  plan = plan_of(embed_or_specs, global_device_count, num_sc_per_device)
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
    A figure: a heading, an image `[rows]` coloured by the device holding
    each row as Treescope draws devices (hover for the shard, device,
    SparseCore and row), the device legend, and a table of the first rows.

  Raises:
    ValueError: On an unknown table or missing topology.
  """
  plan = plan_of(embed_or_specs, global_device_count, num_sc_per_device)
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
  # Coloured by the device holding the row, in Treescope's device colours.
  stack = plan.stack_of_table[table]
  devices, device_text = _device_values(embed_or_specs, plan, stack)
  image = treescope.render_array(
    np.asarray(devices, np.int32)[place["shard"]],
    continuous=False,
    value_item_labels=device_text,
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
    "colour: the device holding the row",
    *device_legend(device_text),
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


_SCALE_RATIOS = (0.0, 0.5, 1.0, 1.5, _LIMIT_RATIO_MAX)
"""The counts / limit a heat map's scale names, with their colours."""


def _ratio_color(ratio: float) -> tuple[int, ...]:
  """The colour of count / limit `ratio` in [0, 2] (`_limit_colormap`'s
  stops are evenly spaced over that range)."""
  stops = _limit_colormap()
  return stops[round(ratio / _LIMIT_RATIO_MAX * (len(stops) - 1))]


def _scale_legend(limit: int) -> Figure:
  """The colour scale as swatches, each with the count it stands for."""
  items = []
  for ratio in _SCALE_RATIOS:
    count = round(ratio * limit)
    text = str(count)
    if ratio == 1.0:
      text += " (the limit)"
    elif ratio == _LIMIT_RATIO_MAX:
      text += " and more (twice the limit; '+' beyond)"
    items.append(
      figures.inline(
        figures.with_color("\u25a0 ", _color_css(_ratio_color(ratio))),
        text + "  ",
      )
    )
  return figures.inline("colour scale: ", *items)


def _count_table(counts: np.ndarray, num_sc_per_device: int) -> list[str]:
  """`[local device, partition]` counts as text, grouped by device.

  Args:
    counts: int `[L, N]`: what each local (source) device sent each
      partition (shard), `p = d * S + c` for SparseCore `c` of device `d`.
    num_sc_per_device: S.

  Returns:
    A header line numbering the source devices, then a line per partition
    in device order, its count from each source device; the device is
    named on its first SparseCore's line (`"to device 1  SC 0:"`, then
    `"             SC 1:"`; `"to device 1:"` for one SparseCore).
  """
  local, n = counts.shape
  s = num_sc_per_device
  width = max(3, len(str(int(counts.max(initial=0)))), len(str(local - 1)))
  device_width = len(f"to device {n // s - 1}")
  labels = []
  for p in range(n):
    device = f"to device {p // s}" if p % s == 0 else ""
    sc = f"  SC {p % s}" if s > 1 else ""
    labels.append(f"{device:<{device_width}}{sc}:")
  head = "from local device"
  pad = max(len(head), *(len(label) for label in labels))
  lines = [f"{head:>{pad}}" + "".join(f" {d:>{width}}" for d in range(local))]
  for p, label in enumerate(labels):
    cells = "".join(f" {int(c):>{width}}" for c in counts[:, p])
    lines.append(f"{label:<{pad}}{cells}")
  return lines


def _limit_heatmap(
  counts: np.ndarray,
  limit: int,
  plan: plan_lib.Plan,
  pixels_per_cell: int,
) -> Figure:
  """`[partition x local device]` counts / limit on the fixed limit scale:
  a row per partition, grouped by the device it is on (as `_count_table`
  prints them), a column per local (source) device."""
  s, n = plan.num_sc_per_device, plan.num_shards
  local = counts.shape[0]
  return treescope.render_array(
    (counts.T / limit).reshape(n // s, s, local),
    rows=[1, 0],
    columns=[2],
    continuous=True,
    around_zero=False,
    vmin=0.0,
    vmax=_LIMIT_RATIO_MAX,
    trim_outliers=False,
    colormap=_limit_colormap(),
    axis_labels={
      0: f"to device ({n // s})",
      1: f"SparseCore ({s})",
      2: f"from local device ({local})",
    },
    axis_item_labels={
      0: [f"to device {d}" for d in range(n // s)],
      1: [f"SC {c}" for c in range(s)],
      2: [f"from local device {d}" for d in range(local)],
    },
    pixels_per_cell=pixels_per_cell,
  )


def _stack_stats_parts(
  stats: Any,
  stack: StackPlan,
  plan: plan_lib.Plan,
  pixels_per_cell: int,
) -> list[Any]:
  """One stack's summary line, then per count its heat map, colour scale
  and numbers, then the over-limit list."""
  spec, name = stack.spec, stack.name
  parts: list[Any] = [
    _heading(_treescope.stats_line(stats, name, spec, stack.coo_per_sc)),
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
    parts += [
      f"{title} per partition (a row each, by device) from each local "
      f"device (a column each), limit {limit}:",
      _side_by_side(
        _limit_heatmap(counts, limit, plan, pixels_per_cell),
        "\n".join(_count_table(counts, plan.num_sc_per_device)),
      ),
      _scale_legend(limit),
    ]
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
    A figure: per stack a summary line; for the ids and the unique ids a
    heat map `[partition x local device]` (partitions grouped by the
    device they are on) of count / limit on a fixed scale where red means
    over the limit, beside it the counts in the same layout as text, and
    the scale with the count of each colour; then the list of over-limit
    partitions.

  Raises:
    ValueError: If a stack of the stats is not in the specs.
  """
  names = list(stats.max_ids_per_partition) if stack is None else [stack]
  if not names:
    return _lines()
  plan = known_plan(embed_or_specs)
  if plan is None:
    if global_device_count is None or num_sc_per_device is None:
      global_device_count, num_sc_per_device = _topology_from_stats(
        stats, names[0]
      )
    plan = plan_of(embed_or_specs, global_device_count, num_sc_per_device)
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


def _edge_items(count: int, truncate: bool) -> np.ndarray:
  """The items of an axis of `count` that get a hover label: all when
  Treescope draws them all; else (`truncate`, more than twice
  `_LABELLED_EDGE_ROWS`) the ones at either end that it can draw."""
  items = np.arange(count)
  edge = _LABELLED_EDGE_ROWS
  if truncate and count > 2 * edge:
    items = np.concatenate([items[:edge], items[-edge:]])
  return items


def _item_labels(
  items: np.ndarray, count: int, label: Any
) -> list[str] | dict[int, str]:
  """`label(i)` for the `items` of an axis of `count` (`_edge_items`).

  A list when every item is labelled; else a mapping keyed by item:
  Treescope's hover text looks a label up by index (`lookup_table[row]` in
  its JavaScript), which a mapping serves as well as a list, and the HTML
  holds about a thousand labels rather than one per item (254,568 per shard
  in the DLRM benchmark: 8 MB).
  """
  labels = {int(i): label(int(i)) for i in items}
  return list(labels.values()) if len(items) == count else labels


def _row_labels(
  stack: StackPlan, owner: np.ndarray, truncate: bool
) -> list[str] | dict[int, str]:
  """Per row of a shard (those `_edge_items` keeps): its table and its row
  inside the table's block."""
  rows = _edge_items(owner.shape[1], truncate)
  tables = dict(zip(rows.tolist(), owner[:, rows].max(axis=0), strict=True))

  def label(r: int) -> str:
    k = tables[r]
    table = stack.tables[k] if k >= 0 else None
    start = table.setting_in_stack.row_offset_in_shard if table else 0
    name = table.name if table else "padding"
    return f"{name} (row {r - start} of its block)"

  return _item_labels(rows, owner.shape[1], label)


def _drawn_sizes(shape: Sequence[int], truncate: bool) -> tuple[int, ...]:
  """How many items of each axis `render_array` draws of an array of
  `shape`: all, or (`truncate`, with `_TRUNCATION`) its edge items at
  either end and one cell for the gap."""
  if not truncate:
    return tuple(shape)
  edges = arrayviz_impl.infer_balanced_truncation(tuple(shape), **_TRUNCATION)
  return tuple(
    size if edge is None else 2 * edge + 1
    for size, edge in zip(shape, edges, strict=True)
  )


def _side_by_side(*parts: Any) -> Figure:
  """`parts` in a row, wrapping to the next line where the row is full (a
  notebook cell or a page never scrolls sideways)."""
  return figures.figure_from_treescope_rendering_part(
    rendering_parts.custom_style(
      rendering_parts.siblings(
        *(figures.treescope_part_from_display_object(p) for p in parts)
      ),
      "display: flex; flex-wrap: wrap; align-items: flex-start; "
      "column-gap: 2ch",
    )
  )


def _values_and_devices(
  values: Any,
  devices: np.ndarray,
  *,
  rows: Sequence[int],
  columns: Sequence[int],
  truncate: bool,
  axis_labels: dict[int, str],
  axis_item_labels: dict[int, Any],
  device_labels: dict[int, str],
  valid_mask: np.ndarray | None = None,
  pixels_per_cell: int = 7,
) -> Figure:
  """Values and the devices holding them, in one layout, cell for cell.

  Both pictures draw an array of the values' shape with the same rows,
  columns, truncation (Treescope's depends on the shape alone), labels and
  cell size: the values, and the digitbox of the devices holding each cell
  (`devices`, broadcast to that shape: as Treescope's sharding view draws a
  device `d`, `d + 1`, with `device_labels` on hover).

  Args:
    values: A positional `[...]` array (a sharded `jax.Array`).
    devices: Digitbox values, broadcastable to the values' shape.
    rows: The axes down the pictures, innermost first.
    columns: The axes across, innermost first.
    truncate: Let Treescope truncate both alike.
    axis_labels: Axis -> label.
    axis_item_labels: Axis -> hover label of each item.
    device_labels: Digitbox value -> the devices it stands for.
    valid_mask: Cells of the values drawn as real (broadcastable; the
      others dotted grey, as Treescope marks missing data).
    pixels_per_cell: Cell size of both pictures.

  Returns:
    The two pictures side by side (the second below the first where a row
    has no room for both).
  """
  common = dict(
    rows=rows,
    columns=columns,
    truncate=truncate,
    axis_labels=axis_labels,
    axis_item_labels=axis_item_labels,
    pixels_per_cell=pixels_per_cell,
    **_TRUNCATION,
  )
  value_image = treescope.render_array(values, valid_mask=valid_mask, **common)
  device_image = treescope.render_array(
    np.broadcast_to(devices, values.shape),
    continuous=False,
    value_item_labels=device_labels,
    **common,
  )
  return _side_by_side(value_image, device_image)


def _table_values_parts(
  embed: Any, stack: StackPlan, truncate: bool
) -> list[Any]:
  """One stack's heading, values and devices (cell for cell), legends."""
  from pz_sparsecore.nn.tables import ROW_AXIS, SHARD_AXIS, positional_table

  config = embed.config
  n = config.plan.num_shards
  var = embed.tables[stack.name]
  if isinstance(var, pz.ParameterSlot):
    raise ValueError(
      f"stack {stack.name!r}: the table is an unbound {type(var).__name__}; "
      "build the layer with an init_base_rng or restore a checkpoint first"
    )
  value = positional_table(config, var.value)
  owner = _owner_index(stack, n)
  shard_values, labels = _device_values(embed, config.plan, stack)
  shards, _, width = _drawn_sizes(value.shape, truncate)
  # The shards side by side, as many cells across as fit the width.
  pixels = _VALUES_WIDTH_PX // (shards * (width + 1))
  picture = _values_and_devices(
    value,
    np.asarray(shard_values, np.int64)[:, None, None],
    rows=[1],
    columns=[2, 0],
    truncate=truncate,
    axis_labels={
      0: f"{SHARD_AXIS} ({n})",
      1: f"{ROW_AXIS} ({stack.rows_per_shard})",
      2: f"{config.embedding_axis} ({stack.dim})",
    },
    axis_item_labels={1: _row_labels(stack, owner, truncate)},
    device_labels=labels,
    valid_mask=(owner >= 0)[:, :, None],
    pixels_per_cell=min(max(pixels, 1), _PIXELS_PER_CELL_RANGE[0]),
  )
  return [
    _heading(
      f"stack {stack.name!r}: {config.table_label(stack.name)} "
      f"[{n} shards x {stack.rows_per_shard} rows x {stack.dim}]"
    ),
    *_replicated_note(embed, stack.name),
    "the values, a panel per shard (hover a row for its table; dotted grey:"
    " padding rows),",
    "and in the same layout, cell for cell, the device holding each cell:",
    picture,
    *device_legend(labels),
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
    A figure: per stack a heading, the `[N, V_shard, D]` values (a panel
    per shard, its rows down and the embedding across; hover a row for its
    table and its row in the table's block; padding rows dotted grey) and,
    beside them in the same layout, cell for cell, the device holding each
    cell (Treescope's device colours: device `d` is the digitbox of
    `d + 1`), with the device and table legends. The two pictures sit side
    by side where the cell is wide enough, else one below the other.

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
  plan = known_plan(context)
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
    plan = known_plan(context)
    summary = _treescope.inputs_summary(obj)
    details = _treescope.inputs_details(
      obj, None if plan is None else plan.num_shards
    )
  elif isinstance(obj, preprocess.SparseDenseMatmulInputStats):
    summary = _treescope.stats_summary(obj)
    details = _treescope.stats_details(obj, *_stats_context(context))
  elif isinstance(obj, embed_class()):
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
