"""Tests of the host-side preprocessor (pz_sparsecore.host.preprocess).

The numba preprocessor is checked against literal expected buffers (worked
examples whose buffers upstream's preprocessor 0.1.0 also writes), against
the plain-Python reference in `reference_preprocess.py` byte for byte, and by
decoding its buffers back into activations that are compared with a dense
per-sample sum computed directly from the ids.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import hypothesis
import jax
import numpy as np
import pytest
from hypothesis import strategies as st
from reference_preprocess import reference_preprocess

from pz_sparsecore.core import buffer_format as bf
from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core import specs as sp
from pz_sparsecore.host import preprocess as pp

P = pp.PAD_ID
NAN = np.nan
BUFFER_FIELDS = (
  "lhs_row_pointers",
  "lhs_embedding_ids",
  "lhs_sample_ids",
  "lhs_gains",
)
STATS_FIELDS = (
  "max_ids_per_partition",
  "max_unique_ids_per_partition",
  "required_buffer_size_per_sc",
  "id_drop_counters",
)


def make_table(
  name,
  vocab,
  dim=4,
  combiner="sum",
  max_ids=256,
  max_unique=256,
  suggested=None,
):
  return sp.TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.zeros,
    optimizer=sp.SGDOptimizerSpec(),
    combiner=combiner,
    max_ids_per_partition=max_ids,
    max_unique_ids_per_partition=max_unique,
    suggested_coo_buffer_size_per_device=suggested,
  )


def make_feature(name, table, batch):
  return sp.FeatureSpec(
    name=name,
    table_spec=table,
    input_shape=[batch, 1],
    output_shape=[batch, table.embedding_dim],
  )


def assert_same(actual, expected):
  """Exact equality of two (buffers, stats) results (NaNs equal)."""
  for field in BUFFER_FIELDS:
    a, e = getattr(actual[0], field), getattr(expected[0], field)
    assert list(a) == list(e), field
    for stack in e:
      assert a[stack].dtype == e[stack].dtype, (field, stack)
      np.testing.assert_array_equal(a[stack], e[stack], err_msg=field)
  for field in STATS_FIELDS:
    a, e = getattr(actual[1], field), getattr(expected[1], field)
    assert list(a) == list(e), field
    for stack in e:
      np.testing.assert_array_equal(a[stack], e[stack], err_msg=field)


# ---------------------------------------------------------------------------
# Worked examples (upstream 0.1.0 writes the same buffers).


def example_specs(max_ids=8, max_unique=8, g=2, s=1, combiner="sum"):
  table = make_table(
    "t", 16, combiner=combiner, max_ids=max_ids, max_unique=max_unique
  )
  feature = make_feature("f", table, 4)
  return layout.prepare_feature_specs_for_training({"f": feature}, g, s)


EXAMPLE_IDS = np.array([[3, 8, 3], [5, 0, 2], [7, 7, 1], [4, 9, 6]])
EXAMPLE_WEIGHTS = np.array(
  [[1, 2, 3], [1, 1, 1], [0.5, 0.5, 1], [1, 1, 1]], np.float32
)


@pytest.mark.parametrize("weighted", [True, False])
def test_worked_example(weighted):
  weights = {"f": EXAMPLE_WEIGHTS} if weighted else None
  buffers, stats = pp.preprocess_sparse_dense_matmul_input(
    {"f": EXAMPLE_IDS},
    weights,
    example_specs(),
    2,
    2,
    num_sc_per_device=1,
    has_leading_dimension=True,
  )
  np.testing.assert_array_equal(
    buffers.lhs_row_pointers["t"],
    [[3, 10, 16, 16, 16, 16, 16, 16], [2, 11, 16, 16, 16, 16, 16, 16]],
  )
  np.testing.assert_array_equal(
    buffers.lhs_embedding_ids["t"],
    [
      [0, 1, 4, P, P, P, P, P, 1, 2, P, P, P, P, P, P],
      [2, 3, P, P, P, P, P, P, 0, 3, 4, P, P, P, P, P],
    ],
  )
  np.testing.assert_array_equal(
    buffers.lhs_sample_ids["t"],
    [
      [1, 1, 0, P, P, P, P, P, 0, 1, P, P, P, P, P, P],
      [1, 1, P, P, P, P, P, P, 0, 0, 1, P, P, P, P, P],
    ],
  )
  n = NAN
  if weighted:
    gains = [
      [1, 1, 2, n, n, n, n, n, 4, 1, n, n, n, n, n, n],
      [1, 1, n, n, n, n, n, n, 1, 1, 1, n, n, n, n, n],
    ]
  else:
    gains = [
      [1, 1, 1, n, n, n, n, n, 2, 1, n, n, n, n, n, n],
      [1, 1, n, n, n, n, n, n, 1, 2, 1, n, n, n, n, n],
    ]
  np.testing.assert_array_equal(buffers.lhs_gains["t"], gains)
  for field in BUFFER_FIELDS:
    assert getattr(buffers, field)["t"].dtype == (
      np.float32 if field == "lhs_gains" else np.int32
    )
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [3, 2, 2, 3])
  np.testing.assert_array_equal(
    stats.max_unique_ids_per_partition["t"], [3, 2, 2, 3]
  )
  np.testing.assert_array_equal(
    stats.required_buffer_size_per_sc["t"], [16, 16]
  )
  assert stats.id_drop_counters["t"] == 0
  for field in STATS_FIELDS[:3]:
    assert getattr(stats, field)["t"].dtype == np.int32


def test_worked_example_flat_and_mean():
  buffers, _ = pp.preprocess_sparse_dense_matmul_input(
    {"f": EXAMPLE_IDS},
    {"f": EXAMPLE_WEIGHTS},
    example_specs(combiner="mean"),
    2,
    2,
    num_sc_per_device=1,
  )
  assert buffers.lhs_row_pointers["t"].shape == (16,)
  assert buffers.lhs_gains["t"].shape == (32,)
  # Device 0, partition 1: ids 3 (w 1, 3) of sample 0, whose weights sum to 6.
  np.testing.assert_array_equal(
    buffers.lhs_gains["t"][8:10],
    np.array([np.float32(1 / 6) + np.float32(3 / 6), np.float32(1 / 3)]),
  )


DROP_IDS = np.array(
  [
    [0, 2, 4, 6, 8, 10],
    [0, 2, 4, 6, 1, 3],
    [1, 3, 5, 7, 9, 11],
    [1, 1, 1, 1, 1, 1],
  ]
)


def test_dropping_example():
  with pytest.warns(UserWarning, match="dropped"):
    buffers, stats = pp.preprocess_sparse_dense_matmul_input(
      {"f": DROP_IDS},
      None,
      example_specs(4, 2, g=1, s=2),
      1,
      1,
      num_sc_per_device=2,
      allow_id_dropping=True,
    )
  np.testing.assert_array_equal(
    buffers.lhs_row_pointers["t"],
    [4, 10, 16, 16, 16, 16, 16, 16, 0, 3, 8, 8, 8, 8, 8, 8],
  )
  seg0 = [0, 0, 1, 1, P, P, P, P, 0, 1, P, P, P, P, P, P]
  seg1 = [0, 0, 1] + [P] * 13
  np.testing.assert_array_equal(buffers.lhs_embedding_ids["t"], seg0 + seg1)
  np.testing.assert_array_equal(
    buffers.lhs_sample_ids["t"],
    [0, 1, 0, 1, P, P, P, P, 1, 1, P, P, P, P, P, P, 0, 1, 0] + [P] * 13,
  )
  np.testing.assert_array_equal(
    buffers.lhs_gains["t"],
    [1] * 4 + [NAN] * 4 + [1, 1] + [NAN] * 6 + [1, 6, 1] + [NAN] * 13,
  )
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [10, 7])
  np.testing.assert_array_equal(stats.max_unique_ids_per_partition["t"], [6, 6])
  np.testing.assert_array_equal(stats.required_buffer_size_per_sc["t"], [24, 8])
  assert stats.id_drop_counters["t"] == 10


def test_limits_exceeded_raises_naming_everything():
  with pytest.raises(ValueError) as info:
    pp.preprocess_sparse_dense_matmul_input(
      {"f": DROP_IDS},
      None,
      example_specs(4, 2, g=1, s=2),
      1,
      1,
      num_sc_per_device=2,
    )
  message = str(info.value)
  for part in (
    "'t'",
    "'f'",
    "device 0",
    "SparseCore 0",
    "10 ids",
    "partition 0",
    "max_ids_per_partition=4",
    "allow_id_dropping",
  ):
    assert part in message


def test_unique_limit_exceeded_raises():
  with pytest.raises(ValueError, match=r"6 unique ids .*=2"):
    pp.preprocess_sparse_dense_matmul_input(
      {"f": DROP_IDS},
      None,
      example_specs(16, 2, g=1, s=2),
      1,
      1,
      num_sc_per_device=2,
    )


# ---------------------------------------------------------------------------
# Random problems: numba vs the reference, and decoding.


@dataclasses.dataclass
class Problem:
  specs: dict
  features: dict
  weights: dict | None
  local: int
  global_: int
  num_sc: int
  dense: dict  # feature name -> (list of id rows, list of weight rows)
  tables: dict  # table name -> random logical table [vocab, dim]


def random_problem(
  rng, *, stack=True, dropping_limits=False, suggested=False, num_features=None
):
  num_sc = int(rng.choice([1, 2, 4]))
  global_ = int(rng.choice([d for d in (1, 2, 4, 8) if d * num_sc <= 16]))
  local = int(rng.choice([d for d in (1, 2, 4, 8) if global_ % d == 0]))
  n = global_ * num_sc
  num_tables = int(rng.integers(1, 4))
  combiner = str(rng.choice(["sum", "mean", "sqrtn"]))
  tables = []
  for t in range(num_tables):
    limit = int(rng.integers(1, 12)) if dropping_limits else 1024
    unique = int(rng.integers(1, 12)) if dropping_limits else 1024
    tables.append(
      make_table(
        f"t{t}",
        int(rng.integers(1, 60)),
        dim=int(rng.integers(1, 10)),
        combiner=combiner
        if stack
        else str(rng.choice(["sum", "mean", "sqrtn"])),
        max_ids=limit,
        max_unique=unique,
        suggested=(
          int(rng.integers(1, -(-limit // 8) * 8 * num_sc * n + 1))
          if suggested
          else None
        ),
      )
    )
  num_features = num_features or int(rng.integers(1, 5))
  specs, features, weights, dense = {}, {}, {}, {}
  for i in range(num_features):
    table = tables[i % num_tables]
    per_sc = int(rng.integers(1, 4))
    name = f"f{i}"
    specs[name] = make_feature(name, table, per_sc * n)
    batch = per_sc * local * num_sc
    lengths = rng.integers(0, 7, size=batch)
    rows = [rng.integers(0, table.vocabulary_size, size=k) for k in lengths]
    # Duplicates: reuse ids within a row now and then.
    rows = [
      r
      if len(r) < 2 or rng.random() < 0.5
      else np.repeat(r[: len(r) // 2 + 1], 2)
      for r in rows
    ]
    has_weights = rng.random() < 0.6
    wrows = [
      (rng.integers(1, 5, size=len(r)) / 2).astype(np.float32) for r in rows
    ]
    fmt = rng.choice(["dense", "object", "list", "splits"])
    if fmt == "dense":
      k = int(rng.integers(1, 4))
      rows = [rng.integers(0, table.vocabulary_size, size=k) for _ in rows]
      wrows = [
        (rng.integers(1, 5, size=k) / 2).astype(np.float32) for _ in rows
      ]
      features[name] = np.stack(rows)
      weights[name] = np.stack(wrows)
    elif fmt == "object":
      features[name] = np.array(rows + [None], dtype=object)[:-1]
      weights[name] = np.array(wrows + [None], dtype=object)[:-1]
    elif fmt == "list":
      features[name] = rows
      weights[name] = wrows
    else:
      splits = np.concatenate([[0], np.cumsum([len(r) for r in rows])])
      features[name] = (np.concatenate(rows).astype(np.int64), splits)
      weights[name] = (np.concatenate(wrows), splits)
    if not has_weights:
      weights[name] = None
      wrows = [np.ones(len(r), np.float32) for r in rows]
    dense[name] = (rows, wrows)
  used = [
    t.name for t in tables if any(f.table_spec is t for f in specs.values())
  ]
  if stack and len(used) > 1:
    specs = layout.stack_tables(
      specs,
      used,
      global_,
      num_sc,
      rotation=int(rng.integers(0, n + 1)),
      stack_to_max_ids_per_partition=lambda *_: tables[0].max_ids_per_partition,
      stack_to_max_unique_ids_per_partition=(
        lambda *_: tables[0].max_unique_ids_per_partition
      ),
    )
    if suggested:
      c_max = -(-tables[0].max_ids_per_partition // 8) * 8 * num_sc * n
      size = int(rng.integers(1, c_max + 1))
      specs = {
        k: f.replace(
          table_spec=f.table_spec.replace(
            stacked_table_spec=f.table_spec.stacked_table_spec.replace(
              suggested_coo_buffer_size_per_device=size
            )
          )
        )
        for k, f in specs.items()
      }
  specs = layout.prepare_feature_specs_for_training(specs, global_, num_sc)
  if all(w is None for w in weights.values()) and rng.random() < 0.5:
    weights = None
  logical = {
    t.name: rng.standard_normal((t.vocabulary_size, t.embedding_dim))
    for t in tables
  }
  return Problem(
    specs, features, weights, local, global_, num_sc, dense, logical
  )


def run_both(problem, allow_id_dropping, has_leading_dimension=False):
  kwargs = dict(
    num_sc_per_device=problem.num_sc,
    has_leading_dimension=has_leading_dimension,
    allow_id_dropping=allow_id_dropping,
  )
  args = (
    problem.features,
    problem.weights,
    problem.specs,
    problem.local,
    problem.global_,
  )
  expected = reference_preprocess(*args, **kwargs)
  return expected, args, kwargs


@pytest.mark.parametrize("seed", range(40))
def test_matches_reference(seed):
  rng = np.random.default_rng(seed)
  problem = random_problem(
    rng,
    stack=seed % 2 == 0,
    dropping_limits=seed % 3 == 0,
    suggested=seed % 5 == 1,
  )
  allow = seed % 3 == 0 and seed % 2 == 0 or seed % 5 == 1
  expected, args, kwargs = run_both(problem, allow, seed % 4 == 0)
  exceeded = any(
    (
      expected[1].max_ids_per_partition[s]
      > f.table_spec.stacked_table_spec.max_ids_per_partition
    ).any()
    or (
      expected[1].max_unique_ids_per_partition[s]
      > f.table_spec.stacked_table_spec.max_unique_ids_per_partition
    ).any()
    for f in jax.tree.leaves(problem.specs)
    for s in [f.table_spec.setting_in_stack.stack_name]
  )
  if exceeded and not allow:
    with pytest.raises(ValueError, match="allow_id_dropping"):
      pp.preprocess_sparse_dense_matmul_input(*args, **kwargs)
    return
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    actual = pp.preprocess_sparse_dense_matmul_input(*args, **kwargs)
  assert_same(actual, expected)


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
  seed=st.integers(0, 2**32 - 1),
  allow=st.booleans(),
  leading=st.booleans(),
)
def test_matches_reference_hypothesis(seed, allow, leading):
  rng = np.random.default_rng(seed)
  problem = random_problem(
    rng,
    stack=rng.random() < 0.5,
    dropping_limits=allow,
    suggested=rng.random() < 0.2,
  )
  expected, args, kwargs = run_both(problem, True, leading)
  kwargs["allow_id_dropping"] = True
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    actual = pp.preprocess_sparse_dense_matmul_input(*args, **kwargs)
  assert_same(actual, expected)


def decode(problem, buffers):
  """Activations per feature `[local batch, dim]` from the buffers alone."""
  n = problem.global_ * problem.num_sc
  s_count, num_local = problem.num_sc, problem.local
  specs = jax.tree.leaves(problem.specs)
  out = {}
  for stack, rp_all in buffers.lhs_row_pointers.items():
    members = [
      f for f in specs if f.table_spec.setting_in_stack.stack_name == stack
    ]
    stacked = members[0].table_spec.stacked_table_spec
    shard_rows = stacked.stack_vocab_size // n
    # Physical row -> (table name, logical id), from the stacking math.
    owner = {}
    for table in {f.table_spec.name: f.table_spec for f in members}.values():
      setting = table.setting_in_stack
      for i in range(table.vocabulary_size):
        p = (i % n + setting.shard_rotation) % n
        row = setting.row_offset_in_shard + i // n
        owner[(p, row)] = (table.name, i)
    rp = rp_all.reshape(num_local, s_count, -1)
    coo = [
      getattr(buffers, f)[stack].reshape(num_local, s_count, -1)
      for f in BUFFER_FIELDS[1:]
    ]
    batch_sc = stacked.total_sample_count // n
    act = np.zeros((num_local, s_count, batch_sc, stacked.stack_embedding_dim))
    for d in range(num_local):
      for s in range(s_count):
        start = 0
        for p in range(n):
          for j in range(start, rp[d, s, p]):
            row, sample, gain = (c[d, s, j] for c in coo)
            assert 0 <= row < shard_rows
            name, i = owner[(p, int(row))]
            vec = problem.tables[name][i]
            act[d, s, sample, : len(vec)] += np.float64(gain) * vec
          start = -(-int(rp[d, s, p]) // 8) * 8
    for f in members:
      per_sc = f.sample_count // n
      off = f.id_transformation.row_offset // n
      block = act[:, :, off : off + per_sc, : f.table_spec.embedding_dim]
      out[f.name] = block.reshape(-1, f.table_spec.embedding_dim)
  return out


def dense_activation(problem, name):
  spec = problem.specs[name]
  table = problem.tables[spec.table_spec.name]
  combiner = spec.table_spec.combiner
  rows, wrows = problem.dense[name]
  out = np.zeros((len(rows), table.shape[1]))
  for b, (ids, w) in enumerate(zip(rows, wrows, strict=True)):
    w = np.asarray(w, np.float64)
    divisor = {"sum": 1.0, "mean": w.sum(), "sqrtn": np.sqrt((w * w).sum())}
    for e, we in zip(ids, w, strict=True):
      out[b] += we / divisor[combiner] * table[e]
  return out


@pytest.mark.parametrize("seed", range(12))
def test_decoded_buffers_give_dense_activations(seed):
  rng = np.random.default_rng(100 + seed)
  problem = random_problem(rng, stack=True)
  buffers, stats = pp.preprocess_sparse_dense_matmul_input(
    problem.features,
    problem.weights,
    problem.specs,
    problem.local,
    problem.global_,
    num_sc_per_device=problem.num_sc,
    has_leading_dimension=bool(seed % 2),
  )
  assert all(v == 0 for v in stats.id_drop_counters.values())
  decoded = decode(problem, buffers)
  for name in problem.specs:
    np.testing.assert_allclose(
      decoded[name], dense_activation(problem, name), rtol=1e-5, atol=1e-5
    )


def test_stacking_with_rotation_layout():
  # The layout docstring's example: ta id 13 -> partition 2, local row 27.
  ta = make_table("ta", 40, dim=6, combiner="sum")
  tb = make_table("tb", 72, dim=8, combiner="sum")
  specs = {
    "fa": make_feature("fa", ta, 16),
    "fb1": make_feature("fb1", tb, 16),
    "fb2": make_feature("fb2", tb, 16),
  }
  specs = layout.stack_tables(
    specs, ["tb", "ta"], 2, 2, rotation=1, stack_name="stack_ba"
  )
  specs = layout.prepare_feature_specs_for_training(specs, 2, 2)
  features = {
    "fa": np.full((16, 1), 13),
    "fb1": np.array([np.zeros(0, np.int32)] * 16 + [None], object)[:-1],
    "fb2": np.zeros((16, 2), np.int64),
  }
  buffers, _ = pp.preprocess_sparse_dense_matmul_input(
    features,
    None,
    specs,
    2,
    2,
    num_sc_per_device=2,
    has_leading_dimension=True,
  )
  rp = buffers.lhs_row_pointers["stack_ba"].reshape(2, 2, 8)
  ids = buffers.lhs_embedding_ids["stack_ba"].reshape(2, 2, -1)
  sids = buffers.lhs_sample_ids["stack_ba"].reshape(2, 2, -1)
  gains = buffers.lhs_gains["stack_ba"].reshape(2, 2, -1)
  for d in range(2):
    for s in range(2):
      # fb2's id 0 (x2 per sample, merged) -> partition 0, row 0, samples 8..11
      np.testing.assert_array_equal(rp[d, s, :4], [4, 8, 12, 16])
      np.testing.assert_array_equal(ids[d, s, :4], [0, 0, 0, 0])
      np.testing.assert_array_equal(sids[d, s, :4], [8, 9, 10, 11])
      np.testing.assert_array_equal(gains[d, s, :4], [2, 2, 2, 2])
      np.testing.assert_array_equal(ids[d, s, 8:12], [27] * 4)
      np.testing.assert_array_equal(sids[d, s, 8:12], [0, 1, 2, 3])


# ---------------------------------------------------------------------------
# Formats, dtypes, shapes.


@pytest.mark.parametrize(
  "dtype",
  [
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
  ],
)
@pytest.mark.parametrize("fmt", ["dense", "object", "list", "splits"])
def test_integer_dtypes_and_formats(dtype, fmt):
  ids = EXAMPLE_IDS.astype(dtype)
  if fmt == "object":
    leaf = np.empty(4, object)
    leaf[:] = list(ids)
  elif fmt == "list":
    leaf = list(ids)
  elif fmt == "splits":
    leaf = (ids.reshape(-1), np.arange(5) * 3)
  else:
    leaf = ids
  actual = pp.preprocess_sparse_dense_matmul_input(
    {"f": leaf}, None, example_specs(), 2, 2, num_sc_per_device=1
  )
  expected = pp.preprocess_sparse_dense_matmul_input(
    {"f": EXAMPLE_IDS.astype(np.int32)},
    None,
    example_specs(),
    2,
    2,
    num_sc_per_device=1,
  )
  assert_same(actual, expected)


def test_empty_rows_and_float_empty_rows():
  rows = [
    np.array([], np.int32),
    np.array([1, 2]),
    np.array([]),
    np.array([5], np.int64),
  ]
  buffers, stats = pp.preprocess_sparse_dense_matmul_input(
    {"f": rows}, None, example_specs(), 2, 2, num_sc_per_device=1
  )
  expected = reference_preprocess(
    {"f": rows}, None, example_specs(), 2, 2, num_sc_per_device=1
  )
  assert_same((buffers, stats), expected)


def test_all_ones_weights_equal_none():
  specs = example_specs(combiner="sqrtn")
  a = pp.preprocess_sparse_dense_matmul_input(
    {"f": EXAMPLE_IDS},
    {"f": np.ones((4, 3))},
    specs,
    2,
    2,
    num_sc_per_device=1,
  )
  b = pp.preprocess_sparse_dense_matmul_input(
    {"f": EXAMPLE_IDS}, None, specs, 2, 2, num_sc_per_device=1
  )
  assert_same(a, b)


def test_inputs_not_mutated_and_outputs_fresh():
  ids = EXAMPLE_IDS.copy()
  weights = EXAMPLE_WEIGHTS.copy()
  rows = np.empty(4, object)
  rows[:] = [r.copy() for r in ids]
  pp.preprocess_sparse_dense_matmul_input(
    {"f": ids}, {"f": weights}, example_specs(), 2, 2, num_sc_per_device=1
  )
  pp.preprocess_sparse_dense_matmul_input(
    {"f": rows}, None, example_specs(), 2, 2, num_sc_per_device=1
  )
  np.testing.assert_array_equal(ids, EXAMPLE_IDS)
  np.testing.assert_array_equal(weights, EXAMPLE_WEIGHTS)
  for r, e in zip(rows, EXAMPLE_IDS, strict=True):
    np.testing.assert_array_equal(r, e)


def test_tuple_leaf_in_a_list_tree():
  specs = [example_specs()["f"]]
  leaf = (EXAMPLE_IDS.reshape(-1), np.arange(5) * 3)
  a = pp.preprocess_sparse_dense_matmul_input(
    [leaf], None, specs, 2, 2, num_sc_per_device=1
  )
  b = pp.preprocess_sparse_dense_matmul_input(
    [EXAMPLE_IDS], None, specs, 2, 2, num_sc_per_device=1
  )
  assert_same(a, b)


@pytest.mark.parametrize("leading", [True, False])
def test_eval_shape_matches_and_pytrees(leading):
  specs = example_specs()
  shapes = pp.eval_preprocess_sparse_dense_matmul_input_shape(
    specs, 2, 2, num_sc_per_device=1, has_leading_dimension=leading
  )
  buffers, stats = pp.preprocess_sparse_dense_matmul_input(
    {"f": EXAMPLE_IDS},
    None,
    specs,
    2,
    2,
    num_sc_per_device=1,
    has_leading_dimension=leading,
  )
  got = jax.tree.map(lambda x: (x.shape, x.dtype), buffers)
  want = jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
  assert got == want
  assert len(jax.tree.leaves(buffers)) == 4
  assert len(jax.tree.leaves(stats)) == 4


def test_buffer_size_helpers():
  assert pp.compute_row_pointers_size_per_device(2, 1) == 8
  assert pp.compute_row_pointers_size_per_device(4, 4) == 64
  assert pp.compute_theoretical_max_coo_buffer_size(5, 2, 2) == 64
  table = make_table("t", 100, max_ids=20, suggested=30)
  specs = layout.prepare_feature_specs_for_training(
    {"f": make_feature("f", table, 8)}, 2, 2
  )
  assert pp.compute_coo_buffer_size_per_device(specs, 2, 2) == {"t": 32}
  table = make_table("t", 100, max_ids=20)
  specs = layout.prepare_feature_specs_for_training(
    {"f": make_feature("f", table, 8)}, 2, 2
  )
  assert pp.compute_coo_buffer_size_per_device(specs, 2, 2) == {"t": 192}


def test_overflow_drops_and_stops():
  # N = 2, limits 16 (C_max = 32); a suggested 16 entries per device overflow.
  table = make_table("t", 32, max_ids=16, suggested=16)
  specs = layout.prepare_feature_specs_for_training(
    {"f": make_feature("f", table, 2)}, 2, 1
  )
  row = list(range(0, 12, 2)) + list(range(1, 24, 2))  # 6 to P0, 12 to P1.
  ids = np.array([row, row])
  with pytest.warns(UserWarning, match="overflowed"):
    buffers, stats = pp.preprocess_sparse_dense_matmul_input(
      {"f": ids},
      None,
      specs,
      2,
      2,
      num_sc_per_device=1,
      has_leading_dimension=True,
    )
  for d in range(2):
    np.testing.assert_array_equal(
      buffers.lhs_row_pointers["t"][d], [6, 16, 16, 16, 16, 16, 16, 16]
    )
    np.testing.assert_array_equal(
      buffers.lhs_embedding_ids["t"][d], [0, 1, 2, 3, 4, 5, P, P, *range(8)]
    )
  assert stats.id_drop_counters["t"] == 8
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [6, 12] * 2)
  np.testing.assert_array_equal(
    stats.required_buffer_size_per_sc["t"], [24] * 2
  )
  assert_same(
    (buffers, stats),
    reference_preprocess(
      {"f": ids},
      None,
      specs,
      2,
      2,
      num_sc_per_device=1,
      has_leading_dimension=True,
    ),
  )


# ---------------------------------------------------------------------------
# Errors.


def call(features, weights=None, specs=None, local=2, global_=2, **kwargs):
  kwargs.setdefault("num_sc_per_device", 1)
  return pp.preprocess_sparse_dense_matmul_input(
    features, weights, specs or example_specs(), local, global_, **kwargs
  )


@pytest.mark.parametrize(
  "features, weights, match",
  [
    (
      {"f": EXAMPLE_IDS + 8},
      None,
      r"feature 'f': id 16 outside \[0, 16\) at "
      "sample 0",
    ),
    ({"f": EXAMPLE_IDS - 1}, None, r"id -1 outside \[0, 16\) at sample 1"),
    (
      {
        "f": [np.array([1]), np.array([2]), np.array([3, 2**40]), np.array([4])]
      },
      None,
      r"id 1099511627776 .* at sample 2",
    ),
    ({"f": EXAMPLE_IDS.astype(np.float32)}, None, "must be integers"),
    (
      {"f": [np.array([1]), np.array([2.5]), np.array([3]), np.array([4])]},
      None,
      "integers, got dtype float64 at sample 1",
    ),
    ({"f": EXAMPLE_IDS}, {"f": np.ones((4, 2))}, "sample 0 has 3 ids but 2"),
    ({"f": EXAMPLE_IDS}, {"f": np.ones((2, 3))}, "2 rows of weights"),
    (
      {"f": [np.array([1]), np.array([2]), np.array([3]), np.array([4])]},
      {"f": [np.ones(1), np.ones(1), np.ones(2), np.ones(1)]},
      "sample 2 has 1 ids but 2 weights",
    ),
    ({"f": EXAMPLE_IDS}, {"f": np.full((4, 3), np.nan)}, "weight nan"),
    ({"f": EXAMPLE_IDS}, {"f": np.full((4, 3), np.inf)}, "weight inf"),
    ({"f": EXAMPLE_IDS}, {"f": np.full((4, 3), 1e300)}, "not finite"),
    ({"g": EXAMPLE_IDS}, None, "same tree structure"),
    ({"f": EXAMPLE_IDS}, {"g": EXAMPLE_WEIGHTS}, "features_weights must"),
    ({"f": EXAMPLE_IDS[:3]}, None, "3 rows does not divide"),
    ({"f": EXAMPLE_IDS[:0]}, None, "empty batch"),
    ({"f": EXAMPLE_IDS[:, 0]}, None, "must be 2-D"),
    ({"f": (np.arange(3), np.array([0, 2, 1, 3, 3]))}, None, "row_splits"),
    ({"f": (np.arange(3), np.array([0, 1, 2, 3]))}, None, "3 rows does not"),
    ({"f": [1, 2, 3, 4]}, None, "1-D array"),
  ],
)
def test_bad_inputs_raise(features, weights, match):
  with pytest.raises(ValueError, match=match):
    call(features, weights)


def test_samples_come_from_the_input_rows_not_output_shape():
  # Upstream's preprocessing takes each feature's samples from its input
  # rows and its offsets from the id transformation; `output_shape` is not
  # read. Specs claiming 4 samples per feature give the buffers of the specs
  # of the 8 they are fed; the layer's plan (sizing activations) refuses.
  table = make_table("t", 16, max_ids=16, max_unique=16)
  right = layout.prepare_feature_specs_for_training(
    {"a": make_feature("a", table, 8), "b": make_feature("b", table, 8)}, 2, 2
  )
  wrong = {
    name: spec.replace(output_shape=(4, spec.output_shape[-1]))
    for name, spec in right.items()
  }
  rng = np.random.default_rng(7)
  features = {name: rng.integers(0, 16, (4, 3)) for name in right}
  expected = pp.preprocess_sparse_dense_matmul_input(
    features, None, right, 1, 2, num_sc_per_device=2
  )
  got = pp.preprocess_sparse_dense_matmul_input(
    features, None, wrong, 1, 2, num_sc_per_device=2
  )
  assert_same(got, expected)
  with pytest.raises(ValueError, match="total_sample_count 16 is not the"):
    plan_lib.build(wrong, 2, 2)
  table_plan = plan_lib.build(right, 2, 2)
  halves = {name: ids[:2] for name, ids in features.items()}
  with pytest.raises(ValueError, match="feature 'a'.*output_shape"):
    pp.preprocess_for_plan(table_plan, halves, None, 1)
  assert_same(pp.preprocess_for_plan(table_plan, features, None, 1), expected)


def test_sample_offsets_of_another_batch_wrap_as_upstream():
  # Offsets prepared for 4 samples, fed 2 rows per feature: upstream's
  # sample id is (row_offset / N + row) modulo the SparseCore's samples.
  table = make_table("t", 16, max_ids=16, max_unique=16)
  specs = layout.prepare_feature_specs_for_training(
    {"a": make_feature("a", table, 4), "b": make_feature("b", table, 4)}, 1, 1
  )
  features = {"a": np.array([[1], [2]]), "b": np.array([[3], [4]])}
  buffers, _ = pp.preprocess_sparse_dense_matmul_input(
    features, None, specs, 1, 1, num_sc_per_device=1
  )
  n = int(buffers.lhs_row_pointers["t"][0])
  # b starts at sample 4 % 4 = 0 of the 4 samples (2 + 2 rows).
  assert list(buffers.lhs_embedding_ids["t"][:n]) == [1, 2, 3, 4]
  assert list(buffers.lhs_sample_ids["t"][:n]) == [0, 1, 0, 1]


@pytest.mark.parametrize(
  "local, global_, sc, match",
  [
    # Upstream's phrases, in its order of checks, with the value.
    (0, 2, 1, r"local_device_count must be greater than 0, got 0"),
    (1, 0, 1, r"global_device_count must be greater than 0, got 0"),
    (1, 2, 0, r"num_sc_per_device must be greater than 0, got 0"),
    (
      4,
      2,
      1,
      r"global_device_count must be greater than or equal to "
      r"local_device_count, got 2 < 4",
    ),
    (1, 1, 3, r"\(devices x SparseCores = 1 x 3 = 3\) must be a power of 2"),
  ],
)
def test_device_count_messages(local, global_, sc, match):
  with pytest.raises(ValueError, match=match):
    call({"f": EXAMPLE_IDS}, local=local, global_=global_, num_sc_per_device=sc)


def test_empty_batch_message():
  with pytest.raises(ValueError, match="input_batches cannot be empty"):
    pp.preprocess_sparse_dense_matmul_input(
      {}, None, {}, 1, 1, num_sc_per_device=1
    )


def test_local_batch_limit(monkeypatch):
  assert bf.MAX_LOCAL_BATCH_PER_DEVICE == 67_108_863  # upstream's 2**26 - 1
  # 4 rows on 2 local devices: 2 samples per device; a limit of 1 refuses.
  monkeypatch.setattr(bf, "MAX_LOCAL_BATCH_PER_DEVICE", 2)
  call({"f": EXAMPLE_IDS})
  monkeypatch.setattr(bf, "MAX_LOCAL_BATCH_PER_DEVICE", 1)
  with pytest.raises(
    ValueError,
    match="stack 't': a local batch of 2 samples per device .* exceeds the "
    "maximum limit supported by the SparseCore CooFormat sorting key",
  ):
    call({"f": EXAMPLE_IDS})


def test_bad_configuration_raises():
  with pytest.raises(ValueError, match="sharding_strategy"):
    call({"f": EXAMPLE_IDS}, sharding_strategy="DIV")
  with pytest.raises(ValueError, match="must be a power of 2"):
    call({"f": EXAMPLE_IDS}, num_sc_per_device=3)
  with pytest.raises(ValueError, match="local_device_count"):
    call({"f": EXAMPLE_IDS}, local=4)
  unprepared = {"f": make_feature("f", make_table("t", 16), 4)}
  with pytest.raises(ValueError, match="feature 'f'.*not prepared"):
    call({"f": EXAMPLE_IDS}, specs=unprepared)
  # Prepared for 2 shards, used with 4: preprocessing uses neither the padded
  # vocabulary nor total_sample_count (as upstream); tables need the match.
  call(
    {"f": np.zeros((4, 1), np.int32)},
    specs=example_specs(),
    local=1,
    global_=1,
    num_sc_per_device=4,
  )
  with pytest.raises(ValueError, match="another topology"):
    plan_lib.build(example_specs(), 1, 4)
  table = make_table("t", 16, max_ids=8, suggested=100)
  specs = layout.prepare_feature_specs_for_training(
    {"f": make_feature("f", table, 4)}, 2, 1
  )
  with pytest.raises(ValueError, match="exceeds the theoretical maximum 16"):
    call({"f": EXAMPLE_IDS}, specs=specs)
  with pytest.raises(ValueError, match="exceeds the theoretical maximum"):
    pp.compute_coo_buffer_size_per_device(specs, 2, 1)


def test_process_local_batch():
  # L = 1 of G = 2: this process holds half of the global batch of 4.
  buffers, stats = call(
    {"f": EXAMPLE_IDS[2:]},
    {"f": EXAMPLE_WEIGHTS[2:]},
    local=1,
    has_leading_dimension=True,
  )
  np.testing.assert_array_equal(
    buffers.lhs_row_pointers["t"], [[2, 11, 16, 16, 16, 16, 16, 16]]
  )
  np.testing.assert_array_equal(stats.max_ids_per_partition["t"], [2, 3])


def test_sqrtn_gain_value():
  table = make_table("t", 16, combiner="sqrtn")
  specs = layout.prepare_feature_specs_for_training(
    {"f": make_feature("f", table, 1)}, 1, 1
  )
  buffers, _ = pp.preprocess_sparse_dense_matmul_input(
    {"f": np.array([[3, 5]])},
    {"f": np.array([[3.0, 4.0]])},
    specs,
    1,
    1,
    num_sc_per_device=1,
  )
  np.testing.assert_array_equal(
    buffers.lhs_gains["t"][:2], np.float32([3 / 5, 4 / 5])
  )
  assert math.isnan(buffers.lhs_gains["t"][2])


def test_error_in_a_later_stack_raises_cleanly():
  # Many stacks; the last feature is bad.
  specs, features = {}, {}
  for i in range(12):
    specs[f"f{i:02d}"] = make_feature(
      f"f{i:02d}", make_table(f"t{i}", 16, max_ids=8, max_unique=8), 4
    )
    features[f"f{i:02d}"] = EXAMPLE_IDS
  specs = layout.prepare_feature_specs_for_training(specs, 2, 1)
  features["f11"] = EXAMPLE_IDS + 100
  with pytest.raises(ValueError, match="feature 'f11': id 103"):
    pp.preprocess_sparse_dense_matmul_input(
      features, None, specs, 2, 2, num_sc_per_device=1
    )
  features["f11"] = EXAMPLE_IDS
  buffers, _ = pp.preprocess_sparse_dense_matmul_input(
    features, None, specs, 2, 2, num_sc_per_device=1
  )
  single = call({"f": EXAMPLE_IDS})[0]
  for i in range(12):
    np.testing.assert_array_equal(
      buffers.lhs_embedding_ids[f"t{i}"], single.lhs_embedding_ids["t"]
    )
