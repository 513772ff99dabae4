"""Every malformed input, through the public API: a clear ValueError that
names the feature, and tables, slots and specs left exactly as they were."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc

VOCAB, DIM, BATCH = 64, 8, 16


@pytest.fixture(scope="module")
def embed():
  table = pzsc.TableSpec(
    name="words",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(),
    optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.1),
    combiner="mean",
    max_ids_per_partition=16,
    max_unique_ids_per_partition=16,
  )
  features = {
    "words": pzsc.FeatureSpec(
      name="words",
      table_spec=table,
      input_shape=(BATCH, 3),
      output_shape=(BATCH, DIM),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:4]), ("device",))
  return pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh
  )


def _snapshot(embed):
  return (
    pzsc.logical_tables(embed),
    pzsc.logical_slots(embed),
    embed.config.plan.feature_specs,
  )


def _assert_unchanged(embed, before):
  tables, slots, specs = _snapshot(embed)
  for name, value in before[0].items():
    np.testing.assert_array_equal(tables[name], value)
  for name, value in before[1].items():
    for slot, array in value.items():
      np.testing.assert_array_equal(slots[name][slot], array)
  assert specs == before[2]


def _ids(seed=0, shape=(BATCH, 3)):
  return np.random.default_rng(seed).integers(0, VOCAB, shape)


def _one_partition():
  """Distinct ids that all live in partition 0: 32 pairs per device > 16."""
  return np.random.default_rng(1).integers(0, VOCAB // 4, (BATCH, 8)) * 4


def _ragged(rows):
  out = np.empty(len(rows), dtype=object)
  out[:] = [np.asarray(r, dtype=np.int32) for r in rows]
  return out


def _with(array, index, value):
  array = np.array(array)
  array[index] = value
  return array


BAD_INPUTS = {
  "id above vocabulary": (
    lambda: ({"words": _with(_ids(), (5, 1), VOCAB)}, None),
    r"feature 'words'.*64",
  ),
  "negative id": (
    lambda: ({"words": _with(_ids(), (2, 0), -1)}, None),
    r"feature 'words'.*-1",
  ),
  "float ids": (
    lambda: ({"words": _ids().astype(np.float32)}, None),
    r"feature 'words'.*float",
  ),
  "NaN weight": (
    lambda: (
      {"words": _ids()},
      {"words": _with(np.ones((BATCH, 3), np.float32), (3, 2), np.nan)},
    ),
    r"feature 'words'.*(NaN|nan|finite)",
  ),
  "infinite weight": (
    lambda: (
      {"words": _ids()},
      {"words": _with(np.ones((BATCH, 3), np.float32), (0, 0), np.inf)},
    ),
    r"feature 'words'.*(inf|finite)",
  ),
  "ragged weights do not match ids": (
    lambda: (
      {"words": _ragged([[1, 2]] * BATCH)},
      {"words": _ragged([[1.0]] * BATCH)},
    ),
    r"feature 'words'",
  ),
  "wrong feature name": (
    lambda: ({"wordz": _ids()}, None),
    r"(structure|words|wordz)",
  ),
  "empty batch": (
    lambda: ({"words": _ids(shape=(0, 3))}, None),
    r"feature 'words'",
  ),
  "limits exceeded without dropping": (
    lambda: ({"words": _one_partition()}, None),
    r"words.*partition.*max_ids_per_partition",
  ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_and_changes_nothing(embed, case):
  make, pattern = BAD_INPUTS[case]
  features, weights = make()
  before = _snapshot(embed)
  with pytest.raises(ValueError, match=pattern):
    embed.preprocess(features, weights)
  _assert_unchanged(embed, before)


def test_a_batch_of_another_size_is_padded_not_refused(embed):
  """The layer takes any batch size (`nn.batching`): 14 of the specs' 16
  samples are padded to the bucket and nothing else changes."""
  before = _snapshot(embed)
  inputs, _ = embed.preprocess({"words": _ids(shape=(BATCH - 2, 3))})
  assert inputs.batch.samples == (BATCH - 2,)
  assert embed(inputs)["words"].named_shape == {
    "batch": BATCH - 2,
    "embedding": DIM,
  }
  _assert_unchanged(embed, before)


def test_upstream_preprocessing_refuses_a_batch_of_another_size(embed):
  """Upstream's call keeps its contract: the specs' batch, or an error."""
  with pytest.raises(ValueError, match="feature 'words'"):
    pzsc.preprocess_sparse_dense_matmul_input(
      {"words": _ids(shape=(BATCH - 2, 3))},
      None,
      embed.config.plan.specs_tree,
      4,
      4,
      num_sc_per_device=1,
    )


def test_limits_exceeded_with_dropping_is_allowed(embed):
  # Dropping is never silent: the warning names the stack and the limit.
  with pytest.warns(UserWarning, match="stack 'words'.*ids were dropped"):
    inputs, stats = embed.preprocess(
      {"words": _one_partition()}, allow_id_dropping=True
    )
  assert stats.id_drop_counters["words"] > 0


def test_oversized_suggested_buffer(embed):
  stack = embed.config.plan.stack("words").spec
  too_big = stack.replace(suggested_coo_buffer_size_per_device=10**6)
  specs = jax.tree.map(
    lambda f: f.replace(
      table_spec=f.table_spec.replace(stacked_table_spec=too_big)
    ),
    embed.config.plan.specs_tree,
  )
  before = _snapshot(embed)
  with pytest.raises(ValueError, match=r"words"):
    pzsc.preprocess_sparse_dense_matmul_input(
      {"words": _ids()}, None, specs, 4, 4, num_sc_per_device=1
    )
  _assert_unchanged(embed, before)


@pytest.mark.parametrize(
  "field, dtype",
  [
    ("lhs_embedding_ids", np.float32),
    ("lhs_gains", np.int32),
    ("lhs_row_pointers", np.int16),
  ],
)
def test_wrong_dtype_buffers_fed_to_the_layer(embed, field, dtype):
  inputs, _ = embed.preprocess({"words": _ids()})
  bad = dataclasses.replace(
    inputs,
    **{field: {k: v.astype(dtype) for k, v in getattr(inputs, field).items()}},
  )
  before = _snapshot(embed)
  with pytest.raises(ValueError, match=r"words"):
    pz.variable_jit(lambda e, x: e(x))(embed, bad)
  _assert_unchanged(embed, before)


def test_wrong_shape_buffers_fed_to_the_layer(embed):
  inputs, _ = embed.preprocess({"words": _ids()})
  bad = dataclasses.replace(
    inputs,
    lhs_sample_ids={k: v[:-8] for k, v in inputs.lhs_sample_ids.items()},
  )
  with pytest.raises(ValueError, match=r"words"):
    pz.variable_jit(lambda e, x: e(x))(embed, bad)


def test_not_preprocessed_input(embed):
  with pytest.raises(ValueError, match=r"PreprocessedInput"):
    pz.variable_jit(lambda e, x: e(x))(embed, {"words": _ids()})


def test_bad_logical_tables_write_nothing(embed):
  before = _snapshot(embed)
  with pytest.raises(ValueError, match=r"unknown table"):
    pzsc.set_logical_tables(embed, {"nope": np.zeros((VOCAB, DIM))})
  with pytest.raises(ValueError, match=r"words.*shape"):
    pzsc.set_logical_tables(embed, {"words": np.zeros((VOCAB + 1, DIM))})
  with pytest.raises(ValueError, match=r"words.*finite"):
    pzsc.set_logical_tables(embed, {"words": np.full((VOCAB, DIM), np.nan)})
  _assert_unchanged(embed, before)


def _grad(embed, value):
  return {"words": value}


@pytest.mark.parametrize(
  "grad, match",
  [
    (np.ones((DIM, BATCH), np.float32), r"shape \(8, 16\), expected \(16, 8\)"),
    (np.ones((BATCH, DIM + 1), np.float32), r"shape \(16, 9\)"),
    (np.ones(BATCH * DIM, np.float32), r"shape \(128,\)"),
    (np.ones((BATCH, DIM), np.int32), "floating dtype"),
    (
      pz.nx.wrap(np.ones((BATCH, DIM), np.float32)).tag("batch", "features"),
      "expected the named axes",
    ),
    (
      pz.nx.wrap(np.ones((BATCH, DIM), np.float32)).tag_prefix("batch"),
      "positional shape",
    ),
  ],
  ids=[
    "transposed",
    "wrong size",
    "flat",
    "int",
    "wrong axis name",
    "positional axis",
  ],
)
def test_apply_gradients_refuses_bad_gradients(embed, grad, match):
  inputs, _ = embed.preprocess({"words": _ids()})
  before = _snapshot(embed)
  with pytest.raises(ValueError, match=f"feature 'words'.*{match}"):
    embed.apply_gradients(inputs, _grad(embed, grad), 0)
  _assert_unchanged(embed, before)
  with pytest.raises(ValueError, match=r"unknown features \['wrods'\]"):
    embed.apply_gradients(inputs, {"words": grad, "wrods": grad}, 0)
  _assert_unchanged(embed, before)
  # The next action: a gradient shaped like the activations is applied.
  acts = embed(inputs)["words"]
  embed.apply_gradients(inputs, {"words": acts * 0.0 + 1.0}, 0)
  assert not np.array_equal(
    pzsc.logical_tables(embed)["words"], before[0]["words"]
  )
  pzsc.set_logical_tables(embed, before[0])
  pzsc.set_logical_slots(embed, before[1])


@pytest.mark.parametrize(
  "make, match",
  [
    (
      lambda: pzsc.AdagradOptimizerSpec(initial_accumulator_value=-0.5),
      "AdagradOptimizerSpec: initial_accumulator_value must be >= 0, got -0.5",
    ),
    (
      lambda: pzsc.FTRLOptimizerSpec(initial_accumulator_value=0.0),
      "FTRLOptimizerSpec: initial_accumulator_value must be > 0",
    ),
    (
      lambda: pzsc.FTRLOptimizerSpec(
        initial_accumulator_value=0.0, beta=1.0, learning_rate_power=0.5
      ),
      "positive learning_rate_power",
    ),
    (
      lambda: pzsc.AdagradMomentumOptimizerSpec(epsilon=0.0, beta2=0.9),
      "epsilon must be > 0 when beta2 != 1",
    ),
    (
      lambda: pzsc.AdagradMomentumOptimizerSpec(
        epsilon=0.0, initial_accumulator_value=0.0
      ),
      "initial_accumulator_value must be > 0",
    ),
  ],
)
def test_optimizers_refuse_a_zero_accumulator(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize(
  "spec",
  [
    pzsc.AdagradOptimizerSpec(
      learning_rate=0.5, initial_accumulator_value=1e-30
    ),
    pzsc.FTRLOptimizerSpec(initial_accumulator_value=0.0, beta=1.0),
    pzsc.AdagradMomentumOptimizerSpec(epsilon=0.0),
  ],
  ids=["adagrad tiny", "ftrl beta", "adagrad_momentum"],
)
def test_accepted_accumulators_never_make_nan(spec):
  """Zero gradient components on referenced rows keep the rows finite."""
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(),
    optimizer=spec,
    combiner="sum",
  )
  features = {
    "t": pzsc.FeatureSpec(
      name="t",
      table_spec=table,
      input_shape=(BATCH, 2),
      output_shape=(BATCH, DIM),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:2]), ("device",))
  layer = pzsc.SparseCoreEmbed.from_config(
    "z", jax.random.key(0), features, mesh
  )
  inputs, _ = layer.preprocess({"t": _ids(1, (BATCH, 2))})
  grad = np.zeros((BATCH, DIM), np.float32)
  grad[:, 0] = 1.0  # One component moves; the others have zero gradient.
  for step in range(3):
    layer.apply_gradients(inputs, {"t": grad}, step)
  assert np.all(np.isfinite(pzsc.logical_tables(layer)["t"]))
  for slots in pzsc.logical_slots(layer)["t"].values():
    assert np.all(np.isfinite(slots))
