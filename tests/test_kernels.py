"""Tests of the sparse-dense matmul kernels (FFI handlers vs references)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close, draw_slot

import pz_sparsecore as pzsc
from pz_sparsecore.core import buffer_format, optimizers
from pz_sparsecore.device import kernels

PAD = buffer_format.PAD_ID
MLR = "multiply_linear_by_learning_rate"


@dataclasses.dataclass
class Buffers:
  """Random CSR-wrapped COO buffers plus the dense truth they encode."""

  row_pointers: np.ndarray
  embedding_ids: np.ndarray
  sample_ids: np.ndarray
  gains: np.ndarray
  num_segments: int
  samples_per_segment: int
  num_partitions: int
  rows_per_partition: int
  # Valid entries as (segment, partition, row, sample, gain).
  entries: list[tuple[int, int, int, int, float]]

  def args(self):
    return (
      jnp.asarray(self.row_pointers),
      jnp.asarray(self.embedding_ids),
      jnp.asarray(self.sample_ids),
      jnp.asarray(self.gains),
    )

  def layout(self, partition_begin: int = 0) -> dict[str, int]:
    return dict(
      num_segments=self.num_segments,
      samples_per_segment=self.samples_per_segment,
      num_partitions=self.num_partitions,
      rows_per_partition=self.rows_per_partition,
      partition_begin=partition_begin,
    )


def make_buffers(
  seed: int,
  *,
  num_segments: int = 2,
  samples_per_segment: int = 16,
  num_partitions: int = 4,
  rows_per_partition: int = 32,
  ids_per_sample: int = 6,
  empty_partitions: tuple[int, ...] = (),
  invalid_entries: bool = True,
  seg_len: int | None = None,
) -> Buffers:
  """Builds sorted, deduplicated buffers with edge cases mixed in.

  Ids are drawn so that rows 0 and rows_per_partition - 1 of every partition
  are hit often and the same rows recur across segments. With
  ``invalid_entries`` some entries have an out-of-range id or sample id (to
  be skipped) and are placed where the (row, sample) order still holds.
  """
  rng = np.random.default_rng(seed)
  rpp = rows_per_partition
  per_segment = []
  for _ in range(num_segments):
    parts = []
    for p in range(num_partitions):
      pairs = {}
      if p not in empty_partitions:
        for s in range(samples_per_segment):
          n = rng.integers(0, ids_per_sample + 1)
          hot = np.array([0, rpp - 1, 1, rpp // 2])
          rows = np.where(
            rng.random(n) < 0.4,
            rng.choice(hot, n),
            rng.integers(0, rpp, n),
          )
          for r in rows:
            g = float(rng.normal())
            pairs[(int(r), s)] = pairs.get((int(r), s), 0.0) + g
      if p == 1 and p not in empty_partitions:
        pairs[(rpp - 2, 0)] = 0.0  # Referenced with gain 0.
      entries = sorted((r, s, g) for (r, s), g in pairs.items())
      invalid = []
      if invalid_entries and p not in empty_partitions:
        # Out-of-range sample ids (any row) and ids: placed in sorted order.
        invalid.append((rpp // 3, samples_per_segment + 3, 1.0))
        invalid.append((rpp // 3, -1, 1.0))
        invalid.append((-5, 0, 1.0))
        invalid.append((rpp, 0, 1.0))
        invalid.append((rpp + 7, 2, 1.0))
      parts.append((entries, invalid))
    per_segment.append(parts)
  needed = max(
    sum(buffer_format.round_up(len(e) + len(i)) for e, i in parts)
    for parts in per_segment
  )
  seg_len = seg_len or needed + 2 * buffer_format.ALIGNMENT
  rp_stride = buffer_format.row_pointers_per_sc(num_partitions)
  ids = np.full(num_segments * seg_len, PAD, np.int32)
  sids = np.full(num_segments * seg_len, PAD, np.int32)
  gains = np.full(num_segments * seg_len, buffer_format.PAD_GAIN, np.float32)
  rps = np.zeros(num_segments * rp_stride, np.int32)
  truth = []
  for k, parts in enumerate(per_segment):
    pos = 0
    for p, (entries, invalid) in enumerate(parts):
      allrows = sorted(entries + invalid, key=lambda e: (e[0], e[1]))
      start = pos
      for j, (r, s, g) in enumerate(allrows):
        at = k * seg_len + start + j
        ids[at], sids[at], gains[at] = r, s, g
        if 0 <= r < rpp and 0 <= s < samples_per_segment:
          truth.append((k, p, r, s, float(np.float32(g))))
      end = start + len(allrows)
      rps[k * rp_stride + p] = end
      pos = buffer_format.round_up(end)
    rps[k * rp_stride + num_partitions : (k + 1) * rp_stride] = pos
  return Buffers(
    rps,
    ids,
    sids,
    gains,
    num_segments,
    samples_per_segment,
    num_partitions,
    rows_per_partition,
    truth,
  )


def dense_forward(buf: Buffers, table: np.ndarray, partition_begin=0):
  """Forward from the decoded truth, in float64."""
  out = np.zeros((buf.num_segments * buf.samples_per_segment, table.shape[1]))
  ntp = table.shape[0] // buf.rows_per_partition
  for k, p, r, s, g in buf.entries:
    if partition_begin <= p < partition_begin + ntp:
      row = (p - partition_begin) * buf.rows_per_partition + r
      out[k * buf.samples_per_segment + s] += g * table[row]
  return out


def row_grads(buf: Buffers, act_grad: np.ndarray, num_rows: int, pb=0):
  """Row gradients (float64) of the referenced rows: {row: grad}."""
  grads = {}
  for k, p, r, s, g in buf.entries:
    row = (p - pb) * buf.rows_per_partition + r
    if 0 <= row < num_rows and p >= pb:
      contrib = g * act_grad[k * buf.samples_per_segment + s].astype(float)
      grads[row] = grads.get(row, 0.0) + contrib
  return grads


def _table(buf: Buffers, dim: int, seed: int, partitions=None) -> np.ndarray:
  n = partitions if partitions is not None else buf.num_partitions
  rng = np.random.default_rng(seed)
  return rng.normal(size=(n * buf.rows_per_partition, dim)).astype(np.float32)


def _slots(optimizer: str, table: np.ndarray, seed: int) -> tuple:
  """Random values of `optimizer`'s slots for `table`, each at its width (a
  row-wise accumulator: `[rows, 1]`) and in its domain (`draw_slot`)."""
  rng = np.random.default_rng(seed)
  return tuple(
    draw_slot(slot, (*table.shape[:-1], slot.width(table.shape[-1])), rng)
    for slot in optimizers.REGISTRY[optimizer].slots
  )


HYPERPARAMETERS = {
  "sgd": [0.1],
  "adagrad": [0.05],
  "adagrad_momentum": [0.05, 0.9, 1.0, 1e-8, 2.0, 0.0],
  "adam": [0.01, 0.9, 0.999, 1e-7],
  "ftrl": [0.1, -0.5, 0.0, 0.0, 0.0],
  "laprop": [0.01, 0.9, 0.7, 1e-30],
  "f2a": [0.05, 0.5, 0.01, 0.02, 100.0, 7.0],
  # (lr, eps, embedding_dim, l2, decoupled): the mean over 12 of 19
  # columns is allowed (a table narrower than its stack).
  "rowwise_adagrad": [0.05, 1e-8, 12.0, 0.0, 0.0],
}
GRAD_CASES = [
  ("sgd", HYPERPARAMETERS["sgd"], {}),
  ("adagrad", HYPERPARAMETERS["adagrad"], {}),
  ("adagrad_momentum", HYPERPARAMETERS["adagrad_momentum"], {}),
  ("adagrad_momentum", [0.05, 0.8, 0.95, 1e-6, 3.0, 1.0], {}),
  ("adam", HYPERPARAMETERS["adam"], {}),
  ("ftrl", HYPERPARAMETERS["ftrl"], {MLR: False}),
  ("ftrl", [0.1, -0.7, 0.05, 0.1, 0.2], {MLR: False}),
  ("ftrl", [0.1, -0.5, 0.05, 0.1, 0.2], {MLR: True}),
  ("laprop", HYPERPARAMETERS["laprop"], {}),
  ("laprop", [0.01, 0.5, 0.0, 1e-8], {}),
  ("f2a", HYPERPARAMETERS["f2a"], {}),
  ("f2a", [0.05, 1.5, 0.0, 0.0, 3.0, 0.0], {}),
  ("rowwise_adagrad", HYPERPARAMETERS["rowwise_adagrad"], {}),
  ("rowwise_adagrad", [0.05, 1e-6, 19.0, 0.01, 0.0], {}),
  ("rowwise_adagrad", [0.05, 1e-6, 19.0, 0.0, 0.02], {}),
]

FORWARD_CASES = {
  "one_segment": dict(num_segments=1, num_partitions=1),
  "multi": dict(num_segments=3, num_partitions=4),
  "empty_parts": dict(
    num_segments=2, num_partitions=4, empty_partitions=(0, 2)
  ),
  "no_invalid": dict(num_segments=2, num_partitions=2, invalid_entries=False),
  "many_parts": dict(num_segments=2, num_partitions=16, samples_per_segment=8),
  # Enough entries (~60k) for the forward to split them into chunks, with
  # chunk boundaries inside slices and output rows spanning chunks.
  "large": dict(
    num_segments=3,
    num_partitions=4,
    samples_per_segment=256,
    rows_per_partition=2048,
    ids_per_sample=40,
  ),
}


@pytest.mark.parametrize("case", sorted(FORWARD_CASES))
@pytest.mark.parametrize("dim", [1, 19, 64])
def test_forward_matches_truth(case, dim):
  buf = make_buffers(hash(case) % 1000, **FORWARD_CASES[case])
  table = _table(buf, dim, seed=dim)
  want = dense_forward(buf, table)
  for impl in ("ffi", "reference"):
    got = _forward(buf, table, impl)
    assert_close(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize(
  "partition_begin,num_table_partitions", [(1, 2), (2, 2)]
)
def test_forward_partition_window(partition_begin, num_table_partitions):
  buf = make_buffers(7, num_segments=3, num_partitions=4)
  full = _table(buf, 8, seed=3)
  rpp = buf.rows_per_partition
  window = full[
    partition_begin * rpp : (partition_begin + num_table_partitions) * rpp
  ]
  want = dense_forward(buf, window, partition_begin)
  for impl in ("ffi", "reference"):
    got = _forward(buf, window, impl, partition_begin)
    assert_close(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


def decode_truth(buf: Buffers) -> list[tuple[int, int, int, int, float]]:
  """Plain-Python decoding of the buffers into valid entries."""
  seg_len = buf.embedding_ids.shape[0] // buf.num_segments
  stride = buf.row_pointers.shape[0] // buf.num_segments
  out = []
  for k in range(buf.num_segments):
    rp = buf.row_pointers[k * stride : (k + 1) * stride]
    for p in range(buf.num_partitions):
      begin = 0 if p == 0 else buffer_format.round_up(max(int(rp[p - 1]), 0))
      for j in range(begin, min(int(rp[p]), seg_len)):
        at = k * seg_len + j
        r, s = int(buf.embedding_ids[at]), int(buf.sample_ids[at])
        if 0 <= r < buf.rows_per_partition and 0 <= s < buf.samples_per_segment:
          out.append((k, p, r, s, float(buf.gains[at])))
  return out


def test_decode_truth_matches_builder():
  buf = make_buffers(21, num_segments=3, num_partitions=4)
  assert sorted(decode_truth(buf)) == sorted(buf.entries)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_overflowed_row_pointers(impl):
  # An overflow stops filling inside partition 2: later pointers all equal
  # the stop offset, and the buffer past it holds stale entries.
  buf = make_buffers(11, num_segments=1, num_partitions=4)
  rp = buf.row_pointers.copy()
  stop = buffer_format.round_up(int(rp[1])) + 3
  rp[2:] = stop
  buf = dataclasses.replace(buf, row_pointers=rp)
  buf = dataclasses.replace(buf, entries=decode_truth(buf))
  assert any(e[1] == 2 for e in buf.entries)
  assert not any(e[1] == 3 for e in buf.entries)
  table = _table(buf, 4, seed=1)
  got = _forward(buf, table, impl)
  assert_close(got, dense_forward(buf, table), rtol=1e-5, atol=1e-5)
  act_grad = np.ones((buf.samples_per_segment, 4), np.float32)
  new, _ = _grad_call(
    buf, act_grad, table, (), "sgd", [1.0], impl, **buf.layout()
  )
  want = table.astype(np.float64).copy()
  for r, g in row_grads(buf, act_grad, table.shape[0]).items():
    want[r] -= g
  assert_close(new, want, rtol=1e-5, atol=1e-6)


def _grad_call(buf, act_grad, table, slots, opt, hp, impl, **kw):
  fn = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul_grad,
      optimizer=opt,
      implementation=impl,
      **kw,
    ),
  )
  return fn(
    jnp.asarray(act_grad),
    *buf.args(),
    jnp.asarray(table),
    tuple(jnp.asarray(s) for s in slots),
    hyperparameters=jnp.asarray(hp, jnp.float32),
  )


def _forward(buf, table, impl, partition_begin=0):
  fn = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul,
      implementation=impl,
      **buf.layout(partition_begin),
    )
  )
  return fn(*buf.args(), jnp.asarray(table))


@pytest.mark.parametrize("opt,hp,static", GRAD_CASES)
@pytest.mark.parametrize("case", ["multi", "empty_parts", "many_parts"])
def test_grad_ffi_matches_reference(opt, hp, static, case):
  buf = make_buffers(5, **FORWARD_CASES[case])
  table = _table(buf, 19, seed=2)
  slots = _slots(opt, table, seed=3)
  act_grad = (
    np.random.default_rng(4)
    .normal(size=(buf.num_segments * buf.samples_per_segment, 19))
    .astype(np.float32)
  )
  kw = dict(buf.layout(), static_attributes=static)
  got = _grad_call(buf, act_grad, table, slots, opt, hp, "ffi", **kw)
  want = _grad_call(buf, act_grad, table, slots, opt, hp, "reference", **kw)
  referenced = sorted(row_grads(buf, act_grad, table.shape[0]))
  untouched = np.setdiff1d(np.arange(table.shape[0]), referenced)
  for name, g, w, old in zip(
    ("table",) + optimizers.REGISTRY[opt].slot_names,
    (got[0],) + got[1],
    (want[0],) + want[1],
    (table,) + slots,
    strict=True,
  ):
    g, w = np.asarray(g), np.asarray(w)
    assert_close(g, w, rtol=1e-5, atol=1e-6, err_msg=name)
    # Unreferenced rows are bit-identical, referenced ones changed.
    np.testing.assert_array_equal(g[untouched], old[untouched], err_msg=name)
    np.testing.assert_array_equal(w[untouched], old[untouched], err_msg=name)
  assert not np.array_equal(np.asarray(got[0])[referenced], table[referenced])


def test_grad_sgd_matches_truth_and_gain_zero_row_is_referenced():
  buf = make_buffers(9, num_segments=3, num_partitions=4)
  table = _table(buf, 8, seed=1)
  act_grad = np.random.default_rng(2).normal(size=(48, 8)).astype(np.float32)
  grads = row_grads(buf, act_grad, table.shape[0])
  gain_zero_row = 1 * buf.rows_per_partition + buf.rows_per_partition - 2
  assert gain_zero_row in grads
  want = table.astype(np.float64).copy()
  for r, g in grads.items():
    want[r] -= 0.1 * g
  for impl in ("ffi", "reference"):
    new, slots = _grad_call(
      buf, act_grad, table, (), "sgd", [0.1], impl, **buf.layout()
    )
    assert slots == ()
    assert_close(new, want, rtol=1e-5, atol=1e-6, err_msg=impl)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_grad_partition_window(impl):
  buf = make_buffers(13, num_segments=2, num_partitions=4)
  rpp = buf.rows_per_partition
  full = _table(buf, 8, seed=1)
  window = full[2 * rpp : 4 * rpp]
  act_grad = np.random.default_rng(2).normal(size=(32, 8)).astype(np.float32)
  want = window.astype(np.float64).copy()
  for r, g in row_grads(buf, act_grad, window.shape[0], pb=2).items():
    want[r] -= 0.5 * g
  new, _ = _grad_call(
    buf, act_grad, window, (), "sgd", [0.5], impl, **buf.layout(2)
  )
  assert_close(new, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_grad_clip_applies_to_table_only(impl):
  buf = make_buffers(3, num_segments=2, num_partitions=2)
  table = _table(buf, 8, seed=1)
  slots = _slots("adagrad", table, seed=2)
  act_grad = 10 * np.random.default_rng(2).normal(size=(32, 8)).astype(
    np.float32
  )
  new, (acc,) = _grad_call(
    buf,
    act_grad,
    table,
    slots,
    "adagrad",
    [1.0],
    impl,
    clip=(-0.25, 0.5),
    **buf.layout(),
  )
  unclipped, (acc2,) = _grad_call(
    buf, act_grad, table, slots, "adagrad", [1.0], impl, **buf.layout()
  )
  referenced = sorted(row_grads(buf, act_grad, table.shape[0]))
  new = np.asarray(new)
  assert new[referenced].min() >= -0.25 and new[referenced].max() <= 0.5
  assert_close(
    new[referenced], np.clip(np.asarray(unclipped)[referenced], -0.25, 0.5)
  )
  np.testing.assert_array_equal(acc, acc2)


def _np_adam(w, m, v, g, alpha, b1, b2, eps):
  m = m + (1 - b1) * (g - m)
  v = v + (1 - b2) * (g * g - v)
  return w - alpha * m / (np.sqrt(v) + eps), m, v


def _np_ftrl(w, a, lin, g, lr, k, l1, l2, beta, mlr):
  a_new = a + g * g
  p_new = a_new ** (-k)
  dp = p_new - a ** (-k)
  if mlr:
    lin = lin + lr * g - dp * w
    l1s, den = l1 * lr, p_new + 2 * lr * l2 + beta
  else:
    lin = lin + g - dp / lr * w
    l1s, den = l1, (p_new + beta) / lr + 2 * l2
  num = -lin if l1 == 0 else np.clip(lin, -l1s, l1s) - lin
  return num / den, a_new, lin


def _adam_hyperparameters(step, lr=0.01, b1=0.9, b2=0.999, eps=1e-7):
  t = step + 1
  c = np.sqrt(1 - b2**t)
  return [lr * c / (1 - b1**t), b1, b2, eps * c]


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize(
  "opt,mlr", [("adam", False), ("ftrl", False), ("ftrl", True)]
)
def test_three_steps_match_numpy(impl, opt, mlr):
  bufs = [
    make_buffers(30 + i, num_segments=2, num_partitions=2) for i in range(3)
  ]
  table = _table(bufs[0], 8, seed=1)
  slots = _slots(opt, table, seed=2)
  ftrl_hp = [0.1, -0.5, 0.01, 0.05, 0.1]
  w64, s64 = table.astype(np.float64), [s.astype(np.float64) for s in slots]
  state = (jnp.asarray(table), tuple(jnp.asarray(s) for s in slots))
  rng = np.random.default_rng(3)
  for step, buf in enumerate(bufs):
    act_grad = rng.normal(size=(32, 8)).astype(np.float32)
    hp = _adam_hyperparameters(step) if opt == "adam" else ftrl_hp
    state = _grad_call(
      buf,
      act_grad,
      *state,
      opt,
      hp,
      impl,
      static_attributes={MLR: mlr} if opt == "ftrl" else {},
      **buf.layout(),
    )
    for r, g in row_grads(buf, act_grad, table.shape[0]).items():
      if opt == "adam":
        w64[r], s64[0][r], s64[1][r] = _np_adam(
          w64[r], s64[0][r], s64[1][r], g, *hp
        )
      else:
        w64[r], s64[0][r], s64[1][r] = _np_ftrl(
          w64[r], s64[0][r], s64[1][r], g, *hp, mlr
        )
  assert_close(state[0], w64, rtol=1e-4, atol=1e-5)
  for got, want in zip(state[1], s64, strict=True):
    assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_large_batch_parallel_backward_and_determinism():
  # Enough entries that the backward splits its key space into many chunks.
  buf = make_buffers(
    41,
    num_segments=2,
    num_partitions=2,
    samples_per_segment=512,
    rows_per_partition=256,
    ids_per_sample=12,
  )
  table = _table(buf, 16, seed=1)
  slots = _slots("adagrad", table, seed=2)
  act_grad = np.random.default_rng(3).normal(size=(1024, 16)).astype(np.float32)
  got = _grad_call(
    buf, act_grad, table, slots, "adagrad", [0.1], "ffi", **buf.layout()
  )
  again = _grad_call(
    buf, act_grad, table, slots, "adagrad", [0.1], "ffi", **buf.layout()
  )
  want = _grad_call(
    buf, act_grad, table, slots, "adagrad", [0.1], "reference", **buf.layout()
  )
  np.testing.assert_array_equal(got[0], again[0])
  assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
  assert_close(got[1][0], want[1][0], rtol=1e-5, atol=1e-6)
  fwd = _forward(buf, table, "ffi")
  np.testing.assert_array_equal(fwd, _forward(buf, table, "ffi"))
  assert_close(fwd, dense_forward(buf, table), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_backward_is_in_place_with_donation(opt):
  buf = make_buffers(17, num_segments=2, num_partitions=2)
  table = jnp.asarray(_table(buf, 8, seed=1))
  slots = tuple(jnp.asarray(s) for s in _slots(opt, np.asarray(table), seed=2))
  act_grad = jnp.ones((32, 8), jnp.float32)
  hp = jnp.asarray(HYPERPARAMETERS[opt], jnp.float32)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(table, slots, act_grad, hp, *bufs):
    return kernels.sparse_dense_matmul_grad(
      act_grad,
      *bufs,
      table,
      slots,
      optimizer=opt,
      hyperparameters=hp,
      **buf.layout(),
    )

  pointers = [x.unsafe_buffer_pointer() for x in (table, *slots)]
  new_table, new_slots = step(table, slots, act_grad, hp, *buf.args())
  assert table.is_deleted()
  assert [
    x.unsafe_buffer_pointer() for x in (new_table, *new_slots)
  ] == pointers


def test_forward_under_vmap_and_shard_map():
  buf = make_buffers(19, num_segments=2, num_partitions=2)
  tables = np.stack([_table(buf, 4, seed=s) for s in range(3)])
  fwd = functools.partial(kernels.sparse_dense_matmul, **buf.layout())
  got = jax.jit(jax.vmap(fwd, in_axes=(None,) * 4 + (0,)))(
    *buf.args(), jnp.asarray(tables)
  )
  for i in range(3):
    assert_close(got[i], dense_forward(buf, tables[i]), rtol=1e-5, atol=1e-5)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  spec = jax.sharding.PartitionSpec("x")
  sharded = jax.jit(
    jax.shard_map(
      fwd, mesh=mesh, in_specs=(spec,) * 4 + (spec,), out_specs=spec
    )
  )
  assert_close(
    sharded(*buf.args(), jnp.asarray(tables[0])),
    dense_forward(buf, tables[0]),
    rtol=1e-5,
    atol=1e-5,
  )


def _error_operands():
  buf = make_buffers(23, num_segments=2, num_partitions=2)
  table = jnp.asarray(_table(buf, 4, seed=1))
  return buf, table


@pytest.mark.parametrize(
  "change,match",
  [
    (dict(embedding_ids=np.zeros(3, np.int32)), "same length"),
    (dict(sample_ids=np.zeros(256, np.float32)), "dtype int32"),
    (dict(gains=np.zeros((2, 2), np.float32)), "rank 1"),
    (dict(row_pointers=np.zeros(3, np.int32)), "row_pointers length"),
    (dict(table=np.zeros((63, 4), np.float32)), "rows_per_partition"),
    (dict(table=np.zeros((64, 4), np.int32)), "float32"),
    (dict(num_segments=0), "positive"),
    (dict(implementation="gpu"), "implementation"),
  ],
)
def test_forward_errors(change, match):
  buf, table = _error_operands()
  rp, ids, sids, gains = buf.args()
  kw = dict(
    row_pointers=rp,
    embedding_ids=ids,
    sample_ids=sids,
    gains=gains,
    table=table,
    **buf.layout(),
  )
  kw.update(
    {
      k: jnp.asarray(v) if isinstance(v, np.ndarray) else v
      for k, v in change.items()
    }
  )
  with pytest.raises(ValueError, match=match):
    kernels.sparse_dense_matmul(**kw)


@pytest.mark.parametrize(
  "opt,change,match",
  [
    (
      "sgd",
      dict(activation_grad=np.zeros((31, 4), np.float32)),
      "activation_grad",
    ),
    ("adagrad", dict(slots=()), "needs slots"),
    (
      "adam",
      dict(
        slots=(np.zeros((64, 4), np.float32),) * 2,
        hyperparameters=np.zeros(3, np.float32),
      ),
      "hyperparameters",
    ),
    (
      "adam",
      dict(
        slots=(np.zeros((64, 4), np.float32), np.zeros((64, 5), np.float32))
      ),
      "table's shape",
    ),
    ("sgd", dict(hyperparameters=np.zeros(1, np.int32)), "float32"),
    ("sgd", dict(clip=(1.0, -1.0)), "clip"),
    ("rmsprop", dict(), "Unknown optimizer"),
    ("sgd", dict(static_attributes={MLR: True}), "'sgd' has no static"),
  ],
)
def test_grad_errors(opt, change, match):
  buf, table = _error_operands()
  kw = dict(
    activation_grad=jnp.zeros((32, 4), jnp.float32),
    table=table,
    slots=(),
    hyperparameters=jnp.ones(1, jnp.float32),
    optimizer=opt,
    **buf.layout(),
  )
  for k, v in change.items():
    if k == "slots":
      v = tuple(jnp.asarray(s) for s in v)
    elif isinstance(v, np.ndarray):
      v = jnp.asarray(v)
    kw[k] = v
  with pytest.raises(ValueError, match=match):
    kernels.sparse_dense_matmul_grad(
      *[x for x in buf.args()][:0], **_grad_positional(buf, kw)
    )


def _grad_positional(buf, kw):
  rp, ids, sids, gains = buf.args()
  return dict(
    kw, row_pointers=rp, embedding_ids=ids, sample_ids=sids, gains=gains
  )


def test_handler_rejects_bad_operands_without_crashing():
  # Bypass the Python checks: the C++ handler must return an error.
  from pz_sparsecore.device.kernels import contract, ffi

  buf, table = _error_operands()
  shape = contract.check_buffers(*buf.args(), table, **buf.layout())
  none = jnp.zeros((0,), jnp.int32)  # no sample order
  bad = dataclasses.replace(shape, num_partitions=100)
  with pytest.raises(Exception, match="row_pointers"):
    jax.block_until_ready(
      ffi.sparse_dense_matmul(*buf.args(), table, none, bad)
    )
  bad = dataclasses.replace(shape, rows_per_partition=5)
  with pytest.raises(Exception, match="rows_per_partition"):
    jax.block_until_ready(
      ffi.sparse_dense_matmul(*buf.args(), table, none, bad)
    )


# --- which implementation runs ----------------------------------------------


def test_backend_info_reports_this_build():
  from pz_sparsecore.device.kernels import ffi

  info = pzsc.backend_info()
  assert info.load_error is None
  assert os.path.isfile(info.extension_path)
  assert info.abi_version == info.expected_abi_version == ffi.ABI_VERSION
  labels = ["forward"] + [f"grad {name}" for name in optimizers.REGISTRY]
  assert list(info.implementations) == labels + ["grad custom"]
  assert info.implementations["grad custom"] == {
    "cpu": "reference",
    "cuda": "reference",
  }
  for label in labels:
    assert info.implementations[label] == {
      "cpu": "ffi",
      "cuda": "ffi" if info.cuda_build else "reference",
    }
  text = str(info)
  assert info.extension_path in text and "grad ftrl" in text


_FALLBACK_SCRIPT = """
import json, sys, warnings
import numpy as np
import jax.numpy as jnp
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  import pz_sparsecore as pzsc
  from pz_sparsecore.device import kernels
  arrays = np.load(sys.argv[1])
  args = [jnp.asarray(arrays[k]) for k in ("rp", "ids", "sids", "gains", "t")]
  layout = json.loads(sys.argv[2])
  outs = [kernels.sparse_dense_matmul(*args, **layout) for _ in range(2)]
  info = pzsc.backend_info()
print(json.dumps({
  "warnings": [str(w.message) for w in caught
               if w.category is kernels.KernelFallbackWarning],
  "outs": [np.asarray(o).tolist() for o in outs],
  "forward": info.implementations["forward"]["cpu"],
  "load_error": info.load_error,
}))
"""


@pytest.mark.parametrize("library", ["missing", "garbage"])
def test_failed_extension_load_warns_once_and_runs_reference(tmp_path, library):
  path = tmp_path / "_pzsc_ffi.cpython-311-x86_64-linux-gnu.so"
  if library == "garbage":
    path.write_bytes(b"not an ELF file")
  buf = make_buffers(29, num_segments=2, num_partitions=2)
  table = _table(buf, 4, seed=1)
  arrays = tmp_path / "arrays.npz"
  np.savez(
    arrays,
    rp=buf.row_pointers,
    ids=buf.embedding_ids,
    sids=buf.sample_ids,
    gains=buf.gains,
    t=table,
  )
  result = subprocess.run(
    [sys.executable, "-c", _FALLBACK_SCRIPT, arrays, json.dumps(buf.layout())],
    env={**os.environ, "PZSC_FFI_LIBRARY": str(path)},
    capture_output=True,
    text=True,
    check=True,
  )
  report = json.loads(result.stdout)
  assert len(report["warnings"]) == 1, report["warnings"]
  assert str(path) in report["warnings"][0]
  assert "runs the pure-JAX reference" in report["warnings"][0]
  assert report["forward"] == "reference"
  assert str(path) in report["load_error"]
  for out in report["outs"]:
    assert_close(out, dense_forward(buf, table), rtol=1e-5, atol=1e-5)


class _OtherAbi:
  """A loaded extension that reports another ABI version."""

  def __init__(self, version):
    self.version = version

  def abi_version(self):
    return self.version


def test_abi_mismatch_is_an_error_not_a_fallback(monkeypatch):
  from pz_sparsecore.device.kernels import ffi

  ext = ffi.check_extension(_OtherAbi(ffi.ABI_VERSION - 1), "/x/_pzsc_ffi.so")
  assert ext.mismatch and ext.module is None
  assert f"ABI version {ffi.ABI_VERSION - 1}" in ext.error
  monkeypatch.setattr(ffi, "EXTENSION", ext)
  monkeypatch.setattr(ffi, "_PLATFORMS", {})
  buf, table = _error_operands()
  for impl in (None, "ffi"):
    with pytest.raises(kernels.ExtensionMismatchError, match="rebuild"):
      kernels.sparse_dense_matmul(
        *buf.args(), table, implementation=impl, **buf.layout()
      )
  got = kernels.sparse_dense_matmul(
    *buf.args(), table, implementation="reference", **buf.layout()
  )
  assert_close(got, dense_forward(buf, np.asarray(table)), rtol=1e-5, atol=1e-5)
  info = pzsc.backend_info()
  assert info.implementations["grad adam"]["cpu"] == "error"
  assert "/x/_pzsc_ffi.so" in str(info)


@pytest.mark.skipif(
  pzsc.backend_info().cuda_build,
  reason="this build has CUDA handlers: nothing falls back on CUDA",
)
def test_reference_fallback_on_a_platform_warns_once(monkeypatch):
  from pz_sparsecore.device.kernels import dispatch

  monkeypatch.setattr(dispatch, "_warned", set())
  buf, table = _error_operands()
  step = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul_grad,
      optimizer="adagrad",
      **buf.layout(),
    )
  )
  args = (jnp.ones((32, 4), jnp.float32), *buf.args(), table, (table,))
  hp = jnp.ones(1, jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("error", kernels.KernelFallbackWarning)
    jax.block_until_ready(step(*args, hyperparameters=hp))  # CPU: the FFI.
  with pytest.warns(
    kernels.KernelFallbackWarning,
    match="'pzsc_sparse_dense_matmul_grad_adagrad' on platform 'cuda'",
  ):
    jax.export.export(step, platforms=("cuda",))(*args, hyperparameters=hp)
  with warnings.catch_warnings():
    warnings.simplefilter("error", kernels.KernelFallbackWarning)
    jax.export.export(step, platforms=("cuda",))(*args, hyperparameters=hp)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_adagrad_zero_accumulator_guard(impl):
  """Accumulators at 0 and rows whose gradient sums to 0: acc stays 0 and
  the row is left as it was (no 0 / sqrt(0)); a NaN gradient leaves its
  element as it was too (NaN > 0 is false); the others as numpy."""
  b = make_buffers(5, num_segments=2, num_partitions=4)
  dim = 20  # Two vectors of 8 and a tail.
  rng = np.random.default_rng(5)
  table = rng.normal(size=(b.num_partitions * b.rows_per_partition, dim))
  table = table.astype(np.float32)
  act = rng.normal(size=(b.num_segments * b.samples_per_segment, dim))
  act = act.astype(np.float32)
  act[::2] = 0.0  # Every even output row's gradient is 0.
  act[1, 3] = np.nan
  zero = np.zeros_like(table)
  hp = np.asarray([0.5], np.float32)
  new_table, (new_acc,) = _grad_call(
    b, act, table, (zero,), "adagrad", hp, impl, **b.layout()
  )
  new_table, new_acc = np.asarray(new_table), np.asarray(new_acc)
  grads = {}
  for k, p, r, smp, g in b.entries:
    row = p * b.rows_per_partition + r
    grads[row] = grads.get(row, 0.0) + g * act[k * b.samples_per_segment + smp]
  zero_rows = [row for row, g in grads.items() if not np.any(g)]
  nan_rows = [row for row, g in grads.items() if np.isnan(g).any()]
  assert zero_rows and nan_rows and len(zero_rows) < len(grads)
  want = table.copy()
  acc = np.zeros_like(table)
  for row, g in grads.items():
    acc[row] = g * g
    nz = acc[row] > 0
    want[row, nz] -= hp[0] * g[nz] / np.sqrt(acc[row, nz])
  assert np.isfinite(new_table).all()
  np.testing.assert_array_equal(new_table[zero_rows], table[zero_rows])
  # The NaN gradient's accumulator elements are NaN on both sides.
  assert_close(new_acc, acc, rtol=1e-5, atol=1e-6, allow_nan=True)
  assert_close(new_table, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_f2a_keeps_a_nan_local_step(impl):
  """F2A's min(ratio^rho, max_multiplier) keeps NaN (jnp.minimum's rule), so
  a NaN step count poisons exactly its own elements, as in numpy."""
  buf = make_buffers(31, num_segments=1, num_partitions=2)
  table = _table(buf, 4, seed=8)
  acc, local = _slots("f2a", table, 9)
  rpp = buf.rows_per_partition
  rows = sorted({p * rpp + r for _, p, r, _, _ in buf.entries})
  local[rows[0], 1] = np.nan
  act = np.random.default_rng(10).normal(
    size=(buf.num_segments * buf.samples_per_segment, 4)
  )
  act = act.astype(np.float32)
  lr, rho, l1, l2, max_mult, step = HYPERPARAMETERS["f2a"]
  new_table, (new_acc, new_local) = _grad_call(
    buf,
    act,
    table,
    (acc, local),
    "f2a",
    HYPERPARAMETERS["f2a"],
    impl,
    **buf.layout(),
  )
  g = row_grads(buf, act, table.shape[0])[rows[0]].astype(np.float32)
  n = local[rows[0]] + np.float32(1)
  mult = np.minimum((np.maximum(step, 1.0) / n) ** rho, max_mult)
  a = acc[rows[0]] + g * g
  w = table[rows[0]]
  want = w - lr * (mult * g / np.sqrt(a) + l1 * np.sign(w) + l2 * w)
  got = np.asarray(new_table)[rows[0]]
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  assert np.isnan(got[1]) and np.isfinite(np.delete(got, 1)).all()
  assert_close(got, want, rtol=1e-5, atol=1e-6, allow_nan=True)
  assert np.isnan(np.asarray(new_local)[rows[0], 1])


def test_the_built_forward_prefetches_table_rows():
  """The CPU forward's L2 prefetches of table rows are in the extension.

  A helper that the per-ISA clones of a loop called without inlining it
  was once compiled away whole (a function without side effects), and the
  forward ran without any prefetch: up to 2x slower on 16-bit tables.
  """
  import importlib.util
  import shutil

  objdump = shutil.which("objdump")
  if objdump is None:
    pytest.skip("objdump is not installed")
  spec = importlib.util.find_spec("pz_sparsecore._pzsc_ffi")
  assert spec is not None and spec.origin
  listing = subprocess.run(
    [objdump, "-d", "--no-show-raw-insn", spec.origin],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  if "prefetcht0" not in listing:
    pytest.skip("the extension was built for an ISA without x86 prefetches")
  # One per cache line of a row, per dtype and width, per ISA clone.
  assert listing.count("prefetcht2") >= 100
