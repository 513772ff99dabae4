"""GPU benchmark: the CUDA handlers against torch and plain JAX, one GPU.

Run: ``python benchmarks/gpu.py`` (needs a GPU that JAX and torch see, and
the extension built with the CUDA handlers; prints the tables last).
``--workloads 0,3`` picks workloads (``none``: the train step alone),
``--repeats N`` the timed calls.

Workloads: a batch of 65,536 samples x 32 ids (sum combiner) looked up in a
``[vocab, 64]`` f32 table, vocab 1M, 8M and 64M, ids uniform or Zipf(1.05).
Every library runs in its own subprocess per workload (so that each has the
GPU's memory to itself); each figure is the median of ``--repeats`` timed
runs after warm-up, each run ``PIPELINE`` (10) calls enqueued back to back
and one wait for the GPU at the end (JAX: ``block_until_ready``; torch:
``torch.cuda.synchronize``), divided by 10: device time per call, as a
training loop that keeps the GPU fed sees it. Column ``1 call`` of part 1
is our forward dispatched and waited for alone (the latency). The jaxlib
version is printed: plain JAX's scatter-add and ``segment_sum`` speeds
changed between releases.

1. ``fwd``: the lookup. Ours:
   ``pz_sparsecore.device.kernels.sparse_dense_matmul`` on the buffers of the
   public host preprocessing (``preprocess_sparse_dense_matmul_input``, timed on
   its own in column ``host prep``: the host work an input pipeline overlaps
   with the device steps); torch: ``nn.EmbeddingBag(mode="sum")`` on the
   ``[65536, 32]`` int64 ids on the GPU; plain JAX: ``jnp.take`` + sum. GB/s:
   the bytes a lookup must move (each id's row read once, the output written
   once) over the time, beside the card's copy bandwidth measured in the same
   run.
2. ``update``: a fixed activation gradient applied to the table. Ours: the
   fused backward alone (SGD, Adagrad; table and slot donated); torch:
   ``EmbeddingBag(sparse=True)``'s backward + ``optim.SGD`` /
   ``optim.Adagrad`` (its forward excluded: timed as forward + backward +
   step minus the forward); plain JAX: the dense gradient of take + sum and
   a dense update of the whole table (donated).
3. ``step``: forward then update, each library as in 1 and 2.
4. Train step, vocab 2^24: ``benchmarks/train_step.py``'s model (one
   feature, a Linear head, a squared loss, Adam), scaled to this batch:
   ``SparseCoreTrainer`` against Penzai's ``EmbeddingLookup`` + ``optax.adam``
   on the dense gradient (donated), both on the GPU; per step, blocking
   (each loss read before the next step) and pipelined (10 steps
   dispatched, the last loss read; ours within the trainer's bound of steps
   in flight, as ``fit`` runs them).

Each pair's results are checked (forward outputs allclose to torch's; the
touched rows after one SGD update allclose to torch's).

FBGEMM's GPU TBE is not among the peers: its wheel (fbgemm-gpu, 474 MiB)
cannot reach a machine without a package registry within this project's
transfer limits; torch's sparse EmbeddingBag path is the peer for updates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCH, IDS, DIM = 65536, 32, 64
VOCABS = (1 << 20, 1 << 23, 1 << 26)
WORKLOADS = [(v, d) for v in VOCABS for d in ("uniform", "zipf")]
LR, ACC0 = 0.01, 0.1
HERE = os.path.dirname(os.path.abspath(__file__))


def make_ids(vocab: int, dist: str, seed: int = 0):
  import numpy as np

  rng = np.random.default_rng(seed)
  n = BATCH * IDS
  if dist == "uniform":
    ids = rng.integers(0, vocab, n)
  else:
    cdf = np.cumsum(np.arange(1, vocab + 1, dtype=np.float64) ** -1.05)
    ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1])
    ids = rng.permutation(vocab)[np.minimum(ranks, vocab - 1)]
  return ids.reshape(BATCH, IDS).astype(np.int64)


#: Calls enqueued back to back per timed run (one wait at the end): the
#: figures are device time per call, as a training loop that keeps the GPU
#: fed sees it, without one dispatch-and-wait round trip per call.
PIPELINE = 10
OURS_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
# Each optimizer's hyper-parameters (row-wise: lr, eps, the table's width,
# no weight decay).
HYPER = {
  "sgd": [LR],
  "adagrad": [LR],
  "rowwise_adagrad": [LR, 1e-8, float(DIM), 0.0, 0.0],
}


def pipelined_ms(call, wait, repeats: int, n: int = PIPELINE) -> float:
  """Median over ``repeats`` runs of ``n`` back-to-back ``call()``s then one
  ``wait(last result)``, per call."""

  def run():
    result = None
    for _ in range(n):
      result = call()
    wait(result)

  return median_ms(run, repeats) / n


def _ready(x):
  x.block_until_ready()


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return 1e3 * statistics.median(times)


# --- children -----------------------------------------------------------------


def one_shard_layout(vocab: int) -> dict:
  """The layout attributes of one device with one SparseCore (a
  power-of-two vocabulary: no padding)."""
  return dict(
    num_segments=1,
    samples_per_segment=BATCH,
    num_partitions=1,
    rows_per_partition=vocab,
  )


def jitted_update(layout: dict):
  """Our fused update of ``layout``'s buffers (table and slots donated):
  ``update(table, slots, optimizer, act, bufs)``."""
  import functools

  import jax
  import jax.numpy as jnp

  from pz_sparsecore.device import kernels

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnums=(2,))
  def update(table, slots, optimizer, act, bufs):
    return kernels.sparse_dense_matmul_grad(
      act,
      *bufs,
      table,
      slots,
      optimizer=optimizer,
      hyperparameters=jnp.asarray(HYPER[optimizer], jnp.float32),
      **layout,
    )

  return update


def child_jax(vocab: int, dist: str, repeats: int) -> dict:
  import functools

  import jax
  import jax.numpy as jnp
  import jaxlib
  import numpy as np

  from pz_sparsecore.device import kernels

  sys.path.insert(0, HERE)
  from kernels import preprocess_fn

  ids = make_ids(vocab, dist)
  prep = preprocess_fn(vocab, BATCH, IDS, DIM)

  def preprocess():
    return prep(ids)

  prep_ms = median_ms(preprocess, max(3, repeats // 4), warmup=1)
  gpu = jax.devices("gpu")[0]
  bufs = tuple(jax.device_put(b, gpu) for b in preprocess())
  rows = vocab  # One shard of a power-of-two vocabulary: no padding.
  layout = one_shard_layout(vocab)
  rng = np.random.default_rng(1)
  block = jax.device_put(
    jnp.asarray(rng.normal(size=(1024, DIM)), jnp.float32), gpu
  )
  # A large random table without a host copy: a random block, tiled.
  make_table = jax.jit(lambda b: jnp.tile(b, (rows // 1024, 1)))
  table = make_table(block)
  act = jax.device_put(
    jnp.asarray(rng.normal(size=(BATCH, DIM)), jnp.float32), gpu
  )
  out = {
    "prep_ms": prep_ms,
    "entries": int((np.asarray(bufs[1]) < rows).sum()),
    "unique_rows": int(np.unique(ids).size),
    "jaxlib": jaxlib.__version__,
  }

  fwd = jax.jit(functools.partial(kernels.sparse_dense_matmul, **layout))
  y = fwd(*bufs, table)
  out["fwd_sample"] = np.asarray(y[:64]).tolist()
  out["ours_fwd"] = pipelined_ms(lambda: fwd(*bufs, table), _ready, repeats)
  out["ours_fwd_blocking"] = median_ms(
    lambda: fwd(*bufs, table).block_until_ready(), repeats
  )

  update = jitted_update(layout)

  @functools.partial(jax.jit, donate_argnums=(0, 1), static_argnums=(2,))
  def step(table, slots, optimizer, act, bufs):
    y = kernels.sparse_dense_matmul(*bufs, table, **layout)
    return kernels.sparse_dense_matmul_grad(
      act + 0 * y[:1],
      *bufs,
      table,
      slots,
      optimizer=optimizer,
      hyperparameters=jnp.asarray(HYPER[optimizer], jnp.float32),
      **layout,
    )

  ids_dev = jax.device_put(jnp.asarray(ids, jnp.int32), gpu)
  jfwd = jax.jit(lambda t, i: jnp.take(t, i, axis=0).sum(1))
  out["jax_fwd"] = pipelined_ms(lambda: jfwd(table, ids_dev), _ready, repeats)
  table = None  # Freed: each optimizer gets a fresh table.
  check_rows = np.unique(ids[:64].reshape(-1))
  for opt in OURS_OPTIMIZERS:
    slots = {
      "sgd": (),
      "adagrad": (jnp.full((rows, DIM), ACC0, jnp.float32),),
      "rowwise_adagrad": (jnp.full((rows, 1), ACC0, jnp.float32),),
    }[opt]
    state = [make_table(block), slots]

    def call(fn, opt=opt, state=state):
      state[0], state[1] = fn(state[0], state[1], opt, act, bufs)
      return state[0]

    if opt == "sgd":
      _ready(call(update))
      out["sgd_rows"] = np.asarray(state[0][check_rows]).tolist()
      out["sgd_rows_before"] = np.asarray(block[check_rows % 1024]).tolist()
    out[f"ours_update_{opt}"] = pipelined_ms(
      lambda: call(update), _ready, repeats
    )
    out[f"ours_step_{opt}"] = pipelined_ms(lambda: call(step), _ready, repeats)
    state = None

  if vocab <= (1 << 23):

    @functools.partial(jax.jit, donate_argnums=(0,))
    def jax_update(t, i, act):
      g = jax.grad(lambda t: jnp.sum(jnp.take(t, i, axis=0).sum(1) * act))(t)
      return t - LR * g

    st = [make_table(block)]

    def jcall():
      st[0] = jax_update(st[0], ids_dev, act)
      return st[0]

    out["jax_update_sgd"] = pipelined_ms(jcall, _ready, repeats)
  return out


def child_torch(vocab: int, dist: str, repeats: int) -> dict:
  import numpy as np
  import torch

  dev = torch.device("cuda")
  ids = torch.as_tensor(make_ids(vocab, dist), device=dev)
  rng = np.random.default_rng(1)
  block = torch.as_tensor(rng.normal(size=(1024, DIM)), dtype=torch.float32)
  weight = block.to(dev).repeat(vocab // 1024, 1)
  act = torch.as_tensor(
    rng.normal(size=(BATCH, DIM)), dtype=torch.float32, device=dev
  )
  out = {}

  def timed(fn):
    return pipelined_ms(fn, lambda _: torch.cuda.synchronize(), repeats)

  # The card's copy bandwidth (bytes read + written).
  a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
  b = torch.empty_like(a)
  out["copy_gbs"] = 2 * a.numel() / timed(lambda: b.copy_(a)) / 1e6
  a = b = None

  bag = torch.nn.EmbeddingBag(vocab, DIM, mode="sum", sparse=True, device=dev)
  with torch.no_grad():
    bag.weight.copy_(weight)
  del weight
  with torch.no_grad():
    y = bag(ids)
    out["fwd_sample"] = y[:64].cpu().numpy().tolist()
    out["torch_fwd"] = timed(lambda: bag(ids))
  check_rows = torch.as_tensor(
    np.unique(ids[:64].cpu().numpy().reshape(-1)), device=dev
  )
  for opt in ("sgd", "adagrad"):
    optim = (
      torch.optim.SGD(bag.parameters(), lr=LR)
      if opt == "sgd"
      else torch.optim.Adagrad(
        bag.parameters(), lr=LR, initial_accumulator_value=ACC0, eps=1e-10
      )
    )

    def step(optim=optim):
      optim.zero_grad(set_to_none=True)
      bag(ids).backward(act)
      optim.step()

    if opt == "sgd":
      before = bag.weight.detach()[check_rows].cpu().numpy()
      step()
      torch.cuda.synchronize()
      out["sgd_rows"] = bag.weight.detach()[check_rows].cpu().numpy().tolist()
      out["sgd_rows_before"] = before.tolist()
    out[f"torch_step_{opt}"] = timed(step)
    out[f"torch_update_{opt}"] = out[f"torch_step_{opt}"] - out["torch_fwd"]
    del optim
  return out


def child_train(which: str, repeats: int) -> dict:
  """Part 4 in this process: train_step.py's models at this batch."""
  sys.path.insert(0, HERE)
  import train_step

  train_step.BATCH, train_step.IDS, train_step.DIM = BATCH, IDS, DIM
  vocab = 1 << 24
  if which == "ours":
    step, _ = train_step._run_ours(vocab, "adam")
  else:
    step = train_step._run_penzai(vocab)
  i = [0]
  dispatch = []

  def call():
    i[0] += 1
    t = time.perf_counter()
    loss = step(i[0])
    dispatch.append(time.perf_counter() - t)
    return loss

  # Blocking: each step's loss read before the next is dispatched.
  # Pipelined: PIPELINE steps dispatched back to back and the last loss
  # read (ours keeps SparseCoreTrainer's bound of steps in flight, as
  # `fit` does).
  blocking = median_ms(lambda: float(call()), repeats)
  dispatch.clear()
  pipelined = pipelined_ms(call, float, repeats)
  # Host time of one `step` call in the pipelined runs (dispatch, and the
  # trainer's wait for the step two back).
  return {
    "ms": blocking,
    "pipelined_ms": pipelined,
    "dispatch_ms": 1e3 * statistics.median(dispatch),
  }


def _spawn(args: list[str]) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    res = subprocess.run(
      [sys.executable, __file__, *args],
      capture_output=True,
      text=True,
      env=env,
      timeout=240,
    )
  except subprocess.TimeoutExpired:
    return {"error": "timed out after 240 s"}
  if res.returncode != 0:
    return {"error": res.stderr.strip().splitlines()[-1] if res.stderr else "?"}
  return json.loads(res.stdout.strip().splitlines()[-1])


def _close(a, b, rtol=1e-4, atol=1e-4) -> str:
  import numpy as np

  if a is None or b is None:
    return "n/a"
  a, b = np.asarray(a), np.asarray(b)
  ok = np.isclose(a, b, rtol=rtol, atol=atol).all(axis=-1)
  return f"{int(ok.sum())}/{ok.size}"


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--workloads", default=None)
  parser.add_argument("--child", nargs="*", default=None)
  parser.add_argument("--skip-train", action="store_true")
  args = parser.parse_args()
  if args.child:
    kind = args.child[0]
    if kind == "train":
      res = child_train(args.child[1], args.repeats)
    else:
      vocab, dist = int(args.child[1]), args.child[2]
      fn = child_jax if kind == "jax" else child_torch
      res = fn(vocab, dist, args.repeats)
    print(json.dumps(res))
    return

  if args.workloads == "none":  # Part 4 alone.
    picks = []
  elif args.workloads:
    picks = [int(i) for i in args.workloads.split(",")]
  else:
    picks = range(len(WORKLOADS))
  rows = []
  for i in picks:
    vocab, dist = WORKLOADS[i]
    r = ["--repeats", str(args.repeats)]
    ours = _spawn(["--child", "jax", str(vocab), dist, *r])
    peer = _spawn(["--child", "torch", str(vocab), dist, *r])
    rows.append((vocab, dist, ours, peer))
    brief = {
      k: round(v, 3)
      for k, v in {**ours, **peer}.items()
      if isinstance(v, float)
    }
    print(f"workload {i}: {vocab} {dist}: {brief}", flush=True)
  train = {
    w: {"error": "skipped"}
    if args.skip_train
    else _spawn(["--child", "train", w, "--repeats", "10"])
    for w in ("ours", "penzai")
  }

  copy = next(
    (p["copy_gbs"] for *_, p in rows if "copy_gbs" in p), float("nan")
  )
  jaxlib_version = next(
    (o["jaxlib"] for _, _, o, _ in rows if "jaxlib" in o), "?"
  )
  print(f"\njaxlib {jaxlib_version}")
  print(f"GPU copy bandwidth (read + write): {copy:.0f} GB/s")
  print(
    "\n1. forward (ms per call, pipelined; GB/s = ids' rows read + output "
    "written, TorchRec's count; % of the copy bandwidth; 1 call: ours "
    "dispatched and waited for alone)"
  )
  print(
    f"{'vocab':>9} {'ids':8} {'entries':>9} {'host prep':>9} {'ours':>7} "
    f"{'GB/s':>6} {'%copy':>5} {'1 call':>7} {'torch':>7} {'x ours':>6} "
    f"{'jax':>7} {'x ours':>6} {'check':>7}"
  )
  for vocab, dist, o, p in rows:
    if "error" in o or "error" in p:
      print(f"{vocab:>9} {dist:8} error: {o.get('error') or p.get('error')}")
      continue
    gb = (BATCH * IDS * DIM * 4 + BATCH * DIM * 4) / 1e9
    print(
      f"{vocab:>9} {dist:8} {o['entries']:>9} {o['prep_ms']:>9.1f} "
      f"{o['ours_fwd']:>7.3f} {gb / o['ours_fwd'] * 1e3:>6.0f} "
      f"{100 * gb / o['ours_fwd'] * 1e3 / copy:>5.0f} "
      f"{o['ours_fwd_blocking']:>7.3f} {p['torch_fwd']:>7.3f} "
      f"{p['torch_fwd'] / o['ours_fwd']:>6.2f} {o['jax_fwd']:>7.3f} "
      f"{o['jax_fwd'] / o['ours_fwd']:>6.2f} "
      f"{_close(o['fwd_sample'], p['fwd_sample']):>7}"
    )
  print(
    "\n2./3. update and step (ms per call, pipelined): ours fused, torch "
    "sparse grad + optimizer; GB/s of ours: each referenced row and its "
    "slot read and written once, the activation gradient read once"
  )
  print(
    f"{'vocab':>9} {'ids':8} {'opt':8} {'ours upd':>8} {'GB/s':>6} "
    f"{'%copy':>5} {'torch upd':>9} "
    f"{'x ours':>6} {'ours step':>9} {'torch step':>10} {'x ours':>6} "
    f"{'jax upd':>8} {'check':>7}"
  )
  for vocab, dist, o, p in rows:
    if "error" in o or "error" in p:
      continue
    for opt in OURS_OPTIMIZERS:
      ju = o.get(f"jax_update_{opt}")
      check = _close(o["sgd_rows"], p["sgd_rows"]) if opt == "sgd" else ""
      # torch has no row-wise Adagrad: its (element-wise) Adagrad is the
      # peer of that row, marked "*".
      peer = "adagrad" if opt == "rowwise_adagrad" else opt
      # Bytes: each referenced row (and its slot row: D or 1 floats) read
      # and written once, the activation gradient read once.
      width = {"sgd": 0, "adagrad": DIM, "rowwise_adagrad": 1}[opt]
      gb = (2 * o["unique_rows"] * (DIM + width) + BATCH * DIM) * 4 / 1e9
      gbs = gb / o[f"ours_update_{opt}"] * 1e3
      label = "rowwise*" if opt == "rowwise_adagrad" else opt
      print(
        f"{vocab:>9} {dist:8} {label:8} {o[f'ours_update_{opt}']:>8.3f} "
        f"{gbs:>6.0f} {100 * gbs / copy:>5.0f} "
        f"{p[f'torch_update_{peer}']:>9.3f} "
        f"{p[f'torch_update_{peer}'] / o[f'ours_update_{opt}']:>6.2f} "
        f"{o[f'ours_step_{opt}']:>9.3f} {p[f'torch_step_{peer}']:>10.3f} "
        f"{p[f'torch_step_{peer}'] / o[f'ours_step_{opt}']:>6.2f} "
        f"{(f'{ju:.3f}' if ju else '-'):>8} {check:>7}"
      )
  print("  * torch: element-wise Adagrad (torch has no row-wise Adagrad)")
  print("\n4. train step, vocab 2^24, 65536 x 32 ids, Adam (ms)")
  o, p = train["ours"], train["penzai"]
  if "error" in o or "error" in p:
    print(f"error: ours {o} penzai {p}")
  else:
    for label, key in (
      ("blocking", "ms"),
      ("pipelined", "pipelined_ms"),
      ("one pipelined call (dispatch + in-flight wait)", "dispatch_ms"),
    ):
      print(
        f"{label:9}  SparseCoreTrainer {o[key]:.2f}   Penzai "
        f"EmbeddingLookup + optax {p[key]:.2f}   x ours "
        f"{p[key] / o[key]:.1f}"
      )


if __name__ == "__main__":
  main()
