"""Treescope views of stacked, MOD-sharded tables and their inputs.

Rendering a `SparseCoreEmbed`, a `PreprocessedInput`, a
`SparseDenseMatmulInputStats` or a spec with Treescope (`treescope.show`,
`pz.show`, `treescope.render_to_html`) gives a one-line summary that expands
into per-stack details and the usual attribute tree (see `_treescope`).
This module adds the figures; each returns a `TreescopeFigure`, displayable
in a notebook (`_repr_html_`) and turned into a standalone HTML fragment by
`to_html`:

* `shard_map_figure`: per stack, an image of `[devices x SparseCores]` rows
  (one per shard, in shard-major order, grouped by device) by the `V_shard`
  rows of a shard, coloured by the member table that owns each row, with
  padding rows in grey, and a legend (table, vocabulary, rows per shard,
  rotation). Since every table occupies the same block of rows in every
  shard, tables appear as vertical bands; padding shows where
  `padded_vocab_size` exceeds the vocabulary. Treescope's own sharding view
  cannot draw MOD sharding (its shards must be contiguous blocks); this
  figure draws the physical order instead.
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

Example::

  embed = SparseCoreEmbed.from_config("emb", key, specs, mesh)
  viz.shard_map_figure(embed)          # in a notebook
  html = viz.to_html(viz.stats_heatmap(stats, embed))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import treescope
from penzai import pz
from treescope import figures, rendering_parts

from pz_sparsecore import _treescope, layout, preprocess
from pz_sparsecore.specs import FeatureSpec, StackedTableSpec, TableSpec

Figure = Any  # treescope's `TreescopeFigure` (not exported publicly).

TABLE_COLORS: tuple[tuple[int, int, int], ...] = (
  (31, 119, 180),
  (255, 127, 14),
  (44, 160, 44),
  (148, 103, 189),
  (23, 190, 207),
  (227, 119, 194),
  (188, 189, 34),
  (140, 86, 75),
)
"""Colours of the member tables of a stack, in row order (cycled)."""

PADDING_COLOR = (210, 210, 210)
"""Colour of padding rows."""

MAX_COLUMNS = 512
"""Widest `shard_map_figure` image; longer shards are drawn in bins."""

_LIMIT_RATIO_MAX = 2.0
_UNDER_LIMIT_COLORS = ((26, 152, 80), (145, 207, 96), (254, 224, 139))
_OVER_LIMIT_COLORS = ((244, 109, 67), (165, 0, 38))


# ---------------------------------------------------------------------------
# Inputs.


def _resolve(
  embed_or_specs: Any,
  global_device_count: int | None,
  num_sc_per_device: int | None,
) -> tuple[tuple[FeatureSpec, ...], int, int]:
  """(prepared feature specs, G, S) from a layer or from specs + topology."""
  config = getattr(embed_or_specs, "config", None)
  if config is not None and hasattr(config, "topology"):
    topo = config.topology
    return config.feature_specs, topo.num_devices, topo.num_sc_per_device
  if global_device_count is None or num_sc_per_device is None:
    raise ValueError(
      "pass a SparseCoreEmbed, or feature specs together with "
      "global_device_count and num_sc_per_device"
    )
  prepared = layout.prepare_feature_specs_for_training(
    embed_or_specs, global_device_count, num_sc_per_device
  )
  return (
    tuple(jax.tree.leaves(prepared)),
    global_device_count,
    num_sc_per_device,
  )


def _stack_names(specs: Sequence[FeatureSpec], stack: str | None) -> list[str]:
  names = list(layout.get_stacked_table_specs(specs))
  if stack is None:
    return names
  if stack not in names:
    raise ValueError(f"unknown stack {stack!r}; the stacks are {names}")
  return [stack]


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


def shard_table_index(
  feature_specs: Any, num_shards: int, stack: str
) -> np.ndarray:
  """Which member table owns each physical row of a stack.

  Args:
    feature_specs: Prepared feature specs.
    num_shards: N = devices x SparseCores.
    stack: The stack's name.

  Returns:
    int32 `[N, V_shard]`: the index of the owning table in row order
    (`layout.get_table_stacks`), or -1 for a padding row.
  """
  spec = layout.get_stacked_table_specs(feature_specs)[stack]
  members = layout.get_table_stacks(feature_specs)[stack]
  owner = np.full(spec.stack_vocab_size, -1, np.int32)
  for k, table in enumerate(members):
    ids = np.arange(table.vocabulary_size)
    owner[layout.physical_row_ids(table, ids, num_shards)] = k
  return owner.reshape(num_shards, -1)


def _table_legend(
  members: Sequence[TableSpec], num_shards: int
) -> list[Figure]:
  items = []
  for k, table in enumerate(members):
    setting = table.setting_in_stack
    rows = setting.padded_vocab_size // num_shards
    start = setting.row_offset_in_shard
    color = TABLE_COLORS[k % len(TABLE_COLORS)]
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
      figures.with_color("\u25a0 ", _color_css(PADDING_COLOR)), "padding"
    )
  )
  return items


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
    embed_or_specs: A `SparseCoreEmbed`, or a pytree of feature specs (then
      `global_device_count` and `num_sc_per_device` are required; unstacked
      tables are prepared as one-table stacks).
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: SparseCores per device.
    stack: Only this stack; all by default.
    max_columns: Shards longer than this are drawn in bins of rows; a bin
      shows padding if it holds any, else the last table in it.
    pixels_per_cell: Cell size of the images.

  Returns:
    A figure: per stack a heading, the `[device, SparseCore] x row` image and
    the legend.

  Raises:
    ValueError: On an unknown stack or missing topology.
  """
  specs, g, s = _resolve(embed_or_specs, global_device_count, num_sc_per_device)
  n = layout.num_shards(g, s)
  stacks = layout.get_stacked_table_specs(specs)
  parts: list[Any] = []
  for name in _stack_names(specs, stack):
    members = layout.get_table_stacks(specs)[name]
    owner = shard_table_index(specs, n, name)
    padding = len(members)
    values = np.where(owner < 0, padding, owner)
    v_shard = values.shape[1]
    step = -(-v_shard // max_columns)
    if step > 1:
      cols = -(-v_shard // step)
      binned = np.full((n, cols * step), padding, values.dtype)
      binned[:, :v_shard] = values
      values = binned.reshape(n, cols, step).max(axis=2)
    row_label = "row in shard" + (f" (bins of {step})" if step > 1 else "")
    colormap = [TABLE_COLORS[k % len(TABLE_COLORS)] for k in range(padding)]
    colormap.append(PADDING_COLOR)
    image = treescope.render_array(
      values.reshape(g, s, -1),
      rows=[1, 0],
      columns=[2],
      continuous=False,
      colormap=colormap,
      value_item_labels={
        **{k: t.name for k, t in enumerate(members)},
        padding: "padding",
      },
      axis_labels={0: f"device ({g})", 1: f"SparseCore ({s})", 2: row_label},
      pixels_per_cell=pixels_per_cell,
    )
    spec = stacks[name]
    parts += [
      _heading(
        f"stack {name!r}: {n} shards ({g} devices x {s} SC), "
        f"{v_shard} rows/shard x {spec.stack_embedding_dim}"
      ),
      image,
      *_table_legend(members, n),
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
    embed_or_specs: A `SparseCoreEmbed`, or feature specs plus topology.
    table: The logical table's name.
    ids: Logical rows; all rows by default.
    global_device_count: Devices (with feature specs).
    num_sc_per_device: SparseCores per device (with feature specs).

  Returns:
    Arrays shaped like `ids`: "id", "shard", "device", "sparsecore",
    "row_in_shard" and "physical_row" (flat row of the `[N * V_shard, D]`
    stack).

  Raises:
    ValueError: On an unknown table or an id outside the vocabulary.
  """
  specs, g, s = _resolve(embed_or_specs, global_device_count, num_sc_per_device)
  n = layout.num_shards(g, s)
  tables = layout.get_table_specs(specs)
  if table not in tables:
    raise ValueError(f"unknown table {table!r}; the tables are {list(tables)}")
  spec = tables[table]
  ids = np.arange(spec.vocabulary_size) if ids is None else np.asarray(ids)
  physical = layout.physical_row_ids(spec, ids, n)
  v_shard = spec.stacked_table_spec.stack_vocab_size // n
  shard = physical // v_shard
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
    embed_or_specs: A `SparseCoreEmbed`, or feature specs plus topology.
    table: The logical table's name.
    num_rows: Rows shown in the image (the first ones).
    num_listed: Rows listed in the text table below the image.
    global_device_count: Devices (with feature specs).
    num_sc_per_device: SparseCores per device (with feature specs).

  Returns:
    A figure: a heading, an image `[rows]` of owner shards (hover for the
    device, SparseCore and row) and a table of the first rows.
  """
  specs, g, s = _resolve(embed_or_specs, global_device_count, num_sc_per_device)
  spec = layout.get_table_specs(specs).get(table)
  if spec is None:
    raise ValueError(f"unknown table {table!r}")
  count = min(num_rows, spec.vocabulary_size)
  place = row_placement(specs, table, np.arange(count), **_topo(g, s))
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
  n = g * s
  return _lines(
    _heading(
      f"table {table!r} in stack {setting.stack_name!r}: row i on shard "
      f"(i % {n} + {setting.shard_rotation}) % {n}, at row "
      f"{setting.row_offset_in_shard} + i // {n}"
    ),
    image,
    header,
    *rows,
  )


def _topo(g: int, s: int) -> dict[str, int]:
  return {"global_device_count": g, "num_sc_per_device": s}


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


def _stats_topology(
  stats: Any,
  stack: str,
  embed_or_specs: Any,
  global_device_count: int | None,
  num_sc_per_device: int | None,
) -> tuple[int, int]:
  """(G, S), inferring a single-process topology from the stats if needed."""
  config = getattr(embed_or_specs, "config", None)
  if config is not None and hasattr(config, "topology"):
    return config.topology.num_devices, config.topology.num_sc_per_device
  if global_device_count is not None and num_sc_per_device is not None:
    return global_device_count, num_sc_per_device
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
    embed_or_specs: A `SparseCoreEmbed` or prepared feature specs.
    global_device_count: Devices (with feature specs; inferred from the
      stats for a single process when omitted).
    num_sc_per_device: SparseCores per device (likewise).
    stack: Only this stack; all by default.
    pixels_per_cell: Cell size of the images.

  Returns:
    A figure: per stack a summary line, two heat maps `[local device x
    partition]` of count / limit (ids, unique ids) on a fixed scale where
    red means over the limit, and the list of over-limit partitions.
  """
  specs = getattr(
    getattr(embed_or_specs, "config", None), "feature_specs", None
  )
  specs = embed_or_specs if specs is None else specs
  stacks = layout.get_stacked_table_specs(specs)
  names = list(stats.max_ids_per_partition) if stack is None else [stack]
  colormap = _limit_colormap()
  parts: list[Any] = []
  for name in names:
    if name not in stacks:
      raise ValueError(f"stats stack {name!r} is not in the feature specs")
    spec = stacks[name]
    g, s = _stats_topology(
      stats, name, embed_or_specs, global_device_count, num_sc_per_device
    )
    n = layout.num_shards(g, s)
    buffer = preprocess.compute_coo_buffer_size_per_device(specs, g, s)[name]
    details = _treescope.stats_details(stats, stacks, {name: buffer // s})
    parts.append(
      _heading(
        dict(zip(stats.max_ids_per_partition, details, strict=True))[name]
      )
    )
    over = []
    for title, counts, limit in (
      (
        "ids",
        stats.max_ids_per_partition[name],
        spec.max_ids_per_partition,
      ),
      (
        "unique ids",
        stats.max_unique_ids_per_partition[name],
        spec.max_unique_ids_per_partition,
      ),
    ):
      counts = np.asarray(counts).reshape(-1, n)
      parts.append(f"{title} per partition / limit {limit}:")
      parts.append(
        treescope.render_array(
          counts / limit,
          rows=[0],
          columns=[1],
          continuous=True,
          around_zero=False,
          vmin=0.0,
          vmax=_LIMIT_RATIO_MAX,
          trim_outliers=False,
          colormap=colormap,
          axis_labels={
            0: f"local device ({counts.shape[0]})",
            1: f"partition ({n})",
          },
          axis_item_labels={
            1: [f"device {p // s}, SC {p % s}" for p in range(n)]
          },
          pixels_per_cell=pixels_per_cell,
        )
      )
      over += [
        f"{title}: {line}" for line in over_limit_partitions(counts, limit, s)
      ]
    if over:
      parts.append(figures.with_color(f"OVER LIMIT ({len(over)}):", "red"))
      parts += over
    else:
      parts.append("all partitions within the limits")
  return _lines(*parts)


# ---------------------------------------------------------------------------
# Table values.


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
    ValueError: If the tables are unbound `ParameterSlot`s.
  """
  from pz_sparsecore.nn.embed import ROW_AXIS, SHARD_AXIS

  config = embed.config
  n = config.topology.num_shards
  parts: list[Any] = []
  for name in _stack_names(config.feature_specs, stack):
    var = embed.tables[name]
    if isinstance(var, pz.ParameterSlot):
      raise ValueError(
        f"stack {name!r}: the table is an unbound {type(var).__name__}; "
        "build the layer with an init_base_rng or restore a checkpoint first"
      )
    value = var.value
    owner = shard_table_index(config.feature_specs, n, name)
    members = layout.get_table_stacks(config.feature_specs)[name]
    row_labels = []
    for r in range(owner.shape[1]):
      k = owner[:, r].max()
      start = members[k].setting_in_stack.row_offset_in_shard if k >= 0 else 0
      label = members[k].name if k >= 0 else "padding"
      row_labels.append(f"{label} (row {r - start} of its block)")
    parts += [
      _heading(
        f"stack {name!r}: {config.table_label(name)} "
        f"[{n} shards x {owner.shape[1]} rows x "
        f"{config.stacks[name].stack_embedding_dim}]"
      ),
      treescope.render_array(
        value,
        rows=[ROW_AXIS],
        columns=[config.embedding_axis, SHARD_AXIS],
        truncate=truncate,
        axis_item_labels={ROW_AXIS: row_labels},
      ),
      "device sharding:",
      treescope.render_array_sharding(
        value, rows=[SHARD_AXIS], columns=[config.embedding_axis, ROW_AXIS]
      ),
      *_table_legend(members, n),
    ]
  return _lines(*parts)


# ---------------------------------------------------------------------------
# Text and HTML.


def describe(obj: Any, context: Any = None) -> str:
  """A plain-text summary (the Treescope summary plus its detail lines).

  Args:
    obj: A `SparseCoreEmbed`, `PreprocessedInput`,
      `SparseDenseMatmulInputStats`, `TableSpec`, `FeatureSpec` or
      `StackedTableSpec`.
    context: For stats, the `SparseCoreEmbed` (or prepared feature specs) to
      compare against its limits and buffer sizes; for inputs, the layer (for
      its number of shards).

  Returns:
    Lines of text, the first `Type(summary)`, the others indented by two.

  Raises:
    TypeError: For other objects.
  """
  kind = type(obj).__name__
  config = getattr(context, "config", None)
  if isinstance(obj, (TableSpec, FeatureSpec, StackedTableSpec)):
    return f"{kind}({_treescope.spec_summary(obj)})"
  if isinstance(obj, preprocess.PreprocessedInput):
    n = config.topology.num_shards if config is not None else None
    summary = _treescope.inputs_summary(obj)
    details = _treescope.inputs_details(obj, n)
  elif isinstance(obj, preprocess.SparseDenseMatmulInputStats):
    summary = _treescope.stats_summary(obj)
    stacks = buffers = None
    if context is not None:
      specs = context if config is None else config.feature_specs
      stacks = layout.get_stacked_table_specs(specs)
      if config is not None:
        topo = config.topology
        g, s = topo.num_devices, topo.num_sc_per_device
        sizes = preprocess.compute_coo_buffer_size_per_device(specs, g, s)
        buffers = {k: v // s for k, v in sizes.items()}
    details = _treescope.stats_details(obj, stacks, buffers)
  elif hasattr(obj, "config") and hasattr(obj, "tables"):
    summary = _treescope.embed_summary(obj)
    details = _treescope.embed_details(obj)
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


__all__ = [
  "MAX_COLUMNS",
  "PADDING_COLOR",
  "TABLE_COLORS",
  "describe",
  "over_limit_partitions",
  "row_owner_figure",
  "row_placement",
  "shard_map_figure",
  "shard_table_index",
  "stats_heatmap",
  "table_values_figure",
  "to_html",
]
