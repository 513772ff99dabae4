"""Forward and train step through each documented path, against raw `jax.jit`.

Run: ``.venv/bin/python benchmarks/jit_paths.py [--vocabs 16,20,24]``.

Model: a Penzai model of a `SparseCoreEmbed` (one feature, 2048 samples x 8
ids, sum combiner, a ``[vocab, 32]`` table with Adagrad) and an MLP head
(Linear 32 -> 64, ReLU, Linear 64 -> 16), squared-error loss, optax Adam on
the head; 8 virtual CPU devices. Each vocabulary runs in its own subprocess;
inside it every path runs on the same model and batches, the paths
interleaved round by round (same load), median of the rounds.

Paths (the ``raw`` rows are the reference: plain `jax.jit` over the arrays,
calling `routing.lookup` / `routing.apply_gradients` directly, tables,
slots, head and optimizer state donated):

* forward: ``pzsc.variable_jit(lambda m, x: m(x))`` (the README's call);
  ``pz.variable_jit(..., donate_variables=True)``; and ``pz.variable_jit``
  without donation, which copies every table and slot on every call (shown
  for scale; the docs say not to use it with tables).
* train step: ``SparseCoreTrainer.step``; the hand-written step under
  ``pzsc.variable_jit(..., donate_variables=True)``; the same step under
  ``pz.variable_jit(..., donate_variables=True)``.

Goal: every documented path within 1.2x of the raw path at every
vocabulary, and flat in the vocabulary: its time at the largest vocabulary
over its time at the smallest (the ``flat`` column) at most 1.2x the raw
path's. The raw path itself reads the same number of rows at every
vocabulary, from a table in cache at 2**16 and from memory at 2**24; an
O(vocabulary) path grows with the vocabulary (the not-donating row, timed
after the others with at most 5 rounds: each of its calls allocates and
frees a copy of every table and slot).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

# 8 virtual CPU devices, before anything imports jax (importing the library
# already creates the CPU backend).
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  ).strip()

import _embeds  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from penzai import pz  # noqa: E402

import pz_sparsecore as pzsc  # noqa: E402
from pz_sparsecore.device import routing  # noqa: E402
from pz_sparsecore.nn.tables import (  # noqa: E402
  assign_arrays,
  slot_arrays,
  table_arrays,
)

BATCH, IDS, DIM, HIDDEN, OUT = 2048, 8, 32, 64, 16
WARMUP, ROUNDS = 2, 15
GOAL = 1.2
OPTIMIZER = optax.adam(1e-3)


@pz.pytree_dataclass
class Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Sequential

  def __call__(self, inputs, /, **side_inputs):
    return self.head(self.embed(inputs)["ids"])


def build(vocab: int) -> tuple[Model, list]:
  """The model and four preprocessed batches `(inputs, targets)`."""
  rng = np.random.default_rng(0)
  ids = [rng.integers(0, vocab, (BATCH, IDS)) for _ in range(4)]
  embed = _embeds.one_feature(
    vocab,
    DIM,
    (BATCH, IDS),
    pzsc.AdagradOptimizerSpec(learning_rate=0.05),
    ids,
  )
  k1, k2 = jax.random.split(jax.random.key(1))
  head = pz.nn.Sequential(
    [
      pz.nn.Linear.from_config("h1", k1, {"embedding": DIM}, {"h": HIDDEN}),
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Linear.from_config("h2", k2, {"h": HIDDEN}, {"out": OUT}),
    ]
  )
  batches = [
    (
      embed.preprocess({"ids": x})[0],
      jnp.asarray(rng.normal(size=(BATCH, OUT)), jnp.float32),
    )
    for x in ids
  ]
  return Model(embed=embed, head=head), batches


def mse(out: pz.nx.NamedArray, targets: jax.Array) -> jax.Array:
  return jnp.mean((out.unwrap("batch", "out") - targets) ** 2)


def forward_paths(model: Model) -> dict:
  """Path name → function of `(inputs, targets)`."""
  config = model.embed.config
  head_model, _ = pz.unbind_params(model.head, freeze=True)

  @jax.jit
  def raw(tables, params, inputs):
    flat = routing.lookup(config.plan, config.topology, tables, inputs)
    acts = pz.nx.wrap(flat["ids"]).tag("batch", "embedding")
    return pz.bind_variables(head_model, params)(acts)

  def call(m, inputs):
    return m(inputs)

  ours = pzsc.variable_jit(call)
  donating = pz.variable_jit(call, donate_variables=True)
  copying = pz.variable_jit(call)
  return {
    "raw": lambda x, t: raw(
      table_arrays(model.embed),
      pz.unbind_params(model.head, freeze=True)[1],
      x,
    ),
    "pzsc.variable_jit": lambda x, t: ours(model, x),
    "pz.variable_jit, donating": lambda x, t: donating(model, x),
    COPYING: lambda x, t: copying(model, x),
  }


def hand_written_step(embed, head, opt_state, inputs, targets, step):
  """The training step of the docs, for `variable_jit` (either one)."""
  acts = embed(inputs)
  head_model, head_params = pz.unbind_params(head, freeze=True)

  def loss_of(params, acts):
    return mse(pz.bind_variables(head_model, params)(acts["ids"]), targets)

  loss, (g_params, g_acts) = jax.value_and_grad(loss_of, (0, 1))(
    head_params, acts
  )
  embed.apply_gradients(inputs, g_acts, step)
  updates, opt_state = OPTIMIZER.update(g_params, opt_state, head_params)
  new_params = optax.apply_updates(head_params, updates)
  for var, new in zip(pz.unbind_params(head)[1], new_params, strict=True):
    var.value = new.value
  return loss, opt_state


def raw_step_fn(model: Model):
  """The same step over arrays: `routing.lookup` / `apply_gradients`."""
  config = model.embed.config
  head_model, _ = pz.unbind_params(model.head, freeze=True)

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2, 3))
  def raw(tables, slots, params, opt_state, inputs, targets, step):
    flat = routing.lookup(config.plan, config.topology, tables, inputs)

    def loss_of(params, flat):
      acts = pz.nx.wrap(flat["ids"]).tag("batch", "embedding")
      return mse(pz.bind_variables(head_model, params)(acts), targets)

    loss, (g_params, g_flat) = jax.value_and_grad(loss_of, (0, 1))(params, flat)
    tables, slots = routing.apply_gradients(
      config.plan, config.topology, tables, slots, inputs, g_flat, step
    )
    updates, opt_state = OPTIMIZER.update(g_params, opt_state, params)
    return tables, slots, optax.apply_updates(params, updates), opt_state, loss

  return raw


def step_paths(model: Model) -> dict:
  """Path name → function of `(inputs, targets)` running one step."""
  _, head_params = pz.unbind_params(model.head, freeze=True)
  state = {"opt": OPTIMIZER.init(head_params), "step": 0}
  raw = raw_step_fn(model)

  def run_raw(inputs, targets):
    params = pz.unbind_params(model.head, freeze=True)[1]
    tables, slots, params, state["opt"], loss = raw(
      table_arrays(model.embed),
      slot_arrays(model.embed),
      params,
      state["opt"],
      inputs,
      targets,
      jnp.int32(0),
    )
    assign_arrays(model.embed, tables, slots)
    for var, new in zip(pz.unbind_params(model.head)[1], params, strict=True):
      var.value = new.value
    return loss

  def jitted(variable_jit):
    fn = variable_jit(hand_written_step, donate_variables=True)

    def run(inputs, targets):
      loss, state["opt"] = fn(
        model.embed, model.head, state["opt"], inputs, targets, jnp.int32(0)
      )
      return loss

    return run

  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(2),
    model,
    OPTIMIZER,
    lambda *, model, state, rng, inputs, targets: (
      mse(model(inputs), targets),
      state,
      {},
    ),
  )
  return {
    "raw": run_raw,
    "SparseCoreTrainer.step": lambda x, t: (
      trainer.step(inputs=x, targets=t) or trainer.state.value.step
    ),
    "pzsc.variable_jit, donating": jitted(pzsc.variable_jit),
    "pz.variable_jit, donating": jitted(pz.variable_jit),
  }


def time_paths(paths: dict, batches: list, rounds: int) -> dict[str, float]:
  """Median seconds of each path, the paths interleaved round by round."""
  for fn in paths.values():
    for i in range(WARMUP):
      jax.block_until_ready(fn(*batches[i % len(batches)]))
  times = {name: [] for name in paths}
  for r in range(rounds):
    for name, fn in paths.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*batches[r % len(batches)]))
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def child(vocab: int, rounds: int) -> None:
  model, batches = build(vocab)
  forward = forward_paths(model)
  # Timed on its own, after the others: each of its calls allocates and
  # frees a copy of every table and slot, which would slow whichever path
  # runs next in a round.
  copying = {COPYING: forward.pop(COPYING)}
  result = {
    "forward": time_paths(forward, batches, rounds)
    | time_paths(copying, batches, min(rounds, 5)),
    "train step": time_paths(step_paths(model), batches, rounds),
  }
  print("RESULT " + json.dumps(result))


def measure(vocab: int, rounds: int) -> dict:
  out = subprocess.run(
    [sys.executable, __file__, "--child", str(vocab), "--rounds", str(rounds)],
    capture_output=True,
    text=True,
    check=False,
  )
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT ") :])
  raise RuntimeError(f"vocab {vocab} failed:\n{out.stderr[-4000:]}")


COPYING = "pz.variable_jit, not donating"
DOCUMENTED = {
  "pzsc.variable_jit",
  "pz.variable_jit, donating",
  "SparseCoreTrainer.step",
  "pzsc.variable_jit, donating",
}


def report(results: dict[int, dict], rounds: int) -> str:
  vocabs = sorted(results)
  small = vocabs[0]
  names = [f"2**{v.bit_length() - 1}" for v in vocabs]
  header = (
    f"{'':<11}{'path':<31}"
    + "".join(f"{'ms ' + n:>10}" for n in names)
    + "".join(f"{'/raw ' + n:>11}" for n in names)
    + f"{'flat':>7}  goal"
  )
  lines = [
    f"batch {BATCH} x {IDS} ids, table [vocab, {DIM}] Adagrad, MLP head "
    f"{DIM}->{HIDDEN}->{OUT}, Adam; 8 virtual CPU devices, "
    f"{os.cpu_count()} cores; median of {rounds} interleaved rounds",
    header,
    "-" * len(header),
  ]
  met = True
  for kind in ("forward", "train step"):
    raw = [results[v][kind]["raw"] for v in vocabs]
    for name in results[small][kind]:
      ms = [results[v][kind][name] for v in vocabs]
      ratios = [t / r for t, r in zip(ms, raw, strict=True)]
      flat = ms[-1] / ms[0]
      if name == "raw":
        verdict = "reference"
      elif name in DOCUMENTED:
        # Flat: growing no faster than the raw path's own time.
        ok = max(ratios) <= GOAL and flat <= GOAL * raw[-1] / raw[0]
        met &= ok
        verdict = "met" if ok else "NOT met"
      else:
        verdict = "not documented for tables"
      lines.append(
        f"{kind:<11}{name:<31}"
        + "".join(f"{t * 1e3:10.2f}" for t in ms)
        + "".join(f"{r:11.2f}" for r in ratios)
        + f"{flat:7.2f}  {verdict}"
      )
  lines.append(
    f"goal: each documented path <= {GOAL}x raw at every vocabulary, and "
    f"its growth from 2**{small.bit_length() - 1} (flat) <= {GOAL}x the "
    "raw path's: " + ("met" if met else "NOT met")
  )
  lines.append(
    "the raw path's own growth is the kernels': the same number of rows "
    "read from a table in cache at small vocabularies and from memory at "
    "large ones; an O(vocabulary) path grows with the vocabulary itself "
    "(the not-donating row)"
  )
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--vocabs", default="16,20,24")
  parser.add_argument("--rounds", type=int, default=ROUNDS)
  parser.add_argument("--child", type=int, default=None)
  args = parser.parse_args()
  if args.child is not None:
    child(args.child, args.rounds)
    return
  results = {}
  for bits in (int(b) for b in args.vocabs.split(",")):
    print(f"measuring vocab 2**{bits} ...", file=sys.stderr)
    results[2**bits] = measure(2**bits, args.rounds)
  print(report(results, args.rounds))


if __name__ == "__main__":
  main()
