"""Minibatched preprocessing (`enable_minibatching=True`).

The buffers are decoded here (segment `s * M + m`, absolute row pointers)
and checked against what minibatching promises, computed independently from
the unsplit buffers of the same batch: every entry of the batch in exactly
one minibatch, a row's entries all in one, each minibatch within the limits,
buckets by HighwayHash in upstream's order, and the split that a direct
transcription of upstream's tree walk gives. (`benchmarks/minibatching.py`
compares the buffers with jax-tpu-embedding's own on 300 random cases.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from pz_sparsecore.core import buffer_format, layout
from pz_sparsecore.core import specs as sp
from pz_sparsecore.host import _highwayhash, minibatching
from pz_sparsecore.host import preprocess as pp

P = buffer_format.PAD_ID


def _specs(limit, unique, g, s, batch, vocab=300, suggested=None):
  table = sp.TableSpec(
    vocabulary_size=vocab,
    embedding_dim=8,
    initializer=jax.nn.initializers.zeros,
    optimizer=sp.SGDOptimizerSpec(),
    combiner="mean",
    name="t",
    max_ids_per_partition=limit,
    max_unique_ids_per_partition=unique,
    suggested_coo_buffer_size_per_device=suggested,
  )
  feature = sp.FeatureSpec(
    table_spec=table, input_shape=(batch, 1), output_shape=(batch, 8), name="f"
  )
  return layout.prepare_feature_specs_for_training({"f": feature}, g, s)


def _batch(rng, batch, vocab=300):
  rows = [
    rng.integers(0, vocab, int(rng.integers(0, 16))).astype(np.int32)
    for _ in range(batch)
  ]
  rows[0] = np.array([0, 0, 7, 7, 7], np.int32)  # duplicates
  return {"f": np.array(rows + [None], dtype=object)[:-1]}


def _run(specs, ids, g, s, **kwargs):
  return pp.preprocess_sparse_dense_matmul_input(
    ids, None, specs, g, g, num_sc_per_device=s, **kwargs
  )


def _device(buffers, d):
  """Device `d`'s row pointers and (ids, samples, gains) of stack 't'
  (flat buffers are one device's)."""
  coo = (buffers.lhs_embedding_ids, buffers.lhs_sample_ids, buffers.lhs_gains)
  return np.atleast_2d(buffers.lhs_row_pointers["t"])[d], [
    np.atleast_2d(x["t"])[d] for x in coo
  ]


def _decode(buffers, d, s, n):
  """Device `d`'s entries of `(sc, minibatch, partition)`: (row, sample,
  gain) lists, checking the chain of segments and the alignment of every
  partition."""
  m = int(np.reshape(buffers.num_minibatches, -1)[d])
  rpp = buffer_format.row_pointers_per_sc(n)
  rp, (ids, sids, gains) = _device(buffers, d)
  out, start = {}, 0
  for k in range(s * m):
    ends = rp[k * rpp : (k + 1) * rpp]
    assert np.all(ends[n:] == buffer_format.round_up(ends[n - 1]))
    for p in range(n):
      assert start % 8 == 0 and ends[p] >= start
      out[k // m, k % m, p] = list(
        zip(
          ids[start : ends[p]],
          sids[start : ends[p]],
          gains[start : ends[p]],
          strict=True,
        )
      )
      assert np.all(ids[ends[p] : buffer_format.round_up(ends[p])] == P)
      start = int(buffer_format.round_up(ends[p]))
  assert np.all(rp[s * m * rpp :] == start)  # empty segments after
  assert np.all(ids[start:] == P) and np.all(np.isnan(gains[start:]))
  return out


def _unsplit(buffers, d, s, n):
  """Device `d`'s entries of `(sc, partition)` of standard buffers."""
  rpp = buffer_format.row_pointers_per_sc(n)
  rp, coo = _device(buffers, d)
  per_sc = len(coo[0]) // s
  out = {}
  for sc in range(s):
    ends = rp[sc * rpp : sc * rpp + n]
    starts = buffer_format.partition_starts(ends)
    for p in range(n):
      a, b = sc * per_sc + starts[p], sc * per_sc + ends[p]
      out[sc, p] = list(zip(*(x[a:b] for x in coo), strict=True))
  return out


def _tree_split(counts, limit):
  """Upstream's ComputeMinibatchingSplit, transcribed: level by level,
  a node over `limit` is split and keeps its larger child."""
  counts, split, bit, size = list(counts), 0, 0, 2
  while size <= len(counts):
    for i in range(0, len(counts), size):
      left, right = counts[i], counts[i + size // 2]
      if left + right > limit:
        split |= 1 << bit
        counts[i] = max(left, right)
      else:
        counts[i] = left + right
      bit += 1
    size *= 2
  return split


def _bucket(row, p, n):
  return int(_highwayhash.bucket_ids(np.array([row * n + p], np.int32))[0])


@pytest.mark.parametrize(
  "g, s, limit, unique", [(1, 1, 12, 12), (2, 2, 6, 4), (4, 1, 5, 5)]
)
def test_minibatches_split_the_batch_as_upstream(g, s, limit, unique):
  rng = np.random.default_rng(g * 10 + s)
  batch = 16 * g * s
  ids = _batch(rng, batch)
  n = g * s
  big = _specs(10_000, 10_000, g, s, batch)
  want, want_stats = _run(big, ids, g, s, has_leading_dimension=True)
  got, stats = _run(
    _specs(limit, unique, g, s, batch),
    ids,
    g,
    s,
    has_leading_dimension=True,
    enable_minibatching=True,
  )
  for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
    np.testing.assert_array_equal(
      getattr(stats, field)["t"], getattr(want_stats, field)["t"]
    )
  m = int(got.num_minibatches[0, 0])
  assert got.num_minibatches.shape == (g, 1)
  split, whole, parts = 0, {}, {}
  for d in range(g):
    for (sc, p), entries in _unsplit(want, d, s, n).items():
      buckets = [_bucket(int(r), p, n) for r, _, _ in entries]
      ids_per = np.bincount(buckets, minlength=64)
      uniq = np.zeros(64, int)
      pairs = {(b, int(e[0])) for b, e in zip(buckets, entries, strict=True)}
      for b, _ in pairs:
        uniq[b] += 1
      split |= _tree_split(ids_per, limit) | _tree_split(uniq, unique)
      whole[d, sc, p] = entries
    parts[d] = _decode(got, d, s, n)
  needed = any(
    len(e) > limit or len({r for r, _, _ in e}) > unique for e in whole.values()
  )
  bounds = minibatching.groups(split if needed else 0)
  assert m == len(bounds) - 1
  assert (m > 1) == needed
  minibatch_of_row = {}
  for d in range(g):
    for sc in range(s):
      for p in range(n):
        merged = []
        for mb in range(m):
          entries = parts[d][sc, mb, p]
          assert len(entries) <= limit
          assert len({r for r, _, _ in entries}) <= unique
          keys = [(_bucket(int(r), p, n), r, smp) for r, smp, _ in entries]
          if m > 1:
            assert keys == sorted(keys)
            assert all(bounds[mb] <= k[0] < bounds[mb + 1] for k in keys)
          for r, _, _ in entries:
            assert minibatch_of_row.setdefault((p, int(r)), mb) == mb
          merged += entries
        assert sorted(merged) == sorted(whole[d, sc, p])


def test_groups_follow_the_split_bits():
  assert minibatching.groups(0) == [0, 64]
  assert minibatching.groups(1) == [0, 1, 64]  # node 0 of level 1: 0 | 1
  assert minibatching.groups(1 << 32) == [0, 2, 64]  # first of level 2
  assert minibatching.groups(1 << 62) == [0, 32, 64]  # the root
  assert minibatching.groups(2**63 - 1) == list(range(65))


def test_batch_within_the_limits_is_one_minibatch_of_the_unsplit_entries():
  rng = np.random.default_rng(5)
  g, s, batch = 2, 2, 64
  specs = _specs(10_000, 10_000, g, s, batch)
  ids = _batch(rng, batch)
  want, want_stats = _run(specs, ids, g, s, has_leading_dimension=True)
  got, stats = _run(
    specs, ids, g, s, has_leading_dimension=True, enable_minibatching=True
  )
  assert got.num_minibatches.tolist() == [[1], [1]]
  np.testing.assert_array_equal(
    stats.required_buffer_size_per_sc["t"],
    want_stats.required_buffer_size_per_sc["t"],
  )
  n = g * s
  assert (
    got.lhs_embedding_ids["t"].shape[1]
    == 64 * (want.lhs_embedding_ids["t"].shape[1])
  )
  for d in range(g):
    split = _decode(got, d, s, n)
    for (sc, p), entries in _unsplit(want, d, s, n).items():
      assert split[sc, 0, p] == entries


def test_bucket_over_a_limit_raises_then_drops_when_allowed():
  g, s, batch = 1, 1, 8
  specs = _specs(4, 4, g, s, batch)
  ids = {"f": np.full((batch, 1), 9, np.int32)}  # one row, 8 samples
  with pytest.raises(ValueError, match="stack 't'.*8 ids.*no split"):
    _run(specs, ids, g, s, enable_minibatching=True)
  got, stats = _run(
    specs, ids, g, s, enable_minibatching=True, allow_id_dropping=True
  )
  assert stats.id_drop_counters["t"] == 4
  assert int(stats.max_ids_per_partition["t"][0]) == 8
  # The full bucket splits every node from its leaf pair to the root.
  assert got.num_minibatches.tolist() == [7]
  entries = _decode(got, 0, s, 1)
  assert sum(len(e) for e in entries.values()) == 4


def test_small_suggested_buffer_drops_what_does_not_fit():
  rng = np.random.default_rng(2)
  g, s, batch = 1, 2, 32
  specs = _specs(8, 8, g, s, batch, suggested=32)
  ids = _batch(rng, batch)
  with pytest.warns(UserWarning, match="stack 't'.*overflowed"):
    got, stats = _run(
      specs, ids, g, s, enable_minibatching=True, allow_id_dropping=True
    )
  assert got.lhs_embedding_ids["t"].shape == (32,)
  kept = int(np.count_nonzero(got.lhs_embedding_ids["t"] != P))
  total = sum(len(np.unique(r)) for r in ids["f"])
  assert kept < total and stats.id_drop_counters["t"] >= total - kept - 8


class _ThreadAllReduce:
  """An OR over `n` threads (each thread calls it the same times)."""

  def __init__(self, n):
    self.barrier = threading.Barrier(n)
    self.values, self.lock = [], threading.Lock()

  def __call__(self, value):
    with self.lock:
      self.values.append(value)
    self.barrier.wait()
    result = 0
    for v in self.values:
      result |= v
    self.barrier.wait()
    with self.lock:
      self.values.clear()
    self.barrier.wait()
    return result


def two_host_batch():
  """Specs (G = 4, S = 1) and a batch of 32 whose first 16 samples (one
  host's) need no split and whose last 16 do."""
  specs = _specs(6, 6, 4, 1, 32)
  ids = _batch(np.random.default_rng(9), 32)
  for i in range(16):
    ids["f"][i] = np.array([i], np.int32)
  return specs, ids


def test_hosts_agree_on_the_split_through_all_reduce():
  """Two hosts of 2 devices each: one alone would not split; with the
  all-reduce both use the split of the whole batch, and their buffers are
  the rows of the one-process result."""
  g, s = 4, 1
  specs, ids = two_host_batch()
  whole, _ = _run(
    specs, ids, g, s, has_leading_dimension=True, enable_minibatching=True
  )
  with pytest.raises(ValueError, match="2 of 4 devices.*all_reduce"):
    pp.preprocess_sparse_dense_matmul_input(
      {"f": ids["f"][:16]},
      None,
      specs,
      2,
      g,
      num_sc_per_device=s,
      enable_minibatching=True,
    )
  reduce, results = _ThreadAllReduce(2), {}

  def host(h):
    results[h] = pp.preprocess_sparse_dense_matmul_input(
      {"f": ids["f"][16 * h : 16 * (h + 1)]},
      None,
      specs,
      2,
      g,
      num_sc_per_device=s,
      has_leading_dimension=True,
      enable_minibatching=True,
      all_reduce=reduce,
    )[0]

  threads = [threading.Thread(target=host, args=(h,)) for h in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert int(whole.num_minibatches[0, 0]) > 1
  for h in range(2):
    assert (
      results[h].num_minibatches.tolist()
      == [[int(whole.num_minibatches[0, 0])]] * 2
    )
    for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids"):
      np.testing.assert_array_equal(
        getattr(results[h], field)["t"],
        getattr(whole, field)["t"][2 * h : 2 * h + 2],
      )


WORKER = os.path.join(os.path.dirname(__file__), "minibatching_worker.py")


@pytest.mark.xdist_group("multiprocess")
def test_processes_agree_on_the_split_through_jax_distributed(tmp_path):
  """Two processes under jax.distributed, the default all-reduce: each
  one's buffers are its devices' rows of the one-process result."""
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    subprocess.Popen(
      [sys.executable, WORKER, str(i), str(port), str(tmp_path)],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=env,
    )
    for i in range(2)
  ]
  try:
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
  for proc, output in zip(procs, outputs, strict=True):
    assert proc.returncode == 0, output[-4000:]
  specs, ids = two_host_batch()
  whole, _ = _run(
    specs, ids, 4, 1, has_leading_dimension=True, enable_minibatching=True
  )
  m = int(whole.num_minibatches[0, 0])
  assert m > 1
  for h in range(2):
    got = np.load(tmp_path / f"process{h}.npz")
    assert got["num_minibatches"].tolist() == [[m], [m]]
    for field in ("row_pointers", "embedding_ids", "sample_ids"):
      np.testing.assert_array_equal(
        got[field], getattr(whole, f"lhs_{field}")["t"][2 * h : 2 * h + 2]
      )
