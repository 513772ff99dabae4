"""`SparseCoreEmbed` takes batches of any size: buckets, padding inside the
layer, outputs for the real samples only.

References: the forward against a NumPy lookup of the logical tables; the
training against the same layer given the same samples padded by hand to
the specs' batch with a masked loss (the path that existed before).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs
from pz_sparsecore.nn import batching
from pz_sparsecore.nn.tables import slot_arrays, table_arrays

B, SEQ, DIM = 64, 3, 8
_INIT = jax.nn.initializers.normal(1.0)


def _table(name, vocab, optimizer, combiner="sum", **kw):
  return specs.TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=DIM,
    initializer=_INIT,
    optimizer=optimizer,
    combiner=combiner,
    **kw,
  )


def _specs(hashed=False):
  adagrad = specs.AdagradOptimizerSpec(learning_rate=0.3)
  big = _table("big", 101, adagrad)
  small = _table("small", 37, adagrad, combiner="mean")
  seq = _table("seq", 50, specs.SGDOptimizerSpec(learning_rate=0.5))
  if hashed:
    big = _table("big", 128, adagrad, ids="hashed")
  return {
    "dense": specs.FeatureSpec(
      name="dense", table_spec=big, input_shape=(B, 3), output_shape=(B, DIM)
    ),
    "ragged": specs.FeatureSpec(
      name="ragged",
      table_spec=small,
      input_shape=(B, None),
      output_shape=(B, DIM),
    ),
    # A second feature of the same table: one stack, two sample ranges.
    "pair": specs.FeatureSpec(
      name="pair", table_spec=big, input_shape=(B, 2), output_shape=(B, DIM)
    ),
    "seq": specs.FeatureSpec(
      name="seq",
      table_spec=seq,
      input_shape=(B, SEQ),
      output_shape=(B, SEQ, DIM),
    ),
  }


_AXES = {"seq": ("batch", "pos")}
_MESHES = {
  "1": ((1,), ("d",), 1),
  "8": ((8,), ("d",), 1),
  "2x2x2sc": ((2, 2), ("x", "y"), 2),
}


@functools.cache
def _layer(mesh_name, hashed=False):
  shape, names, sc = _MESHES[mesh_name]
  count = int(np.prod(shape))
  mesh = Mesh(np.array(jax.devices()[:count]).reshape(shape), names)
  return pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _specs(hashed),
    mesh,
    num_sc_per_device=sc,
    feature_axes=_AXES,
  )


def _fresh(mesh_name, hashed=False):
  """A new layer with its initial values (the same every time)."""
  return _layer.__wrapped__(mesh_name, hashed)


def _batch(rng, n, *, big_vocab=101):
  return {
    "dense": rng.integers(0, big_vocab, (n, 3)),
    # Ragged rows, some empty.
    "ragged": [rng.integers(0, 37, rng.integers(0, 4)) for _ in range(n)],
    "pair": rng.integers(0, big_vocab, (n, 2)),
    "seq": rng.integers(0, 50, (n, SEQ)),
  }


def _reference(tables, batch):
  """NumPy lookups of the logical tables, per feature."""
  big, small, seq = (np.asarray(tables[k]) for k in ("big", "small", "seq"))
  ragged = np.stack(
    [small[r].mean(0) if len(r) else np.zeros(DIM) for r in batch["ragged"]]
  )
  return {
    "dense": big[batch["dense"]].sum(1),
    "ragged": ragged,
    "pair": big[batch["pair"]].sum(1),
    "seq": seq[batch["seq"]],
  }


def _unwrap(acts):
  return {k: np.asarray(v.unwrap(*v.named_shape)) for k, v in acts.items()}


def test_bucket_rule():
  assert batching.bucket_size(1000, 4096) == 1024
  assert batching.bucket_size(3000, 4096) == 4096
  assert batching.bucket_size(4096, 4096) == 4096
  assert batching.bucket_size(5000, 4096) == 8192
  assert batching.bucket_size(1, 4096, 8) == 8
  assert batching.bucket_size(9, 4096, 8) == 16
  # A unit that is not a power of two: 6 * 2**k, never above the specs'.
  assert batching.bucket_size(3, 96, 6) == 6
  assert batching.bucket_size(13, 96, 6) == 24
  assert batching.bucket_size(80, 96, 6) == 96
  assert batching.bucket_size(97, 96, 6) == 192
  # On 8 shards, batches of 1..200 of a layer specified for 64: buckets
  # 8, 16, 32, 64 (the specs'), 128 and 256.
  assert batching.buckets(_layer("8"), 200) == [8, 16, 32, 64, 128, 256]


@pytest.mark.parametrize("mesh_name", list(_MESHES))
def test_forward_of_any_batch_matches_numpy(mesh_name):
  embed = _fresh(mesh_name)
  tables = pzsc.logical_tables(embed)
  rng = np.random.default_rng(1)
  for n in (1, 5, 13, 33, B, 100):
    batch = _batch(rng, n)
    inputs, _ = embed.preprocess(batch)
    assert (inputs.batch is None) == (n == B)
    got = _unwrap(embed(inputs))
    want = _reference(tables, batch)
    for name in want:
      assert got[name].shape[0] == n, name
      np.testing.assert_allclose(
        got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=f"{n} {name}"
      )
    # Kept padding: the bucket's samples, the real ones first, then zeros.
    padded, _ = embed.preprocess(batch, keep_padding=True)
    kept = _unwrap(embed(padded))
    size = kept["dense"].shape[0]
    shards = embed.config.topology.num_shards
    assert size == batching.bucket_size(n, B, shards)
    for name in want:
      np.testing.assert_allclose(kept[name][:n], want[name], atol=1e-5)
      assert not np.any(kept[name][n:]), name


def test_each_bucket_compiles_the_jitted_call_once(caplog):
  embed = _fresh("8")
  call = pzsc.variable_jit(lambda e, x: e(x))
  rng = np.random.default_rng(2)
  with jax.log_compiles(True), caplog.at_level("WARNING"):
    caplog.clear()
    for n in (3, 5, 7, 3, 5, 7, 8):
      inputs, _ = embed.preprocess(_batch(rng, n), keep_padding=True)
      assert inputs.batch.padded[0] == 8
      call(embed, inputs)
    compiles = sum("Compiling" in r.getMessage() for r in caplog.records)
  # Bucket 8 with the padding kept: one program for every size.
  assert compiles == 1


def _loss_fn(*, model, state, rng, inputs, labels, mask):
  """Masked squared error of a fixed readout of every feature."""
  del rng
  acts = model(inputs)
  pred = 0.0
  for a in acts.values():
    x = a.unwrap(*a.named_shape)
    pred = pred + jnp.sin(x.reshape(x.shape[0], -1)).sum(axis=1)
  err = (pred - labels) ** 2
  loss = jnp.sum(err * mask) / jnp.sum(mask)
  return loss, state, {"loss": loss, "samples": pred.shape[0]}


def _pad_by_hand(batch, n):
  """The old way: empty rows and masked labels up to the specs' batch."""
  extra = B - n
  return {
    "dense": [np.asarray(r) for r in batch["dense"]]
    + [np.zeros(0, np.int64)] * extra,
    "ragged": list(batch["ragged"]) + [np.zeros(0, np.int64)] * extra,
    "pair": [np.asarray(r) for r in batch["pair"]]
    + [np.zeros(0, np.int64)] * extra,
    # One id per sample and position: padded positions read row 0 but
    # their outputs are masked out of the loss.
    "seq": np.concatenate([batch["seq"], np.zeros((extra, SEQ), np.int64)]),
  }


def _trainer(mesh_name, hashed=False):
  return pzsc.SparseCoreTrainer.build(
    jax.random.key(1), _fresh(mesh_name, hashed), optax.sgd(0.1), _loss_fn
  )


def _state(trainer):
  out = dict(pzsc.logical_tables(trainer.model))
  for table, slots in pzsc.logical_slots(trainer.model).items():
    for slot, value in slots.items():
      out[f"{table}.{slot}"] = value
  return {k: np.asarray(v) for k, v in out.items()}


def _physical(embed):
  """Every stack's table and slots as stored (hashed rows have no
  vocabulary order)."""
  out = {k: np.asarray(v) for k, v in table_arrays(embed).items()}
  for stack, slots in slot_arrays(embed).items():
    for i, value in enumerate(slots):
      out[f"{stack}.{i}"] = np.asarray(value)
  return out


@pytest.mark.parametrize("mesh_name", ["1", "8"])
def test_training_on_a_short_batch_equals_padding_it_by_hand(mesh_name):
  rng = np.random.default_rng(3)
  sizes = (B, 21, 1, B, 37)
  batches = [(_batch(rng, n), rng.normal(size=n)) for n in sizes]
  ours, theirs = _trainer(mesh_name), _trainer(mesh_name)
  for batch, labels in batches:
    n = len(labels)
    got = ours.step(
      inputs=ours.model.preprocess(batch)[0],
      labels=labels,
      mask=np.ones(n, np.float32),
    )
    assert got["samples"] == n
    mask = np.zeros(B, np.float32)
    mask[:n] = 1
    want = theirs.step(
      inputs=theirs.model.preprocess(_pad_by_hand(batch, n))[0],
      labels=np.concatenate([labels, np.zeros(B - n)]),
      mask=mask,
    )
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  a, b = _state(ours), _state(theirs)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_hashed_tables_train_on_a_short_batch_as_padded_by_hand():
  rng = np.random.default_rng(4)
  raw = rng.integers(-(2**62), 2**62, 400)
  batches = []
  for n in (B, 9, B, 50):
    batch = _batch(rng, n)
    batch["dense"] = rng.choice(raw, (n, 3))
    batch["pair"] = rng.choice(raw, (n, 2))
    batches.append((batch, rng.normal(size=n)))
  ours, theirs = _trainer("8", True), _trainer("8", True)
  for batch, labels in batches:
    n = len(labels)
    ours.step(
      inputs=ours.model.preprocess(batch)[0],
      labels=labels,
      mask=np.ones(n, np.float32),
    )
    mask = np.zeros(B, np.float32)
    mask[:n] = 1
    theirs.step(
      inputs=theirs.model.preprocess(_pad_by_hand(batch, n))[0],
      labels=np.concatenate([labels, np.zeros(B - n)]),
      mask=mask,
    )
  a, b = _physical(ours.model), _physical(theirs.model)
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
  for stack, parts in ours.model.maps.items():
    for part, var in parts.items():
      np.testing.assert_array_equal(
        np.asarray(var.value),
        np.asarray(theirs.model.maps[stack][part].value),
        err_msg=f"{stack} {part}",
      )


def test_fit_epochs_with_a_last_short_batch_compile_twice_in_all(caplog):
  """Five batches an epoch, the last of 23 samples: the full and the short
  batch compile the step once each, in the first epoch only."""
  trainer = _trainer("8")
  rng = np.random.default_rng(5)
  epoch = [(_batch(rng, n), rng.normal(size=n)) for n in (B, B, B, B, 23)]

  def prepare(item):
    batch, labels = item
    return {
      "inputs": trainer.model.preprocess(batch)[0],
      "labels": labels,
      "mask": np.ones(len(labels), np.float32),
    }

  compiles, samples = [], []
  for _ in range(3):
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level("WARNING"):
      aux = trainer.fit(epoch, prepare)
    compiles.append(
      sum(
        r.getMessage().startswith("Compiling jit(_trainer_step)")
        for r in caplog.records
      )
    )
    samples.append([a["samples"] for a in aux])
    assert all(np.isfinite(float(a["loss"])) for a in aux)
  assert compiles == [2, 0, 0]
  assert samples == [[B, B, B, B, 23]] * 3


def test_hand_written_step_with_apply_gradients(mesh_name="8"):
  """`apply_gradients` takes the real samples' activation gradients."""
  rng = np.random.default_rng(6)
  batch, labels = _batch(rng, 11), rng.normal(size=11)
  embed = _fresh(mesh_name)

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def step(embed, inputs, labels):
    acts = embed(inputs)

    def loss_of(acts):
      pred = sum(
        jnp.sin(a.unwrap(*a.named_shape)).reshape(11, -1).sum(1)
        for a in acts.values()
      )
      return jnp.mean((pred - labels) ** 2)

    loss, grads = jax.value_and_grad(loss_of)(acts)
    embed.apply_gradients(inputs, grads, 0)
    return loss

  step(embed, embed.preprocess(batch)[0], labels)
  trainer = _trainer(mesh_name)
  trainer.step(
    inputs=trainer.model.preprocess(batch)[0],
    labels=labels,
    mask=np.ones(11, np.float32),
  )
  a, b = pzsc.logical_tables(embed), pzsc.logical_tables(trainer.model)
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_minibatched_short_batch_matches_numpy():
  embed = _fresh("8")
  tables = pzsc.logical_tables(embed)
  batch = _batch(np.random.default_rng(7), 19)
  inputs, _ = embed.preprocess(batch, enable_minibatching=True)
  assert inputs.num_minibatches is not None
  got = _unwrap(embed(inputs))
  want = _reference(tables, batch)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_refusals_name_the_feature_then_a_good_batch_works():
  embed = _fresh("8")
  rng = np.random.default_rng(8)
  batch = _batch(rng, 10)
  uneven = {**batch, "pair": batch["pair"][:7]}
  with pytest.raises(
    ValueError, match="feature 'pair': 7 samples along 'batch'"
  ):
    embed.preprocess(uneven)
  empty = {k: v[:0] for k, v in batch.items()}
  with pytest.raises(ValueError, match="empty batch"):
    embed.preprocess(empty)
  # A sequence feature given as ragged rows that do not fill its positions.
  rows = {**batch, "seq": [np.array([1])] * 29}
  with pytest.raises(ValueError, match="feature 'seq': 29 rows"):
    embed.preprocess(rows)
  inputs, _ = embed.preprocess(batch)
  wrong = {
    k: pz.nx.wrap(jnp.zeros((B, DIM))).tag("batch", "embedding")
    for k in ("dense", "ragged", "pair")
  }
  wrong["seq"] = pz.nx.wrap(jnp.zeros((B, SEQ, DIM))).tag(
    "batch", "pos", "embedding"
  )
  with pytest.raises(ValueError, match=r"expected \(10, 8\)"):
    embed.apply_gradients(inputs, wrong, 0)
  got = _unwrap(embed(inputs))
  want = _reference(pzsc.logical_tables(embed), batch)
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
