"""Benchmark of the CPU kernels against torch, FBGEMM and plain JAX.

Run: ``.venv/bin/python benchmarks/kernels.py`` (prints four tables);
``--repeats N`` sets the timed rounds (default 10, or
``PZSC_BENCH_REPEATS``), ``--skip-peers`` times only ours and
``--workloads`` picks workloads by index (``0,2``).

Workloads: a ``[vocab, 64]`` f32 table, a batch of 4096 samples with 32 ids
each (sum combiner), ids uniform or Zipf(1.05); vocab 1M, and 8M for the
uniform case.

Fairness: every peer is timed interleaved with ours, in the same run, in
alternating blocks of calls (the first call of each block is not counted,
so that one library's idle threads do not tax the other's first call);
each figure is the best of its calls (the machine may be shared: other
processes only ever add time), and ``x ours`` = peer time / our time from
the same pair. Each pair's results are checked equal before timing.

1. ``fwd``: the lookup only. Ours reads the buffers of the public
   preprocessing (``preprocess_sparse_dense_matmul_input``, one device, one
   SparseCore: sorted by row, duplicates merged, and the sample order the
   CPU forward sums from), built outside the timing as an input pipeline
   hands them over (table 3 times them); torch ``EmbeddingBag`` and
   FBGEMM's table-batched embedding take the raw ids.
   Check: our output equals torch's on every row (``np.allclose``, rtol
   1e-5, atol 1e-5).
2. ``step``: lookup, then a fixed activation gradient applied to the
   table in place: ours = forward + fused backward (donated table and
   slots); torch = ``EmbeddingBag`` with sparse gradients + ``optim.SGD``
   / ``optim.Adagrad``; FBGEMM = the table-batched embedding with fused
   exact SGD, exact (element-wise) Adagrad and exact row-wise Adagrad;
   plain JAX = ``jnp.take`` + ``segment_sum`` with the dense ``jax.grad``
   and a dense optimizer step over the whole table (donated). Check after
   one step from the same table (and accumulator 0.1): the touched rows
   and accumulators equal ours where the rule is ours (rtol 1e-4: hot rows
   sum thousands of gradient terms, each library in its own order;
   FBGEMM's Adagrad adds eps 1e-8 to the root, torch's 1e-10: within the
   tolerance; on Zipf ids the accumulators of the few hottest rows, whose
   gradients sum ~4000 terms with heavy cancellation, may differ by a
   little more). ``step rowwise_adagrad``: ours
   (``RowwiseAdagradOptimizerSpec``'s fused update, one accumulator per
   row) against FBGEMM's exact row-wise Adagrad, the same rule; both are
   checked against a numpy restatement of it.
3. ``raw ids``: from the ``[4096, 32]`` int64 array a user holds: ours =
   the public ``preprocess_sparse_dense_matmul_input`` (host, numba) +
   forward (+ fused backward), the preprocessing inside the timing; torch
   = ``EmbeddingBag`` (+ optimizer) on the same array. Check as in 1.
4. The fused backward's input pass (row pointer check, sortedness scan;
   target ``pzsc_check_coo``, the code the backward runs before its first
   write) beside the backward alone, on the same buffers: timed alone
   (buffers warm) and right after each backward (evicted). Each is its
   own XLA call, so both include one call's dispatch: upper bounds of what
   the pass adds to the fused backward.
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

import pz_sparsecore as pzsc
from pz_sparsecore.device import kernels
from pz_sparsecore.device.kernels import contract, ffi

BATCH = 4096
IDS_PER_SAMPLE = 32
DIM = 64
LEARNING_RATE = 0.01
INITIAL_ACCUMULATOR = 0.1
FBGEMM_EPS = 1e-8
# Our hyper-parameter vectors (row-wise Adagrad: lr, FBGEMM's eps, the
# table's width, no weight decay).
HYPER = {
  "sgd": [LEARNING_RATE],
  "adagrad": [LEARNING_RATE],
  "rowwise_adagrad": [LEARNING_RATE, FBGEMM_EPS, float(DIM), 0.0, 0.0],
}
REPEATS = int(os.environ.get("PZSC_BENCH_REPEATS", "10"))
# Calls per block of the interleaved timing (the first is not counted).
BLOCK = 4
# Check tolerances: the forward's; a step's (its row gradients sum up to
# thousands of terms per hot row, in a library-specific order).
RTOL, ATOL = 1e-5, 1e-5
STEP_RTOL = 1e-4

# A benchmark implementation: (run one call, blocking; read its result:
# the output of a forward, [table, slots...] at the touched rows of a step).
Impl = tuple[Callable[[], object], Callable[[], np.ndarray]]


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


# --- timing -----------------------------------------------------------------


def interleaved(*fns: Callable[[], object]) -> list[float]:
  """Best wall time (ms) of each ``fn()``, timed in alternating blocks.

  Each round runs ``BLOCK`` calls of each function in turn; the first call
  of a block is a warm-up. Two warm-up rounds come first.
  """
  times = [[] for _ in fns]
  for round_ in range(REPEATS + 2):
    for fn, out in zip(fns, times, strict=True):
      for k in range(BLOCK):
        t = time.perf_counter()
        fn()
        if round_ >= 2 and k > 0:
          out.append(time.perf_counter() - t)
  return [1e3 * min(t) for t in times]


def timeit_pair(
  first: Callable[[], object], second: Callable[[], object]
) -> tuple[float, float]:
  """Best wall times (ms) of ``first()`` and of ``second()`` run right after.

  After two warm-up rounds.
  """
  times = ([], [])
  for i in range(REPEATS + 2):
    for fn, out in zip((first, second), times, strict=True):
      t = time.perf_counter()
      fn()
      if i >= 2:
        out.append(time.perf_counter() - t)
  return 1e3 * min(times[0]), 1e3 * min(times[1])


def rows_equal(got: np.ndarray, want: np.ndarray, rtol: float = RTOL) -> str:
  """``"k/n rows equal"``: rows of ``got`` allclose to ``want``'s."""
  got, want = got.reshape(-1, DIM), want.reshape(-1, DIM)
  ok = np.isclose(got, want, rtol=rtol, atol=ATOL).all(axis=-1)
  return f"{int(ok.sum())}/{ok.size} rows equal"


# --- ours -------------------------------------------------------------------

LAYOUT_KEYS = ("num_segments", "samples_per_segment", "num_partitions")


def _layout(vocab: int) -> dict[str, int]:
  return dict(
    num_segments=1,
    samples_per_segment=BATCH,
    num_partitions=1,
    rows_per_partition=vocab,
  )


def _our_forward(bufs, table, layout):
  """The forward on ``bufs``: the four COO buffers, then the sample order
  where the preprocessing wrote one."""
  order = bufs[4] if len(bufs) > 4 else None
  return kernels.sparse_dense_matmul(
    *bufs[:4], table, sample_order=order, **layout
  )


@functools.partial(jax.jit, donate_argnums=(0, 1), static_argnums=(2, 3))
def _our_step(table, slots, optimizer, vocab, act_grad, bufs):
  """Forward, then the fused backward of ``act_grad`` (table donated)."""
  layout = _layout(vocab)
  hp = jnp.asarray(HYPER[optimizer], jnp.float32)
  out = _our_forward(bufs, table, layout)
  return kernels.sparse_dense_matmul_grad(
    act_grad + 0 * out[:1],
    *bufs[:4],
    table,
    slots,
    optimizer=optimizer,
    hyperparameters=hp,
    # A 16-bit table's update rounds stochastically.
    rounding_seed=None if table.dtype == jnp.float32 else jnp.int32(1),
    **layout,
  )


def _our_slots(optimizer: str, table: jax.Array) -> tuple[jax.Array, ...]:
  if optimizer == "sgd":
    return ()
  if optimizer == "rowwise_adagrad":  # One accumulator per row.
    return (jnp.full((table.shape[0], 1), INITIAL_ACCUMULATOR, jnp.float32),)
  return (jnp.full_like(table, INITIAL_ACCUMULATOR),)


def ours_forward(table: jax.Array, bufs) -> Impl:
  fwd = jax.jit(functools.partial(_our_forward, layout=_layout(table.shape[0])))
  return (
    lambda: fwd(bufs, table).block_until_ready(),
    lambda: np.asarray(fwd(bufs, table)),
  )


def _jax_rows(arrays, rows: np.ndarray) -> np.ndarray:
  """``[len(arrays), len(rows), DIM]``: the rows of each array (a row-wise
  slot's one value broadcast over the row, as the peers' results are)."""
  return np.stack(
    [
      np.broadcast_to(
        np.asarray(jnp.take(a, rows, axis=0), np.float32), (len(rows), DIM)
      )
      for a in arrays
    ]
  )


def ours_step(
  table_np, bufs, act_grad, optimizer: str, rows, dtype=jnp.float32
) -> Impl:
  """Our training step (forward + fused backward), the table in ``dtype``."""
  table = jnp.asarray(table_np, dtype)
  state = [table, _our_slots(optimizer, table)]
  vocab = table_np.shape[0]

  def run():
    state[0], state[1] = _our_step(
      state[0], state[1], optimizer, vocab, act_grad, bufs
    )
    state[0].block_until_ready()

  return run, lambda: _jax_rows((state[0], *state[1]), rows)


def preprocess_fn(
  vocab: int,
  batch: int = BATCH,
  ids_per_sample: int = IDS_PER_SAMPLE,
  dim: int = DIM,
  sample_order: bool = False,
) -> Callable[[np.ndarray], tuple]:
  """Raw ``[batch, ids_per_sample]`` ids -> the buffers of one device with
  one SparseCore (a ``[vocab, dim]`` table), via the public API; with
  ``sample_order`` the CPU forward's sample order after them."""
  table_spec = pzsc.TableSpec(
    name="table",
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.zeros,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=LEARNING_RATE),
    combiner="sum",
    max_ids_per_partition=batch * ids_per_sample,
    max_unique_ids_per_partition=batch * ids_per_sample,
  )
  feature = pzsc.FeatureSpec(
    name="ids",
    table_spec=table_spec,
    input_shape=(batch, ids_per_sample),
    output_shape=(batch, dim),
  )
  specs = pzsc.prepare_feature_specs_for_training(
    {"ids": feature}, global_device_count=1, num_sc_per_device=1
  )

  def preprocess(ids: np.ndarray) -> tuple:
    inputs, _ = pzsc.preprocess_sparse_dense_matmul_input(
      {"ids": ids}, None, specs, 1, 1, num_sc_per_device=1
    )
    buffers = tuple(
      getattr(inputs, f)["table"]
      for f in (
        "lhs_row_pointers",
        "lhs_embedding_ids",
        "lhs_sample_ids",
        "lhs_gains",
      )
    )
    if sample_order:
      buffers += (inputs.sample_order["table"],)
    return buffers

  return preprocess


def ours_raw(table_np, ids, act_grad, optimizer: str | None, rows) -> Impl:
  """Preprocessing + forward (+ fused backward) from raw ids."""
  vocab = table_np.shape[0]
  preprocess = preprocess_fn(vocab, sample_order=True)
  if optimizer is None:
    table = jnp.asarray(table_np)
    fwd = jax.jit(functools.partial(_our_forward, layout=_layout(vocab)))
    return (
      lambda: fwd(preprocess(ids), table).block_until_ready(),
      lambda: np.asarray(fwd(preprocess(ids), table)),
    )
  table = jnp.asarray(table_np)
  state = [table, _our_slots(optimizer, table)]

  def run():
    state[0], state[1] = _our_step(
      state[0], state[1], optimizer, vocab, act_grad, preprocess(ids)
    )
    state[0].block_until_ready()

  return run, lambda: _jax_rows((state[0], *state[1]), rows)


def input_pass(bufs, table, layout) -> Callable[[jax.Array], object]:
  """``f(table)`` runs the backward's input pass on these buffers (blocking).

  The pass reads only the table's shape; ``table`` is the current one (the
  backward donates its input).
  """
  bufs = bufs[:4]
  shape = contract.check_buffers(*bufs, table, partition_begin=0, **layout)
  check = jax.jit(lambda *operands: ffi.check_coo(*operands, shape))
  if int(check(*bufs, table)) != 0:
    raise AssertionError("the benchmark's buffers are not sorted")
  return lambda table: check(*bufs, table).block_until_ready()


def bench_input_pass(table_np, bufs, act_grad) -> dict[str, float]:
  """Table 4: the input pass alone, the backward alone, the pass after it."""
  vocab = table_np.shape[0]
  layout = _layout(vocab)

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnums=(2,))
  def backward(table, slots, optimizer, act_grad, bufs):
    return kernels.sparse_dense_matmul_grad(
      act_grad,
      *bufs,
      table,
      slots,
      optimizer=optimizer,
      hyperparameters=jnp.asarray([LEARNING_RATE], jnp.float32),
      **layout,
    )

  table = jnp.asarray(table_np)
  check = input_pass(bufs, table, layout)
  res = {"input pass": min(interleaved(lambda: check(table)))}
  for opt in ("sgd", "adagrad"):
    state = [table, _our_slots(opt, table)]

    def run(state=state, opt=opt):
      state[0], state[1] = backward(state[0], state[1], opt, act_grad, bufs[:4])
      state[0].block_until_ready()

    res[f"bwd {opt}"], res[f"after {opt}"] = timeit_pair(
      run, lambda state=state: check(state[0])
    )
    table = state[0]
    del state
  return res


# --- plain JAX --------------------------------------------------------------


def _jax_lookup(table, flat, seg):
  rows = jnp.take(table, flat, axis=0)
  return jax.ops.segment_sum(rows, seg, num_segments=BATCH)


def _jax_loss(table, act_grad, flat, seg):
  return jnp.vdot(_jax_lookup(table, flat, seg), act_grad)


@functools.partial(jax.jit, donate_argnums=(0,))
def _jax_sgd(table, slots, *args):
  return table - LEARNING_RATE * jax.grad(_jax_loss)(table, *args), slots


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _jax_adagrad(table, slots, *args):
  g = jax.grad(_jax_loss)(table, *args)
  acc = slots[0] + g * g
  return table - LEARNING_RATE * g / jnp.sqrt(acc), (acc,)


def _jax_args(ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
  flat = jnp.asarray(ids.reshape(-1).astype(np.int32))
  seg = jnp.asarray(np.repeat(np.arange(BATCH, dtype=np.int32), ids.shape[1]))
  return flat, seg


def jax_forward(table_np, ids) -> Impl:
  fwd = jax.jit(_jax_lookup)
  table = jnp.asarray(table_np)
  args = _jax_args(ids)
  return (
    lambda: fwd(table, *args).block_until_ready(),
    lambda: np.asarray(fwd(table, *args)),
  )


def jax_step(table_np, ids, act_grad, optimizer: str, rows) -> Impl:
  table = jnp.asarray(table_np)
  state = [table, _our_slots(optimizer, table)]
  step = _jax_sgd if optimizer == "sgd" else _jax_adagrad
  args = (act_grad, *_jax_args(ids))

  def run():
    state[0], state[1] = step(state[0], state[1], *args)
    state[0].block_until_ready()

  return run, lambda: _jax_rows((state[0], *state[1]), rows)


# --- torch / FBGEMM ---------------------------------------------------------


def _import_torch():
  try:
    import torch
  except ImportError as e:
    return None, f"torch not installed ({e})"
  torch.set_num_threads(os.cpu_count() or 1)
  return torch, None


def _torch_bag(torch, table_np, optimizer):
  # A step updates the table in place: it gets its own copy.
  weight = table_np if optimizer is None else table_np.copy()
  bag = torch.nn.EmbeddingBag.from_pretrained(
    torch.from_numpy(weight), freeze=False, mode="sum", sparse=True
  )
  if optimizer is None:
    return bag, None
  if optimizer == "sgd":
    return bag, torch.optim.SGD(bag.parameters(), lr=LEARNING_RATE)
  return bag, torch.optim.Adagrad(
    bag.parameters(),
    lr=LEARNING_RATE,
    initial_accumulator_value=INITIAL_ACCUMULATOR,
  )


def torch_impl(table_np, ids, act_grad_np, optimizer, rows) -> Impl:
  """EmbeddingBag forward (optimizer None) or step, from the raw ids."""
  torch, _ = _import_torch()
  bag, optim = _torch_bag(torch, table_np, optimizer)
  offsets = torch.arange(0, ids.size, ids.shape[1], dtype=torch.int64)

  def lookup():
    return bag(torch.from_numpy(ids.reshape(-1)), offsets)

  if optimizer is None:

    def forward():
      with torch.no_grad():
        return lookup()

    return forward, lambda: forward().numpy()

  grad_out = torch.from_numpy(act_grad_np)

  def run():
    optim.zero_grad()
    lookup().backward(grad_out)
    optim.step()

  def result():
    table = bag.weight.detach().numpy()[rows]
    if optimizer == "sgd":
      return table[None]
    return np.stack([table, optim.state[bag.weight]["sum"].numpy()[rows]])

  return run, result


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


# Our optimizer names -> FBGEMM's optimizer types (None: forward only).
FBGEMM_OPTIMIZERS = {
  None: "EXACT_SGD",
  "sgd": "EXACT_SGD",
  "adagrad": "EXACT_ADAGRAD",
  "rowwise adagrad": "EXACT_ROWWISE_ADAGRAD",
}


def fbgemm_impl(
  table_np, ids, act_grad_np, optimizer, rows, fp16: bool = False
) -> Impl:
  """FBGEMM's table-batched embedding on CPU, forward or fused step
  (``fp16``: float16 weights, written by stochastic rounding)."""
  mods, _ = _import_fbgemm()
  torch, location, device, tbe_cls, optim_type = mods
  precision = {}
  if fp16:
    from fbgemm_gpu.split_embedding_configs import SparseType

    precision = dict(
      weights_precision=SparseType.FP16, stochastic_rounding=True
    )
  tbe = tbe_cls(
    [(table_np.shape[0], DIM, location.HOST, device.CPU)],
    optimizer=getattr(optim_type, FBGEMM_OPTIMIZERS[optimizer]),
    learning_rate=LEARNING_RATE,
    eps=FBGEMM_EPS,
    **precision,
  )
  with torch.no_grad():
    tbe.split_embedding_weights()[0].copy_(torch.from_numpy(table_np))
    for states in tbe.split_optimizer_states():
      states[0].fill_(INITIAL_ACCUMULATOR)
  flat = torch.from_numpy(ids.reshape(-1))
  offsets = torch.arange(0, ids.size + 1, ids.shape[1], dtype=torch.int64)
  if optimizer is None:

    def forward():
      with torch.no_grad():
        return tbe(flat, offsets)

    return forward, lambda: forward().float().numpy()

  def result():
    weights = tbe.split_embedding_weights()[0].detach().float()
    table = weights.numpy()[rows]
    if optimizer == "sgd":
      return table[None]
    acc = tbe.split_optimizer_states()[0][0].detach().numpy()[rows]
    return np.stack(
      [table, np.broadcast_to(acc.reshape(len(rows), -1), table.shape)]
    )

  grad_out = torch.from_numpy(act_grad_np)
  return lambda: tbe(flat, offsets).backward(grad_out), result


def rowwise_adagrad_reference(table_np, ids, act_grad_np, rows) -> Impl:
  """One exact row-wise Adagrad step (FBGEMM's rule) at ``rows``.

  ``rows`` must be the sorted unique ids.
  """
  samples = np.repeat(np.arange(BATCH), ids.shape[1])
  inverse = np.searchsorted(rows, ids.reshape(-1))
  g = np.zeros((rows.size, DIM), np.float32)
  np.add.at(g, inverse, act_grad_np[samples])
  acc = INITIAL_ACCUMULATOR + (g * g).mean(axis=1, keepdims=True)
  table = table_np[rows] - LEARNING_RATE * g / (np.sqrt(acc) + FBGEMM_EPS)
  return np.stack([table, np.broadcast_to(acc, table.shape)])


# --- driver -----------------------------------------------------------------

PEERS = {
  "torch": ("torch EmbeddingBag", _import_torch),
  "fbgemm": ("FBGEMM TBE", _import_fbgemm),
}


def touched_bytes(ids: np.ndarray, op: str) -> int:
  """Embedding bytes a call must move: looked-up rows (+ touched state)."""
  row = DIM * 4
  if op == "fwd":
    return ids.size * row
  slot = {"sgd": 0, "adagrad": row, "rowwise_adagrad": 4}[op]
  return ids.size * row + np.unique(ids).size * 2 * (row + slot)


class Report:
  """Collects the table rows of one run."""

  HEADER = (
    f"{'workload':<13}{'op':<19}{'peer':<27}{'ours ms':>9}{'peer ms':>9}"
    f"{'x ours':>8}{'GB/s':>7}{'load':>6}  check"
  )

  def __init__(self):
    self.lines = {
      k: [self.HEADER, "-" * (len(self.HEADER) + 20)] for k in (1, 2, 3)
    }
    self.notes: list[str] = []

  def pair(
    self, table, label, op, peer, ours: Impl, other: Impl, check, nbytes
  ):
    """Checks, then times ``ours`` and ``other`` interleaved; adds a row."""
    ours[0]()
    other[0]()
    verdict = check(ours[1](), other[1]())
    t_ours, t_peer = interleaved(ours[0], other[0])
    # The 1-minute load average after the pair: a figure measured beside
    # other work (load well above the 2 threads' own) is not quiet.
    self.lines[table].append(
      f"{label:<13}{op:<19}{peer:<27}{t_ours:>9.2f}{t_peer:>9.2f}"
      f"{t_peer / t_ours:>8.2f}{nbytes / t_ours / 1e6:>7.1f}"
      f"{os.getloadavg()[0]:>6.2f}  {verdict}"
    )

  def table(self, number: int) -> str:
    return "\n".join(self.lines[number])


def _peers(skip: bool) -> tuple[dict[str, str], list[str]]:
  """Available peers (key -> name) and notes on the missing ones."""
  available, notes = {}, []
  if skip:
    return available, notes
  for key, (name, probe) in PEERS.items():
    if (err := probe()[1]) is None:
      available[key] = name
    else:
      notes.append(f"{name}: skipped, {err}")
  return available, notes


def _check_forward(ours: np.ndarray, peer: np.ndarray) -> str:
  return rows_equal(ours, peer)


def _check_step(ours: np.ndarray, peer: np.ndarray) -> str:
  """Touched table rows (and accumulator rows), ours against the peer's."""
  return rows_equal(ours, peer, STEP_RTOL)


def bench_forward(report, label, table_np, ids, bufs, peers) -> None:
  """Table 1: the forward against each peer."""
  ours = ours_forward(jnp.asarray(table_np), bufs)
  nbytes = touched_bytes(ids, "fwd")
  makers = {"torch": torch_impl, "fbgemm": fbgemm_impl}
  for key, name in peers.items():
    other = makers[key](table_np, ids, None, None, None)
    report.pair(1, label, "fwd", name, ours, other, _check_forward, nbytes)
    del other
    gc.collect()
  report.pair(
    1,
    label,
    "fwd",
    "plain JAX",
    ours,
    jax_forward(table_np, ids),
    _check_forward,
    nbytes,
  )
  # 16-bit tables (half the bytes): bfloat16 against EmbeddingBag on the
  # same values in float32; float16 against FBGEMM's float16 weights.
  for dtype, key, maker in (
    (jnp.bfloat16, "torch", torch_impl),
    (jnp.float16, "fbgemm", functools.partial(fbgemm_impl, fp16=True)),
  ):
    if key not in peers:
      continue
    table16 = jnp.asarray(table_np, dtype)
    widened = np.asarray(table16, np.float32)
    other = maker(widened, ids, None, None, None)
    report.pair(
      1,
      label,
      f"fwd {jnp.dtype(dtype).name}",
      peers[key] + (" fp32" if key == "torch" else " fp16"),
      ours_forward(table16, bufs),
      other,
      _check_forward,
      nbytes // 2,
    )
    del other
    gc.collect()


def bench_steps(report, label, table_np, ids, bufs, act_grad_np, peers):
  """Table 2: a training step (forward + backward + update) per optimizer."""
  rows = np.unique(ids)
  act_grad = jnp.asarray(act_grad_np)
  reference = rowwise_adagrad_reference(table_np, ids, act_grad_np, rows)
  for opt in ("sgd", "adagrad", "rowwise_adagrad"):
    pairs = []
    if opt == "rowwise_adagrad":
      # FBGEMM's exact row-wise Adagrad is the peer with the same rule;
      # both are checked against a numpy restatement of it.
      if "fbgemm" in peers:
        pairs.append(
          (
            "FBGEMM row-wise Adagrad",
            fbgemm_impl,
            "rowwise adagrad",
            lambda ours, got: (
              "both vs numpy: "
              + _check_step(ours, reference)
              + " / "
              + _check_step(got, reference)
            ),
          )
        )
    else:
      if "torch" in peers:
        pairs.append((peers["torch"], torch_impl, opt, _check_step))
      if "fbgemm" in peers:
        name = "FBGEMM exact " + ("SGD" if opt == "sgd" else "Adagrad")
        pairs.append((name, fbgemm_impl, opt, _check_step))
      pairs.append(("plain JAX (dense)", jax_step, opt, _check_step))
    for name, maker, peer_opt, check in pairs:
      ours = ours_step(table_np, bufs, act_grad, opt, rows)
      other = maker(table_np, ids, act_grad_np, peer_opt, rows)
      report.pair(
        2,
        label,
        f"step {opt}",
        name,
        ours,
        other,
        check,
        touched_bytes(ids, opt),
      )
      del ours, other
      gc.collect()
    if opt == "rowwise_adagrad" and "fbgemm" in peers:
      # float16 tables on both sides, each rounding stochastically (its own
      # random bits): rows equal within a few float16 steps.
      widened = np.asarray(jnp.asarray(table_np, jnp.float16), np.float32)
      ours = ours_step(widened, bufs, act_grad, opt, rows, jnp.float16)
      other = fbgemm_impl(
        widened, ids, act_grad_np, "rowwise adagrad", rows, fp16=True
      )
      report.pair(
        2,
        label,
        "step rowwise f16",
        "FBGEMM row-wise fp16",
        ours,
        other,
        lambda ours, got: rows_equal(ours, got, 4e-3),
        touched_bytes(ids, opt) // 2,
      )
      del ours, other
      gc.collect()


def bench_raw(report, label, table_np, ids, act_grad_np, peers) -> None:
  """Table 3: from raw ids, our preprocessing included, against torch."""
  if "torch" not in peers:
    return
  rows = np.unique(ids)
  act_grad = jnp.asarray(act_grad_np)
  for opt in (None, "sgd", "adagrad"):
    ours = ours_raw(table_np, ids, act_grad, opt, rows)
    other = torch_impl(table_np, ids, act_grad_np, opt, rows)
    op = "fwd" if opt is None else f"step {opt}"
    report.pair(
      3,
      label,
      op,
      peers["torch"],
      ours,
      other,
      _check_forward if opt is None else _check_step,
      touched_bytes(ids, opt or "fwd"),
    )
    del ours, other
    gc.collect()


def input_pass_lines(label: str, res: dict[str, float]) -> list[str]:
  """Rows of table 4 for one workload."""
  lines = []
  for opt in ("sgd", "adagrad"):
    bwd = res[f"bwd {opt}"]
    warm, cold = res["input pass"], res[f"after {opt}"]
    lines.append(
      f"{label:<13}{opt:<9}{bwd:>9.2f}{warm:>11.3f}{100 * warm / bwd:>7.2f}"
      f"{cold:>13.3f}{100 * cold / bwd:>7.2f}"
    )
  return lines


WORKLOADS = [
  (1_000_000, "uniform"),
  (1_000_000, "zipf"),
  (8_000_000, "uniform"),
]


def _parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=REPEATS)
  parser.add_argument("--skip-peers", action="store_true")
  parser.add_argument(
    "--workloads", default=",".join(map(str, range(len(WORKLOADS))))
  )
  return parser.parse_args()


def main() -> None:
  global REPEATS
  args = _parse_args()
  REPEATS = args.repeats
  peers, notes = _peers(args.skip_peers)
  report = Report()
  pass_header = (
    f"{'workload':<13}{'bwd':<9}{'bwd ms':>9}{'pass ms':>11}{'%':>7}"
    f"{'after bwd ms':>13}{'%':>7}"
  )
  pass_lines = [pass_header, "-" * len(pass_header)]
  for index in map(int, args.workloads.split(",")):
    vocab, dist = WORKLOADS[index]
    rng = np.random.default_rng(index)
    ids = make_ids(vocab, dist, rng)
    table = rng.normal(size=(vocab, DIM)).astype(np.float32) * 0.01
    act_grad = rng.normal(size=(BATCH, DIM)).astype(np.float32)
    bufs = tuple(
      jnp.asarray(b) for b in preprocess_fn(vocab, sample_order=True)(ids)
    )
    label = f"{vocab // 1_000_000}M {dist}"
    bench_forward(report, label, table, ids, bufs, peers)
    bench_steps(report, label, table, ids, bufs, act_grad, peers)
    bench_raw(report, label, table, ids, act_grad, peers)
    pass_lines += input_pass_lines(
      label, bench_input_pass(table, bufs, jnp.asarray(act_grad))
    )
    del table, bufs
    gc.collect()
  print(
    f"batch {BATCH} x {IDS_PER_SAMPLE} ids, dim {DIM}, f32, "
    f"{os.cpu_count()} CPU threads, jax {jax.__version__}, "
    f"kernels {pzsc.backend_info().extension_path}"
  )
  print("\n1. Forward (ours: preprocessed buffers; peers: raw ids):")
  print(report.table(1))
  print("\n2. Training step (forward + backward + update, in place):")
  print(report.table(2))
  print("\n3. From raw ids (ours: public preprocessing inside the timing):")
  print(report.table(3))
  print(
    "\n4. The fused backward's input pass (pzsc_check_coo) vs the backward:"
  )
  print("\n".join(pass_lines))
  for note in notes:
    print(note, file=sys.stderr)


if __name__ == "__main__":
  main()
