"""Checkpoints: save on one topology, restore onto others."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore import specs
from pz_sparsecore.models import shakespeare
from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.training import SparseCoreTrainer

VOCAB, SEQ, BATCH, DIM, HIDDEN = 60, 2, 16, 8, 16


def build(g: int, s: int, rng: jax.Array | None) -> shakespeare.NextWordModel:
  """The Shakespeare model, small; `rng=None` gives variable slots."""
  return shakespeare.build_model(
    rng,
    Mesh(np.array(jax.devices()[:g]), ("device",)),
    vocab_size=VOCAB,
    seq_len=SEQ,
    batch_size=BATCH,
    embedding_dim=DIM,
    hidden=HIDDEN,
    optimizer=specs.AdamOptimizerSpec(learning_rate=0.05),
    num_sc_per_device=s,
  )


def batch(seed: int):
  rng = np.random.RandomState(seed)
  return rng.randint(0, VOCAB, (BATCH, SEQ)), rng.randint(0, VOCAB, BATCH)


def logits_of(model, context):
  inputs, _ = model.embed.preprocess({shakespeare.FEATURE: context})
  logits = pz.variable_jit(lambda m, x: m(x))(model, inputs)
  return np.asarray(logits.unwrap("batch", "vocab"))


def dense_params(model) -> dict[str, np.ndarray]:
  _, params = pz.unbind_params(model)
  skip = {v.label for v in model.embed.tables.values()}
  return {
    p.label: np.asarray(p.value.unwrap(*p.value.named_shape))
    for p in params
    if p.label not in skip
  }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A model trained on 8 devices x 1 SC, and its checkpoint directory."""
  model = build(8, 1, jax.random.key(0))
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.adam(1e-2), shakespeare.loss_fn
  )
  for step in range(3):
    context, labels = batch(step)
    inputs, _ = trainer.model.embed.preprocess({shakespeare.FEATURE: context})
    trainer.step(inputs=inputs, labels=jnp.asarray(labels))
  directory = tmp_path_factory.mktemp("ckpt")
  save_checkpoint(directory, trainer.model)
  return trainer.model, directory


@pytest.mark.parametrize(
  "g,s,rng",
  [(4, 2, None), (1, 1, None), (1, 1, 7), (8, 1, 5)],
  ids=["4x2-slots", "1x1-slots", "1x1-bound", "8x1-bound"],
)
def test_restore_onto_other_topologies(trained, g, s, rng):
  model, directory = trained
  fresh = build(g, s, None if rng is None else jax.random.key(rng))
  restored = restore_checkpoint(directory, fresh)
  assert (
    not pz.select(restored)
    .at_instances_of(pz.ParameterSlot | pz.StateVariableSlot)
    .count()
  )
  context, _ = batch(10)
  np.testing.assert_allclose(
    logits_of(restored, context),
    logits_of(model, context),
    rtol=1e-5,
    atol=1e-6,
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
    assert np.any(value != 0)  # Trained: slots moved off their init.
  want_dense, got_dense = dense_params(model), dense_params(restored)
  assert set(got_dense) == set(want_dense)
  for label, value in want_dense.items():
    np.testing.assert_array_equal(got_dense[label], value)
  # The restored table is laid out for the new topology.
  assert restored.embed.tables["words"].value.named_shape["sc_shard"] == g * s


def test_failed_save_keeps_previous_checkpoint(trained, tmp_path, monkeypatch):
  model, _ = trained
  first = save_checkpoint(tmp_path, model)
  expected = pzsc.logical_tables(model.embed)["words"]
  # Change the model, then fail half-way through the next save.
  changed = build(8, 1, jax.random.key(0))
  restore_checkpoint(tmp_path, changed)
  pzsc.set_logical_tables(changed.embed, {"words": np.zeros_like(expected)})

  def boom(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(np, "savez", boom)
  with pytest.raises(OSError, match="disk full"):
    save_checkpoint(tmp_path, changed)
  monkeypatch.undo()
  entries = sorted(os.listdir(tmp_path))
  assert not [e for e in entries if e.startswith(".tmp")], entries
  assert entries == ["LATEST", os.path.basename(first)]
  restored = restore_checkpoint(tmp_path, build(1, 1, None))
  np.testing.assert_array_equal(
    pzsc.logical_tables(restored.embed)["words"], expected
  )
  # A later successful save replaces it and cleans up the old one.
  second = save_checkpoint(tmp_path, changed)
  assert sorted(os.listdir(tmp_path)) == ["LATEST", os.path.basename(second)]
  restored = restore_checkpoint(tmp_path, build(1, 1, None))
  np.testing.assert_array_equal(
    pzsc.logical_tables(restored.embed)["words"], 0.0
  )


def test_restore_from_empty_directory(tmp_path):
  with pytest.raises(FileNotFoundError):
    restore_checkpoint(tmp_path, build(1, 1, None))
  with pytest.raises(FileNotFoundError):
    restore_checkpoint(tmp_path / "missing", build(1, 1, None))


def test_restore_rejects_a_different_model(trained, tmp_path):
  model, directory = trained
  other = build(1, 1, None)
  other = (
    pz.select(other)
    .at_instances_of(SparseCoreEmbed)
    .apply(
      lambda e: dataclasses.replace(
        e, config=dataclasses.replace(e.config, name="other")
      )
    )
  )
  with pytest.raises(ValueError, match="no SparseCoreEmbed 'other'"):
    restore_checkpoint(directory, other)
