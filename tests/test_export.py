"""Serving exports: a trained model exported, loaded in fresh processes.

`export_worker.ExportModel` (an "item" table, a ragged multi-hot "tags"
table with the mean combiner, dense layers to one logit) is trained on 8
devices and exported in float32, bfloat16 and int8; fresh processes load
each export from its pickled structure on 1 and on 8 devices and compute
the logits of held-out batches. The references are the trained model's
own forward (for bfloat16: the trained model with its tables rounded to
bfloat16 by NumPy; for int8: with its rows dequantised here from the
stored bytes, scales and biases) and the trained logical tables.

Float32 is bit for bit on the trained topology (8 devices). On 1 device a
multi-hot lookup sums a sample's rows in another order, so there the
tables are compared bit for bit and the logits to within a few float32
ulps.

Also: the export's files (no optimizer state), damaged and interrupted
exports refused and replaced, training refused, `model_like` instead of
the pickled structure, a hashed table re-homed onto 2 devices (held ids
served, unseen ids zero, nothing inserted) and a `SparseCoreLookup`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import export_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import hashed
from pz_sparsecore.nn.export import export, load_for_serving

WORKER = os.path.join(os.path.dirname(__file__), "export_worker.py")
STEPS = 60
HELD_OUT = [1000 + i for i in range(8)]
SERVING = "serving model"


def worker_env(devices: int) -> dict[str, str]:
  flags = (
    f"--xla_force_host_platform_device_count={devices} "
    "--xla_backend_optimization_level=0"  # As conftest compiles here.
  )
  return {**os.environ, "XLA_FLAGS": flags}


def copy_of(model):
  """The model with variables of its own (writing them leaves `model`'s)."""
  structure, variables = pz.unbind_variables(model)
  fresh = [
    pz.Parameter(value=v.value, label=v.label, metadata=v.metadata)
    if isinstance(v, pz.Parameter)
    else pz.StateVariable(v.value, label=v.label, metadata=v.metadata)
    for v in variables
  ]
  return pz.bind_variables(structure, fresh)


def stored(path: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
  """An export's manifest and, per table, its stored arrays by part."""
  with open(os.path.join(path, "manifest.json")) as f:
    manifest = json.load(f)
  tables = {}
  for name, table in manifest["layers"][0]["tables"].items():
    tables[name] = {}
    for part, file in table["files"].items():
      entry = manifest["files"][file]
      raw = np.fromfile(os.path.join(path, file), np.uint8)
      tables[name][part] = raw.view(jnp.dtype(entry["dtype"])).reshape(
        entry["shape"]
      )
  return manifest, tables


def dequantised(parts: dict[str, np.ndarray]) -> np.ndarray:
  """Independent of the library: q * scale + bias, in float64."""
  q = parts["q"].astype(np.float64)
  return (q * parts["scale"][:, None] + parts["bias"][:, None]).astype(
    np.float32
  )


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
  """ROC AUC by ranks (Mann-Whitney), ties averaged."""
  order = np.argsort(scores, kind="stable")
  ranks = np.empty(len(scores))
  ranks[order] = np.arange(1, len(scores) + 1)
  for value in np.unique(scores):
    tied = scores == value
    ranks[tied] = ranks[tied].mean()
  positive = labels == 1
  n_pos, n_neg = positive.sum(), (~positive).sum()
  return float(
    (ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)
  )


def brier(logits: np.ndarray, labels: np.ndarray) -> float:
  return float(np.mean((1 / (1 + np.exp(-logits)) - labels) ** 2))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """The trained trainer, its exports, held-out batches and references."""
  root = tmp_path_factory.mktemp("exports")
  model = worker.build_model(jax.random.key(0), worker.mesh_of(8))
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), model, optax.adam(0.05), worker.loss_fn
  )
  for step in range(STEPS):
    features, labels = worker.make_batch(step)
    inputs, _ = trainer.model.embed.preprocess(features)
    trainer.step(inputs=inputs, labels=labels)
  for dtype in worker.DTYPES:
    export(trainer, root / dtype, table_dtype=dtype)
  worker.save_batches(str(root / "batches.npz"), HELD_OUT)
  batches = worker.load_batches(str(root / "batches.npz"))
  tables = pzsc.logical_tables(trainer.model.embed)
  rounded = copy_of(trainer.model)
  pzsc.set_logical_tables(
    rounded.embed,
    {k: v.astype(jnp.bfloat16).astype(np.float32) for k, v in tables.items()},
  )
  quantised = copy_of(trainer.model)
  _, int8_parts = stored(str(root / "int8"))
  pzsc.set_logical_tables(
    quantised.embed, {k: dequantised(v) for k, v in int8_parts.items()}
  )
  logits = {
    name: np.concatenate([worker.logits_of(m, f) for f, _ in batches])
    for name, m in (
      ("trained", trainer.model),
      ("bfloat16", rounded),
      ("int8", quantised),
    )
  }
  return {
    "root": root,
    "trainer": trainer,
    "tables": tables,
    "int8_parts": int8_parts,
    "logits": logits,
    "labels": np.concatenate([labels for _, labels in batches]),
  }


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory):
  """Per device count (1, 8): the worker's results, loaded from fresh
  processes (run side by side)."""
  out = tmp_path_factory.mktemp("served")
  root = trained["root"]
  procs = {
    devices: subprocess.Popen(
      [
        sys.executable,
        WORKER,
        "serve",
        str(devices),
        str(root),
        str(root / "batches.npz"),
        str(out / f"{devices}.npz"),
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=worker_env(devices),
    )
    for devices in (1, 8)
  }
  results = {}
  for devices, proc in procs.items():
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-4000:]
    data = np.load(out / f"{devices}.npz")
    results[devices] = {k: data[k] for k in data}
    for dtype in worker.DTYPES:
      results[devices][dtype] = np.concatenate(
        [data[f"{dtype}_{i}"] for i in range(len(HELD_OUT))]
      )
  return results


def test_float32_matches_the_trained_model(trained, served):
  want = trained["logits"]["trained"]
  np.testing.assert_array_equal(served[8]["float32"], want)
  for name, table in trained["tables"].items():
    for devices in (1, 8):
      np.testing.assert_array_equal(served[devices][f"table_{name}"], table)
  # 1 device: the same tables, a multi-hot mean summed in another order.
  np.testing.assert_allclose(served[1]["float32"], want, rtol=0, atol=1e-6)


def test_served_requests_of_any_size(trained, served):
  """Batches of 1 and of 5 samples (the export's specs say 64) give the
  trained model's logits of those samples."""
  want = trained["logits"]["trained"]
  for devices in (1, 8):
    got = served[devices]
    assert got["float32_ones"].shape[0] == 3
    assert got["float32_five"].shape[0] == 5
    np.testing.assert_allclose(got["float32_ones"], want[:3], rtol=1e-6)
    np.testing.assert_allclose(got["float32_five"], want[:5], rtol=1e-6)


def test_bfloat16_matches_the_tables_cast_to_bfloat16(trained, served):
  want = trained["logits"]["bfloat16"]
  np.testing.assert_array_equal(served[8]["bfloat16"], want)
  np.testing.assert_allclose(served[1]["bfloat16"], want, rtol=0, atol=1e-6)
  _, parts = stored(str(trained["root"] / "bfloat16"))
  for name, table in trained["tables"].items():
    rows = parts[name]["rows"]
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(rows, table.astype(jnp.bfloat16))


def test_int8_within_its_bound_and_metrics(trained, served):
  for name, table in trained["tables"].items():
    parts = trained["int8_parts"][name]
    assert parts["q"].dtype == np.uint8
    scale = parts["scale"]
    np.testing.assert_array_equal(parts["bias"], table.min(1))
    spread = table.max(1).astype(np.float64) - table.min(1)
    np.testing.assert_allclose(scale, spread / 255, rtol=2**-24)
    error = np.abs(dequantised(parts) - table)
    bound = scale[:, None] / 2 + np.spacing(np.abs(table))
    assert np.all(error <= bound), name
    assert error.max() > 0.2 * scale.max()  # It is quantised.
  want = trained["logits"]["int8"]
  np.testing.assert_array_equal(served[8]["int8"], want)
  np.testing.assert_allclose(served[1]["int8"], want, rtol=0, atol=1e-6)
  labels, exact = trained["labels"], trained["logits"]["trained"]
  got = served[8]["int8"]
  assert np.abs(got - exact).max() < 0.05
  assert auc(exact, labels) > 0.75  # The model learnt something.
  assert abs(auc(got, labels) - auc(exact, labels)) <= 0.01
  assert abs(brier(got, labels) - brier(exact, labels)) <= 0.002


def test_export_holds_no_optimizer_state(trained):
  root = trained["root"]
  tables = {"item": worker.ITEM_VOCAB, "tags": worker.TAG_VOCAB}
  dense = sum(
    np.asarray(p.value.data_array).nbytes
    for p in pz.unbind_params(trained["trainer"].model)[1]
    if "embeddings" not in p.label
  )
  row_bytes = {"float32": 4 * worker.DIM, "bfloat16": 2 * worker.DIM}
  row_bytes["int8"] = worker.DIM + 8  # Bytes, then a scale and a bias.
  for dtype in worker.DTYPES:
    manifest, _ = stored(str(root / dtype))
    assert set(os.listdir(root / dtype)) == {
      "manifest.json",
      "structure.pkl",
      "arrays",
    }
    arrays = {
      k: v for k, v in manifest["files"].items() if k != "structure.pkl"
    }
    assert len(os.listdir(root / dtype / "arrays")) == len(arrays)
    assert not any("accumulator" in e["what"] for e in arrays.values())
    assert set(manifest["variables"]) == {
      "item_proj.weights",
      "tags_proj.weights",
      "head.weights",
      "bias.bias",
    }
    total = sum(e["bytes"] for e in arrays.values())
    assert total == dense + row_bytes[dtype] * sum(tables.values()), dtype


def flip_byte(file: str, at: int = 5) -> None:
  with open(file, "r+b") as f:
    f.seek(at)
    byte = f.read(1)
    f.seek(at)
    f.write(bytes([byte[0] ^ 0x01]))


def tags_file(path) -> str:
  manifest, _ = stored(str(path))
  return os.path.join(
    path, manifest["layers"][0]["tables"]["tags"]["files"]["rows"]
  )


def test_damaged_export_is_refused_then_a_new_one_loads(trained, tmp_path):
  path = tmp_path / "export"
  shutil.copytree(trained["root"] / "float32", path)
  mesh = worker.mesh_of(2)
  file = tags_file(path)
  flip_byte(file)
  with pytest.raises(ValueError, match="checksum") as info:
    load_for_serving(path, mesh=mesh)
  assert file in str(info.value) and "table 'tags'" in str(info.value)
  os.truncate(file, 8)
  with pytest.raises(ValueError, match="truncated"):
    load_for_serving(path, mesh=mesh)
  export(trained["trainer"], path)  # Replaces the damaged export.
  flip_byte(os.path.join(path, "manifest.json"), at=40)
  with pytest.raises(ValueError, match="manifest"):
    load_for_serving(path, mesh=mesh)
  export(trained["trainer"], path)
  model = load_for_serving(path, mesh=mesh)
  got = pzsc.logical_tables(model.embed)
  for name, table in trained["tables"].items():
    np.testing.assert_array_equal(got[name], table)


def kill_export(path) -> None:
  """An export to `path` in another process, killed mid-write."""
  proc = subprocess.run(
    [sys.executable, WORKER, "killed", str(path)],
    capture_output=True,
    text=True,
    env=worker_env(1),
    timeout=300,
  )
  assert proc.returncode == -9, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_interrupted_export_is_refused_then_the_next_one_works(
  trained, tmp_path
):
  mesh = worker.mesh_of(2)
  # Killed mid-write (its second array file): nothing complete at `fresh`.
  fresh = tmp_path / "fresh"
  kill_export(fresh)
  assert not fresh.exists()
  with pytest.raises(FileNotFoundError, match="incomplete export"):
    load_for_serving(fresh, mesh=mesh)
  export(trained["trainer"], fresh)
  load_for_serving(fresh, mesh=mesh)
  assert os.listdir(tmp_path) == ["fresh"]  # The interrupted one removed.
  # Killed while replacing it: the previous export is still whole there.
  kill_export(fresh)
  model = load_for_serving(fresh, mesh=mesh)
  np.testing.assert_array_equal(
    pzsc.logical_tables(model.embed)["tags"], trained["tables"]["tags"]
  )
  # Its manifest (written last) missing: refused as incomplete.
  os.unlink(fresh / "manifest.json")
  with pytest.raises(ValueError, match="incomplete export"):
    load_for_serving(fresh, mesh=mesh)
  export(trained["trainer"], fresh)
  model = load_for_serving(fresh, mesh=mesh)
  np.testing.assert_array_equal(
    pzsc.logical_tables(model.embed)["item"], trained["tables"]["item"]
  )
  # Another folder is never replaced.
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="not an export"):
    export(trained["trainer"], tmp_path / "other")


def test_serving_model_refuses_training(trained):
  model = load_for_serving(trained["root"] / "float32", mesh=worker.mesh_of(8))
  features, labels = worker.make_batch(0)
  inputs, _ = model.embed.preprocess(features)
  with pytest.raises(ValueError, match=SERVING):
    pzsc.SparseCoreTrainer.build(
      jax.random.key(0), model, optax.sgd(0.1), worker.loss_fn
    )
  with pytest.raises(ValueError, match=SERVING):
    pzsc.split_tables(model)

  def loss(model, inputs):
    return jnp.mean(model(inputs))

  with pytest.raises(ValueError, match=SERVING):
    pzsc.value_and_grad(loss, step=0)(model, (), inputs)
  grads = {
    name: jnp.zeros((worker.BATCH, worker.DIM)) for name in ("item", "tags")
  }
  with pytest.raises(ValueError, match=SERVING):
    model.embed.apply_gradients(inputs, grads, 0)
  with pytest.raises(ValueError, match=SERVING):
    pzsc.save_checkpoint(trained["root"] / "checkpoints", model)
  # Dense parameters are constants, tables not trainable.
  assert not pz.unbind_params(model.item_proj)[1]
  tables = pz.unbind_params(model.embed)[1]
  assert all(not t.metadata["trainable"] for t in tables)
  # Nothing changed: the forward is still the trained one.
  np.testing.assert_array_equal(
    worker.logits_of(model, features),
    worker.logits_of(trained["trainer"].model, features),
  )


def test_model_like_instead_of_the_pickled_structure(trained, tmp_path):
  path = trained["root"] / "float32"
  mesh = worker.mesh_of(2)
  like = worker.build_model(None, worker.mesh_of(4))
  model = load_for_serving(path, like, mesh=mesh)
  features, _ = worker.make_batch(HELD_OUT[0])
  np.testing.assert_allclose(
    worker.logits_of(model, features),
    trained["logits"]["trained"][: worker.BATCH],
    rtol=0,
    atol=1e-6,
  )
  wrong = worker.build_model(jax.random.key(0), worker.mesh_of(1))
  wrong = (
    pz.select(wrong)
    .at_instances_of(pz.nn.AddBias)
    .apply(
      lambda _: pz.nn.AddBias.from_config(
        "bias", jax.random.key(0), {"logit": 2}
      )
    )
  )
  with pytest.raises(ValueError, match="'bias.bias'"):
    load_for_serving(path, wrong, mesh=mesh)

  # A model whose structure does not pickle (a class local to a function)
  # needs model_like.
  @pz.pytree_dataclass
  class Local(pz.nn.Layer):
    inner: worker.ExportModel

    def __call__(self, inputs, /, **side_inputs):
      return self.inner(inputs, **side_inputs)

  export(Local(inner=trained["trainer"].model), tmp_path / "local")
  with pytest.raises(ValueError, match="pass model_like"):
    load_for_serving(tmp_path / "local", mesh=mesh)
  model = load_for_serving(tmp_path / "local", Local(inner=like), mesh=mesh)
  np.testing.assert_array_equal(
    pzsc.logical_tables(model.inner.embed)["tags"], trained["tables"]["tags"]
  )


# ---------------------------------------------------------------------------
# Hashed tables: held ids served, unseen ids read zeros, nothing inserted.

HASHED_BATCH, HASHED_IDS = 16, 3


@pz.pytree_dataclass
class HashedModel(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed

  def __call__(self, inputs, /, **side_inputs):
    return self.embed(inputs)["u"].unwrap("batch", "embedding")


def hashed_loss(*, model, state, rng, inputs, g):
  del rng
  loss = jnp.sum(model(inputs) * g)
  return loss, state, {"loss": loss}


def test_hashed_table_round_trip(tmp_path):
  table = pzsc.TableSpec(
    name="users",
    vocabulary_size=256,
    embedding_dim=worker.DIM,
    initializer=jax.nn.initializers.normal(0.1),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.5),
    combiner="sum",
    ids="hashed",
  )
  spec = pzsc.FeatureSpec(
    name="u",
    table_spec=table,
    input_shape=(HASHED_BATCH, HASHED_IDS),
    output_shape=(HASHED_BATCH, worker.DIM),
  )
  embed = pzsc.SparseCoreEmbed.from_config(
    "e", jax.random.key(0), {"u": spec}, worker.mesh_of(8)
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), HashedModel(embed=embed), optax.sgd(0.1), hashed_loss
  )
  rng = np.random.default_rng(0)
  pool = rng.integers(-(2**62), 2**62, 40)
  for _ in range(3):
    inputs, _ = trainer.model.embed.preprocess(
      {"u": rng.choice(pool, (HASHED_BATCH, HASHED_IDS))}
    )
    g = rng.normal(size=(HASHED_BATCH, worker.DIM)).astype(np.float32)
    trainer.step(inputs=inputs, g=g)
  held = pzsc.hashed_rows(trainer.model.embed)["users"]
  assert len(held.ids) > 20
  export(trainer, tmp_path / "hashed")
  # 2 devices: every id re-homed onto its owner among 2 shards.
  model = load_for_serving(tmp_path / "hashed", mesh=worker.mesh_of(2))
  got = pzsc.hashed_rows(model.embed)["users"]
  np.testing.assert_array_equal(got.ids, held.ids)
  np.testing.assert_array_equal(got.rows, held.rows)
  # Even samples: held ids; odd samples: ids never seen.
  unseen = rng.integers(-(2**62), 2**62, HASHED_BATCH)[:, None]
  held_ids = rng.choice(held.ids, (HASHED_BATCH, HASHED_IDS))
  ids = np.where(
    np.arange(HASHED_BATCH)[:, None] % 2 == 0,
    held_ids,
    unseen + np.arange(HASHED_IDS),
  )
  before = {
    k: np.asarray(v.value) for k, v in model.embed.maps["users"].items()
  }
  forward = pzsc.variable_jit(lambda m, x: m(x))
  inputs, _ = model.embed.preprocess({"u": ids})
  out = np.asarray(forward(model, inputs))
  want_inputs, _ = trainer.model.embed.preprocess({"u": ids})
  want = np.asarray(forward(trainer.model, want_inputs))
  np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)
  assert np.all(out[1::2] == 0) and np.all(np.abs(out[::2]).sum(1) > 0)
  after = {k: np.asarray(v.value) for k, v in model.embed.maps["users"].items()}
  for part in ("ids", "seen"):
    np.testing.assert_array_equal(after[part], before[part])
  counters = dict(zip(hashed.COUNTERS, after["counters"].sum(0), strict=True))
  assert counters["held"] == len(held.ids) and counters["inserted"] == 0
  assert counters["unseen"] == HASHED_BATCH // 2 * HASHED_IDS
  np.testing.assert_array_equal(
    pzsc.hashed_rows(model.embed)["users"].ids, held.ids
  )
  with pytest.raises(ValueError, match=SERVING):
    model.embed.resolve_ids(inputs)  # Training's insertion.


def test_lookup_round_trip_and_re_export(tmp_path):
  lookup = pzsc.SparseCoreLookup.from_config(
    "embedder",
    jax.random.key(0),
    100,
    {"embedding": worker.DIM},
    worker.mesh_of(8),
    pzsc.AdagradOptimizerSpec(learning_rate=0.1),
    gather_max_samples=3,
  )
  tokens = np.random.RandomState(0).randint(0, 100, (4, 6)).astype(np.int32)
  tokens = pz.nx.wrap(jnp.asarray(tokens)).tag("batch", "seq")

  def looked_up(model):
    return np.asarray(model(tokens).unwrap("batch", "seq", "embedding"))

  want = looked_up(lookup)
  export(pz.nn.Sequential([lookup]), tmp_path / "lookup")
  served = load_for_serving(tmp_path / "lookup", mesh=worker.mesh_of(2))
  (layer,) = served.sublayers
  assert isinstance(layer, pzsc.SparseCoreLookup)
  assert layer.config.label == "embedder.embeddings"
  assert layer.config.gather_max_samples == 3  # The serving rule kept.
  np.testing.assert_array_equal(looked_up(served), want)
  # A serving model exports again (here as int8) and loads.
  export(served, tmp_path / "again", table_dtype="int8")
  again = load_for_serving(tmp_path / "again", mesh=worker.mesh_of(1))
  table = pzsc.logical_tables(lookup)["embedder"]
  got = pzsc.logical_tables(again.sublayers[0])["embedder"]
  spread = table.max(1, keepdims=True) - table.min(1, keepdims=True)
  assert np.all(np.abs(got - table) <= spread / 255 / 2 + 1e-7)


def test_jax_nn_activations_and_scalar_variables_round_trip(tmp_path):
  """`pz.nn.Elementwise(jax.nn.relu)` (a `jax.custom_jvp` object) pickles
  by name, and a scalar bias keeps its shape `()`."""
  lookup = pzsc.SparseCoreLookup.from_config(
    "embedder",
    jax.random.key(0),
    50,
    {"embedding": worker.DIM},
    worker.mesh_of(8),
    pzsc.AdagradOptimizerSpec(learning_rate=0.1),
  )
  bias = pz.nn.AddBias.from_config("bias", jax.random.key(1), biased_axes={})
  bias.bias.value = pz.nx.wrap(jnp.float32(0.25))
  model = pz.nn.Sequential(
    [
      lookup,
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Elementwise(jax.nn.silu),
      bias,
    ]
  )
  tokens = pz.nx.wrap(jnp.arange(12, dtype=jnp.int32)).tag("batch")

  def out(m):
    return np.asarray(m(tokens).unwrap("batch", "embedding"))

  export(model, tmp_path / "m")
  served = load_for_serving(tmp_path / "m", mesh=worker.mesh_of(1))
  assert served.sublayers[1].fn is jax.nn.relu
  assert served.sublayers[3].bias.value.positional_shape == ()
  assert served.sublayers[3].bias.value.named_shape == {}
  np.testing.assert_allclose(out(served), out(model), rtol=1e-6)
