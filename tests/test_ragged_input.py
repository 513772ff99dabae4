"""Tests of the id reader (`host.ragged_input`, csrc/ragged_reader.cc).

Every input format, dtype and memory layout must give the buffers and stats
of the plain-Python reference preprocessor; the compiled reader must give
the ids a plain numpy concatenation gives; bad input raises a `ValueError`
naming the feature, and the next good call works; without the compiled
reader the Python conversion gives the same results, with a warning.
"""

from __future__ import annotations

import collections
import sys

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st
from reference_preprocess import reference_preprocess
from test_preprocess import assert_same, make_feature, make_table

from pz_sparsecore.core import layout
from pz_sparsecore.host import preprocess as pp
from pz_sparsecore.host import ragged_input

VOCABS = (50, 16, 1000)
G, S = 4, 2
N = G * S
BATCH = 3 * N  # per feature: 3 samples per SparseCore


def _specs():
  specs = {
    f"f{i}": make_feature(f"f{i}", make_table(f"t{i}", vocab), BATCH)
    for i, vocab in enumerate(VOCABS)
  }
  return layout.prepare_feature_specs_for_training(specs, G, S)


def _random_rows(rng, vocab, k=None):
  """Rows with duplicates, empty rows and ids on shard boundaries."""
  lengths = (
    np.full(BATCH, k) if k is not None else rng.integers(0, 9, size=BATCH)
  )
  edges = np.array([0, N - 1, N, vocab - N, vocab - 1])
  edges = edges[(edges >= 0) & (edges < vocab)]
  rows = []
  for length in lengths:
    row = rng.integers(0, vocab, size=length)
    if length >= 2 and rng.random() < 0.5:
      row[length // 2 :] = row[0]  # duplicates
    if length and rng.random() < 0.5:
      row[-1] = rng.choice(edges)
    rows.append(row)
  return rows


def _as_format(rows, fmt, dtype):
  rows = [r.astype(dtype) for r in rows]
  if fmt == "object":
    leaf = np.empty(len(rows), object)
    leaf[:] = rows
    return leaf
  if fmt == "list":
    return rows
  if fmt == "splits":
    splits = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
    return (np.concatenate(rows), splits)
  return np.stack(rows)  # dense


def _call(features, weights=None, **kwargs):
  return pp.preprocess_sparse_dense_matmul_input(
    features, weights, _specs(), G, G, num_sc_per_device=S, **kwargs
  )


def _expected(features, weights=None):
  return reference_preprocess(
    features, weights, _specs(), G, G, num_sc_per_device=S
  )


def test_compiled_reader_is_built():
  assert ragged_input.READER is not None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.int8])
def test_every_format_matches_the_reference(seed, dtype):
  rng = np.random.default_rng(seed)
  vocabs = [min(v, np.iinfo(dtype).max + 1) for v in VOCABS]
  dense = seed % 2 == 0
  rows = {
    f"f{i}": _random_rows(rng, v, k=3 if dense else None)
    for i, v in enumerate(vocabs)
  }
  formats = ["object", "list", "splits"] + (["dense"] if dense else [])
  expected = _expected(
    {k: _as_format(r, "list", np.int64) for k, r in rows.items()}
  )
  for fmt in formats:
    features = {k: _as_format(r, fmt, dtype) for k, r in rows.items()}
    assert_same(_call(features), expected)
  # Mixed formats in one call.
  mixed = {
    k: _as_format(r, formats[i % len(formats)], dtype)
    for i, (k, r) in enumerate(rows.items())
  }
  assert_same(_call(mixed), expected)


def _layout(name, rows):
  """The same ids as views with unusual strides, orders and types."""
  dense = np.stack(rows)
  values = np.concatenate(rows)
  splits = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
  if name == "strided rows":
    return [np.repeat(r, 2)[::2] for r in rows]
  if name == "strided object array":
    objects = np.empty(2 * len(rows), object)
    objects[::2] = rows
    objects[1::2] = [np.array([-1])] * len(rows)
    return objects[::2]
  if name == "strided values":
    return (np.repeat(values, 3)[::3], np.repeat(splits, 2)[::2])
  if name == "big-endian rows":
    return [r.astype(">i4") for r in rows]
  if name == "Python lists":
    return [r.tolist() for r in rows]
  if name == "unaligned rows":
    return [
      np.frombuffer(b"\0" + r.astype(np.int32).tobytes(), np.int32, offset=1)
      for r in rows
    ]
  if name == "negative strides":
    objects = np.empty(len(rows), object)
    objects[:] = [np.ascontiguousarray(r[::-1])[::-1] for r in rows[::-1]]
    return objects[::-1]
  if name == "Fortran-order dense":
    return np.asfortranarray(dense)
  return np.repeat(dense, 2, axis=1)[:, ::2]  # strided dense


@pytest.mark.parametrize(
  "name",
  [
    "strided rows",
    "strided object array",
    "strided values",
    "big-endian rows",
    "Python lists",
    "unaligned rows",
    "negative strides",
    "Fortran-order dense",
    "strided dense",
  ],
)
def test_strides_and_memory_layouts_match_the_reference(name):
  rng = np.random.default_rng(7)
  rows = {f"f{i}": _random_rows(rng, v, k=4) for i, v in enumerate(VOCABS)}
  expected = _expected({k: np.stack(r) for k, r in rows.items()})
  assert_same(_call({k: _layout(name, r) for k, r in rows.items()}), expected)


@pytest.mark.parametrize("wide", [False, True])
def test_reader_gives_the_concatenated_ids(wide):
  rng = np.random.default_rng(3)
  rows = [_random_rows(rng, vocab) for vocab in VOCABS]
  leaves = [
    _as_format(r, fmt, np.int64)
    for r, fmt in zip(rows, ["object", "list", "splits"], strict=True)
  ]
  vocab = np.array(VOCABS, np.int64)
  values, row_splits, num_rows = ragged_input.READER.read_ids(
    leaves, vocab, wide
  )
  all_rows = [r for feature_rows in rows for r in feature_rows]
  assert values.dtype == (np.int64 if wide else np.int32)
  np.testing.assert_array_equal(values, np.concatenate(all_rows))
  np.testing.assert_array_equal(
    row_splits, np.cumsum([0] + [len(r) for r in all_rows])
  )
  np.testing.assert_array_equal(num_rows, [BATCH] * 3)


def test_reader_takes_any_id_for_a_vocabulary_of_minus_one():
  """vocab -1 (a hashed table's raw ids): every id is read, an unsigned one
  as its 64 bits, in every form and dtype; below -1 is unreadable."""
  big = np.array([2**64 - 1, 2**63, 5], np.uint64)
  rows = [np.array([-(2**63), -1, 0], np.int64), big, np.array([], np.int8)]
  dense = np.array([[-7, 2**31 - 1], [-(2**31), 3]], np.int32)
  splits = (np.array([2**62, -2], np.int64), np.array([0, 1, 2]))
  leaves = [rows, dense, splits]
  vocab = np.full(3, -1, np.int64)
  values, row_splits, num_rows = ragged_input.READER.read_ids(
    leaves, vocab, True
  )
  want = np.concatenate(
    [rows[0], big.view(np.int64), dense.reshape(-1).astype(np.int64)]
    + [splits[0]]
  )
  np.testing.assert_array_equal(values, want)
  np.testing.assert_array_equal(row_splits, [0, 3, 6, 6, 8, 10, 11, 12])
  np.testing.assert_array_equal(num_rows, [3, 2, 2])
  assert (
    ragged_input.READER.read_ids(leaves, np.array([-1, -2, -1], np.int64), True)
    == 1
  )


def _good_features():
  return {f"f{i}": np.ones((BATCH, 2), np.int32) for i in range(len(VOCABS))}


def _rows_with(row, index=5):
  rows = [np.array([1, 2], np.int32) for _ in range(BATCH)]
  rows[index] = row
  return rows


def _objects_with(row, index=5):
  leaf = np.empty(BATCH, object)
  leaf[:] = [np.array([1], np.int32)] * BATCH
  leaf[index] = row
  return leaf


def _column_with(item, index=5):
  leaf = np.ones((BATCH, 1), np.int32).astype(object)
  leaf[index, 0] = item
  return leaf


_NESTED = np.empty(2, object)
_NESTED[:] = [np.array([1]), np.array([2])]

BAD_LEAVES = [
  (_rows_with(np.array([1, 16])), r"feature 'f1': id 16 outside \[0, 16\)"),
  (_rows_with(np.array([-3])), r"id -3 outside \[0, 16\) at sample 5"),
  (_rows_with(np.array([2**40])), r"id 1099511627776 outside"),
  (_rows_with(np.array([2**64 - 1], np.uint64)), r"id 18446744073709551615"),
  (_rows_with(np.array([1.5])), "integers, got dtype float64 at sample 5"),
  (_rows_with(np.array([True])), "integers, got dtype bool"),
  (_rows_with(np.ones((1, 2), np.int32)), "feature 'f1'.*1-D"),
  (_rows_with(np.int32(3)), "feature 'f1'.*1-D"),
  (_rows_with(None), "feature 'f1'.*1-D"),
  (_rows_with(_NESTED), "feature 'f1'"),
  (_objects_with(np.array([20])), r"feature 'f1': id 20 outside"),
  (_objects_with("abc"), "feature 'f1'"),
  (_objects_with(_NESTED), "feature 'f1'"),
  (np.empty((BATCH, 2), object), "feature 'f1'"),
  (
    _column_with(np.array([1, 2])),
    "feature 'f1': a 2-D object array of ids must hold one number per "
    "element, got array .* at sample 5",
  ),
  (np.full((BATCH, 1), 2.5, object), "feature 'f1': ids must be integers"),
  (np.empty((BATCH, 1, 1), object), "feature 'f1': an object array"),
  ((np.arange(4), np.array([0, 3, 2, 4])), "feature 'f1': row_splits"),
  ((np.arange(4), np.array([1, 2, 4])), "feature 'f1': row_splits"),
  ((np.arange(4), np.array([0.0, 4.0])), "feature 'f1': row_splits"),
  ((np.arange(4),), "feature 'f1': a tuple of ids must be"),
  ((np.arange(4.0), np.array([0, 4])), "feature 'f1': ids must be integers"),
  (np.full((BATCH, 2), 16, np.int64), r"feature 'f1': id 16 outside"),
  (np.ones((BATCH, 2), np.float32), "feature 'f1': ids must be integers"),
  (np.ones(BATCH, np.int32), "feature 'f1': dense ids must be 2-D"),
  ("abc", "feature 'f1'"),
]


@pytest.mark.parametrize("leaf, match", BAD_LEAVES)
def test_bad_input_names_the_feature_and_the_next_call_works(leaf, match):
  features = _good_features()
  features["f1"] = leaf
  with pytest.raises(ValueError, match=match):
    _call(features)
  good = _good_features()
  assert_same(_call(good), _expected(good))


def test_python_lists_and_big_endian_rows_are_read():
  rows = [[1, 2], [], [3]] * N
  features = _good_features()
  features["f2"] = rows
  expected = _expected(features)
  assert_same(_call(features), expected)
  features["f2"] = [np.array(r, ">i8") for r in rows]
  assert_same(_call(features), expected)


def test_dense_object_arrays_of_numbers_read_as_dense():
  # Upstream reads a 2-D object array (e.g. [batch, 1] from a data frame)
  # as dense ids.
  rng = np.random.default_rng(12)
  features = {
    f"f{i}": rng.integers(0, v, (BATCH, 1 + i)) for i, v in enumerate(VOCABS)
  }
  weights = {
    k: rng.random(x.shape).astype(np.float32) for k, x in features.items()
  }
  expected = _expected(features, weights)
  as_objects = {k: x.astype(object) for k, x in features.items()}
  weight_objects = {k: w.astype(object) for k, w in weights.items()}
  assert_same(_call(as_objects, weight_objects), expected)


def test_ragged_weights_with_the_compiled_reader():
  rng = np.random.default_rng(11)
  rows = {f"f{i}": _random_rows(rng, v) for i, v in enumerate(VOCABS)}
  weights = {
    k: _as_format(
      [rng.random(len(x)).astype(np.float32) for x in r], "object", np.float32
    )
    for k, r in rows.items()
  }
  weights["f1"] = None
  features = {k: _as_format(r, "object", np.int32) for k, r in rows.items()}
  assert_same(_call(features, weights), _expected(features, weights))


def test_python_fallback_gives_the_same_results(monkeypatch):
  rng = np.random.default_rng(5)
  rows = {f"f{i}": _random_rows(rng, v) for i, v in enumerate(VOCABS)}
  features = {k: _as_format(r, "object", np.int32) for k, r in rows.items()}
  compiled = _call(features)
  monkeypatch.setattr(ragged_input, "READER", None)
  assert_same(_call(features), compiled)
  features["f0"] = _rows_with(np.array([77]))
  with pytest.raises(ValueError, match=r"feature 'f0': id 77 outside"):
    _call(features)


def test_missing_reader_warns(monkeypatch):
  monkeypatch.delenv(ragged_input.READER_ENV, raising=False)
  monkeypatch.setitem(sys.modules, "pz_sparsecore._pzsc_ragged", None)
  with pytest.warns(ragged_input.ReaderFallbackWarning, match="did not load"):
    reader = ragged_input._load_reader()
  assert reader is None


# ---------------------------------------------------------------------------
# Fuzzing: any leaf is read as the Python conversion reads it, or refused.

_Feature = collections.namedtuple("_Feature", "name vocabulary_size")
_DTYPES = ["i1", "u1", "i2", "<u2", ">i4", "i4", "u4", "i8", "u8", "f4", "?"]


@st.composite
def _rows(draw):
  kind = draw(st.sampled_from(["array", "array", "list", "scalar", "junk"]))
  values = draw(st.lists(st.integers(-3, 40), max_size=4))
  if kind == "array":
    row = np.array(values, np.int64).astype(draw(st.sampled_from(_DTYPES)))
    return row[:: draw(st.sampled_from([1, -1]))]
  if kind == "list":
    return values
  if kind == "scalar":
    return np.int32(draw(st.integers(0, 9)))
  return draw(st.sampled_from([None, "ab", np.ones((1, 2), np.int32), _NESTED]))


@st.composite
def _leaves(draw):
  kind = draw(st.sampled_from(["list", "object", "dense", "splits", "junk"]))
  rows = draw(st.lists(_rows(), max_size=5))
  if kind == "list":
    return rows
  if kind == "object":
    leaf = np.empty(len(rows), object)
    leaf[:] = rows
    return leaf[:: draw(st.sampled_from([1, -1, 2]))]
  values = np.array(draw(st.lists(st.integers(-2, 40), max_size=8)), np.int64)
  values = values.astype(draw(st.sampled_from(_DTYPES)))
  if kind == "dense":
    return values[: len(values) // 2 * 2].reshape(-1, 2)
  if kind == "splits":
    cuts = sorted(draw(st.lists(st.integers(0, len(values)), max_size=4)))
    splits = np.array([0, *cuts, len(values)], np.int64)
    if draw(st.booleans()):
      splits = splits[::-1]
    return (values, splits.astype(draw(st.sampled_from(_DTYPES))))
  return draw(st.sampled_from([3, "ids", (values,), {"a": 1}, values]))


def _outcome(features, leaves):
  try:
    values, row_splits, num_rows = ragged_input.read_ids(features, leaves)
  except ValueError as e:
    return str(e)
  return (
    values.astype(np.int64).tolist(),
    row_splits.tolist(),
    num_rows.tolist(),
  )


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
  leaves=st.lists(_leaves(), min_size=1, max_size=3),
  vocab=st.integers(1, 41),
)
def test_any_leaf_reads_as_in_python_or_raises(leaves, vocab):
  features = [_Feature(f"f{i}", vocab) for i in range(len(leaves))]
  compiled = _outcome(features, leaves)
  reader = ragged_input.READER
  try:
    ragged_input.READER = None
    python = _outcome(features, leaves)
  finally:
    ragged_input.READER = reader
  assert compiled == python


def test_reader_from_a_named_file_and_a_bad_one(monkeypatch, tmp_path):
  path = ragged_input.READER.__file__
  monkeypatch.setenv(ragged_input.READER_ENV, path)
  assert ragged_input._load_reader().__file__ == path
  bad = tmp_path / "not_a_module.so"
  bad.write_bytes(b"not an extension")
  monkeypatch.setenv(ragged_input.READER_ENV, str(bad))
  with pytest.warns(ragged_input.ReaderFallbackWarning, match="did not load"):
    assert ragged_input._load_reader() is None
