"""Training a table too large for a dense-gradient approach on this machine.

The default: a 24M x 64 float32 table (6.1 GB) with Adagrad (another 6.1 GB
of slots) trained with SparseCoreTrainer on one CPU device. A dense gradient
and its update would need at least two more table-sized arrays (12+ GB),
more than the 24 GiB machine has beside the table and slots.
``--dtype bfloat16 --optimizer rowwise_adagrad --rows 100000000``: the
largest table this machine trains, 100M x 64 stored in bfloat16 (12.8 GB)
with one Adagrad accumulator per row (0.4 GB). Reports the initialisation
time, the step time (host preprocessing included) and the peak resident
memory against the bytes of table + slots.

Usage: python benchmarks/large_table.py [--rows 24000000] [--steps 20]
  [--dtype float32|bfloat16|float16] [--optimizer adagrad|rowwise_adagrad]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _rss_gb(field: str) -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024**2
  return float("nan")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=24_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--ids", type=int, default=16)
  parser.add_argument("--sc", type=int, default=8, help="virtual SCs")
  parser.add_argument(
    "--dtype", default="float32", choices=("float32", "bfloat16", "float16")
  )
  parser.add_argument(
    "--optimizer", default="adagrad", choices=("adagrad", "rowwise_adagrad")
  )
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh
  from penzai import pz

  import pz_sparsecore as pzsc
  from pz_sparsecore.nn.tables import table_arrays

  @pz.pytree_dataclass
  class Model(pz.nn.Layer):
    embed: pzsc.SparseCoreEmbed
    head: pz.nn.Linear

    def __call__(self, inputs, **side):
      return self.head(self.embed(inputs)["items"])

  def loss_fn(*, model, state, rng, inputs, labels):
    del rng
    logits = model(inputs).unwrap("batch", "out")[:, 0]
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
    return loss, state, {"loss": loss}

  table = pzsc.TableSpec(
    name="items",
    vocabulary_size=args.rows,
    embedding_dim=args.dim,
    initializer=jax.nn.initializers.normal(0.01),
    optimizer=(
      pzsc.AdagradOptimizerSpec(learning_rate=0.05)
      if args.optimizer == "adagrad"
      else pzsc.RowwiseAdagradOptimizerSpec(learning_rate=0.05)
    ),
    combiner="mean",
    dtype=args.dtype,
    max_ids_per_partition=args.batch * args.ids // args.sc,
    max_unique_ids_per_partition=args.batch * args.ids // args.sc,
  )
  features = {
    "items": pzsc.FeatureSpec(
      name="items",
      table_spec=table,
      input_shape=(args.batch, args.ids),
      output_shape=(args.batch, args.dim),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  base = _rss_gb("VmRSS")
  start = time.perf_counter()
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), features, mesh, num_sc_per_device=args.sc
  )
  jax.block_until_ready(table_arrays(embed))
  init_s = time.perf_counter() - start
  head = pz.nn.Linear.from_config(
    "head", jax.random.key(1), {"embedding": args.dim}, {"out": 1}
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(2), Model(embed=embed, head=head), optax.adam(1e-3), loss_fn
  )
  rng = np.random.default_rng(0)
  times = []
  for _ in range(args.steps):
    ids = rng.zipf(1.05, (args.batch, args.ids)) % args.rows
    labels = jnp.asarray(rng.integers(0, 2, args.batch), jnp.float32)
    t0 = time.perf_counter()
    inputs, _ = trainer.model.embed.preprocess({"items": ids})
    aux = trainer.step(inputs=inputs, labels=labels)
    jax.block_until_ready(aux["loss"])
    times.append(time.perf_counter() - t0)
  size_gb = args.rows * args.dim * jnp.dtype(args.dtype).itemsize / 1024**3
  slot_width = args.dim if args.optimizer == "adagrad" else 1
  slots_gb = args.rows * slot_width * 4 / 1024**3
  stored_gb = size_gb + slots_gb
  peak = _rss_gb("VmHWM")
  steady = times[2:] or times
  print(
    f"table {args.rows:,} x {args.dim} {args.dtype} = {size_gb:.2f} GiB; "
    f"{args.optimizer} slots {slots_gb:.2f} GiB"
  )
  print(f"table + slots: {stored_gb:.2f} GiB")
  print(f"init: {init_s:.1f} s; first step (compile): {times[0]:.2f} s")
  print(
    f"step (batch {args.batch} x {args.ids} ids, preprocess included): "
    f"median {statistics.median(steady) * 1e3:.1f} ms over {len(steady)}"
  )
  print(
    f"peak RSS {peak:.2f} GiB (process baseline {base:.2f} GiB); ratio "
    f"to table + slots: {peak / stored_gb:.2f}"
  )
  print(f"final loss {float(aux['loss']):.4f}")


if __name__ == "__main__":
  main()
