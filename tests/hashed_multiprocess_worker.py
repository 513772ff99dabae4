"""One process of a multi-process run of hashed tables (launched by tests).

Usage: python hashed_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT
  OUT_DIR DEVICES_PER_PROCESS

Every process builds the same layer on a one-axis mesh over all global
devices: two hashed tables of 8 shards, "users" (64 rows, `lru`, Adagrad)
and "items" (64 rows, `none`, SGD), each fed a Zipf-like stream of raw
int64 ids (negative ones included) from a pool several times its capacity,
so that "users" evicts and "items" refuses. The global batches are the same
in every process; process `p` of `P` preprocesses rows `[p * B / P,
(p + 1) * B / P)` of each one, as `multiprocess_worker.py` does.
`SparseCoreTrainer.step` resolves the ids and trains a few steps; then
every process gathers the whole of each map (`ids`, `seen`, `counters`,
`seed`), table and optimizer slot and writes them, with the losses and
the activations of every step, to `OUT_DIR/result_{p}.npz`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import numpy as np

BATCH = 32
"""Samples of a global batch (4 per device of 8)."""

IDS_PER_SAMPLE = 4
DIM = 8
STEPS = 6
TABLES = {
  # name: (feature, rows, eviction, pool of raw ids)
  "users": ("u", 64, "lru", 320),
  "items": ("i", 64, "none", 200),
}


def batches(
  seed: int = 0,
) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
  """The global batches: per step, feature -> int64 ids `[BATCH,
  IDS_PER_SAMPLE]` drawn Zipf-like from each table's pool, and the
  activations' gradients, float32 `[BATCH, DIM]` per feature."""
  rng = np.random.default_rng(seed)
  pools, weights = {}, {}
  for name, (_, _, _, size) in TABLES.items():
    pool = rng.integers(-(2**63), 2**63 - 1, size=size, dtype=np.int64)
    pool[:3] = [-1, 0, 2**63 - 1]
    pools[name] = pool
    p = 1.0 / np.arange(1, size + 1)
    weights[name] = p / p.sum()
  for _ in range(STEPS):
    ids, grads = {}, {}
    for name, (feature, _, _, size) in TABLES.items():
      draw = rng.choice(size, size=(BATCH, IDS_PER_SAMPLE), p=weights[name])
      ids[feature] = pools[name][draw]
      grads[feature] = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    yield ids, grads


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  out_dir = sys.argv[4]
  per_process = int(sys.argv[5])
  os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={per_process}"
  )
  import jax

  if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      f"localhost:{port}",
      num_processes=num_processes,
      process_id=process_id,
    )
  import jax.numpy as jnp
  import optax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from penzai import pz

  import pz_sparsecore as pzsc
  from pz_sparsecore.nn.tables import slot_arrays, table_arrays

  mesh = Mesh(np.array(jax.devices()), ("device",))
  optimizers = {
    "users": pzsc.AdagradOptimizerSpec(learning_rate=0.3),
    "items": pzsc.SGDOptimizerSpec(learning_rate=0.5),
  }
  specs = {}
  for name, (feature, capacity, eviction, _) in TABLES.items():
    table = pzsc.TableSpec(
      name=name,
      vocabulary_size=capacity,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=optimizers[name],
      combiner="sum",
      ids="hashed",
      eviction=eviction,
    )
    specs[feature] = pzsc.FeatureSpec(
      name=feature,
      table_spec=table,
      input_shape=(BATCH, IDS_PER_SAMPLE),
      output_shape=(BATCH, DIM),
    )
  embed = pzsc.SparseCoreEmbed.from_config("e", jax.random.key(0), specs, mesh)

  @pz.pytree_dataclass
  class Model(pz.nn.Layer):
    embed: pzsc.SparseCoreEmbed

    def __call__(self, inputs, **side_inputs):
      return self.embed(inputs)

  def loss_fn(*, model, state, rng, inputs, grads):
    del rng
    acts = {f: a.unwrap("batch", "embedding") for f, a in model(inputs).items()}
    loss = sum(jnp.sum(acts[f] * g) for f, g in grads.items())
    return loss, state, {"loss": loss, "acts": acts}

  replicated = NamedSharding(mesh, P())
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.wrap_key_data(
      jax.device_put(
        np.asarray(jax.random.key_data(jax.random.key(1))), replicated
      )
    ),
    Model(embed=embed),
    optax.sgd(0.1),
    loss_fn,
  )

  def gather(x):
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  batch_sharding = NamedSharding(mesh, P("device"))
  local = BATCH // num_processes
  rows = slice(process_id * local, (process_id + 1) * local)
  losses, acts = [], []
  for ids, grads in batches():
    inputs, _ = trainer.model.embed.preprocess(
      {f: x[rows] for f, x in ids.items()}
    )
    grads = {
      f: jax.make_array_from_process_local_data(
        batch_sharding, g[rows], g.shape
      )
      for f, g in grads.items()
    }
    aux = trainer.step(inputs=inputs, grads=grads)
    losses.append(float(jax.device_get(aux["loss"])))
    acts.append({f: gather(a) for f, a in aux["acts"].items()})

  embed = trainer.model.embed
  out = {"losses": np.asarray(losses)}
  for f in acts[0]:
    out[f"acts/{f}"] = np.stack([step[f] for step in acts])
  tables, slots = table_arrays(embed), slot_arrays(embed)
  for name in TABLES:
    stack = embed.config.plan.stack_of_table[name].name
    for part, var in embed.maps[stack].items():
      out[f"{name}/{part}"] = gather(var.value)
    out[f"{name}/table"] = gather(tables[stack])
    for k, value in enumerate(slots[stack]):
      out[f"{name}/slot{k}"] = gather(value)
  np.savez(os.path.join(out_dir, f"result_{process_id}.npz"), **out)


if __name__ == "__main__":
  main()
