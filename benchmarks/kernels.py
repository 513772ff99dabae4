"""Benchmark of the CPU kernels against torch, FBGEMM and plain JAX.

Run: ``.venv/bin/python benchmarks/kernels.py`` (prints two tables);
``--repeats N`` sets the timed repeats (default 10, or ``PZSC_BENCH_REPEATS``)
and ``--skip-peers`` times only ours.

Workloads: a ``[vocab, 64]`` f32 table, a batch of 4096 samples with 32 ids
each (sum combiner), ids uniform or Zipf(1.05); vocab 1M, and 8M for the
uniform case. Each line times one step, median of several, after warm-up:

* ``fwd``: the lookup only.
* ``fwd+bwd sgd`` / ``fwd+bwd adagrad``: lookup, then a fixed activation
  gradient applied to the table (in place where the library allows it):
  ours = forward + fused backward (donated table); torch = EmbeddingBag with
  sparse gradients + ``optim.SGD`` / ``optim.Adagrad``; FBGEMM = the
  table-batched embedding with fused exact SGD / exact row-wise Adagrad;
  plain JAX = ``jnp.take`` + ``segment_sum`` with the dense ``jax.grad``
  (``.at[].add``) and a dense optimizer step over the whole table (donated).

Our buffers (1 device, 1 segment, 1 partition, entries sorted by (row,
sample), duplicates merged) are built once per workload outside the timing,
as the host preprocessor would. GB/s counts the embedding bytes a step must
move: the looked-up rows, plus (backward) each touched row and its slots read
and written once. Peers' ratio = their time / our time.

The second table puts the fused backward's input pass (row pointer check,
sortedness scan of the ids; target ``pzsc_check_coo``, the same code the
backward runs before its first write) beside the backward alone (``bwd``,
no forward), on the same buffers in the same run: once timed alone (its
buffers warm in cache) and once right after each backward (its buffers
evicted by the backward's table traffic). Each is its own XLA call, so both
figures include one call's dispatch (about 8 us here): upper bounds of what
the pass adds to the fused backward, where it reads the ids that the row
sums read next.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore import buffer_format, kernels
from pz_sparsecore.kernels import contract, ffi

BATCH = 4096
IDS_PER_SAMPLE = 32
DIM = 64
LEARNING_RATE = 0.01
REPEATS = int(os.environ.get("PZSC_BENCH_REPEATS", "10"))


def make_ids(vocab: int, dist: str, rng: np.random.Generator) -> np.ndarray:
  """``[BATCH, IDS_PER_SAMPLE]`` int64 ids, uniform or Zipf(1.05) ranked."""
  n = BATCH * IDS_PER_SAMPLE
  if dist == "uniform":
    ids = rng.integers(0, vocab, n)
  else:
    # Bounded Zipf over ranks 1..vocab, ranks mapped to shuffled rows.
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.05)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    ids = rng.permutation(vocab)[np.minimum(ranks, vocab - 1)]
  return ids.reshape(BATCH, IDS_PER_SAMPLE).astype(np.int64)


def build_buffers(ids: np.ndarray) -> tuple[np.ndarray, ...]:
  """One segment, one partition: sorted (row, sample), duplicates merged."""
  samples = np.repeat(np.arange(BATCH, dtype=np.int64), ids.shape[1])
  key = np.unique(ids.reshape(-1) * BATCH + samples, return_counts=True)
  keys, counts = key
  n = keys.shape[0]
  seg_len = buffer_format.round_up(n)
  emb = np.full(seg_len, buffer_format.PAD_ID, np.int32)
  sid = np.full(seg_len, buffer_format.PAD_ID, np.int32)
  gains = np.full(seg_len, buffer_format.PAD_GAIN, np.float32)
  emb[:n] = keys // BATCH
  sid[:n] = keys % BATCH
  gains[:n] = counts
  row_pointers = np.full(buffer_format.row_pointers_per_sc(1), n, np.int32)
  return row_pointers, emb, sid, gains


def timeit(fn: Callable[[], object], repeats: int | None = None) -> float:
  """Best wall time of ``fn()`` in ms, after two warm-up calls.

  The best (not the median) of the repeats, because the machine may be
  shared: other processes only ever add time.
  """
  repeats = repeats or REPEATS
  for _ in range(2):
    fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return 1e3 * min(times)


# --- ours -------------------------------------------------------------------


def timeit_pair(
  first: Callable[[], object], second: Callable[[], object]
) -> tuple[float, float]:
  """Best wall times (ms) of ``first()`` and of ``second()`` run right after.

  Like :func:`timeit`, after two warm-up rounds.
  """
  times = ([], [])
  for i in range(REPEATS + 2):
    for fn, out in zip((first, second), times, strict=True):
      t = time.perf_counter()
      fn()
      if i >= 2:
        out.append(time.perf_counter() - t)
  return 1e3 * min(times[0]), 1e3 * min(times[1])


def input_pass(bufs, table, layout) -> Callable[[jax.Array], object]:
  """``f(table)`` runs the backward's input pass on these buffers (blocking).

  The pass reads only the table's shape; ``table`` is the current one (the
  backward donates its input).
  """
  shape = contract.check_buffers(*bufs, table, partition_begin=0, **layout)
  check = jax.jit(lambda *operands: ffi.check_coo(*operands, shape))
  if int(check(*bufs, table)) != 0:
    raise AssertionError("the benchmark's buffers are not sorted")
  return lambda table: check(*bufs, table).block_until_ready()


def bench_ours(table_np, ids, act_grad_np):
  bufs = tuple(jnp.asarray(b) for b in build_buffers(ids))
  layout = dict(
    num_segments=1,
    samples_per_segment=BATCH,
    num_partitions=1,
    rows_per_partition=table_np.shape[0],
  )
  fwd = jax.jit(functools.partial(kernels.sparse_dense_matmul, **layout))
  table = jnp.asarray(table_np)
  res = {"fwd": timeit(lambda: fwd(*bufs, table).block_until_ready())}
  act_grad = jnp.asarray(act_grad_np)

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnums=(2,))
  def step(table, slots, optimizer, hp, act_grad, bufs):
    out = kernels.sparse_dense_matmul(*bufs, table, **layout)
    new_table, new_slots = kernels.sparse_dense_matmul_grad(
      act_grad + 0 * out[:1],
      *bufs,
      table,
      slots,
      optimizer=optimizer,
      hyperparameters=hp,
      **layout,
    )
    return new_table, new_slots

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnums=(2,))
  def backward(table, slots, optimizer, hp, act_grad, bufs):
    return kernels.sparse_dense_matmul_grad(
      act_grad,
      *bufs,
      table,
      slots,
      optimizer=optimizer,
      hyperparameters=hp,
      **layout,
    )

  hp = jnp.asarray([LEARNING_RATE], jnp.float32)
  check = input_pass(bufs, table, layout)
  res["input pass"] = timeit(lambda: check(table))
  for opt in ("sgd", "adagrad"):
    state = [table, () if opt == "sgd" else (jnp.full_like(table, 0.1),)]
    runs = {}
    for key, fn in ((opt, step), (f"bwd {opt}", backward)):

      def run(state=state, opt=opt, fn=fn):
        state[0], state[1] = fn(state[0], state[1], opt, hp, act_grad, bufs)
        state[0].block_until_ready()

      runs[key] = run
    res[opt] = timeit(runs[opt])
    res[f"bwd {opt}"], res[f"input pass after {opt}"] = timeit_pair(
      runs[f"bwd {opt}"], lambda state=state: check(state[0])
    )
    table = state[0]
    del state
  return res


# --- plain JAX --------------------------------------------------------------


def bench_jax(table_np, ids, act_grad_np):
  flat = jnp.asarray(ids.reshape(-1).astype(np.int32))
  seg = jnp.asarray(np.repeat(np.arange(BATCH, dtype=np.int32), ids.shape[1]))

  def lookup(table, flat, seg):
    rows = jnp.take(table, flat, axis=0)
    return jax.ops.segment_sum(rows, seg, num_segments=BATCH)

  fwd = jax.jit(lookup)
  table = jnp.asarray(table_np)
  res = {"fwd": timeit(lambda: fwd(table, flat, seg).block_until_ready())}
  act_grad = jnp.asarray(act_grad_np)

  def loss(table, act_grad, flat, seg):
    return jnp.vdot(lookup(table, flat, seg), act_grad)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def sgd(table, *args):
    return table - LEARNING_RATE * jax.grad(loss)(table, *args)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def adagrad(table, acc, *args):
    g = jax.grad(loss)(table, *args)
    acc = acc + g * g
    return table - LEARNING_RATE * g / jnp.sqrt(acc), acc

  state = [table]
  args = (act_grad, flat, seg)

  def run_sgd():
    state[0] = sgd(state[0], *args)
    state[0].block_until_ready()

  res["sgd"] = timeit(run_sgd, max(3, REPEATS // 3))
  state.append(jnp.full_like(state[0], 0.1))

  def run_adagrad():
    state[0], state[1] = adagrad(state[0], state[1], *args)
    state[0].block_until_ready()

  res["adagrad"] = timeit(run_adagrad, max(3, REPEATS // 3))
  return res


# --- torch / FBGEMM ---------------------------------------------------------


def _import_torch():
  try:
    import torch
  except ImportError as e:
    return None, f"torch not installed ({e})"
  return torch, None


def bench_torch(table_np, ids, act_grad_np):
  torch, _ = _import_torch()
  torch.set_num_threads(os.cpu_count() or 1)
  flat = torch.from_numpy(ids.reshape(-1))
  offsets = torch.arange(0, flat.numel(), ids.shape[1], dtype=torch.int64)
  grad_out = torch.from_numpy(act_grad_np)
  res = {}
  for opt in ("fwd", "sgd", "adagrad"):
    bag = torch.nn.EmbeddingBag.from_pretrained(
      torch.from_numpy(table_np), freeze=False, mode="sum", sparse=True
    )
    if opt == "fwd":
      with torch.no_grad():
        res[opt] = timeit(lambda bag=bag: bag(flat, offsets))
      continue
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.Adagrad
    kw = {"initial_accumulator_value": 0.1} if opt == "adagrad" else {}
    optim = cls(bag.parameters(), lr=LEARNING_RATE, **kw)

    def run(bag=bag, optim=optim):
      optim.zero_grad()
      bag(flat, offsets).backward(grad_out)
      optim.step()

    res[opt] = timeit(run)
    del bag, optim
    gc.collect()
  return res


def _import_fbgemm():
  torch, err = _import_torch()
  if torch is None:
    return None, err
  try:
    import fbgemm_gpu  # noqa: F401
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
      EmbeddingLocation,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
      ComputeDevice,
      SplitTableBatchedEmbeddingBagsCodegen,
    )
  except Exception as e:  # noqa: BLE001 - any import failure skips FBGEMM.
    return None, f"fbgemm-gpu-cpu unavailable ({type(e).__name__}: {e})"
  return (
    torch,
    EmbeddingLocation,
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
    EmbOptimType,
  ), None


def bench_fbgemm(table_np, ids, act_grad_np):
  mods, _ = _import_fbgemm()
  torch, Location, Device, Tbe, OptimType = mods
  torch.set_num_threads(os.cpu_count() or 1)
  vocab = table_np.shape[0]
  flat = torch.from_numpy(ids.reshape(-1))
  offsets = torch.arange(0, flat.numel() + 1, ids.shape[1], dtype=torch.int64)
  grad_out = torch.from_numpy(act_grad_np)
  res = {}
  for opt, otype in (
    ("fwd", OptimType.EXACT_SGD),
    ("sgd", OptimType.EXACT_SGD),
    ("adagrad", OptimType.EXACT_ROWWISE_ADAGRAD),
  ):
    tbe = Tbe(
      [(vocab, DIM, Location.HOST, Device.CPU)],
      optimizer=otype,
      learning_rate=LEARNING_RATE,
      eps=1e-8,
    )
    with torch.no_grad():
      tbe.split_embedding_weights()[0].copy_(torch.from_numpy(table_np))
    if opt == "fwd":
      with torch.no_grad():
        res[opt] = timeit(lambda tbe=tbe: tbe(flat, offsets))
    else:

      def run(tbe=tbe):
        tbe(flat, offsets).backward(grad_out)

      res[opt] = timeit(run)
    del tbe
    gc.collect()
  return res


# --- driver -----------------------------------------------------------------


def touched_bytes(ids: np.ndarray, op: str) -> int:
  row = DIM * 4
  lookups = ids.size
  if op == "fwd":
    return lookups * row
  unique = np.unique(ids).size
  slots = 0 if op == "sgd" else 1
  return lookups * row + unique * row * 2 * (1 + slots)


def input_pass_lines(label: str, ours: dict[str, float]) -> list[str]:
  """Rows of the input-pass table for one workload."""
  lines = []
  for opt in ("sgd", "adagrad"):
    bwd = ours[f"bwd {opt}"]
    warm, cold = ours["input pass"], ours[f"input pass after {opt}"]
    lines.append(
      f"{label:<13}{opt:<9}{bwd:>9.2f}{warm:>11.3f}{100 * warm / bwd:>7.2f}"
      f"{cold:>13.3f}{100 * cold / bwd:>7.2f}"
    )
  return lines


def _parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=REPEATS)
  parser.add_argument("--skip-peers", action="store_true")
  return parser.parse_args()


def main() -> None:
  global REPEATS
  args = _parse_args()
  REPEATS = args.repeats
  workloads = [
    (1_000_000, "uniform"),
    (1_000_000, "zipf"),
    (8_000_000, "uniform"),
  ]
  peers = [
    ("torch EmbeddingBag", bench_torch, _import_torch),
    ("FBGEMM TBE", bench_fbgemm, _import_fbgemm),
    ("plain JAX", bench_jax, None),
  ]
  if args.skip_peers:
    peers = []
  notes = []
  for name, _, probe in peers:
    if probe is not None and (err := probe()[1]) is not None:
      notes.append(f"{name}: skipped, {err}")
  skipped = {n.split(":")[0] for n in notes}
  rng = np.random.default_rng(0)
  header = (
    f"{'workload':<13}{'op':<17}{'impl':<20}{'ms':>9}{'Mlookup/s':>11}"
    f"{'GB/s':>8}{'x ours':>8}"
  )
  lines = [header, "-" * len(header)]
  check_header = (
    f"{'workload':<13}{'bwd':<9}{'bwd ms':>9}{'pass ms':>11}{'%':>7}"
    f"{'after bwd ms':>13}{'%':>7}"
  )
  check_lines = [check_header, "-" * len(check_header)]
  for vocab, dist in workloads:
    ids = make_ids(vocab, dist, rng)
    table = rng.normal(size=(vocab, DIM)).astype(np.float32) * 0.01
    act_grad = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    results = {"ours": bench_ours(table, ids, act_grad)}
    gc.collect()
    for name, fn, _ in peers:
      if name not in skipped:
        results[name] = fn(table, ids, act_grad)
        gc.collect()
    label = f"{vocab // 1_000_000}M {dist}"
    check_lines += input_pass_lines(label, results["ours"])
    for op in ("fwd", "sgd", "adagrad"):
      ours = results["ours"][op]
      op_name = "fwd" if op == "fwd" else f"fwd+bwd {op}"
      for impl, res in results.items():
        ms = res[op]
        lines.append(
          f"{label:<13}{op_name:<17}{impl:<20}{ms:>9.2f}"
          f"{ids.size / ms / 1e3:>11.1f}"
          f"{touched_bytes(ids, op) / ms / 1e6:>8.1f}"
          f"{ms / ours:>8.2f}"
        )
    del table, results
    gc.collect()
  print(
    f"batch {BATCH} x {IDS_PER_SAMPLE} ids, dim {DIM}, f32, "
    f"{os.cpu_count()} CPU threads, jax {jax.__version__}"
  )
  print("\n".join(lines))
  print("\nThe fused backward's input pass (pzsc_check_coo) vs the backward:")
  print("\n".join(check_lines))
  for note in notes:
    print(note, file=sys.stderr)


if __name__ == "__main__":
  main()
