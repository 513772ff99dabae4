"""The views of the DLRM benchmark's layer: 26 tables in one stack.

The layer is built as `benchmarks/dlrm.py`'s `run_ours` builds it: 26
tables of dimension 16 (four of 100,000 to 1,000,000 rows, 22 of 10 to
10,000), Adagrad, combiner mean, `SparseCoreEmbed.from_config` over 8
devices, which stacks them into one stack of 254,568 rows per shard. Its
HTML took 33 MB (every summarized level held its attributes twice, and the
plan holds each spec three times), its table values 8 MB (a hover label per
row), and its shard map coloured 26 tables with 8 colours in bins where the
22 small tables did not show.

The shard map is checked against the arrays Treescope draws, read back from
the HTML (each array's JSON: values, colours, hover labels; Treescope 0.1),
and against the MOD-sharding rule (`layout.py`): id i of a table with
rotation r lives on shard `(i % N + r) % N`, at row `start + i // N`.
"""

from __future__ import annotations

import pathlib
import re
import sys

import jax
import numpy as np
import pytest
from treescope_arrays import drawn_arrays as _drawn_arrays
from treescope_arrays import lookup_tables as _lookup_tables
from treescope_arrays import values as _values

from pz_sparsecore.nn import SparseCoreEmbed
from pz_sparsecore.viz import figures as viz
from pz_sparsecore.viz.palette import DEVICE_COLORS

# The layer of the DLRM benchmark, built from its own specs.
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))
import dlrm  # noqa: E402

NUM_DEVICES = 8

MAX_HTML_BYTES = 2_000_000


@pytest.fixture(scope="module")
def dlrm_embed():
  features = dlrm.feature_specs()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("device",))
  assert mesh.size == NUM_DEVICES
  return SparseCoreEmbed.from_config("emb", jax.random.key(0), features, mesh)


@pytest.fixture(scope="module")
def stack(dlrm_embed):
  (stack,) = dlrm_embed.config.plan.stacks
  assert len(stack.tables) == len(dlrm.VOCABS)
  return stack


def _legend_colors(html: str) -> dict[str, tuple[int, ...]]:
  """Legend entry (table name or "padding") -> its swatch's colour."""
  found = re.findall(
    r'<span style="color: rgb\((\d+) (\d+) (\d+)\)">\u25a0 </span>'
    r"(t\d\d|padding)",
    html,
  )
  return {name: tuple(map(int, rgb)) for *rgb, name in found}


def test_layer_html_is_small_and_shows_the_layer(dlrm_embed, stack):
  html = viz.to_html(dlrm_embed)
  assert len(html) < MAX_HTML_BYTES, len(html)  # 33 MB before.
  assert "26 features, stacks t00_and_25_more[254568 rows/shard x 16]" in html
  for t, v in enumerate(dlrm.VOCABS):
    assert f"t{t:02d}: vocab {v} x 16, rows [" in html
  assert "arrayviz" in html  # The table and slot arrays.
  # Every spec in full once, the plan's second and third copies one line.
  for t in range(len(dlrm.VOCABS)):
    first = f".config.plan.feature_specs[{t}]"
    assert f'data-copy="{first}.table_spec.vocabulary_size"' in html
    assert f"shown at {first}.table_spec" in html
  assert len(viz.to_html(dlrm_embed.config.plan)) < MAX_HTML_BYTES


def test_table_values_html_is_small(dlrm_embed, stack):
  html = viz.to_html(viz.table_values_figure(dlrm_embed))
  assert len(html) < MAX_HTML_BYTES, len(html)  # 8 MB before.
  (values, _) = _drawn_arrays(html)[:2]
  (labels,) = _lookup_tables(values, "axis_lookup")
  # Hover labels for the rows Treescope draws, at both ends of a shard;
  # t25 (10,000 ids, 1,250 per shard) starts at row 253,312.
  assert labels["0"] == "t00 (row 0 of its block)"
  assert labels[str(253_312 + 744)] == "t25 (row 744 of its block)"
  assert len(labels) <= 1024


def _reference_cell(stack, starts, ends, num_shards):
  """Expected table index (or -1) of each shard's cells, from the MOD rule:
  a cell shows a table if one of its rows holds an id of it."""
  expected = np.full((num_shards, len(starts)), -1)
  for k, table in enumerate(stack.tables):
    setting = table.setting_in_stack
    ids = np.arange(table.vocabulary_size)
    shard = (ids % num_shards + setting.shard_rotation) % num_shards
    row = setting.row_offset_in_shard + ids // num_shards
    cell = np.searchsorted(starts, row, side="right") - 1
    assert (row < ends[cell]).all()
    assert np.isin(expected[shard, cell], (-1, k)).all(), "two tables"
    expected[shard, cell] = k
  return expected


def test_shard_map_tells_every_table_apart(dlrm_embed, stack):
  html = viz.to_html(viz.shard_map_figure(dlrm_embed))
  assert len(html) < MAX_HTML_BYTES
  (image,) = _drawn_arrays(html)
  # [device, SparseCore, bar, cell]: one bar per shard (8 x 1), each its
  # device's cell, a blank, then the shard's cells.
  cells = _values(image)
  assert cells.shape[:3] == (NUM_DEVICES, 1, 1)
  cells = cells.reshape(NUM_DEVICES, -1)
  devices, values = cells[:, 0], cells[:, 2:]
  padding = len(stack.tables)

  # Colours: one per table, all different, padding grey; the legend's
  # swatches are the image's colours, and hovering a cell names its table
  # and the ids it holds.
  colormap = [tuple(c) for c in image["colormapConfig"]["cmapData"]]
  (labels,) = _lookup_tables(image, "value_lookup")
  legend = _legend_colors(html)
  palette = [*(legend[t.name] for t in stack.tables), legend["padding"]]
  assert len(set(palette)) == padding + 1
  assert len(set(palette[padding])) == 1  # r = g = b: grey.
  assert "past its vocabulary, and rows of a shard past its tables" in html
  shown = np.vectorize(lambda v: palette.index(colormap[v]))(values)
  for v, k in zip(values.ravel(), shown.ravel(), strict=True):
    name = stack.tables[k].name if k < padding else "padding"
    assert labels[str(v)].startswith(name), (labels[str(v)], name)

  # The device cells: device d in Treescope's colour for it (digit d + 1).
  assert [colormap[v] for v in devices] == list(DEVICE_COLORS)[:NUM_DEVICES]
  assert [labels[str(v)] for v in devices] == [
    f"CPU {d}" for d in range(NUM_DEVICES)
  ]

  # Bands: at most MAX_COLUMNS cells, covering the shard's rows in order.
  assert values.shape[1] <= viz.MAX_COLUMNS
  (axis,) = [
    t for t in _lookup_tables(image, "axis_lookup") if t[0] == "device"
  ]
  edges = np.array(
    [re.fullmatch(r"rows \[(\d+), (\d+)\)", b).groups() for b in axis[2:]],
    int,
  )
  starts, ends = edges[:, 0], edges[:, 1]
  assert starts[0] == 0 and ends[-1] == stack.rows_per_shard
  np.testing.assert_array_equal(starts[1:], ends[:-1])

  # Each cell shows the table of its rows, or padding if none holds an id;
  # every table shows on every shard, and padding shows (t04: 10 ids in 8
  # rows of each of 8 shards).
  expected = _reference_cell(stack, starts, ends, NUM_DEVICES)
  np.testing.assert_array_equal(
    shown, np.where(expected < 0, padding, expected)
  )
  for shard in shown:
    assert set(shard) == set(range(padding + 1))
