"""Tests of the Treescope summaries and figures (`viz`, `_treescope`)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import chromium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import treescope
import treescope_arrays as arrays
from penzai import pz
from treescope import layout_algorithms, lowering, rendering_parts

from pz_sparsecore.core import layout, specs
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.host.preprocess import PAD_ID, SparseDenseMatmulInputStats
from pz_sparsecore.nn import SparseCoreEmbed
from pz_sparsecore.nn.lookup import SparseCoreLookup
from pz_sparsecore.viz import figures as viz
from pz_sparsecore.viz import palette, vocabulary, vocabulary_view

NUM_DEVICES = 4
BATCH = 16
VALENCY = 3

README_FIGURE_DATA = (
  pathlib.Path(__file__).resolve().parent.parent
  / "docs"
  / "images"
  / "shakespeare.json"
)


def _init(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, dtype)


def _features(limit=None, batch=BATCH):
  opt = specs.AdagradOptimizerSpec(learning_rate=0.1)
  tb = specs.TableSpec(
    name="tb",
    vocabulary_size=70,
    embedding_dim=8,
    initializer=_init,
    optimizer=opt,
    combiner="sum",
  )
  ta = specs.TableSpec(
    name="ta",
    vocabulary_size=40,
    embedding_dim=4,
    initializer=_init,
    optimizer=opt,
    combiner="sum",
  )
  features = {
    "fa": specs.FeatureSpec(
      name="fa",
      table_spec=ta,
      input_shape=(batch, VALENCY),
      output_shape=(batch, 4),
    ),
    "fb": specs.FeatureSpec(
      name="fb",
      table_spec=tb,
      input_shape=(batch, VALENCY),
      output_shape=(batch, 8),
    ),
  }
  kwargs = {}
  if limit is not None:
    kwargs = dict(
      stack_to_max_ids_per_partition=lambda name, count: limit,
      stack_to_max_unique_ids_per_partition=lambda name, count: limit,
    )
  return features, lambda g, s: layout.stack_tables(
    features, ["tb", "ta"], g, s, rotation=1, stack_name="tb_ta", **kwargs
  )


def _mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("device",))


@pytest.fixture(scope="module")
def embed():
  _, stacked = _features()
  return SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), stacked(NUM_DEVICES, 1), _mesh()
  )


@pytest.fixture(scope="module")
def ids():
  rng = np.random.default_rng(0)
  return {
    "fa": rng.integers(0, 40, (BATCH, VALENCY)),
    "fb": rng.integers(0, 70, (BATCH, VALENCY)),
  }


def _text(obj, depth):
  part = treescope.active_renderer.get().to_foldable_representation(obj)
  part = rendering_parts.build_full_line_with_annotations(part)
  layout_algorithms.expand_to_depth(part, depth)
  return lowering.render_to_text_as_root(part)


def _figure_text(figure):
  return lowering.render_to_text_as_root(figure.treescope_part)


SUMMARY = (
  "SparseCoreEmbed('emb': 2 features, stacks tb_ta[40 rows/shard x 8]; "
  "4 devices x 1 SC on 'device')"
)

DESCRIPTION = """\
SparseCoreEmbed('emb': 2 features, stacks tb_ta[40 rows/shard x 8]; \
4 devices x 1 SC on 'device')
  mesh axes: sc_shard -> 'device'; batch -> 'device'; embedding -> replicated
  stack 'tb_ta': 4 shards x 40 rows x 8, adagrad(lr=0.1), sum, 32 samples, \
limits ids 256 / unique 256
    tb: vocab 70 x 8, rows [0, 24) of each shard, rotation 0; features fb
    ta: vocab 40 x 4, rows [24, 40) of each shard, rotation 1; features fa
    placement: sharded over 'device'
    exchange: activations (chosen): 69.6 KB per device per step with rows, \
14.4 KB with activations"""


# ---------------------------------------------------------------------------
# Summaries.


def test_embed_collapsed_is_one_line_summary(embed):
  assert _text(embed, 0) == SUMMARY
  assert repr(embed) == SUMMARY  # pz.Struct's repr: treescope on one line.


def test_embed_expanded_shows_stacks_and_variables(embed):
  text = _text(embed, 1)
  assert text.startswith(f"SparseCoreEmbed(  # {SUMMARY[16:-1]}\n")
  assert "  #   ta: vocab 40 x 4, rows [24, 40) of each shard, rotation 1" in (
    text
  )
  assert "tables={'tb_ta': Parameter(label='emb/tb_ta.embeddings'" in text
  assert "sc_shard:4, sc_row:40, embedding:8" in text
  assert "'accumulator': StateVariable(" in text


def test_describe_embed_golden(embed):
  assert viz.describe(embed) == DESCRIPTION


def test_embed_with_parameter_slots():
  _, stacked = _features()
  slots = SparseCoreEmbed.from_config(
    "emb", None, stacked(NUM_DEVICES, 1), _mesh()
  )
  assert _text(slots, 0) == SUMMARY
  assert "ParameterSlot(label='emb/tb_ta.embeddings')" in _text(slots, 1)
  assert "rotation 1" in viz.to_html(slots)
  with pytest.raises(ValueError, match="unbound ParameterSlot"):
    viz.table_values_figure(slots)


def test_embed_html_has_summary_and_array_views(embed):
  html = viz.to_html(embed)
  assert "tb_ta[40 rows/shard x 8]" in html
  assert "rows [24, 40) of each shard" in html
  assert "arrayviz" in html
  assert "Sharded across 4" in html


def test_each_attribute_is_rendered_once(embed):
  # A summarized node (layer, plan, spec) holds each attribute line once,
  # shown when expanded or in roundtrip mode: a copy per case doubled the
  # HTML at every level (32 copies of the stack's vocabulary size here).
  html = viz.to_html(embed)
  path = ".config.plan.feature_specs[0].table_spec.stacked_table_spec"
  assert html.count(f'data-copy="{path}.stack_vocab_size"') == 1


def test_repeated_specs_point_to_their_first_rendering(embed):
  text = _text(embed, 20)
  first = ".config.plan.feature_specs"
  # The plan's stacks hold the specs of `feature_specs` again: one line each.
  assert (
    "TableSpec('ta': 40 x 4, adagrad(lr=0.1), sum; in 'tb_ta' at row 24, "
    f"rotation 1),  # shown at {first}[0].table_spec"
  ) in text
  assert f"# shown at {first}[1]\n" in text  # The FeaturePlan of fb.
  assert text.count("stack_vocab_size=160") == 1
  # Roundtrip mode: no comment, an explicit non-constructor.
  roundtrip = treescope.render_to_text(embed, roundtrip_mode=True)
  assert "#" not in roundtrip
  assert (
    f"<pz_sparsecore.core.specs.TableSpec 'tb' shown at {first}[1].table_spec>"
  ) in roundtrip
  # A spec rendered on its own, or twice side by side, is in full.
  fa, fb = embed.config.plan.feature_specs
  assert "shown at" not in _text([fa, fb], 20)


def test_spec_summaries(embed):
  fa, fb = embed.config.plan.feature_specs
  assert _text(fa.table_spec, 0) == (
    "TableSpec('ta': 40 x 4, adagrad(lr=0.1), sum; in 'tb_ta' at row 24, "
    "rotation 1)"
  )
  assert _text(fb, 0) == (
    "FeatureSpec('fb' -> 'tb': input [16, 3], output [16, 8]; samples "
    "[16, 32) of 'tb_ta')"
  )
  assert _text(fa.table_spec.stacked_table_spec, 0) == (
    "StackedTableSpec('tb_ta': 160 x 8, adagrad(lr=0.1), sum, 32 samples, "
    "limits 256 / 256)"
  )
  # Roundtrip mode keeps a valid constructor call.
  text = treescope.render_to_text(fa.table_spec, roundtrip_mode=True)
  assert text.startswith("pz_sparsecore.core.specs.TableSpec(\n  name='ta',")
  assert "#" not in text


_RENDER_IN_A_FRESH_PROCESS = """
import sys
import jax
import treescope
from pz_sparsecore.core import specs
assert "pz_sparsecore.viz.treescope" not in sys.modules
spec = specs.TableSpec(
  name="t", vocabulary_size=10, embedding_dim=4,
  initializer=jax.nn.initializers.zeros,
  optimizer=specs.SGDOptimizerSpec(learning_rate=0.5), combiner="sum")
print(treescope.render_to_text(spec))
"""


def test_core_types_render_through_viz_in_a_fresh_process():
  """The `core` types name no renderer; importing the package (here through
  `pz_sparsecore.core`) has Treescope load `viz`'s before it renders."""
  run = subprocess.run(
    [sys.executable, "-c", _RENDER_IN_A_FRESH_PROCESS],
    capture_output=True,
    text=True,
    check=True,
  )
  assert run.stdout.strip() == "TableSpec('t': 10 x 4, sgd(lr=0.5), sum)"


def test_inputs_valid_entries(embed, ids):
  inputs, _ = embed.preprocess(ids)
  # Independent count: distinct (sample, id) pairs of every feature.
  expected = sum(
    len({(r, int(i)) for r, row in enumerate(v) for i in row})
    for v in ids.values()
  )
  pad_count = int(
    np.sum(np.asarray(inputs.lhs_embedding_ids["tb_ta"]) != PAD_ID)
  )
  assert pad_count == expected
  size = NUM_DEVICES * 1024
  line = f"{expected} valid entries of {size} ({expected / size:.1%})"
  assert _text(inputs, 0) == f"PreprocessedInput(1 stack, {line})"
  assert viz.describe(inputs, embed) == (
    f"PreprocessedInput(1 stack, {line})\n"
    f"  tb_ta: row pointers int32[32], COO buffers int32[{size}]; {line}"
  )

  seen = []

  @jax.jit
  def traced(x):
    seen.append(_text(x, 1))
    return x.lhs_gains["tb_ta"].sum()

  traced(inputs)
  assert "# tb_ta: row pointers int32[32], COO buffers int32[4096]\n" in seen[0]
  assert "valid" not in seen[0]
  # Minibatched: 64 times the buffers, the same entries, the count shown.
  minibatched, _ = embed.preprocess(ids, enable_minibatching=True)
  line = f"{expected} valid entries of {size * 64} ({expected / size / 64:.1%})"
  assert _text(minibatched, 0) == (
    f"PreprocessedInput(1 stack, {line}, 1 minibatch)"
  )


def _stats(max_ids, unique=None, drops=0):
  max_ids = np.asarray(max_ids, np.int32)
  unique = max_ids if unique is None else np.asarray(unique, np.int32)
  return SparseDenseMatmulInputStats(
    max_ids_per_partition={"tb_ta": max_ids},
    max_unique_ids_per_partition={"tb_ta": unique},
    required_buffer_size_per_sc={"tb_ta": np.full(NUM_DEVICES, 40, np.int32)},
    id_drop_counters={"tb_ta": drops},
  )


def test_stats_summary_and_heatmap_mark_over_limit(embed):
  counts = np.full((NUM_DEVICES, NUM_DEVICES), 5, np.int32)
  counts[1, 2] = 300
  stats = _stats(counts.reshape(-1), drops=44)
  assert (
    _text(stats, 0) == "SparseDenseMatmulInputStats(1 stack, 44 ids dropped)"
  )
  assert viz.describe(stats, embed).splitlines()[1] == (
    "  tb_ta: max ids 300/256 OVER, max unique 300/256 OVER, required buffer "
    "40/1024 per SC, dropped 44"
  )
  figure = viz.stats_heatmap(stats, embed)
  text = _figure_text(figure)
  assert "OVER LIMIT (2):" in text
  assert "ids: device 1 -> partition 2 (device 2, SC 0): 300 > 256" in text
  html = viz.to_html(figure)
  assert "OVER LIMIT" in html and "arrayviz" in html
  # From feature specs alone (topology inferred from the stats).
  specs_text = _figure_text(
    viz.stats_heatmap(stats, embed.config.plan.feature_specs)
  )
  assert specs_text == text

  ok = _figure_text(
    viz.stats_heatmap(_stats(counts.clip(max=7).ravel()), embed)
  )
  assert "all partitions within the limits" in ok


def test_stats_heatmap_from_preprocess_with_dropping(ids):
  _, stacked = _features(limit=2)
  small = SparseCoreEmbed.from_config(
    "small", jax.random.key(0), stacked(NUM_DEVICES, 1), _mesh()
  )
  with pytest.warns(UserWarning, match="dropped"):
    _, stats = small.preprocess(ids, allow_id_dropping=True)
  assert int(np.sum(stats.id_drop_counters["tb_ta"])) > 0
  text = _figure_text(viz.stats_heatmap(stats, small))
  assert "OVER LIMIT" in text
  counts = np.asarray(stats.max_ids_per_partition["tb_ta"]).reshape(-1, 4)
  d, p = np.argwhere(counts > 2)[0]
  assert f"ids: device {d} -> partition {p} " in text


# ---------------------------------------------------------------------------
# Shard map and row placement.


@pytest.mark.parametrize("devices,sc", [(4, 1), (2, 2)])
def test_shard_table_index_matches_stacked_tables(devices, sc):
  _, stacked = _features()
  prepared = layout.prepare_feature_specs_for_training(
    stacked(devices, sc), devices, sc
  )
  n = devices * sc
  owner = viz.shard_table_index(prepared, n, "tb_ta")
  # Reference: stack constant tables (1 for tb, 2 for ta; padding 0).
  tables = layout.get_table_specs(prepared)
  marked = {
    name: np.full((t.vocabulary_size, t.embedding_dim), k + 1.0)
    for k, (name, t) in enumerate(tables.items())
  }
  ref = layout.stack_and_shard_tables(prepared, marked, n, pad_value=0.0)
  ref = ref["tb_ta"][:, :, 0].astype(int) - 1
  order = {name: k for k, name in enumerate(["tb", "ta"])}
  remap = {-1: -1} | {k: order[name] for k, name in enumerate(tables)}
  np.testing.assert_array_equal(owner, np.vectorize(remap.get)(ref))
  # 70 rows of tb over 4 shards: shards 0, 1 get 18, shards 2, 3 get 17.
  assert owner.shape == (4, 40)
  np.testing.assert_array_equal((owner[:, :24] == 0).sum(1), [18, 18, 17, 17])


def test_shard_map_figure(embed):
  figure = viz.shard_map_figure(embed)
  text = _figure_text(figure)
  assert "stack 'tb_ta': 4 shards (4 devices x 1 SC), 40 rows/shard x 8" in text
  assert (
    "ta: vocab 40 (padded 64) x 4, 16 rows/shard at [24, 40), rotation 1"
  ) in text
  assert "padding" in text
  html = viz.to_html(figure)
  assert "arrayviz" in html and "rows/shard at [0, 24)" in html

  features, _ = _features()
  from_specs = viz.shard_map_figure(
    features, global_device_count=2, num_sc_per_device=2
  )
  text = _figure_text(from_specs)
  assert "stack 'ta': 4 shards (2 devices x 2 SC), 16 rows/shard x 8" in text
  assert "stack 'tb': 4 shards (2 devices x 2 SC), 24 rows/shard x 8" in text
  with pytest.raises(ValueError, match="global_device_count"):
    viz.shard_map_figure(features)


# ---------------------------------------------------------------------------
# Palette.

ARRAYVIZ_JS = (
  pathlib.Path(treescope.__file__).parent / "_internal" / "js" / "arrayviz.js"
)


def _treescope_digit_colors(name: str) -> list[tuple[int, int, int]]:
  """A colour list of Treescope's arrayviz.js (`digitColorPrimary`...)."""
  text = ARRAYVIZ_JS.read_text()
  body = re.search(rf"const {name} = \[(.*?)\];", text, re.S).group(1)
  return [
    tuple(int(h[i : i + 2], 16) for i in (1, 3, 5))
    for h in re.findall(r"'(#[0-9a-f]{6})'", body)
  ]


def test_device_colors_are_treescopes():
  primary = _treescope_digit_colors("digitColorPrimary")
  repeated = _treescope_digit_colors("digitColorSecondary")
  assert len(primary) == len(repeated) == 10
  assert list(palette.DIGIT_COLORS) == primary
  assert list(palette.DIGIT_COLORS_REPEATED) == repeated
  # Device d is the digitbox of d + 1: device 0 blue (#1f77b4), ...
  assert palette.DEVICE_COLORS[0] == (31, 119, 180)
  assert [palette.device_colors(d) for d in range(9)] == [
    (primary[d + 1],) for d in range(9)
  ]
  assert palette.device_colors(9) == (primary[1], primary[0])  # "10"
  assert palette.device_colors(10) == (primary[1], repeated[1])  # "11"
  # "111": the third 1 repeats a lighter one, so it is drawn plain again.
  assert palette.device_colors(110) == (primary[1], repeated[1], primary[1])


def test_cielab_reference_values():
  # CIE L*a*b* (D65) of sRGB white, red and blue, as published.
  lab = palette._cielab(np.array([(255, 255, 255), (255, 0, 0), (0, 0, 255)]))
  np.testing.assert_allclose(
    lab,
    [[100.0, 0.0, 0.0], [53.24, 80.09, 67.20], [32.30, 79.19, -107.86]],
    atol=0.1,
  )


# Smallest CIELAB delta E of a table colour from a colour Treescope draws a
# device in (either shade of any digit, white and grey among them) or from
# the padding grey, and between two table colours, as `palette` states.
MIN_DELTA_E = {
  8: (37.4, 38.4),
  26: (26.9, 27.0),
}


@pytest.mark.parametrize("count", [1, 8, 26, 200])
def test_table_colors_avoid_devices_and_padding(count):
  colors = palette.table_colors(count)
  assert len(colors) == count == len(set(colors))
  assert colors == palette.table_colors(count)  # Deterministic.
  assert colors == palette.table_colors(count + 5)[:count]  # A prefix.
  assert list(palette.TABLE_COLORS) == palette.table_colors(8)
  avoided = [
    *_treescope_digit_colors("digitColorPrimary"),
    *_treescope_digit_colors("digitColorSecondary"),
    (255, 255, 255),
    palette.PADDING_COLOR,
  ]
  lab = palette._cielab(np.array(colors))
  to_avoided = np.linalg.norm(
    lab[:, None] - palette._cielab(np.array(avoided))[None], axis=-1
  )
  pairs = np.linalg.norm(lab[:, None] - lab[None], axis=-1)
  np.fill_diagonal(pairs, np.inf)
  if count in MIN_DELTA_E:
    to_devices, between = MIN_DELTA_E[count]
    assert to_avoided.min() >= to_devices
    assert pairs.min() >= between
  assert to_avoided.min() >= 10  # Even 200 colours stay clear of devices.
  assert all(len(set(c)) > 1 for c in colors)  # No grey.


# ---------------------------------------------------------------------------
# What the shard map draws: one labelled bar per shard, in device colours.

G8, S4 = 8, 4


@pytest.fixture(scope="module")
def embed_8x4():
  _, stacked = _features(batch=2 * G8 * S4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:G8]), ("device",))
  return SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), stacked(G8, S4), mesh, num_sc_per_device=S4
  )


def _held_ids(prepared, stack, num_shards) -> tuple[np.ndarray, np.ndarray]:
  """Reference `[N, V_shard]` table index (row order; -1 for padding) and
  id of each physical row of `stack`: `layout.stack_and_shard_tables` of
  tables whose row i holds (table + 1, i)."""
  members = [t.name for t in stack.tables]
  marked = {}
  for name, table in layout.get_table_specs(prepared).items():
    rows = np.zeros((table.vocabulary_size, table.embedding_dim))
    if name in members:
      rows[:, 0] = members.index(name) + 1
      rows[:, 1] = np.arange(table.vocabulary_size)
    marked[name] = rows
  stacked = layout.stack_and_shard_tables(
    prepared, marked, num_shards, pad_value=0.0
  )[stack.name]
  return stacked[..., 0].astype(int) - 1, stacked[..., 1].astype(int)


def test_shard_map_has_a_labelled_bar_per_shard(embed_8x4):
  plan = embed_8x4.config.plan
  (stack,) = plan.stacks
  n, v_shard = G8 * S4, stack.rows_per_shard
  html = viz.to_html(viz.shard_map_figure(embed_8x4))
  (bars,) = arrays.drawn_arrays(html)

  # 8 devices x 4 SparseCores: 32 bars, each one cell tall, hover-labelled
  # with its device (the CPU holding it) and SparseCore; a bar is its
  # device's cell, a blank, then the 16 rows of the shard.
  cells = arrays.values(bars)
  assert cells.shape == (G8, S4, 1, 2 + v_shard)
  labels = arrays.axis_item_labels(bars)
  assert labels == {
    "device (8)": [f"device {d}: CPU {d}" for d in range(G8)],
    "SparseCore (4)": [f"SparseCore {c}" for c in range(S4)],
    "device | row in shard": ["device", "", *(f"row {r}" for r in range(16))],
  }
  values = cells.reshape(n, 2 + v_shard)
  colors = [tuple(c) for c in bars["colormapConfig"]["cmapData"]]
  (cell_labels,) = arrays.lookup_tables(bars, "value_lookup")

  # The device cell: the colour Treescope's sharding view gives the CPU
  # holding the shard (device d: digit d + 1), named on hover.
  for k in range(n):
    assert colors[values[k, 0]] == palette.DEVICE_COLORS[k // S4]
    assert cell_labels[str(values[k, 0])] == f"CPU {k // S4}"
    assert colors[values[k, 1]] == (255, 255, 255)
  # And in the legend, as Treescope's digitboxes of d + 1.
  for d in range(G8):
    assert f'renderOneDigitbox(parent, {{"value": {d + 1}}})' in html
    assert f" CPU {d}  " in html

  # Each row cell: the colour of the table whose id it holds, and that id
  # on hover; padding grey.
  table, ids = _held_ids(plan.specs_tree, stack, n)
  tables = palette.table_colors(len(stack.tables))
  for k in range(n):
    for r in range(v_shard):
      value, t = values[k, 2 + r], table[k, r]
      label = cell_labels[str(value)]
      if t < 0:
        assert colors[value] == palette.PADDING_COLOR
        assert label.startswith("padding"), label
      else:
        assert colors[value] == tables[t]
        assert label == f"{stack.tables[t].name}: id {ids[k, r]}"

  text = _figure_text(viz.shard_map_figure(embed_8x4))
  assert (
    "each bar: one shard (32: 8 devices x 4 SparseCores, 4 per device): its "
    "device, a blank, then its 16 rows, row 0 first"
  ) in text
  assert "tb: vocab 70 (padded 256) x 8, 8 rows/shard at [0, 8), rotation " in (
    text
  )
  assert (
    "ta: vocab 40 (padded 256) x 4, 8 rows/shard at [8, 16), rotation 1; id "
    "i on shard (i % 32 + 1) % 32, row 8 + i // 32"
  ) in text


def test_shard_map_one_table_stack_says_which_ids():
  """A one-table stack is one colour; its cells still say their ids."""
  features, _ = _features()
  prepared = layout.prepare_feature_specs_for_training(features, 2, 2)
  stack = plan_lib.build(prepared, 2, 2).stack("ta")
  (data,) = viz.shard_map_data(
    features, global_device_count=2, num_sc_per_device=2, stack="ta"
  )
  # 40 ids over 4 shards, padded to 64: 16 rows a shard, 10 of them used.
  assert data["num_shards"] == 4 and data["rows_per_shard"] == 16
  assert not data["banded"]
  table, ids = _held_ids(prepared, stack, 4)
  for k, row in enumerate(data["cells"]):
    labels = [data["cell_labels"][v] for v in row]
    expected = [
      f"ta: id {i}" if t == 0 else "padding: ta's rows past its vocabulary"
      for t, i in zip(table[k], ids[k], strict=True)
    ]
    assert labels == expected
    assert sum(t == 0 for t in table[k]) == 10
  assert data["device_labels"] == ["device 0", "device 1"]
  assert [d["value"] for d in data["devices"]] == [1, 2]
  assert data["shard_devices"] == [1, 1, 2, 2]
  assert data["key"][0] == (
    "each bar: one shard (4: 2 devices x 2 SparseCores, 2 per device): its "
    "device, a blank, then its 16 rows, row 0 first"
  )
  held = [int(i) for i, t in zip(ids[1], table[1], strict=True) if t == 0]
  assert data["key"][-1] == (
    f"e.g. shard 1 (device 0, SparseCore 1) holds ids {held[0]}, {held[1]}, "
    f"{held[2]}, ..., {held[-1]} of ta, at rows 0 to {len(held) - 1}"
  )


def test_shard_map_bands_label_their_ids():
  features, _ = _features()
  (data,) = viz.shard_map_data(
    features,
    global_device_count=1,
    num_sc_per_device=1,
    stack="tb",
    max_columns=6,
  )
  # 70 ids, one shard of 72 rows, in 6 bands of 12 rows.
  assert data["banded"] and data["cell_rows"][0] == [0, 12]
  labels = [data["cell_labels"][v] for v in data["cells"][0]]
  assert labels[0] == "tb: ids 0 to 11 in steps of 1 (12 ids)"
  assert labels[-1] == (
    "tb: ids 60 to 69 in steps of 1 (10 ids), then 2 padding rows"
  )


_CANVAS_CELLS = """(() => {
  const host = document.querySelector("treescope-container");
  const canvases = host.shadowRoot.querySelectorAll(
    ".arrayviz_container canvas");
  return [...canvases].map((canvas) => {
    const ctx = canvas.getContext("2d");
    const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    const cells = [];
    for (let y = 3; y < canvas.height; y += 7) {
      const row = [];
      for (let x = 3; x < canvas.width; x += 7) {
        const i = 4 * (y * canvas.width + x);
        row.push([data[i], data[i + 1], data[i + 2], data[i + 3]]);
      }
      cells.push(row);
    }
    return {cells};
  });
})()"""


def test_shard_map_as_drawn_in_chromium(embed_8x4, tmp_path):
  """The picture as Chromium draws it: a bar per shard, each starting with
  its device's cell in Treescope's colour for that device, then a blank,
  then each row in its table's colour."""
  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  plan = embed_8x4.config.plan
  (stack,) = plan.stacks
  page = tmp_path / "shards.html"
  page.write_text(
    "<!DOCTYPE html><html><body>"
    + viz.to_html(viz.shard_map_figure(embed_8x4))
    + "</body></html>"
  )
  with chromium.devtools(browser, tmp_path / "profile", 1280, 1600) as call:
    call("Runtime.enable")
    chromium.open_page(call, page.as_uri())
    drawn = chromium.evaluate(call, chromium.DRAW_ALL)
    assert drawn["undrawn"] == [], drawn
    (bars,) = chromium.evaluate(call, _CANVAS_CELLS)
    assert chromium.console_errors(call) == []
  cells = np.array(bars["cells"])  # [cell rows, cell columns, RGBA]
  # Drawn rows: the first cell of each bar is opaque; gaps stay empty.
  # Treescope leaves one empty cell between a device's bars, two between
  # devices, and one around the image.
  drawn_rows = [int(y) for y in np.nonzero(cells[:, 1, 3] == 255)[0]]
  assert drawn_rows == [
    1 + d * (2 * S4 + 1) + 2 * c for d in range(G8) for c in range(S4)
  ]
  table, _ = _held_ids(plan.specs_tree, stack, plan.num_shards)
  tables = [*palette.table_colors(len(stack.tables)), palette.PADDING_COLOR]
  for k, y in enumerate(drawn_rows):
    row = [tuple(int(x) for x in c[:3]) for c in cells[y, 1:-1]]
    assert row[0] == palette.DEVICE_COLORS[k // S4]
    assert row[1] == (255, 255, 255)
    assert row[2:] == [tables[t] for t in table[k]]


def test_readme_figure_is_what_the_code_draws():
  """`docs/images/shakespeare.png` is drawn with the shard map's data beside
  it (`docs/readme_figure.py`); the current code draws the same for the
  same run, else the picture is out of date (`make readme-figure`)."""
  from pz_sparsecore.models import shakespeare

  saved = json.loads(README_FIGURE_DATA.read_text())
  config = saved["config"]
  mesh = jax.sharding.Mesh(
    np.array(jax.devices("cpu")[: config["devices"]]), ("device",)
  )
  model = shakespeare.build_model(
    None,
    mesh,
    vocab_size=saved["vocab_size"],
    seq_len=config["seq_len"],
    batch_size=config["batch_size"],
    embedding_dim=config["embedding_dim"],
    hidden=config["hidden"],
    optimizer=shakespeare.OPTIMIZERS[config["optimizer"]](),
    num_sc_per_device=config["sc_per_device"],
    table_dtype=config["table_dtype"],
  )
  drawn = json.loads(json.dumps(viz.shard_map_data(model.embed)))
  assert drawn == saved["shard_map"]
  (data,) = drawn
  assert len(data["cells"]) == config["devices"] * config["sc_per_device"]


def test_row_placement_layout_example(embed):
  place = viz.row_placement(embed, "ta", [13])
  assert {k: int(v[0]) for k, v in place.items()} == {
    "id": 13,
    "shard": 2,
    "device": 2,
    "sparsecore": 0,
    "row_in_shard": 27,
    "physical_row": 107,
  }
  text = _figure_text(viz.row_owner_figure(embed, "ta", num_listed=2))
  assert "row i on shard (i % 4 + 1) % 4, at row 24 + i // 4" in text
  assert "    0      1       1   0            24            64" in text
  assert "    2      3" not in text


def test_row_owner_figure_colours_rows_by_device(embed):
  html = viz.to_html(viz.row_owner_figure(embed, "ta", num_rows=8))
  (image,) = arrays.drawn_arrays(html)
  # ta (rotation 1) over 4 devices x 1 SparseCore: id i on device
  # (i % 4 + 1) % 4, drawn as Treescope draws that device: digit d + 1.
  assert image["colormapConfig"]["type"] == "digitbox"
  np.testing.assert_array_equal(arrays.values(image), [2, 3, 4, 1] * 2)
  (names,) = arrays.lookup_tables(image, "value_lookup")
  assert names == {str(d + 1): f"CPU {d}" for d in range(NUM_DEVICES)}
  assert "colour: the device holding the row" in html


def test_table_values_figure(embed):
  figure = viz.table_values_figure(embed)
  text = _figure_text(figure)
  assert "stack 'tb_ta': emb/tb_ta.embeddings [4 shards x 40 rows x 8]" in text
  assert (
    "in the same layout, cell for cell, the device holding each cell" in text
  )
  html = viz.to_html(figure)
  assert "arrayviz" in html
  with pytest.raises(ValueError, match="unknown stack"):
    viz.table_values_figure(embed, "nope")


def test_to_html_compression(embed):
  figure = viz.shard_map_figure(embed)
  assert "rows/shard" in viz.to_html(figure)
  assert "rows/shard" not in viz.to_html(figure, compressed=True)


def test_figures_accept_a_plan(embed):
  plan = embed.config.plan
  # The same picture; a layer names its devices (CPU d), a plan numbers them.
  assert _figure_text(viz.shard_map_figure(plan)) == _figure_text(
    viz.shard_map_figure(embed)
  ).replace("CPU", "device")
  assert viz.describe(plan).splitlines() == [
    "Plan(2 features, stacks tb_ta[40 rows/shard x 8]; 4 devices x 1 SC)",
    # A plan has no mesh: no mapping, no placement, no exchange.
    *DESCRIPTION.splitlines()[2:-2],
  ]
  assert int(viz.row_placement(plan, "ta", [13])["physical_row"][0]) == 107
  np.testing.assert_array_equal(
    viz.shard_table_index(plan, 4, "tb_ta"),
    viz.shard_table_index(plan.specs_tree, 4, "tb_ta"),
  )
  with pytest.raises(ValueError, match="the plan has 4 shards"):
    viz.shard_table_index(plan, 8, "tb_ta")


# ---------------------------------------------------------------------------
# A SparseCoreLookup in Penzai's vocabulary.

LOOKUP_VOCAB = 50
LOOKUP_SUMMARY = (
  "SparseCoreLookup('emb.embeddings': vocabulary:50 x embedding:8 over 4 "
  "shards, sgd(lr=0.1))"
)


def _dense(embedding_axes):
  table = pz.nn.EmbeddingTable.from_config(
    "emb", jax.random.key(1), LOOKUP_VOCAB, embedding_axes
  )
  return pz.nn.EmbeddingLookup(table)


def _converted(dense, sc=1):
  return SparseCoreLookup.from_lookup(
    dense,
    mesh=_mesh(),
    optimizer=specs.SGDOptimizerSpec(learning_rate=0.1),
    num_sc_per_device=sc,
  )


def _dense_rows(dense, ids=None):
  """The dense table's `[V, *embedding]` values (rows `ids`), in numpy."""
  value = dense.table.embeddings.value
  names = [n for n in value.named_shape if n != "vocabulary"]
  rows = np.asarray(value.unwrap("vocabulary", *names))
  return rows if ids is None else rows[np.asarray(ids)]


@pytest.fixture(scope="module")
def dense_lookup():
  return _dense({"embedding": 8})


@pytest.fixture(scope="module")
def lookup(dense_lookup):
  return _converted(dense_lookup)


@pytest.mark.parametrize(
  "embedding_axes,sc",
  [({"embedding": 8}, 1), ({"heads": 2, "embedding": 3}, 2)],
)
def test_vocabulary_view_is_the_embedding_lookup_table(embedding_axes, sc):
  dense = _dense(embedding_axes)
  lk = _converted(dense, sc)
  view = vocabulary_view(lk)
  expected = dense.table.embeddings.value
  assert dict(view.named_shape) == dict(expected.named_shape)
  assert not view.positional_shape
  names = list(expected.named_shape)
  np.testing.assert_array_equal(
    np.asarray(view.unwrap(*names)), np.asarray(expected.unwrap(*names))
  )


@pytest.mark.parametrize("sc", [1, 2])
def test_vocabulary_view_rows(sc, dense_lookup):
  lk = _converted(dense_lookup, sc)
  n = lk.config.topology.num_shards
  rng = np.random.default_rng(7)
  boundaries = [0, n - 1, n, LOOKUP_VOCAB - 1]
  ids = np.concatenate([boundaries, rng.integers(0, LOOKUP_VOCAB, 9)])
  view = vocabulary_view(lk, ids)
  assert dict(view.named_shape) == {"vocabulary": ids.size, "embedding": 8}
  got = np.asarray(view.unwrap("vocabulary", "embedding"))
  np.testing.assert_array_equal(got, _dense_rows(dense_lookup, ids))
  # Token ids as a jax array, and slices (steps and negative bounds).
  got = vocabulary_view(lk, jnp.asarray(ids))
  np.testing.assert_array_equal(
    np.asarray(got.unwrap("vocabulary", "embedding")),
    _dense_rows(dense_lookup, ids),
  )
  for rows in (slice(3, 20, 2), slice(-n - 1, None), slice(None, None, -7)):
    got = vocabulary_view(lk, rows).unwrap("vocabulary", "embedding")
    np.testing.assert_array_equal(
      np.asarray(got), _dense_rows(dense_lookup)[rows]
    )
  empty = vocabulary_view(lk, np.zeros(0, np.int32))
  assert dict(empty.named_shape) == {"vocabulary": 0, "embedding": 8}


def test_vocabulary_view_gathers_only_the_rows(lookup):
  from pz_sparsecore.nn.tables import positional_table

  config = lookup.config
  table = positional_table(config, lookup.tables[config.feature].value)
  row, shard = jnp.divmod(jnp.arange(5, dtype=jnp.int32), 4)
  hlo = vocabulary._gather.lower(table, shard, row, 8).compile().as_text()
  # Each device gathers the rows it holds; the table is never all-gathered.
  assert "all-gather" not in hlo
  assert "gather(" in hlo


def test_vocabulary_view_errors(lookup, embed):
  label = "'emb.embeddings'"
  for bad, text in (
    (-1, "-1 at position 1"),
    (LOOKUP_VOCAB, "50 at position 1"),
  ):
    with pytest.raises(ValueError, match=f"{label}: token id {text} .*50"):
      vocabulary_view(lookup, [3, bad, 4])
  for rows in (3, [[1, 2]], [0.5]):
    with pytest.raises(ValueError, match=f"{label}: rows must be"):
      vocabulary_view(lookup, rows)
  with pytest.raises(ValueError, match="takes a SparseCoreEmbed"):
    vocabulary_view(embed.config)
  with pytest.raises(ValueError, match=r"no table; pass table= one of"):
    vocabulary_view(embed)
  with pytest.raises(ValueError, match="table 'tc'; pass table="):
    vocabulary_view(embed, table="tc")


def test_lookup_treescope_summary_and_view_line(lookup):
  assert _text(lookup, 0) == LOOKUP_SUMMARY
  assert repr(lookup) == LOOKUP_SUMMARY
  assert viz.describe(lookup).splitlines()[0] == LOOKUP_SUMMARY
  lines = _text(lookup, 1).splitlines()
  assert lines[0] == f"SparseCoreLookup(  # {LOOKUP_SUMMARY[17:-1]}"
  # The pointer to the vocabulary view sits just above the physical table.
  at = lines.index("  # vocabulary order: pzsc.viz.vocabulary_view(lookup)")
  assert lines[at + 1].startswith("  tables={'emb': Parameter(")
  nested = treescope.render_to_text(pz.nn.Sequential([lookup]))
  assert "# vocabulary order: pzsc.viz.vocabulary_view(model.sublayers[0])" in (
    nested
  )


@pytest.mark.parametrize("which", ["embed", "lookup"])
def test_comments_only_outside_roundtrip_mode(which, request):
  obj = request.getfixturevalue(which)
  module = type(obj).__module__
  plain = treescope.render_to_text(obj).splitlines()
  assert plain[0].startswith(f"{type(obj).__name__}(  # ")
  comments = [line for line in plain if line.lstrip().startswith("#")]
  assert len(comments) >= 4
  assert plain[len(comments) + 1].startswith("  tables={")
  roundtrip = treescope.render_to_text(obj, roundtrip_mode=True).splitlines()
  # A constructor call: no comment, no blank line, the fields in order (the
  # placement pictures take the height budget: the fields may be collapsed).
  assert roundtrip[0] == f"{module}.{type(obj).__name__}("
  assert roundtrip[1].startswith("  tables={")
  assert not [line for line in roundtrip if "#" in line or not line.strip()]
  fields = [
    line.split("=")[0].strip()
    for line in roundtrip
    if "=" in line and not line.startswith("   ")
  ]
  assert fields == ["tables", "slots", "config"]
  assert roundtrip[-1] == ")"
