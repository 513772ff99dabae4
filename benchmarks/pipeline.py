"""Input pipeline benchmark: a training loop with its preprocessing included.

Run: ``.venv/bin/python benchmarks/pipeline.py`` (prints one table).

Model: ``SparseCoreEmbed`` with ``FEATURES`` features of ``BATCH`` samples,
ragged rows of 0 to ``MAX_IDS`` Zipf-distributed ids each (a ``(values,
row_splits)`` pair per feature), one ``[VOCAB, DIM]`` table per feature
(Adagrad), the features' activations concatenated into a two-layer MLP head
(optax Adam), squared-error loss; ``SparseCoreTrainer`` on 8 virtual CPU
devices, limits fitted to the batches by FDO.

The same trainer runs four loops, interleaved round by round (same load):

* ``preprocessed``: fed batches preprocessed beforehand (the step alone);
* ``inline``: ``embed.preprocess`` then ``step``, one after the other;
* ``pipeline``: ``trainer.fit``, which preprocesses batch k + 1 in a
  background thread (``pzsc.prefetch``) while step k runs.
* ``idle``: ``trainer.fit`` with a stand-in preprocessing that waits as
  long as the real one without using the CPU or the GIL: the pipeline's
  own cost, apart from the contention of host work with the step.

Every loop reads the loss of each step (as a loop that logs it does), so
steps do not pile up behind an asynchronous dispatch. A round of a loop
runs ``STEPS + 1`` steps and times the last ``STEPS`` (the first waits for
a new pipeline's first batch). Ratios: median over the rounds of the ratio
within a round. Goal: ``pipeline`` >= 0.9x ``preprocessed``. The table
also prints the preprocessing's own time per batch and the CPU time per
step (host and devices share the cores here), and checks that the
pipeline's batches equal the inline ones.
"""

from __future__ import annotations

import itertools
import os
import statistics
import sys
import time

import _embeds
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs

FEATURES = 4
BATCH = 4096
MAX_IDS = 64
ZIPF = 1.2
VOCAB = 2**18
DIM, HIDDEN, OUT = 16, 64, 8
NUM_BATCHES, ROUNDS, STEPS, WARMUP = 8, 8, 12, 3

# 8 virtual CPU devices (before the first use of a device).
jax.config.update("jax_num_cpu_devices", 8)

NAMES = [f"f{i}" for i in range(FEATURES)]


def _raw_batches() -> list[tuple[dict[str, tuple], np.ndarray]]:
  """`(ids by feature as (values, row_splits), targets)` batches."""
  rng = np.random.default_rng(0)
  out = []
  for _ in range(NUM_BATCHES):
    ids = {}
    for name in NAMES:
      lengths = rng.integers(0, MAX_IDS + 1, BATCH)
      splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
      values = (rng.zipf(ZIPF, splits[-1]) - 1) % VOCAB
      ids[name] = (values.astype(np.int32), splits)
    targets = rng.normal(size=(BATCH, OUT)).astype(np.float32)
    out.append((ids, targets))
  return out


@pz.pytree_dataclass
class Model(pz.nn.Layer):
  """The features' activations, side by side, through an MLP."""

  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Sequential

  def __call__(self, inputs, /, **side_inputs):
    acts = self.embed(inputs)
    stacked = pz.nx.stack([acts[name] for name in NAMES], "feature")
    return self.head(stacked)


def _feature_specs() -> dict[str, specs.FeatureSpec]:
  out = {}
  for name in NAMES:
    table = specs.TableSpec(
      name=f"table_{name}",
      vocabulary_size=VOCAB,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=specs.AdagradOptimizerSpec(learning_rate=0.05),
      combiner="mean",
      max_ids_per_partition=BATCH * MAX_IDS,
      max_unique_ids_per_partition=BATCH * MAX_IDS,
    )
    out[name] = specs.FeatureSpec(
      name=name,
      table_spec=table,
      input_shape=(BATCH, MAX_IDS),
      output_shape=(BATCH, DIM),
    )
  return out


def _head() -> pz.nn.Sequential:
  rng = jax.random.key(1)
  return pz.nn.Sequential(
    [
      pz.nn.Linear.from_config(
        "hidden",
        rng,
        input_axes={"feature": FEATURES, "embedding": DIM},
        output_axes={"hidden": HIDDEN},
      ),
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Linear.from_config(
        "out",
        jax.random.fold_in(rng, 1),
        input_axes={"hidden": HIDDEN},
        output_axes={"out": OUT},
      ),
    ]
  )


def _loss_fn(*, model, state, rng, inputs, targets):
  del rng
  pred = model(inputs).unwrap("batch", "out")
  loss = jnp.mean((pred - targets) ** 2)
  return loss, state, {"loss": loss}


def _fitted_embed(raws) -> pzsc.SparseCoreEmbed:
  """The layer with limits from the batches' stats plus 25% headroom."""
  mesh = Mesh(np.array(jax.devices()), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), _feature_specs(), mesh
  )
  return _embeds.tuned(embed, (ids for ids, _ in raws))


def _step_kwargs(embed):
  """Raw batch → the step's keyword arguments."""

  def preprocess(raw):
    ids, targets = raw
    inputs, _ = embed.preprocess(ids)
    return {"inputs": inputs, "targets": jnp.asarray(targets)}

  return preprocess


class _Clock:
  """Wall and CPU time at the end of each step (after reading its loss)."""

  def __init__(self):
    self.marks = []

  def tick(self, loss) -> None:
    float(loss)
    self.marks.append((time.perf_counter(), time.process_time()))

  def per_step_ms(self) -> tuple[float, float]:
    """Wall and CPU ms per step after the first one."""
    (w0, c0), (w1, c1) = self.marks[0], self.marks[-1]
    n = len(self.marks) - 1
    return (w1 - w0) / n * 1e3, (c1 - c0) / n * 1e3


def _loops(trainer, raws, preprocess, prep_s: float) -> dict:
  """Mode → a function running `n` steps from batch `start`, ticking
  `clock` after each.

  `idle` stands in for the preprocessing with a wait of `prep_s` that uses
  no CPU and no GIL, then the batch preprocessed beforehand: the
  pipeline's own overhead, apart from the host's contention.
  """
  ready = [preprocess(raw) for raw in raws]

  def batches(items, start, n):
    return itertools.islice(itertools.cycle(items), start, start + n)

  def preprocessed(start, n, clock):
    for kwargs in batches(ready, start, n):
      clock.tick(trainer.step(**kwargs)["loss"])

  def inline(start, n, clock):
    for raw in batches(raws, start, n):
      clock.tick(trainer.step(**preprocess(raw))["loss"])

  def fit(items, prepare):
    return lambda start, n, clock: trainer.fit(
      batches(items, start, n),
      prepare,
      callback=lambda i, aux: clock.tick(aux["loss"]),
    )

  def idle(i):
    time.sleep(prep_s)
    return ready[i]

  return {
    "preprocessed": preprocessed,
    "inline": inline,
    "pipeline": fit(raws, preprocess),
    "idle": fit(range(len(ready)), idle),
  }


def _same_batches(raws, preprocess) -> bool:
  """Whether the pipeline's batches equal preprocessing in this thread."""
  expected = [preprocess(raw) for raw in raws]
  got = list(pzsc.prefetch(raws, preprocess))
  return all(
    np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)
    for e, g in zip(expected, got, strict=True)
    for x, y in zip(jax.tree.leaves(e), jax.tree.leaves(g), strict=True)
  )


def _preprocess_ms(raws, preprocess) -> float:
  times = []
  for raw in raws:
    start = time.perf_counter()
    jax.block_until_ready(preprocess(raw))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def main() -> None:
  raws = _raw_batches()
  model = Model(embed=_fitted_embed(raws), head=_head())
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(2), model, optax.adam(1e-3), _loss_fn
  )
  preprocess = _step_kwargs(model.embed)
  same = _same_batches(raws, preprocess)
  prep_s = _preprocess_ms(raws, preprocess) / 1e3
  loops = _loops(trainer, raws, preprocess, prep_s)
  for loop in loops.values():
    loop(0, WARMUP, _Clock())
  walls = {mode: [] for mode in loops}
  cpus = {mode: [] for mode in loops}
  prep_ms = []
  for r in range(ROUNDS):
    prep_ms.append(_preprocess_ms(raws, preprocess))
    order = list(loops)[r % len(loops) :] + list(loops)[: r % len(loops)]
    for mode in order:
      clock = _Clock()
      loops[mode](r * STEPS, STEPS + 1, clock)
      wall, cpu = clock.per_step_ms()
      walls[mode].append(wall)
      cpus[mode].append(cpu)
  _print(walls, cpus, statistics.median(prep_ms), same)


def _print(
  walls: dict[str, list[float]],
  cpus: dict[str, list[float]],
  prep_ms: float,
  same: bool,
) -> None:
  """The table; a ratio is the median over the rounds of the ratio within
  each round (the same load), ms/step the median over the rounds."""
  ms = {mode: statistics.median(v) for mode, v in walls.items()}
  cpu_ms = {mode: statistics.median(v) for mode, v in cpus.items()}
  ratio = {
    mode: statistics.median(
      b / w for b, w in zip(walls["preprocessed"], v, strict=True)
    )
    for mode, v in walls.items()
  }
  ids = FEATURES * BATCH * MAX_IDS // 2
  cores = os.cpu_count()
  header = f"{'loop':<44} {'steps/s':>8} {'ms/step':>8} {'CPU ms':>7}  ratio"
  lines = [
    f"input pipeline: {FEATURES} features x {BATCH} samples x 0-{MAX_IDS} "
    f"Zipf({ZIPF}) ids (~{ids:,} ids/batch), tables {VOCAB:,} x {DIM}, MLP "
    f"head, 8 virtual CPU devices, {cores} cores; median of "
    f"{ROUNDS} interleaved rounds of {STEPS} steps",
    header,
    "-" * len(header),
  ]
  names = {
    "preprocessed": "step on batches preprocessed beforehand",
    "inline": "preprocess, then step (no pipeline)",
    "pipeline": "trainer.fit: preprocess k+1 in step k",
    "idle": "trainer.fit, stand-in: idle wait as long",
  }
  base = ms["preprocessed"]
  for mode, name in names.items():
    note = " (goal >= 0.9)" if mode == "pipeline" else ""
    lines.append(
      f"{name:<44} {1e3 / ms[mode]:8.2f} {ms[mode]:8.1f} "
      f"{cpu_ms[mode]:7.1f}  {ratio[mode]:.2f}x{note}"
    )
  lines += [
    f"preprocessing alone: {prep_ms:.1f} ms/batch "
    f"({prep_ms / base:.2f}x a step's time)",
    # The host and the CPU devices share the cores: no overlap makes a step
    # take less than its CPU time spread over every core.
    f"the pipelined loop uses {cpu_ms['pipeline']:.1f} CPU-ms/step: on "
    f"{cores} cores (shared by host and devices) at least "
    f"{cpu_ms['pipeline'] / cores:.1f} ms/step",
    f"pipeline batches equal inline preprocessing: {same}",
  ]
  print("\n".join(lines))
  sys.stdout.flush()


if __name__ == "__main__":
  main()
