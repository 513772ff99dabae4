"""Train-step benchmark: vocabulary independence and Penzai's dense baseline.

Run: ``.venv/bin/python benchmarks/train_step.py`` (prints one table).

Model: one feature of 2048 samples x 8 ids (sum combiner) looked up in a
``[vocab, 32]`` table, a ``Linear`` head (embedding -> 16) and a scalar
squared-error loss, on 8 virtual CPU devices.

* (a) ``SparseCoreEmbed`` + ``SparseCoreTrainer`` with Adagrad on the table,
  vocab 2**16 and 2**24, same batches: the ratio of median step times
  (goal < 1.3: a step's cost must not grow with the vocabulary).
* (b) vocab 2**20 with Adam: ours vs Penzai's own ``EmbeddingTable`` +
  ``EmbeddingLookup`` trained with ``optax.adam`` on the dense gradient (a
  hand-written jitted step with donation; table rows sharded over the
  devices like ours). Speed-up goal >= 20x.
* (c) vocab 2**20 with Adagrad, once with each exchange forced
  (``exchange="activations"`` and ``"rows"``): step times side by side with
  each exchange's predicted collective bytes per device per step
  (``pz_sparsecore.device.exchange``), and which one ``"auto"`` picks.

Each configuration runs in its own subprocess. Step time: median of 20 steps
after 3 warm-up steps, preprocessing excluded (batches are preprocessed
beforehand, as an input pipeline would). Memory: ``VmRSS`` after init and
warm-up, then the peak (``VmHWM``, reset through ``/proc/self/clear_refs``)
during the timed steps; "peak delta" is their difference, "peak RSS" the
process's lifetime maximum (``ru_maxrss``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

BATCH, IDS, DIM, OUT = 2048, 8, 32, 16
WARMUP, STEPS, NUM_BATCHES = 3, 20, 4

# 8 virtual CPU devices, before anything imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
  ).strip()


def _proc_status(field: str) -> int:
  """A `/proc/self/status` field in bytes."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def _reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _batches(vocab: int, ids: int = IDS):
  import numpy as np

  rng = np.random.RandomState(0)
  return [
    (
      rng.randint(0, vocab, (BATCH, ids)),
      rng.normal(size=(BATCH, OUT)).astype(np.float32),
    )
    for _ in range(NUM_BATCHES)
  ]


def _run_ours(
  vocab: int, optimizer: str, exchange: str = "auto", ids: int = IDS
):
  import _embeds
  import jax
  import jax.numpy as jnp
  import optax
  from penzai import pz

  from pz_sparsecore.core import specs
  from pz_sparsecore.device.exchange import ExchangeBytes
  from pz_sparsecore.nn.embed import SparseCoreEmbed
  from pz_sparsecore.nn.training import SparseCoreTrainer

  opt = {
    "adagrad": specs.AdagradOptimizerSpec(learning_rate=0.1),
    "adam": specs.AdamOptimizerSpec(learning_rate=0.01),
  }[optimizer]
  data = _batches(vocab, ids)
  embed = _embeds.one_feature(
    vocab, DIM, (BATCH, ids), opt, [x for x, _ in data], exchange
  )
  chosen = embed.config.topology.exchange_of(embed.config.plan.stacks[0])

  @pz.pytree_dataclass
  class Model(pz.nn.Layer):
    embed: SparseCoreEmbed
    head: pz.nn.Linear

    def __call__(self, inputs, /, **side_inputs):
      return self.head(self.embed(inputs)["ids"])

  model = Model(
    embed=embed,
    head=pz.nn.Linear.from_config(
      "head",
      jax.random.key(1),
      input_axes={"embedding": DIM},
      output_axes={"out": OUT},
    ),
  )

  def loss_fn(*, model, state, rng, inputs, targets):
    del rng
    pred = model(inputs).unwrap("batch", "out")
    loss = jnp.mean((pred - targets) ** 2)
    return loss, state, {"loss": loss}

  trainer = SparseCoreTrainer.build(
    jax.random.key(2), model, optax.adam(1e-3), loss_fn
  )
  batches = []
  for ids, targets in data:
    inputs, _ = model.embed.preprocess({"ids": ids})
    batches.append((inputs, jnp.asarray(targets)))

  def step(i):
    inputs, targets = batches[i % len(batches)]
    aux = trainer.step(inputs=inputs, targets=targets)
    return aux["loss"]

  return step, {
    "mode": chosen.mode,
    # One device ("local") exchanges nothing.
    "step_bytes": chosen.by_mode.get(chosen.mode, ExchangeBytes(0, 0, 0)).step,
    "reason": chosen.reason,
  }


def _run_penzai(vocab: int):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from penzai import pz

  mesh = Mesh(np.array(jax.devices()), ("device",))
  table = pz.nn.EmbeddingTable.from_config(
    "table",
    jax.random.key(0),
    vocab_size=vocab,
    embedding_axes={"embedding": DIM},
  )
  # Rows sharded over the devices, like ours.
  table.embeddings.value = pz.nx.wrap(
    jax.device_put(
      table.embeddings.value.unwrap("vocabulary", "embedding"),
      NamedSharding(mesh, P("device", None)),
    )
  ).tag("vocabulary", "embedding")
  head = pz.nn.Linear.from_config(
    "head",
    jax.random.key(1),
    input_axes={"embedding": DIM},
    output_axes={"out": OUT},
  )
  lookup = pz.nn.EmbeddingLookup(table)

  @pz.pytree_dataclass
  class Model(pz.nn.Layer):
    lookup: pz.nn.EmbeddingLookup
    head: pz.nn.Linear

    def __call__(self, ids, /, **side_inputs):
      acts = self.lookup(ids)  # [batch, ids, embedding]
      summed = pz.nx.nmap(jnp.sum)(acts.untag("ids"))
      return self.head(summed)

  model = Model(lookup=lookup, head=head)
  unbound, params = pz.unbind_params(model, freeze=True)
  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(params)

  def train_step(params, opt_state, ids, targets):
    def loss_of(params):
      pred = pz.bind_variables(unbound, params)(ids).unwrap("batch", "out")
      return jnp.mean((pred - targets) ** 2)

    loss, grads = jax.value_and_grad(loss_of)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  train_step = jax.jit(train_step, donate_argnums=(0, 1))
  batch_sharding = NamedSharding(mesh, P("device"))
  batches = [
    (
      pz.nx.wrap(jax.device_put(ids, batch_sharding)).tag("batch", "ids"),
      jax.device_put(jnp.asarray(targets), batch_sharding),
    )
    for ids, targets in _batches(vocab)
  ]
  state = {"params": params, "opt_state": opt_state}

  def step(i):
    ids, targets = batches[i % len(batches)]
    state["params"], state["opt_state"], loss = train_step(
      state["params"], state["opt_state"], ids, targets
    )
    return loss

  return step


def _child(
  impl: str, vocab: int, optimizer: str, exchange: str, ids: int
) -> None:
  import resource

  import jax

  if impl == "ours":
    step, info = _run_ours(vocab, optimizer, exchange, ids)
  else:
    step, info = _run_penzai(vocab), {}
  for i in range(WARMUP):
    jax.block_until_ready(step(i))
  rss_after_init = _proc_status("VmRSS")
  reset = _reset_peak()
  times = []
  for i in range(STEPS):
    start = time.perf_counter()
    jax.block_until_ready(step(WARMUP + i))
    times.append(time.perf_counter() - start)
  peak = _proc_status("VmHWM") if reset else None
  result = {
    "median_s": statistics.median(times),
    "rss_after_init": rss_after_init,
    "peak_delta": None if peak is None else max(peak - rss_after_init, 0),
    "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    **info,
  }
  print("RESULT " + json.dumps(result))


def _measure(
  impl: str, vocab: int, optimizer: str, exchange: str = "auto", ids=IDS
) -> dict:
  out = subprocess.run(
    [sys.executable, __file__, "--child", impl, str(vocab), optimizer]
    + [exchange, str(ids)],
    env=dict(os.environ),
    capture_output=True,
    text=True,
    check=False,
  )
  for line in out.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT ") :])
  raise RuntimeError(
    f"{impl} vocab {vocab} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
  )


def _mib(n: int | None) -> str:
  return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def main() -> None:
  runs = [
    ("a", "ours", 2**16, "adagrad"),
    ("a", "ours", 2**24, "adagrad"),
    ("b", "ours", 2**20, "adam"),
    ("b", "penzai", 2**20, "adam"),
  ]
  results = {}
  for part, impl, vocab, opt in runs:
    print(
      f"measuring {impl} vocab 2**{vocab.bit_length() - 1} {opt} ...",
      file=sys.stderr,
    )
    results[(part, impl, vocab)] = _measure(impl, vocab, opt)

  names = {
    "ours": "SparseCoreEmbed + SparseCoreTrainer",
    "penzai": "pz.nn.EmbeddingLookup + optax (dense grad)",
  }
  header = (
    f"{'part':<4} {'implementation':<44} {'vocab':>6} {'opt':<8} "
    f"{'step ms':>9} {'peak delta':>11} {'peak RSS':>10}  ratio"
  )
  lines = [
    f"train step: batch {BATCH} x {IDS} ids, dim {DIM}, Linear head -> {OUT}, "
    f"8 virtual CPU devices, {os.cpu_count()} cores; median of {STEPS} steps",
    header,
    "-" * len(header),
  ]
  small = results[("a", "ours", 2**16)]["median_s"]
  ours_b = results[("b", "ours", 2**20)]["median_s"]
  for part, impl, vocab, opt in runs:
    r = results[(part, impl, vocab)]
    if part == "a":
      ratio = f"{r['median_s'] / small:.2f}x vs 2**16 (goal < 1.3)"
    elif impl == "penzai":
      ratio = f"ours is {r['median_s'] / ours_b:.1f}x faster (goal >= 20)"
    else:
      ratio = "-"
    lines.append(
      f"{part:<4} {names[impl]:<44} {'2**' + str(vocab.bit_length() - 1):>6} "
      f"{opt:<8} {r['median_s'] * 1e3:9.2f} {_mib(r['peak_delta']):>11} "
      f"{_mib(r['peak_rss']):>10}  {ratio}"
    )
  print("\n".join(lines))
  print()
  print("\n".join(_exchange_table()))


def _exchange_table() -> list[str]:
  """Part (c): the same step with each exchange forced."""
  header = (
    f"{'part':<4} {'ids/sample':>10} {'exchange':<12} {'step ms':>9} "
    f"{'KB/device/step':>15}  ratio"
  )
  lines = [
    f"(c) exchanges: vocab 2**20, adagrad, 8 devices, local batch "
    f"{BATCH // 8} samples",
    header,
    "-" * len(header),
  ]
  for ids in (IDS, 1):
    results = {}
    for mode in ("activations", "rows", "auto"):
      print(f"measuring exchange {mode}, {ids} ids ...", file=sys.stderr)
      results[mode] = _measure("ours", 2**20, "adagrad", mode, ids)
    base = results["activations"]["median_s"]
    for mode in ("activations", "rows"):
      r = results[mode]
      picked = " (auto)" if results["auto"]["mode"] == mode else ""
      lines.append(
        f"{'c':<4} {ids:>10} {mode:<12} {r['median_s'] * 1e3:9.2f} "
        f"{r['step_bytes'] / 1000:15,.1f}  "
        f"{r['median_s'] / base:.2f}x activations' time{picked}"
      )
  return lines


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--child":
    impl, vocab, optimizer, exchange, ids = sys.argv[2:7]
    _child(impl, int(vocab), optimizer, exchange, int(ids))
  else:
    main()
