"""Replicated tables: every device holds the stack, looks up locally, and
every copy takes the same update.

A layer whose small tables are replicated (by hand or by the cost model)
must look up, train and checkpoint exactly as the same tables sharded: its
activations equal a numpy gather, one Adagrad step equals a numpy
restatement of it (row gradients summed over every device's samples), a
few Adam steps with `check_finite` equal the sharded layer's (rows the
batches never reference stay bit-identical), its copies stay equal on every
device, its update moves the bytes `exchange.predict_bytes` says, and its
checkpoints restore onto sharded layers and back. Bad placements are
refused naming the table, and the corrected call works.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import pz_sparsecore as pzsc
from pz_sparsecore.device import exchange, replication, routing
from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.tables import table_arrays

BATCH = 64
# (vocabulary, width): one large table, two small ones, one small and
# narrow; ids of the small ones hit every row, with duplicates.
TABLES = {
  "big": (5_000, 16),
  "tiny": (10, 16),
  "small": (300, 16),
  "n8": (40, 8),
}
SMALL = ("tiny", "small", "n8")


def _specs(optimizer, batch: int = BATCH) -> dict:
  out = {}
  for name, (vocab, dim) in TABLES.items():
    table = pzsc.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=optimizer,
      combiner="sum",
    )
    out[f"f_{name}"] = pzsc.FeatureSpec(
      name=f"f_{name}",
      table_spec=table,
      input_shape=(batch, 4),
      output_shape=(batch, dim),
    )
  return out


def _mesh(g: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:g]), ("device",))


def _layer(optimizer, placement, g: int = 8, s: int = 1, rng=0):
  return pzsc.SparseCoreEmbed.from_config(
    "emb",
    None if rng is None else jax.random.key(rng),
    _specs(optimizer),
    _mesh(g),
    num_sc_per_device=s,
    placement=placement,
  )


def _batch(seed: int) -> dict:
  """Ragged rows of 0-4 ids (empty rows, duplicates; ids 0 and the last
  row of each table, the shard boundaries of the MOD layout)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, (vocab, _) in TABLES.items():
    rows = []
    for i in range(BATCH):
      k = int(rng.integers(0, 5))
      ids = rng.integers(0, vocab, k)
      if i % 7 == 0 and k:
        ids[0] = 0 if i % 14 else vocab - 1
      if i % 5 == 0 and k > 1:
        ids[1] = ids[0]
      rows.append(ids.astype(np.int32))
    out[f"f_{name}"] = np.array(rows, dtype=object)
  return out


def _initial(seed: int = 3) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    name: rng.normal(0, 0.1, (vocab, dim)).astype(np.float32)
    for name, (vocab, dim) in TABLES.items()
  }


REPLICATE_SMALL = {name: "replicated" for name in SMALL}


def _loss_fn(*, model, state, rng, inputs, target):
  del rng
  acts = model(inputs)
  loss = sum(
    jnp.sum((a.unwrap("batch", "embedding") - target) ** 2)
    for a in acts.values()
  )
  return loss, state, {"loss": loss}


def test_replicated_lookup_equals_a_numpy_gather_and_one_adagrad_step_numpy():
  """Forward: each sample's sum of its rows. One step of Adagrad: every
  referenced row's gradient summed over all 8 devices' samples, then
  acc += g^2, w -= lr g / sqrt(acc), once per row; other rows untouched."""
  lr, acc0 = 0.1, 0.1
  optimizer = pzsc.AdagradOptimizerSpec(
    learning_rate=lr, initial_accumulator_value=acc0
  )
  embed = _layer(optimizer, REPLICATE_SMALL)
  topo = embed.config.topology
  replicated = sorted(topo.replicated)
  assert replicated and all(topo.is_replicated(name) for name in replicated)
  for stack in embed.config.plan.stacks:
    members = {t.name for t in stack.tables}
    assert (stack.name in topo.replicated) == (members <= set(SMALL))
    assert members <= set(SMALL) or not members & set(SMALL)
  initial = _initial()
  pzsc.set_logical_tables(embed, initial)
  batch = _batch(0)
  inputs, _ = embed.preprocess(batch)
  acts = embed(inputs)
  target = 0.25
  for name in TABLES:
    want = np.stack([initial[name][ids].sum(0) for ids in batch[f"f_{name}"]])
    got = np.asarray(acts[f"f_{name}"].unwrap("batch", "embedding"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.0), _loss_fn
  )
  trainer.step(inputs=inputs, target=target)
  tables = pzsc.logical_tables(trainer.model)
  for name in SMALL:
    w, acc = initial[name].copy(), np.full_like(initial[name], acc0)
    grad = np.zeros_like(w)
    for ids in batch[f"f_{name}"]:
      g_act = 2 * (w[ids].sum(0) - target)
      for i in ids:
        grad[i] += g_act
    touched = np.zeros(len(w), bool)
    for ids in batch[f"f_{name}"]:
      touched[ids] = True
    acc[touched] += grad[touched] ** 2
    w[touched] -= lr * grad[touched] / np.sqrt(acc[touched])
    np.testing.assert_allclose(tables[name], w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(
      tables[name][~touched], initial[name][~touched]
    )
  for name, var in trainer.model.tables.items():
    if name in topo.replicated:
      copies = [
        np.asarray(s.data) for s in var.value.data_array.addressable_shards
      ]
      assert len(copies) == 8
      for copy in copies[1:]:
        np.testing.assert_array_equal(copy, copies[0], err_msg=name)


# 4 devices x 2 SparseCores (8 x 1 is the numpy test's topology).
@pytest.mark.parametrize("g,s", [(4, 2)])
def test_replicated_adam_with_guard_trains_as_sharded(g, s):
  """Three Adam steps with `check_finite` (so the guarded update path):
  tables and both slots equal the all-sharded layer's; the rows no batch
  references (Adam would move them if they were updated) are unchanged
  bit for bit, and the replicated copies stay equal."""
  optimizer = pzsc.AdamOptimizerSpec(learning_rate=0.05)
  results, touched = {}, {n: np.zeros(v, bool) for n, (v, _) in TABLES.items()}
  initial = _initial()
  for placement in (REPLICATE_SMALL, "sharded"):
    embed = _layer(optimizer, placement, g, s)
    pzsc.set_logical_tables(embed, initial)
    trainer = pzsc.SparseCoreTrainer.build(
      jax.random.key(1), embed, optax.sgd(0.0), _loss_fn, check_finite=True
    )
    for step in range(3):
      batch = _batch(10 + step)
      for name in TABLES:
        for ids in batch[f"f_{name}"]:
          touched[name][ids] = True
      inputs, _ = trainer.model.preprocess(batch)
      trainer.step(inputs=inputs, target=0.25)
    key = "replicated" if isinstance(placement, dict) else placement
    results[key] = (
      pzsc.logical_tables(trainer.model),
      pzsc.logical_slots(trainer.model),
    )
    if key == "replicated":
      assert trainer.model.config.topology.replicated
      for name, var in trainer.model.tables.items():
        if trainer.model.config.topology.is_replicated(name):
          arrays = [var.value.data_array]
          arrays += [
            v.value.data_array for v in trainer.model.slots[name].values()
          ]
          for array in arrays:
            copies = [np.asarray(x.data) for x in array.addressable_shards]
            for copy in copies[1:]:
              np.testing.assert_array_equal(copy, copies[0])
  (rep_tables, rep_slots), (sh_tables, sh_slots) = (
    results["replicated"],
    results["sharded"],
  )
  for name in TABLES:
    np.testing.assert_allclose(
      rep_tables[name], sh_tables[name], rtol=1e-5, atol=1e-6, err_msg=name
    )
    for slot in rep_slots[name]:
      np.testing.assert_allclose(
        rep_slots[name][slot], sh_slots[name][slot], rtol=1e-5, atol=1e-7
      )
    untouched = ~touched[name]
    np.testing.assert_array_equal(
      rep_tables[name][untouched], initial[name][untouched]
    )
  assert any((~t).any() for t in touched.values())


def test_auto_placement_follows_the_cost_model():
  """`auto` replicates the small tables whose bytes beat the exchange and
  that fit `max_replicated_bytes`; the numbers are the documented formulas;
  `describe` says where each stack lives; one device replicates nothing."""
  optimizer = pzsc.AdagradOptimizerSpec(learning_rate=0.1)
  embed = _layer(optimizer, "auto")
  plan, topo = embed.config.plan, embed.config.topology
  placed = {
    t.name: topo.is_replicated(stack.name)
    for stack in plan.stacks
    for t in stack.tables
  }
  assert placed == {"big": False, "tiny": True, "small": True, "n8": True}
  for stack in plan.stacks:
    rows = plan.num_shards * stack.rows_per_shard
    chosen = topo.exchange_of(stack)
    if topo.is_replicated(stack.name):
      assert chosen.mode == exchange.REPLICATED
      assert chosen.by_mode["replicated"].step == 4 * rows * (stack.dim + 1)
    else:
      assert chosen.mode in ("activations", "rows")
  text = pzsc.viz.describe(embed)
  assert "placement: replicated on every device (8 copies)" in text
  assert "placement: sharded over 'device'" in text
  # The figures say which stacks every device holds whole.
  note = "replicated: each of the 8 devices holds all 8 shards"
  for stack in plan.stacks:
    figure = pzsc.viz.to_html(
      pzsc.viz.shard_map_figure(embed, stack=stack.name)
    )
    assert (note in figure) == topo.is_replicated(stack.name)
  owner = pzsc.viz.to_html(pzsc.viz.row_owner_figure(embed, "tiny"))
  assert note in owner
  assert note not in pzsc.viz.to_html(pzsc.viz.row_owner_figure(embed, "big"))
  # The memory bound: nothing fits in 1 KB; one device: nothing replicated.
  small = _layer(optimizer, "auto", rng=None)
  bound = pzsc.SparseCoreEmbed.from_config(
    "emb",
    None,
    _specs(optimizer),
    _mesh(8),
    placement="auto",
    max_replicated_bytes=1024,
  )
  assert (
    small.config.topology.replicated and not bound.config.topology.replicated
  )
  alone = _layer(optimizer, "auto", g=1)
  assert not alone.config.topology.replicated
  # The docstring's example.
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=1000,
    embedding_dim=16,
    initializer=jax.nn.initializers.zeros,
    optimizer=optimizer,
    combiner="sum",
  )
  feature = pzsc.FeatureSpec(
    name="f", table_spec=table, input_shape=(2048, 1), output_shape=(2048, 16)
  )
  one = pzsc.SparseCoreEmbed.from_config(
    "e", None, {"f": feature}, _mesh(8), placement="auto"
  )
  stack = one.config.plan.stacks[0]
  cost = replication.cost(one.config.plan, stack)
  assert (cost.replicated_bytes, cost.replicated_step, cost.sharded_step) == (
    131_072,
    69_632,
    135_200,
  )
  assert one.config.topology.is_replicated(stack.name)
  # A bfloat16 table takes 2 bytes per value; its slot stays float32.
  half = pzsc.SparseCoreEmbed.from_config(
    "e",
    None,
    {
      "f": feature.replace(
        table_spec=table.replace(dtype=jnp.bfloat16, optimizer=optimizer)
      )
    },
    _mesh(8),
    placement="auto",
  )
  cost = replication.cost(half.config.plan, half.config.plan.stacks[0])
  assert cost.replicated_bytes == 1024 * 16 * (2 + 4)


def test_replicated_update_moves_the_predicted_bytes():
  """The compiled update of a replicated SGD stack all-reduces exactly
  `4 * rows * (dim + 1)` bytes per device, and its lookup moves none."""
  embed = _layer(pzsc.SGDOptimizerSpec(learning_rate=0.1), "auto")
  inputs, _ = embed.preprocess(_batch(1))
  plan, topo = embed.config.plan, embed.config.topology
  only = [s for s in plan.stacks if topo.is_replicated(s.name)]
  assert only
  measured = routing.compiled_exchange_bytes(
    plan, topo, table_arrays(embed), inputs, ("lookup", "update")
  )
  sharded = [s for s in plan.stacks if not topo.is_replicated(s.name)]
  predicted = [topo.exchange_of(s).by_mode for s in plan.stacks]
  want_update = sum(
    topo.exchange_of(s).by_mode[topo.exchange_of(s).mode].update
    for s in plan.stacks
  )
  want_lookup = sum(
    topo.exchange_of(s).by_mode[topo.exchange_of(s).mode].lookup
    for s in sharded
  )
  assert predicted and measured == {
    "lookup": want_lookup,
    "update": want_update,
  }


def test_bad_placements_are_refused_then_the_fixed_call_works():
  optimizer = pzsc.AdagradOptimizerSpec(learning_rate=0.1)
  cases = [
    ({"nope": "replicated"}, "'nope'"),
    ({"tiny": "everywhere"}, "'tiny'.*'everywhere'"),
    ("everywhere", "'everywhere'"),
  ]
  for placement, match in cases:
    with pytest.raises(ValueError, match=match):
      _layer(optimizer, placement, rng=None)
  # A stack made by hand takes one placement.
  specs = pzsc.stack_tables(_specs(optimizer), ["tiny", "small"], 8, 1)
  with pytest.raises(ValueError, match="'tiny'.*'small'|tiny_small|share one"):
    pzsc.SparseCoreEmbed.from_config(
      "emb",
      None,
      specs,
      _mesh(8),
      placement={"tiny": "replicated", "small": "sharded"},
    )
  fixed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    specs,
    _mesh(8),
    placement={"tiny": "replicated", "small": "replicated"},
  )
  stack = fixed.config.plan.stack_of_table["tiny"].name
  assert fixed.config.plan.stack_of_table["small"].name == stack
  assert fixed.config.topology.is_replicated(stack)
  inputs, _ = fixed.preprocess(_batch(2))
  fixed(inputs)


def test_checkpoints_move_between_placements_and_device_counts(tmp_path):
  """A replicated layer's checkpoint restores onto itself, onto an
  all-sharded layer on 4 devices (another stacking) and from there back
  onto a replicated one on 8: tables and slots equal the saved ones, and
  land where the layer places them."""
  optimizer = pzsc.AdagradOptimizerSpec(learning_rate=0.1)
  embed = _layer(optimizer, REPLICATE_SMALL)
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.0), _loss_fn
  )
  inputs, _ = trainer.model.preprocess(_batch(4))
  trainer.step(inputs=inputs, target=0.5)
  saved = trainer.model
  want = (pzsc.logical_tables(saved), pzsc.logical_slots(saved))
  save_checkpoint(tmp_path / "rep", saved)
  sharded = restore_checkpoint(
    tmp_path / "rep", _layer(optimizer, "sharded", g=4, rng=None)
  )
  assert not sharded.config.topology.replicated
  save_checkpoint(tmp_path / "sh", sharded)
  back = restore_checkpoint(
    tmp_path / "sh", _layer(optimizer, REPLICATE_SMALL, rng=None)
  )
  same = restore_checkpoint(
    tmp_path / "rep", _layer(optimizer, REPLICATE_SMALL, rng=None)
  )
  for restored in (sharded, back, same):
    got = (pzsc.logical_tables(restored), pzsc.logical_slots(restored))
    for name in TABLES:
      np.testing.assert_array_equal(got[0][name], want[0][name])
      for slot in want[1][name]:
        np.testing.assert_array_equal(got[1][name][slot], want[1][name][slot])
  for layer in (back, same):
    for name, var in layer.tables.items():
      want_sharding = layer.config.topology.table_sharding(name)
      assert var.value.data_array.sharding.is_equivalent_to(want_sharding, 3)
    assert any(layer.config.topology.is_replicated(n) for n in layer.tables)


def test_minibatched_steps_and_fit_with_limit_refreshes_train_as_sharded():
  """Minibatched buffers (the update loops over minibatches, all-reducing
  each) and `fit` with limits calibrated and refreshed (the layer is
  re-specified; the replicated stacks stay replicated): the tables equal
  the all-sharded layer's."""
  optimizer = pzsc.AdagradOptimizerSpec(learning_rate=0.1)
  initial, results = _initial(), []
  for placement in (REPLICATE_SMALL, "sharded"):
    embed = _layer(optimizer, placement)
    pzsc.set_logical_tables(embed, initial)
    trainer = pzsc.SparseCoreTrainer.build(
      jax.random.key(1), embed, optax.sgd(0.0), _loss_fn
    )
    inputs, _ = trainer.model.preprocess(_batch(20), enable_minibatching=True)
    assert inputs.num_minibatches is not None
    trainer.step(inputs=inputs, target=0.2)

    def prep(batch, trainer=trainer):
      return {"inputs": trainer.model.preprocess(batch)[0], "target": 0.2}

    trainer.fit(
      [_batch(30 + i) for i in range(3)], prep, refresh_limits_every=2
    )
    assert bool(trainer.model.config.topology.replicated) == (
      placement != "sharded"
    )
    results.append(pzsc.logical_tables(trainer.model))
  for name in TABLES:
    np.testing.assert_allclose(
      results[0][name], results[1][name], rtol=2e-5, atol=1e-6, err_msg=name
    )
