"""Quantized tables: `QuantizationConfig` on lookups, stacking and the layer.

A quantized lookup reads every table value clipped to `[min, max]` and
rounded (half to even) to the nearest of `num_buckets` evenly spaced levels;
the table itself and its updates stay float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from numerics import assert_close
from penzai import pz
from test_kernels import _forward, _table, dense_forward, make_buffers

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout
from pz_sparsecore.device import kernels
from pz_sparsecore.device.kernels import reference

CONFIG = pzsc.QuantizationConfig(min_value=-0.5, max_value=0.75, num_buckets=6)


def np_quantize(values: np.ndarray, config) -> np.ndarray:
  """The levels in numpy float32, written out independently."""
  lo, hi = np.float32(config.min_value), np.float32(config.max_value)
  step = (hi - lo) / np.float32(config.num_buckets - 1)
  clipped = np.minimum(np.maximum(values.astype(np.float32), lo), hi)
  return lo + np.round((clipped - lo) / step) * step


def test_levels_round_half_to_even_and_clip():
  # step 0.25 from -0.5: -0.375 is half way between levels 0 and 1 (-> 0),
  # -0.125 between 1 and 2 (-> 2).
  values = jnp.array([-9.0, -0.375, -0.125, 0.1, 0.76, 0.625, 5.0])
  got = np.asarray(reference.quantize(values, CONFIG.as_tuple()))
  np.testing.assert_array_equal(got, [-0.5, -0.5, 0.0, 0.0, 0.75, 0.5, 0.75])


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_quantized_forward_equals_numpy(impl):
  buf = make_buffers(21, num_segments=2, num_partitions=4)
  table = _table(buf, 8, seed=4)  # normal(0, 1): many values clip
  want = dense_forward(buf, np_quantize(table, CONFIG))
  lookup = jax.jit(
    lambda *a: kernels.sparse_dense_matmul(
      *a, quantization=CONFIG.as_tuple(), implementation=impl, **buf.layout()
    )
  )
  got = lookup(*buf.args(), jnp.asarray(table))
  assert_close(got, want, rtol=1e-6, atol=1e-6)
  # Unquantized, the same call differs.
  assert not np.allclose(_forward(buf, table, impl), want, atol=1e-3)


def test_quantized_forward_with_a_generic_width_and_refused_settings():
  buf = make_buffers(22, num_segments=3, num_partitions=2)
  table = _table(buf, 13, seed=5)  # not a multiple of 8: the generic loop
  config = pzsc.QuantizationConfig(min_value=-1.0, max_value=2.0, num_buckets=7)
  want = dense_forward(buf, np_quantize(table, config))
  call = functools.partial(
    kernels.sparse_dense_matmul, implementation="ffi", **buf.layout()
  )
  got = call(*buf.args(), jnp.asarray(table), quantization=config.as_tuple())
  assert_close(got, want, rtol=1e-6, atol=1e-6)
  # The handler checks the attribute too (the spec class refuses first).
  with pytest.raises(Exception, match="num_buckets >= 2"):
    jax.block_until_ready(
      call(*buf.args(), jnp.asarray(table), quantization=(0.0, 1.0, 1))
    )
  got = call(*buf.args(), jnp.asarray(table), quantization=config.as_tuple())
  assert_close(got, want, rtol=1e-6, atol=1e-6)


def _table_spec(name, config, vocab=40, lr=0.5):
  return pzsc.TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=8,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=lr),
    combiner="sum",
    quantization_config=config,
  )


def _features(tables, batch=32):
  return {
    f"f_{t.name}": pzsc.FeatureSpec(
      name=f"f_{t.name}",
      table_spec=t,
      input_shape=(batch, 3),
      output_shape=(batch, 8),
    )
    for t in tables
  }


def test_tables_in_a_stack_share_their_quantization_config():
  other = pzsc.QuantizationConfig(min_value=0.0, max_value=1.0, num_buckets=4)
  features = _features(
    [_table_spec("a", CONFIG), _table_spec("b", other), _table_spec("c", None)]
  )
  with pytest.raises(ValueError, match="different quantization configs"):
    layout.stack_tables(features, ["a", "b"], 2, 2)
  with pytest.raises(ValueError, match="different quantization configs"):
    layout.stack_tables(features, ["a", "c"], 2, 2)
  # The refused call changed nothing; a stack of equal configs carries it.
  same = _features([_table_spec("a", CONFIG), _table_spec("d", CONFIG)])
  stacked = layout.stack_tables(same, ["a", "d"], 2, 2)
  assert stacked["f_a"].table_spec.stacked_table_spec.quantization_config == (
    CONFIG
  )
  # auto_stack groups by config: a, d together; b and c alone.
  grouped = layout.auto_stack_tables(
    features | {"f_d": same["f_d"]}, 2, num_sc_per_device=2
  )
  stacks = {
    f.table_spec.name: f.table_spec.setting_in_stack.stack_name
    for f in grouped.values()
  }
  assert stacks["a"] == stacks["d"]
  assert len({stacks["a"], stacks["b"], stacks["c"]}) == 3
  # Each one-table stack (prepare) copies its table's config.
  prepared = layout.prepare_feature_specs_for_training(features, 2, 2)
  for feature in prepared.values():
    table = feature.table_spec
    assert table.stacked_table_spec.quantization_config == (
      table.quantization_config
    )


def test_layer_refuses_a_table_whose_stack_has_another_config():
  features = _features([_table_spec("a", CONFIG)])
  stacked = layout.stack_tables(features, ["a"], 1, 1)
  table = stacked["f_a"].table_spec
  mixed = {"f_a": stacked["f_a"].replace(table_spec=table.replace(
    quantization_config=None))}  # fmt: skip
  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  with pytest.raises(ValueError, match="tables in a stack share one"):
    pzsc.SparseCoreEmbed.from_config(
      "e", jax.random.key(0), mixed, mesh, num_sc_per_device=1
    )
  pzsc.SparseCoreEmbed.from_config(
    "e", jax.random.key(0), stacked, mesh, num_sc_per_device=1
  )


@pytest.mark.parametrize("exchange", ["activations", "rows"])
def test_layer_reads_quantized_rows_and_updates_float_tables(exchange):
  batch, vocab, lr = 32, 40, 0.5
  features = _features(
    [_table_spec("q", CONFIG, vocab, lr), _table_spec("p", None, vocab, lr)],
    batch,
  )
  mesh = Mesh(np.array(jax.devices()[:8]), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "e", jax.random.key(1), features, mesh, num_sc_per_device=1,
    exchange=exchange,
  )  # fmt: skip
  rng = np.random.default_rng(2)
  ids = {name: rng.integers(0, vocab, (batch, 3)) for name in features}
  ids["f_q"][:2] = [[0, vocab - 1, vocab - 1], [8, 7, 0]]  # edges, duplicates
  inputs, _ = embed.preprocess(ids)
  tables = pzsc.logical_tables(embed)
  acts = embed(inputs)
  for name, table_name in (("f_q", "q"), ("f_p", "p")):
    rows = tables[table_name]
    if table_name == "q":
      rows = np_quantize(rows, CONFIG)
    want = rows[ids[name]].astype(np.float64).sum(axis=1)
    got = np.asarray(acts[name].unwrap("batch", "embedding"))
    assert_close(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
  grads = {
    name: pz.nx.wrap(
      rng.normal(size=(batch, 8)).astype(np.float32), "batch", "embedding"
    )
    for name in features
  }
  embed.apply_gradients(inputs, grads, 0)
  after = pzsc.logical_tables(embed)
  for name, table_name in (("f_q", "q"), ("f_p", "p")):
    want = tables[table_name].astype(np.float64)
    g = np.asarray(grads[name].unwrap("batch", "embedding"), np.float64)
    for sample, row_ids in enumerate(ids[name]):
      for i in row_ids:
        want[i] -= lr * g[sample]
    # The float32 table gets the plain gradient step, not a quantized one.
    assert_close(after[table_name], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_nan_in_a_quantized_table_reaches_the_output(impl):
  """A diverged table shows through a quantized lookup (jnp.clip keeps NaN),
  so a finiteness check sees it; the other columns still read their
  levels."""
  buf = make_buffers(22, num_segments=1, num_partitions=2)
  table = _table(buf, 4, seed=5)
  rpp = buf.rows_per_partition
  rows = sorted({p * rpp + r for _, p, r, _, _ in buf.entries})
  table[rows[0]] = [np.nan, 0.3, 1.0, -2.0]
  table[rows[-1], 2] = np.nan
  want = dense_forward(buf, np_quantize(table, CONFIG))
  got = np.asarray(
    jax.jit(
      lambda *a: kernels.sparse_dense_matmul(
        *a, quantization=CONFIG.as_tuple(), implementation=impl, **buf.layout()
      )
    )(*buf.args(), jnp.asarray(table))
  )
  assert np.isnan(want).any() and np.isfinite(want).any()
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert_close(got, want, rtol=1e-6, atol=1e-6, allow_nan=True)
  # The row of the example: NaN stays NaN, the rest is clipped and rounded.
  assert np.isnan(np_quantize(np.float32([np.nan]), CONFIG)[0])
