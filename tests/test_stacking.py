"""Stacking by default: `SparseCoreEmbed.from_config` stacks compatible
tables (upstream's rule), keeping each table's limits, under readable names;
activations and training equal one stack per table."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs

BATCH = 32


def _features(widths=(16,) * 12, optimizers=None):
  """One feature per table: `table_NN` of width `widths[i]`, 20 to 1,200
  rows, its own limits (24 + 4 i: every batch fits), ragged 0-3 ids per
  sample."""
  features = {}
  for i, width in enumerate(widths):
    optimizer = (optimizers or {}).get(i) or specs.AdagradOptimizerSpec(
      learning_rate=0.1
    )
    table = specs.TableSpec(
      name=f"table_{i:02d}",
      vocabulary_size=20 + 100 * i,
      embedding_dim=width,
      initializer=jax.nn.initializers.normal(1.0),
      optimizer=optimizer,
      combiner="sum",
      max_ids_per_partition=24 + 4 * i,
      max_unique_ids_per_partition=24 + 4 * i,
    )
    features[f"f{i:02d}"] = specs.FeatureSpec(
      name=f"f{i:02d}",
      table_spec=table,
      input_shape=(BATCH, 3),
      output_shape=(BATCH, width),
    )
  return features


def _batch(features, seed):
  rng = np.random.default_rng(seed)
  ids = {}
  for name, f in features.items():
    vocab = f.table_spec.vocabulary_size
    rows = []
    for b in range(BATCH):
      row = rng.integers(0, vocab, rng.integers(0, 4))
      if b == 0:
        row = np.asarray([0, vocab - 1])  # shard boundaries
      rows.append(row.astype(np.int32))
    ids[name] = rows
  return ids


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:4]), ("device",))


def _loss_fn(*, model, state, rng, inputs, targets):
  del rng
  acts = model(inputs)
  loss = sum(
    jnp.sum((a.unwrap("batch", "embedding") - targets[k]) ** 2)
    for k, a in acts.items()
  )
  return loss, state, {"loss": loss}


def test_compatible_tables_share_a_stack_with_their_limits(mesh):
  features = _features()
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh
  )
  stacks = embed.config.plan.stacks
  assert [s.name for s in stacks] == ["table_00_and_11_more"]
  spec = stacks[0].spec
  assert spec.max_ids_per_partition == sum(24 + 4 * i for i in range(12))
  assert spec.max_unique_ids_per_partition == spec.max_ids_per_partition
  assert set(embed.tables) == {"table_00_and_11_more"}
  # One stack per table when told.
  alone = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh, stacking=None
  )
  assert [s.name for s in alone.config.plan.stacks] == [
    f"table_{i:02d}" for i in range(12)
  ]


def test_stacked_layer_computes_and_trains_as_one_stack_per_table(mesh):
  """Same logical tables in both layouts: equal activations, and equal
  tables and slots after three Adagrad steps."""
  features = _features()
  layers = [
    pzsc.SparseCoreEmbed.from_config(
      "emb", jax.random.key(0), features, mesh, stacking=stacking
    )
    for stacking in ("auto", None)
  ]
  values = pzsc.logical_tables(layers[1])
  pzsc.set_logical_tables(layers[0], values)
  ids = _batch(features, 1)
  acts = [layer(layer.preprocess(ids)[0]) for layer in layers]
  for name in features:
    np.testing.assert_allclose(
      acts[0][name].unwrap("batch", "embedding"),
      acts[1][name].unwrap("batch", "embedding"),
      rtol=1e-6,
      atol=1e-6,
    )
  rng = np.random.default_rng(2)
  targets = {
    k: jnp.asarray(rng.normal(size=(BATCH, 16)), jnp.float32) for k in features
  }
  trainers = [
    pzsc.SparseCoreTrainer.build(
      jax.random.key(1), layer, optax.sgd(0.1), _loss_fn
    )
    for layer in layers
  ]
  for step in range(3):
    batch = _batch(features, 10 + step)
    for trainer in trainers:
      inputs, _ = trainer.model.preprocess(batch)
      trainer.step(inputs=inputs, targets=targets)
  got, want = (pzsc.logical_tables(t.model) for t in trainers)
  got_slots, want_slots = (pzsc.logical_slots(t.model) for t in trainers)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    for slot in want_slots[name]:
      np.testing.assert_allclose(
        got_slots[name][slot], want_slots[name][slot], rtol=1e-5, atol=1e-6
      )


def test_only_compatible_tables_stack_and_short_names_stay_whole(mesh):
  """Widths 16 and 32 and one FTRL table: two stacks named by their
  tables, the odd table alone under its own name."""
  widths = (16, 16, 32, 32, 16)
  ftrl = specs.FTRLOptimizerSpec(learning_rate=0.1)
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _features(widths, optimizers={4: ftrl}),
    mesh,
  )
  assert [s.name for s in embed.config.plan.stacks] == [
    "table_00_table_01",
    "table_02_table_03",
    "table_04",
  ]
  assert embed.config.plan.stacks[0].spec.max_ids_per_partition == 24 + 28


def test_unknown_stacking_is_refused_then_none_works(mesh):
  features = _features((16, 16))
  with pytest.raises(ValueError, match=r"stacking must be one of .*'stack'"):
    pzsc.SparseCoreEmbed.from_config(
      "emb", jax.random.key(0), features, mesh, stacking="stack"
    )
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh, stacking=None
  )
  assert len(embed.config.plan.stacks) == 2
