"""compat `lib.core.input_preprocessing` against an independent reference."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from pz_sparsecore.compat.lib.core import constants, input_preprocessing
from pz_sparsecore.compat.utils import utils

PAD = constants.PADDING_VALUE
preprocess = input_preprocessing.preprocess_sparse_dense_matmul_input


def _mesh(num_devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:num_devices]), ("x",))


def _r8(x: int) -> int:
  return (x + 7) // 8 * 8


def _partitions(batch, weights, num_sc, n):
  """(SparseCore, partition) -> {(local row, sample): summed gain}."""
  parts = collections.defaultdict(lambda: collections.defaultdict(float))
  rows_per_sc = len(batch) // num_sc
  for i, (ids, ws) in enumerate(zip(batch, weights, strict=True)):
    sc, sample = divmod(i, rows_per_sc)
    for e, w in zip(ids, ws, strict=True):
      parts[sc, int(e) % n][int(e) // n, sample] += float(w)
  return parts


def _counts(parts):
  """The largest (ids, unique ids) count of any partition."""
  ids = max((len(p) for p in parts.values()), default=0)
  unique = max((len({row for row, _ in p}) for p in parts.values()), default=0)
  return ids, unique


def _reference(minibatches, weights, num_devices, num_sc, max_ids, *, mb):
  """Upstream's buffers, written out partition by partition."""
  n = num_devices * num_sc
  segment = _r8(max_ids) * n
  size = segment * num_sc * len(minibatches)
  col = np.full(size, PAD, np.int32)
  row = np.full(size, PAD, np.int32)
  gain = np.full(size, np.nan, np.float32)
  pointers = []
  parts = [
    _partitions(b, w, num_sc, n)
    for b, w in zip(minibatches, weights, strict=True)
  ]
  pos = 0
  for sc in range(num_sc):
    base = 0 if mb else sc * segment
    pos = pos if mb else base
    for batch_parts in parts:
      for p in range(n):
        for (local_row, sample), g in sorted(batch_parts[sc, p].items()):
          col[pos], row[pos], gain[pos] = local_row, sample, g
          pos += 1
        pointers.append(pos - base)
        pos = _r8(pos)
      pointers += [pos - base] * (max(n, 8) - n)
  return np.array(pointers, np.int32), col, row, gain


def _assert_equal(actual, expected):
  for a, e in zip(actual, expected, strict=True):
    np.testing.assert_array_equal(np.asarray(a), e)


def _random_batch(rng, batch, vocab, max_len, ragged):
  """Ids (with duplicates, empty rows if ragged) and dyadic weights."""
  if ragged:
    lengths = rng.integers(0, max_len + 1, batch)
    ids = [rng.integers(0, vocab, k).astype(np.int32) for k in lengths]
    weights = [rng.integers(1, 9, k) / 4 for k in lengths]
    return ids, weights
  ids = rng.integers(0, vocab, (batch, max_len)).astype(np.int32)
  return ids, rng.integers(1, 9, (batch, max_len)) / 4


@pytest.mark.parametrize("num_devices", [1, 2, 8])
@pytest.mark.parametrize("num_sc", [1, 2, 4])
@pytest.mark.parametrize("ragged", [False, True])
def test_matches_reference(num_devices, num_sc, ragged):
  rng = np.random.default_rng(num_devices * 10 + num_sc + 100 * ragged)
  n = num_devices * num_sc
  ids, weights = _random_batch(rng, 4 * num_sc, 3 * n + 5, 6, ragged)
  got = preprocess(
    ids,
    weights,
    _mesh(num_devices),
    max_ids_per_partition=30,
    max_unique_ids_per_partition=30,
    num_sc_per_device=num_sc,
  )
  assert [a.dtype for a in got] == [np.int32] * 3 + [np.float32]
  assert all(isinstance(a, jax.Array) for a in got)
  _assert_equal(
    got, _reference([ids], [weights], num_devices, num_sc, 30, mb=False)
  )


def test_ids_on_shard_boundaries_and_empty_rows():
  num_devices, num_sc = 2, 2
  n = num_devices * num_sc
  ids = [
    np.array([0, n - 1, n, 2 * n - 1], np.int32),
    np.array([], np.int32),
    np.array([n * 9, n * 9 - 1, 0, 0], np.int32),
    np.array([], np.int32),
  ]
  weights = [np.full(len(r), 0.5) for r in ids]
  got = preprocess(
    ids,
    weights,
    _mesh(num_devices),
    max_ids_per_partition=8,
    max_unique_ids_per_partition=8,
    num_sc_per_device=num_sc,
  )
  _assert_equal(
    got, _reference([ids], [weights], num_devices, num_sc, 8, mb=False)
  )


def test_duplicates_are_merged_with_summed_gains():
  # N = 2: odd ids in partition 1, even in partition 0; row = id // 2.
  ids = [[5, 5, 2], [5]]
  weights = [[1.0, 2.0, 0.5], [4.0]]
  rp, col, row, gain = preprocess(
    ids,
    weights,
    _mesh(2),
    max_ids_per_partition=8,
    max_unique_ids_per_partition=8,
    num_sc_per_device=1,
  )
  np.testing.assert_array_equal(rp, [1, 10, 16, 16, 16, 16, 16, 16])
  np.testing.assert_array_equal(col, [1] + [PAD] * 7 + [2, 2] + [PAD] * 6)
  np.testing.assert_array_equal(row, [0] + [PAD] * 7 + [0, 1] + [PAD] * 6)
  np.testing.assert_array_equal(
    gain, [0.5] + [np.nan] * 7 + [3.0, 4.0] + [np.nan] * 6
  )


def test_object_arrays_and_unit_weights():
  ids = np.array([[3], [8], [1], [6]], dtype=object)
  ragged = np.array([np.array([3]), np.array([8]), np.array([1]), [6]], object)
  ones = [[1.0]] * 4
  expected = _reference([ids], [ones], 1, 2, 8, mb=False)
  dense = jax.numpy.asarray(ids.astype(np.int32))
  cases = ((ids, ones), (ragged, None), (ids.tolist(), None), (dense, None))
  for features, weights in cases:
    got = preprocess(
      features,
      weights,
      _mesh(1),
      max_ids_per_partition=8,
      max_unique_ids_per_partition=8,
      num_sc_per_device=2,
    )
    _assert_equal(got, expected)


def test_default_sparsecores_come_from_the_mesh():
  ids = np.arange(16, dtype=np.int32).reshape(8, 2)
  weights = np.ones((8, 2))
  kwargs = dict(max_ids_per_partition=8, max_unique_ids_per_partition=8)
  num_sc = utils.num_sparsecores_per_device(jax.devices()[0])
  _assert_equal(
    preprocess(ids, weights, _mesh(2), **kwargs),
    preprocess(ids, weights, _mesh(2), num_sc_per_device=num_sc, **kwargs),
  )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_limits_raise_exactly_when_exceeded(seed):
  rng = np.random.default_rng(seed)
  num_devices, num_sc = 2, 2
  ids, weights = _random_batch(rng, 8, 12, 10, ragged=True)
  max_ids, max_unique = _counts(_partitions(ids, weights, num_sc, 4))
  mesh = _mesh(num_devices)

  def run(ids_limit, unique_limit):
    return preprocess(
      ids,
      weights,
      mesh,
      max_ids_per_partition=ids_limit,
      max_unique_ids_per_partition=unique_limit,
      num_sc_per_device=num_sc,
    )

  expected = _reference(
    [ids], [weights], num_devices, num_sc, max_ids, mb=False
  )
  _assert_equal(run(max_ids, max_unique), expected)
  with pytest.raises(ValueError, match="max_ids_per_partition"):
    run(max_ids - 1, max_unique)
  with pytest.raises(ValueError, match="max_unique_ids_per_partition"):
    run(max_ids, max_unique - 1)


@pytest.mark.parametrize("num_devices", [1, 4])
@pytest.mark.parametrize("num_sc", [1, 2])
def test_minibatching_matches_reference(num_devices, num_sc):
  rng = np.random.default_rng(7 + num_devices + num_sc)
  n = num_devices * num_sc
  batches = [
    _random_batch(rng, rows * num_sc, 2 * n + 3, 5, ragged=True)
    for rows in (2, 1, 3)
  ]
  ids = [b[0] for b in batches]
  weights = [b[1] for b in batches]
  got = preprocess(
    ids,
    weights,
    _mesh(num_devices),
    max_ids_per_partition=20,
    max_unique_ids_per_partition=20,
    num_sc_per_device=num_sc,
    enable_minibatching=True,
  )
  _assert_equal(got, _reference(ids, weights, num_devices, num_sc, 20, mb=True))


def test_minibatching_docstring_example():
  # S = 1, N = 2: partition 0 holds even ids, partition 1 odd ones.
  rp, col, _, _ = preprocess(
    [[[0, 2], [1]], [[0], [2], [4]]],
    None,
    _mesh(2),
    max_ids_per_partition=8,
    max_unique_ids_per_partition=8,
    num_sc_per_device=1,
    enable_minibatching=True,
  )
  np.testing.assert_array_equal(rp, [2, 9] + [16] * 6 + [19] + [24] * 7)
  assert col.shape == (32,)
  np.testing.assert_array_equal(col[24:], [PAD] * 8)


def test_no_minibatches_give_empty_buffers():
  got = preprocess(
    [],
    [],
    _mesh(2),
    max_ids_per_partition=8,
    max_unique_ids_per_partition=8,
    num_sc_per_device=2,
    enable_minibatching=True,
  )
  assert [a.shape for a in got] == [(0,)] * 4


def test_minibatch_over_limit_raises():
  with pytest.raises(ValueError, match="max_ids_per_partition"):
    preprocess(
      [[[1], [2]], [[0, 2, 4], [6]]],
      None,
      _mesh(1),
      max_ids_per_partition=3,
      max_unique_ids_per_partition=8,
      num_sc_per_device=1,
      enable_minibatching=True,
    )


_NO_WEIGHTS = {"features_weights": None}
_BAD_CALLS = {
  "max_ids": {"max_ids_per_partition": 0},
  "max_unique": {"max_unique_ids_per_partition": -1},
  "3d": {"features": np.zeros((4, 1, 2), np.int32), **_NO_WEIGHTS},
  "lengths": {"features_weights": np.ones((3, 2))},
  "row_lengths": {"features_weights": [[1.0, 1.0]] * 3 + [[1.0]]},
  "strategy": {"sharding_strategy": "DIV"},
  "empty_mesh": {"mesh": Mesh(np.array([]), ("x",))},
  "not_power_of_two": {"mesh": Mesh(np.array(jax.devices()[:3]), ("x",))},
  "batch_split": {"features": np.zeros((3, 2), np.int32), **_NO_WEIGHTS},
  "negative_id": {"features": np.array([[0, -1]] * 4), **_NO_WEIGHTS},
  # Ids 0 and 4 share partition 0 of N = 4: two per sample, limit 1.
  "over_limit": {"features": np.array([[0, 4]] * 4), **_NO_WEIGHTS},
}


@pytest.mark.parametrize("case", sorted(_BAD_CALLS))
def test_bad_arguments_raise_then_a_good_call_works(case):
  # N = 4, two samples per SparseCore: one id per partition.
  good = {
    "features": np.arange(8, dtype=np.int32).reshape(4, 2),
    "features_weights": np.ones((4, 2)),
    "mesh": _mesh(2),
    "max_ids_per_partition": 1,
    "max_unique_ids_per_partition": 1,
    "num_sc_per_device": 2,
  }
  bad = {**good, **_BAD_CALLS[case]}
  with pytest.raises(ValueError):
    preprocess(bad.pop("features"), bad.pop("features_weights"), **bad)
  features, weights = good.pop("features"), good.pop("features_weights")
  _assert_equal(
    preprocess(features, weights, **good),
    _reference([features], [weights], 2, 2, 1, mb=False),
  )
