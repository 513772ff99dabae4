"""Hostile buffers: the FFI kernels equal the reference or raise, never crash.

Hypothesis draws buffer contents of every kind the kernels may meet:
unsorted ids, negative, out-of-range, padding and extreme ids (INT32_MIN,
INT32_MAX), bad sample ids, row pointers that are negative, past the
segment, extreme or decreasing, garbage in the row pointer tails, NaN and
infinite gains, several segments and partitions and table windows, and every
optimizer of the registry with clip on and off. Each call through the public
functions with ``implementation="ffi"`` must equal the same call with
``implementation="reference"``, unless the row pointers make partition starts
decrease (partitions would overlap): then the FFI must raise, and the next
valid call must work.

Half the cases draw NaN and infinite gains (``Case.about_nan``): their
outputs may hold NaN where both implementations do. The other half draw
finite gains, and there a NaN or an infinity in any output is a failure
(``numerics.assert_close``), so an update that is NaN on both sides (a slot
drawn outside its domain) is caught.

The layouts come from a short fixed list, so that the jitted functions
compile a bounded number of times; the contents vary freely.
"""

from __future__ import annotations

import dataclasses
import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from numerics import assert_close
from test_kernels import HYPERPARAMETERS, MLR, PAD, _slots

from pz_sparsecore.core import buffer_format, optimizers
from pz_sparsecore.device import kernels
from pz_sparsecore.device.kernels import contract, ffi
from pz_sparsecore.device.kernels.contract import BufferShape

INT32_MIN = -(2**31)
# A handler's INVALID_ARGUMENT: a ValueError when XLA reports it as the call
# is dispatched, a JaxRuntimeError when it surfaces later.
KERNEL_ERRORS = (ValueError, jax.errors.JaxRuntimeError)
FUZZ = hypothesis.settings(
  max_examples=40,
  derandomize=True,
  deadline=None,
  database=None,
  suppress_health_check=[hypothesis.HealthCheck.too_slow],
)


def _attrs(layout: BufferShape) -> dict[str, int]:
  """The layout keywords of the public kernels."""
  return dict(
    num_segments=layout.num_segments,
    samples_per_segment=layout.samples_per_segment,
    num_partitions=layout.num_partitions,
    rows_per_partition=layout.rows_per_partition,
    partition_begin=layout.partition_begin,
  )


# BufferShape(num_segments, samples_per_segment, num_partitions,
#   rows_per_partition, partition_begin, num_table_partitions, seg_len,
#   rp_stride, dim).
FORWARD_LAYOUTS = (
  BufferShape(1, 4, 2, 4, 0, 2, 24, 8, 3),
  # Window [1, 3) of 4 partitions, a segment length not a multiple of 8,
  # the vectorised forward (dim 16).
  BufferShape(2, 5, 4, 5, 1, 2, 37, 4, 16),
  # The table holds more partitions than the row pointers describe.
  BufferShape(3, 3, 3, 8, 0, 4, 16, 9, 1),
  # The window starts past the last partition: nothing is looked up.
  BufferShape(2, 2, 2, 3, 2, 1, 11, 8, 2),
  # Empty COO buffers.
  BufferShape(2, 3, 2, 2, 0, 2, 0, 8, 4),
)
BACKWARD_LAYOUTS = FORWARD_LAYOUTS[:3]

# (optimizer, hyper-parameters, FTRL's multiply_linear_by_learning_rate).
OPTIMIZER_CASES = [
  (name, HYPERPARAMETERS[name], False) for name in optimizers.REGISTRY
] + [("ftrl", [0.1, -0.5, 0.05, 0.1, 0.2], True)]


def _hostile_ids(layout: BufferShape):
  rpp = layout.rows_per_partition
  return st.one_of(
    st.integers(0, rpp - 1),
    st.integers(0, rpp - 1),
    st.sampled_from(
      [-1, -3, -100_000, rpp, rpp + 1, 2 * rpp + 1, PAD, PAD - 1, INT32_MIN]
    ),
  )


def _hostile_sample_ids(layout: BufferShape):
  spp = layout.samples_per_segment
  return st.one_of(
    st.integers(0, spp - 1),
    st.integers(0, spp - 1),
    st.sampled_from([-1, spp, spp + 1, PAD, INT32_MIN]),
  )


FINITE_GAINS = st.floats(-2.0, 2.0, width=32)
GAINS = st.one_of(FINITE_GAINS, st.sampled_from([0.0, np.nan, np.inf, -np.inf]))


@st.composite
def _row_pointers(draw, layout: BufferShape) -> np.ndarray:
  """One segment's row pointers: well formed or hostile, hostile tails."""
  n, p = layout.seg_len, layout.num_partitions
  wild = st.one_of(
    st.integers(-3, n + 3),
    st.sampled_from([INT32_MIN, -1, 0, n, n + 1, PAD, PAD - 7]),
  )
  if draw(st.integers(0, 2)):  # Well formed two times in three.
    ends = sorted(draw(st.lists(st.integers(0, n), min_size=p, max_size=p)))
  else:
    ends = draw(st.lists(wild, min_size=p, max_size=p))
  tail = draw(st.lists(wild, min_size=layout.rp_stride - p, max_size=16))
  return np.asarray(ends + tail[: layout.rp_stride - p], np.int32)


@dataclasses.dataclass
class Case:
  """Buffers of `layout`; `about_nan`: whether their gains may be NaN or
  infinite (else every gain the kernels may read is finite)."""

  layout: BufferShape
  row_pointers: np.ndarray
  embedding_ids: np.ndarray
  sample_ids: np.ndarray
  gains: np.ndarray
  seed: int
  about_nan: bool = False

  def buffers(self) -> tuple[jax.Array, ...]:
    return tuple(
      jnp.asarray(x)
      for x in (
        self.row_pointers,
        self.embedding_ids,
        self.sample_ids,
        self.gains,
      )
    )


@st.composite
def cases(draw, layouts=FORWARD_LAYOUTS) -> Case:
  layout = draw(st.sampled_from(layouts))
  n = layout.num_segments * layout.seg_len
  rp = np.concatenate(
    [draw(_row_pointers(layout)) for _ in range(layout.num_segments)]
  )
  ids = np.asarray(
    draw(st.lists(_hostile_ids(layout), min_size=n, max_size=n)), np.int32
  )
  if not draw(st.integers(0, 2)):  # Sorted segments one time in three.
    ids = np.sort(ids.reshape(layout.num_segments, -1), axis=1).reshape(-1)
  sids = draw(st.lists(_hostile_sample_ids(layout), min_size=n, max_size=n))
  about_nan = draw(st.booleans())
  gain = GAINS if about_nan else FINITE_GAINS
  gains = draw(st.lists(gain, min_size=n, max_size=n))
  return Case(
    layout,
    rp,
    ids,
    np.asarray(sids, np.int32),
    np.asarray(gains, np.float32),
    draw(st.integers(0, 2**16)),
    about_nan,
  )


def starts_decrease(case: Case) -> bool:
  """Whether some segment's partition starts decrease (partitions overlap).

  Partition ``p`` starts at ``r8(clip(rp[p - 1], 0, seg_len))`` (0 for the
  first): the kernels' contract (``csrc/coo_layout.h``).
  """
  lay = case.layout
  rp = case.row_pointers.reshape(lay.num_segments, lay.rp_stride)
  ends = np.clip(rp[:, : lay.num_partitions].astype(np.int64), 0, lay.seg_len)
  starts = buffer_format.partition_starts(ends)
  return bool(np.any(np.diff(starts, axis=1) < 0))


def _table(layout: BufferShape, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  shape = (layout.num_rows, layout.dim)
  return rng.normal(size=shape).astype(np.float32)


def _activation_grad(layout: BufferShape, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed + 1)
  shape = (layout.num_segments * layout.samples_per_segment, layout.dim)
  return rng.normal(size=shape).astype(np.float32)


@functools.partial(jax.jit, static_argnames=("layout", "impl"))
def _forward(rp, ids, sids, gains, table, *, layout: BufferShape, impl: str):
  return kernels.sparse_dense_matmul(
    rp, ids, sids, gains, table, implementation=impl, **_attrs(layout)
  )


@functools.partial(
  jax.jit, static_argnames=("layout", "opt", "mlr", "clip", "impl")
)
def _backward(
  act, bufs, table, slots, hp, seed=None, *, layout, opt, mlr, clip, impl
):
  return kernels.sparse_dense_matmul_grad(
    act,
    *bufs,
    table,
    slots,
    optimizer=opt,
    hyperparameters=hp,
    clip=clip,
    static_attributes={MLR: mlr} if opt == "ftrl" else None,
    rounding_seed=seed,
    implementation=impl,
    **_attrs(layout),
  )


def _assert_same(got, want, case: Case, name: str = "") -> None:
  """The FFI's output equals the reference's, NaN counted as a mismatch
  unless the case is about NaN (`Case.about_nan`)."""
  # A 16-bit table's values may differ by one rounding step (the handler's
  # float32 update may differ from the reference's in the last bit).
  sixteen = np.asarray(got).dtype.itemsize == 2
  assert_close(
    got,
    want,
    rtol=2.0**-7 if sixteen else 1e-4,
    atol=1e-5,
    err_msg=name,
    allow_nan=case.about_nan,
  )


def refused(result) -> None:
  """Waits for a call under ``jit`` and raises its refusal: the CPU handler's
  error (at dispatch or when ready), or the one a CUDA handler recorded on
  the device (``kernels.raise_device_errors``)."""
  jax.block_until_ready(result)
  kernels.raise_device_errors()


def check_forward(case: Case, dtype=jnp.float32) -> None:
  table = jnp.asarray(_table(case.layout, case.seed), dtype)
  run = functools.partial(_forward, *case.buffers(), table, layout=case.layout)
  if starts_decrease(case):
    with pytest.raises(
      KERNEL_ERRORS, match="row_pointers of segment .* decrease"
    ):
      refused(run(impl="ffi"))
    return
  _assert_same(run(impl="ffi"), run(impl="reference"), case)


def check_backward(
  case: Case, opt: str, hp, mlr: bool, clip, dtype=jnp.float32
) -> None:
  lay = case.layout
  table = _table(lay, case.seed)
  run = functools.partial(
    _backward,
    jnp.asarray(_activation_grad(lay, case.seed)),
    case.buffers(),
    jnp.asarray(table, dtype),
    tuple(jnp.asarray(s) for s in _slots(opt, table, case.seed + 2)),
    jnp.asarray(hp, jnp.float32),
    None if dtype == jnp.float32 else jnp.int32(case.seed),
    layout=lay,
    opt=opt,
    mlr=mlr,
    clip=clip,
  )
  if starts_decrease(case):
    with pytest.raises(
      KERNEL_ERRORS, match="row_pointers of segment .* decrease"
    ):
      refused(run(impl="ffi"))
    return
  got, want = run(impl="ffi"), run(impl="reference")
  names = ("table",) + optimizers.REGISTRY[opt].slot_names
  for name, g, w in zip(
    names, (got[0], *got[1]), (want[0], *want[1]), strict=True
  ):
    _assert_same(g, w, case, name)


@FUZZ
@hypothesis.given(case=cases())
def test_forward_equals_reference_or_raises(case):
  check_forward(case)


@pytest.mark.parametrize(
  "opt,hp,mlr", OPTIMIZER_CASES, ids=[f"{c[0]}-{c[2]}" for c in OPTIMIZER_CASES]
)
@hypothesis.settings(FUZZ, max_examples=12)
@hypothesis.given(
  case=cases(BACKWARD_LAYOUTS),
  clip=st.sampled_from([None, (-0.75, 0.5)]),
)
def test_backward_equals_reference_or_raises(opt, hp, mlr, case, clip):
  check_backward(case, opt, hp, mlr, clip)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize(
  "opt,hp,mlr",
  [c for c in OPTIMIZER_CASES if c[0] in ("sgd", "adagrad", "rowwise_adagrad")],
)
@hypothesis.settings(FUZZ, max_examples=8)
@hypothesis.given(
  case=cases(BACKWARD_LAYOUTS),
  clip=st.sampled_from([None, (-0.75, 0.5)]),
)
def test_16_bit_tables_equal_reference_or_raise(
  dtype, opt, hp, mlr, case, clip
):
  check_forward(case, dtype)
  check_backward(case, opt, hp, mlr, clip, dtype)


def _single_partition_case(ids, *, rpp, num_partitions=1, sids=None):
  """One segment whose first partition holds ``ids`` (later ones empty)."""
  n = len(ids)
  seg_len = buffer_format.round_up(n) + 8
  rp_stride = buffer_format.row_pointers_per_sc(num_partitions)
  layout = BufferShape(1, 4, num_partitions, rpp, 0, num_partitions, seg_len,
                  rp_stride, 4)  # fmt: skip
  pad = seg_len - n
  return Case(
    layout,
    np.full(rp_stride, n, np.int32),
    np.asarray(list(ids) + [PAD] * pad, np.int32),
    np.asarray((sids or [i % 4 for i in range(n)]) + [PAD] * pad, np.int32),
    np.asarray(
      [(1.0, 0.5, -2.0, 0.25)[i % 4] for i in range(n)] + [np.nan] * pad,
      np.float32,
    ),
    seed=n,
  )


REGRESSIONS = {
  # A negative id after valid ones: the binary search assumed sorted ids.
  "0,1,2,-3": _single_partition_case([0, 1, 2, -3], rpp=4),
  # An id past the partition before a valid one: it must not update row 2
  # of the next partition.
  "6,1": _single_partition_case([6, 1], rpp=4, num_partitions=2),
  # A very negative id after a valid one: an offset far before the table.
  "3,-100000": _single_partition_case([3, -100_000], rpp=4),
  "extremes": _single_partition_case(
    [PAD, 2, INT32_MIN, 1, PAD - 1, 0, 3, 3, -1], rpp=4
  ),
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
@pytest.mark.parametrize(
  "opt,hp,mlr", [c for c in OPTIMIZER_CASES if c[0] in ("sgd", "adagrad")]
)
def test_unsorted_regressions(name, opt, hp, mlr):
  case = REGRESSIONS[name]
  check_forward(case)
  check_backward(case, opt, hp, mlr, None)


def test_unsorted_backward_touches_only_valid_rows():
  # [6, 1] with 4 rows per partition: only row 1 of partition 0 moves.
  case = REGRESSIONS["6,1"]
  table = _table(case.layout, 0)
  new, _ = _backward(
    jnp.ones((4, 4), jnp.float32),
    case.buffers(),
    jnp.asarray(table),
    (),
    jnp.asarray([1.0], jnp.float32),
    layout=case.layout,
    opt="sgd",
    mlr=False,
    clip=None,
    impl="ffi",
  )
  changed = np.flatnonzero(np.any(np.asarray(new) != table, axis=1))
  np.testing.assert_array_equal(changed, [1])


def _decreasing_case() -> Case:
  # Partition 2 would start at 8, inside partition 0 ([0, 12)).
  case = _single_partition_case(list(range(4)) * 3, rpp=4, num_partitions=3)
  rp = case.row_pointers.copy()
  rp[:3] = [12, 3, 20]
  return dataclasses.replace(case, row_pointers=rp)


def test_refused_call_changes_nothing_and_next_call_works():
  bad = _decreasing_case()
  assert starts_decrease(bad)
  lay = bad.layout
  table = _table(lay, 5)
  slots = _slots("adagrad", table, 6)

  @functools.partial(jax.jit, donate_argnums=(1, 2))
  def step(bufs, table, slots):
    return kernels.sparse_dense_matmul_grad(
      jnp.ones((4, lay.dim), jnp.float32),
      *bufs,
      table,
      slots,
      optimizer="adagrad",
      hyperparameters=jnp.asarray([0.5], jnp.float32),
      **_attrs(lay),
    )

  state = (jnp.asarray(table), tuple(jnp.asarray(s) for s in slots))
  with pytest.raises(KERNEL_ERRORS, match="segment 0 decrease: partition 2"):
    refused(step(bad.buffers(), *state))
  for got, old in zip((state[0], *state[1]), (table, *slots), strict=True):
    if not got.is_deleted():
      np.testing.assert_array_equal(got, old)
  # The user's next action: a valid batch (partition 1 empty) on fresh state.
  good = dataclasses.replace(
    bad, row_pointers=np.asarray([12, 12, 20, 20, 20, 20, 20, 20], np.int32)
  )
  assert not starts_decrease(good)
  fresh = (jnp.asarray(table), tuple(jnp.asarray(s) for s in slots))
  got = step(good.buffers(), *fresh)
  want = _backward(
    jnp.ones((4, lay.dim), jnp.float32),
    good.buffers(),
    jnp.asarray(table),
    tuple(jnp.asarray(s) for s in slots),
    jnp.asarray([0.5], jnp.float32),
    layout=lay,
    opt="adagrad",
    mlr=False,
    clip=None,
    impl="reference",
  )
  _assert_same(got[0], want[0], good)
  _assert_same(got[1][0], want[1][0], good)


def _check_coo(case: Case) -> int:
  table = jnp.asarray(_table(case.layout, 0))
  shape = contract.check_buffers(*case.buffers(), table, **_attrs(case.layout))
  return int(ffi.check_coo(*case.buffers(), table, shape))


@FUZZ
@hypothesis.given(case=cases())
def test_check_coo_counts_unsorted_slices(case):
  lay = case.layout
  if starts_decrease(case):
    with pytest.raises(KERNEL_ERRORS, match="decrease"):
      _check_coo(case)
    return
  rp = case.row_pointers.reshape(lay.num_segments, lay.rp_stride)
  unsorted = 0
  for k in range(lay.num_segments):
    begin = 0
    for p in range(lay.num_partitions):
      end = int(np.clip(rp[k, p], 0, lay.seg_len))
      ids = case.embedding_ids[k * lay.seg_len :][begin:end].astype(np.int64)
      local = p - lay.partition_begin
      if 0 <= local < lay.num_table_partitions and np.any(np.diff(ids) < 0):
        unsorted += 1
      begin = buffer_format.round_up(end)
  assert _check_coo(case) == unsorted


def test_output_rows_beyond_int32_are_refused():
  # Bypasses the Python contract (the input pass has a scalar result, so no
  # output of 2**33 rows is allocated).
  case = REGRESSIONS["0,1,2,-3"]
  table = jnp.zeros((4, 4), jnp.float32)
  shape = contract.check_buffers(*case.buffers(), table, **_attrs(case.layout))
  huge = dataclasses.replace(shape, samples_per_segment=2**33)
  with pytest.raises(KERNEL_ERRORS, match="exceeds 2147483647 output rows"):
    jax.block_until_ready(ffi.check_coo(*case.buffers(), table, huge))
  assert int(ffi.check_coo(*case.buffers(), table, shape)) == 1
