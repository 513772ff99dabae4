"""The cost of tracking touched rows: a trainer step with and without it.

Two `SparseCoreTrainer`s of the same model (one table with Adagrad, or
row-wise Adagrad for a 16-bit table, and a `Linear` head), one built with
`track_touched=True` (the bitmap delta checkpoints need), take the same
preprocessed Zipf batches in interleaved blocks of 5 steps (8 blocks each,
after 3 warm-up steps); each step is waited for. Prints the median step
time of each and the difference. Preprocessing is excluded.

Usage: python benchmarks/touched_rows.py [--devices 1] [--sc 8]
  [--rows 8000000] [--dim 64] [--batch 4096] [--ids 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--sc", type=int, default=8)
  parser.add_argument("--rows", type=int, default=8_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=4096)
  parser.add_argument("--ids", type=int, default=16)
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args()
  os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}"
  )

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh
  from penzai import pz

  import pz_sparsecore as pzsc

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

  optimizer = pzsc.AdagradOptimizerSpec(learning_rate=0.05)
  if args.dtype != "float32":
    optimizer = pzsc.RowwiseAdagradOptimizerSpec(learning_rate=0.05)
  table = pzsc.TableSpec(
    name="items",
    vocabulary_size=args.rows,
    embedding_dim=args.dim,
    initializer=jax.nn.initializers.normal(0.01),
    optimizer=optimizer,
    combiner="mean",
    dtype=args.dtype,
  )
  features = {
    "items": pzsc.FeatureSpec(
      name="items",
      table_spec=table,
      input_shape=(args.batch, args.ids),
      output_shape=(args.batch, args.dim),
    )
  }
  mesh = Mesh(np.array(jax.devices()[: args.devices]), ("device",))

  def trainer(track: bool):
    embed = pzsc.SparseCoreEmbed.from_config(
      "embed", jax.random.key(0), features, mesh, num_sc_per_device=args.sc
    )
    head = pz.nn.Linear.from_config(
      "head", jax.random.key(1), {"embedding": args.dim}, {"out": 1}
    )
    return pzsc.SparseCoreTrainer.build(
      jax.random.key(2),
      Model(embed=embed, head=head),
      optax.adam(1e-3),
      loss_fn,
      track_touched=track,
    )

  trainers = {False: trainer(False), True: trainer(True)}
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(4):
    ids = (rng.zipf(1.2, (args.batch, args.ids)) % args.rows).astype(np.int32)
    inputs, _ = trainers[False].model.embed.preprocess({"items": ids})
    labels = jnp.asarray(rng.integers(0, 2, args.batch), jnp.float32)
    batches.append({"inputs": inputs, "labels": labels})
  for t in trainers.values():
    for i in range(3):
      t.step(**batches[i % 4])
    t.wait()
  times = {False: [], True: []}
  for _ in range(8):
    for track, t in trainers.items():
      for i in range(5):
        start = time.perf_counter()
        t.step(**batches[i % 4])
        t.wait()
        times[track].append(time.perf_counter() - start)
  off, on = (statistics.median(times[k]) * 1e3 for k in (False, True))
  print(
    f"{args.devices} device(s) x {args.sc} SparseCores, {args.rows:,} x "
    f"{args.dim} {args.dtype}, batch {args.batch} x {args.ids}: step "
    f"{off:.2f} ms, tracked {on:.2f} ms ({on - off:+.2f} ms, "
    f"{(on / off - 1) * 100:+.0f}%); {os.cpu_count()} CPUs, load "
    f"{os.getloadavg()[0]:.1f}"
  )


if __name__ == "__main__":
  main()
