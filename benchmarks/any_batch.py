"""Batches of any size: a request's cost against padding it by hand.

Run: ``python benchmarks/any_batch.py`` (8 virtual CPU devices).

The layer of the docs' 26-table DLRM shape, reduced to what a serving call
reads: 26 one-hot features (four tables of 100,000 to 1,000,000 rows, 22
small ones, 16 wide), specified for a batch of 2,048. A request of `n`
samples is served two ways, each timed as host preprocessing plus the
jitted forward, waited for (median of 30 interleaved calls):

* ours: `embed.preprocess(ids)` of the `n` samples (padded inside to their
  bucket) and the call, which returns `n` rows;
* by hand: the ids padded to the specs' 2,048 samples with rows of id 0
  (the way before; a loss or metric then masks them), the call, the first
  `n` rows kept.

It also counts the forward's compilations for 40 requests of random sizes
from 1 to 2,048, with and without `keep_padding`.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import logging
import statistics
import time

import jax
import numpy as np

import pz_sparsecore as pzsc

BATCH, DIM = 2048, 16
VOCABS = (100_000, 300_000, 600_000, 1_000_000) + tuple(
  int(v) for v in np.geomspace(10, 10_000, 22)
)
SIZES = (1, 8, 100, 1000, BATCH)
CALLS = 30
REQUESTS = 40


def build():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("device",))
  specs = {}
  for t, vocab in enumerate(VOCABS):
    table = pzsc.TableSpec(
      name=f"t{t}",
      vocabulary_size=vocab,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(0.05),
      optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.05),
      combiner="sum",
    )
    specs[f"f{t}"] = pzsc.FeatureSpec(
      name=f"f{t}",
      table_spec=table,
      input_shape=(BATCH, 1),
      output_shape=(BATCH, DIM),
    )
  return pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), specs, mesh
  )


def request(rng, n):
  return {
    f"f{t}": rng.integers(0, vocab, (n, 1)) for t, vocab in enumerate(VOCABS)
  }


def by_hand(ids, n):
  """Rows of id 0 up to the specs' batch (their outputs are cut off)."""
  pad = np.zeros((BATCH - n, 1), np.int64)
  return {k: np.concatenate([v, pad]) for k, v in ids.items()}


class _Compiles(logging.Handler):
  def __init__(self):
    super().__init__(logging.WARNING)
    self.count = 0

  def emit(self, record):
    if record.getMessage().startswith("Compiling"):
      self.count += 1


def main():
  embed = build()
  forward = pzsc.variable_jit(lambda e, x: e(x))
  rng = np.random.default_rng(0)

  def ours(ids):
    out = forward(embed, embed.preprocess(ids)[0])
    jax.block_until_ready(out)

  def hand(ids, n):
    out = forward(embed, embed.preprocess(by_hand(ids, n))[0])
    jax.block_until_ready({k: v.data_array[:n] for k, v in out.items()})

  print(f"load average before: {os.getloadavg()[0]:.1f}")
  print(f"{'samples':>8} {'ours ms':>9} {'by hand ms':>11} {'ours/hand':>10}")
  for n in SIZES:
    ids = request(rng, n)
    ours(ids)  # Compile.
    hand(ids, n)
    a, b = [], []
    for _ in range(CALLS):
      t = time.perf_counter()
      ours(ids)
      a.append(time.perf_counter() - t)
      t = time.perf_counter()
      hand(ids, n)
      b.append(time.perf_counter() - t)
    ma, mb = 1e3 * statistics.median(a), 1e3 * statistics.median(b)
    print(f"{n:>8} {ma:>9.2f} {mb:>11.2f} {ma / mb:>10.2f}")
  sizes = rng.integers(1, BATCH + 1, REQUESTS)
  counter = _Compiles()
  logging.getLogger("jax").addHandler(counter)
  jax.config.update("jax_log_compiles", True)
  for keep in (False, True):
    counter.count = 0
    fresh = pzsc.variable_jit(lambda e, x: e(x))
    for n in sizes:
      inputs, _ = embed.preprocess(request(rng, int(n)), keep_padding=keep)
      jax.block_until_ready(fresh(embed, inputs))
    print(
      f"{REQUESTS} requests of 1..{BATCH} samples ({len(set(sizes.tolist()))} "
      f"sizes), keep_padding={keep}: {counter.count} compilations"
    )
  print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
