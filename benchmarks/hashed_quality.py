"""Hashed tables against modulo hashing, on a drifting stream of raw ids.

Run: ``python benchmarks/hashed_quality.py`` (about 2 minutes on 2 CPU
cores; ``--steps``, ``--batch``, ``--ranks`` and ``--drift`` size the
stream, ``--variants`` picks among `VARIANTS`; ``--devices 8`` runs on 8
virtual CPU devices, a table in 8 shards). The markdown table prints
last; the figure goes to ``docs/images/hashed_quality.png``
(``--figure``), and with ``--json PATH`` every number and series to PATH.

The stream: two categorical features, ``user`` and ``item``, one raw id
each per sample, ``--batch`` (1,024) samples per step, ``--steps`` (400)
steps. Per sample and feature a rank ``r >= 0`` is drawn Zipf(1.1) over
``--ranks`` (20,000) ranks and names an index around the step's offset
``o(t) = floor(t * drift)`` (``--drift`` 50): even ranks ahead of it
(``o + r / 2``), odd ranks behind (``o - (r + 1) / 2``). An index is rare
while the offset is far ahead, rises to the head as the offset reaches
it, fades as the offset moves on, and goes cold once the offset is
``ranks / 2`` past it. With the defaults the offset moves 20,000 indices
over the run, the popular set's whole width: the ids popular in the
first steps are cold in the last ones. A feature's id is ``mix64(index
+ salt) % 10**9``, an int64 from a space of 10**9 ids; the defaults give
about 27,500 distinct ids per feature, seen 15 times each on average.
Labels come from a hidden model of the ids: per id a score ``s ~ N(0,
1)`` and a vector ``h ~ N(0, 0.5**2 I_4)``, functions of the id alone
(hashes of the id and a draw number, `_normal`), and ``P(label = 1) =
sigmoid(s_user + s_item + <h_user, h_item>)``. Only a row of its own lets
an id's embedding learn its ``s`` and ``h``; the AUC of the hidden
logits themselves prints as the ceiling.

The model: the two 16-wide embeddings ``e_u``, ``e_i`` into a dot and
linear head, ``logit = <e_u, e_i> + w_u . e_u + w_i . e_i + b``, logistic
loss (mean over the batch). Tables learn with Adagrad (``--table-lr``
0.05, accumulators from 0), the head with Adam (``--dense-lr`` 0.01);
`SparseCoreTrainer` on a mesh of ``--devices`` CPU devices (1).

The variants (`VARIANTS`), each a table per feature whose capacity is a
fraction of that feature's distinct ids over the whole stream (rounded
up to whole shards of 8-aligned rows):

* ``unbounded``: `ids="hashed"`, twice the distinct ids (nothing needs
  evicting; the evictions print);
* ``lru 1/2``, ``lru 1/4``: hashed, `eviction="lru"`;
* ``lfu 1/2``: `eviction="lfu"`, counts never decaying; ``lfu/20 1/2``:
  `Eviction("lfu", decay_steps=20)`;
* ``mod 1/2``, ``mod 1/4`` (and ``mod 2x``, the unbounded variant's
  capacity): a range table of that many rows fed ``mix64(id) %
  capacity``, the collision baseline.

Measured, per variant: progressive validation AUC (each batch scored by
the model before it trains on it, by an inference call: a hashed table's
ids that hold no row read a zero row) over the second half of the
stream, the AUC of the final window of ``--window`` (20) steps, and the
AUC per window. For the modulo tables, the fraction of the stream's
distinct ids whose row holds another of them. For the hashed ones, the
per-shard counters summed (`embed.maps[table]["counters"]`): ids evicted
and refused, held ids over the capacity at the end (occupancy), and the
fraction of each batch's distinct ids that held no row when the batch was
scored (unseen at scoring: the map counts distinct ids per call); per
step, the occupancy and the cumulative evictions (the figure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ID_SPACE = 10**9
ZIPF = 1.1
DIM = 16
HIDDEN_DIM = 4
HIDDEN_SCALE = 0.5
TABLE_LR, DENSE_LR = 0.05, 1e-2
FEATURES = ("user", "item")
SALTS = {"user": 1, "item": 2}
UNBOUNDED = 2.0  # The unbounded variant's capacity over the distinct ids.
# (label, policy, capacity over the distinct ids): policy "mod" is a range
# table fed `mix64(id) % capacity`; "lfu/20" is lfu with `decay_steps=20`.
VARIANTS = (
  ("unbounded", "lru", UNBOUNDED),
  ("lru 1/2", "lru", 1 / 2),
  ("lru 1/4", "lru", 1 / 4),
  ("lfu 1/2", "lfu", 1 / 2),
  ("lfu/20 1/2", "lfu/20", 1 / 2),
  ("mod 2x", "mod", UNBOUNDED),
  ("mod 1/2", "mod", 1 / 2),
  ("mod 1/4", "mod", 1 / 4),
)
FIGURE = "docs/images/hashed_quality.png"


# --- the stream ---------------------------------------------------------------


def _uniform(ids: np.ndarray, draw: int) -> np.ndarray:
  """A uniform in (0, 1) per id and draw number: a hash of both."""
  from pz_sparsecore.core.hashed import mix64

  with np.errstate(over="ignore"):
    key = mix64(ids) + np.uint64(draw + 1) * np.uint64(0x9E3779B97F4A7C15)
  bits = mix64(key.view(np.int64)) >> np.uint64(11)
  return (bits.astype(np.float64) + 0.5) * 2.0**-53


def _normal(ids: np.ndarray, draw: int) -> np.ndarray:
  """A standard normal per id and draw number (Box-Muller of two hashes)."""
  u1, u2 = _uniform(ids, 2 * draw), _uniform(ids, 2 * draw + 1)
  return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)


def hidden(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Each id's hidden score `[n]` and vector `[n, HIDDEN_DIM]`."""
  score = _normal(ids, 0)
  vec = np.stack([_normal(ids, 1 + k) for k in range(HIDDEN_DIM)], -1)
  return score, HIDDEN_SCALE * vec


def make_stream(args: argparse.Namespace) -> dict[str, np.ndarray]:
  """Per feature the raw ids `[steps, batch]` (int64), `labels` `[steps,
  batch]` (float32) and the hidden model's `logits` (float64)."""
  from pz_sparsecore.core.hashed import mix64

  rng = np.random.default_rng(args.seed)
  cdf = np.cumsum(np.arange(1, args.ranks + 1, dtype=np.float64) ** -ZIPF)
  cdf /= cdf[-1]
  offset = (np.arange(args.steps) * args.drift).astype(np.int64)[:, None]
  out, logit = {}, 0.0
  vecs = []
  for name in FEATURES:
    r = np.searchsorted(cdf, rng.random((args.steps, args.batch)))
    index = np.where(r % 2 == 0, offset + r // 2, offset - (r + 1) // 2)
    words = mix64(index + SALTS[name] * 2**40)
    ids = (words % np.uint64(ID_SPACE)).astype(np.int64)
    score, vec = hidden(ids.reshape(-1))
    logit = logit + score
    vecs.append(vec)
    out[name] = ids
  logit = logit + np.sum(vecs[0] * vecs[1], -1)
  out["logits"] = logit.reshape(args.steps, args.batch)
  p = 1 / (1 + np.exp(-out["logits"]))
  out["labels"] = (rng.random(p.shape) < p).astype(np.float32)
  return out


# --- AUC ----------------------------------------------------------------------


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """ROC AUC by ranks (tied scores share their mean rank)."""
  scores = np.asarray(scores, np.float64).reshape(-1)
  pos = np.asarray(labels).reshape(-1) > 0.5
  _, inverse, counts = np.unique(
    scores, return_inverse=True, return_counts=True
  )
  mean_rank = np.cumsum(counts) - (counts - 1) / 2  # 1-based.
  ranks = mean_rank[inverse]
  n_pos, n_neg = pos.sum(), (~pos).sum()
  return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _pairwise_auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """AUC by counting every (positive, negative) pair; ties count 1/2."""
  s_pos = scores[labels > 0.5][:, None]
  s_neg = scores[labels <= 0.5][None, :]
  wins = (s_pos > s_neg).sum() + 0.5 * (s_pos == s_neg).sum()
  return float(wins / (s_pos.size * s_neg.size))


def check_auc() -> None:
  """`auc` equals the pairwise count on small inputs with many ties."""
  rng = np.random.default_rng(0)
  for n in (2, 7, 50, 301):
    labels = (rng.random(n) < 0.4).astype(np.float32)
    labels[:2] = (0, 1)
    scores = rng.integers(0, 6, n).astype(np.float32)  # Ties.
    want = _pairwise_auc(scores, labels)
    got = auc(scores, labels)
    if abs(got - want) > 1e-12:
      raise RuntimeError(f"auc {got} != pairwise {want} (n = {n})")


# --- one variant --------------------------------------------------------------


def capacity_of(distinct: int, fraction: float, shards: int) -> int:
  """`fraction` of `distinct` rows, rounded up to whole shards of aligned
  rows (so the plan's rows are the capacity)."""
  from pz_sparsecore.core import buffer_format

  rows = int(np.ceil(distinct * fraction))
  return int(buffer_format.round_up(rows, buffer_format.ALIGNMENT * shards))


def collided(ids: np.ndarray, capacity: int) -> float:
  """The fraction of the distinct `ids` whose row `mix64(id) % capacity`
  holds another of them."""
  from pz_sparsecore.core.hashed import mix64

  distinct = np.unique(ids)
  rows = mix64(distinct) % np.uint64(capacity)
  _, inverse, counts = np.unique(rows, return_inverse=True, return_counts=True)
  return float(np.mean(counts[inverse] > 1))


def _eviction(policy: str):
  """`"lfu/20"`: lfu with counts halving every 20 steps; else the name."""
  import pz_sparsecore as pzsc

  name, _, decay = policy.partition("/")
  return pzsc.Eviction(name, decay_steps=int(decay) if decay else None)


def build(policy: str, capacities: dict[str, int], args) -> tuple:
  """The variant's trainer and its forward `(model, inputs) -> logits`."""
  import jax
  import jax.numpy as jnp
  import optax
  from jax.sharding import Mesh
  from penzai import pz

  import pz_sparsecore as pzsc

  mesh = Mesh(np.array(jax.devices()[: args.devices]), ("device",))
  hashed = policy != "mod"
  specs = {}
  for name in FEATURES:
    table = pzsc.TableSpec(
      name=name,
      vocabulary_size=capacities[name],
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=pzsc.AdagradOptimizerSpec(
        learning_rate=args.table_lr, initial_accumulator_value=0.0
      ),
      combiner="sum",
      ids="hashed" if hashed else "range",
      eviction=_eviction(policy) if hashed else None,
    )
    specs[name] = pzsc.FeatureSpec(
      name=name,
      table_spec=table,
      input_shape=(args.batch, 1),
      output_shape=(args.batch, DIM),
    )
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), specs, mesh, stacking=None
  )
  plan = embed.config.plan
  rows = {s.name: s.rows_per_shard * plan.num_shards for s in plan.stacks}
  if rows != capacities:
    raise RuntimeError(f"the plan's rows {rows} are not {capacities}")
  model = {
    "embed": embed,
    "w": pz.Parameter(value=jnp.zeros((2, DIM)), label="w"),
    "b": pz.Parameter(value=jnp.zeros(()), label="b"),
  }

  def forward(model, inputs):
    acts = model["embed"](inputs)
    e_u = acts["user"].unwrap("batch", "embedding")
    e_i = acts["item"].unwrap("batch", "embedding")
    w = model["w"].value
    return jnp.sum(e_u * e_i, -1) + e_u @ w[0] + e_i @ w[1] + model["b"].value

  def loss_fn(*, model, state, rng, inputs, labels):
    del rng
    loss = jnp.mean(
      optax.sigmoid_binary_cross_entropy(forward(model, inputs), labels)
    )
    return loss, state, {"loss": loss}

  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), model, optax.adam(args.dense_lr), loss_fn
  )
  return trainer, forward


def run_variant(policy: str, capacities: dict[str, int], stream, args) -> dict:
  """Trains one variant on the stream with progressive validation: each
  step scores its batch (an inference call), then trains on it."""
  import pz_sparsecore as pzsc
  from pz_sparsecore.core.hashed import mix64

  hashed = policy != "mod"
  trainer, forward = build(policy, capacities, args)
  score = pzsc.variable_jit(forward)

  def features(t):
    out = {}
    for name in FEATURES:
      ids = stream[name][t].reshape(-1, 1)
      if not hashed:
        ids = (mix64(ids) % np.uint64(capacities[name])).astype(np.int32)
      out[name] = ids
    return out

  t0 = time.perf_counter()
  scores = np.empty((args.steps, args.batch), np.float32)
  counters = []
  for t in range(args.steps):
    inputs, _ = trainer.model["embed"].preprocess(features(t))
    scores[t] = np.asarray(score(trainer.model, inputs))
    trainer.step(inputs=inputs, labels=stream["labels"][t])
    if hashed:
      maps = trainer.model["embed"].maps
      counters.append(
        [np.asarray(maps[n]["counters"].value).sum(0) for n in FEATURES]
      )
  seconds = time.perf_counter() - t0
  rows = [capacities[n] for n in FEATURES]
  return _report(scores, np.asarray(counters), rows, seconds, stream, args)


def _report(scores, counters, rows, seconds, stream, args) -> dict:
  """A variant's numbers from its scores `[steps, batch]`, its counters
  (`[steps, feature, COUNTERS]`, empty for a range table) and its rows
  per feature."""
  from pz_sparsecore.core.hashed import COUNTERS

  labels = stream["labels"]
  half, w = args.steps // 2, args.window
  windows = [
    auc(scores[s : s + w], labels[s : s + w])
    for s in range(0, args.steps - w + 1, w)
  ]
  out = {
    "auc": auc(scores[half:], labels[half:]),
    "final_auc": windows[-1],
    "window_auc": windows,
    "rows": rows,
    "seconds": seconds,
  }
  if len(counters):
    held, evicted, refused, unseen = (
      COUNTERS.index(c) for c in ("held", "evicted", "refused", "unseen")
    )
    cap = np.array(rows, np.float64)
    out["occupancy"] = (counters[:, :, held] / cap).tolist()
    out["evicted"] = counters[:, :, evicted].tolist()
    out["refused"] = counters[-1, :, refused].tolist()
    # The map counts each batch's distinct ids once.
    distinct = [sum(len(np.unique(b)) for b in stream[n]) for n in FEATURES]
    out["unseen"] = (counters[-1, :, unseen] / np.array(distinct)).tolist()
  else:
    out["collided"] = [
      collided(stream[n], r) for n, r in zip(FEATURES, rows, strict=True)
    ]
  return out


# --- report -------------------------------------------------------------------


def _pair(values, fmt: str) -> str:
  """The user and item values as `"u / i"`."""
  return " / ".join(fmt.format(v) for v in values)


def print_table(results: dict, stream: dict, args, load: float) -> None:
  """The stream's summary line and the variants' markdown table."""
  distinct = {n: len(np.unique(stream[n])) for n in FEATURES}
  half = args.steps // 2
  oracle = auc(stream["logits"][half:], stream["labels"][half:])
  print(
    f"\nDrifting stream: {args.steps} steps of {args.batch} samples, "
    f"features {' / '.join(FEATURES)}, Zipf({ZIPF}) over {args.ranks} "
    f"ranks, drift {args.drift} indices per step, ids in [0, 10**9); "
    f"distinct ids {_pair(distinct.values(), '{:,}')}; AUC of the hidden "
    f"model's own logits over the 2nd half {oracle:.4f}; "
    f"{args.devices} device(s); load average {load:.2f}\n"
  )
  print(
    "| variant | rows (user / item) | rows / distinct | AUC, 2nd half "
    "| AUC, final window | ids sharing a row | evicted | refused "
    "| occupancy at end | unseen at scoring | seconds |"
  )
  print("|" + "---|" * 11)
  for label, r in results.items():
    frac = [
      rows / distinct[n] for rows, n in zip(r["rows"], FEATURES, strict=True)
    ]
    hashed = "occupancy" in r
    cells = [
      label,
      _pair(r["rows"], "{:,}"),
      _pair(frac, "{:.2f}"),
      f"{r['auc']:.4f}",
      f"{r['final_auc']:.4f}",
      "" if hashed else _pair(r["collided"], "{:.1%}"),
      _pair(r["evicted"][-1], "{:,}") if hashed else "",
      _pair(r["refused"], "{:,}") if hashed else "",
      _pair(r["occupancy"][-1], "{:.1%}") if hashed else "",
      _pair(r["unseen"], "{:.1%}") if hashed else "",
      f"{r['seconds']:.0f}",
    ]
    print("| " + " | ".join(cells) + " |")


def plot(results: dict, args, path: str) -> bool:
  """The figure: occupancy and cumulative evictions of the hashed tables
  per step, AUC per window of every variant. False without matplotlib."""
  try:
    import matplotlib
  except ImportError:
    return False
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  steps = np.arange(1, args.steps + 1)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for i, (label, r) in enumerate(results.items()):
    color = colors[i % len(colors)]
    if "occupancy" in r:
      for k, style in ((0, "-"), (1, "--")):
        occ = np.asarray(r["occupancy"])[:, k]
        ev = np.asarray(r["evicted"])[:, k]
        name = f"{label}, {FEATURES[k]}"
        lw = 3 - 2 * i / len(results)
        axes[0].plot(steps, occ, style, lw=lw, color=color, label=name)
        axes[1].plot(steps, ev, style, lw=lw, color=color, label=name)
    ends = np.arange(1, len(r["window_auc"]) + 1) * args.window
    style = ":" if "occupancy" not in r else "-"
    # Later lines thinner: variants with equal series stay visible.
    axes[2].plot(
      ends,
      r["window_auc"],
      style,
      lw=3 - 2 * i / len(results),
      marker="o",
      ms=3,
      color=color,
      label=label,
    )
  axes[0].set(title="held ids / capacity", xlabel="step")
  axes[1].set(title="ids evicted (cumulative)", xlabel="step")
  axes[2].set(title=f"progressive AUC per {args.window} steps", xlabel="step")
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  return True


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--ranks", type=int, default=20_000)
  parser.add_argument(
    "--drift", type=float, default=50.0, help="indices per step"
  )
  parser.add_argument("--window", type=int, default=20, help="steps")
  parser.add_argument("--table-lr", type=float, default=TABLE_LR)
  parser.add_argument("--dense-lr", type=float, default=DENSE_LR)
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--variants",
    default=",".join(v[0] for v in VARIANTS),
    help="comma-separated labels of VARIANTS",
  )
  parser.add_argument("--figure", default=FIGURE)
  parser.add_argument("--json", default=None, help="write the series here")
  args = parser.parse_args()
  if args.devices > 1:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={args.devices}"
    )
  check_auc()
  stream = make_stream(args)
  distinct = {n: len(np.unique(stream[n])) for n in FEATURES}
  chosen = args.variants.split(",")
  unknown = set(chosen) - {v[0] for v in VARIANTS}
  if unknown:
    sys.exit(f"unknown variants {sorted(unknown)}; have {VARIANTS}")
  results, loads = {}, []
  for label, policy, fraction in VARIANTS:
    if label not in chosen:
      continue
    caps = {
      n: capacity_of(distinct[n], fraction, args.devices) for n in FEATURES
    }
    results[label] = run_variant(policy, caps, stream, args)
    loads.append(os.getloadavg()[0])
    print(
      f"{label}: AUC {results[label]['auc']:.4f}, "
      f"{results[label]['seconds']:.0f} s",
      flush=True,
    )
  print_table(results, stream, args, max(loads))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"distinct": distinct, "variants": results}, f)
  if plot(results, args, args.figure):
    print(f"\nfigure: {args.figure}")
  else:
    print("\nmatplotlib is not installed: no figure (see --json)")


if __name__ == "__main__":
  main()
