"""Tests of sparse COO input (pz_sparsecore.host.sparse_coo).

A batch given as `(indices, values, dense_shape)` triples, or as BCOO
leaves, must give byte for byte the buffers and stats of the same rows given
as dense or ragged arrays to `preprocess_sparse_dense_matmul_input`: sorted
or not, with duplicate ids, empty rows, stacked tables and up to 8 devices.
Bad input raises a `ValueError` naming the feature, and the next good call
works.
"""

from __future__ import annotations

import enum
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import sparse
from test_preprocess import (
  BUFFER_FIELDS,
  EXAMPLE_IDS,
  STATS_FIELDS,
  assert_same,
  example_specs,
  make_feature,
  make_table,
  random_problem,
)

from pz_sparsecore.core import layout
from pz_sparsecore.host import coo_input, sparse_coo
from pz_sparsecore.host import preprocess as pp


def assert_bytes_equal(actual, expected):
  """`assert_same`, and every buffer and stat equal as bytes."""
  assert_same(actual, expected)
  for part, fields in ((0, BUFFER_FIELDS), (1, STATS_FIELDS)):
    for field in fields:
      a, e = getattr(actual[part], field), getattr(expected[part], field)
      for stack in e:
        assert np.asarray(a[stack]).tobytes() == np.asarray(e[stack]).tobytes()


def to_coo(rows, rng, *, shuffle, weight_rows=None, spread=3):
  """`(indices, values, dense_shape, weights)` holding `rows`.

  Row `i`'s ids sit at increasing random columns of `[0, k)`; with `shuffle`
  the entries come in random order. `weights` is None without `weight_rows`.
  """
  k = max([len(r) for r in rows] + [0]) + spread
  indices = [
    (i, int(c))
    for i, row in enumerate(rows)
    for c in np.sort(rng.choice(k, size=len(row), replace=False))
  ]
  indices = np.array(indices, np.int64).reshape(-1, 2)
  values = np.concatenate([np.zeros(0, np.int64), *rows])
  weights = None
  if weight_rows is not None:
    weights = np.concatenate([np.zeros(0, np.float32), *weight_rows])
  if shuffle:
    order = rng.permutation(len(values))
    indices, values = indices[order], values[order]
    weights = None if weights is None else weights[order]
  return indices, values, np.array([len(rows), k], np.int64), weights


def from_sparse_tensor(coo, problem, **kwargs):
  """The COO triples `coo` (feature name -> `to_coo` result) preprocessed."""
  return sparse_coo.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
    *({name: c[i] for name, c in coo.items()} for i in range(3)),
    problem.specs,
    problem.local,
    problem.global_,
    num_sc_per_device=problem.num_sc,
    **kwargs,
  )


def from_features(problem, weights, **kwargs):
  return pp.preprocess_sparse_dense_matmul_input(
    problem.features,
    weights,
    problem.specs,
    problem.local,
    problem.global_,
    num_sc_per_device=problem.num_sc,
    **kwargs,
  )


# ---------------------------------------------------------------------------
# Conversion.


def test_worked_example():
  ids, weights = coo_input.coo_rows(
    "f", [[2, 1], [0, 0], [2, 0], [0, 2]], [7, 3, 5, 4], [4, 3]
  )
  np.testing.assert_array_equal(ids[0], [3, 4, 5, 7])
  np.testing.assert_array_equal(ids[1], [0, 2, 2, 4, 4])
  assert weights is None


def test_weights_follow_their_ids():
  ids, weights = coo_input.coo_rows(
    "f", [[1, 0], [0, 1], [0, 0]], [7, 8, 9], [2, 2], [0.5, 2.0, 3.0]
  )
  np.testing.assert_array_equal(ids[0], [9, 8, 7])
  np.testing.assert_array_equal(weights[0], [3.0, 2.0, 0.5])
  np.testing.assert_array_equal(weights[1], ids[1])


@pytest.mark.parametrize("width", [2**62, 2**60])
def test_huge_dense_shape_sorts_without_overflow(width):
  """Keys over 2**63 (width 2**62) or too wide to carry positions (2**60)."""
  indices = np.array([[3, width // 2], [0, 5], [3, 1], [1, width - 1]])
  ids, _ = coo_input.coo_rows("f", indices, [10, 11, 12, 13], [4, width])
  np.testing.assert_array_equal(ids[0], [11, 13, 12, 10])
  np.testing.assert_array_equal(ids[1], [0, 1, 2, 2, 4])
  ids, _ = coo_input.coo_rows(
    "f", indices[[1, 3, 2, 0]], [11, 13, 12, 10], [4, width]
  )  # already sorted
  np.testing.assert_array_equal(ids[0], [11, 13, 12, 10])
  with pytest.raises(ValueError, match=r"\[3, \d+\] is given twice"):
    coo_input.coo_rows("f", indices[[0, 1, 0]], [1, 2, 3], [4, width])


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.uint64, np.int8])
def test_index_dtypes(dtype):
  indices = np.array([[2, 1], [0, 0], [2, 0], [0, 2]], dtype)
  ids, _ = coo_input.coo_rows("f", indices, [7, 3, 5, 4], [4, 3])
  np.testing.assert_array_equal(ids[0], [3, 4, 5, 7])
  np.testing.assert_array_equal(ids[1], [0, 2, 2, 4, 4])


def test_index_over_int64_raises():
  with pytest.raises(ValueError, match="feature 'f': index 18446744073709"):
    coo_input.coo_rows("f", np.array([[0, 2**64 - 1]], np.uint64), [1], [1, 1])


def test_empty_batch_parts():
  ids, _ = coo_input.coo_rows("f", [], [], [3, 0])
  assert ids[0].dtype.kind == "i" and len(ids[0]) == 0
  np.testing.assert_array_equal(ids[1], [0, 0, 0, 0])


# ---------------------------------------------------------------------------
# Equality with dense and ragged input.


@pytest.mark.parametrize("seed", range(16))
def test_matches_ragged_input(seed):
  rng = np.random.default_rng(seed)
  problem = random_problem(rng, stack=seed % 2 == 0)
  coo = {
    name: to_coo(rows, rng, shuffle=seed % 4 < 2)
    for name, (rows, _) in problem.dense.items()
  }
  leading = dict(has_leading_dimension=seed % 3 == 0)
  expected = from_features(problem, None, **leading)
  copies = {name: [np.copy(a) for a in c[:3]] for name, c in coo.items()}
  assert_bytes_equal(from_sparse_tensor(coo, problem, **leading), expected)
  for name, c in coo.items():  # inputs are not modified
    for a, b in zip(c[:3], copies[name], strict=True):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("seed", range(4))
def test_matches_with_dropping(seed):
  rng = np.random.default_rng(100 + seed)
  problem = random_problem(rng, dropping_limits=True)
  coo = {
    name: to_coo(rows, rng, shuffle=True)
    for name, (rows, _) in problem.dense.items()
  }
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    expected = from_features(problem, None, allow_id_dropping=True)
    actual = from_sparse_tensor(coo, problem, allow_id_dropping=True)
  assert_bytes_equal(actual, expected)


class _Strategy(enum.Enum):
  MOD = 1


def test_upstream_style_call():
  """Flat lists, Python lists of pairs, an enum strategy, 4 x 4 SparseCores."""
  table = make_table("t", 512, dim=8, max_ids=64, max_unique=64)
  specs = layout.prepare_feature_specs_for_training(
    [make_feature("f", table, 16)], 4, 4
  )
  indices = [(i, j) for i in range(16) for j in range(16)]
  dense = np.arange(256).reshape(16, 16)
  kwargs = dict(num_sc_per_device=4, has_leading_dimension=True)
  actual = sparse_coo.preprocess_sparse_dense_matmul_sparse_coo_input(
    [indices],
    [list(range(256))],
    [[16, 512]],
    specs,
    4,
    4,
    sharding_strategy=_Strategy.MOD,
    batch_number=42,
    enable_minibatching=False,
    all_reduce_interface=None,
    **kwargs,
  )
  expected = pp.preprocess_sparse_dense_matmul_input(
    [dense], [np.ones((16, 16), np.float32)], specs, 4, 4, **kwargs
  )
  assert_bytes_equal(actual, expected)


# ---------------------------------------------------------------------------
# BCOO leaves.


def to_bcoo(coo, padding):
  """A BCOO of `coo`'s ids, with `padding` entries past its shape."""
  indices, values, shape, _ = coo
  indices = np.concatenate([indices, np.tile(shape, (padding, 1))])
  values = np.concatenate([values, np.zeros(padding, values.dtype)])
  return sparse.BCOO(
    (jnp.asarray(values), jnp.asarray(indices)), shape=tuple(shape)
  )


@pytest.mark.parametrize("seed", range(8))
def test_bcoo_leaves_match_ragged_input(seed):
  rng = np.random.default_rng(200 + seed)
  problem = random_problem(rng, stack=seed % 2 == 0)
  features, weights = dict(problem.features), {}
  for i, (name, (rows, wrows)) in enumerate(problem.dense.items()):
    weighted = problem.weights is not None and problem.weights[name] is not None
    weights[name] = problem.weights[name] if weighted else None
    if i % 3 == 2:  # this feature stays as it is
      continue
    coo = to_coo(rows, rng, shuffle=seed % 2 == 0, weight_rows=wrows)
    features[name] = to_bcoo(coo, padding=i % 2 * 3)
    if weighted and i % 2:
      weights[name] = sparse.BCOO(
        (jnp.asarray(np.concatenate([coo[3], np.ones(3, np.float32)])),
         features[name].indices),
        shape=features[name].shape,
      )  # fmt: skip
    elif weighted:
      weights[name] = coo[3]
  expected = from_features(problem, problem.weights)
  actual = pp.preprocess_sparse_dense_matmul_input(
    features,
    weights,
    problem.specs,
    problem.local,
    problem.global_,
    num_sc_per_device=problem.num_sc,
  )
  assert_bytes_equal(actual, expected)


# ---------------------------------------------------------------------------
# Bad input.

GOOD = (np.array([[0, 0], [1, 2], [3, 1]]), np.array([5, 0, 15]), [4, 3])


def call_coo(indices, values, dense_shape, **kwargs):
  return sparse_coo.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
    {"f": indices},
    {"f": values},
    {"f": dense_shape},
    example_specs(),
    2,
    2,
    num_sc_per_device=1,
    **kwargs,
  )


def expected_good():
  rows = [np.array([5]), np.array([0]), np.array([], np.int64), [15]]
  rows[3] = np.array(rows[3])
  return pp.preprocess_sparse_dense_matmul_input(
    {"f": rows}, None, example_specs(), 2, 2, num_sc_per_device=1
  )


@pytest.mark.parametrize(
  "indices, values, dense_shape, match",
  [
    (GOOD[0][:, :1], GOOD[1], GOOD[2], r"of shape \[n, 2\]"),
    (GOOD[0].astype(float), GOOD[1], GOOD[2], "integer array"),
    (GOOD[0], GOOD[1][:2], GOOD[2], r"one entry per index \(3\)"),
    (GOOD[0], GOOD[1][:, None], GOOD[2], "values must be 1-D"),
    (GOOD[0] + [1, 0], GOOD[1], GOOD[2], r"index \[4, 1\] at entry 2"),
    (GOOD[0] - [0, 1], GOOD[1], GOOD[2], r"\[0, -1\] .* dense_shape \[4, 3\]"),
    (GOOD[0] + [0, 1], GOOD[1], GOOD[2], r"index \[1, 3\] at entry 1"),
    (GOOD[0][[0, 1, 0]], GOOD[1], GOOD[2], r"\[0, 0\] is given twice"),
    (GOOD[0], GOOD[1] - 1, GOOD[2], r"id -1 outside \[0, 16\)"),
    (GOOD[0], GOOD[1] + 1, GOOD[2], r"id 16 outside \[0, 16\) at sample 3"),
    (GOOD[0], GOOD[1].astype(np.float32), GOOD[2], "must be integers"),
    (GOOD[0], GOOD[1], [4], "dense_shape must be two"),
    (GOOD[0], GOOD[1], [4, -3], "dense_shape must be two"),
    (GOOD[0], GOOD[1], [4.0, 3.0], "dense_shape must be two"),
    (GOOD[0][:2], GOOD[1][:2], [3, 3], "3 rows does not divide"),
  ],
)
def test_bad_coo_raises_then_good_call_works(
  indices, values, dense_shape, match
):
  with pytest.raises(ValueError, match="feature 'f'") as error:
    call_coo(indices, values, dense_shape)
  error.match(match)
  assert_bytes_equal(call_coo(*GOOD), expected_good())


def test_bad_trees_and_options_raise():
  with pytest.raises(ValueError, match="indices must have the same tree"):
    sparse_coo.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
      {"g": GOOD[0]}, {"f": GOOD[1]}, {"f": GOOD[2]}, example_specs(), 2, 2,
      num_sc_per_device=1,
    )  # fmt: skip
  minibatched = call_coo(*GOOD, enable_minibatching=True)
  assert minibatched[0].num_minibatches.tolist() == [1, 1]
  with pytest.raises(ValueError, match="sharding_strategy"):
    call_coo(*GOOD, sharding_strategy="DIV")
  assert_bytes_equal(call_coo(*GOOD), expected_good())


def _bcoo(indices, values, shape):
  return sparse.BCOO((jnp.asarray(values), jnp.asarray(indices)), shape=shape)


@pytest.mark.parametrize(
  "ids, weights, match",
  [
    (
      lambda: _bcoo([[0, 0, 0]], [1], (4, 3, 2)),
      lambda: None,
      "must be 2-D",
    ),
    (
      lambda: _bcoo(np.zeros((4, 1, 1), int), np.ones((4, 1), int), (4, 3)),
      lambda: None,
      "n_batch=1",
    ),
    (
      lambda: _bcoo(GOOD[0], GOOD[1], (4, 3)),
      lambda: _bcoo(GOOD[0][::-1], np.ones(3, np.float32), (4, 3)),
      r"same indices as its ids: entry 0 is \[3, 1\] in the weights",
    ),
    (
      lambda: _bcoo(GOOD[0], GOOD[1], (4, 3)),
      lambda: _bcoo(GOOD[0][:2], np.ones(2, np.float32), (4, 3)),
      r"weights of shape \(4, 3\) with 2 entries, ids of shape \(4, 3\) "
      "with 3",
    ),
    (
      lambda: EXAMPLE_IDS,
      lambda: _bcoo(GOOD[0], np.ones(3, np.float32), (4, 3)),
      "BCOO weights need BCOO ids",
    ),
    (
      lambda: _bcoo(GOOD[0], GOOD[1], (4, 3)),
      lambda: np.ones(2, np.float32),
      "weights must be 1-D with one entry per index",
    ),
    (
      lambda: _bcoo(GOOD[0], GOOD[1], (4, 3)),
      lambda: np.array([1, np.nan, 1], np.float32),
      "weight nan",
    ),
    (
      lambda: _bcoo(GOOD[0] - [1, 0], GOOD[1], (4, 3)),
      lambda: None,
      r"index \[-1, 0\] at entry 0 is outside",
    ),
    (lambda: _bcoo(GOOD[0], GOOD[1] + 1, (4, 3)), lambda: None, "id 16"),
  ],
)
def test_bad_bcoo_raises_then_good_call_works(ids, weights, match):
  specs = example_specs()
  w = weights()
  with pytest.raises(ValueError, match="feature 'f'") as error:
    pp.preprocess_sparse_dense_matmul_input(
      {"f": ids()}, None if w is None else {"f": w}, specs, 2, 2,
      num_sc_per_device=1,
    )  # fmt: skip
  error.match(match)
  actual = pp.preprocess_sparse_dense_matmul_input(
    {"f": _bcoo(GOOD[0], GOOD[1], (4, 3))},
    None,
    specs,
    2,
    2,
    num_sc_per_device=1,
  )
  assert_bytes_equal(actual, expected_good())
