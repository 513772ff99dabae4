"""The forward's sample order: written by the preprocessor for one device,
read by the CPU forward instead of sorting, refused when malformed."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from numerics import assert_close

import pz_sparsecore as pzsc
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core import specs
from pz_sparsecore.device import kernels
from pz_sparsecore.device.kernels import reference
from pz_sparsecore.device.kernels.contract import check_buffers
from pz_sparsecore.nn.embed import SparseCoreEmbed

BATCH = 32
NUM_SC = 2


def _features(combiner="sum", limit=4096):
  """Two features of one table (one stack): `a` (4 ids per sample) and `b`
  (weighted, ragged)."""
  ta = specs.TableSpec(
    name="ta",
    vocabulary_size=40,
    embedding_dim=8,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=specs.SGDOptimizerSpec(learning_rate=0.1),
    combiner=combiner,
    max_ids_per_partition=limit,
    max_unique_ids_per_partition=limit,
  )
  return {
    "a": specs.FeatureSpec(
      name="a", table_spec=ta, input_shape=(BATCH, 4), output_shape=(BATCH, 8)
    ),
    "b": specs.FeatureSpec(
      name="b", table_spec=ta, input_shape=(BATCH, 3), output_shape=(BATCH, 8)
    ),
  }


def _batch(seed):
  """Ids with duplicates within samples, empty samples and the first and
  last row of each vocabulary; `b` weighted."""
  rng = np.random.default_rng(seed)
  a = rng.integers(0, 40, (BATCH, 4))
  a[0] = [0, 0, 39, 39]
  a[1] = 7
  b = np.empty(BATCH, object)
  wb = np.empty(BATCH, object)
  for i in range(BATCH):
    n = int(rng.integers(0, 4))
    b[i] = rng.integers(0, 40, n)
    wb[i] = rng.uniform(0.5, 2.0, n).astype(np.float32)
  b[2], wb[2] = np.array([39, 0, 39]), np.array([1.0, 2.0, 0.5], np.float32)
  b[3], wb[3] = np.array([], np.int64), np.array([], np.float32)
  return {"a": a, "b": b}, {"a": None, "b": wb}


def _prepared(features):
  return pzsc.prepare_feature_specs_for_training(
    features, global_device_count=1, num_sc_per_device=NUM_SC
  )


def _preprocess(features, ids, weights, **kw):
  return pzsc.preprocess_sparse_dense_matmul_input(
    ids, weights, _prepared(features), 1, 1, num_sc_per_device=NUM_SC, **kw
  )


def _layout(features):
  """The name, kernel sizes and table rows of the features' one stack on
  one device (the local exchange's)."""
  (stack,) = plan_lib.build(_prepared(features), 1, NUM_SC).stacks
  layout = dict(
    num_segments=NUM_SC,
    samples_per_segment=stack.samples_per_sc,
    num_partitions=NUM_SC,
    rows_per_partition=stack.rows_per_shard,
  )
  return stack.name, layout, NUM_SC * stack.rows_per_shard


def _buffers(inputs, name):
  return [
    jnp.asarray(getattr(inputs, f)[name])
    for f in (
      "lhs_row_pointers",
      "lhs_embedding_ids",
      "lhs_sample_ids",
      "lhs_gains",
    )
  ]


def _split(order, num_outputs):
  starts = order[: num_outputs + 1]
  pairs = order[num_outputs + 1 :].reshape(-1, 2)
  return starts, pairs[:, 0].view(np.uint32), pairs[:, 1].view(np.float32)


def _entries_of_buffers(inputs, name, layout, table_rows):
  """(output row, table row) -> summed gain, decoded from the COO buffers
  by the reference's decoder."""
  *args, gains = _buffers(inputs, name)
  table = jnp.zeros((table_rows, 1))
  shape = check_buffers(*args, gains, table, partition_begin=0, **layout)
  valid, row, out = map(np.asarray, reference.decode_entries(*args, shape))
  gains = np.asarray(inputs.lhs_gains[name])
  merged = {}
  for v, r, o, g in zip(valid, row, out, gains, strict=True):
    if v:
      merged[int(o), int(r)] = merged.get((int(o), int(r)), 0.0) + g
  return merged


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
def test_preprocessor_writes_every_lookup_grouped_by_output_row(combiner):
  features = _features(combiner)
  ids, weights = _batch(0)
  inputs, _ = _preprocess(features, ids, weights)
  name, layout, table_rows = _layout(features)
  order = np.asarray(inputs.sample_order[name])
  assert order.shape == (
    NUM_SC * layout["samples_per_segment"]
    + 1
    + 2 * inputs.lhs_gains[name].shape[0],
  )
  num_outputs = layout["num_segments"] * layout["samples_per_segment"]
  starts, rows, gains = _split(order, num_outputs)
  assert starts[0] == 0 and np.all(np.diff(starts) >= 0)
  # One output row per (SparseCore, feature sample): the raw ids of the
  # sample, duplicates kept.
  per_sc = BATCH // NUM_SC
  counts = np.diff(starts).reshape(NUM_SC, 2, per_sc)
  for s in range(NUM_SC):
    for i in range(per_sc):
      sample = s * per_sc + i
      assert counts[s, 0, i] == len(ids["a"][sample])
      assert counts[s, 1, i] == len(ids["b"][sample])
  # The same lookups and gains as the COO buffers (which merged duplicates).
  summed = {}
  for o in range(num_outputs):
    for j in range(starts[o], starts[o + 1]):
      key = (o, int(rows[j]))
      summed[key] = summed.get(key, 0.0) + float(gains[j])
  used = starts[-1]
  assert rows[:used].max() < table_rows
  assert not rows[used:].any() and not gains[used:].any()  # zeros
  merged = _entries_of_buffers(inputs, name, layout, table_rows)
  assert summed.keys() == merged.keys()
  for key, g in merged.items():
    assert_close(summed[key], g, rtol=1e-6)


def _dense_forward(features, ids, weights, tables, combiner):
  """numpy: each feature's combined rows of its own table."""
  out = {}
  for name, spec in features.items():
    table = tables[spec.table_spec.name]
    rows = []
    for i in range(BATCH):
      e = np.asarray(ids[name][i]).reshape(-1)
      w = (
        np.ones(len(e), np.float64)
        if weights[name] is None
        else np.asarray(weights[name][i], np.float64)
      )
      if combiner == "mean" and len(e):
        w = w / w.sum()
      if combiner == "sqrtn" and len(e):
        w = w / np.sqrt((w * w).sum())
      rows.append((w[:, None] * table[e]).sum(0) if len(e) else np.zeros(8))
    out[name] = np.stack(rows)
  return out


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_layer_forward_reads_the_order_and_matches_numpy(combiner):
  """A one-device layer: its buffers carry the order, its forward equals
  numpy's and the forward without the order; a changed order changes the
  output (so the forward reads it)."""
  features = _features(combiner)
  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  embed = SparseCoreEmbed.from_config("e", jax.random.key(1), features, mesh)
  ids, weights = _batch(1)
  inputs, _ = embed.preprocess(ids, weights)
  assert inputs.sample_order is not None
  tables = {
    k: np.asarray(v, np.float64) for k, v in pzsc.logical_tables(embed).items()
  }
  want = _dense_forward(features, ids, weights, tables, combiner)
  got = {
    k: np.asarray(v.unwrap("batch", "embedding"))
    for k, v in embed(inputs).items()
  }
  without = embed(dataclasses.replace(inputs, sample_order=None))
  for k in features:
    assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)
    assert_close(
      got[k],
      np.asarray(without[k].unwrap("batch", "embedding")),
      rtol=1e-6,
      atol=1e-6,
    )
  (name,) = inputs.sample_order
  order = np.array(inputs.sample_order[name])
  num_outputs = NUM_SC * BATCH  # two features of BATCH / NUM_SC per SC
  order[num_outputs + 2] = np.float32(5.0).view(np.int32)  # first gain
  changed = embed(
    dataclasses.replace(inputs, sample_order={name: jnp.asarray(order)})
  )
  assert not np.allclose(
    np.asarray(changed["a"].unwrap("batch", "embedding")), got["a"]
  )


def test_multi_device_buffers_and_minibatches_carry_no_order():
  features = _features()
  ids, weights = _batch(2)
  prepared = pzsc.prepare_feature_specs_for_training(
    features, global_device_count=2, num_sc_per_device=1
  )
  inputs, _ = pzsc.preprocess_sparse_dense_matmul_input(
    ids, weights, prepared, 2, 2, num_sc_per_device=1
  )
  assert inputs.sample_order is None
  inputs, _ = _preprocess(features, ids, weights, enable_minibatching=True)
  assert inputs.sample_order is None


def test_dropped_ids_mark_the_order_unused_and_the_forward_sorts():
  features = _features(limit=2)
  ids, weights = _batch(3)
  with pytest.warns(UserWarning, match="dropped"):
    inputs, stats = _preprocess(features, ids, weights, allow_id_dropping=True)
  assert sum(stats.id_drop_counters.values()) > 0
  name, layout, table_rows = _layout(features)
  assert np.asarray(inputs.sample_order[name])[0] == -1
  table = jnp.asarray(
    np.random.default_rng(0).normal(size=(table_rows, 8)), jnp.float32
  )
  bufs = _buffers(inputs, name)
  with_order = kernels.sparse_dense_matmul(
    *bufs,
    table,
    sample_order=jnp.asarray(inputs.sample_order[name]),
    implementation="ffi",
    **layout,
  )
  want = kernels.sparse_dense_matmul(
    *bufs, table, implementation="reference", **layout
  )
  assert_close(with_order, want, rtol=1e-6, atol=1e-6)


def test_eval_shapes_match_the_buffers():
  features = _features()
  ids, weights = _batch(4)
  for lead in (False, True):
    inputs, _ = _preprocess(features, ids, weights, has_leading_dimension=lead)
    shapes = pzsc.eval_preprocess_sparse_dense_matmul_input_shape(
      _prepared(features),
      1,
      1,
      num_sc_per_device=NUM_SC,
      has_leading_dimension=lead,
    )
    structs = jax.tree.map(lambda x: (x.shape, x.dtype), shapes)
    assert structs == jax.tree.map(lambda x: (x.shape, x.dtype), inputs)
    assert inputs.sample_order is not None


# --- the kernel's checks ------------------------------------------------------


def _one_segment(seed=0, samples=16, rows=64):
  """One segment, one partition: buffers, a table and a valid order."""
  rng = np.random.default_rng(seed)
  pairs = sorted(
    {(int(rng.integers(0, rows)), s) for s in range(samples) for _ in range(3)}
  )
  n = len(pairs)
  seg = -(-n // 8) * 8
  emb = np.full(seg, 2**31 - 1, np.int32)
  sid = np.full(seg, 2**31 - 1, np.int32)
  gains = np.full(seg, np.nan, np.float32)
  emb[:n] = [r for r, _ in pairs]
  sid[:n] = [s for _, s in pairs]
  gains[:n] = rng.uniform(0.5, 1.5, n)
  rp = np.full(8, n, np.int32)
  by_sample = sorted(range(n), key=lambda j: (sid[j], j))
  starts = np.searchsorted(sid[:n][by_sample], np.arange(samples + 1))
  order_pairs = np.stack(
    [emb[by_sample], gains[by_sample].view(np.int32)], axis=1
  ).reshape(-1)
  order = np.concatenate([starts.astype(np.int32), order_pairs])
  table = rng.normal(size=(rows, 8)).astype(np.float32)
  layout = dict(
    num_segments=1,
    samples_per_segment=samples,
    num_partitions=1,
    rows_per_partition=rows,
  )
  return [jnp.asarray(x) for x in (rp, emb, sid, gains)], table, order, layout


def _call(bufs, table, order, layout):
  fn = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul, implementation="ffi", **layout
    )
  )
  return np.asarray(fn(*bufs, jnp.asarray(table), sample_order=order))


def test_a_valid_order_gives_the_buffers_result_bit_for_bit():
  bufs, table, order, layout = _one_segment()
  got = _call(bufs, table, jnp.asarray(order), layout)
  want = _call(bufs, table, jnp.zeros((0,), jnp.int32), layout)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
  "corrupt, match",
  [
    (lambda o, n: o.__setitem__(0, 1), "start 0 is 1"),
    (lambda o, n: o.__setitem__(5, o[4] - 1), "start 5"),
    (lambda o, n: o.__setitem__(16, (len(o) - 17) // 2 + 1), "start 16"),
    (lambda o, n: o.__setitem__(17, 64), "rows outside the table"),
    (lambda o, n: o.__setitem__(17, -1), "rows outside the table"),
  ],
)
def test_a_malformed_order_is_refused_and_the_next_call_works(corrupt, match):
  bufs, table, order, layout = _one_segment(1)
  bad = order.copy()
  corrupt(bad, 16)
  with pytest.raises(Exception, match=match):
    _call(bufs, table, jnp.asarray(bad), layout)
  want = _call(bufs, table, jnp.zeros((0,), jnp.int32), layout)
  np.testing.assert_array_equal(
    _call(bufs, table, jnp.asarray(order), layout), want
  )


def test_an_order_of_the_wrong_length_is_a_value_error():
  bufs, table, order, layout = _one_segment(2)
  with pytest.raises(ValueError, match="sample_order has"):
    _call(bufs, table, jnp.asarray(order[:-1]), layout)
  with pytest.raises(ValueError, match="sample_order has"):
    _call(bufs, table, jnp.asarray(order[:10]), layout)


def test_random_orders_never_read_outside_the_table():
  """Garbage of the right length: refused, or summed from in-table rows
  (the ASan build runs this too)."""
  bufs, table, order, layout = _one_segment(3)
  rng = np.random.default_rng(7)
  for trial in range(30):
    garbage = rng.integers(-5, 70, order.shape).astype(np.int32)
    if trial % 3 == 0:
      garbage[:17] = np.sort(np.abs(garbage[:17]))
      garbage[0] = 0
    try:
      out = _call(bufs, table, jnp.asarray(garbage), layout)
    except Exception as e:  # noqa: BLE001
      assert "sample_order" in str(e)
      continue
    assert out.shape == (16, 8)
