"""Throughput of the host-side preprocessor, and of upstream's when installed.

26 features x global batch 4096, ragged rows of 0-40 Zipf-distributed ids
(vocabulary 1M per feature, one table each), 8 partitions (G = L = 8, S = 1),
`has_leading_dimension=True`. Limits and the COO buffer size are set from a
first pass's stats (as FDO would). Prints M ids/s for pz_sparsecore and, when
`jax_tpu_embedding` (PyPI 0.1.0) is importable, for its C++ preprocessor on
the same input, after checking that both produce the same buffers.

Run: `python benchmarks/preprocess.py [--runs 9]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import jax
import numpy as np

from pz_sparsecore import layout
from pz_sparsecore import preprocess as pp
from pz_sparsecore import specs as sp

NUM_FEATURES = 26
GLOBAL_BATCH = 4096
MAX_IDS_PER_SAMPLE = 40
VOCAB = 1_000_000
ZIPF_A = 1.2
G = L = 8
S = 1


def make_batch(seed: int = 0) -> tuple[dict[str, np.ndarray], int]:
  """Ragged int32 rows per feature (object arrays) and the total id count."""
  rng = np.random.default_rng(seed)
  features = {}
  total = 0
  for f in range(NUM_FEATURES):
    lengths = rng.integers(0, MAX_IDS_PER_SAMPLE + 1, size=GLOBAL_BATCH)
    ids = ((rng.zipf(ZIPF_A, size=int(lengths.sum())) - 1) % VOCAB).astype(
      np.int32
    )
    rows = np.empty(GLOBAL_BATCH, dtype=object)
    rows[:] = np.split(ids, np.cumsum(lengths)[:-1])
    features[f"f{f:02d}"] = rows
    total += len(ids)
  return features, total


def build_specs(
  spec_module, max_ids: int, max_unique: int, suggested: int | None
):
  """The benchmark's feature specs; both libraries take the same fields."""
  specs = {}
  for f in range(NUM_FEATURES):
    table = spec_module.TableSpec(
      name=f"t{f:02d}",
      vocabulary_size=VOCAB,
      embedding_dim=16,
      initializer=jax.nn.initializers.zeros,
      optimizer=spec_module.SGDOptimizerSpec(),
      combiner="mean",
      max_ids_per_partition=max_ids,
      max_unique_ids_per_partition=max_unique,
      suggested_coo_buffer_size_per_device=suggested,
    )
    specs[f"f{f:02d}"] = spec_module.FeatureSpec(
      name=f"f{f:02d}",
      table_spec=table,
      input_shape=[GLOBAL_BATCH, MAX_IDS_PER_SAMPLE],
      output_shape=[GLOBAL_BATCH, 16],
    )
  return specs


def our_specs(max_ids: int, max_unique: int, suggested: int | None):
  specs = build_specs(sp, max_ids, max_unique, suggested)
  return layout.prepare_feature_specs_for_training(specs, G, S)


def upstream_call(max_ids: int, max_unique: int, suggested: int | None):
  """A callable running upstream's preprocessor, or None if not installed."""
  try:
    from jax_tpu_embedding.sparsecore.lib.core import (
      pybind_input_preprocessing as pybind,
    )
    from jax_tpu_embedding.sparsecore.lib.nn import embedding
    from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec as es
  except ImportError:
    return None
  specs = build_specs(es, max_ids, max_unique, suggested)
  # Upstream's prepare only accepts S in {2, 4}; the stacking depends on
  # N = G * S alone, so prepare for the same N with S = 2.
  embedding.prepare_feature_specs_for_training(
    specs, global_device_count=G * S // 2, num_sc_per_device=2
  )
  spec_leaves = jax.tree.leaves(specs)

  def run(features):
    # S = 1 is only accepted by the raw pybind function.
    return pybind.preprocess_sparse_dense_matmul_input(
      jax.tree.leaves(features),
      None,
      spec_leaves,
      L,
      G,
      num_sc_per_device=S,
      sharding_strategy=pybind.ShardingStrategy.MOD,
      has_leading_dimension=True,
      allow_id_dropping=False,
    )

  return run


def valid_entries_equal(ours, theirs) -> bool:
  """Row pointers equal and entries equal inside every partition's range."""
  n = G * S
  for stack, rp in ours.lhs_row_pointers.items():
    if not np.array_equal(rp, theirs[0][stack]):
      return False
    rp = rp.reshape(L, S, -1)
    for field, other in zip(
      ("lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"),
      theirs[1:4],
      strict=True,
    ):
      a = getattr(ours, field)[stack].reshape(L, S, -1)
      b = other[stack].reshape(L, S, -1)
      for d in range(L):
        for s in range(S):
          start = 0
          for p in range(n):
            end = rp[d, s, p]
            if not np.array_equal(a[d, s, start:end], b[d, s, start:end]):
              return False
            start = -(-int(end) // 8) * 8
  return True


def timeit(fns: dict[str, Any], runs: int) -> dict[str, float]:
  """Median seconds per call of each function, runs interleaved.

  Interleaving makes both implementations see the same background load.
  """
  for fn in fns.values():
    fn()
    fn()
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(runs):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=15)
  args = parser.parse_args()
  features, total = make_batch()
  print(
    f"{NUM_FEATURES} features x batch {GLOBAL_BATCH}, 0-{MAX_IDS_PER_SAMPLE} "
    f"Zipf({ZIPF_A}) ids per sample over {VOCAB:,} rows: {total:,} ids; "
    f"G=L={G}, S={S}; {os.cpu_count()} CPUs"
  )
  _, stats = pp.preprocess_sparse_dense_matmul_input(
    features,
    None,
    our_specs(2**16, 2**16, None),
    L,
    G,
    num_sc_per_device=S,
    has_leading_dimension=True,
  )
  max_ids = int(max(v.max() for v in stats.max_ids_per_partition.values()))
  max_unique = int(
    max(v.max() for v in stats.max_unique_ids_per_partition.values())
  )
  suggested = int(
    max(v.max() for v in stats.required_buffer_size_per_sc.values()) * S
  )
  print(
    f"limits from a first pass: max_ids={max_ids} max_unique={max_unique} "
    f"suggested_coo_buffer_size_per_device={suggested}"
  )
  specs = our_specs(max_ids, max_unique, suggested)

  def ours():
    return pp.preprocess_sparse_dense_matmul_input(
      features,
      None,
      specs,
      L,
      G,
      num_sc_per_device=S,
      has_leading_dimension=True,
    )

  fns = {"pz_sparsecore": ours}
  upstream = upstream_call(max_ids, max_unique, suggested)
  if upstream is not None:
    fns["jax_tpu_embedding"] = lambda: upstream(features)
  times = timeit(fns, args.runs)
  for name, t in times.items():
    print(f"{name:20s} {t * 1e3:8.2f} ms  {total / t / 1e6:7.1f} M ids/s")
  if upstream is None:
    print("jax_tpu_embedding    not installed")
    return
  same = valid_entries_equal(ours()[0], upstream(features))
  ratio = times["jax_tpu_embedding"] / times["pz_sparsecore"]
  print(
    f"ratio (ours / upstream throughput): {ratio:.2f}x; buffers equal "
    f"inside every partition: {same}"
  )


if __name__ == "__main__":
  main()
