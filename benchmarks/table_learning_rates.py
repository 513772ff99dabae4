"""Learning rates for embedding tables: a sweep per table optimizer.

Run: ``.venv/bin/python benchmarks/table_learning_rates.py`` (about 2
minutes on 2 cores; prints one table).

The model and data of ``notebooks/your_own_model.ipynb``: three features
(a ragged history of up to 20 items, a candidate item, a country), the
``items`` table shared by two of them, an MLP head trained with
``optax.adam(3e-3)``, 8 virtual CPU devices, batches of 128. For each table
optimizer and learning rate (both tables use it), ``SparseCoreTrainer``
runs 60 steps from the same initial values on the same batches, and the
table reports the mean loss of the last 10 steps and the accuracy on 20
held-out batches. A constant predictor (the click rate, about 0.25)
reaches a loss of about 0.56 and an accuracy of about 0.75.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax
from penzai import pz

import pz_sparsecore as pzsc

BATCH, HISTORY, STEPS, HELD_OUT = 128, 20, 60, 20

SWEEP = {
  "sgd": (pzsc.SGDOptimizerSpec, (0.1, 1.0, 5.0, 20.0, 50.0)),
  "adagrad": (pzsc.AdagradOptimizerSpec, (0.05, 0.5, 2.0, 5.0, 10.0)),
  "adagrad_momentum": (
    pzsc.AdagradMomentumOptimizerSpec,
    (0.01, 0.2, 1.0, 3.0),
  ),
  "adam": (pzsc.AdamOptimizerSpec, (1e-3, 1e-2, 3e-2, 1e-1)),
  "ftrl": (pzsc.FTRLOptimizerSpec, (0.05, 0.5, 2.0, 5.0, 10.0)),
}


def make_batch(rng: np.random.Generator):
  """The notebook's click data: 300 items, each good (`id % 3 == 0`) or
  not and of one of 10 genres (`id % 10`); a history mostly of a favourite
  genre; clicks on good candidates and on the favourite genre."""
  favourite = rng.integers(0, 10, BATCH)
  history = np.empty(BATCH, dtype=object)
  for i in range(BATCH):
    n = rng.integers(1, HISTORY + 1)
    ids = rng.integers(0, 30, n) * 10 + favourite[i]
    noise = rng.random(n) < 0.2
    ids[noise] = rng.integers(0, 300, noise.sum())
    history[i] = ids
  candidate = rng.integers(0, 300, BATCH)
  p_click = (
    0.05 + 0.45 * (candidate % 3 == 0) + 0.45 * (candidate % 10 == favourite)
  )
  clicked = rng.random(BATCH) < p_click
  features = {
    "history": history,
    "candidate": candidate[:, None],
    "country": rng.integers(0, 200, (BATCH, 1)),
  }
  return features, clicked.astype(np.float32)


@pz.pytree_dataclass
class ClickModel(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Sequential

  def __call__(self, inputs, /, **side_inputs):
    acts = self.embed(inputs, **side_inputs)
    x = pz.nx.concatenate(
      [acts["history"], acts["candidate"], acts["country"]], "embedding"
    )
    return self.head(x)


def build_model(optimizer: pzsc.OptimizerSpec, mesh) -> ClickModel:
  def table(name, vocab, dim, combiner):
    return pzsc.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.1),
      optimizer=optimizer,
      combiner=combiner,
    )

  items = table("items", 50_000, 16, "mean")
  countries = table("countries", 200, 4, "sum")
  specs = {
    "history": pzsc.FeatureSpec(
      name="history",
      table_spec=items,
      input_shape=(BATCH, HISTORY),
      output_shape=(BATCH, 16),
    ),
    "candidate": pzsc.FeatureSpec(
      name="candidate",
      table_spec=items,
      input_shape=(BATCH, 1),
      output_shape=(BATCH, 16),
    ),
    "country": pzsc.FeatureSpec(
      name="country",
      table_spec=countries,
      input_shape=(BATCH, 1),
      output_shape=(BATCH, 4),
    ),
  }
  embed_rng, hidden_rng, logit_rng = jax.random.split(jax.random.key(0), 3)
  head = pz.nn.Sequential(
    [
      pz.nn.Linear.from_config(
        "hidden",
        hidden_rng,
        input_axes={"embedding": 36},
        output_axes={"hidden": 64},
      ),
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Linear.from_config(
        "logit", logit_rng, input_axes={"hidden": 64}, output_axes={}
      ),
    ]
  )
  embed = pzsc.SparseCoreEmbed.from_config("embed", embed_rng, specs, mesh)
  return ClickModel(embed=embed, head=head)


def loss_fn(*, model, state, rng, inputs, labels):
  del rng
  logits = model(inputs).unwrap("batch")
  loss = optax.sigmoid_binary_cross_entropy(logits, labels).mean()
  accuracy = ((logits > 0) == (labels > 0.5)).mean()
  return loss, state, {"loss": loss, "accuracy": accuracy}


def run(optimizer: pzsc.OptimizerSpec, batches, held_out, mesh):
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), build_model(optimizer, mesh), optax.adam(3e-3), loss_fn
  )
  losses = []
  for features, labels in batches:
    inputs, _ = trainer.model.embed.preprocess(features)
    aux = trainer.step(inputs=inputs, labels=labels)
    losses.append(float(aux["loss"]))
  model = trainer.model
  forward = pzsc.variable_jit(lambda m, x: m(x))
  correct = []
  for features, labels in held_out:
    inputs, _ = model.embed.preprocess(features)
    logits = np.asarray(forward(model, inputs).unwrap("batch"))
    correct.append(np.mean((logits > 0) == (labels > 0.5)))
  return float(np.mean(losses[-10:])), float(np.mean(correct))


def main() -> None:
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("device",))
  rng = np.random.default_rng(0)
  batches = [make_batch(rng) for _ in range(STEPS)]
  held_out = [make_batch(rng) for _ in range(HELD_OUT)]
  print(
    f"{'optimizer':<18} {'learning rate':>13} {'loss (last 10)':>15} "
    f"{'held-out accuracy':>18}"
  )
  for name, (spec, rates) in SWEEP.items():
    for lr in rates:
      loss, accuracy = run(spec(learning_rate=lr), batches, held_out, mesh)
      print(f"{name:<18} {lr:>13g} {loss:>15.3f} {accuracy:>18.3f}")


if __name__ == "__main__":
  main()
