"""`SparseCoreEmbed`: logical views, spec updates and input validation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs
from pz_sparsecore.host.preprocess import PreprocessedInput
from pz_sparsecore.nn.embed import ROW_AXIS, SHARD_AXIS, SparseCoreEmbed
from pz_sparsecore.nn.tables import table_arrays

BATCH = 8


def _specs(vocab_a=50, limit=64):
  adagrad = specs.AdagradOptimizerSpec(learning_rate=0.1)
  ta = specs.TableSpec(
    name="ta",
    vocabulary_size=vocab_a,
    embedding_dim=8,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=adagrad,
    combiner="sum",
    max_ids_per_partition=limit,
    max_unique_ids_per_partition=limit,
  )
  tb = specs.TableSpec(
    name="tb",
    vocabulary_size=30,
    embedding_dim=4,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=specs.FTRLOptimizerSpec(learning_rate=0.1),
    combiner="mean",
  )
  return {
    "fa": specs.FeatureSpec(
      name="fa", table_spec=ta, input_shape=(BATCH, 2), output_shape=(BATCH, 8)
    ),
    "fb": specs.FeatureSpec(
      name="fb", table_spec=tb, input_shape=(BATCH, 3), output_shape=(BATCH, 4)
    ),
  }


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:2]), ("device",))


@pytest.fixture(scope="module")
def _shared(mesh):
  embed = SparseCoreEmbed.from_config("emb", jax.random.key(0), _specs(), mesh)
  return embed, pzsc.logical_tables(embed), pzsc.logical_slots(embed)


@pytest.fixture()
def embed(_shared):
  """The module's layer (built once), reset to its initial values."""
  embed, tables, slots = _shared
  pzsc.set_logical_tables(embed, tables)
  pzsc.set_logical_slots(embed, slots)
  return embed


def _batch(seed=0):
  rng = np.random.RandomState(seed)
  return {
    "fa": rng.randint(0, 50, (BATCH, 2)),
    "fb": rng.randint(0, 30, (BATCH, 3)),
  }


def test_variables_labels_and_layout(embed):
  assert set(embed.tables) == {"ta", "tb"}
  table = embed.tables["ta"]
  assert isinstance(table, pz.Parameter)
  assert table.label == "emb/ta.embeddings"
  assert dict(table.value.named_shape) == {
    SHARD_AXIS: 2,
    ROW_AXIS: 32,  # 50 padded to 64 rows over 2 shards.
    "embedding": 8,
  }
  assert {v.label for v in embed.slots["tb"].values()} == {
    "emb/tb.accumulator",
    "emb/tb.linear",
  }
  assert all(
    isinstance(v, pz.StateVariable) for v in embed.slots["ta"].values()
  )
  assert pz.select(embed).at_instances_of(SparseCoreEmbed).count() == 1


def test_logical_tables_round_trip_subset(embed):
  rng = np.random.RandomState(1)
  before = pzsc.logical_tables(embed)
  assert before["ta"].shape == (50, 8) and before["tb"].shape == (30, 4)
  new_a = rng.normal(size=(50, 8)).astype(np.float32)
  pzsc.set_logical_tables(embed, {"ta": new_a})
  after = pzsc.logical_tables(embed)
  np.testing.assert_array_equal(after["ta"], new_a)
  np.testing.assert_array_equal(after["tb"], before["tb"])
  # The written rows are where MOD sharding puts them: id i on shard i % 2.
  table = np.asarray(table_arrays(embed)["ta"])
  np.testing.assert_array_equal(table[1, 3], new_a[7])
  np.testing.assert_array_equal(table[0, 24], new_a[48])


@pytest.mark.parametrize(
  "values,match",
  [
    ({"nope": np.zeros((50, 8))}, "unknown table"),
    ({"ta": np.zeros((50, 7))}, r"expected shape \(50, 8\)"),
    ({"tb": np.zeros((30, 4)), "ta": np.zeros((49, 8))}, "expected shape"),
    ({"ta": np.full((50, 8), np.nan)}, "finite"),
  ],
)
def test_set_logical_tables_rejects_and_writes_nothing(embed, values, match):
  before = pzsc.logical_tables(embed)
  with pytest.raises(ValueError, match=match):
    pzsc.set_logical_tables(embed, values)
  after = pzsc.logical_tables(embed)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name])


def test_logical_slots_round_trip(embed):
  slots = pzsc.logical_slots(embed)
  assert set(slots) == {"ta", "tb"}
  assert set(slots["tb"]) == {"accumulator", "linear"}
  np.testing.assert_array_equal(slots["ta"]["accumulator"], np.float32(0.1))
  new = np.arange(30 * 4, dtype=np.float32).reshape(30, 4)
  pzsc.set_logical_slots(embed, {"tb": {"linear": new}})
  after = pzsc.logical_slots(embed)
  np.testing.assert_array_equal(after["tb"]["linear"], new)
  np.testing.assert_array_equal(
    after["tb"]["accumulator"], slots["tb"]["accumulator"]
  )
  np.testing.assert_array_equal(
    after["ta"]["accumulator"], slots["ta"]["accumulator"]
  )


@pytest.mark.parametrize(
  "values",
  [
    {"tb": {"velocity": np.zeros((30, 4))}},
    {"nope": {"linear": np.zeros((30, 4))}},
    {
      "ta": {"accumulator": np.ones((50, 8))},
      "tb": {"linear": np.ones((3, 4))},
    },
    {"ta": {"accumulator": np.ones((50, 8))}, "tb": {"bad": np.ones((30, 4))}},
  ],
)
def test_set_logical_slots_rejects_and_writes_nothing(embed, values):
  before = pzsc.logical_slots(embed)
  with pytest.raises(ValueError):
    pzsc.set_logical_slots(embed, values)
  after = pzsc.logical_slots(embed)
  for table, slots in before.items():
    for slot, value in slots.items():
      np.testing.assert_array_equal(after[table][slot], value)


def test_with_feature_specs_shares_variables_and_changes_limits(embed):
  new = pzsc.with_feature_specs(embed, _specs(limit=16))
  assert new.tables["ta"] is embed.tables["ta"]
  assert new.slots["ta"]["accumulator"] is embed.slots["ta"]["accumulator"]
  assert new.config.plan.stack("ta").spec.max_ids_per_partition == 16
  # A write through one is seen by the other.
  value = np.ones((50, 8), np.float32)
  pzsc.set_logical_tables(new, {"ta": value})
  np.testing.assert_array_equal(pzsc.logical_tables(embed)["ta"], value)
  inputs, _ = new.preprocess(_batch())
  out = new(inputs)
  np.testing.assert_allclose(out["fa"].unwrap("batch", "embedding"), 2.0)


def test_with_feature_specs_rejects_layout_changes(embed):
  with pytest.raises(ValueError, match="change more than the limits"):
    pzsc.with_feature_specs(embed, _specs(vocab_a=200))
  with pytest.raises(ValueError, match="structure"):
    pzsc.with_feature_specs(embed, {"fa": _specs()["fa"]})


def _loss_fn(*, model, state, rng, inputs):
  del rng
  acts = model(inputs)
  loss = sum(jnp.sum(a.unwrap(*a.named_shape) ** 2) for a in acts.values())
  return loss, state, {"loss": loss}


def test_update_limits_refreshes_the_layer_inside_the_trainer(embed):
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.01), _loss_fn
  )
  inputs, stats = trainer.model.preprocess(_batch(0))
  trainer.step(inputs=inputs)
  observed = int(np.max(stats.max_ids_per_partition["ta"]))
  assert observed < 64
  refreshed = pzsc.update_limits(trainer, stats)
  layer = refreshed.model
  assert layer.config.plan.stack("ta").spec.max_ids_per_partition == observed
  assert layer.tables["ta"] is embed.tables["ta"]
  # The old layer's buffers no longer fit; the message names the call.
  with pytest.raises(ValueError, match=r"pzsc.update_limits\(trainer"):
    refreshed.step(inputs=inputs)
  # The next action: preprocess with the refreshed layer and train on (the
  # observed batch fits the limits observed on it).
  before = pzsc.logical_tables(layer)["ta"]
  refreshed.step(inputs=layer.preprocess(_batch(0))[0])
  assert int(refreshed.state.value.step) == 2
  assert not np.array_equal(pzsc.logical_tables(layer)["ta"], before)
  # Headroom scales the observed counts; a tree without layers is refused.
  roomy = pzsc.update_limits(embed, stats, headroom=2.0)
  assert roomy.config.plan.stack("ta").spec.max_ids_per_partition == (
    2 * observed
  )
  with pytest.raises(ValueError, match="holds no SparseCoreEmbed"):
    pzsc.update_limits({"w": jnp.zeros(3)}, stats)


def test_preprocess_rejects_wrong_structure(embed):
  # A wrong feature name: the expected and given names, plainly.
  ids = {"fa": _batch()["fa"], "fc": _batch()["fb"]}
  with pytest.raises(
    ValueError,
    match=r"expected the keys \['fa', 'fb'\], got \['fa', 'fc'\] "
    r"\(missing \['fb'\], unknown \['fc'\]\)",
  ):
    embed.preprocess(ids)
  with pytest.raises(ValueError, match="structure"):
    embed.preprocess([_batch()["fa"], _batch()["fb"]])


@pytest.mark.parametrize("bad", [50, -1, 10**12])
def test_preprocess_rejects_bad_ids_naming_the_feature(embed, bad):
  ids = _batch()
  ids["fa"][3, 1] = bad
  with pytest.raises(ValueError, match="'fa'|fa"):
    embed.preprocess(ids)


def test_preprocess_rejects_float_ids_and_bad_batch(embed):
  ids = _batch()
  ids["fb"] = ids["fb"].astype(np.float32)
  with pytest.raises(ValueError, match="fb"):
    embed.preprocess(ids)
  ids = _batch()
  ids["fb"] = ids["fb"][:5]
  with pytest.raises(ValueError, match="fb"):
    embed.preprocess(ids)


def test_call_rejects_wrong_buffers(embed):
  inputs, _ = embed.preprocess(_batch())
  with pytest.raises(ValueError, match="PreprocessedInput"):
    embed({"fa": inputs})
  bad_dtype = dataclasses.replace(
    inputs,
    lhs_gains={k: v.astype(jnp.float16) for k, v in inputs.lhs_gains.items()},
  )
  with pytest.raises(ValueError, match="lhs_gains"):
    embed(bad_dtype)
  bad_shape = dataclasses.replace(
    inputs,
    lhs_embedding_ids={
      k: jnp.concatenate([v, v]) for k, v in inputs.lhs_embedding_ids.items()
    },
  )
  with pytest.raises(ValueError, match="lhs_embedding_ids"):
    embed(bad_shape)
  missing = dataclasses.replace(
    inputs, lhs_sample_ids={"ta": inputs.lhs_sample_ids["ta"]}
  )
  with pytest.raises(ValueError, match="stacks"):
    embed(missing)
  assert isinstance(inputs, PreprocessedInput)


def test_unknown_side_inputs_are_ignored(embed):
  inputs, _ = embed.preprocess(_batch())
  out = embed(inputs, some_side_input=3)
  assert set(out) == {"fa", "fb"}


def test_from_config_rejects_bad_arguments(mesh):
  with pytest.raises(ValueError, match="Mesh"):
    SparseCoreEmbed.from_config("e", jax.random.key(0), _specs(), "mesh")
  with pytest.raises(ValueError, match="shard axis maps to mesh axis .x."):
    SparseCoreEmbed.from_config(
      "e", jax.random.key(0), _specs(), mesh, sharding_axis="x"
    )
  with pytest.raises(ValueError, match="sample axes"):
    SparseCoreEmbed.from_config(
      "e", jax.random.key(0), _specs(), mesh, feature_axes=("batch", "seq")
    )
  with pytest.raises(ValueError, match="divide"):
    SparseCoreEmbed.from_config(
      "e", jax.random.key(0), _specs(), mesh, num_sc_per_device=8
    )
  # Everything after the mesh is keyword-only.
  with pytest.raises(TypeError, match="positional"):
    SparseCoreEmbed.from_config("e", jax.random.key(0), _specs(), mesh, "x")


@pytest.mark.parametrize("devices", [1, 8])
def test_one_dimensional_table_with_one_id_per_sample(devices):
  # embedding_dim=1 and [batch, 1] inputs (upstream's newer releases): the
  # lookup and an Adagrad step against numpy, duplicates and shard edges
  # included.
  batch, vocab = 32, 37
  table = specs.TableSpec(
    name="t",
    vocabulary_size=vocab,
    embedding_dim=1,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=specs.AdagradOptimizerSpec(learning_rate=0.5),
    combiner="sum",
  )
  feature = specs.FeatureSpec(
    name="f", table_spec=table, input_shape=(batch, 1), output_shape=(batch, 1)
  )
  one_mesh = Mesh(np.array(jax.devices()[:devices]), ("device",))
  embed = SparseCoreEmbed.from_config(
    "e", jax.random.key(0), {"f": feature}, one_mesh
  )
  ids = np.random.default_rng(0).integers(0, vocab, (batch, 1))
  ids[:4, 0] = [0, vocab - 1, vocab - 1, 8]  # edges, a duplicate
  inputs, _ = embed.preprocess({"f": ids})
  before = pzsc.logical_tables(embed)["t"]
  assert before.shape == (vocab, 1)
  act = embed(inputs)["f"]
  assert dict(act.named_shape) == {"batch": batch, "embedding": 1}
  np.testing.assert_array_equal(
    np.asarray(act.unwrap("batch", "embedding"))[:, 0], before[ids[:, 0], 0]
  )
  grads = np.random.default_rng(1).normal(size=(batch,)).astype(np.float32)
  embed.apply_gradients(
    inputs, {"f": pz.nx.wrap(grads[:, None], "batch", "embedding")}, 0
  )
  row_grad = np.zeros(vocab)
  np.add.at(row_grad, ids[:, 0], grads.astype(np.float64))
  accumulator = 0.1 + row_grad**2
  want = before[:, 0] - 0.5 * row_grad / np.sqrt(accumulator)
  touched = np.unique(ids)
  after = pzsc.logical_tables(embed)["t"][:, 0]
  np.testing.assert_allclose(after[touched], want[touched], rtol=1e-5)
  untouched = np.setdiff1d(np.arange(vocab), touched)
  np.testing.assert_array_equal(after[untouched], before[untouched, 0])


def _one_stack_layer(mesh, inits, vocabs, dim, dtype=jnp.float32):
  """A layer whose tables `t{i}` (initializer `inits[i]`, `vocabs[i]` rows,
  SGD) share one stack; returns the stack, the shard count, the stack's
  `[N, V_shard, D]` values as float32 and the stack's per-shard keys."""
  features = {}
  for i, (init, vocab) in enumerate(zip(inits, vocabs, strict=True)):
    table = specs.TableSpec(
      name=f"t{i}",
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=init,
      optimizer=specs.SGDOptimizerSpec(learning_rate=0.1),
      combiner="sum",
      dtype=dtype,
    )
    features[f"f{i}"] = specs.FeatureSpec(
      name=f"f{i}",
      table_spec=table,
      input_shape=(BATCH, 1),
      output_shape=(BATCH, dim),
    )
  embed = SparseCoreEmbed.from_config(
    "emb", jax.random.key(7), features, mesh, num_sc_per_device=2
  )
  (stack,) = embed.config.plan.stacks
  n = embed.config.topology.num_shards
  table = embed.tables[stack.name]
  got = np.asarray(
    table.value.unwrap(SHARD_AXIS, ROW_AXIS, "embedding"), np.float32
  )
  keys = jax.random.split(
    pz.nn.derive_param_key(jax.random.key(7), table.label), n
  )
  return stack, n, got, keys


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_stack_too_large_to_draw_at_once_is_drawn_in_blocks(
  mesh, monkeypatch, dtype
):
  """A stack with a member over `_FILL_BLOCK_BYTES` of float32 rows per
  shard: member `i`'s rows of shard `g` are drawn in blocks of B rows,
  block `b` from `fold_in(fold_in(keys[g], i), b)`, the last block ending
  at the member's last row; a 16-bit table holds the float32 draw rounded
  to nearest."""
  from pz_sparsecore.nn import embed as embed_module

  dim, block = 8, 5
  monkeypatch.setattr(embed_module, "_FILL_BLOCK_BYTES", block * dim * 4)
  inits = [jax.nn.initializers.normal(0.5), jax.nn.initializers.uniform(0.2)]
  stack, n, got, keys = _one_stack_layer(mesh, inits, (93, 30), dim, dtype)
  for i, (t, init) in enumerate(zip(stack.tables, inits, strict=True)):
    rows = t.setting_in_stack.padded_vocab_size // n
    start = t.setting_in_stack.row_offset_in_shard
    assert rows > block  # Several blocks, the last one overlapping.
    for g in range(n):
      want = np.zeros((rows, dim), np.float32)
      for b, lo in enumerate(range(0, rows, block)):
        key = jax.random.fold_in(jax.random.fold_in(keys[g], i), b)
        at = min(lo, rows - block)
        drawn = np.asarray(init(key, (block, dim), jnp.float32))
        want[at : at + block] = drawn
      want = np.asarray(jnp.asarray(want).astype(dtype), np.float32)
      np.testing.assert_array_equal(got[g, start : start + rows], want)


def test_initial_rows_are_each_tables_own_draw(mesh):
  """Every member table of a stack starts as its initializer's draw of
  shape `[padded_vocab / N, D]` from key `g` of the stack's keys on shard
  `g`, whether members share one draw (equal jax initializers) or not
  (shape-dependent and user initializers)."""
  inits = [
    jax.nn.initializers.normal(0.5),
    jax.nn.initializers.normal(0.5),  # Equal to the first: one draw.
    jax.nn.initializers.normal(2.0),
    jax.nn.initializers.uniform(0.2),
    jax.nn.initializers.glorot_normal(),  # Depends on the shape.
    lambda key, shape, dtype=jnp.float32: jax.random.normal(key, shape) + 3,
  ]
  vocabs = [40 + 17 * i for i in range(len(inits))]
  stack, n, got, keys = _one_stack_layer(mesh, inits, vocabs, 8)
  for t, init in zip(stack.tables, inits, strict=True):
    setting = t.setting_in_stack
    rows = setting.padded_vocab_size // n
    start = setting.row_offset_in_shard
    for g in range(n):
      want = np.asarray(init(keys[g], (rows, 8), jnp.float32))
      # Up to rounding: jit fuses the user function's arithmetic.
      np.testing.assert_allclose(
        got[g, start : start + rows], want, rtol=1e-6, atol=1e-6
      )


def test_specs_stacked_for_another_topology_are_refused():
  """A stack prepared for 8 shards on 4: the second table's block would
  start at row 8 of each shard where the kernels put it at row 16, and the
  first table's rows 8-15 of each shard would be the second's."""

  def features():
    out = {}
    for name, vocab in (("a", 64), ("b", 128)):
      table = specs.TableSpec(
        name=name,
        vocabulary_size=vocab,
        embedding_dim=8,
        initializer=jax.nn.initializers.zeros,
        optimizer=specs.SGDOptimizerSpec(),
        combiner="sum",
      )
      out[name] = specs.FeatureSpec(
        name=name, table_spec=table, input_shape=(8, 1), output_shape=(8, 8)
      )
    return pzsc.stack_tables(out, ["a", "b"], 4, 2, 0)

  mesh4 = Mesh(np.array(jax.devices()[:4]), ("device",))
  with pytest.raises(ValueError, match="table 'b' was prepared for another"):
    SparseCoreEmbed.from_config("e", jax.random.key(0), features(), mesh4)
  # The user's next step: the same specs on the topology they were stacked
  # for restore the layer, and a round trip of the tables is exact.
  embed = SparseCoreEmbed.from_config(
    "e", jax.random.key(0), features(), mesh4, num_sc_per_device=2
  )
  values = {
    "a": np.arange(64 * 8, dtype=np.float32).reshape(64, 8),
    "b": -np.arange(128 * 8, dtype=np.float32).reshape(128, 8),
  }
  pzsc.set_logical_tables(embed, values)
  got = pzsc.logical_tables(embed)
  for name, value in values.items():
    np.testing.assert_array_equal(got[name], value)
