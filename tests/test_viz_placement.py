"""The placement picture: which device holds each id, in vocabulary order.

The device the picture gives id i is checked against the device that holds
it: every logical row is written with a marker (its id and its table) by
the layer's own setter, and the devices holding a marker are read from the
addressable shards of the layer's `[N, V_shard, D]` table. Device colours
are checked against Treescope's own sharding view of that table (its value
-> device lookup, read from the HTML), the default Treescope view of the
layers against the arrays drawn in its HTML, and a 100M-id table against
the MOD rule written out here: id i on shard `(i % N + rotation) % N`,
device `shard // S`.
"""

from __future__ import annotations

import html as html_lib
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import treescope  # noqa: E402
import treescope_arrays  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from penzai import pz  # noqa: E402

import pz_sparsecore as pzsc  # noqa: E402
from pz_sparsecore.nn.tables import table_arrays  # noqa: E402
from pz_sparsecore.viz import placement  # noqa: E402

NUM_DEVICES = 8
BATCH = 32
ALL_ROWS = 100_000  # max_rows: every row of the test tables drawn.


def _specs(tables: dict[str, int], dim: int = 8) -> dict:
  """One feature per table (vocabulary sizes `tables`), SGD, sum."""
  out = {}
  for name, vocab in tables.items():
    table = pzsc.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
      combiner="sum",
    )
    out[f"f_{name}"] = pzsc.FeatureSpec(
      name=f"f_{name}",
      table_spec=table,
      input_shape=(BATCH, 2),
      output_shape=(BATCH, dim),
    )
  return out


def _mesh(shape, names, order=None) -> Mesh:
  devices = np.array(jax.devices()[: int(np.prod(shape))])
  if order is not None:
    devices = devices[np.asarray(order)]
  return Mesh(devices.reshape(shape), names)


# name -> (tables, mesh shape, mesh axes, device order, S, from_config kwargs)
CASES = {
  "1_device": ({"t": 100}, (1,), ("device",), None, 1, {}),
  "8_devices": ({"t": 1000}, (8,), ("device",), None, 1, {}),
  "2_devices_4_sc": ({"t": 300}, (2,), ("device",), None, 4, {}),
  # Three tables stacked: the second and third rotated (by 1 and 2 x S).
  "stack_rotated": (
    {"a": 90, "b": 200, "c": 37},
    (4,),
    ("device",),
    None,
    2,
    {},
  ),
  # A 2 x 4 mesh with its devices out of id order, tables over both axes.
  "mesh_2x4": (
    {"t": 500},
    (2, 4),
    ("data", "model"),
    [3, 0, 6, 5, 1, 7, 2, 4],
    1,
    {},
  ),
  # Tables over "model" only: every shard on two devices.
  "mesh_2x4_model": (
    {"t": 500},
    (2, 4),
    ("data", "model"),
    None,
    1,
    {"sharding_axis": "model"},
  ),
  "replicated": (
    {"big": 700, "tiny": 50},
    (8,),
    ("device",),
    None,
    1,
    {"placement": {"tiny": "replicated", "big": "sharded"}},
  ),
}


def _marked_layer(case: str) -> pzsc.SparseCoreEmbed:
  """The case's layer, each row `i` of table number `k` holding `[i + 1,
  -(k + 1), ...]`."""
  tables, shape, names, order, s, kwargs = CASES[case]
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _specs(tables),
    _mesh(shape, names, order),
    num_sc_per_device=s,
    **kwargs,
  )
  marked = {}
  for k, (name, vocab) in enumerate(tables.items()):
    rows = np.zeros((vocab, 8), np.float32)
    rows[:, 0] = np.arange(vocab) + 1
    rows[:, 1] = -(k + 1)
    marked[name] = rows
  pzsc.set_logical_tables(embed, marked)
  return embed


def _holders(
  embed, number: int, table: str
) -> tuple[dict[int, set[int]], dict[int, set[tuple[int, int]]]]:
  """Id -> the ids of the devices whose shard of the table (the case's
  table `number`) holds its row, and id -> its (shard, row in shard), read
  from the markers in the addressable shards."""
  plan = embed.config.plan
  array = table_arrays(embed)[plan.stack_of_table[table].name]
  devices: dict[int, set[int]] = {}
  places: dict[int, set[tuple[int, int]]] = {}
  for shard in array.addressable_shards:
    data = np.asarray(shard.data)
    first = shard.index[0].start or 0
    local, row = np.nonzero(data[..., 1] == -(number + 1))
    ids = data[local, row, 0].astype(np.int64) - 1
    for i, k, r in zip(ids, local, row, strict=True):
      devices.setdefault(int(i), set()).add(shard.device.id)
      places.setdefault(int(i), set()).add((first + int(k), int(r)))
  return devices, places


@pytest.fixture(scope="module", params=list(CASES))
def layer(request):
  return request.param, _marked_layer(request.param)


def test_device_of_each_id_is_the_device_holding_it(layer):
  case, embed = layer
  tables = CASES[case][0]
  for number, (table, vocab) in enumerate(tables.items()):
    grid = placement.placement_grid(embed, table, max_rows=ALL_ROWS)
    assert grid.omitted_rows == 0
    holders, places = _holders(embed, number, table)
    assert sorted(holders) == list(range(vocab))  # Every id is held.
    ids, values = grid.ids.ravel(), grid.values.ravel()
    shards, rows = grid.shards.ravel(), grid.shard_rows.ravel()
    for i, value, k, r in zip(ids, values, shards, rows, strict=True):
      if 0 <= i < vocab:
        assert set(grid.devices[int(value)]) == holders[int(i)], (table, i)
        assert places[int(i)] == {(k, r)}, (table, i)  # One row, everywhere.
    # Padding: the ids the table reserves past its vocabulary.
    padding = (ids >= vocab) & (ids < grid.padded_vocab_size)
    assert padding.sum() == grid.padded_vocab_size - vocab
    assert (values[padding] == placement.PADDING_VALUE).all()
    assert placement.PADDING_VALUE not in grid.devices
    # Wrapped rows: W a multiple of N, ids in order row by row.
    assert grid.columns % grid.num_shards == 0
    np.testing.assert_array_equal(
      ids[ids >= 0], np.arange(grid.padded_vocab_size)
    )


def _value_lookup(array: dict) -> dict[int, str]:
  (table,) = treescope_arrays.lookup_tables(array, "value_lookup")
  return {int(k): v for k, v in table.items()}


def test_device_colours_are_treescope_sharding_views(layer):
  case, embed = layer
  for stack, array in table_arrays(embed).items():
    sharding = treescope.render_array_sharding(array)
    html = pzsc.viz.to_html(sharding)
    (drawn,) = treescope_arrays.drawn_arrays(html)
    treescope_labels = _value_lookup(drawn)
    table = embed.config.plan.stack(stack).tables[0].name
    grid = placement.placement_grid(embed, table)
    assert grid.labels == treescope_labels, case


def test_rotation_shifts_the_stripes():
  embed = _marked_layer("stack_rotated")
  n = embed.config.plan.num_shards  # 4 devices x 2 SparseCores.
  firsts = {}
  for table in ("a", "b", "c"):
    grid = placement.placement_grid(embed, table)
    rotation = embed.config.plan.tables[table].setting_in_stack.shard_rotation
    firsts[rotation] = list(grid.values[0, :n])
  assert sorted(firsts) == [0, 2, 4]
  # Rotation r moves id i to the shard of id i + r without rotation.
  for r, first in firsts.items():
    assert first == firsts[0][r:] + firsts[0][:r]


def test_rule_names_the_mesh_axes():
  grid = placement.placement_grid(_marked_layer("mesh_2x4"), "t")
  assert grid.rule() == (
    "id i -> shard (i % 8 + 0) % 8 -> device shard // 1, row 0 + i // 8 of "
    "the shard (devices in the mesh's order over ('data', 'model'))"
  )
  grid = placement.placement_grid(_marked_layer("mesh_2x4_model"), "t")
  assert grid.rule().endswith(
    "% 4 -> device shard // 1, row 0 + i // 4 of the shard (a copy on each "
    "device along ('data',))"
  )


def test_replicated_stack_is_every_device():
  embed = _marked_layer("replicated")
  grid = placement.placement_grid(embed, "tiny")
  assert grid.replicated
  assert set(np.unique(grid.values)) == {1234567, placement.PADDING_VALUE}
  assert grid.labels == {1234567: "CPU 0,1,2,3,4,5,6,7"}
  text = placement.placement_figure(embed, "tiny")
  html = pzsc.viz.to_html(text)
  assert "replicated: every device holds every id" in html
  assert not placement.placement_grid(embed, "big").replicated


def test_specs_draw_devices_by_position():
  specs = _specs({"t": 1000})
  grid = placement.placement_grid(
    specs, "t", global_device_count=2, num_sc_per_device=4
  )
  # N = 8: id i on shard i % 8, device (i % 8) // 4.
  assert grid.labels == {1: "device 0", 2: "device 1"}
  ids = grid.ids[grid.ids >= 0]
  held = ids[ids < 1000]
  cells = grid.values[(grid.ids >= 0) & (grid.ids < 1000)]
  np.testing.assert_array_equal(cells, (held % 8) // 4 + 1)
  with pytest.raises(ValueError, match="multiple of the 8 shards"):
    placement.placement_grid(
      specs, "t", columns=12, global_device_count=2, num_sc_per_device=4
    )
  with pytest.raises(ValueError, match="unknown table 'u'"):
    placement.placement_grid(
      specs, "u", global_device_count=2, num_sc_per_device=4
    )


# ---------------------------------------------------------------------------
# Large tables.

HUGE = 100_000_007  # Not a multiple of 8 x 32: 249 padding ids.


def test_100m_id_table_picture_is_small_and_quick():
  mesh = _mesh((8,), ("device",))
  # Variable slots: nothing allocated, the picture reads the layout only.
  lookup = pzsc.SparseCoreLookup.from_config(
    "emb",
    None,
    vocab_size=HUGE,
    embedding_axes={"embedding": 64},
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    num_sc_per_device=4,
  )
  start = time.perf_counter()
  grid = placement.placement_grid(lookup, lookup.config.feature)
  html = pzsc.viz.to_html(placement.placement_figure(lookup))
  view = treescope.render_to_html(lookup, compressed=False)
  elapsed = time.perf_counter() - start
  assert elapsed < 5, elapsed
  assert len(html) < 100_000, len(html)
  assert len(view) < 1_000_000, len(view)
  (drawn,) = treescope_arrays.drawn_arrays(view)
  np.testing.assert_array_equal(treescope_arrays.values(drawn), grid.values)
  n = 32
  assert grid.columns == 64
  assert grid.ids.shape == (placement.MAX_ROWS + 1, 64)
  assert grid.num_rows == -(-grid.padded_vocab_size // 64)
  assert grid.omitted_rows == grid.num_rows - placement.MAX_ROWS
  assert f"{grid.omitted_rows} rows" in html
  # The first rows, and the last (up to the padded vocabulary).
  assert grid.ids[0, 0] == 0
  assert grid.ids[-1].max() == grid.padded_vocab_size - 1
  assert (grid.ids[placement.MAX_ROWS // 2] == -1).all()
  ids = grid.ids[grid.ids >= 0]
  cells = grid.values[grid.ids >= 0]
  held = ids < HUGE
  device = (ids % n) // 4  # Rotation 0: shard i % N, device shard // S.
  np.testing.assert_array_equal(cells[held], device[held] + 1)
  assert (cells[~held] == placement.PADDING_VALUE).all()


# ---------------------------------------------------------------------------
# The layers' default Treescope view.


def _expanded_text(obj, depth: int) -> str:
  part = treescope.active_renderer.get().to_foldable_representation(obj)
  part = treescope.rendering_parts.build_full_line_with_annotations(part)
  treescope.layout_algorithms.expand_to_depth(part, depth)
  return treescope.lowering.render_to_text_as_root(part)


def _lookup():
  dense = pz.nn.EmbeddingLookup(
    pz.nn.EmbeddingTable.from_config(
      "emb", jax.random.key(1), 1000, {"embedding": 8}
    )
  )
  return pzsc.SparseCoreLookup.from_lookup(
    dense,
    mesh=_mesh((8,), ("device",)),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
  )


@pytest.mark.parametrize("which", ["embed", "lookup"])
def test_default_view_shows_the_placement(which):
  obj = _marked_layer("stack_rotated") if which == "embed" else _lookup()
  plan = obj.config.plan
  assert "\n" not in _expanded_text(obj, 0)  # Collapsed: one line.
  # The default expansion (the root expanded once) shows the pictures.
  text = treescope.render_to_text(obj)
  lines = text.splitlines()
  pictures = [i for i, line in enumerate(lines) if "<Arrayviz" in line]
  tables = list(plan.tables)
  assert len(pictures) >= len(tables)
  for table in tables:
    grid = placement.placement_grid(obj, table)
    assert f"  # {grid.rule()}" in lines
  # Above the attributes.
  first_attribute = next(
    i for i, line in enumerate(lines) if line.startswith("  tables=")
  )
  assert max(pictures) < first_attribute
  # The drawn arrays are the grids, in table order.
  html = treescope.render_to_html(obj, compressed=False)
  drawn = [
    a
    for a in treescope_arrays.drawn_arrays(html)
    if a["xAxisSpecs"][0]["label"] == "id % 64"
  ]
  assert len(drawn) == len(tables)
  for array, table in zip(drawn, tables, strict=True):
    grid = placement.placement_grid(obj, table)
    np.testing.assert_array_equal(treescope_arrays.values(array), grid.values)
    assert _value_lookup(array)[1] == "CPU 0"
  # Roundtrip mode: no comment, no picture.
  roundtrip = treescope.render_to_text(obj, roundtrip_mode=True)
  assert "#" not in roundtrip
  assert "Arrayviz" not in roundtrip


def test_many_tables_show_the_first_and_name_the_rest():
  tables = {f"t{k}": 40 + k for k in range(6)}
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", None, _specs(tables), _mesh((8,), ("device",))
  )
  names = list(embed.config.plan.tables)
  assert sorted(names) == sorted(tables)
  shown, rest = names[: placement.MAX_TABLES_IN_VIEW], names[4:]
  text = treescope.render_to_text(embed)
  assert text.count("<Arrayviz rendering>\n") == len(shown)
  for name in shown:
    assert f"# table {name!r} in stack" in text
  assert (
    f"# 2 more tables ({rest[0]} to {rest[1]}): "
    f"pzsc.viz.placement_figure(layer, {rest[0]!r})"
  ) in text
  nested = _expanded_text(pz.nn.Sequential([embed]), 10)
  assert f"placement_figure(model.sublayers[0], {rest[0]!r})" in nested
  # The figure draws them all.
  html = pzsc.viz.to_html(placement.placement_figure(embed))
  for name in names:
    assert f"table {name!r} in stack" in html_lib.unescape(html)


# ---------------------------------------------------------------------------
# As a reader sees it.

# Treescope's digit colours (`digitColorPrimary` in its arrayviz.js): a
# digitbox of a one-digit value is a square of its digit's colour, so
# device d (value d + 1) draws as DIGIT_COLORS[d + 1], padding (0) white.
DIGIT_COLORS = (
  "#ffffff",
  "#1f77b4",
  "#ff7f0e",
  "#2ca02c",
  "#d62728",
  "#9467bd",
  "#8c564b",
  "#e377c2",
  "#bcbd22",
  "#17becf",
)

# The centre pixel of each cell of the first array drawn on the page
# (arrayviz draws cell (row, col) at ((col + 1) * 7, (row + 1) * 7), 7 px).
CELL_COLORS = """(() => {
  const host = document.querySelector("treescope-container");
  const canvas = host.shadowRoot.querySelector(".arrayviz_container canvas");
  const context = canvas.getContext("2d");
  const rows = canvas.height / 7 - 2, cols = canvas.width / 7 - 2;
  const out = [];
  for (let r = 0; r < rows; r++) {
    const line = [];
    for (let c = 0; c < cols; c++) {
      const [red, green, blue] = context.getImageData(
        (c + 1) * 7 + 3, (r + 1) * 7 + 3, 1, 1).data;
      line.push("#" + [red, green, blue].map(
        (x) => x.toString(16).padStart(2, "0")).join(""));
    }
    out.push(line);
  }
  return out;
})()"""


def test_default_view_draws_device_colours_in_chromium(tmp_path):
  import chromium

  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  lookup = _lookup()  # 1000 ids on 8 devices: 16 rows of 64.
  page = tmp_path / "lookup.html"
  page.write_text(treescope.render_to_html(lookup))
  profile = tmp_path / "profile"
  profile.mkdir()
  with chromium.devtools(browser, profile, 1200, 1600) as call:
    call("Runtime.enable")
    chromium.open_page(call, page.as_uri())
    chromium.wait_for(call, chromium.DRAWN)
    drawn = chromium.evaluate(call, chromium.DRAW_ALL)
    assert drawn["undrawn"] == [], drawn
    colors = np.array(chromium.evaluate(call, CELL_COLORS))
    assert chromium.console_errors(call) == []
  assert colors.shape == (16, 64)
  ids = np.arange(16 * 64).reshape(16, 64)
  # Id i on device i % 8 (rotation 0, one SparseCore per device).
  expected = np.array(DIGIT_COLORS)[ids % 8 + 1]
  expected[ids >= 1000] = DIGIT_COLORS[0]  # Padding: 1000-1023.
  np.testing.assert_array_equal(colors, expected)
