"""What the views of a layer's tables say, checked against independent facts.

`vocabulary_view` (its values, axes and where they live) and its figure
(the ids it labels, the devices it draws), `logical_tables(named=True)`,
`table_values_figure`'s device picture, the heat maps' printed counts, and
the text of a `SparseCoreLookup`'s header and of `describe`. The references
are the MOD rule written out here (id `i` of a table with rotation `r` on
shard `(i % N + r) % N`, row `row_offset + i // N`), the table array's own
sharding, the stats given to the heat map, and Penzai's `EmbeddingTable`.
The pictures are read back from Treescope's HTML (`treescope_arrays`).
"""

from __future__ import annotations

import base64

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz
from treescope import lowering
from treescope_arrays import drawn_arrays, lookup_tables
from treescope_arrays import values as drawn_values

from pz_sparsecore.core import layout, specs
from pz_sparsecore.host.preprocess import SparseDenseMatmulInputStats
from pz_sparsecore.nn import SparseCoreEmbed
from pz_sparsecore.nn.lookup import SparseCoreLookup
from pz_sparsecore.nn.tables import logical_tables
from pz_sparsecore.viz import figures as viz
from pz_sparsecore.viz import vocabulary_view, vocabulary_view_figure

BATCH = 16
STACK = "tb_ta"
SGD = specs.SGDOptimizerSpec(learning_rate=0.1)


def _init(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, dtype)


def _mesh(devices):
  return jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("device",))


def _embed(devices, sc):
  """Tables tb (70 x 8) and ta (40 x 4, rotation 1) in one stack."""
  opt = specs.AdagradOptimizerSpec(learning_rate=0.1)
  tables = {
    name: specs.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=_init,
      optimizer=opt,
      combiner="sum",
    )
    for name, vocab, dim in (("tb", 70, 8), ("ta", 40, 4))
  }
  features = {
    f"f{name}": specs.FeatureSpec(
      name=f"f{name}",
      table_spec=table,
      input_shape=(BATCH, 3),
      output_shape=(BATCH, table.embedding_dim),
    )
    for name, table in tables.items()
  }
  stacked = layout.stack_tables(
    features, ["tb", "ta"], devices, sc, rotation=1, stack_name=STACK
  )
  return SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), stacked, _mesh(devices), num_sc_per_device=sc
  )


@pytest.fixture(scope="module", params=[(4, 1), (2, 2)], ids=["4x1", "2x2"])
def embed(request):
  return _embed(*request.param)


def _rule(embed, table, ids):
  """The shard and the row in it of each id, by the MOD rule."""
  setting = embed.config.plan.tables[table].setting_in_stack
  n = embed.config.plan.num_shards
  ids = np.asarray(ids)
  shard = (ids % n + setting.shard_rotation) % n
  return shard, setting.row_offset_in_shard + ids // n


def _physical(embed):
  """The stack's `[N, V_shard, D]` values."""
  value = embed.tables[STACK].value
  return np.asarray(value.unwrap("sc_shard", "sc_row", "embedding"))


def _rows(embed, table, ids):
  """Rows `ids` of a logical table, read off the physical stack."""
  shard, row = _rule(embed, table, ids)
  width = embed.config.plan.tables[table].embedding_dim
  return _physical(embed)[shard, row, :width]


def _holders(embed):
  """The ids of the devices holding each shard, from the table's array."""
  array = embed.tables[STACK].value.data_array
  n = array.shape[0]
  holders = [[] for _ in range(n)]
  for device, index in array.sharding.devices_indices_map(array.shape).items():
    for k in range(n)[index[0]]:
      holders[k].append(device.id)
  return [sorted(h) for h in holders]


def _text(figure):
  return lowering.render_to_text_as_root(figure.treescope_part)


def _label(labels, j):
  """Item `j` of Treescope's hover labels (a list, or a mapping)."""
  return labels[j] if isinstance(labels, list) else labels[str(j)]


# ---------------------------------------------------------------------------
# vocabulary_view of a SparseCoreEmbed's table.


def test_vocabulary_view_of_a_layer_table(embed):
  ids = np.random.default_rng(3).integers(0, 40, 11)
  view = vocabulary_view(embed, ids, table="ta")
  assert dict(view.named_shape) == {"vocabulary": 11, "embedding": 4}
  np.testing.assert_array_equal(
    np.asarray(view.unwrap("vocabulary", "embedding")), _rows(embed, "ta", ids)
  )
  whole = vocabulary_view(embed, table="tb")
  assert dict(whole.named_shape) == {"vocabulary": 70, "embedding": 8}
  np.testing.assert_array_equal(
    np.asarray(whole.unwrap("vocabulary", "embedding")),
    _rows(embed, "tb", np.arange(70)),
  )
  with pytest.raises(ValueError, match="table 'ta': token id 40 at position"):
    vocabulary_view(embed, [1, 40], table="ta")


def test_vocabulary_view_keeps_rows_where_the_table_holds_them(embed):
  holders = _holders(embed)
  s = embed.config.plan.num_sc_per_device
  g = len(holders) // s
  ids = np.arange(40)
  shard, _ = _rule(embed, "ta", ids)

  # Ids all on one shard: on the one device holding it.
  one = ids[shard == 2][:3]
  view = vocabulary_view(embed, one, table="ta").data_array
  assert [d.id for d in view.sharding.device_set] == holders[2]
  assert len(holders[2]) == 1

  # Two ids per device, in the devices' order: each row on its device.
  device = shard // s
  blocks = np.concatenate([ids[device == d][:2] for d in range(g)])
  view = vocabulary_view(embed, blocks, table="ta").data_array
  assert not view.is_fully_replicated
  seen = set()
  for piece in view.addressable_shards:
    for j in range(len(blocks))[piece.index[0]]:
      assert [piece.device.id] == holders[_rule(embed, "ta", blocks[j])[0]]
      seen.add(j)
  assert seen == set(range(len(blocks)))
  np.testing.assert_array_equal(np.asarray(view), _rows(embed, "ta", blocks))

  # Ids of several devices in no such order: a copy on every device.
  mixed = vocabulary_view(embed, [0, 1, 2], table="ta").data_array
  assert mixed.is_fully_replicated
  assert len(mixed.sharding.device_set) == g


def test_vocabulary_view_figure_labels_ids_and_devices(embed):
  holders = _holders(embed)
  s = embed.config.plan.num_sc_per_device
  ids = np.array([5, 0, 39, 12])
  figure = vocabulary_view_figure(embed, ids, table="ta")
  text = _text(figure)
  assert "table 'ta' in vocabulary order, 4 rows: ids 5, 0, 39, 12" in text
  assert "this view's values: a copy on each of" in text

  values, devices = drawn_arrays(viz.to_html(figure))[:2]
  (labels,) = lookup_tables(values, "axis_lookup")
  shard, row = _rule(embed, "ta", ids)
  for j, i in enumerate(ids):
    assert _label(labels, j) == (
      f"id {i}: CPU {holders[shard[j]][0]}, shard {shard[j]} (SC "
      f"{shard[j] % s}), row {row[j]}"
    )
  np.testing.assert_array_equal(drawn_values(values), _rows(embed, "ta", ids))
  # The same layout, each cell the digitbox of the device holding it.
  assert values["yAxisSpecs"] == devices["yAxisSpecs"]
  assert values["xAxisSpecs"] == devices["xAxisSpecs"]
  expected = np.array([holders[k][0] + 1 for k in shard])
  np.testing.assert_array_equal(
    drawn_values(devices), np.broadcast_to(expected[:, None], (4, 4))
  )

  (one,) = [i for i in range(40) if _rule(embed, "ta", i)[0] == 3][:1]
  text = _text(vocabulary_view_figure(embed, [one], table="ta"))
  assert f"ids {one}\n" in text
  assert f"on CPU {holders[3][0]}, the device holding these rows" in text


# ---------------------------------------------------------------------------
# Logical tables with Penzai's axis names.


def test_logical_tables_named(embed):
  plain = logical_tables(embed)
  named = logical_tables(embed, named=True)
  assert set(named) == set(plain) == {"ta", "tb"}
  for name, table in plain.items():
    assert isinstance(table, np.ndarray)
    np.testing.assert_array_equal(
      table, _rows(embed, name, np.arange(table.shape[0]))
    )
    value = named[name]
    assert isinstance(value, pz.nx.NamedArray)
    assert dict(value.named_shape) == {
      "vocabulary": table.shape[0],
      "embedding": table.shape[1],
    }
    np.testing.assert_array_equal(
      np.asarray(value.unwrap("vocabulary", "embedding")), table
    )


@pytest.mark.parametrize("axes", [{"embedding": 8}, {"heads": 2, "emb": 3}])
def test_logical_tables_named_of_a_lookup_is_its_embedding_table(axes):
  table = pz.nn.EmbeddingTable.from_config("emb", jax.random.key(1), 50, axes)
  lookup = SparseCoreLookup.from_lookup(
    pz.nn.EmbeddingLookup(table), mesh=_mesh(4), optimizer=SGD
  )
  (named,) = logical_tables(lookup, named=True).values()
  expected = table.embeddings.value
  assert dict(named.named_shape) == dict(expected.named_shape)
  names = list(expected.named_shape)
  np.testing.assert_array_equal(
    np.asarray(named.unwrap(*names)), np.asarray(expected.unwrap(*names))
  )


# ---------------------------------------------------------------------------
# Table values and devices, cell for cell.


def test_table_values_figure_draws_values_and_devices_cell_for_cell(embed):
  html = viz.to_html(viz.table_values_figure(embed))
  values, devices = drawn_arrays(html)[:2]
  assert values["yAxisSpecs"] == devices["yAxisSpecs"]
  assert values["xAxisSpecs"] == devices["xAxisSpecs"]
  # Rows of a shard down; the shards side by side, each its embedding.
  physical = _physical(embed).transpose(1, 0, 2)
  np.testing.assert_array_equal(drawn_values(values), physical)
  expected = np.array([h[0] + 1 for h in _holders(embed)])
  np.testing.assert_array_equal(
    drawn_values(devices),
    np.broadcast_to(expected[None, :, None], physical.shape),
  )
  # Padding rows are marked (dotted grey) in the values.
  mask = np.frombuffer(base64.b64decode(values["validMaskBase64"]), bool)
  owner = viz.shard_table_index(embed.config.plan, 4, STACK)
  np.testing.assert_array_equal(
    mask.reshape(_physical(embed).shape)[:, :, 0], owner >= 0
  )
  # Every table's ids past its vocabulary, up to its padded vocabulary.
  assert (owner < 0).sum() == (96 - 70) + (64 - 40)


# ---------------------------------------------------------------------------
# Heat maps: counts printed, grouped by device.


def _stats(counts, unique):
  local = counts.shape[0]
  return SparseDenseMatmulInputStats(
    max_ids_per_partition={STACK: counts.reshape(-1)},
    max_unique_ids_per_partition={STACK: unique.reshape(-1)},
    required_buffer_size_per_sc={STACK: np.full(local, 40, np.int32)},
    id_drop_counters={STACK: 0},
  )


def _printed_counts(text, num_shards):
  """The count tables printed in `text`: per table, `(labels, [N, L])`."""
  lines = text.splitlines()
  tables = []
  for i, line in enumerate(lines):
    if "from local device" not in line:
      continue
    rows = [row.split(":", 1) for row in lines[i + 1 : i + 1 + num_shards]]
    labels = [label.strip() for label, _ in rows]
    counts = np.array(
      [[int(c) for c in numbers.split()] for _, numbers in rows]
    )
    tables.append((labels, counts))
  return tables


@pytest.mark.parametrize("uniform", [False, True], ids=["random", "uniform"])
def test_stats_heatmap_prints_counts_grouped_by_device(embed, uniform):
  plan = embed.config.plan
  n, s = plan.num_shards, plan.num_sc_per_device
  g = n // s
  rng = np.random.default_rng(5)
  if uniform:
    counts = np.full((g, n), 5, np.int32)
    unique = np.full((g, n), 3, np.int32)
  else:
    counts = rng.integers(0, 400, (g, n)).astype(np.int32)
    unique = rng.integers(0, 40, (g, n)).astype(np.int32)
  figure = viz.stats_heatmap(_stats(counts, unique), embed)
  text = _text(figure)
  spec = plan.stack(STACK).spec
  limits = (spec.max_ids_per_partition, spec.max_unique_ids_per_partition)
  printed = _printed_counts(text, n)
  assert len(printed) == 2
  for (labels, got), want in zip(printed, (counts, unique), strict=True):
    np.testing.assert_array_equal(got, want.T)
    for p, label in enumerate(labels):
      device = f"to device {p // s}" if p % s == 0 else ""
      assert label == (f"{device}  SC {p % s}".strip() if s > 1 else device)
  for limit in limits:
    assert f"{limit} (the limit)" in text
    assert f"{2 * limit} and more (twice the limit" in text
  # The pictures: count / limit, a row per partition grouped by device.
  drawn = drawn_arrays(viz.to_html(figure))
  for array, want, limit in zip(drawn, (counts, unique), limits, strict=True):
    np.testing.assert_allclose(
      drawn_values(array), (want.T / limit).reshape(g, s, g), rtol=1e-6
    )


# ---------------------------------------------------------------------------
# Header and describe text.


def test_lookup_header_names_its_own_axes_and_per_call_limits():
  def lookup(**kwargs):
    return SparseCoreLookup.from_config(
      "emb",
      jax.random.key(0),
      vocab_size=50,
      embedding_axes={"heads": 2, "embedding": 4},
      mesh=_mesh(4),
      optimizer=SGD,
      **kwargs,
    )

  text = viz.describe(lookup())
  lines = text.splitlines()
  assert lines[1] == (
    "  mesh axes: sc_shard -> 'device'; heads, embedding -> replicated"
  )
  assert lines[2] == (
    "  stack 'emb': 4 shards x 16 rows x 8, sgd(lr=0.1), sum, samples per "
    "call, limits per call: every id a call sends a partition "
    "(max_ids_per_partition=None)"
  )
  assert (
    "    exchange: chosen per call: the mode with fewer predicted bytes"
    in (lines)
  )
  details = "\n".join(lines[1:])
  for internal in ("limits ids", "sc_sample", "sc_embedding", "('"):
    assert internal not in details
  capped = viz.describe(lookup(max_ids_per_partition=64))
  assert "limits per call: ids 64 per partition (max_ids_per_partition)" in (
    capped
  )
  # The lookup's sample axis is one name, not a tuple of names.
  names = [name for name, _ in lookup().config.axis_mapping.names]
  assert names == ["sc_shard", "sc_sample", "sc_embedding"]


def test_describe_says_why_the_unique_limit_is_the_rows_per_shard():
  table = specs.TableSpec(
    name="small",
    vocabulary_size=300,
    embedding_dim=16,
    initializer=_init,
    optimizer=SGD,
    combiner="sum",
  )
  feature = specs.FeatureSpec(
    name="f", table_spec=table, input_shape=(128, 40), output_shape=(128, 16)
  )
  embed = SparseCoreEmbed.from_config(
    "e", jax.random.key(0), {"f": feature}, _mesh(4)
  )
  (stack,) = embed.config.plan.stacks
  # limits="auto": every id of a SparseCore, 32 samples x 40; distinct ids
  # at most the 320 / 4 rows of a shard.
  assert stack.spec.max_ids_per_partition == 32 * 40
  assert stack.spec.max_unique_ids_per_partition == stack.rows_per_shard == 80
  assert (
    "limits ids 1280 / unique 80 (= rows per shard: no partition receives "
    "more distinct ids)"
  ) in viz.describe(embed)
