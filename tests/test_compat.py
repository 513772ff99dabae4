"""The compat namespace: upstream's module paths and in-place semantics."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pz_sparsecore as pzsc
from pz_sparsecore.compat.lib.core import constants, pybind_input_preprocessing
from pz_sparsecore.compat.lib.nn import (
  embedding,
  embedding_spec,
  table_stacking,
)
from pz_sparsecore.compat.utils import utils

_ONES = jax.nn.initializers.constant(1.0)


def _features(optimizer=None):
  optimizer = optimizer or embedding_spec.SGDOptimizerSpec(learning_rate=0.1)
  init = _ONES
  a = embedding_spec.TableSpec(
    name="a",
    vocabulary_size=40,
    embedding_dim=8,
    initializer=init,
    optimizer=optimizer,
    combiner="sum",
  )
  b = embedding_spec.TableSpec(
    name="b",
    vocabulary_size=100,
    embedding_dim=8,
    initializer=init,
    optimizer=optimizer,
    combiner="sum",
  )
  return [
    embedding_spec.FeatureSpec(
      name="fa", table_spec=a, input_shape=[16, 2], output_shape=[16, 8]
    ),
    embedding_spec.FeatureSpec(
      name="fb", table_spec=b, input_shape=[16, None], output_shape=[16, 8]
    ),
    embedding_spec.FeatureSpec(
      name="fb2", table_spec=b, input_shape=[16, 1], output_shape=[16, 8]
    ),
  ]


def test_stacking_fills_the_specs_in_place_and_returns_none():
  features = _features()
  frozen = pzsc.auto_stack_tables(
    embedding_spec.to_pz(features), 2, num_sc_per_device=4
  )
  frozen = pzsc.prepare_feature_specs_for_training(frozen, 2, 4)
  assert not features[0].table_spec.is_stacked()
  assert table_stacking.auto_stack_tables(features, 2, 4) is None
  assert embedding.prepare_feature_specs_for_training(features, 2, 4) is None
  for compat, new in zip(features, frozen, strict=True):
    assert compat.id_transformation == new.id_transformation
    assert compat.table_spec.setting_in_stack == new.table_spec.setting_in_stack
    stacked = compat.table_spec.stacked_table_spec
    assert stacked.replace(optimizer=new.table_spec.optimizer) == (
      new.table_spec.stacked_table_spec
    )
    # The stack keeps the user's (compat) optimizer object.
    assert stacked.optimizer is compat.table_spec.optimizer
  # Features sharing a table share the compat table object.
  assert features[1].table_spec is features[2].table_spec
  # Equality ignores what stacking filled in, as upstream's.
  assert features[0] == _features()[0]


def test_a_compat_table_takes_a_16_bit_dtype():
  """`dtype` (pz_sparsecore's field) goes through compat stacking into the
  stack; tables of different dtypes never share a stack; a bad one is
  refused naming the table."""
  features = _features()
  features[0].table_spec.dtype = "bfloat16"
  table_stacking.auto_stack_tables(features, 2, 4)
  embedding.prepare_feature_specs_for_training(features, 2, 4)
  a, b = features[0].table_spec, features[1].table_spec
  assert a.stacked_table_spec.dtype == jnp.bfloat16
  assert b.stacked_table_spec.dtype == jnp.float32
  assert a.stacked_table_spec.stack_name != b.stacked_table_spec.stack_name
  assert embedding_spec.table_to_pz(a).dtype == jnp.bfloat16
  bad = _features()
  bad[0].table_spec.dtype = "int8"
  with pytest.raises(ValueError, match=r"table 'a': dtype must be one of"):
    embedding.prepare_feature_specs_for_training(bad, 2, 4)
  # The user's next call, with a dtype of the list, works.
  bad[0].table_spec.dtype = "float16"
  embedding.prepare_feature_specs_for_training(bad, 2, 4)
  assert bad[0].table_spec.stacked_table_spec.dtype == jnp.float16


def test_a_compat_table_takes_an_activation_dtype():
  """`activation_dtype` (pz_sparsecore's field) reaches the frozen spec the
  layer reads; tables of different activation dtypes share a stack; a bad
  one is refused naming the table, then a good one works."""
  features = _features()
  features[1].table_spec.activation_dtype = "bfloat16"
  table_stacking.auto_stack_tables(features, 2, 4)
  embedding.prepare_feature_specs_for_training(features, 2, 4)
  a, b = features[0].table_spec, features[1].table_spec
  assert a.stacked_table_spec.stack_name == b.stacked_table_spec.stack_name
  assert embedding_spec.table_to_pz(b).activation_dtype == jnp.bfloat16
  assert embedding_spec.table_to_pz(a).activation_dtype == jnp.float32
  bad = _features()
  bad[0].table_spec.activation_dtype = "int8"
  with pytest.raises(
    ValueError, match=r"table 'a': activation_dtype must be one of"
  ):
    embedding.prepare_feature_specs_for_training(bad, 2, 4)
  bad[0].table_spec.activation_dtype = "float16"
  embedding.prepare_feature_specs_for_training(bad, 2, 4)
  assert embedding_spec.table_to_pz(bad[0].table_spec).activation_dtype == (
    jnp.float16
  )


def test_stacked_table_refuses_changes_except_through_update():
  features = _features()
  embedding.prepare_feature_specs_for_training(features, 1, 4)
  table = features[0].table_spec
  with pytest.raises(AttributeError, match="update_preprocessing_parameters"):
    table.max_ids_per_partition = 3
  with pytest.raises(AttributeError, match="dataclasses.replace"):
    table.vocabulary_size = 3
  stats = pzsc.SparseDenseMatmulInputStats(
    max_ids_per_partition={"a": np.array([5, 7])},
    max_unique_ids_per_partition={"a": np.array([2, 3])},
  )
  assert embedding.update_preprocessing_parameters(features, stats, 4) is None
  stacked = table.stacked_table_spec
  assert (
    stacked.max_ids_per_partition,
    stacked.max_unique_ids_per_partition,
  ) == (
    7,
    3,
  )
  # The frozen API computes the same from the same specs.
  frozen = pzsc.update_preprocessing_parameters(
    pzsc.prepare_feature_specs_for_training(
      embedding_spec.to_pz(_features()), 1, 4
    ),
    stats,
    4,
  )
  assert frozen[0].table_spec.stacked_table_spec.max_ids_per_partition == 7


def test_optimizer_hyper_parameters_are_assignable():
  opt = embedding_spec.AdagradOptimizerSpec(learning_rate=0.5)
  opt.initial_accumulator_value = 2.0
  opt.learning_rate = lambda step: 0.1 * step
  assert float(opt.get_learning_rate(3)) == pytest.approx(0.3)
  (acc,) = opt.slot_variables_initializers()
  assert float(acc(jax.random.key(0), (1, 1))[0, 0]) == 2.0
  assert type(opt.slot_variables_initializers()).__name__ == (
    "AdagradSlotVariables"
  )
  assert opt.to_pz() == pzsc.AdagradOptimizerSpec(
    learning_rate=opt.learning_rate, initial_accumulator_value=2.0
  )
  assert opt == embedding_spec.AdagradOptimizerSpec(
    learning_rate=opt.learning_rate, initial_accumulator_value=2.0
  )
  assert opt.short_name() == "adagrad"
  with pytest.raises(NotImplementedError, match="sparse_dense_matmul_grad"):
    opt.get_optimizer_primitive().bind(jnp.zeros(1))


def test_preprocessing_equals_the_frozen_api():
  features = _features()
  embedding.auto_stack_tables(features, 1, 4)
  embedding.prepare_feature_specs_for_training(features, 1, 4)
  rng = np.random.default_rng(0)
  ids = [
    rng.integers(0, 40, (16, 2)),
    np.array([rng.integers(0, 100, rng.integers(0, 4)) for _ in range(16)],
             dtype=object),
    rng.integers(0, 100, (16, 1)),
  ]  # fmt: skip
  got, got_stats = embedding.preprocess_sparse_dense_matmul_input(
    ids, None, features, 1, 1, num_sc_per_device=4
  )
  want, want_stats = pzsc.preprocess_sparse_dense_matmul_input(
    ids, None, embedding_spec.to_pz(features), 1, 1, num_sc_per_device=4
  )
  for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids"):
    for stack in getattr(want, field):
      np.testing.assert_array_equal(
        getattr(got, field)[stack], getattr(want, field)[stack]
      )
  np.testing.assert_array_equal(
    got_stats.max_ids_per_partition["a_b"],
    want_stats.max_ids_per_partition["a_b"],
  )
  # The extension-style call returns upstream's tuple.
  row_pointers, *_, num_minibatches, stats = (
    pybind_input_preprocessing.preprocess_sparse_dense_matmul_input(
      ids,
      None,
      features,
      local_device_count=1,
      global_device_count=1,
      num_sc_per_device=4,
      sharding_strategy=pybind_input_preprocessing.ShardingStrategy.MOD,
    )
  )
  np.testing.assert_array_equal(
    row_pointers["a_b"], want.lhs_row_pointers["a_b"]
  )
  assert num_minibatches == 1
  assert embedding.SparseDenseMatmulInputStats.from_cc(stats) is stats
  minibatched, _ = embedding.preprocess_sparse_dense_matmul_input(
    ids, None, features, 1, 1, num_sc_per_device=4, enable_minibatching=True
  )
  assert minibatched.num_minibatches.tolist() == [1]
  assert minibatched.lhs_embedding_ids["a_b"].size == 64 * (
    want.lhs_embedding_ids["a_b"].size
  )


def test_lookups_of_specs_raise_upstreams_errors():
  features = _features()
  twice = [features[0], dataclasses.replace(features[1], name="fa")]
  with pytest.raises(ValueError, match="Feature spec fa is already defined."):
    embedding.get_table_specs(twice)
  with pytest.raises(ValueError, match="prepare_feature_specs_for_training"):
    embedding.get_stacked_table_specs(features)
  with pytest.raises(ValueError, match=r"Table a is repeated in group a_b_a\."):
    table_stacking.stack_tables(features, ["a", "b", "a"], 1, 4)
  # The specs are untouched by the refused call, and stacking then works.
  assert not features[0].table_spec.is_stacked()
  table_stacking.stack_tables(features, ["a", "b"], 1, 4)
  assert set(embedding.get_stacked_table_specs(features)) == {"a_b"}


def test_sizes_with_minibatching_are_upstreams():
  # Upstream sizes minibatched buffers for 64 minibatches.
  sizes = {
    flag: (
      embedding.compute_row_pointers_size_per_device(
        global_device_count=1, num_sc_per_device=4, enable_minibatching=flag
      ),
      embedding.compute_theoretical_max_coo_buffer_size(
        12, 1, num_sc_per_device=4, enable_minibatching=flag
      ),
    )
    for flag in (False, True)
  }
  assert sizes[False] == (32, 4 * 4 * 16)
  assert sizes[True] == (64 * 32, 64 * 4 * 4 * 16)


def test_prepare_takes_tables_of_one_name_as_the_last():
  # Two table objects named "a" that differ only in their initializer: upstream
  # prepares both; the layout is the last one's.
  features = _features()[:1]
  other = dataclasses.replace(
    features[0].table_spec, initializer=jax.nn.initializers.zeros
  )
  features.append(
    embedding_spec.FeatureSpec(
      name="fa2", table_spec=other, input_shape=[16, 1], output_shape=[16, 8]
    )
  )
  embedding.prepare_feature_specs_for_training(features, 1, 4)
  stacks = [f.table_spec.stacked_table_spec for f in features]
  assert stacks[0] == stacks[1]
  assert stacks[0].total_sample_count == 32
  assert [f.id_transformation.row_offset for f in features] == [0, 16]
  # The frozen API refuses two different tables of one name.
  with pytest.raises(ValueError, match="two different TableSpecs"):
    pzsc.prepare_feature_specs_for_training(
      embedding_spec.to_pz(_features()[:1] + features[1:]), 1, 4
    )


def test_hand_stacked_table_without_id_transformation_reads_from_zero():
  features = _features()[:1]
  table_stacking.stack_tables(features, ["a"], 1, 4)
  features[0].id_transformation = None
  ids = [np.random.default_rng(1).integers(0, 40, (16, 2))]
  got, _ = embedding.preprocess_sparse_dense_matmul_input(
    ids, None, features, 1, 1, num_sc_per_device=4
  )
  embedding.prepare_feature_specs_for_training(features, 1, 4)
  assert features[
    0
  ].id_transformation == embedding_spec.FeatureIdTransformation(0, 0, 0)
  want, _ = embedding.preprocess_sparse_dense_matmul_input(
    ids, None, features, 1, 1, num_sc_per_device=4
  )
  for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids"):
    np.testing.assert_array_equal(
      getattr(got, field)["a"], getattr(want, field)["a"]
    )


def test_stats_from_any_subset_of_fields():
  stats = embedding.SparseDenseMatmulInputStats(
    max_ids_per_partition={"s": np.array([1])}
  )
  assert stats.required_buffer_size_per_sc == {}
  assert stats.get_required_buffer_size_per_device("s") is None
  with pytest.raises(
    ValueError, match="num_sc_per_device must be provided.*stack 's'"
  ):
    stats.set_required_buffer_size_per_device("s", 64)
  stats.set_required_buffer_size_per_device("s", 64, num_sc_per_device=4)
  np.testing.assert_array_equal(
    stats.required_buffer_size_per_sc["s"], [16] * 4
  )
  assert stats.get_required_buffer_size_per_device("s") == 64


@pytest.mark.parametrize("mode", ["plain", "jit", "pmap"])
def test_compute_physical_row_ids_traces(mode):
  rows = jnp.arange(40)
  want = pzsc.physical_row_ids(
    pzsc.prepare_feature_specs_for_training(
      embedding_spec.to_pz(_features()[:1]), 2, 4
    )[0].table_spec,
    np.arange(40),
    8,
  )

  def f(r):
    return table_stacking.compute_physical_row_ids(8, 64 * 8 // 8 * 1, 0, 0, r)

  # One table of padded vocabulary 64 on 8 shards: 8 rows per shard.
  if mode == "jit":
    got = jax.jit(f)(rows)
  elif mode == "pmap":
    got = jax.pmap(f)(rows[None])[0]
  else:
    got = f(rows)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_init_embedding_variables_and_table_round_trip():
  features = _features(embedding_spec.AdagradOptimizerSpec())
  embedding.auto_stack_tables(features, 8, 4)
  embedding.prepare_feature_specs_for_training(features, 8, 4)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  sharding = jax.sharding.NamedSharding(
    mesh, jax.sharding.PartitionSpec("x", None)
  )
  variables = embedding.init_embedding_variables(
    jax.random.key(0), embedding.get_table_specs(features), sharding, 4
  )
  table, (acc,) = variables["a_b"]
  assert table.shape == (
    features[0].table_spec.stacked_table_spec.stack_vocab_size,
    8,
  )
  assert float(acc[0, 0]) == pytest.approx(0.1)
  logical = table_stacking.unshard_and_unstack_tables(
    embedding.get_table_specs(features), {"a_b": table}, 32, donate=True
  )
  assert table.is_deleted()
  np.testing.assert_array_equal(logical["a"], np.ones((40, 8)))
  stacked = table_stacking.stack_and_shard_tables(
    embedding.get_table_specs(features), logical, 32, delete_input=True
  )
  assert (
    logical["a"].is_deleted() if isinstance(logical["a"], jax.Array) else True
  )
  assert np.prod(stacked["a_b"].shape) == np.prod(table.shape)
  with pytest.raises(ValueError, match="PartitionSpec"):
    embedding.init_embedding_variables(
      jax.random.key(0),
      embedding.get_table_specs(features),
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x")),
      4,
    )


def test_module_constants_and_sparsecore_count():
  assert constants.PADDING_VALUE == pzsc.PAD_ID == 2**31 - 1
  assert utils.num_sparsecores_per_device(jax.devices()[0]) == 4
  with pytest.raises(ValueError, match="device kind"):
    utils.num_sparsecores_per_device(object())


def test_frozen_api_names_compat_specs_and_the_conversion():
  features = _features()
  embedding.prepare_feature_specs_for_training(features, 1, 4)
  with pytest.raises(
    ValueError, match=r"compat\.lib\.nn\.embedding_spec\.FeatureSpec.*to_pz"
  ):
    pzsc.prepare_feature_specs_for_training(features, 1, 4)
  frozen = embedding_spec.to_pz(features)
  assert pzsc.prepare_feature_specs_for_training(frozen, 1, 4) == frozen


def test_embedding_table_format_is_the_tables_sharding():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  spec = jax.sharding.PartitionSpec("x", None)
  got = utils.embedding_table_format(mesh, spec)
  assert got == jax.sharding.NamedSharding(mesh, spec)
  table = jax.jit(lambda: jnp.zeros((64, 8)), out_shardings=got)()
  assert table.sharding == got


@pytest.mark.parametrize("as_jax", [False, True])
def test_shard_emb_table_is_mod_sharding_and_round_trips(as_jax):
  g, s, vocab, dim = 2, 4, 48, 3
  table = np.random.default_rng(0).normal(size=(vocab, dim)).astype(np.float32)
  given = jnp.asarray(table) if as_jax else table
  sharded = utils.shard_emb_table(given, num_devices=g, num_sc_per_device=s)
  assert isinstance(sharded, jax.Array) == as_jax
  per_shard = vocab // (g * s)
  assert sharded.shape == (g, s * per_shard, dim)
  # Row r lives on shard r % N (device shard // S, its SparseCore shard % S)
  # at place r // N.
  for r in range(vocab):
    shard = r % (g * s)
    device, sc = divmod(shard, s)
    np.testing.assert_array_equal(
      np.asarray(sharded)[device, sc * per_shard + r // (g * s)], table[r]
    )
  back = utils.unshard_emb_table(sharded, num_sc_per_device=s)
  np.testing.assert_array_equal(np.asarray(back), table)
  with pytest.raises(ValueError, match="only MOD"):
    utils.shard_emb_table(
      table, num_devices=g, num_sc_per_device=s, sharding_strategy="DIV"
    )
  with pytest.raises(ValueError, match="48 rows does not split over"):
    utils.shard_emb_table(table, num_devices=g, num_sc_per_device=5)
  with pytest.raises(ValueError, match="do not split over 5 SparseCores"):
    utils.unshard_emb_table(sharded, num_sc_per_device=5)
