"""Minibatched preprocessing against jax-tpu-embedding's C++, side by side.

For many random batches and topologies (1 to 3 stacks, sum/mean/sqrtn,
weights, duplicates, empty samples, `S` in {1, 2, 4}, `G` in {1, 2, 4},
limits from far over the batch to a few ids, with and without id dropping,
some with a suggested buffer that overflows), runs pz_sparsecore's
`preprocess_sparse_dense_matmul_input(..., enable_minibatching=True)` and
upstream's pybind preprocessor on the same specs and batch, and checks
that the number of minibatches, the stats and every buffer entry upstream
defines are equal (upstream leaves the row pointers past the last
minibatch's segment, and the COO entries past the last segment, unwritten).
Then times both on one batch that needs minibatching, and the user's
training loop (`preprocess` then `SparseCoreTrainer.step`) on minibatched
buffers beside the same loop on plain ones (no peer runs minibatches off
TPUs).

    python benchmarks/minibatching.py [--cases 300] [--seed 0]

Needs `jax-tpu-embedding` installed beside pz_sparsecore (its pybind
module only; the benchmarks extras).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import buffer_format, layout
from pz_sparsecore.core import specs as sp
from pz_sparsecore.host import preprocess as pp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import preprocess as bench_preprocess  # noqa: E402


def _specs(rng, g: int, s: int, batch: int) -> dict[str, sp.FeatureSpec]:
  """1-3 tables (some sharing a stack) with random limits."""
  n_tables = int(rng.integers(1, 4))
  combiner = str(rng.choice(["sum", "mean", "sqrtn"]))
  limit = int(rng.choice([2, 4, 8, 16, 1000]))
  suggested = None
  if rng.random() < 0.2:
    suggested = int(rng.integers(1, 48)) * 8 * s
  features = {}
  for i in range(n_tables):
    table = sp.TableSpec(
      vocabulary_size=int(rng.integers(8, 400)),
      embedding_dim=8,
      initializer=jax.nn.initializers.zeros,
      optimizer=sp.SGDOptimizerSpec(),
      combiner=combiner,
      name=f"t{i}",
      max_ids_per_partition=limit,
      max_unique_ids_per_partition=max(1, limit // int(rng.integers(1, 3))),
      suggested_coo_buffer_size_per_device=suggested,
    )
    features[f"f{i}"] = sp.FeatureSpec(
      table_spec=table,
      input_shape=(batch, 1),
      output_shape=(batch, 8),
      name=f"f{i}",
    )
  return layout.prepare_feature_specs_for_training(features, g, s)


def _batch(rng, specs, weighted: bool) -> tuple[dict, dict | None]:
  ids, weights = {}, {}
  for name, f in specs.items():
    rows = []
    for _ in range(f.input_shape[0]):
      n = int(rng.integers(0, 12))
      hot = rng.integers(0, 4, n)  # duplicates
      cold = rng.integers(0, f.table_spec.vocabulary_size, n)
      rows.append(np.where(rng.random(n) < 0.3, hot, cold).astype(np.int32))
    ids[name] = np.array(rows + [None], dtype=object)[:-1]
    weights[name] = np.array(
      [rng.random(len(r)).astype(np.float32) + 0.5 for r in rows] + [None],
      dtype=object,
    )[:-1]
  return ids, (weights if weighted else None)


def _upstream(specs, ids, weights, g, s, drop):
  from jax_tpu_embedding.sparsecore.lib.core import (
    pybind_input_preprocessing as pybind,
  )

  leaves = [bench_preprocess._as_upstream(f) for f in jax.tree.leaves(specs)]
  return pybind.preprocess_sparse_dense_matmul_input(
    jax.tree.leaves(ids),
    None if weights is None else jax.tree.leaves(weights),
    leaves,
    g,
    g,
    num_sc_per_device=s,
    sharding_strategy=pybind.ShardingStrategy.MOD,
    has_leading_dimension=True,
    allow_id_dropping=drop,
    enable_minibatching=True,
  )


def _ours(specs, ids, weights, g, s, drop):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return pp.preprocess_sparse_dense_matmul_input(
      ids,
      weights,
      specs,
      g,
      g,
      num_sc_per_device=s,
      has_leading_dimension=True,
      allow_id_dropping=drop,
      enable_minibatching=True,
    )


def _compare(ours, stats, theirs, s: int, n: int) -> str | None:
  """Where our result differs from upstream's, or None."""
  m = int(theirs[4])
  if int(ours.num_minibatches[0, 0]) != m:
    return f"num_minibatches {int(ours.num_minibatches[0, 0])} vs {m}"
  up = theirs[5]
  for field, theirs_field in (
    ("max_ids_per_partition", up.max_ids_per_partition),
    ("max_unique_ids_per_partition", up.max_unique_ids_per_partition),
    ("required_buffer_size_per_sc", up.required_buffer_sizes),
  ):
    for name, value in getattr(stats, field).items():
      if not np.array_equal(value, np.asarray(theirs_field[name])):
        return f"stats {field} of {name}"
  for name, value in stats.id_drop_counters.items():
    if value != up.dropped_id_count[name]:
      return f"dropped {value} vs {up.dropped_id_count[name]} of {name}"
  rpp = buffer_format.row_pointers_per_sc(n)
  for name, rp in ours.lhs_row_pointers.items():
    written = s * m * rpp
    if not np.array_equal(rp[:, :written], theirs[0][name][:, :written]):
      return f"row pointers of {name}"
    for d in range(rp.shape[0]):
      end = int(buffer_format.round_up(rp[d, written - 1]))
      for i, field in enumerate(("lhs_embedding_ids", "lhs_sample_ids")):
        a = getattr(ours, field)[name][d, :end]
        if not np.array_equal(a, theirs[1 + i][name][d, :end]):
          return f"{field} of {name} on device {d}"
      a, b = ours.lhs_gains[name][d, :end], theirs[3][name][d, :end]
      if not np.allclose(a, b, rtol=1e-6, equal_nan=True):
        return f"gains of {name} on device {d}"
  return None


def cross_check(cases: int, seed: int) -> tuple[int, int, list[str]]:
  rng = np.random.default_rng(seed)
  failures, split = [], 0
  for case in range(cases):
    g = int(rng.choice([1, 2, 4]))
    s = int(rng.choice([1, 2, 4]))
    batch = g * s * int(rng.integers(1, 6))
    specs = _specs(rng, g, s, batch)
    ids, weights = _batch(rng, specs, bool(rng.random() < 0.5))
    drop = bool(rng.random() < 0.5)
    try:
      ours, stats = _ours(specs, ids, weights, g, s, drop)
    except ValueError as e:
      ours, stats = e, None
    theirs = None
    if not isinstance(ours, ValueError) or drop:
      theirs = _upstream(specs, ids, weights, g, s, drop)
    if isinstance(ours, ValueError):
      # Upstream aborts the process where a bucket alone is over a limit.
      if "no split can divide" not in str(ours):
        failures.append(f"case {case}: {ours}")
      continue
    split += int(theirs[4]) > 1
    where = _compare(ours, stats, theirs, s, g * s)
    if where:
      failures.append(f"case {case} (G={g}, S={s}, drop={drop}): {where}")
  return cases, split, failures


def timing(repeats: int = 5) -> tuple[float, float, int]:
  """Median ms of ours and upstream's on a batch of 4096 x ~20 ids, G=4,
  S=2, limits a quarter of what a partition gets (it splits)."""
  rng = np.random.default_rng(1)
  g, s, batch = 4, 2, 4096
  table = sp.TableSpec(
    vocabulary_size=100_000,
    embedding_dim=16,
    initializer=jax.nn.initializers.zeros,
    optimizer=sp.SGDOptimizerSpec(),
    combiner="sum",
    name="t",
    max_ids_per_partition=320,
    max_unique_ids_per_partition=320,
  )
  feature = sp.FeatureSpec(
    table_spec=table, input_shape=(batch, 1), output_shape=(batch, 16), name="f"
  )
  specs = layout.prepare_feature_specs_for_training({"f": feature}, g, s)
  ids = {
    "f": np.array(
      [
        rng.integers(0, 100_000, int(rng.integers(10, 30))).astype(np.int32)
        for _ in range(batch)
      ]
      + [None],
      dtype=object,
    )[:-1]
  }
  minibatches = int(
    _ours(specs, ids, None, g, s, False)[0].num_minibatches[0, 0]
  )
  times = {"ours": [], "upstream": []}
  for _ in range(repeats + 1):
    for who, fn in (("ours", _ours), ("upstream", _upstream)):
      t0 = time.perf_counter()
      fn(specs, ids, None, g, s, False)
      times[who].append(time.perf_counter() - t0)
  return (
    statistics.median(times["ours"][1:]) * 1e3,
    statistics.median(times["upstream"][1:]) * 1e3,
    minibatches,
  )


@pz.pytree_dataclass
class _Model(pz.nn.Layer):
  """The layer and one dense scale: what the trainer steps."""

  embed: pzsc.SparseCoreEmbed
  w: pz.ParameterValue

  def __call__(self, inputs, /, **side_inputs):
    acts = self.embed(inputs)["f"].unwrap("batch", "embedding")
    return acts * self.w.value


def _loss(*, model, state, rng, inputs, target):
  del rng
  loss = jnp.mean((model(inputs) - target) ** 2)
  return loss, state, {"loss": loss}


def step_timing(repeats: int = 5) -> list[tuple[str, int, float, float]]:
  """The user's training loop, `preprocess` then `SparseCoreTrainer.step`,
  on the same batches: plain buffers under limits the batches fit, and
  minibatched buffers under limits an eighth of that (one device, S=2, a
  100,000 x 16 Adagrad table, 4096 samples of 10-30 ids). Median ms of each
  part; the step includes waiting for its result."""
  rng = np.random.default_rng(2)
  batch, dim, vocab = 4096, 16, 100_000
  batches = [
    [rng.integers(0, vocab, int(rng.integers(10, 30))) for _ in range(batch)]
    for _ in range(repeats + 2)
  ]
  target = jnp.asarray(rng.normal(size=(batch, dim)), jnp.float32)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("device",))
  rows = []
  for name, limit, minibatching in (
    ("plain", 24_000, False),
    ("minibatched", 3_000, True),
  ):
    table = sp.TableSpec(
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=sp.AdagradOptimizerSpec(learning_rate=0.1),
      combiner="mean",
      name="t",
      max_ids_per_partition=limit,
      max_unique_ids_per_partition=limit,
    )
    feature = sp.FeatureSpec(
      table_spec=table,
      input_shape=(batch, 1),
      output_shape=(batch, dim),
      name="f",
    )
    embed = pzsc.SparseCoreEmbed.from_config(
      "emb", jax.random.key(0), {"f": feature}, mesh, num_sc_per_device=2
    )
    model = _Model(embed=embed, w=pz.Parameter(value=jnp.ones(()), label="w"))
    trainer = pzsc.SparseCoreTrainer.build(
      jax.random.key(1), model, optax.sgd(0.1), _loss
    )
    times: dict[str, list[float]] = {"pre": [], "step": []}
    count = 1
    for ids in batches:
      t0 = time.perf_counter()
      inputs, _ = trainer.model.embed.preprocess(
        {"f": ids}, enable_minibatching=minibatching
      )
      t1 = time.perf_counter()
      jax.block_until_ready(trainer.step(inputs=inputs, target=target))
      t2 = time.perf_counter()
      times["pre"].append(t1 - t0)
      times["step"].append(t2 - t1)
      if minibatching:
        count = int(np.max(inputs.num_minibatches))
    rows.append(
      (
        name,
        count,
        statistics.median(times["pre"][2:]) * 1e3,
        statistics.median(times["step"][2:]) * 1e3,
      )
    )
  return rows


def main(argv: Any = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", type=int, default=300)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  try:
    import jax_tpu_embedding  # noqa: F401
  except ImportError:
    print("jax-tpu-embedding is not installed: nothing to compare with")
    return 1
  cases, split, failures = cross_check(args.cases, args.seed)
  print(
    f"cross-check: {cases} random cases ({split} split into minibatches), "
    f"{cases - len(failures)} equal to upstream"
  )
  for line in failures[:20]:
    print("  ", line)
  ours, theirs, minibatches = timing()
  print()
  print(
    f"| batch (4096 samples, G=4, S=2, {minibatches} minibatches) | ms "
    "| vs upstream |"
  )
  print("|---|---|---|")
  print(f"| pz_sparsecore | {ours:.1f} | {theirs / ours:.2f}x |")
  print(f"| jax-tpu-embedding 0.1.0 | {theirs:.1f} | 1.00x |")
  rows = step_timing()
  print()
  print(
    "| training loop (1 device, S=2, 4096 samples) | minibatches | "
    "preprocess ms | step ms | total vs plain |"
  )
  print("|---|---|---|---|---|")
  plain = rows[0][2] + rows[0][3]
  for name, count, pre, step in rows:
    print(
      f"| {name} | {count} | {pre:.1f} | {step:.1f} | "
      f"{(pre + step) / plain:.2f}x |"
    )
  return 1 if failures else 0


if __name__ == "__main__":
  raise SystemExit(main())
