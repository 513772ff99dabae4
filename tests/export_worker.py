"""The serving-export tests' model, and their worker process.

The model (`ExportModel`): a `SparseCoreEmbed` with an "item" table (one id
per sample, sum combiner) and a "tags" table (a ragged multi-hot feature,
mean combiner), whose activations go through dense layers to one logit per
sample; its labels come from a fixed random teacher over the same ids.

Usage (launched by tests/test_export.py):

  python export_worker.py serve DEVICES EXPORTS BATCHES OUT
    Loads each export EXPORTS/<dtype> (float32, bfloat16, int8) from its
    pickled structure onto a mesh of DEVICES CPU devices and writes the
    logits of the held-out batches in BATCHES (an .npz of `save_batches`),
    and the float32 export's logical tables, to OUT (.npz).
  python export_worker.py killed PATH
    Exports a fresh model to PATH and dies (SIGKILL) after writing its
    second array file: an export killed mid-write.
"""

from __future__ import annotations

import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc

BATCH = 64
ITEM_VOCAB, TAG_VOCAB, DIM, HIDDEN = 200, 96, 8, 8
MAX_TAGS = 4
DTYPES = ("float32", "bfloat16", "int8")


@pz.pytree_dataclass
class ExportModel(pz.nn.Layer):
  """Two looked-up features, a hidden layer and one logit per sample.

  Attributes:
    embed: The "item" and "tags" features.
    item_proj: The item activations to the hidden units.
    tags_proj: The tags activations to the hidden units.
    head: Hidden units to the logit.
    bias: The logit's bias.
  """

  embed: pzsc.SparseCoreEmbed
  item_proj: pz.nn.Linear
  tags_proj: pz.nn.Linear
  head: pz.nn.Linear
  bias: pz.nn.AddBias

  def __call__(self, inputs, /, **side_inputs):
    acts = self.embed(inputs, **side_inputs)
    hidden = self.item_proj(acts["item"]) + self.tags_proj(acts["tags"])
    hidden = pz.nx.nmap(jax.nn.relu)(hidden)
    return self.bias(self.head(hidden)).unwrap("batch", "logit")[:, 0]


def feature_specs() -> dict[str, pzsc.FeatureSpec]:
  tables = {
    "item": (ITEM_VOCAB, pzsc.AdagradOptimizerSpec(learning_rate=1.0), "sum"),
    "tags": (TAG_VOCAB, pzsc.SGDOptimizerSpec(learning_rate=2.0), "mean"),
  }
  valency = {"item": 1, "tags": MAX_TAGS}
  return {
    name: pzsc.FeatureSpec(
      name=name,
      table_spec=pzsc.TableSpec(
        name=name,
        vocabulary_size=vocab,
        embedding_dim=DIM,
        initializer=jax.nn.initializers.normal(0.3),
        optimizer=optimizer,
        combiner=combiner,
      ),
      input_shape=(BATCH, valency[name]),
      output_shape=(BATCH, DIM),
    )
    for name, (vocab, optimizer, combiner) in tables.items()
  }


def mesh_of(devices: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:devices]), ("device",))


def build_model(rng: jax.Array | None, mesh: Mesh) -> ExportModel:
  """The model on `mesh`; `rng=None` gives variable slots."""
  keys = [None] * 4 if rng is None else list(jax.random.split(rng, 4))

  def linear(name, key, inputs, outputs):
    return pz.nn.Linear.from_config(
      name, key, input_axes=inputs, output_axes=outputs
    )

  return ExportModel(
    embed=pzsc.SparseCoreEmbed.from_config(
      "emb", keys[0], feature_specs(), mesh
    ),
    item_proj=linear("item_proj", keys[1], {"embedding": DIM}, {"h": HIDDEN}),
    tags_proj=linear("tags_proj", keys[2], {"embedding": DIM}, {"h": HIDDEN}),
    head=linear("head", keys[3], {"h": HIDDEN}, {"logit": 1}),
    bias=pz.nn.AddBias.from_config("bias", keys[3], {"logit": 1}),
  )


_TEACHER = np.random.RandomState(1234)
ITEM_WEIGHT = _TEACHER.normal(size=ITEM_VOCAB)
TAG_WEIGHT = _TEACHER.normal(size=TAG_VOCAB)


def make_batch(seed: int) -> tuple[dict[str, object], np.ndarray]:
  """Features (item ids `[B, 1]`, ragged tag ids) and 0/1 labels."""
  rng = np.random.RandomState(seed)
  item = rng.randint(0, ITEM_VOCAB, (BATCH, 1)).astype(np.int32)
  tags = [
    rng.randint(0, TAG_VOCAB, rng.randint(1, MAX_TAGS + 1)).astype(np.int32)
    for _ in range(BATCH)
  ]
  score = ITEM_WEIGHT[item[:, 0]] + np.array(
    [TAG_WEIGHT[t].mean() for t in tags]
  )
  labels = (score + 0.5 * rng.normal(size=BATCH) > 0).astype(np.float32)
  features = {"item": item, "tags": np.array(tags + [None], object)[:-1]}
  return features, labels


def loss_fn(*, model, state, rng, inputs, labels):
  del rng
  logits = model(inputs)
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
  return loss, state, {"loss": loss}


forward = pzsc.variable_jit(lambda model, inputs: model(inputs))


def logits_of(model, features) -> np.ndarray:
  inputs, _ = model.embed.preprocess(features)
  return np.asarray(forward(model, inputs))


def save_batches(path: str, seeds: list[int]) -> None:
  """Held-out batches as an .npz (ragged tags padded with -1)."""
  out = {}
  for i, seed in enumerate(seeds):
    features, labels = make_batch(seed)
    tags = np.full((BATCH, MAX_TAGS), -1, np.int32)
    for b, row in enumerate(features["tags"]):
      tags[b, : len(row)] = row
    out[f"item_{i}"], out[f"tags_{i}"] = features["item"], tags
    out[f"labels_{i}"] = labels
  np.savez(path, **out)


def load_batches(path: str) -> list[tuple[dict[str, object], np.ndarray]]:
  data = np.load(path)
  out = []
  for i in range(len([k for k in data if k.startswith("labels_")])):
    tags = [row[row >= 0] for row in data[f"tags_{i}"]]
    features = {
      "item": data[f"item_{i}"],
      "tags": np.array(tags + [None], object)[:-1],
    }
    out.append((features, data[f"labels_{i}"]))
  return out


def serve(devices: int, exports: str, batches: str, out: str) -> None:
  from pz_sparsecore.nn.export import load_for_serving

  mesh = mesh_of(devices)
  results = {}
  for dtype in DTYPES:
    model = load_for_serving(os.path.join(exports, dtype), mesh=mesh)
    for i, (features, _) in enumerate(load_batches(batches)):
      results[f"{dtype}_{i}"] = logits_of(model, features)
    if dtype == "float32":
      for name, rows in pzsc.logical_tables(model.embed).items():
        results[f"table_{name}"] = rows
      # Requests of other sizes than the training batch: one sample at a
      # time, and 5 samples.
      features, _ = load_batches(batches)[0]
      results["float32_ones"] = np.concatenate(
        [
          logits_of(model, {k: v[i : i + 1] for k, v in features.items()})
          for i in range(3)
        ]
      )
      results["float32_five"] = logits_of(
        model, {k: v[:5] for k, v in features.items()}
      )
  np.savez(out, **results)


def killed(path: str) -> None:
  from pz_sparsecore.nn import export as export_lib

  model = build_model(jax.random.key(0), mesh_of(1))
  write = export_lib._write_file
  written = []

  def write_then_die(file, data):
    entry = write(file, data)
    written.append(file)
    if len(written) == 2:
      os.kill(os.getpid(), signal.SIGKILL)
    return entry

  export_lib._write_file = write_then_die
  export_lib.export(model, path)


if __name__ == "__main__":
  mode, args = sys.argv[1], sys.argv[2:]
  if mode == "serve":
    serve(int(args[0]), *args[1:])
  elif mode == "killed":
    killed(args[0])
  else:
    raise SystemExit(f"unknown mode {mode!r}")
