"""A 26-table DLRM on the default path against TorchRec, on the same data.

Run: ``python benchmarks/dlrm.py`` (``make bench-dlrm`` installs the peer:
``torchrec==1.8.0`` with ``--no-deps`` beside ``fbgemm-gpu-cpu==1.8.0`` and
torch 2.13.0, plus the few modules its import needs). Each library runs in
its own subprocess (peak RSS is the process's); the tables print last.

The model, written as a user would from the docs: 13 dense features into a
bottom MLP (13 -> 64 -> 16), 26 categorical features each with its own
16-wide table (four of 100,000 to 1,000,000 rows, 22 of 10 to 10,000; three
multi-hot with 1 to 5 ids per sample, the rest one id), dot interactions
between the 27 vectors (ours: ``pzsc.dot_interaction``; ``--interaction
einsum``: einsum and fancy indexing, as TorchRec's is written), a top
MLP (367 -> 64 -> 1), a logistic loss; both libraries start from the same
MLP weights (`dense_init`). Tables
learn with Adagrad (lr 0.05; ``--table-optimizer rowwise_adagrad``: exact
row-wise Adagrad in both libraries), dense parameters with Adam (lr 1e-3). Ids
follow Zipf(1.1) over a random permutation of each table's rows; labels
carry a learnable signal (a hidden score per id of 8 tables plus a linear
function of the dense features). Batch 2,048; 8 virtual CPU devices (ours).

Ours: ``SparseCoreEmbed.from_config`` with the docs' defaults (compatible
tables stacked, default limits, exchange chosen per stack),
``SparseCoreTrainer``; host preprocessing is ``embed.preprocess`` on the
ids as upstream's users pass them (a ``[batch, 1]`` array for each one-hot
feature, a list of per-sample arrays for each multi-hot one); ``--placement``
also runs the replicated placements against the default all-sharded one.
TorchRec: ``FusedEmbeddingBagCollection`` (FBGEMM's table-batched
embedding with the Adagrad update fused into the backward) and the same MLPs
in torch, one process.

Hashed tables: ``--libs ours-hashed,ours-modulo`` compares two runs of
ours instead: every table ``ids="hashed"`` (capacity its vocabulary,
``lru``) fed raw int64 ids (each row's id a fixed random int64, drawn with
the same distributions), against the same model of range tables fed those
raw ids modulo the vocabulary, as a user hashes by hand (rows shared by
the collisions); ``--devices`` sets our CPU devices (8).

Reported per library: model build seconds, first step (with ours, the
compile), host preprocessing ms per batch, step ms (device step with the
batch ready), end-to-end ms per step over the training run (host work
included; ours overlaps it with ``fit``'s prefetching), preprocessing then
step in sequence (median over 30 batches, after the held-out scores, as
TorchRec's loop runs: ours waits for each step), peak RSS, held-out AUC
after the same batches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

BATCH, DIM, DENSE = 2048, 16, 13
BIG = (100_000, 300_000, 600_000, 1_000_000)
SMALL = tuple(int(v) for v in np.geomspace(10, 10_000, 22))
VOCABS = BIG + SMALL
MULTI_HOT = (4, 5, 6)  # Features with 1-5 ids per sample.
SIGNAL = (0, 1, 4, 6, 8, 10, 12, 14)  # Features that carry the signal.
TABLE_LR, DENSE_LR = 0.05, 1e-3
# `fit(refresh_limits_every=...)` for ours (`--refresh`; 0: None, which
# keeps the worst-case limits `from_config` starts with). The docs' loop:
# limits calibrated on the first batch before anything compiles.
REFRESH = 100
# The tables' optimizer (`--table-optimizer`): FBGEMM's exact Adagrad or
# exact row-wise Adagrad, the same rule in both libraries.
TABLE_OPTIMIZER = "adagrad"
# Our tables' storage (TorchRec's are float32 whatever this is).
TABLE_DTYPE = "float32"
# Our tables' ids (`--libs ours-hashed,ours-modulo`): "range" (ids in
# [0, V)), "hashed" (every table `ids="hashed"`, capacity V, lru, fed raw
# int64 ids: each row's id a fixed random int64), or "modulo" (range
# tables fed those raw ids modulo V, as a user hashes by hand).
IDS = "range"
# Our model's interaction (`--interaction`): "library", the docs' way
# (`pzsc.dot_interaction`), or "einsum" (`einsum` of the vectors with
# themselves, then the upper triangle by fancy indexing, as TorchRec's
# `InteractionArch` writes it in torch; XLA's autodiff then gives three
# batched products and a scatter).
INTERACTION = "library"
DEVICES = 8


def table_optimizer():
  """Ours, as FBGEMM's: accumulators start at 0; row-wise, eps 1e-8."""
  import pz_sparsecore as pzsc

  if TABLE_OPTIMIZER == "rowwise_adagrad":
    return pzsc.RowwiseAdagradOptimizerSpec(learning_rate=TABLE_LR)
  return pzsc.AdagradOptimizerSpec(
    learning_rate=TABLE_LR, initial_accumulator_value=0.0
  )


# `from_config(placement=...)` for ours (`--placement`): "sharded" (the
# docs' default), "auto" (the cost model), or "small" (the 22 small tables
# replicated by hand).
PLACEMENT = "sharded"


def make_data(num_batches: int, seed: int = 0):
  """Batches of (dense [B, 13] f32, ids: per feature a [B, 1] int32 array
  (one id per sample) or a list of B per-sample arrays (multi-hot), labels
  [B] f32)."""
  rng = np.random.default_rng(seed)
  # Each row's raw 64-bit id (hashed and modulo runs), drawn apart so
  # that the range run's data stay as they were.
  raw_rng = np.random.default_rng(seed + 1)
  raw = [raw_rng.integers(-(2**63), 2**63 - 1, v, np.int64) for v in VOCABS]
  hidden = [rng.normal(0, 1, v).astype(np.float32) for v in VOCABS]
  perms = [rng.permutation(v) for v in VOCABS]
  cdfs = [np.cumsum(np.arange(1, v + 1) ** -1.1) for v in VOCABS]
  w_dense = rng.normal(0, 0.5, DENSE).astype(np.float32)
  batches = []
  for _ in range(num_batches):
    dense = rng.normal(0, 1, (BATCH, DENSE)).astype(np.float32)
    ids, score = [], dense @ w_dense
    for t, v in enumerate(VOCABS):
      counts = (
        rng.integers(1, 6, BATCH)
        if t in MULTI_HOT
        else np.ones(BATCH, np.int64)
      )
      ranks = np.searchsorted(cdfs[t], rng.random(counts.sum()) * cdfs[t][-1])
      flat = perms[t][np.minimum(ranks, v - 1)].astype(np.int32)
      if t in SIGNAL:
        per_id = hidden[t][flat]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        score = score + np.add.reduceat(per_id, starts) / counts
      if IDS == "hashed":
        flat = raw[t][flat]
      elif IDS == "modulo":
        flat = (raw[t][flat].view(np.uint64) % np.uint64(v)).astype(np.int32)
      # As upstream's users pass them: one id per sample as a dense
      # [batch, 1] array, ragged rows as a list of per-sample arrays.
      if t in MULTI_HOT:
        ids.append(np.split(flat, np.cumsum(counts)[:-1]))
      else:
        ids.append(flat.reshape(BATCH, 1))
    labels = (rng.random(BATCH) < 1 / (1 + np.exp(-score / 2))).astype(
      np.float32
    )
    batches.append((dense, ids, labels))
  return batches


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  order = np.argsort(scores)
  ranks = np.empty(len(scores))
  ranks[order] = np.arange(1, len(scores) + 1)
  pos = labels > 0.5
  n_pos, n_neg = pos.sum(), (~pos).sum()
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def dense_init() -> dict[str, np.ndarray]:
  """The MLPs' initial weights (`[in, out]`, He-normal) and biases (zero),
  the same for both libraries."""
  rng = np.random.default_rng(1)
  shapes = {"b1": (DENSE, 64), "b2": (64, DIM), "t1": (27 * 26 // 2 + DIM, 64)}
  shapes["t2"] = (64, 1)
  params = {}
  for name, shape in shapes.items():
    params[name] = rng.normal(0, np.sqrt(2.0 / shape[0]), shape).astype(
      np.float32
    )
    params[f"{name}_bias"] = np.zeros(shape[1], np.float32)
  return params


# --- ours ---------------------------------------------------------------------


def feature_specs() -> dict:
  """Our 26 features, each with its own table (also built by
  tests/test_viz_dlrm.py)."""
  import jax

  import pz_sparsecore as pzsc

  features = {}
  for t, v in enumerate(VOCABS):
    table = pzsc.TableSpec(
      name=f"t{t:02d}",
      vocabulary_size=v,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(0.05),
      optimizer=table_optimizer(),
      combiner="mean",
      dtype=TABLE_DTYPE,
      **({"ids": "hashed", "eviction": "lru"} if IDS == "hashed" else {}),
    )
    k = 5 if t in MULTI_HOT else 1
    features[f"c{t:02d}"] = pzsc.FeatureSpec(
      name=f"c{t:02d}",
      table_spec=table,
      input_shape=(BATCH, k),
      output_shape=(BATCH, DIM),
    )
  return features


def run_ours(train, test, warmup: int) -> dict:
  os.environ.setdefault(
    "XLA_FLAGS", f"--xla_force_host_platform_device_count={DEVICES}"
  )
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh
  from penzai import pz

  import pz_sparsecore as pzsc

  t0 = time.perf_counter()
  features = feature_specs()
  mesh = Mesh(np.array(jax.devices()), ("device",))
  placement = PLACEMENT
  if placement == "small":
    placement = {
      f"t{t:02d}": "replicated" for t in range(len(BIG), len(VOCABS))
    }
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh, placement=placement
  )
  params = {
    label: pz.Parameter(value=jnp.asarray(value), label=label)
    for label, value in dense_init().items()
  }
  names = list(features)
  iu = np.triu_indices(27, 1)

  def forward(model, inputs, dense):
    acts = model["embed"](inputs)

    def linear(name, x):
      return x @ model[name].value + model[f"{name}_bias"].value

    x = linear("b2", jax.nn.relu(linear("b1", dense)))
    vecs = jnp.stack(
      [x] + [acts[n].unwrap("batch", "embedding") for n in names], axis=1
    )
    if INTERACTION == "library":
      inter = pzsc.dot_interaction(vecs)
    else:
      inter = jnp.einsum("bid,bjd->bij", vecs, vecs)[:, iu[0], iu[1]]
    h = jax.nn.relu(linear("t1", jnp.concatenate([x, inter], 1)))
    return linear("t2", h)[:, 0]

  def loss_fn(*, model, state, rng, inputs, dense, labels):
    del rng
    logits = forward(model, inputs, dense)
    loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
    return loss, state, {"loss": loss}

  model = {"embed": embed, **params}
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(2), model, optax.adam(DENSE_LR), loss_fn
  )
  build_s = time.perf_counter() - t0

  def prep(batch):
    dense, ids, labels = batch
    inputs, _ = trainer.model["embed"].preprocess(
      {n: ids[t] for t, n in enumerate(names)}
    )
    return {
      "inputs": inputs,
      "dense": dense,
      "labels": labels,
    }

  compiles = _CompileCounter()
  jax.config.update("jax_log_compiles", True)
  logging.getLogger("jax").addHandler(compiles)
  # The first step as the docs' loop takes it: `fit` (calibrating the
  # limits on the batch first, with REFRESH), the compile included.
  t0 = time.perf_counter()
  trainer.fit(train[:1], prep, refresh_limits_every=REFRESH)
  first_s = time.perf_counter() - t0
  prep_ms = [1e3 * _timed(lambda b=b: prep(b))[1] for b in train[:10]]
  ready = [prep(b) for b in train[1 : warmup + 1]]
  step_ms = []
  for kw in ready:
    t = time.perf_counter()
    jax.block_until_ready(trainer.step(**kw))
    step_ms.append(1e3 * (time.perf_counter() - t))
  rest = train[warmup + 1 :]
  t0 = time.perf_counter()
  trainer.fit(rest, prep, refresh_limits_every=REFRESH)
  e2e_ms = 1e3 * (time.perf_counter() - t0) / len(rest)
  eval_fn = pzsc.variable_jit(forward)
  scores, labels = [], []
  for batch in test:
    kw = prep(batch)
    scores.append(np.asarray(eval_fn(trainer.model, kw["inputs"], kw["dense"])))
    labels.append(batch[2])
  logging.getLogger("jax").removeHandler(compiles)

  def in_sequence(batch):
    jax.block_until_ready(trainer.step(**prep(batch)))

  return _result(
    (len(trainer.model["embed"].config.plan.stacks), compiles.count),
    (build_s, first_s, prep_ms, step_ms, e2e_ms),
    scores,
    labels,
    _sequence_ms(in_sequence, rest),
  )


SEQUENCE_BATCHES = 30
"""Batches timed in sequence after the held-out scores (more training)."""


def _sequence_ms(step, batches) -> float:
  """Median ms of host preprocessing then the step, one batch at a time
  (as TorchRec's loop runs; ours waits for each step), after the held-out
  scores."""
  times = [
    1e3 * _timed(lambda b=b: step(b))[1] for b in batches[:SEQUENCE_BATCHES]
  ]
  return statistics.median(times)


class _CompileCounter(logging.Handler):
  """Counts the compilations of the trainer's step (jax.log_compiles)."""

  def __init__(self):
    super().__init__(logging.WARNING)
    self.count = 0

  def emit(self, record: logging.LogRecord) -> None:
    if record.getMessage().startswith("Compiling jit(_trainer_step)"):
      self.count += 1


def _result(counts, times, scores, labels, sequence_ms) -> dict:
  """One library's row: `counts` = (stacks or tables, step compilations),
  `times` = (build s, first step s, preprocessing ms per batch, step ms per
  batch, end-to-end ms per step), `sequence_ms` the median of
  preprocessing then step, in sequence."""
  build_s, first_s, prep_ms, step_ms, e2e_ms = times
  return {
    "sequence_ms": sequence_ms,
    "stacks": counts[0],
    "compiles": counts[1],
    "build_s": build_s,
    "first_step_s": first_s,
    "prep_ms": statistics.median(prep_ms),
    "step_ms": statistics.median(step_ms),
    "e2e_ms": e2e_ms,
    "rss_gb": peak_rss_gb(),
    "auc": auc(np.concatenate(scores), np.concatenate(labels)),
  }


def _timed(fn):
  t = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t


# --- TorchRec -----------------------------------------------------------------


def run_torchrec(train, test, warmup: int) -> dict:
  import torch
  from torchrec.modules.embedding_configs import EmbeddingBagConfig
  from torchrec.modules.fused_embedding_modules import (
    FusedEmbeddingBagCollection,
  )
  from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

  torch.manual_seed(0)
  t0 = time.perf_counter()
  names = [f"c{t:02d}" for t in range(len(VOCABS))]
  tables = [
    EmbeddingBagConfig(
      num_embeddings=v,
      embedding_dim=DIM,
      name=f"t{t:02d}",
      feature_names=[names[t]],
      pooling=__import__("torchrec").PoolingType.MEAN,
      init_fn=lambda w: torch.nn.init.normal_(w, 0.0, 0.05),
    )
    for t, v in enumerate(VOCABS)
  ]
  from torchrec import optim as trec_optim

  ebc = FusedEmbeddingBagCollection(
    tables,
    optimizer_type=(
      trec_optim.RowWiseAdagrad
      if TABLE_OPTIMIZER == "rowwise_adagrad"
      else torch.optim.Adagrad
    ),
    optimizer_kwargs={"lr": TABLE_LR, "eps": 1e-8},
  )
  bottom = torch.nn.Sequential(
    torch.nn.Linear(DENSE, 64), torch.nn.ReLU(), torch.nn.Linear(64, DIM)
  )
  n_int = 27 * 26 // 2
  top = torch.nn.Sequential(
    torch.nn.Linear(n_int + DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
  )
  iu = torch.triu_indices(27, 27, 1)
  init = dense_init()
  with torch.no_grad():
    for name, layer in (
      ("b1", bottom[0]),
      ("b2", bottom[2]),
      ("t1", top[0]),
      ("t2", top[2]),
    ):
      layer.weight.copy_(torch.from_numpy(init[name].T))
      layer.bias.copy_(torch.from_numpy(init[f"{name}_bias"]))
  dense_opt = torch.optim.Adam(
    list(bottom.parameters()) + list(top.parameters()), lr=DENSE_LR
  )
  build_s = time.perf_counter() - t0

  def prep(batch):
    dense, ids, labels = batch
    lengths = np.concatenate(
      [
        np.full(len(f), f.shape[1])
        if isinstance(f, np.ndarray)
        else [len(r) for r in f]
        for f in ids
      ]
    )
    values = np.concatenate(
      [
        f.reshape(-1) if isinstance(f, np.ndarray) else np.concatenate(f)
        for f in ids
      ]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
      keys=names,
      values=torch.from_numpy(values.astype(np.int64)),
      lengths=torch.from_numpy(lengths.astype(np.int32)),
    )
    return kjt, torch.from_numpy(dense), torch.from_numpy(labels)

  def forward(kjt, dense):
    x = bottom(dense)
    pooled = ebc(kjt).values().view(-1, len(names), DIM)
    vecs = torch.cat([x[:, None, :], pooled], 1)
    inter = torch.bmm(vecs, vecs.transpose(1, 2))[:, iu[0], iu[1]]
    return top(torch.cat([x, inter], 1))[:, 0]

  def step(kjt, dense, labels):
    dense_opt.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
      forward(kjt, dense), labels
    )
    loss.backward()  # The tables' Adagrad runs inside, fused.
    dense_opt.step()
    return float(loss)

  prep_ms = [1e3 * _timed(lambda b=b: prep(b))[1] for b in train[:10]]
  t0 = time.perf_counter()
  step(*prep(train[0]))
  first_s = time.perf_counter() - t0
  ready = [prep(b) for b in train[1 : warmup + 1]]
  step_ms = [1e3 * _timed(lambda r=r: step(*r))[1] for r in ready]
  rest = train[warmup + 1 :]
  t0 = time.perf_counter()
  for batch in rest:
    step(*prep(batch))
  e2e_ms = 1e3 * (time.perf_counter() - t0) / len(rest)
  scores, labels = [], []
  with torch.no_grad():
    for batch in test:
      kjt, dense, lab = prep(batch)
      scores.append(forward(kjt, dense).numpy())
      labels.append(batch[2])
  return _result(
    (len(tables), 0),
    (build_s, first_s, prep_ms, step_ms, e2e_ms),
    scores,
    labels,
    _sequence_ms(lambda b: step(*prep(b)), rest),
  )


LIBS = {
  "ours": ("ours", "range"),
  "torchrec": ("torchrec", "range"),
  "ours-hashed": ("ours", "hashed"),
  "ours-modulo": ("ours", "modulo"),
}


def main() -> None:
  global REFRESH, PLACEMENT, TABLE_OPTIMIZER, TABLE_DTYPE, IDS, DEVICES
  global INTERACTION
  parser = argparse.ArgumentParser()
  parser.add_argument(
    "--libs",
    default="ours,torchrec",
    help="the two runs compared, first / second: ours, torchrec, "
    "ours-hashed (every table hashed, raw int64 ids), ours-modulo (range "
    "tables, the raw ids modulo the size)",
  )
  parser.add_argument("--ids", default=IDS, help=argparse.SUPPRESS)
  parser.add_argument(
    "--devices", type=int, default=DEVICES, help="ours: CPU devices"
  )
  parser.add_argument("--child", default=None)
  parser.add_argument("--batches", type=int, default=120)
  parser.add_argument("--test-batches", type=int, default=8)
  parser.add_argument("--warmup", type=int, default=10)
  parser.add_argument(
    "--repeat",
    type=int,
    default=1,
    help="runs of each library, alternated; the table gives medians",
  )
  parser.add_argument(
    "--refresh",
    type=int,
    default=REFRESH,
    help="ours: fit(refresh_limits_every=N) (FDO inside fit); 0: None",
  )
  parser.add_argument(
    "--placement",
    default=PLACEMENT,
    choices=("auto", "sharded", "small"),
    help="ours: from_config(placement=...); small: the 22 small tables "
    "replicated",
  )
  parser.add_argument(
    "--table-optimizer",
    default=TABLE_OPTIMIZER,
    choices=("adagrad", "rowwise_adagrad"),
    help="both libraries' tables: exact Adagrad or exact row-wise Adagrad",
  )
  parser.add_argument(
    "--table-dtype",
    default=TABLE_DTYPE,
    choices=("float32", "bfloat16", "float16"),
    help="ours: how the tables' rows are stored (TorchRec's stay float32)",
  )
  parser.add_argument(
    "--interaction",
    default=INTERACTION,
    choices=("library", "einsum"),
    help="ours: pzsc.dot_interaction (the docs' way) or einsum and fancy "
    "indexing (TorchRec's InteractionArch written in jnp)",
  )
  args = parser.parse_args()
  TABLE_DTYPE = args.table_dtype
  REFRESH = args.refresh or None
  PLACEMENT = args.placement
  TABLE_OPTIMIZER = args.table_optimizer
  IDS, DEVICES = args.ids, args.devices
  INTERACTION = args.interaction
  if args.child:
    data = make_data(args.batches + args.test_batches)
    train, test = data[: args.batches], data[args.batches :]
    fn = run_ours if args.child == "ours" else run_torchrec
    data_gb = peak_rss_gb()
    result = fn(train, test, args.warmup)
    print(json.dumps({**result, "rss_data_gb": data_gb}))
    return
  libs = args.libs.split(",")
  runs = {who: [] for who in libs}
  for _ in range(args.repeat):
    for who in libs:
      runs[who].append(_child_run(who, args))
      print(who, runs[who][-1], flush=True)
  load = os.getloadavg()[0]
  print(
    f"\n26-table DLRM, batch {BATCH}, {args.batches} training batches, "
    f"{args.test_batches} held out, tables {args.table_optimizer} (ours "
    f"{args.table_dtype}, {args.devices} devices, interaction "
    f"{args.interaction}); load "
    f"average {load:.1f}"
  )
  if any("error" in r for rs in runs.values() for r in rs):
    return
  _print_table(libs, runs)


def _child_run(who: str, args: argparse.Namespace) -> dict:
  """One library's run in its own process: its result row, or the error."""
  child, ids = LIBS[who]
  options = {
    "child": child,
    "ids": ids,
    "devices": args.devices,
    "batches": args.batches,
    "test-batches": args.test_batches,
    "warmup": args.warmup,
    "refresh": args.refresh,
    "placement": args.placement,
    "table-optimizer": args.table_optimizer,
    "table-dtype": args.table_dtype,
    "interaction": args.interaction,
  }
  command = [sys.executable, __file__]
  for key, value in options.items():
    command += [f"--{key}", str(value)]
  out = subprocess.run(command, capture_output=True, text=True)
  if out.returncode != 0:
    return {"error": out.stderr.strip().splitlines()[-1:]}
  return json.loads(out.stdout.strip().splitlines()[-1])


_ROWS = [
  ("stacks / tables", "stacks", "{:.0f}", False),
  ("step compilations", "compiles", "{:.0f}", False),
  ("model build, s", "build_s", "{:.2f}", True),
  ("first step (compile), s", "first_step_s", "{:.2f}", True),
  ("host preprocessing, ms/batch", "prep_ms", "{:.2f}", True),
  ("step, batch ready, ms", "step_ms", "{:.2f}", True),
  ("end to end, ms/step", "e2e_ms", "{:.2f}", True),
  ("preprocessing then step, in sequence, ms", "sequence_ms", "{:.2f}", True),
  ("peak RSS, GB", "rss_gb", "{:.2f}", True),
  ("RSS with the batches only, GB", "rss_data_gb", "{:.2f}", True),
  ("held-out AUC", "auc", "{:.4f}", False),
]


def _print_table(libs: list[str], runs: dict[str, list[dict]]) -> None:
  """Each row's median over the runs, the two libraries side by side; with
  several runs, also each pair's in-sequence ratio (the pairs alternate,
  so each pair saw the same machine)."""
  a, b = libs
  o, t = (
    {
      key: statistics.median(r[key] for r in runs[who])
      for _, key, _, _ in _ROWS
    }
    for who in libs
  )
  repeat = len(runs[a])
  if repeat > 1:
    print(f"(medians of {repeat} alternated runs of each)")
  width = max(len(label) for label, *_ in _ROWS)
  print(f"{'':{width}} {a:>12} {b:>12} {a + '/' + b:>26}")
  for label, key, fmt, ratio in _ROWS:
    r = f"{o[key] / t[key]:.2f}" if ratio and t[key] else ""
    print(
      f"{label:{width}} {fmt.format(o[key]):>12} {fmt.format(t[key]):>12} "
      f"{r:>26}"
    )
  if repeat > 1:
    pairs = [
      x["sequence_ms"] / y["sequence_ms"]
      for x, y in zip(runs[a], runs[b], strict=True)
    ]
    print(
      "in sequence, each pair's ratio: "
      + ", ".join(f"{r:.2f}" for r in pairs)
      + f" (median {statistics.median(pairs):.2f})"
    )


if __name__ == "__main__":
  main()
