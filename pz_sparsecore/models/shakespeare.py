"""A next-word model of Shakespeare with a sharded SparseCore embedding.

The model reads a context of `seq_len` words and predicts the next one:

  context ids [batch, seq]
    → SparseCoreEmbed (feature "context", sample axes ("batch", "seq"))
    → NamedArray [batch, seq, embedding]
    → Linear over (seq, embedding) → hidden, bias, ReLU
    → Linear hidden → vocab, bias → logits [batch, vocab]

Each (batch, seq) position is one sample of the "context" feature with one
id, so the embedding learns one vector per word, and the first Linear layer
mixes positions. The word table is row-sharded over every device of the mesh
and trained in place by its own optimizer (Adagrad by default); the dense
layers use optax.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from penzai import pz

from pz_sparsecore.core import specs
from pz_sparsecore.models.shakespeare_config import RunConfig
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.jit import variable_jit

FEATURE = "context"
TABLE = "words"

OPTIMIZERS = {
  "adagrad": lambda: specs.AdagradOptimizerSpec(learning_rate=0.2),
  # One accumulator per row, started as Adagrad's.
  "rowwise_adagrad": lambda: specs.RowwiseAdagradOptimizerSpec(
    learning_rate=0.2, initial_accumulator_value=0.1
  ),
  "adam": lambda: specs.AdamOptimizerSpec(learning_rate=0.01),
  "sgd": lambda: specs.SGDOptimizerSpec(learning_rate=2.0),
  "ftrl": lambda: specs.FTRLOptimizerSpec(learning_rate=0.5),
}


@pz.pytree_dataclass
class NextWordModel(pz.nn.Layer):
  """Embedding lookup followed by a small MLP over the context.

  Attributes:
    embed: The SparseCore embedding of the context words.
    body: Dense layers from `[batch, seq, embedding]` to `[batch, vocab]`.
  """

  embed: SparseCoreEmbed
  body: pz.nn.Sequential

  def __call__(self, inputs: Any, /, **side_inputs: Any) -> pz.nx.NamedArray:
    """Logits `[batch, vocab]` for preprocessed context ids."""
    return self.body(self.embed(inputs, **side_inputs)[FEATURE], **side_inputs)


def feature_specs(
  *,
  vocab_size: int,
  seq_len: int,
  batch_size: int,
  embedding_dim: int,
  optimizer: specs.OptimizerSpec,
  max_ids_per_partition: int = 256,
  table_dtype: Any = "float32",
) -> dict[str, specs.FeatureSpec]:
  """The one feature of the model: `batch x seq` samples of one word each."""
  table = specs.TableSpec(
    name=TABLE,
    vocabulary_size=vocab_size,
    embedding_dim=embedding_dim,
    initializer=jax.nn.initializers.normal(stddev=0.1),
    optimizer=optimizer,
    combiner="sum",
    max_ids_per_partition=max_ids_per_partition,
    max_unique_ids_per_partition=max_ids_per_partition,
    dtype=table_dtype,
  )
  return {
    FEATURE: specs.FeatureSpec(
      name=FEATURE,
      table_spec=table,
      input_shape=(batch_size * seq_len, 1),
      output_shape=(batch_size, seq_len, embedding_dim),
    )
  }


def build_model(
  rng: jax.Array | None,
  mesh: Mesh,
  *,
  vocab_size: int,
  seq_len: int,
  batch_size: int,
  embedding_dim: int = 64,
  hidden: int = 256,
  optimizer: specs.OptimizerSpec | None = None,
  num_sc_per_device: int = 1,
  sharding_axis: str | tuple[str, ...] | None = None,
  exchange: str = "auto",
  table_dtype: Any = "float32",
) -> NextWordModel:
  """Builds the model with its table sharded over `mesh`.

  `rng=None` gives variable slots, to be filled by `restore_checkpoint`;
  `exchange` is `SparseCoreEmbed.from_config`'s; `table_dtype` how the
  table's rows are stored (`TableSpec(dtype=...)`).
  """
  embed_rng, dense_rng = (None, None) if rng is None else jax.random.split(rng)
  logits_rng = None if rng is None else jax.random.fold_in(dense_rng, 1)
  embed = SparseCoreEmbed.from_config(
    "embed",
    embed_rng,
    feature_specs(
      vocab_size=vocab_size,
      seq_len=seq_len,
      batch_size=batch_size,
      embedding_dim=embedding_dim,
      optimizer=optimizer or OPTIMIZERS["adagrad"](),
      table_dtype=table_dtype,
    ),
    mesh,
    sharding_axis=sharding_axis,
    num_sc_per_device=num_sc_per_device,
    feature_axes=("batch", "seq"),
    exchange=exchange,
  )
  body = pz.nn.Sequential(
    [
      pz.nn.Linear.from_config(
        "hidden",
        dense_rng,
        input_axes={"seq": seq_len, "embedding": embedding_dim},
        output_axes={"hidden": hidden},
      ),
      pz.nn.AddBias.from_config("hidden_bias", dense_rng, {"hidden": hidden}),
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Linear.from_config(
        "logits",
        logits_rng,
        input_axes={"hidden": hidden},
        output_axes={"vocab": vocab_size},
      ),
      pz.nn.AddBias.from_config(
        "logits_bias", dense_rng, {"vocab": vocab_size}
      ),
    ]
  )
  return NextWordModel(embed=embed, body=body)


def cross_entropy(logits: pz.nx.NamedArray, labels: jax.Array) -> jax.Array:
  """Per-example cross-entropy (nats) of `[batch, vocab]` logits."""
  values = logits.unwrap("batch", "vocab")
  return optax.softmax_cross_entropy_with_integer_labels(values, labels)


def loss_fn(*, model, state, rng, inputs, labels):
  """`SparseCoreTrainer` loss: mean next-word cross-entropy."""
  del rng
  loss = jnp.mean(cross_entropy(model(inputs), labels))
  return loss, state, {"loss": loss}


# Reads the table and writes nothing: no variable is copied or donated.
@variable_jit
def _eval_batch(model, inputs, labels):
  logits = model(inputs)
  loss = jnp.sum(cross_entropy(logits, labels))
  correct = jnp.sum(jnp.argmax(logits.unwrap("batch", "vocab"), -1) == labels)
  return loss, correct


def evaluate(model: NextWordModel, batches) -> dict[str, float]:
  """Mean held-out loss and accuracy over `(context, labels)` batches."""
  total_loss, total_correct, count = 0.0, 0, 0
  for context, labels in batches:
    inputs, _ = model.embed.preprocess(
      {FEATURE: context}, allow_id_dropping=True
    )
    loss, correct = _eval_batch(model, inputs, labels)
    total_loss += float(loss)
    total_correct += int(correct)
    count += len(labels)
  return {"loss": total_loss / count, "accuracy": total_correct / count}


def unigram_metrics(counts: np.ndarray, batches) -> dict[str, float]:
  """Loss and accuracy of the add-one smoothed unigram model on `batches`."""
  probs = (counts + 1.0) / (counts.sum() + len(counts))
  losses, hits, count = 0.0, 0, 0
  best = int(np.argmax(counts))
  for _, labels in batches:
    losses += float(-np.log(probs[labels]).sum())
    hits += int(np.sum(labels == best))
    count += len(labels)
  return {"loss": losses / count, "accuracy": hits / count}


@dataclasses.dataclass
class RunResult:
  """What a run measured.

  Attributes:
    config: The run's configuration.
    losses: Training loss per step.
    step_times: Wall time per step (seconds, host side).
    fdo_updates: `(step, max_ids_per_partition, max_unique, buffer)` after
      each FDO refresh.
    dropped_ids: Ids dropped by the limits over the run.
    heldout: Held-out loss and accuracy of the trained model.
    baseline: Held-out loss and accuracy of the unigram baseline.
    model: The trained model.
    last_stats: Preprocessing statistics of the last batch.
  """

  config: RunConfig
  losses: list[float]
  step_times: list[float]
  fdo_updates: list[tuple[int, int, int, int]]
  dropped_ids: int
  heldout: dict[str, float]
  baseline: dict[str, float]
  model: NextWordModel
  last_stats: Any


def _refresh_limits(
  trainer: Any, fdo: Any, config: RunConfig
) -> tuple[Any, tuple[int, int, int]]:
  """Publishes the FDO stats and rebuilds the layer with limits fitted to them.

  Returns:
    The trainer holding the new layer (same variables), and the stack's new
    `(max_ids_per_partition, max_unique_ids_per_partition,
    suggested_coo_buffer_size_per_device)`.
  """
  from pz_sparsecore.host.fdo import (
    scale_stats,
    update_preprocessing_parameters,
  )
  from pz_sparsecore.nn.respec import with_feature_specs

  fdo.publish()
  observed = scale_stats(fdo.load(), config.fdo_headroom)
  embed = trainer.model.embed
  new_specs = update_preprocessing_parameters(
    embed.config.plan.specs_tree,
    observed,
    config.sc_per_device,
    global_device_count=config.devices,
  )
  embed = with_feature_specs(embed, new_specs)
  stack = embed.config.plan.stacks[0].spec
  trainer = dataclasses.replace(
    trainer, model=dataclasses.replace(trainer.model, embed=embed)
  )
  return trainer, (
    stack.max_ids_per_partition,
    stack.max_unique_ids_per_partition,
    stack.suggested_coo_buffer_size_per_device,
  )


def _prefetched(
  batches: Any, embed: SparseCoreEmbed, first_step: int, count: int
) -> Any:
  """The next `count` training batches, preprocessed for `embed` in a
  background thread while the steps run.

  Returns:
    A `prefetch` pipeline of `(inputs, stats, labels)`; the first is
    batch number `first_step`.
  """
  from pz_sparsecore.host.pipeline import prefetch

  def prepare(numbered):
    step, (context, labels) = numbered
    inputs, stats = embed.preprocess(
      {FEATURE: context}, batch_number=step, allow_id_dropping=True
    )
    return inputs, stats, labels

  return prefetch(
    enumerate(itertools.islice(batches, count), first_step), prepare
  )


def _train(
  trainer: Any, data: Any, fdo: Any, config: RunConfig, progress: bool
) -> tuple[Any, dict[str, Any]]:
  """`config.steps` training steps with FDO refreshes.

  Batch k + 1 is preprocessed while step k runs, up to each FDO refresh:
  the refresh changes the layer's limits, so the batches after it are
  preprocessed for the new layer.

  Returns:
    The trained trainer and the `RunResult` fields it measured (`losses`,
    `step_times`, `fdo_updates`, `dropped_ids`, `last_stats`).
  """
  import time

  from tqdm.auto import tqdm

  batches = data.batches(config.batch_size, seed=config.seed)
  losses, times, fdo_updates, dropped = [], [], [], 0
  stats = None
  segment = config.fdo_every or max(config.steps, 1)
  bar = tqdm(total=config.steps, disable=not progress, unit="step")
  for first in range(0, config.steps, segment):
    count = min(segment, config.steps - first)
    with _prefetched(batches, trainer.model.embed, first, count) as pipeline:
      start = time.perf_counter()
      for inputs, stats, labels in pipeline:
        fdo.record(stats)
        dropped += sum(int(v) for v in stats.id_drop_counters.values())
        aux = trainer.step(inputs=inputs, labels=labels)
        losses.append(float(aux["loss"]))
        # From the previous step's end: waiting for the batch counts.
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        bar.update()
        bar.set_postfix(
          loss=f"{losses[-1]:.3f}",
          examples_per_s=f"{config.batch_size / times[-1]:,.0f}",
        )
    if config.fdo_every and (first + count) % config.fdo_every == 0:
      trainer, limits = _refresh_limits(trainer, fdo, config)
      fdo_updates.append((first + count, *limits))
  bar.close()
  return trainer, {
    "losses": losses,
    "step_times": times,
    "fdo_updates": fdo_updates,
    "dropped_ids": dropped,
    "last_stats": stats,
  }


def run(
  config: RunConfig,
  *,
  fdo_dir: str,
  progress: bool = True,
) -> RunResult:
  """Trains the next-word model on Shakespeare and evaluates it.

  Args:
    config: The run's configuration (`config.devices` must not exceed
      `jax.device_count()`).
    fdo_dir: Directory for the FDO client's files.
    progress: Show a progress bar.

  Returns:
    The run's measurements and the trained model.

  Raises:
    ValueError: If `config.devices` exceeds the devices JAX sees.
  """
  import uuid

  from pz_sparsecore.data import ShakespeareData
  from pz_sparsecore.host.fdo import NPZFileFDOClient
  from pz_sparsecore.nn.training import SparseCoreTrainer

  if config.devices > jax.device_count():
    raise ValueError(
      f"--devices {config.devices} exceeds the {jax.device_count()} devices "
      "JAX sees"
    )
  mesh = Mesh(np.array(jax.devices()[: config.devices]), ("device",))
  data = ShakespeareData.load(vocab_size=config.vocab, seq_len=config.seq_len)
  model = build_model(
    jax.random.key(config.seed),
    mesh,
    vocab_size=data.vocab.size,
    seq_len=config.seq_len,
    batch_size=config.batch_size,
    embedding_dim=config.embedding_dim,
    hidden=config.hidden,
    optimizer=OPTIMIZERS[config.optimizer](),
    num_sc_per_device=config.sc_per_device,
    table_dtype=config.table_dtype,
  )
  trainer = SparseCoreTrainer.build(
    jax.random.key(config.seed + 1), model, optax.adam(2e-3), loss_fn
  )
  fdo = NPZFileFDOClient(fdo_dir, run_id=uuid.uuid4().hex)
  trainer, measured = _train(trainer, data, fdo, config, progress)
  eval_batches = list(
    data.eval_batches(config.batch_size, max_batches=config.eval_batches)
  )
  return RunResult(
    config=config,
    heldout=evaluate(trainer.model, eval_batches),
    baseline=unigram_metrics(data.unigram_counts("train"), eval_batches),
    model=trainer.model,
    **measured,
  )


def summary(result: RunResult) -> str:
  """A few lines comparing the trained model with the unigram baseline."""
  c, h, b = result.config, result.heldout, result.baseline
  steady = sorted(result.step_times[1:]) or result.step_times
  median = steady[len(steady) // 2]
  platform = jax.devices()[0].platform
  plural = "s" if c.devices != 1 else ""
  return "\n".join(
    [
      f"trained {c.steps} steps on {c.devices} {platform} device{plural} x "
      f"{c.sc_per_device} SC "
      f"(vocab {c.vocab}, batch {c.batch_size} x {c.seq_len}, {c.optimizer}, "
      f"{c.table_dtype} table)",
      f"median step {median * 1e3:.1f} ms "
      f"({c.batch_size / median:,.0f} examples/s); first step (compile) "
      f"{result.step_times[0]:.1f} s",
      f"held-out loss {h['loss']:.3f} nats, accuracy {h['accuracy']:.3f}",
      f"unigram baseline loss {b['loss']:.3f} nats, accuracy "
      f"{b['accuracy']:.3f}",
      f"ids dropped by limits: {result.dropped_ids}; FDO refreshes: "
      f"{len(result.fdo_updates)}",
    ]
  )
