"""Checkpoints: save on one topology, restore onto others; resume a trainer.

The references are independent of the checkpoint code: logical tables and
slots read with `logical_tables` / `logical_slots` (a host gather, fine for
small test tables), logits of the saved model, and an uninterrupted run of
the same trainer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz
from test_training import (
  TABLES,
  act_grads,
  build_model,
  feature_specs,
  make_batch,
  mesh_of,
)
from test_training import loss_fn as probe_loss_fn

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout, specs
from pz_sparsecore.models import shakespeare
from pz_sparsecore.nn import _ckpt_layout, host, tables
from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.training import SparseCoreTrainer

VOCAB, SEQ, BATCH, DIM, HIDDEN = 60, 2, 16, 8, 16


def build(g: int, s: int, rng: jax.Array | None, **changes):
  """The Shakespeare model, small; `rng=None` gives variable slots."""
  config = dict(
    vocab_size=VOCAB,
    seq_len=SEQ,
    batch_size=BATCH,
    embedding_dim=DIM,
    hidden=HIDDEN,
    optimizer=specs.AdamOptimizerSpec(learning_rate=0.05),
  )
  config.update(changes)
  return shakespeare.build_model(
    rng,
    Mesh(np.array(jax.devices()[:g]), ("device",)),
    num_sc_per_device=s,
    **config,
  )


def batch(seed: int):
  rng = np.random.RandomState(seed)
  return rng.randint(0, VOCAB, (BATCH, SEQ)), rng.randint(0, VOCAB, BATCH)


_apply = pz.variable_jit(lambda model, inputs: model(inputs))


def logits_of(model, context):
  inputs, _ = model.embed.preprocess({shakespeare.FEATURE: context})
  return np.asarray(_apply(model, inputs).unwrap("batch", "vocab"))


def dense_params(model) -> dict[str, np.ndarray]:
  _, params = pz.unbind_params(model)
  skip = {v.label for v in model.embed.tables.values()}
  return {
    p.label: np.asarray(p.value.unwrap(*p.value.named_shape))
    for p in params
    if p.label not in skip
  }


def all_values(model) -> dict[str, np.ndarray]:
  """Every bound variable's value on the host, by label."""
  out = {}
  for var in pz.unbind_variables(model)[1]:
    value = var.value
    if isinstance(value, pz.nx.NamedArray):
      value = value.unwrap(*value.named_shape)
    out[var.label] = np.asarray(value)
  return out


def assert_same_values(got: dict, want: dict) -> None:
  assert set(got) == set(want)
  for label, value in want.items():
    np.testing.assert_array_equal(got[label], value, err_msg=label)


def random_slots(embed, seed: int) -> None:
  """Gives every slot of every table random values (as training would)."""
  rng = np.random.default_rng(seed)
  slots = pzsc.logical_slots(embed)
  pzsc.set_logical_slots(
    embed,
    {
      name: {k: rng.uniform(0.1, 1.0, v.shape) for k, v in table.items()}
      for name, table in slots.items()
    },
  )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A model on 8 devices x 1 SC with random slots, its checkpoint and its
  logits on `batch(10)`."""
  model = build(8, 1, jax.random.key(0))
  random_slots(model.embed, 0)
  directory = tmp_path_factory.mktemp("ckpt")
  save_checkpoint(directory, model)
  return model, directory, logits_of(model, batch(10)[0])


@pytest.mark.parametrize(
  "g,s,rng",
  [(4, 2, None), (1, 1, None), (1, 1, 7), (8, 1, 5), (8, 2, None)],
  ids=["4x2-slots", "1x1-slots", "1x1-bound", "8x1-bound", "8x2-slots"],
)
def test_restore_onto_other_topologies(trained, g, s, rng):
  model, directory, logits = trained
  fresh = build(g, s, None if rng is None else jax.random.key(rng))
  restored = restore_checkpoint(directory, fresh)
  # Uncommitted dense values stay uncommitted, like fresh parameters.
  for param in pz.unbind_params(restored.body)[1]:
    assert not param.value.data_array.committed
  assert (
    not pz.select(restored)
    .at_instances_of(pz.ParameterSlot | pz.StateVariableSlot)
    .count()
  )
  np.testing.assert_allclose(
    logits_of(restored, batch(10)[0]), logits, rtol=1e-5, atol=1e-6
  )
  want, got = (
    pzsc.logical_tables(model.embed),
    pzsc.logical_tables(restored.embed),
  )
  np.testing.assert_array_equal(got["words"], want["words"])
  want_slots = pzsc.logical_slots(model.embed)["words"]
  got_slots = pzsc.logical_slots(restored.embed)["words"]
  assert set(got_slots) == {"momentum", "velocity"}
  for slot, value in want_slots.items():
    np.testing.assert_array_equal(got_slots[slot], value)
    assert np.all(value != 0)  # Not their initial zeros.
  want_dense, got_dense = dense_params(model), dense_params(restored)
  assert set(got_dense) == set(want_dense)
  for label, value in want_dense.items():
    np.testing.assert_array_equal(got_dense[label], value)
  # The restored table is laid out for the new topology.
  assert restored.embed.tables["words"].value.named_shape["sc_shard"] == g * s


def test_committed_values_keep_their_sharding(trained):
  _, directory, _ = trained
  fresh = build(4, 1, jax.random.key(3))
  replicated = NamedSharding(fresh.embed.config.topology.mesh, P())
  for param in pz.unbind_params(fresh.body)[1]:
    param.value = jax.tree.map(
      lambda x: jax.device_put(x, replicated), param.value
    )
  restored = restore_checkpoint(directory, fresh)
  for param in pz.unbind_params(restored.body)[1]:
    assert param.value.data_array.sharding == replicated


def _unstacked(specs_tree):
  """The feature specs with the stacking taken out."""

  def strip(feature):
    table = feature.table_spec.replace(
      setting_in_stack=None, stacked_table_spec=None
    )
    return feature.replace(table_spec=table, id_transformation=None)

  return jax.tree.map(strip, specs_tree)


# Stacks with different slot sets (none for SGD, two for Adam, one for the
# Adagrad pair stacked in one table), from test_training.
SOME_TABLES = {k: TABLES[k] for k in ("sgd", "adam", "pa", "pb")}


def test_restore_onto_another_stacking(tmp_path):
  # Restored onto 2 devices with the pair stacked the other way round,
  # without rotation.
  model = build_model(8, 1, SOME_TABLES)
  random_slots(model.embed, 1)
  save_checkpoint(tmp_path, model)
  other = layout.stack_tables(
    _unstacked(feature_specs(2, 1, SOME_TABLES)), ["pb", "pa"], 2, 1, 0
  )
  embed = SparseCoreEmbed.from_config("emb", None, other, mesh_of(2))
  assert [t.name for t in embed.config.plan.stack("pb_pa").tables] == [
    "pb",
    "pa",
  ]
  restored = restore_checkpoint(
    tmp_path, dataclasses.replace(model, embed=embed)
  )
  for got, want in zip(
    (pzsc.logical_tables(restored.embed), pzsc.logical_slots(restored.embed)),
    (pzsc.logical_tables(model.embed), pzsc.logical_slots(model.embed)),
    strict=True,
  ):
    assert set(got) == set(want) and len(want) >= 3
    for name in want:
      for leaf_got, leaf_want in zip(
        jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True
      ):
        np.testing.assert_array_equal(leaf_got, leaf_want, err_msg=name)
  np.testing.assert_array_equal(restored.w.value, model.w.value)


# ---------------------------------------------------------------------------
# Validation before anything is assigned.


def _renamed(model, name: str):
  def rename(embed):
    config = dataclasses.replace(embed.config, name=name)
    return dataclasses.replace(embed, config=config)

  return pz.select(model).at_instances_of(SparseCoreEmbed).apply(rename)


def _changed_variable(model, label: str, convert):
  for var in pz.unbind_variables(model)[1]:
    if var.label == label:
      var.value = convert(var.value)
  return model


def _with_extra_layer(model):
  extra = pz.nn.AddBias.from_config(
    "extra_bias", jax.random.key(0), {"vocab": VOCAB}
  )
  body = dataclasses.replace(
    model.body, sublayers=[*model.body.sublayers, extra]
  )
  return dataclasses.replace(model, body=body)


MISMATCHES = {
  "dense-shape": (
    lambda rng: build(1, 1, rng, hidden=2 * HIDDEN),
    r"variable 'hidden.weights': checkpoint shape \(2, 8, 16\), model "
    r"\(2, 8, 32\)",
  ),
  "optimizer": (
    lambda rng: build(1, 1, rng, optimizer=specs.SGDOptimizerSpec()),
    r"table 'words': checkpoint optimizer adam \(slots momentum, "
    r"velocity\), model sgd$",
  ),
  "table-shape": (
    lambda rng: build(4, 2, rng, embedding_dim=2 * DIM),
    r"table 'words': checkpoint shape \(60, 8\), model \(60, 16\)",
  ),
  "layer-name": (
    lambda rng: _renamed(build(1, 1, rng), "other"),
    r"SparseCoreEmbed 'other': not in the checkpoint, which has \['embed'\]",
  ),
  "axis-names": (
    lambda rng: _changed_variable(
      build(1, 1, rng),
      "hidden_bias.bias",
      lambda v: v.untag("hidden").tag("units"),
    ),
    r"variable 'hidden_bias.bias': checkpoint axes \('hidden',\), model "
    r"\('units',\)",
  ),
  "dtype": (
    lambda rng: _changed_variable(
      build(1, 1, rng), "logits_bias.bias", lambda v: v.astype(jnp.bfloat16)
    ),
    r"variable 'logits_bias.bias': checkpoint dtype float32, model bfloat16",
  ),
  "extra-variable": (
    lambda rng: _with_extra_layer(build(1, 1, rng)),
    r"variable 'extra_bias.bias': not in the checkpoint",
  ),
}


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "slots"])
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_restore_validates_before_assigning(trained, case, bound):
  _, directory, _ = trained
  make, message = MISMATCHES[case]
  if not bound and case in ("dense-shape", "axis-names", "dtype"):
    pytest.skip("a variable slot has no shape, axes or dtype to compare")
  model = make(jax.random.key(2) if bound else None)
  before = all_values(model)
  slots = pz.select(model).at_instances_of(pz.ParameterSlot).count()
  with pytest.raises(ValueError, match=message):
    restore_checkpoint(directory, model)
  assert_same_values(all_values(model), before)
  assert pz.select(model).at_instances_of(pz.ParameterSlot).count() == slots


def test_restoring_a_trainer_validates_its_state(trained, tmp_path):
  _, model_checkpoint, _ = trained

  def trainer_of(optimizer):
    model = build(1, 1, jax.random.key(0))
    return SparseCoreTrainer.build(
      jax.random.key(1), model, optimizer, shakespeare.loss_fn
    )

  save_checkpoint(tmp_path, trainer_of(optax.adam(1e-2)))
  for directory, trainer, message in (
    (model_checkpoint, trainer_of(optax.adam(1e-2)), "a model, not a trainer"),
    (
      tmp_path,
      trainer_of(optax.sgd(1e-2)),
      r"trainer state \['state'\].opt_state\[0\].count of the checkpoint",
    ),
  ):
    before = all_values(trainer.model)
    state = trainer.state.value
    with pytest.raises(ValueError, match=message):
      restore_checkpoint(directory, trainer)
    assert_same_values(all_values(trainer.model), before)
    assert trainer.state.value is state


def test_restore_from_empty_directory(tmp_path):
  with pytest.raises(FileNotFoundError):
    restore_checkpoint(tmp_path, build(1, 1, None))
  with pytest.raises(FileNotFoundError):
    restore_checkpoint(tmp_path / "missing", build(1, 1, None))


# ---------------------------------------------------------------------------
# Resuming a trainer.


def noisy_loss_fn(*, model, state, rng, inputs, grads):
  """test_training's loss, plus noise from the step's key and a counter."""
  loss, _, _ = probe_loss_fn(
    model=model, state=state, rng=rng, inputs=inputs, grads=grads
  )
  loss = loss + jax.random.uniform(rng)
  return loss, state + 1, {"loss": loss}


# One optimizer object: trainers that share it share their compiled step.
DENSE_OPTIMIZER = optax.adam(0.1)


def _probe_trainer(g: int, s: int, key: int) -> SparseCoreTrainer:
  return SparseCoreTrainer.build(
    jax.random.key(key),
    build_model(g, s, SOME_TABLES),
    DENSE_OPTIMIZER,
    noisy_loss_fn,
    initial_loss_fn_state=jnp.zeros((), jnp.int32),
  )


def _run(trainer, steps) -> list[float]:
  grads = {k: jnp.asarray(v) for k, v in act_grads(3, SOME_TABLES).items()}
  losses = []
  for step in steps:
    ids, weights = make_batch(100 + step, SOME_TABLES)
    inputs, _ = trainer.model.embed.preprocess(ids, weights)
    aux = trainer.step(inputs=inputs, grads=grads)
    losses.append(float(aux["loss"]))
  return losses


def _trainer_values(trainer) -> dict[str, np.ndarray]:
  embed = trainer.model.embed
  out = {"w": np.asarray(trainer.model.w.value)}
  for name, value in pzsc.logical_tables(embed).items():
    out[name] = value
  for name, slots in pzsc.logical_slots(embed).items():
    for slot, value in slots.items():
      out[f"{name}.{slot}"] = value
  state = jax.tree_util.tree_flatten_with_path(trainer.state.value)[0]
  for path, value in state:
    out[f"state{jax.tree_util.keystr(path)}"] = np.asarray(value)
  out["key"] = np.asarray(jax.random.key_data(trainer.root_rng))
  return out


def test_trainer_resumes_where_it_stopped(tmp_path):
  total, k = 4, 2
  trainer = _probe_trainer(1, 1, key=1)
  want_losses = _run(trainer, range(k))
  save_checkpoint(tmp_path, trainer)
  want_losses += _run(trainer, range(k, total))  # Uninterrupted by the save.
  want = _trainer_values(trainer)
  assert "state.opt_state[0].mu[0].value" in want  # optax's state is there.
  for g in (1, 2):
    # A fresh model and trainer, with another key: the checkpoint's wins.
    resumed = restore_checkpoint(tmp_path, _probe_trainer(g, 1, key=9))
    assert int(resumed.state.value.step) == k
    assert int(resumed.state.value.loss_fn_state) == k
    losses = want_losses[:k] + _run(resumed, range(k, total))
    got = _trainer_values(resumed)
    if g == 1:  # The same program on one device: bit for bit.
      assert losses == want_losses
      assert_same_values(got, want)
      continue
    # On two devices the collectives sum in another order.
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert set(got) == set(want)
    for name, value in want.items():
      np.testing.assert_allclose(
        got[name], value, rtol=1e-4, atol=1e-5, err_msg=name
      )


# ---------------------------------------------------------------------------
# Nothing is gathered: a cap on the bytes a process holds in flight.


def _big_embed(g: int, rng) -> SparseCoreEmbed:
  table = pzsc.TableSpec(
    name="big",
    vocabulary_size=4096,
    embedding_dim=16,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=pzsc.AdagradOptimizerSpec(),
    combiner="sum",
  )
  features = {
    "f": pzsc.FeatureSpec(
      name="f", table_spec=table, input_shape=(8, 1), output_shape=(8, 16)
    )
  }
  return SparseCoreEmbed.from_config("emb", rng, features, mesh_of(g))


def test_tables_larger_than_the_cap_save_and_restore(tmp_path, monkeypatch):
  embed = _big_embed(8, jax.random.key(0))
  table_bytes = 4096 * 16 * 4
  cap = table_bytes // 3  # Over one device's shard or two, under a table.

  def gather(*args, **kwargs):
    raise AssertionError("a checkpoint gathered a table")

  for module, name in (
    (host, "to_host"),
    (tables, "to_host"),
    (tables, "logical_tables"),
    (tables, "logical_slots"),
    (jax.experimental.multihost_utils, "process_allgather"),
  ):
    monkeypatch.setattr(module, name, gather)
  save_checkpoint(tmp_path, embed, max_host_bytes=cap)
  # 8 devices read their shards as stored; 4 devices read two shards each
  # and move the rows on device.
  restored = [
    restore_checkpoint(tmp_path, _big_embed(g, None), max_host_bytes=cap)
    for g in (8, 4)
  ]
  monkeypatch.undo()
  want = pzsc.logical_tables(embed)["big"]
  assert want.nbytes > cap
  for layer in restored:
    np.testing.assert_array_equal(pzsc.logical_tables(layer)["big"], want)
  # The cap is enforced: one device's shard does not fit under a smaller one.
  with pytest.raises(ValueError, match="max_host_bytes 16384 .* 'emb/big"):
    save_checkpoint(tmp_path, embed, max_host_bytes=table_bytes // 16)


def test_relayout_from_fewer_stored_shards_than_devices():
  # 12 stored rows do not split over 8 devices: they are read padded to 16
  # and split by rows; the padding never reaches the new table.
  features = {
    "f": pzsc.FeatureSpec(
      name="f",
      table_spec=pzsc.TableSpec(
        name="t",
        vocabulary_size=10,
        embedding_dim=8,
        initializer=jax.nn.initializers.zeros,
        optimizer=pzsc.SGDOptimizerSpec(),
        combiner="sum",
      ),
      input_shape=(8, 1),
      output_shape=(8, 8),
    )
  }
  prepared = layout.prepare_feature_specs_for_training(features, 8, 1)
  plan = pzsc.build_plan(prepared, 8, 1)
  stored = _ckpt_layout.StackLayout(
    num_shards=1,
    rows_per_shard=12,
    dim=8,
    tables=(_ckpt_layout.TablePlacement("t", 10, 8, 12, 0, 0),),
  )
  topology = pzsc.Topology(mesh_of(8), "device", 1)
  sharding, shape = _ckpt_layout.read_sharding(stored, topology)
  assert shape == (1, 16, 8) and sharding.spec == P(None, "device")
  logical = np.random.default_rng(0).normal(size=(10, 8)).astype(np.float32)
  padded = np.full(shape, np.nan, np.float32)
  padded[0, :10] = logical
  out = _ckpt_layout.relayout(
    [jax.device_put(padded, sharding)],
    [_ckpt_layout.Source(0, 1, stored.tables[0])],
    _ckpt_layout.stack_layout(plan, plan.stacks[0]),
    topology.sharding(3),
  )
  assert out.sharding.is_equivalent_to(topology.sharding(3), 3)
  want = layout.stack_and_shard_tables(prepared, {"t": logical}, 8, 0.0)
  np.testing.assert_array_equal(np.asarray(out), want["t"])


@pytest.mark.parametrize("before,after", [(8, 16), (2, 8), (8, 2)], ids=str)
def test_relayout_needs_no_device_to_hold_the_table(before, after):
  def stack(n):
    prepared = layout.prepare_feature_specs_for_training(
      _big_embed(1, None).config.plan.specs_tree, min(n, 8), max(n // 8, 1)
    )
    plan = pzsc.build_plan(prepared, min(n, 8), max(n // 8, 1))
    return _ckpt_layout.stack_layout(plan, plan.stacks[0])

  stored, target = stack(before), stack(after)
  topology = pzsc.Topology(mesh_of(min(after, 8)), "device", max(after // 8, 1))
  sharding, shape = _ckpt_layout.read_sharding(stored, topology)
  compiled = _ckpt_layout._relayout.lower(
    (jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding),),
    (_ckpt_layout.Source(0, stored.num_shards, stored.tables[0]),),
    target,
    topology.sharding(3),
  ).compile()
  share = compiled.memory_analysis().output_size_in_bytes
  assert share == 4 * np.prod(target.shape) // topology.num_devices
  assert compiled.memory_analysis().temp_size_in_bytes <= 2 * share
