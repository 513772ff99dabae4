"""The CUDA handlers on a GPU: against the references, on hostile buffers, end
to end in the layer, the trainer and the Shakespeare job.

Every test here needs a GPU that JAX sees and an extension built with the
CUDA handlers; without one the whole module is skipped, with the reason.
Buffers and tables are placed on the GPU explicitly; the references run on
the CPU (numpy or the pure-JAX reference).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_kernel_fuzz as fuzz
from numerics import assert_close
from test_kernels import HYPERPARAMETERS, MLR, make_buffers

import pz_sparsecore as pzsc
from pz_sparsecore.core import optimizers
from pz_sparsecore.device import kernels
from pz_sparsecore.device.kernels import ffi


def _gpus() -> list:
  try:
    return jax.devices("gpu")
  except RuntimeError:
    return []


GPUS = _gpus()
pytestmark = [
  pytest.mark.gpu,
  pytest.mark.skipif(not GPUS, reason="no GPU visible to JAX"),
  pytest.mark.skipif(
    bool(GPUS) and not ffi.available(ffi.FORWARD_TARGET, "cuda"),
    reason="the extension was built without the CUDA handlers",
  ),
]


def _on_gpu(x):
  return jax.device_put(x, GPUS[0])


def _on_cpu(x):
  return jax.device_put(x, jax.devices("cpu")[0])


def test_backend_info_reports_cuda_handlers():
  info = pzsc.backend_info()
  assert info.cuda_build
  for label, platforms in info.implementations.items():
    # A custom optimizer's update is its JAX function on every platform.
    want = "reference" if label == "grad custom" else "ffi"
    assert platforms["cuda"] == want == platforms["cpu"], label


# --- handlers against the references ------------------------------------------


def _zipf_batch(seed, *, batch, ids_per_sample, vocab):
  """Ragged-free [batch, k] ids: Zipf ranks (hot rows with long runs)."""
  rng = np.random.default_rng(seed)
  cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.1)
  ranks = np.searchsorted(cdf, rng.random((batch, ids_per_sample)) * cdf[-1])
  return np.minimum(ranks, vocab - 1).astype(np.int64)


def _buffers_from_ids(ids, *, vocab, dim, num_sc):
  """The public preprocessing of ``ids`` for one device with ``num_sc``."""
  batch, k = ids.shape
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.zeros,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    combiner="sum",
    max_ids_per_partition=batch * k,
    max_unique_ids_per_partition=batch * k,
  )
  feature = pzsc.FeatureSpec(
    name="f",
    table_spec=table,
    input_shape=(batch, k),
    output_shape=(batch, dim),
  )
  specs = pzsc.prepare_feature_specs_for_training(
    {"f": feature}, global_device_count=1, num_sc_per_device=num_sc
  )
  inputs, _ = pzsc.preprocess_sparse_dense_matmul_input(
    {"f": ids}, None, specs, 1, 1, num_sc_per_device=num_sc
  )
  stacked = next(iter(inputs.lhs_row_pointers))
  bufs = tuple(
    getattr(inputs, f)[stacked]
    for f in (
      "lhs_row_pointers",
      "lhs_embedding_ids",
      "lhs_sample_ids",
      "lhs_gains",
    )
  )
  padded = specs["f"].table_spec.stacked_table_spec.stack_vocab_size
  return bufs, padded


LAYOUT_CASES = [
  # (seed, batch, ids per sample, vocab, dim, SparseCores): dim 64 takes the
  # vectorised forward, dim 7 the scalar one, dim 200 two register chunks.
  (0, 512, 16, 1000, 64, 4),
  (1, 256, 8, 300, 7, 2),
  (2, 128, 32, 5000, 200, 1),
]


def _layout(bufs, padded, batch, num_sc):
  num_partitions = num_sc
  return dict(
    num_segments=num_sc,
    samples_per_segment=batch // num_sc,
    num_partitions=num_partitions,
    rows_per_partition=padded // num_partitions,
  )


@pytest.mark.parametrize("case", LAYOUT_CASES)
@pytest.mark.parametrize("quantization", [None, (-0.5, 0.75, 6)])
def test_forward_matches_reference(case, quantization):
  seed, batch, k, vocab, dim, num_sc = case
  ids = _zipf_batch(seed, batch=batch, ids_per_sample=k, vocab=vocab)
  bufs, padded = _buffers_from_ids(ids, vocab=vocab, dim=dim, num_sc=num_sc)
  layout = _layout(bufs, padded, batch, num_sc)
  table = np.random.default_rng(seed).normal(size=(padded, dim))
  table = table.astype(np.float32)
  fwd = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul, quantization=quantization, **layout
    ),
    static_argnames="implementation",
  )
  got = fwd(*map(_on_gpu, bufs), _on_gpu(table), implementation="ffi")
  assert got.devices() == {GPUS[0]}
  want = fwd(*map(_on_cpu, bufs), _on_cpu(table), implementation="reference")
  assert_close(np.asarray(got), np.asarray(want), 1e-5, 1e-5)


def _step(optimizer, static, layout):
  def step(act, bufs, table, slots, hp, implementation, seed=None):
    return kernels.sparse_dense_matmul_grad(
      act,
      *bufs,
      table,
      slots,
      optimizer=optimizer,
      hyperparameters=hp,
      clip=(-0.5, 0.5),
      static_attributes=static,
      rounding_seed=seed,
      implementation=implementation,
      **layout,
    )

  return jax.jit(step, static_argnames="implementation")


@pytest.mark.parametrize("case", LAYOUT_CASES)
@pytest.mark.parametrize("optimizer", sorted(optimizers.REGISTRY))
def test_fused_update_matches_reference_and_is_deterministic(case, optimizer):
  seed, batch, k, vocab, dim, num_sc = case
  ids = _zipf_batch(seed, batch=batch, ids_per_sample=k, vocab=vocab)
  _check_update(ids, vocab, dim, num_sc, optimizer, seed)


@pytest.mark.parametrize("dim", [32, 200])
@pytest.mark.parametrize("optimizer", sorted(optimizers.REGISTRY))
def test_hot_rows_of_every_optimizer_match_reference(optimizer, dim):
  """Row 0 in every sample (128 chunks: a block sums them), 40 warm rows
  (4 chunks each: one warp adds them) and cold rows. The activation
  gradient's values are multiples of 1/8, so that every sum is exact in
  float32 whatever its order: a float32 sum of 8,192 normal values is off by
  about 5e-4 (sequentially, as the reference adds), which Adagrad-like rules
  amplify (g / sqrt(a + g^2) where g is near 0) past any fixed tolerance."""
  batch = 8192
  ids = np.stack(
    [np.zeros(batch), 1 + np.arange(batch) % 40, np.arange(batch) % 997], 1
  ).astype(np.int64)
  _check_update(ids, 1000, dim, 1, optimizer, 11, eighths=True)


def _check_update(ids, vocab, dim, num_sc, optimizer, seed, eighths=False):
  """The fused update of ``optimizer`` on the GPU against the reference on
  the CPU, and the same bits from a second call (``eighths``: activation
  gradient values in {-1, -7/8, ..., 1})."""
  batch = ids.shape[0]
  bufs, padded = _buffers_from_ids(ids, vocab=vocab, dim=dim, num_sc=num_sc)
  layout = _layout(bufs, padded, batch, num_sc)
  rng = np.random.default_rng(seed + 7)
  table = rng.normal(size=(padded, dim)).astype(np.float32) * 0.1
  act = rng.normal(size=(batch, dim)).astype(np.float32)
  if eighths:
    act = (rng.integers(-8, 9, size=(batch, dim)) / 8).astype(np.float32)
  # Each slot at its width (a row-wise accumulator: [rows, 1]).
  slots = tuple(
    rng.uniform(0.1, 1.0, size=(padded, slot.width(dim))).astype(np.float32)
    for slot in optimizers.REGISTRY[optimizer].slots
  )
  hp = np.asarray(HYPERPARAMETERS[optimizer], np.float32)
  static = {MLR: True} if optimizer == "ftrl" else None
  step = _step(optimizer, static, layout)
  want = step(
    _on_cpu(act),
    tuple(map(_on_cpu, bufs)),
    _on_cpu(table),
    tuple(map(_on_cpu, slots)),
    _on_cpu(hp),
    implementation="reference",
  )
  gpu_args = (
    _on_gpu(act),
    tuple(map(_on_gpu, bufs)),
    _on_gpu(table),
    tuple(map(_on_gpu, slots)),
    _on_gpu(hp),
  )
  got = step(*gpu_args, implementation="ffi")
  again = step(*gpu_args, implementation="ffi")
  for g, w, a in zip(
    jax.tree.leaves(got),
    jax.tree.leaves(want),
    jax.tree.leaves(again),
    strict=True,
  ):
    assert_close(np.asarray(g), np.asarray(w), 1e-4, 1e-4)
    # Deterministic: the same call gives the same bits.
    np.testing.assert_array_equal(np.asarray(g), np.asarray(a))


def test_hot_row_longer_than_a_warp_run():
  """One row referenced by every sample (a block-summed run) and cold rows."""
  batch, dim, vocab = 4096, 32, 64
  ids = np.zeros((batch, 2), np.int64)
  ids[:, 1] = np.arange(batch) % vocab
  bufs, padded = _buffers_from_ids(ids, vocab=vocab, dim=dim, num_sc=1)
  layout = _layout(bufs, padded, batch, 1)
  rng = np.random.default_rng(3)
  table = rng.normal(size=(padded, dim)).astype(np.float32)
  act = rng.normal(size=(batch, dim)).astype(np.float32)
  hp = np.asarray(HYPERPARAMETERS["adagrad"], np.float32)
  slots = (np.full((padded, dim), 0.1, np.float32),)
  step = _step("adagrad", None, layout)
  want = step(
    act, bufs, table, slots, hp, implementation="reference"
  )  # default device may be the GPU: compare to numpy below as well
  got = step(
    _on_gpu(act),
    tuple(map(_on_gpu, bufs)),
    _on_gpu(table),
    tuple(map(_on_gpu, slots)),
    _on_gpu(hp),
    implementation="ffi",
  )
  # Row 0's gradient: the sum over all samples (both columns of sample
  # 64 m hit row 0).
  row0 = act.astype(np.float64).sum(0) + act[::vocab].astype(np.float64).sum(0)
  acc = 0.1 + row0**2
  expect = np.clip(table[0] - hp[0] * row0 / np.sqrt(acc), -0.5, 0.5)
  assert_close(np.asarray(got[0])[0], expect, 1e-4, 1e-4)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert_close(np.asarray(g), np.asarray(w), 1e-4, 1e-4)


@pytest.mark.parametrize("dim", [64, 7])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("optimizer", sorted(optimizers.REGISTRY))
def test_16_bit_tables_on_gpu_match_the_cpu_handler(optimizer, dtype, dim):
  """Forward and fused update of a bfloat16 / float16 table on the GPU
  against the CPU handler (the same random bits: equal but where the two
  float32 updates differ in the last bit, then by one 16-bit step), and the
  same bits from a second GPU call (the update; the forward's sums are
  not deterministic on the GPU)."""
  batch, k, vocab, num_sc = 512, 16, 1000, 4
  ids = _zipf_batch(5, batch=batch, ids_per_sample=k, vocab=vocab)
  bufs, padded = _buffers_from_ids(ids, vocab=vocab, dim=dim, num_sc=num_sc)
  layout = _layout(bufs, padded, batch, num_sc)
  rng = np.random.default_rng(9)
  table = (rng.normal(size=(padded, dim)) * 0.1).astype(np.float32)
  table = np.asarray(jnp.asarray(table, dtype))
  act = rng.normal(size=(batch, dim)).astype(np.float32)
  slots = tuple(
    rng.uniform(0.1, 1.0, size=(padded, slot.width(dim))).astype(np.float32)
    for slot in optimizers.REGISTRY[optimizer].slots
  )
  hp = np.asarray(HYPERPARAMETERS[optimizer], np.float32)
  static = {MLR: True} if optimizer == "ftrl" else None

  update = _step(optimizer, static, layout)
  forward = jax.jit(
    functools.partial(
      kernels.sparse_dense_matmul, implementation="ffi", **layout
    )
  )

  def run(put):
    a, b, t, s, h, seed = jax.tree.map(
      put, (act, tuple(bufs), table, slots, hp, np.int32(17))
    )
    return forward(*b, t), update(a, b, t, s, h, "ffi", seed)

  want_out, (want_t, want_s) = run(_on_cpu)
  got_out, (got_t, got_s) = run(_on_gpu)
  again_out, (again_t, _) = run(_on_gpu)
  assert got_t.dtype == dtype
  assert_close(np.asarray(got_out), np.asarray(want_out), 1e-5, 1e-5)
  for g, w in zip(got_s, want_s, strict=True):
    assert_close(np.asarray(g), np.asarray(w), 1e-4, 1e-5)
  bits = lambda x: np.asarray(x).view(np.uint16).astype(np.int64)  # noqa: E731
  diff = np.abs(bits(got_t) - bits(want_t))
  assert diff.max() <= 1 and (diff == 0).mean() > 0.98
  np.testing.assert_array_equal(bits(got_t), bits(again_t))
  # The forward adds with float atomics: its last bits vary between calls.
  assert_close(np.asarray(again_out), np.asarray(got_out), 1e-6, 1e-6)


# --- hostile buffers ----------------------------------------------------------


def test_fuzz_forward_on_gpu():
  with jax.default_device(GPUS[0]):
    fuzz.test_forward_equals_reference_or_raises()


@pytest.mark.parametrize("opt,hp,mlr", fuzz.OPTIMIZER_CASES)
def test_fuzz_backward_on_gpu(opt, hp, mlr):
  with jax.default_device(GPUS[0]):
    fuzz.test_backward_equals_reference_or_raises(opt=opt, hp=hp, mlr=mlr)


def test_refused_call_changes_nothing_and_next_call_works_on_gpu():
  with jax.default_device(GPUS[0]):
    fuzz.test_refused_call_changes_nothing_and_next_call_works()
    fuzz.test_unsorted_backward_touches_only_valid_rows()


def test_random_buffers_match_truth_on_gpu():
  """Hand-built buffers with duplicates, empty rows and shard-boundary ids."""
  for seed in range(4):
    b = make_buffers(seed, num_segments=3, num_partitions=4)
    table = np.random.default_rng(seed).normal(
      size=(b.num_partitions * b.rows_per_partition, 16)
    )
    table = table.astype(np.float32)
    want = np.zeros((b.num_segments * b.samples_per_segment, 16), np.float64)
    for k, p, row, s, g in b.entries:
      want[k * b.samples_per_segment + s] += (
        g * table[p * b.rows_per_partition + row]
      )
    with jax.default_device(GPUS[0]):
      got = kernels.sparse_dense_matmul(
        *b.args(), jnp.asarray(table), implementation="ffi", **b.layout()
      )
    assert_close(np.asarray(got), want, 1e-5, 1e-5)


def test_refused_call_under_jit_changes_nothing_and_is_raised_when_ready():
  """Row pointers whose starts decrease, under jit: no host synchronisation,
  a zero output and an unchanged table, the error raised (the CPU handler's
  words) by raise_device_errors once the results are ready, then cleared;
  the next valid call works."""
  bad = fuzz._decreasing_case()
  lay = bad.layout
  table = jnp.asarray(fuzz._table(lay, 3))
  fwd = jax.jit(
    lambda *a: kernels.sparse_dense_matmul(
      *a, implementation="ffi", **fuzz._attrs(lay)
    )
  )
  with jax.default_device(GPUS[0]):
    got = fwd(*bad.buffers(), table)
    jax.block_until_ready(got)
    np.testing.assert_array_equal(np.asarray(got), 0.0)
    with pytest.raises(ValueError, match="segment 0 decrease: partition 2"):
      kernels.raise_device_errors()
    kernels.raise_device_errors()  # Cleared: nothing to raise.
    good = fuzz.dataclasses.replace(
      bad, row_pointers=np.asarray([12, 12, 20, 20, 20, 20, 20, 20], np.int32)
    )
    got = fwd(*good.buffers(), table)
    want = fwd(*map(_on_cpu, good.buffers()), _on_cpu(table))
    assert_close(np.asarray(got), np.asarray(want), 1e-6, 1e-6)
    kernels.raise_device_errors()


def test_nan_through_the_quantized_lookup_and_f2a_on_gpu():
  import test_kernels  # noqa: PLC0415
  import test_quantization  # noqa: PLC0415

  with jax.default_device(GPUS[0]):
    test_quantization.test_nan_in_a_quantized_table_reaches_the_output("ffi")
    test_kernels.test_f2a_keeps_a_nan_local_step("ffi")


def test_adagrad_zero_accumulator_guard_on_gpu():
  import test_kernels  # noqa: PLC0415

  with jax.default_device(GPUS[0]):
    test_kernels.test_adagrad_zero_accumulator_guard("ffi")


def test_minibatched_buffers_on_gpu():
  """Minibatched steps (limits that split every batch) on one GPU with two
  SparseCores: activations and trained tables as numpy; then the guarded
  trainer refuses an overflowing minibatched step and trains on."""
  import test_minibatching_layer as mb  # noqa: PLC0415

  assert jax.default_backend() == "gpu"
  mb.test_trainer_steps_on_minibatches_equal_numpy(1, 2, "auto", 6)
  mb.check_guarded_minibatched_step(1, 2, 6)


# --- the drop-in lookup, its buffers built on the GPU -------------------------


@pytest.fixture(scope="module")
def gpu_mesh():
  return jax.sharding.Mesh(np.array(GPUS[:1]).reshape(1, 1), ("data", "model"))


@pytest.mark.parametrize(
  "name",
  [
    "test_lookup_matches_embedding_lookup_on_any_axes",
    "test_device_buffers_equal_host_buffers",
    "test_bad_ids_are_refused_then_the_next_call_works",
    "test_trainer_learns_as_the_dense_model",
    "test_sampler_runs_on_the_converted_model",
  ],
)
def test_sparsecore_lookup_on_gpu(name, gpu_mesh):
  """test_lookup.py's tests of SparseCoreLookup on a one-GPU mesh."""
  import test_lookup  # noqa: PLC0415

  getattr(test_lookup, name)(gpu_mesh)


def test_converted_transformer_on_gpu(gpu_mesh):
  import test_lookup  # noqa: PLC0415

  transformer = test_lookup.transformer.__wrapped__(gpu_mesh)
  for shape in test_lookup.SHAPES:
    test_lookup.test_converted_transformer_equals_dense(transformer, shape)


# --- end to end ---------------------------------------------------------------


def test_trainer_on_gpu_matches_numpy_optimizers():
  """The trainer's steps on one GPU, every optimizer, against numpy."""
  import test_training  # noqa: PLC0415

  assert jax.default_backend() == "gpu"
  model = test_training.build_model(1, 1)
  for table in model.embed.tables.values():
    assert {d.platform for d in table.value.data_array.devices()} == {"gpu"}
  test_training.test_trainer_matches_numpy_optimizers(1, 1, "auto")


def test_shakespeare_job_runs_on_the_gpu(tmp_path):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  # This process already holds XLA's preallocated share of the GPU; the job
  # allocates as it goes (with its own 75% share it ran out of memory in
  # CUB's first launch).
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "pz_sparsecore",
      "shakespeare",
      "--steps",
      "60",
      "--no-progress",
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "on 1 gpu device" in out.stdout, out.stdout
