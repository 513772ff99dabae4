"""Feature groups: a stack's features cross `shard_map` as one
`[samples, k, dim]` array per run of features with the same samples and
width (`routing.feature_groups`).

A stack whose features fall into several groups (widths 8 and 4, a feature
with twice the samples, ragged rows with duplicates and empty rows, ids on
the shard boundaries) looks up exactly a numpy gather and takes exactly a
numpy SGD step. A model that stacks the features along axis 1 (a DLRM's
interaction) compiles to the same number of operations whatever the number
of features: one group, no per-feature copy or slice.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import pz_sparsecore as pzsc
from pz_sparsecore.device import routing
from pz_sparsecore.nn.tables import table_arrays

BATCH = 16
LR = 0.5
# Feature -> (vocabulary, width, samples): a and b share a group, c is
# narrower, d follows c, e has twice the samples.
FEATURES = {
  "a": (40, 8, BATCH),
  "b": (24, 8, BATCH),
  "c": (16, 4, BATCH),
  "d": (32, 8, BATCH),
  "e": (48, 8, 2 * BATCH),
}


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()), ("device",))


def _specs(features: dict) -> dict:
  out = {}
  for name, (vocab, dim, samples) in features.items():
    table = pzsc.TableSpec(
      name=f"t_{name}",
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=pzsc.SGDOptimizerSpec(learning_rate=LR),
      combiner="sum",
    )
    out[name] = pzsc.FeatureSpec(
      name=name,
      table_spec=table,
      input_shape=(samples, 3),
      output_shape=(samples, dim),
    )
  return out


def _batch(seed: int) -> dict[str, np.ndarray]:
  """Rows of 0-3 ids: empty rows, duplicates, ids 0 and vocab - 1."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, (vocab, _, samples) in FEATURES.items():
    rows = []
    for i in range(samples):
      ids = rng.integers(0, vocab, int(rng.integers(0, 4)))
      if len(ids) and i % 5 == 0:
        ids[0] = 0 if i % 10 else vocab - 1
      if len(ids) > 1 and i % 3 == 0:
        ids[1] = ids[0]
      rows.append(ids.astype(np.int32))
    out[name] = np.array(rows, dtype=object)
  return out


def test_groups_of_a_stack_and_lookup_and_sgd_step_equal_numpy():
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _specs(FEATURES), _mesh()
  )
  (stack,) = embed.config.plan.stacks
  groups = [[f.name for f in g] for g in routing.feature_groups(stack)]
  assert groups == [["a", "b"], ["c"], ["d"], ["e"]]

  tables = {k: np.asarray(v) for k, v in pzsc.logical_tables(embed).items()}
  batch = _batch(1)
  rng = np.random.default_rng(2)
  targets = {
    name: rng.normal(size=(samples, dim)).astype(np.float32)
    for name, (_, dim, samples) in FEATURES.items()
  }

  def gather(name):
    table = tables[f"t_{name}"]
    return np.stack(
      [table[row].sum(0) if len(row) else 0 * table[0] for row in batch[name]]
    )

  inputs, _ = embed.preprocess(batch)
  acts = pzsc.variable_jit(lambda e, x: e(x))(embed, inputs)
  for name in FEATURES:
    np.testing.assert_allclose(
      np.asarray(acts[name].unwrap("batch", "embedding")),
      gather(name),
      rtol=1e-6,
      atol=1e-6,
    )

  # loss = sum_f <acts_f, target_f>: each row's gradient is the sum of the
  # targets of the samples that hold it, once per id.
  def loss_fn(*, model, state, rng, inputs):
    del rng
    out = model(inputs)
    loss = sum(
      jnp.sum(out[name].unwrap("batch", "embedding") * targets[name])
      for name in FEATURES
    )
    return loss, state, {}

  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.0), loss_fn
  )
  trainer.step(inputs=inputs)
  got = pzsc.logical_tables(trainer.model)
  for name in FEATURES:
    want = tables[f"t_{name}"].copy()
    for row, target in zip(batch[name], targets[name], strict=True):
      for i in row:
        want[i] -= LR * target
    np.testing.assert_allclose(
      np.asarray(got[f"t_{name}"]), want, rtol=1e-5, atol=1e-6
    )


def _compiled_ops(num_features: int) -> int:
  """HLO operations of a compiled lookup + fused update of
  `num_features` one-hot width-8 features whose gradients come from a
  model stacking them along axis 1."""
  features = {f"f{i:02d}": (64, 8, BATCH) for i in range(num_features)}
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _specs(features), _mesh(), exchange="rows"
  )
  config = embed.config
  plan, topo = config.plan, config.topology
  names = list(features)
  rng = np.random.default_rng(0)
  batch = {n: rng.integers(0, 64, (BATCH, 1)) for n in names}
  inputs, _ = embed.preprocess(batch)
  slots = {s.name: () for s in plan.stacks}

  def step(tables, inputs, w):
    acts = routing.lookup(plan, topo, tables, inputs)

    def loss(acts):
      x = jnp.stack([acts[n] for n in names], axis=1)
      return jnp.sum(jnp.tanh(x) * w)

    grads = jax.grad(loss)(acts)
    return routing.apply_gradients(plan, topo, tables, slots, inputs, grads, 0)

  w = jnp.ones((BATCH, num_features, 8))
  text = jax.jit(step).lower(table_arrays(embed), inputs, w).compile().as_text()
  return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", text, re.M))


def test_compiled_step_does_not_grow_with_the_number_of_features():
  # One op per feature and direction would add 18 (a copy or a slice each
  # way per feature): the difference stays within a few ops of constants.
  assert _compiled_ops(12) <= _compiled_ops(3) + 4
