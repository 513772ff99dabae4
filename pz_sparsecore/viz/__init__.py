"""Figures of how tables are laid out, and Treescope renderers.

`figures` draws which rows of which logical table live on which device and
SparseCore, tables in vocabulary order, and the per-partition id counts
against the limits, each table in its own colour from `palette`;
`vocabulary` shows a table of a `SparseCoreLookup` or a
`SparseCoreEmbed` in vocabulary order, as Penzai's `EmbeddingTable` holds it
(`vocabulary_view`; `vocabulary_view_figure` draws it with its ids and the
devices holding them); `placement` draws a table's ids in vocabulary
order coloured by the device holding them (`placement_figure`, also in a
layer's Treescope view); `treescope` renders the package's objects (specs,
plans, buffers, stats, layers) as compact Treescope summaries: it
registers the renderers of the `core` types with Treescope when imported
(which `import pz_sparsecore` arranges before any rendering), and `nn`'s
layers import it lazily from their `__treescope_repr__` hooks.
"""

from __future__ import annotations

from pz_sparsecore.viz.figures import (
  MAX_COLUMNS,
  describe,
  over_limit_partitions,
  row_owner_figure,
  row_placement,
  shard_map_data,
  shard_map_figure,
  shard_table_index,
  stats_heatmap,
  table_values_figure,
  to_html,
)
from pz_sparsecore.viz.palette import (
  DEVICE_COLORS,
  PADDING_COLOR,
  TABLE_COLORS,
  device_colors,
  table_colors,
)
from pz_sparsecore.viz.placement import placement_figure, placement_grid
from pz_sparsecore.viz.vocabulary import vocabulary_view, vocabulary_view_figure

__all__ = [
  "DEVICE_COLORS",
  "MAX_COLUMNS",
  "PADDING_COLOR",
  "TABLE_COLORS",
  "describe",
  "device_colors",
  "over_limit_partitions",
  "placement_figure",
  "placement_grid",
  "row_owner_figure",
  "row_placement",
  "shard_map_data",
  "shard_map_figure",
  "shard_table_index",
  "stats_heatmap",
  "table_colors",
  "table_values_figure",
  "to_html",
  "vocabulary_view",
  "vocabulary_view_figure",
]
