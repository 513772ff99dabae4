"""A training step updates the tables in place: no table-sized copy."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc

VOCAB, DIM, BATCH = 2**15 + 8, 16, 64


@pz.pytree_dataclass
class _Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Linear

  def __call__(self, inputs, **side):
    return self.head(self.embed(inputs)["f"])


def _loss_fn(*, model, state, rng, inputs, labels):
  del rng
  logits = model(inputs).unwrap("batch", "out")[:, 0]
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
  return loss, state, {"loss": loss}


@pytest.mark.parametrize("devices, sc", [(1, 4), (4, 2)])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_train_step_has_no_table_copy(devices, sc, optimizer):
  opt = {
    "sgd": pzsc.SGDOptimizerSpec(learning_rate=0.1),
    "adam": pzsc.AdamOptimizerSpec(learning_rate=0.1),
  }[optimizer]
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(),
    optimizer=opt,
    combiner="sum",
  )
  features = {
    "f": pzsc.FeatureSpec(
      name="f",
      table_spec=table,
      input_shape=(BATCH, 4),
      output_shape=(BATCH, DIM),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:devices]), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh, num_sc_per_device=sc
  )
  head = pz.nn.Linear.from_config(
    "head", jax.random.key(1), {"embedding": DIM}, {"out": 1}
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(2), _Model(embed=embed, head=head), optax.sgd(0.1), _loss_fn
  )
  ids = np.random.default_rng(0).integers(0, VOCAB, (BATCH, 4))
  inputs, _ = embed.preprocess({"f": ids})
  labels = jnp.zeros(BATCH)

  captured = {}
  step_fn = trainer.step_fn

  def capture(*args, **kwargs):
    captured["args"], captured["kwargs"] = args, kwargs
    return step_fn(*args, **kwargs)

  object.__setattr__(trainer, "step_fn", capture)
  value = trainer.model.embed.tables["t"].value.data_array
  before = [s.data.unsafe_buffer_pointer() for s in value.addressable_shards]
  trainer.step(inputs=inputs, labels=labels)
  value = trainer.model.embed.tables["t"].value.data_array
  after = [s.data.unsafe_buffer_pointer() for s in value.addressable_shards]
  assert before == after

  hlo = (
    step_fn.lower(*captured["args"], **captured["kwargs"]).compile().as_text()
  )
  shard_rows = value.shape[0] * value.shape[1] // devices
  big = re.compile(r"f32\[([\d,]+)\]")
  for line in hlo.splitlines():
    if " copy(" not in line:
      continue
    for dims in big.findall(line.split("=", 1)[1].split("copy(")[0]):
      size = np.prod([int(d) for d in dims.split(",")])
      assert size < shard_rows * DIM, f"table-sized copy: {line.strip()}"
