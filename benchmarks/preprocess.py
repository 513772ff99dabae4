"""Throughput of the host-side preprocessor against jax-tpu-embedding's.

26 features x global batch 4096 (one table of 1M rows each, "mean"),
`has_leading_dimension=True`, every device local, on three topologies:
G = 8 devices x S = 1 SparseCore, G = 4 x S = 2 and G = 1 x S = 4. Ragged
batches hold rows of 0-40 Zipf(1.2) ids, given as a 1-D object array of
int32 rows, a list of int32 rows, or a `(values, row_splits)` tuple; the
dense batch is `[4096, 20]` Zipf(1.2) ids. Limits and the COO buffer size
come from a first pass's stats (as FDO would).

Each row times pz_sparsecore and, when `jax_tpu_embedding` (PyPI 0.1.0) is
importable, its C++ preprocessor on the same batch, interleaved (both see
the same load), and prints the ratio (upstream's time over ours: above 1 is
faster) and whether the buffers (every valid entry of every partition, and
the row pointers) and the stats equal upstream's. Upstream reads only numpy
arrays (1-D object or 2-D dense): for lists and tuples it is timed on the
same ids as an object array, as the last column says. It runs on our
prepared specs, handed over with the attributes its C++ reads; the raw
pybind call takes any S (upstream's Python API only S in {2, 4}).

Run: `python benchmarks/preprocess.py [--runs 7]`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from typing import Any

import jax
import numpy as np

from pz_sparsecore.core import layout
from pz_sparsecore.core import specs as sp
from pz_sparsecore.host import preprocess as pp

NUM_FEATURES = 26
GLOBAL_BATCH = 4096
MAX_IDS_PER_SAMPLE = 40
DENSE_IDS_PER_SAMPLE = 20
VOCAB = 1_000_000
ZIPF_A = 1.2
TOPOLOGIES = ((8, 1), (4, 2), (1, 4))  # (G = L, S)


def _zipf_ids(rng: np.random.Generator, n: int) -> np.ndarray:
  return ((rng.zipf(ZIPF_A, size=n) - 1) % VOCAB).astype(np.int32)


def make_batches(seed: int = 0) -> dict[str, tuple[dict[str, Any], Any]]:
  """Per input format: our features and upstream's (None: same)."""
  rng = np.random.default_rng(seed)
  objects, lists, tuples, dense = {}, {}, {}, {}
  for f in range(NUM_FEATURES):
    name = f"f{f:02d}"
    lengths = rng.integers(0, MAX_IDS_PER_SAMPLE + 1, size=GLOBAL_BATCH)
    ids = _zipf_ids(rng, int(lengths.sum()))
    splits = np.concatenate([[0], np.cumsum(lengths)])
    rows = np.split(ids, splits[1:-1])
    objects[name] = np.empty(GLOBAL_BATCH, dtype=object)
    objects[name][:] = rows
    lists[name] = rows
    tuples[name] = (ids, splits)
    dense[name] = _zipf_ids(rng, GLOBAL_BATCH * DENSE_IDS_PER_SAMPLE).reshape(
      GLOBAL_BATCH, DENSE_IDS_PER_SAMPLE
    )
  return {
    "object array": (objects, None),
    "list of arrays": (lists, objects),
    "(values, row_splits)": (tuples, objects),
    f"dense [B, {DENSE_IDS_PER_SAMPLE}]": (dense, None),
  }


def our_specs(
  g: int, s: int, max_ids: int, max_unique: int, suggested: int | None
) -> dict[str, sp.FeatureSpec]:
  """The benchmark's feature specs, prepared for `g` devices x `s` SCs."""
  specs = {}
  for f in range(NUM_FEATURES):
    table = sp.TableSpec(
      name=f"t{f:02d}",
      vocabulary_size=VOCAB,
      embedding_dim=16,
      initializer=jax.nn.initializers.zeros,
      optimizer=sp.SGDOptimizerSpec(),
      combiner="mean",
      max_ids_per_partition=max_ids,
      max_unique_ids_per_partition=max_unique,
      suggested_coo_buffer_size_per_device=suggested,
    )
    specs[f"f{f:02d}"] = sp.FeatureSpec(
      name=f"f{f:02d}",
      table_spec=table,
      input_shape=[GLOBAL_BATCH, MAX_IDS_PER_SAMPLE],
      output_shape=[GLOBAL_BATCH, 16],
    )
  return layout.prepare_feature_specs_for_training(specs, g, s)


def _as_upstream(feature: sp.FeatureSpec) -> types.SimpleNamespace:
  """A prepared spec with the attributes upstream's C++ reads."""
  ns = types.SimpleNamespace
  table = feature.table_spec
  stacked = table.stacked_table_spec
  ids = feature.id_transformation
  return ns(
    name=feature.name,
    input_shape=list(feature.input_shape),
    _id_transformation=ns(
      row_offset=ids.row_offset,
      col_offset=ids.col_offset,
      col_shift=ids.col_shift,
    ),
    table_spec=ns(
      vocabulary_size=table.vocabulary_size,
      setting_in_stack=ns(stack_name=table.setting_in_stack.stack_name),
      stacked_table_spec=ns(
        combiner=stacked.combiner,
        max_ids_per_partition=stacked.max_ids_per_partition,
        max_unique_ids_per_partition=stacked.max_unique_ids_per_partition,
        suggested_coo_buffer_size_per_device=(
          stacked.suggested_coo_buffer_size_per_device
        ),
      ),
    ),
  )


def upstream_preprocessor(specs: dict[str, sp.FeatureSpec], g: int, s: int):
  """A callable running upstream's preprocessor, or None if not installed."""
  try:
    from jax_tpu_embedding.sparsecore.lib.core import (
      pybind_input_preprocessing as pybind,
    )
  except ImportError:
    return None
  spec_leaves = [_as_upstream(f) for f in jax.tree.leaves(specs)]

  def run(features: dict[str, Any]):
    return pybind.preprocess_sparse_dense_matmul_input(
      jax.tree.leaves(features),
      None,
      spec_leaves,
      g,
      g,
      num_sc_per_device=s,
      sharding_strategy=pybind.ShardingStrategy.MOD,
      has_leading_dimension=True,
      allow_id_dropping=False,
    )

  return run


def buffers_equal(ours: pp.PreprocessedInput, theirs: Any, s: int) -> bool:
  """Row pointers equal, and entries equal inside every partition's range."""
  for stack, rp in ours.lhs_row_pointers.items():
    if not np.array_equal(rp, theirs[0][stack]):
      return False
    num_local = rp.shape[0]
    rp = rp.reshape(num_local * s, -1)
    for field, other in zip(
      ("lhs_embedding_ids", "lhs_sample_ids", "lhs_gains"),
      theirs[1:4],
      strict=True,
    ):
      a = getattr(ours, field)[stack].reshape(num_local * s, -1)
      b = other[stack].reshape(num_local * s, -1)
      for sc in range(num_local * s):
        start = 0
        for end in rp[sc]:
          if not np.array_equal(a[sc, start:end], b[sc, start:end]):
            return False
          start = max(start, -(-int(end) // 8) * 8)
  return True


def stats_equal(ours: pp.SparseDenseMatmulInputStats, theirs: Any) -> bool:
  pairs = (
    (ours.max_ids_per_partition, theirs.max_ids_per_partition),
    (ours.max_unique_ids_per_partition, theirs.max_unique_ids_per_partition),
    (ours.required_buffer_size_per_sc, theirs.required_buffer_sizes),
  )
  return all(
    a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    for a, b in pairs
  ) and ours.id_drop_counters == dict(theirs.dropped_id_count)


def timeit(fns: dict[str, Any], runs: int) -> dict[str, float]:
  """Median seconds per call of each function, runs interleaved.

  Interleaving makes both implementations see the same background load.
  """
  for fn in fns.values():
    fn()
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(runs):
    for name, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(t) for name, t in times.items()}


def fdo_specs(batches: dict[str, Any], g: int, s: int) -> dict[str, Any]:
  """Specs whose limits and buffer size fit every batch (a first pass)."""
  loose = our_specs(g, s, 2**16, 2**16, 2**16 * s)
  max_ids = max_unique = required = 0
  for features, _ in batches.values():
    _, stats = pp.preprocess_sparse_dense_matmul_input(
      features, None, loose, g, g, num_sc_per_device=s
    )
    for v in stats.max_ids_per_partition.values():
      max_ids = max(max_ids, int(v.max()))
    for v in stats.max_unique_ids_per_partition.values():
      max_unique = max(max_unique, int(v.max()))
    for v in stats.required_buffer_size_per_sc.values():
      required = max(required, int(v.max()))
  return our_specs(g, s, max_ids, max_unique, required * s)


def bench_topology(batches: dict[str, Any], g: int, s: int, runs: int):
  """Prints one row per input format on `g` devices x `s` SparseCores."""
  specs = fdo_specs(batches, g, s)
  upstream = upstream_preprocessor(specs, g, s)
  for fmt, (features, upstream_features) in batches.items():
    upstream_features = (
      features if upstream_features is None else upstream_features
    )

    def ours(features=features):
      return pp.preprocess_sparse_dense_matmul_input(
        features,
        None,
        specs,
        g,
        g,
        num_sc_per_device=s,
        has_leading_dimension=True,
      )

    fns = {"ours": ours}
    if upstream is not None:
      fns["upstream"] = lambda x=upstream_features: upstream(x)
    t = timeit(fns, runs)
    row = f"{fmt:22s} G={g} S={s}  ours {t['ours'] * 1e3:7.1f} ms"
    if upstream is None:
      print(row + "  upstream not installed")
      continue
    buffers, stats = ours()
    theirs = upstream(upstream_features)
    same = buffers_equal(buffers, theirs, s)
    same_stats = stats_equal(stats, theirs[-1])
    given = "same input" if upstream_features is features else "object array"
    print(
      f"{row}  upstream {t['upstream'] * 1e3:7.1f} ms  "
      f"ratio {t['upstream'] / t['ours']:5.2f}x  buffers equal {same!s:5s} "
      f"stats equal {same_stats!s:5s} upstream input: {given}"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=7)
  args = parser.parse_args()
  batches = make_batches()
  ragged_ids = sum(
    len(v[0]) for v in batches["(values, row_splits)"][0].values()
  )
  print(
    f"{NUM_FEATURES} features x batch {GLOBAL_BATCH}, vocabulary {VOCAB:,}: "
    f"ragged 0-{MAX_IDS_PER_SAMPLE} Zipf({ZIPF_A}) ids per sample "
    f"({ragged_ids:,} ids), dense {DENSE_IDS_PER_SAMPLE} per sample; "
    f"{os.cpu_count()} CPUs; ratio = upstream ms / ours (> 1: ours faster)"
  )
  for g, s in TOPOLOGIES:
    bench_topology(batches, g, s, args.runs)


if __name__ == "__main__":
  main()
