"""`pzsc.top_k` against a NumPy brute force over `pzsc.logical_tables`.

Three tables share one stack (widths 8, 6 and 8 padded to 8; vocabularies
37, 101 and 5, none a multiple of the shard count), so a search must skip
the other tables' rows, the padding rows and the padding columns. Tables
"a" and "c" hold multiples of 1/2 in [-1, 1] and the queries too: every
dot product is exact in float32 and many are equal, so the ids must equal
the reference's exactly, ties (smaller id first) included. Table "b" holds
normal values with duplicated rows and a zero row (for cosine).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from penzai import pz  # noqa: E402

import pz_sparsecore as pzsc  # noqa: E402
from pz_sparsecore.core import layout  # noqa: E402
from pz_sparsecore.device import retrieval  # noqa: E402
from pz_sparsecore.nn.tables import positional_table  # noqa: E402

TABLES = {"a": (37, 8), "b": (101, 6), "c": (5, 8)}
LAYOUTS = [(1, 1), (2, 2), (8, 1)]
"""(devices, SparseCores per device): N = 1, 4, 8 shards."""


def _specs(dtype=jnp.float32):
  out = {}
  for name, (vocab, dim) in TABLES.items():
    table = pzsc.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(1.0),
      optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
      combiner="sum",
      dtype=dtype,
    )
    out[name] = pzsc.FeatureSpec(
      name=f"f{name}",
      table_spec=table,
      input_shape=(16, 1),
      output_shape=(16, dim),
    )
  return out


def _halves(rng, shape):
  """Multiples of 1/2 in [-1, 1] (exact in bfloat16, exact dot products)."""
  return (rng.integers(-2, 3, shape) / 2).astype(np.float32)


def _values(seed=0):
  rng = np.random.default_rng(seed)
  values = {n: _halves(rng, (v, d)) for n, (v, d) in TABLES.items()}
  values["a"][[20, 30, 36]] = values["a"][3]  # Ties across shards.
  b = rng.normal(size=TABLES["b"]).astype(np.float32)
  b[[50, 77, 100]] = b[10]
  b[60] = 0
  values["b"] = b
  return values


def _embed(devices, sc, dtype=jnp.float32, placement="sharded"):
  mesh = Mesh(np.array(jax.devices()[:devices]), ("d",))
  layer = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _specs(dtype),
    mesh,
    num_sc_per_device=sc,
    placement=placement,
  )
  assert list(layer.tables) == ["a_b_c"]  # One stack of three tables.
  pzsc.set_logical_tables(layer, _values())
  return layer


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}x{p[1]}")
def layer(request):
  return _embed(*request.param)


@pytest.fixture(scope="module")
def layer8():
  return _embed(8, 1)


def _queries(name, count, seed=1):
  rng = np.random.default_rng(seed)
  dim = TABLES[name][1]
  if name == "b":
    return rng.normal(size=(count, dim)).astype(np.float32)
  return _halves(rng, (count, dim))


def reference(table, queries, k, exclude=None, metric="dot"):
  """Brute force in float64: by score, then by smaller id."""
  table = np.asarray(table, np.float64)
  queries = np.asarray(queries, np.float64)
  scores = queries @ table.T
  if metric == "cosine":
    norms = np.outer(
      np.linalg.norm(queries, axis=1), np.linalg.norm(table, axis=1)
    )
    scores = np.where(norms > 0, scores / np.where(norms > 0, norms, 1), 0)
  out_scores = np.full((len(queries), k), -np.inf)
  out_ids = np.full((len(queries), k), -1)
  for q in range(len(queries)):
    ids = np.arange(len(table))
    if exclude is not None:
      ids = np.setdiff1d(ids, exclude[q])
    best = ids[np.lexsort((ids, -scores[q, ids]))][:k]
    out_scores[q, : len(best)] = scores[q, best]
    out_ids[q, : len(best)] = best
  return out_scores, out_ids


def check(got, want):
  scores, ids = got
  assert scores.dtype == jnp.float32 and ids.dtype == jnp.int32
  assert scores.shape == ids.shape == want[1].shape
  np.testing.assert_array_equal(np.asarray(ids), want[1])
  np.testing.assert_allclose(np.asarray(scores), want[0], rtol=1e-6, atol=1e-6)


def test_logical_ids_invert_the_layout(layer):
  plan = layer.config.plan
  n = plan.num_shards
  for name, table in plan.tables.items():
    rows = retrieval.TableRows.of(table, n)
    v_shard = plan.stack_of_table[name].rows_per_shard
    physical = layout.physical_row_ids(
      table, np.arange(rows.vocabulary_size), n
    )
    ids = rows.logical_ids(physical // v_shard, physical % v_shard)
    np.testing.assert_array_equal(ids, np.arange(rows.vocabulary_size))
    real = [int(rows.real_rows(g)) for g in range(n)]
    assert sum(real) == rows.vocabulary_size


def test_matches_brute_force(layer):
  tables = pzsc.logical_tables(layer)
  for name, (vocab, _) in TABLES.items():
    for count, k in [(1, 1), (37, 10), (37, vocab + 3)]:
      queries = _queries(name, count, seed=count + k)
      got = pzsc.top_k(queries, layer, k, table=name)
      check(got, reference(tables[name], queries, k))


def test_exclude_lists_and_padded_arrays(layer):
  tables = pzsc.logical_tables(layer)
  queries = _queries("a", 37)
  _, best = reference(tables["a"], queries, 5)
  rng = np.random.default_rng(3)
  exclude = [
    best[q].tolist() + best[(q + 1) % 37, :2].tolist() for q in range(37)
  ]
  exclude[0] = []
  exclude[1] = [best[1, 0]] * 4 + [best[1, 1]]  # Duplicates.
  exclude[2] = np.arange(37)  # Everything: no row left.
  exclude[3] = rng.integers(0, 37, 30)
  want = reference(tables["a"], queries, 10, exclude)
  check(pzsc.top_k(queries, layer, 10, table="a", exclude=exclude), want)
  padded = np.full((37, 40), -1, np.int64)
  for q, ids in enumerate(exclude):
    padded[q, : len(ids)] = ids
  check(pzsc.top_k(queries, layer, 10, table="a", exclude=padded), want)
  assert (want[1][2] == -1).all() and (want[0][2] == -np.inf).all()


def test_ties_go_to_the_smaller_id(layer8):
  before = pzsc.logical_tables(layer8)
  c = np.zeros((5, 8), np.float32)
  c[:4, :2] = [[1, 0], [0, 1], [1, 0], [2, 2]]
  try:
    pzsc.set_logical_tables(layer8, {"a": np.ones((37, 8)), "c": c})
    scores, ids = pzsc.top_k(np.ones((2, 8)), layer8, 12, table="a")
    np.testing.assert_array_equal(ids, np.tile(np.arange(12), (2, 1)))
    np.testing.assert_array_equal(scores, np.full((2, 12), 8.0))
    # The example of `nn.retrieval`'s docstring.
    query = np.eye(8, dtype=np.float32)[:1]
    scores, ids = pzsc.top_k(query, layer8, 6, table="c", exclude=[[3]])
    np.testing.assert_array_equal(ids, [[0, 2, 1, 4, -1, -1]])
    np.testing.assert_array_equal(scores, [[1, 1, 0, 0, -np.inf, -np.inf]])
  finally:
    pzsc.set_logical_tables(layer8, before)


@pytest.mark.parametrize("devices,sc", [(2, 2), (8, 1)])
def test_cosine(devices, sc, request):
  layer = request.getfixturevalue("layer8") if devices == 8 else _embed(2, 2)
  table = pzsc.logical_tables(layer)["b"]
  queries = _queries("b", 37)
  queries[5] = 0  # A zero query: every row scores 0.
  for k in (1, 10, 101):
    got = pzsc.top_k(queries, layer, k, table="b", metric="cosine")
    check(got, reference(table, queries, k, metric="cosine"))
  scores, ids = np.asarray(got[0]), np.asarray(got[1])
  np.testing.assert_array_equal(ids[5], np.arange(101))  # All score 0.
  # The zero row (60) is a row like the others: it scores 0.
  assert (ids >= 0).all() and (scores[ids == 60] == 0).all()


def test_bfloat16_and_replicated_tables():
  for layer in (
    _embed(2, 1, jnp.bfloat16),
    _embed(2, 2, placement=dict.fromkeys(TABLES, "replicated")),
  ):
    tables = pzsc.logical_tables(layer)
    for name in ("a", "c"):
      queries = _queries(name, 37)
      got = pzsc.top_k(queries, layer, 10, table=name)
      check(got, reference(tables[name], queries, 10))
  assert layer.config.topology.is_replicated("a_b_c")


def test_under_jit(layer8):
  tables = pzsc.logical_tables(layer8)
  queries = _queries("a", 37)
  exclude = np.full((37, 3), -1, np.int32)
  exclude[:, 0] = np.arange(37)
  stateless, variables = pz.unbind_variables(layer8, freeze=True)

  @jax.jit
  def search(variables, queries, exclude):
    bound = pz.bind_variables(stateless, variables)
    return pzsc.top_k(queries, bound, 10, table="a", exclude=exclude)

  want = reference(tables["a"], queries, 10, exclude[:, :1])
  check(search(variables, queries, exclude), want)
  # Penzai's variable_jit, over the bound layer.
  search = pz.variable_jit(lambda lyr, q: pzsc.top_k(q, lyr, 10, table="a"))
  check(search(layer8, queries), reference(tables["a"], queries, 10))


@pytest.mark.parametrize("sharding_axis", [None, "model"])
def test_sparse_core_lookup_and_named_queries(sharding_axis):
  """A lookup on a 2 x 4 mesh, sharded over both axes (8 shards) or over
  "model" only (4 shards, two replicas)."""
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  lookup = pzsc.SparseCoreLookup.from_config(
    "items",
    jax.random.key(2),
    vocab_size=77,
    embedding_axes={"heads": 2, "proj": 3},
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    sharding_axis=sharding_axis,
  )
  assert lookup.config.topology.num_shards == (4 if sharding_axis else 8)
  table = pzsc.logical_tables(lookup)["items"]
  assert table.shape == (77, 6)
  queries = np.random.default_rng(4).normal(size=(37, 6)).astype(np.float32)
  want = reference(table, queries, 10)
  check(pzsc.top_k(queries, lookup, 10), want)
  named = pz.nx.wrap(queries.reshape(37, 2, 3)).tag("user", "heads", "proj")
  check(pzsc.top_k(named, lookup, 10, table="items"), want)
  with pytest.raises(ValueError, match="one query axis"):
    pzsc.top_k(named.untag("user"), lookup, 10)


@pytest.fixture(scope="module")
def big():
  """A 5,000-row table on 2 devices x 2 SparseCores: 1,256 rows a shard."""
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  lookup = pzsc.SparseCoreLookup.from_config(
    "big",
    jax.random.key(3),
    vocab_size=5000,
    embedding_axes={"embedding": 8},
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    num_sc_per_device=2,
  )
  values = _halves(np.random.default_rng(5), (5000, 8))
  values[4000:] = values[:1000]  # Equal rows in other shards and blocks.
  values[3] = -0.5  # Products -0.0 with the zero query: still a tie at 0.
  pzsc.set_logical_tables(lookup, {"big": values})
  return lookup


@pytest.mark.parametrize("block_bytes", [retrieval.BLOCK_BYTES, 40_000])
def test_blocks_and_runs(big, block_bytes):
  """One block of 1,256 rows a shard, runs of 8 rows; or blocks of 256
  rows (the last overlapping the one before), runs of 32 rows."""
  plan = big.config.plan
  rows = retrieval.TableRows.of(plan.tables["big"], plan.num_shards)
  assert rows.rows == 1256
  block = retrieval.block_rows(rows, 37, False, block_bytes)
  assert block == (1256 if block_bytes == retrieval.BLOCK_BYTES else 256)
  table = pzsc.logical_tables(big)["big"]
  queries = _halves(np.random.default_rng(6), (37, 8))
  queries[5] = 0
  _, best = reference(table, queries, 3)
  exclude = np.full((37, 4), -1, np.int32)
  exclude[:, 1:] = best  # Each query's own best three rows.
  exclude[0] = -1
  value = positional_table(big.config, big.tables["big"].value)
  for k in (1, 10):
    for ex in (exclude[:, :0], exclude):
      got = retrieval.top_k(
        value,
        queries,
        ex,
        rows=rows,
        topology=big.config.topology,
        stack="big",
        k=k,
        metric="dot",
        block_bytes=block_bytes,
      )
      check(got, reference(table, queries, k, ex))


def test_runs_are_searched_in_row_order(big):
  """The best runs of a block, taken by their maxima, are searched in
  row order: ties go to the smaller id even when a later run ranks first.

  Shard 0 holds ids 0, 4, 8, ...: id 4 j is its row j, in run j // 8. Ids
  320, 160 and 32 (runs 10, 5 and 1) score 10, 9 and 8, every other row 1.
  """
  before = pzsc.logical_tables(big)
  values = np.zeros((5000, 8), np.float32)
  values[:, 0] = 1
  values[[320, 160, 32], 0] = [10, 9, 8]
  try:
    pzsc.set_logical_tables(big, {"big": values})
    query = np.eye(8, dtype=np.float32)[:1]
    scores, ids = pzsc.top_k(query, big, 10)
    np.testing.assert_array_equal(ids, [[320, 160, 32, 0, 1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(scores, [[10, 9, 8] + [1] * 7])
  finally:
    pzsc.set_logical_tables(big, before)


def test_hashed_tables_are_refused():
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  lookup = pzsc.SparseCoreLookup.from_config(
    "users",
    jax.random.key(0),
    vocab_size=64,
    embedding_axes={"embedding": 8},
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    ids="hashed",
  )
  with pytest.raises(ValueError, match="table 'users' is hashed"):
    pzsc.top_k(np.ones((1, 8)), lookup, 3)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(queries=np.ones((3, 7))), r"queries must be \[Q, 8\]"),
    (dict(queries=np.ones(8)), r"queries must be \[Q, 8\]"),
    (dict(queries=np.ones((3, 8), np.int32)), "must be floats"),
    (dict(k=0), "k must be a positive int"),
    (dict(k=-2), "k must be a positive int"),
    (dict(k=2.0), "k must be a positive int"),
    (dict(table="nope"), "unknown table 'nope'"),
    (dict(table=None), r"has 3 tables .*name one with table="),
    (dict(metric="l2"), "unknown metric 'l2'"),
    (dict(exclude=[[1], [2]]), "exclude has 2 lists for 3 queries"),
    (dict(exclude=[[1], [37], []]), r"exclude\[1\] .* id 37, outside"),
    (dict(exclude=[[1], [-1], []]), r"exclude\[1\] .* id -1, outside"),
    (dict(exclude=[[1.5], [], []]), "integer ids"),
    (dict(exclude=np.full((3, 2), -2)), r"id -2, outside \[-1, 37\)"),
    (dict(exclude=np.zeros((2, 2), int)), r"must be \[3, E\]"),
    (dict(exclude=5), "exclude must be None"),
  ],
)
def test_bad_input_is_refused(layer8, kwargs, match):
  call = dict(queries=np.ones((3, 8), np.float32), k=4, table="a")
  call.update(kwargs)
  queries = call.pop("queries")
  with pytest.raises(ValueError, match=match):
    pzsc.top_k(queries, layer8, **call)
  with pytest.raises(ValueError, match="SparseCoreEmbed or"):
    pzsc.top_k(queries, object(), 4)
  # A correct call still works.
  scores, ids = pzsc.top_k(np.ones((3, 8), np.float32), layer8, 4, table="a")
  assert ids.shape == (3, 4) and (np.asarray(ids) >= 0).all()
