"""16-bit tables at the kernel level: bfloat16 and float16 rows read widened
to float32, updated in float32 and written back by stochastic rounding.

References: numpy (float64 sums of the widened rows; the two 16-bit
neighbours of each float32 update and the probability of the upper one),
the pure-JAX reference (the same random bits), and the float32 path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import user_compile
from numerics import assert_close
from test_kernels import (
  FORWARD_CASES,
  GRAD_CASES,
  _slots,
  _table,
  make_buffers,
  row_grads,
)

from pz_sparsecore.core import buffer_format, optimizers
from pz_sparsecore.device import kernels
from pz_sparsecore.device.kernels import reference

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _as(table: np.ndarray, dtype: str) -> np.ndarray:
  """``table`` rounded to nearest in ``dtype`` (numpy, via ml_dtypes)."""
  return table.astype(_numpy_dtype(dtype))


def _numpy_dtype(dtype: str) -> np.dtype:
  return np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)


def _bits(x) -> np.ndarray:
  return np.asarray(x).view(np.uint16).astype(np.int64)


def _forward(buf, table, impl, quantization=None):
  fn = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul,
      implementation=impl,
      quantization=quantization,
      **buf.layout(),
    )
  )
  return np.asarray(fn(*buf.args(), jnp.asarray(table)))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("dim", [8, 19, 24, 64])
@pytest.mark.parametrize("case", ["multi", "empty_parts", "large"])
def test_forward_of_a_16_bit_table_sums_its_widened_rows(dtype, dim, case):
  buf = make_buffers(3, **FORWARD_CASES[case])
  table = _as(_table(buf, dim, seed=4), dtype)
  got = _forward(buf, table, "ffi")
  want = _forward(buf, table, "reference")
  assert got.dtype == want.dtype == np.float32
  # numpy: float64 sums of the widened rows, entry by entry.
  truth = np.zeros(got.shape)
  wide = table.astype(np.float64)
  for k, p, r, s, g in buf.entries:
    truth[k * buf.samples_per_segment + s] += (
      g * wide[p * buf.rows_per_partition + r]
    )
  assert_close(got, truth, rtol=1e-5, atol=1e-5)
  assert_close(want, truth, rtol=1e-5, atol=1e-5)
  # The float32 path on the widened table gives the same bits.
  np.testing.assert_array_equal(
    got, _forward(buf, table.astype(np.float32), "ffi")
  )


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_quantized_forward_of_a_16_bit_table(dtype):
  buf = make_buffers(6, **FORWARD_CASES["multi"])
  table = _as(_table(buf, 16, seed=1), dtype)
  q = (-0.5, 0.75, 6)
  got = _forward(buf, table, "ffi", q)
  want = _forward(buf, table, "reference", q)
  assert_close(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(
    got, _forward(buf, table.astype(np.float32), "ffi", q)
  )


def _grad(buf, act, table, slots, opt, hp, impl, seed, static=None):
  fn = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul_grad,
      optimizer=opt,
      implementation=impl,
      static_attributes=static,
      **buf.layout(),
    ),
    compiler_options=user_compile.OPTIONS,
  )
  new_table, new_slots = fn(
    jnp.asarray(act),
    *buf.args(),
    jnp.asarray(table),
    tuple(jnp.asarray(s) for s in slots),
    hyperparameters=jnp.asarray(hp, jnp.float32),
    rounding_seed=None if seed is None else jnp.asarray(seed, jnp.int32),
  )
  return np.asarray(new_table), tuple(np.asarray(s) for s in new_slots)


def _neighbours(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
  """The representable values of ``dtype`` just below and above float32
  ``x`` in magnitude (equal where x is representable)."""
  t = _numpy_dtype(dtype)
  lo = x.astype(t)
  lo = np.where(np.abs(lo.astype(np.float32)) > np.abs(x), _toward_zero(lo), lo)
  hi = np.where(lo.astype(np.float32) == x, lo, _away(lo))
  return lo.astype(t), hi.astype(t)


def _toward_zero(v):
  b = v.view(np.uint16)
  return (b - (b & 0x7FFF != 0)).astype(np.uint16).view(v.dtype)


def _away(v):
  return (v.view(np.uint16) + 1).astype(np.uint16).view(v.dtype)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("opt,hp,static", GRAD_CASES)
def test_update_of_a_16_bit_table_matches_reference(dtype, opt, hp, static):
  buf = make_buffers(5, **FORWARD_CASES["multi"])
  dim = 19
  table = _as(_table(buf, dim, seed=2) * 0.5, dtype)
  slots = _slots(opt, table.astype(np.float32), seed=3)
  act = (
    np.random.default_rng(4)
    .normal(size=(buf.num_segments * buf.samples_per_segment, dim))
    .astype(np.float32)
  )
  got_t, got_s = _grad(buf, act, table, slots, opt, hp, "ffi", 7, static)
  want_t, want_s = _grad(
    buf, act, table, slots, opt, hp, "reference", 7, static
  )
  assert got_t.dtype == table.dtype and all(
    s.dtype == np.float32 for s in got_s
  )
  for g, w in zip(got_s, want_s, strict=True):
    assert_close(g, w, rtol=1e-5, atol=1e-6)
  # The float32 update of the widened rows, then each stored value is one
  # of its two neighbours; handler and reference share the random bits, so
  # they agree bit for bit but where their float32 results differ in the
  # last bit (then by one 16-bit step at most).
  wide_t, _ = _grad(
    buf,
    act,
    table.astype(np.float32),
    slots,
    opt,
    hp,
    "reference",
    None,
    static,
  )
  referenced = sorted(row_grads(buf, act, table.shape[0]))
  untouched = np.setdiff1d(np.arange(table.shape[0]), referenced)
  lo, hi = _neighbours(wide_t[referenced], dtype)
  for got, share in ((want_t, 1.0), (got_t, 0.98)):
    np.testing.assert_array_equal(
      _bits(got[untouched]), _bits(table[untouched])
    )
    r = got[referenced].astype(np.float32)
    ok = (r == lo.astype(np.float32)) | (r == hi.astype(np.float32))
    assert ok.mean() >= share, np.argwhere(~ok)[:5]
  diff = np.abs(_bits(got_t) - _bits(want_t))
  assert diff.max() <= 1
  assert (diff == 0).mean() > 0.98
  if opt == "sgd":
    np.testing.assert_array_equal(_bits(got_t), _bits(want_t))


def _one_row_per_sample(rows: int):
  """Buffers of one segment and partition: sample s references row s with
  gain 1 (one valid entry per row)."""
  rp_stride = buffer_format.row_pointers_per_sc(1)
  rps = np.full(rp_stride, rows, np.int32)
  ids = np.arange(rows, dtype=np.int32)
  return (
    (
      jnp.asarray(rps),
      jnp.asarray(ids),
      jnp.asarray(ids),
      jnp.ones(rows, jnp.float32),
    ),
    dict(
      num_segments=1,
      samples_per_segment=rows,
      num_partitions=1,
      rows_per_partition=rows,
    ),
  )


@pytest.mark.parametrize(
  "dtype,start,delta",
  [
    ("bfloat16", 1.0, 0.3 * 2.0**-7),  # 30% of a step above 1.
    ("bfloat16", -3.0, -0.8 * 2.0**-6),
    ("float16", 0.5, 0.6 * 2.0**-11),
    ("float16", 2.0**-20, 0.25 * 2.0**-24),  # Subnormal: units of 2^-24.
  ],
)
@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_stochastic_rounding_is_unbiased_and_seeded(dtype, start, delta, impl):
  rows, dim = 256, 64
  bufs, layout = _one_row_per_sample(rows)
  table = jnp.full((rows, dim), start, DTYPES[dtype])
  # SGD with lr 1 and gradient -delta: every element's float32 update is
  # start + delta, between two neighbours.
  act = jnp.full((rows, dim), -delta, jnp.float32)
  step = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul_grad,
      optimizer="sgd",
      implementation=impl,
      **layout,
    )
  )

  def run(seed):
    t, _ = step(
      act,
      *bufs,
      table,
      (),
      hyperparameters=jnp.ones(1, jnp.float32),
      rounding_seed=jnp.int32(seed),
    )
    return np.asarray(t).astype(np.float64)

  x = np.float32(start) + np.float32(delta)
  lo, hi = (
    np.asarray(v).astype(np.float64)
    for v in _neighbours(np.asarray([x], np.float32), dtype)
  )
  p = (x - lo[0]) / (hi[0] - lo[0])
  assert 0.05 < p < 0.95
  got = run(11)
  assert np.isin(got, [lo[0], hi[0]]).all()
  n = got.size
  up = (got == hi[0]).mean()
  assert abs(up - p) < 5 * np.sqrt(p * (1 - p) / n), (up, p)
  # The mean is the float32 value (the rounding's expectation).
  step_size = abs(hi[0] - lo[0])
  assert abs(got.mean() - x) < 5 * step_size * np.sqrt(p * (1 - p) / n)
  np.testing.assert_array_equal(got, run(11))  # Reproducible.
  assert not np.array_equal(got, run(12))


def test_special_values_survive_rounding():
  x = jnp.asarray(
    [[np.nan, np.inf, -np.inf, 0.0, -0.0, 65519.0, 1e-30, 3.0e38]],
    jnp.float32,
  )
  rows = jnp.zeros(1, jnp.int32)
  for dtype in (jnp.bfloat16, jnp.float16):
    r = np.asarray(reference.stochastic_round(x, dtype, 3, rows)).astype(
      np.float32
    )[0]
    assert np.isnan(r[0]) and r[1] == np.inf and r[2] == -np.inf
    assert r[3] == 0 and r[4] == 0 and np.signbit(r[4])
    assert r[6] in (0.0, 2.0**-24) or dtype == jnp.bfloat16
  f16 = np.asarray(reference.stochastic_round(x, jnp.float16, 3, rows))[0]
  assert f16[5] in (np.float16(65504), np.float16(np.inf))
  assert f16[7] == np.inf  # Past float16's range.


def test_the_rounding_seed_is_required_and_checked():
  buf = make_buffers(1, **FORWARD_CASES["multi"])
  table = _as(_table(buf, 8, seed=0), "bfloat16")
  act = np.zeros((buf.num_segments * buf.samples_per_segment, 8), np.float32)
  with pytest.raises(ValueError, match="bfloat16 table's update rounds"):
    _grad(buf, act, table, (), "sgd", [0.1], None, None)
  with pytest.raises(ValueError, match="one int32 or uint32"):
    kernels.sparse_dense_matmul_grad(
      jnp.asarray(act),
      *buf.args(),
      jnp.asarray(table),
      (),
      optimizer="sgd",
      hyperparameters=jnp.ones(1, jnp.float32),
      rounding_seed=jnp.float32(1.0),
      **buf.layout(),
    )
  with pytest.raises(ValueError, match="this table is float32"):
    _grad(buf, act, table.astype(np.float32), (), "sgd", [0.1], "ffi", 3)
  with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
    _forward(buf, table.astype(np.int32), "ffi")
  # The next call, with a seed, works.
  new, _ = _grad(buf, act, table, (), "sgd", [0.1], "ffi", 3)
  np.testing.assert_array_equal(_bits(new), _bits(table))
  assert optimizers.REGISTRY["sgd"].compiled
