"""Compiles and runs every kind of program the layers build, one by one.

Run as a script by tests/test_programs.py, in a process of its own, so that
a crash inside XLA's compiler (jaxlib 0.11's Shardy canonicalizer once
segfaulted on a `shard_map` input it never read) fails that test with the
program's name instead of taking a pytest worker down. Prints
`start <name>` before and `done <name>` after each program; a program's
checks are small (finite outputs of the right shape, the lookup against a
NumPy gather): the suite's other modules compare the numbers.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from penzai import pz  # noqa: E402

import pz_sparsecore as pzsc  # noqa: E402

BATCH = 32
TABLES = {"big": (1000, 8), "small": (40, 8)}


def _program(name, fn):
  print(f"start {name}", flush=True)
  fn()
  print(f"done {name}", flush=True)


def _specs(batch=BATCH):
  out = {}
  for name, (vocab, dim) in TABLES.items():
    table = pzsc.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.1),
      combiner="mean",
    )
    out[f"f_{name}"] = pzsc.FeatureSpec(
      name=f"f_{name}",
      table_spec=table,
      input_shape=(batch, 4),
      output_shape=(batch, dim),
    )
  return out


def _batch(seed):
  """Rows of 0-4 ids, with empty rows, duplicates and ids on the shard
  boundaries (0, 7, 8, the last row)."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, (vocab, _) in TABLES.items():
    rows = []
    for i in range(BATCH):
      ids = rng.integers(0, vocab, int(rng.integers(0, 5)))
      if ids.size:
        ids[0] = (0, 7, 8, vocab - 1, ids[0])[i % 5]
      rows.append(np.concatenate([ids, ids[:1]]).astype(np.int32))
    out[f"f_{name}"] = np.array(rows, dtype=object)
  return out


def _loss_fn(*, model, state, rng, inputs, target):
  del rng
  acts = model(inputs)
  loss = sum(
    jnp.sum((a.unwrap("batch", "embedding") - target) ** 2)
    for a in acts.values()
  )
  return loss, state, {"loss": loss}


def _finite(tree):
  for leaf in jax.tree.leaves(tree):
    value = leaf.unwrap(*leaf.named_shape) if hasattr(leaf, "unwrap") else leaf
    if not np.all(np.isfinite(np.asarray(value))):
      raise AssertionError("a non-finite output")


def _embed(mesh, **options):
  layer = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _specs(), mesh, **options
  )
  inputs, _ = layer.preprocess(_batch(1))
  acts = pzsc.variable_jit(lambda e, x: e(x))(layer, inputs)
  for name, (_, dim) in TABLES.items():
    shape = dict(acts[f"f_{name}"].named_shape)
    if shape != {"batch": BATCH, "embedding": dim}:
      raise AssertionError(f"{name}: {shape}")
  _finite(acts)
  return layer


def _train(mesh, steps=2, minibatching=False, **options):
  layer = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _specs(), mesh, **options
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), layer, optax.sgd(0.1), _loss_fn
  )
  for seed in range(steps):
    inputs, _ = layer.preprocess(_batch(seed), enable_minibatching=minibatching)
    out = trainer.step(inputs=inputs, target=jnp.ones((BATCH, 8)))
    _finite(jax.block_until_ready(out))
  return trainer


def _lookup(mesh):
  table = pz.nn.EmbeddingTable.from_config(
    name="tok",
    init_base_rng=jax.random.key(0),
    vocab_size=1000,
    embedding_axes={"embedding": 16},
  )
  lookup = pzsc.SparseCoreLookup.from_lookup(
    pz.nn.EmbeddingLookup(table=table),
    mesh=mesh,
    optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.05),
  )
  ids = np.random.default_rng(0).integers(0, 1000, (4, 6))
  ids[0, :4] = [0, 7, 8, 999]
  tokens = pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag("batch", "seq")
  dense = np.asarray(table.embeddings.value.unwrap("vocabulary", "embedding"))
  for call in (lookup, jax.jit(lambda t: lookup(t))):
    got = call(tokens).unwrap("batch", "seq", "embedding")
    np.testing.assert_allclose(np.asarray(got), dense[ids], rtol=1e-6)

  def loss_fn(*, model, state, rng, tokens):
    del rng
    out = model(tokens).unwrap("batch", "seq", "embedding")
    loss = jnp.sum(out**2)
    return loss, state, {"loss": loss}

  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), lookup, optax.sgd(0.1), loss_fn
  )
  for _ in range(2):
    _finite(jax.block_until_ready(trainer.step(tokens=tokens)))


def _checkpoint(mesh8, mesh4):
  trainer = _train(mesh8, exchange="rows")
  with tempfile.TemporaryDirectory() as folder:
    pzsc.save_checkpoint(folder, trainer)
    layer = pzsc.SparseCoreEmbed.from_config(
      "emb", None, _specs(), mesh4, num_sc_per_device=2
    )
    restored = pzsc.restore_checkpoint(folder, layer)
  want = pzsc.logical_tables(trainer.model)
  got = pzsc.logical_tables(restored)
  for name in want:
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def main() -> int:
  devices = jax.devices()
  mesh8 = Mesh(np.array(devices[:8]), ("device",))
  mesh2x4 = Mesh(np.array(devices[:8]).reshape(2, 4), ("data", "model"))
  mesh4 = Mesh(np.array(devices[:4]), ("device",))
  one = Mesh(np.array(devices[:1]), ("device",))
  print(f"jax {jax.__version__} jaxlib {jax.lib.__version__}", flush=True)
  _program("lookup", lambda: _lookup(mesh2x4))
  _program("embed one device", lambda: _embed(one))
  for exchange in ("activations", "rows"):
    _program(f"embed {exchange}", lambda e=exchange: _embed(mesh8, exchange=e))
    _program(
      f"embed {exchange} 2 SparseCores",
      lambda e=exchange: _embed(mesh8, exchange=e, num_sc_per_device=2),
    )
    _program(f"train {exchange}", lambda e=exchange: _train(mesh8, exchange=e))
  _program(
    "embed placed on 2x4",
    lambda: _embed(mesh2x4, axis_name_to_mesh_name={"batch": "data"}),
  )
  _program(
    "train replicated small table",
    lambda: _train(mesh8, placement={"small": "replicated", "big": "sharded"}),
  )
  _program(
    "train minibatching",
    lambda: _train(mesh8, exchange="rows", minibatching=True),
  )
  _program("checkpoint onto 4 devices", lambda: _checkpoint(mesh8, mesh4))
  print("all programs ran", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
