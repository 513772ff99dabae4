"""Tests of table stacking and MOD sharding (pz_sparsecore.core.layout).

References: the verified stacking example of the upstream notes (section
3.5) as literals, hand-computed small layouts, and a loop-based numpy
construction of the physical layout that walks shards and local rows (the
inverse direction of the code's reshape / roll).
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.specs import (
  AdagradOptimizerSpec,
  FeatureIdTransformation,
  FeatureSpec,
  SGDOptimizerSpec,
  TableSettingInStack,
  TableSpec,
)


def _init(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, dtype)


def _table(name, vocab, dim, combiner="sum", optimizer=None, **kw):
  return TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=_init,
    optimizer=optimizer or SGDOptimizerSpec(),
    combiner=combiner,
    **kw,
  )


def _feature(name, table, batch, dim=None, valency=None):
  dim = table.embedding_dim if dim is None else dim
  input_shape = [batch] if valency is None else [batch, valency]
  return FeatureSpec(
    name=name,
    table_spec=table,
    input_shape=input_shape,
    output_shape=[batch, dim],
  )


def _by_name(features):
  return {f.name: f for f in jax.tree.leaves(features)}


# ---------------------------------------------------------------------------
# The stacking example of `pz_sparsecore.core.layout`'s docstring (72/40 rows),
# whose layout upstream's `stack_tables` also gives.


def _example_features():
  ta = _table("ta", 40, 6, combiner="sqrtn")
  tb = _table("tb", 72, 8, combiner="sqrtn")
  return [
    _feature("fa", ta, 16, valency=3),
    _feature("fb1", tb, 16),
    _feature("fb2", tb, 16, valency=2),
  ]


def _example_stacked():
  stacked = layout.stack_tables(
    _example_features(), ["tb", "ta"], 2, 2, rotation=1, stack_name="stack_ba"
  )
  return layout.prepare_feature_specs_for_training(stacked, 2, 2)


def test_stacking_example_settings():
  features = _by_name(_example_stacked())
  ta = features["fa"].table_spec
  tb = features["fb1"].table_spec
  assert tb.setting_in_stack == TableSettingInStack(
    stack_name="stack_ba",
    padded_vocab_size=96,
    padded_embedding_dim=8,
    row_offset_in_shard=0,
    shard_rotation=0,
  )
  assert ta.setting_in_stack == TableSettingInStack(
    stack_name="stack_ba",
    padded_vocab_size=64,
    padded_embedding_dim=8,
    row_offset_in_shard=24,
    shard_rotation=1,
  )
  stack = ta.stacked_table_spec
  assert stack is not None and stack == tb.stacked_table_spec
  assert stack.stack_name == "stack_ba"
  assert stack.stack_vocab_size == 160
  assert stack.stack_embedding_dim == 8
  assert stack.total_sample_count == 48
  assert stack.combiner == "sqrtn"
  assert stack.optimizer == SGDOptimizerSpec()
  # Multi-table stacks use the default limits callables (256).
  assert stack.max_ids_per_partition == 256
  assert stack.max_unique_ids_per_partition == 256
  assert features["fa"].id_transformation == FeatureIdTransformation(0, 96, 1)
  assert features["fb1"].id_transformation == FeatureIdTransformation(16, 0, 0)
  assert features["fb2"].id_transformation == FeatureIdTransformation(32, 0, 0)
  assert layout.get_stacked_table_specs(_example_stacked()) == {
    "stack_ba": stack
  }


def test_stacking_example_physical_row():
  ta = _by_name(_example_stacked())["fa"].table_spec
  assert layout.physical_row_ids(ta, np.array([13]), 4).tolist() == [107]


def test_stack_tables_leaves_inputs_unchanged():
  features = _example_features()
  before = list(features)
  out = layout.stack_tables(features, ["tb", "ta"], 2, 2)
  assert features == before
  assert all(f.table_spec.stacked_table_spec is None for f in features)
  assert all(f.id_transformation is None for f in features)
  assert out is not features
  # Default name: member names joined by "_"; default rotation = S.
  assert _by_name(out)["fa"].table_spec.setting_in_stack.stack_name == "tb_ta"
  assert _by_name(out)["fa"].table_spec.setting_in_stack.shard_rotation == 2


def test_stack_tables_custom_limits():
  calls = []

  def max_ids(name, count):
    calls.append((name, count))
    return 17

  out = layout.stack_tables(
    _example_features(),
    ["ta", "tb"],
    1,
    1,
    stack_to_max_ids_per_partition=max_ids,
    stack_to_max_unique_ids_per_partition=lambda name, count: 5,
  )
  stack = _by_name(out)["fa"].table_spec.stacked_table_spec
  assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (
    17,
    5,
  )
  assert calls == [("ta_tb", 48)]


def test_single_table_stack_keeps_table_limits():
  t = _table(
    "t", 10, 8, max_ids_per_partition=11, max_unique_ids_per_partition=3
  )
  out = layout.stack_tables([_feature("f", t, 8)], ["t"], 1, 1, stack_name="s")
  stack = out[0].table_spec.stacked_table_spec
  assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (
    11,
    3,
  )


# ---------------------------------------------------------------------------
# prepare_feature_specs_for_training.


@pytest.mark.parametrize("devices, sc", [(1, 1), (2, 1), (2, 4), (8, 2)])
def test_prepare_pads_and_orders_features_by_name(devices, sc):
  n = devices * sc
  table = _table(
    "t1",
    100,
    6,
    combiner="mean",
    optimizer=AdagradOptimizerSpec(0.5),
    max_ids_per_partition=17,
    max_unique_ids_per_partition=9,
    suggested_coo_buffer_size_per_device=1000,
  )
  other = _table("t2", 7, 16)
  zeta = FeatureSpec(
    name="zeta", table_spec=table, input_shape=[4, 8], output_shape=[4, 8, 6]
  )
  alpha = _feature("alpha", table, 16, dim=4)
  mid = _feature("mid", table, 8)
  lone = _feature("lone", other, 24)
  features = {"b": [zeta, lone], "a": mid, "c": alpha}
  out = layout.prepare_feature_specs_for_training(features, devices, sc)

  # The inputs are untouched.
  assert features == {"b": [zeta, lone], "a": mid, "c": alpha}
  assert table.stacked_table_spec is None and zeta.id_transformation is None

  got = _by_name(out)
  padded_vocab = -(-100 // (8 * n)) * 8 * n
  setting = got["zeta"].table_spec.setting_in_stack
  assert setting == TableSettingInStack(
    stack_name="t1",
    padded_vocab_size=padded_vocab,
    padded_embedding_dim=8,
  )
  # Sorted by feature name: alpha (16), mid (8), zeta (32).
  assert got["alpha"].id_transformation == FeatureIdTransformation(0, 0, 0)
  assert got["mid"].id_transformation == FeatureIdTransformation(16, 0, 0)
  assert got["zeta"].id_transformation == FeatureIdTransformation(24, 0, 0)
  stack = got["zeta"].table_spec.stacked_table_spec
  assert stack.stack_name == "t1"
  assert stack.stack_vocab_size == padded_vocab
  assert stack.stack_embedding_dim == 8
  assert stack.total_sample_count == 56
  assert stack.optimizer == AdagradOptimizerSpec(0.5)
  assert stack.combiner == "mean"
  assert stack.max_ids_per_partition == 17
  assert stack.max_unique_ids_per_partition == 9
  assert stack.suggested_coo_buffer_size_per_device == 1000

  lone_stack = got["lone"].table_spec.stacked_table_spec
  assert lone_stack.stack_vocab_size == 8 * n
  assert lone_stack.stack_embedding_dim == 16
  assert lone_stack.total_sample_count == 24
  assert got["lone"].id_transformation == FeatureIdTransformation(0, 0, 0)
  assert set(layout.get_stacked_table_specs(out)) == {"t1", "t2"}


def test_prepare_is_idempotent_and_keeps_stacks():
  once = _example_stacked()
  assert layout.prepare_feature_specs_for_training(once, 2, 2) == once


def test_prepare_keeps_stacks_of_another_topology_the_plan_refuses_them():
  # Upstream's prepare leaves stacked tables alone whatever the topology;
  # the plan that sizes tables (the layer's) refuses them, preprocessing's
  # takes them.
  stacked = _example_stacked()  # for 2 devices x 2 SparseCores
  kept = layout.prepare_feature_specs_for_training(stacked, 4, 4)
  assert kept == stacked
  with pytest.raises(ValueError, match="topology"):
    plan_lib.build(kept, 4, 4)
  assert plan_lib.build(kept, 4, 4, for_tables=False).num_shards == 16


def test_prepare_fills_missing_id_transformation_of_hand_stacked_table():
  stacked = _example_stacked()
  bare = [f.replace(id_transformation=None) for f in stacked]
  with pytest.raises(ValueError, match="feature 'fa' is not prepared"):
    plan_lib.build(
      [bare[0].replace(table_spec=_example_features()[0].table_spec)], 2, 2
    )
  filled = layout.prepare_feature_specs_for_training(bare, 2, 2)
  assert [f.id_transformation for f in filled] == [
    FeatureIdTransformation(0, 0, 0)
  ] * 3
  # Without prepare, the plan reads them as (0, 0, 0) too.
  plan = plan_lib.build(bare, 2, 2, for_tables=False)
  assert {
    (f.sample_offset, f.row_offset_in_shard, f.shard_rotation)
    for s in plan.stacks
    for f in s.features
  } == {(0, 0, 0)}


def test_get_stacked_table_specs_requires_preparation():
  with pytest.raises(ValueError, match="prepare"):
    layout.get_stacked_table_specs(_example_features())


# ---------------------------------------------------------------------------
# auto_stack_tables.


def test_auto_stack_groups_by_dim_optimizer_combiner():
  adagrad = AdagradOptimizerSpec()
  tables = {
    "a": _table("a", 16, 6),
    "b": _table("b", 16, 8),
    "c": _table("c", 16, 16),
    "d": _table("d", 16, 8, optimizer=adagrad),
    "e": _table("e", 16, 8, combiner="mean"),
    "f": _table("f", 16, 3),
  }
  features = {k: _feature("f_" + k, t, 8) for k, t in tables.items()}
  out = layout.auto_stack_tables(features, 2, 1)
  names = {k: f.table_spec.setting_in_stack.stack_name for k, f in out.items()}
  assert names == {
    "a": "a_b_f",
    "b": "a_b_f",
    "c": "c",
    "d": "d",
    "e": "e",
    "f": "a_b_f",
  }
  # Layout follows first appearance (alphabetical for dicts); rotation = S.
  settings = {k: f.table_spec.setting_in_stack for k, f in out.items()}
  assert [settings[k].row_offset_in_shard for k in "abf"] == [0, 8, 16]
  assert [settings[k].shard_rotation for k in "abf"] == [0, 1, 0]
  assert settings["a"].padded_embedding_dim == 8
  prepared = layout.prepare_feature_specs_for_training(out, 2, 1)
  assert set(layout.get_stacked_table_specs(prepared)) == {
    "a_b_f",
    "c",
    "d",
    "e",
  }


def test_auto_stack_long_names_are_shortened():
  names = [f"table_number_{i:02d}_with_a_long_name" for i in range(3)]
  features = [_feature("f" + n, _table(n, 8, 8), 8) for n in names]
  full = "_".join(names)
  assert len(full) > 50
  short = full[:50] + "..." + hashlib.sha256(full.encode()).hexdigest()[:12]
  out = layout.auto_stack_tables(features, 1, 1)
  assert out[0].table_spec.setting_in_stack.stack_name == short
  out = layout.auto_stack_tables(features, 1, 1, use_short_stack_names=False)
  assert out[0].table_spec.setting_in_stack.stack_name == full
  # stack_tables' default name is shortened too.
  out = layout.stack_tables(features, names, 1, 1)
  assert out[2].table_spec.setting_in_stack.stack_name == short


def test_auto_stack_splits_by_activation_memory():
  # N = 2; cost = 8 (dim) * (samples // 2) * 4 bytes = 16 * samples.
  samples = {"t0": 120, "t1": 120, "t2": 80, "t3": 200}
  features = [
    _feature("f" + k, _table(k, 16, 8), s) for k, s in samples.items()
  ]
  limit = 16 * 200
  out = layout.auto_stack_tables(
    features, 2, 1, activation_mem_bytes_limit=limit
  )
  names = [f.table_spec.setting_in_stack.stack_name for f in out]
  # First fit: t0 opens a group; t1 does not fit with t0 (240 > 200) and
  # opens a second; t2 fits with t0 (200); t3 fits nowhere.
  assert names == ["t0_t2", "t1", "t0_t2", "t3"]
  big = layout.auto_stack_tables(features, 2, 1)
  assert {f.table_spec.setting_in_stack.stack_name for f in big} == {
    "t0_t1_t2_t3"
  }


# ---------------------------------------------------------------------------
# Errors.


def test_stack_errors():
  features = _example_features()
  stacked = layout.stack_tables(features, ["ta", "tb"], 1, 1, stack_name="s")
  with pytest.raises(ValueError, match="already stacked"):
    layout.stack_tables(stacked, ["ta"], 1, 1)
  with pytest.raises(ValueError, match="repeated"):
    layout.stack_tables(features, ["ta", "ta"], 1, 1)
  with pytest.raises(ValueError, match="unknown table"):
    layout.stack_tables(features, ["ta", "tc"], 1, 1)
  with pytest.raises(ValueError, match="must be a power of 2"):
    layout.stack_tables(features, ["ta", "tb"], 3, 1)
  with pytest.raises(ValueError, match="must be a power of 2"):
    layout.prepare_feature_specs_for_training(features, 2, 3)
  with pytest.raises(ValueError, match="must be a power of 2"):
    layout.auto_stack_tables(features, 6, 1)
  with pytest.raises(ValueError):
    layout.stack_tables(features, ["ta", "tb"], 0, 1)


def test_stack_name_already_used():
  tables = [_table(n, 8, 8) for n in ("a", "b", "c")]
  features = [_feature("f" + t.name, t, 8) for t in tables]
  stacked = layout.stack_tables(features, ["a", "b"], 1, 1, stack_name="s")
  with pytest.raises(ValueError, match="already used"):
    layout.stack_tables(stacked, ["c"], 1, 1, stack_name="s")


def test_stack_name_clashing_with_unstacked_table():
  # Stack "s" of tables a, b plus an unstacked table named "s": preparing
  # would create a second, different stack "s".
  tables = [_table(n, 8, 8) for n in ("a", "b", "s")]
  features = [_feature("f" + t.name, t, 8) for t in tables]
  stacked = layout.stack_tables(features, ["a", "b"], 1, 1, stack_name="s")
  with pytest.raises(ValueError, match="already has that name"):
    layout.prepare_feature_specs_for_training(stacked, 1, 1)
  # A one-table stack named after its own table is fine.
  solo = layout.stack_tables(features, ["s"], 1, 1, stack_name="s")
  layout.prepare_feature_specs_for_training(solo, 1, 1)


def test_stack_different_optimizer_or_combiner():
  a = _table("a", 8, 8)
  b = _table("b", 8, 8, optimizer=SGDOptimizerSpec(0.5))
  c = _table("c", 8, 8, combiner="sqrtn")
  features = [_feature("f" + t.name, t, 8) for t in (a, b, c)]
  with pytest.raises(ValueError, match="optimizer"):
    layout.stack_tables(features, ["a", "b"], 1, 1)
  with pytest.raises(ValueError, match="combiner"):
    layout.stack_tables(features, ["a", "c"], 1, 1)


def test_excess_padding():
  a, b = _table("a", 8, 8), _table("b", 8, 12)
  features = [_feature("fa", a, 8), _feature("fb", b, 8)]
  with pytest.raises(ValueError, match="padded"):
    layout.stack_tables(features, ["a", "b"], 1, 1, fail_on_excess_padding=True)
  out = layout.stack_tables(features, ["a", "b"], 1, 1)
  assert out[0].table_spec.setting_in_stack.padded_embedding_dim == 16
  assert out[0].table_spec.stacked_table_spec.stack_embedding_dim == 16


def test_duplicate_names():
  t = _table("t", 8, 8)
  # Stacking accepts repeated feature names (as upstream); the lookups of
  # get_table_specs / get_stacked_table_specs refuse them, in upstream's words.
  twice = layout.prepare_feature_specs_for_training(
    [_feature("f", t, 8), _feature("f", t, 4)], 1, 1
  )
  with pytest.raises(ValueError, match="Feature spec f is already defined."):
    layout.get_table_specs(twice)
  with pytest.raises(ValueError, match="Feature spec f is already defined."):
    layout.get_stacked_table_specs(twice)
  other = _table("t", 16, 8)
  with pytest.raises(ValueError, match="different TableSpecs"):
    layout.prepare_feature_specs_for_training(
      [_feature("f", t, 8), _feature("g", other, 8)], 1, 1
    )
  with pytest.raises(ValueError, match="different TableSpecs"):
    layout.auto_stack_tables(
      [_feature("f", t, 8), _feature("g", other, 8)], 1, 1
    )


# ---------------------------------------------------------------------------
# Physical rows and table round trips.


def _reference_stack(members, tables, n, pad_value):
  """Builds `[N, V_shard, D]` by walking each shard's local rows."""
  stack = members[0].stacked_table_spec
  v_shard = stack.stack_vocab_size // n
  out = np.full((n, v_shard, stack.stack_embedding_dim), pad_value, np.float32)
  for table in members:
    s = table.setting_in_stack
    values = np.asarray(tables[table.name])
    for shard in range(n):
      for local in range(s.padded_vocab_size // n):
        logical = local * n + (shard - s.shard_rotation) % n
        if logical < table.vocabulary_size:
          row = out[shard, s.row_offset_in_shard + local]
          row[: table.embedding_dim] = values[logical]
  return out


def _random_stack(rng, n_devices, sc, rotation):
  n = n_devices * sc
  dims = [int(d) for d in rng.integers(1, 17, size=3)]
  vocabs = [int(v) for v in rng.integers(1, 200, size=3)]
  tables = [
    _table(f"t{i}", vocabs[i], dims[i], combiner="mean") for i in range(3)
  ]
  single = _table("solo", int(rng.integers(1, 50)), 5)
  features = [_feature("f" + t.name, t, 8 * n) for t in tables + [single]]
  features = layout.stack_tables(
    features, ["t2", "t0", "t1"], n_devices, sc, rotation=rotation
  )
  return layout.prepare_feature_specs_for_training(features, n_devices, sc)


@pytest.mark.parametrize(
  "n_devices, sc", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 2)]
)
@pytest.mark.parametrize("rotation", [None, 1, 3])
def test_stack_and_shard_round_trip(n_devices, sc, rotation):
  n = n_devices * sc
  rng = np.random.default_rng(1000 * n + (rotation or 0))
  features = _random_stack(rng, n_devices, sc, rotation)
  tables = {f.table_spec.name: f.table_spec for f in jax.tree.leaves(features)}
  values = {
    name: rng.standard_normal((t.vocabulary_size, t.embedding_dim)).astype(
      np.float32
    )
    for name, t in tables.items()
  }
  stacked = layout.stack_and_shard_tables(features, values, n, pad_value=-7.0)
  assert set(stacked) == {"t2_t0_t1", "solo"}
  members = sorted(
    [tables[k] for k in ("t0", "t1", "t2")],
    key=lambda t: t.setting_in_stack.row_offset_in_shard,
  )
  assert [t.name for t in members] == ["t2", "t0", "t1"]
  expected = _reference_stack(members, values, n, -7.0)
  np.testing.assert_array_equal(stacked["t2_t0_t1"], expected)
  np.testing.assert_array_equal(
    stacked["solo"], _reference_stack([tables["solo"]], values, n, -7.0)
  )

  back = layout.unshard_and_unstack_tables(features, stacked, n)
  assert set(back) == set(values)
  for name, v in values.items():
    np.testing.assert_array_equal(back[name], v)
  # The flat [N * V_shard, D] form is accepted as well.
  flat = {k: v.reshape(-1, v.shape[-1]) for k, v in stacked.items()}
  back = layout.unshard_and_unstack_tables(features, flat, n)
  for name, v in values.items():
    np.testing.assert_array_equal(back[name], v)

  # physical_row_ids agrees with the layout: the row holds the logical row.
  for name, t in tables.items():
    ids = np.arange(t.vocabulary_size)
    rows = layout.physical_row_ids(t, ids, n)
    stack = flat[t.stacked_table_spec.stack_name]
    np.testing.assert_array_equal(stack[rows, : t.embedding_dim], values[name])


def test_round_trip_sixteen_shards_with_slots():
  n_devices, sc = 4, 4
  n = 16
  rng = np.random.default_rng(16)
  features = _random_stack(rng, n_devices, sc, None)
  tables = {f.table_spec.name: f.table_spec for f in jax.tree.leaves(features)}

  def rand(t):
    return rng.standard_normal((t.vocabulary_size, t.embedding_dim)).astype(
      np.float32
    )

  values = {
    name: {"table": rand(t), "slot": (rand(t), rand(t))}
    for name, t in tables.items()
  }
  stacked = layout.stack_and_shard_tables(features, values, n)
  stack = stacked["t2_t0_t1"]
  assert set(stack) == {"table", "slot"} and len(stack["slot"]) == 2
  members = [tables[k] for k in ("t2", "t0", "t1")]
  for j in range(2):
    slot_j = {k: values[k]["slot"][j] for k in ("t0", "t1", "t2")}
    np.testing.assert_array_equal(
      stack["slot"][j], _reference_stack(members, slot_j, n, np.nan)
    )
  back = layout.unshard_and_unstack_tables(features, stacked, n)
  for name in values:
    np.testing.assert_array_equal(back[name]["table"], values[name]["table"])
    for j in range(2):
      np.testing.assert_array_equal(
        back[name]["slot"][j], values[name]["slot"][j]
      )


def test_physical_row_ids_formula():
  rng = np.random.default_rng(3)
  features = _random_stack(rng, 4, 2, 3)
  n = 8
  for f in jax.tree.leaves(features):
    t = f.table_spec
    s = t.setting_in_stack
    v_shard = t.stacked_table_spec.stack_vocab_size // n
    ids = rng.integers(0, t.vocabulary_size, size=(5, 7))
    expected = np.empty_like(ids)
    for idx, i in np.ndenumerate(ids):
      shard = (i % n + s.shard_rotation) % n
      expected[idx] = shard * v_shard + s.row_offset_in_shard + i // n
    np.testing.assert_array_equal(layout.physical_row_ids(t, ids, n), expected)
    with pytest.raises(ValueError, match="outside"):
      layout.physical_row_ids(t, np.array([t.vocabulary_size]), n)
    with pytest.raises(ValueError, match="outside"):
      layout.physical_row_ids(t, np.array([-1]), n)


def test_mod_sharding_literal():
  # vocab 16, N = 2: shard 0 holds the even rows, shard 1 the odd rows.
  t = _table("t", 16, 8)
  features = layout.prepare_feature_specs_for_training(
    [_feature("f", t, 8)], 2, 1
  )
  values = np.repeat(np.arange(16, dtype=np.float32)[:, None], 8, axis=1)
  stacked = layout.stack_and_shard_tables(features, {"t": values}, 2)["t"]
  assert stacked.shape == (2, 8, 8)
  assert stacked.dtype == np.float32
  np.testing.assert_array_equal(stacked[0, :, 0], [0, 2, 4, 6, 8, 10, 12, 14])
  np.testing.assert_array_equal(stacked[1, :, 0], [1, 3, 5, 7, 9, 11, 13, 15])
  np.testing.assert_array_equal(
    np.broadcast_to(stacked[..., :1], stacked.shape), stacked
  )


def test_padding_filled_with_pad_value():
  # vocab 10 -> 16 rows (8 per shard), dim 5 -> 8 columns, N = 2.
  t = _table("t", 10, 5)
  features = layout.prepare_feature_specs_for_training(
    [_feature("f", t, 8)], 2, 1
  )
  values = np.arange(50, dtype=np.float32).reshape(10, 5)
  stacked = layout.stack_and_shard_tables(
    features, {"t": values}, 2, pad_value=-1.0
  )["t"]
  assert stacked.shape == (2, 8, 8)
  np.testing.assert_array_equal(stacked[:, :, 5:], -1.0)
  # Logical rows 10..15 are padding: local rows 5..7 of both shards.
  np.testing.assert_array_equal(stacked[:, 5:, :], -1.0)
  np.testing.assert_array_equal(stacked[0, :5, :5], values[0::2])
  np.testing.assert_array_equal(stacked[1, :5, :5], values[1::2])
  default = layout.stack_and_shard_tables(features, {"t": values}, 2)["t"]
  assert np.isnan(default[:, 5:, :]).all() and np.isnan(default[:, :, 5:]).all()
  assert not np.isnan(default[:, :5, :5]).any()


def test_shape_mismatch_and_missing_tables():
  t = _table("t", 10, 5)
  features = layout.prepare_feature_specs_for_training(
    [_feature("f", t, 8)], 2, 1
  )
  with pytest.raises(ValueError, match="shape"):
    layout.stack_and_shard_tables(features, {"t": np.zeros((10, 6))}, 2)
  with pytest.raises(ValueError, match="shape"):
    layout.stack_and_shard_tables(features, {"t": np.zeros((11, 5))}, 2)
  with pytest.raises(ValueError, match="missing"):
    layout.stack_and_shard_tables(features, {}, 2)
  with pytest.raises(ValueError, match="shape"):
    layout.unshard_and_unstack_tables(features, {"t": np.zeros((2, 8, 5))}, 2)
  with pytest.raises(ValueError, match="missing"):
    layout.unshard_and_unstack_tables(features, {}, 2)
  with pytest.raises(ValueError, match="prepare"):
    layout.stack_and_shard_tables(
      [_feature("f", t, 8)], {"t": np.zeros((10, 5))}, 2
    )
