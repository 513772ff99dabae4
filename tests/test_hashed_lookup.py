"""`SparseCoreLookup` with raw ids (`ids="hashed"`).

References, independent of the lookup: the same stream trained through a
`SparseCoreEmbed` with a hashed `TableSpec` (itself checked against
`hashed_model` and a NumPy trainer in `test_hashed_tables.py`), and
`hashed_model.ShardModel` replaying each shard's map. The buffers the
lookup builds on the device are checked against its host path bit for
bit, and each looked-up row against the rows the map says the ids hold
(`pzsc.hashed_rows`).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import hashed_model
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import hashed
from pz_sparsecore.device import hashed_build
from pz_sparsecore.nn.embed import fits

D = 8
LR = 0.5
INIT = jax.nn.initializers.normal(0.1)
AXES = ("batch", "seq")


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()[:8]), ("d",))


def hashed_lookup(mesh, capacity, name="users", **kwargs):
  return pzsc.SparseCoreLookup.from_config(
    name,
    jax.random.key(0),
    vocab_size=capacity,
    embedding_axes={"embedding": D},
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=LR),
    initializer=INIT,
    ids="hashed",
    eviction="lru",
    **kwargs,
  )


def named(ids) -> pz.nx.NamedArray:
  return pz.nx.wrap(jnp.asarray(ids)).tag(*AXES[: np.ndim(ids)])


def values(out) -> jax.Array:
  """A lookup's output `{batch, seq, embedding}` (leading axes) as an
  array."""
  return out.unwrap(*AXES[: len(out.named_shape) - 1], "embedding")


def counters(layer) -> np.ndarray:
  (parts,) = layer.maps.values()
  return np.asarray(parts["counters"].value).sum(0)


def ids_owned_by(shard: int, count: int, seed: int, n: int = 8) -> np.ndarray:
  rng = np.random.default_rng(seed)
  pool = rng.integers(-(2**31), 2**31 - 1, size=40 * count, dtype=np.int64)
  return pool[hashed.owners(pool, n) == shard][:count]


# ---------------------------------------------------------------------------
# The hashes on the devices.


def test_device_hashes_equal_the_host_ones():
  rng = np.random.default_rng(0)
  ids = rng.integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)
  ids[:5] = [0, -1, 2**63 - 1, -(2**63), 2**32]
  lo, hi = hashed.key_words(ids)
  mixed = hashed.mix64(ids)
  got_lo, got_hi = hashed.mix64_words(lo, hi)
  np.testing.assert_array_equal(
    np.asarray(got_lo), (mixed & np.uint64(2**32 - 1)).astype(np.uint32)
  )
  np.testing.assert_array_equal(
    np.asarray(got_hi), (mixed >> np.uint64(32)).astype(np.uint32)
  )
  np.testing.assert_array_equal(
    hashed.owners_of_words(lo, hi, 8), hashed.owners(ids, 8)
  )
  np.testing.assert_array_equal(
    hashed.homes_of_words(lo, hi, 1000), hashed.homes(ids, 1000)
  )
  # int32 ids read as signed 64-bit ids (sign-extended); uint32 ones as
  # their value.
  small = np.array([-5, -1, 0, 7, 2**31 - 1, -(2**31)], np.int32)
  for given, as_int64 in (
    (small, small.astype(np.int64)),
    (small.view(np.uint32), small.view(np.uint32).astype(np.int64)),
  ):
    got = hashed_build.id_words(jnp.asarray(given))
    want = hashed.key_words(as_int64)
    for g, w in zip(got, want, strict=True):
      np.testing.assert_array_equal(np.asarray(g).view(np.int32), w)
  with pytest.raises(ValueError, match="power of two"):
    hashed.owners_of_words(lo, hi, 6)


# ---------------------------------------------------------------------------
# (a) Training on host buffers.


@pz.pytree_dataclass
class LookupModel(pz.nn.Layer):
  lookup: pzsc.SparseCoreLookup

  def __call__(self, tokens, **side_inputs):
    return self.lookup(tokens, **side_inputs)


@pz.pytree_dataclass
class EmbedModel(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed

  def __call__(self, inputs, **side_inputs):
    return self.embed(inputs)["users"]


def lookup_loss(*, model, state, rng, tokens, sparsecore_inputs, g):
  del rng
  acts = values(model(tokens, sparsecore_inputs=sparsecore_inputs))
  loss = jnp.sum(acts * g)
  return loss, state, {"loss": loss}


def embed_loss(*, model, state, rng, inputs, g):
  del rng
  acts = model(inputs).unwrap("batch", "embedding")
  loss = jnp.sum(acts.reshape(g.shape) * g)
  return loss, state, {"loss": loss}


def stream(shape, steps, seed):
  """Batches of raw ids: duplicates, negative ids, the extremes, each
  shard's ids, and one batch of strings."""
  rng = np.random.default_rng(seed)
  size = int(np.prod(shape))
  pool = rng.integers(-(2**63), 2**63 - 1, size=120, dtype=np.int64)
  pool[:3] = [-1, 0, 2**63 - 1]
  for p in range(8):
    pool[3 + p] = ids_owned_by(p, 1, seed + p)[0]
  for step in range(steps):
    ids = pool[rng.integers(0, len(pool), size=size)]
    ids[:8] = pool[(np.arange(8) + 8 * step) % len(pool)]
    ids[8] = ids[0]  # A duplicate.
    batch = ids.reshape(shape)
    if step == 2:
      batch = np.array([f"user-{i % 5}" for i in range(size)]).reshape(shape)
    yield batch, rng.normal(size=(*shape, D)).astype(np.float32)


def replay_maps(batches, capacity_per_shard, n=8):
  """Each shard's map after training on `batches` (`hashed_model`)."""
  shards = [hashed_model.ShardModel(capacity_per_shard) for _ in range(n)]
  total = np.zeros(len(hashed.COUNTERS), np.int64)
  eviction = hashed.Eviction("lru")
  for step, batch in enumerate(batches):
    flat = np.asarray(batch).reshape(-1)
    if flat.dtype.kind == "U":
      flat = pzsc.string_ids(flat)
    owner = hashed.owners(flat, n)
    for p, shard in enumerate(shards):
      distinct = np.unique(flat[owner == p])
      if len(distinct):
        got = shard.call(
          hashed_model.shard_input(distinct, capacity_per_shard),
          step,
          eviction,
          True,
        )
        total += got[2]
  return shards, total


def test_host_path_trains_as_a_hashed_embed(mesh, tmp_path):
  """The trainer inserts the lookup's raw ids (from `preprocess`) as it
  does a `SparseCoreEmbed`'s: the same maps (and as `hashed_model`
  replays them, with evictions of full shards), rows and losses; a
  checkpoint keeps them."""
  shape, capacity = (4, 4), 64  # 8 rows per shard: lru evicts.
  lookup = hashed_lookup(mesh, capacity)
  table = pzsc.TableSpec(
    name="users",
    vocabulary_size=capacity,
    embedding_dim=D,
    initializer=INIT,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=LR),
    combiner="sum",
    ids="hashed",
    eviction="lru",
  )
  spec = pzsc.FeatureSpec(
    name="users", table_spec=table, input_shape=(16, 1), output_shape=(16, D)
  )
  embed = pzsc.SparseCoreEmbed.from_config(
    "users", jax.random.key(0), {"users": spec}, mesh
  )
  trainers = (
    pzsc.SparseCoreTrainer.build(
      jax.random.key(1), LookupModel(lookup), optax.sgd(0.1), lookup_loss
    ),
    pzsc.SparseCoreTrainer.build(
      jax.random.key(1), EmbedModel(embed), optax.sgd(0.1), embed_loss
    ),
  )
  tokens = named(np.zeros(shape, np.int32))  # Only its shape counts.
  batches = list(stream(shape, 7, seed=1))
  for ids, g in batches:
    inputs, _ = lookup.preprocess(ids)
    assert inputs.hashed_ids is not None
    assert fits(trainers[0].model.lookup, inputs)
    got = trainers[0].step(
      tokens=tokens, sparsecore_inputs=inputs, g=jnp.asarray(g)
    )
    inputs, _ = trainers[1].model.embed.preprocess(
      {"users": ids.reshape(-1, 1)}
    )
    want = trainers[1].step(inputs=inputs, g=jnp.asarray(g))
    np.testing.assert_allclose(
      float(got["loss"]), float(want["loss"]), rtol=1e-6
    )
  trained, reference = trainers[0].model.lookup, trainers[1].model.embed
  seen = np.concatenate(
    [
      pzsc.string_ids(b.reshape(-1)) if b.dtype.kind == "U" else b.reshape(-1)
      for b, _ in batches
    ]
  )
  assert set(hashed.owners(seen, 8)) == set(range(8))
  for part in ("ids", "seen", "counters", "seed"):
    np.testing.assert_array_equal(
      np.asarray(trained.maps["users"][part].value),
      np.asarray(reference.maps["users"][part].value),
      err_msg=part,
    )
  # The rows of the held ids (free slots hold their initializer's values,
  # drawn from the table's label, which the layers name differently).
  held, want = (pzsc.hashed_rows(x)["users"] for x in (trained, reference))
  assert len(held.ids)
  for field in held._fields:
    np.testing.assert_array_equal(
      getattr(held, field), getattr(want, field), err_msg=field
    )
  shards, total = replay_maps([b for b, _ in batches], 8)
  for p, shard in enumerate(shards):
    np.testing.assert_array_equal(
      trained.maps["users"]["ids"].value[p], shard.ids
    )
    np.testing.assert_array_equal(
      trained.maps["users"]["seen"].value[p], shard.seen
    )
  np.testing.assert_array_equal(counters(trained), total)
  full = (np.asarray(trained.maps["users"]["seen"].value)[..., 0] >= 0).all(1)
  assert full.any() and total[2] > 0  # Full shards evict.
  # Served from its buffers and from its ids alike: each id its held row.
  ids, _ = batches[-1]
  held = pzsc.hashed_rows(trained)["users"]
  at = np.searchsorted(held.ids, ids.reshape(-1))
  np.testing.assert_array_equal(held.ids[at], ids.reshape(-1))
  want = held.rows[at].reshape(*shape, D)
  host = trained(tokens, sparsecore_inputs=trained.preprocess(ids)[0])
  np.testing.assert_array_equal(values(host), want)

  pzsc.save_checkpoint(tmp_path, trainers[0], step=len(batches))
  fresh = LookupModel(
    pzsc.SparseCoreLookup.from_config(
      "users",
      None,
      capacity,
      {"embedding": D},
      mesh,
      pzsc.SGDOptimizerSpec(learning_rate=LR),
      initializer=INIT,
      ids="hashed",
    )
  )
  restored = pzsc.restore_checkpoint(tmp_path, fresh).lookup
  for part in ("ids", "seen", "counters", "seed"):
    np.testing.assert_array_equal(
      np.asarray(restored.maps["users"][part].value),
      np.asarray(trained.maps["users"][part].value),
    )
  got = pzsc.hashed_rows(restored)["users"]
  np.testing.assert_array_equal(got.ids, held.ids)
  np.testing.assert_array_equal(got.rows, held.rows)


# ---------------------------------------------------------------------------
# (b), (c) Inference from the ids alone.


@pytest.fixture(scope="module")
def served(mesh):
  """A lookup holding 200 ids (inserted from host buffers), and those."""
  lookup = hashed_lookup(mesh, 1024, name="served")
  rng = np.random.default_rng(2)
  known = rng.integers(-(2**31), 2**31 - 1, size=200, dtype=np.int64)
  known[:2] = [-1, -(2**31)]
  inputs, _ = lookup.preprocess(known.reshape(25, 8))
  lookup.resolve_ids(inputs, step=0)
  assert counters(lookup)[0] == 200
  return lookup, known


def mixed_ids(known, shape, seed):
  """int32 ids: held ones (negative ones among them), unseen ones and
  duplicates."""
  rng = np.random.default_rng(seed)
  size = int(np.prod(shape))
  ids = known[rng.integers(0, len(known), size=size)]
  unseen = rng.random(size) < 0.4
  ids[unseen] = rng.integers(-(2**31), 2**31 - 1, size=unseen.sum())
  ids[0] = known[1]  # A negative held id.
  if size > 2:
    ids[-1] = ids[-2]
  return ids.astype(np.int32).reshape(shape)


def test_describe_shows_the_lookups_map(served):
  lookup, _ = served
  text = pzsc.viz.describe(lookup)
  held = int(counters(lookup)[0])
  assert f"map: {held} ids held of 1024 rows" in text
  assert "inserted" in text and "unseen (inference)" in text


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (8, 17)])
def test_ids_on_the_device_read_as_host_buffers(served, shape):
  """Bit for bit the host path's embeddings; each id its held row or
  zeros, unseen ids counted alike; nothing inserted."""
  lookup, known = served
  ids = mixed_ids(known, shape, seed=sum(shape))
  before = counters(lookup)
  device = np.asarray(values(lookup(named(ids))))
  after_device = counters(lookup)
  # The host path reads its buffers; the NamedArray gives the shape only.
  inputs, _ = lookup.preprocess(ids.astype(np.int64))
  host = np.asarray(
    values(lookup(named(np.zeros(shape, np.int32)), sparsecore_inputs=inputs))
  )
  after_host = counters(lookup)
  np.testing.assert_array_equal(device.view(np.int32), host.view(np.int32))
  held = pzsc.hashed_rows(lookup)["served"]
  flat = ids.reshape(-1).astype(np.int64)
  at = np.minimum(np.searchsorted(held.ids, flat), len(held.ids) - 1)
  is_held = held.ids[at] == flat
  want = np.where(is_held[:, None], held.rows[at], 0).reshape(*shape, D)
  np.testing.assert_array_equal(device, want)
  unseen = len(set(flat[~is_held].tolist()))
  assert unseen > 0 or ids.size == 1
  np.testing.assert_array_equal(after_device - before, [0, 0, 0, 0, unseen])
  np.testing.assert_array_equal(
    after_host - after_device, after_device - before
  )


def test_int64_and_uint64_ids_on_the_device_with_x64(served):
  lookup, known = served
  ids = np.array([[known[0], -(2**62), 2**40], [7, known[5], 2**63 - 1]])
  inputs, _ = lookup.preprocess(ids)
  host = values(
    lookup(named(np.zeros((2, 3), np.int32)), sparsecore_inputs=inputs)
  )
  # Two held ids; four unseen ones read zeros.
  assert np.sum(np.abs(np.asarray(host)).sum(-1) == 0) == 4
  with jax.enable_x64(True):
    for given in (ids, ids.view(np.uint64)):
      tokens = pz.nx.wrap(jnp.asarray(given)).tag("batch", "seq")
      assert tokens.dtype == given.dtype
      np.testing.assert_array_equal(values(lookup(tokens)), host)


def test_ids_on_the_device_under_jit(served):
  lookup, known = served
  ids = mixed_ids(known, (3, 5), seed=9)
  want = values(lookup(named(ids)))
  before = counters(lookup)
  got = pzsc.variable_jit(lambda m, t: m(t))(lookup, named(ids))
  np.testing.assert_array_equal(values(got), want)
  unseen = (counters(lookup) - before)[4]
  assert unseen > 0
  # A raw jax.jit of the unbound layer, its state threaded through.
  stateless, variables = pz.unbind_variables(lookup, freeze=True)

  @jax.jit
  def call(variables, tokens):
    mutable = [v.unfreeze_as_copy() for v in variables]
    out = pz.bind_variables(stateless, mutable)(tokens)
    return out, [v.freeze() for v in mutable]

  out, new = call(variables, named(ids))
  np.testing.assert_array_equal(values(out), want)
  (counted,) = [v for v in new if v.label == "served.map_counters"]
  np.testing.assert_array_equal(
    np.asarray(counted.value).sum(0), counters(lookup) + [0, 0, 0, 0, unseen]
  )


# ---------------------------------------------------------------------------
# (d) What is refused.


def test_training_on_device_ids_is_refused_then_host_buffers_train(mesh):
  lookup = hashed_lookup(mesh, 256, name="refused")

  def loss_fn(*, model, state, rng, tokens, **side_inputs):
    del rng
    out = values(model(tokens, **side_inputs))
    loss = jnp.sum(out)
    return loss, state, {"loss": loss}

  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), LookupModel(lookup), optax.sgd(0.1), loss_fn
  )
  ids = np.array([[-3, 5, 10**15], [7, -3, 2**40]], np.int64)
  tokens = named(ids.astype(np.int32))
  with pytest.raises(
    ValueError,
    match=r"'refused.embeddings' has hashed ids.*"
    r"sparsecore_inputs=lookup.preprocess\(raw_ids\)\[0\]",
  ):
    trainer.step(tokens=tokens)
  assert counters(trainer.model.lookup)[1] == 0
  inputs, _ = lookup.preprocess(ids)
  aux = trainer.step(tokens=tokens, sparsecore_inputs=inputs)
  assert np.isfinite(float(aux["loss"])) and float(aux["loss"]) != 0
  assert counters(trainer.model.lookup)[1] == 5  # inserted

  # A hand-written step must resolve the buffers first.
  rest, dense = pzsc.split_tables(LookupModel(trainer.model.lookup))
  grad = pzsc.value_and_grad(
    lambda m, t, i: jnp.sum(values(m(t, sparsecore_inputs=i))), step=1
  )
  with pytest.raises(ValueError, match="not resolved.*resolve_ids"):
    grad(rest, dense, tokens, inputs)
  resolved = trainer.model.lookup.resolve_ids(inputs, step=1)
  loss, _ = grad(rest, dense, tokens, resolved)
  assert np.isfinite(float(loss))


def test_bad_arguments_and_ids_are_refused(mesh):
  opt = pzsc.SGDOptimizerSpec(learning_rate=0.1)
  make = functools.partial(
    pzsc.SparseCoreLookup.from_config, "t", None, 64, {"e": 8}, mesh, opt
  )
  with pytest.raises(ValueError, match="eviction is for hashed tables"):
    make(eviction="lru")
  with pytest.raises(ValueError, match="ids must be one of"):
    make(ids="raw")
  with pytest.raises(ValueError, match="eviction policy must be one of"):
    make(ids="hashed", eviction="fifo")
  dense = pz.nn.EmbeddingLookup(
    pz.nn.EmbeddingTable.from_config("emb", jax.random.key(1), 50, {"e": 8})
  )
  with pytest.raises(TypeError, match="ids"):
    pzsc.SparseCoreLookup.from_lookup(
      dense, mesh=mesh, optimizer=opt, ids="hashed"
    )

  lookup = hashed_lookup(mesh, 64, name="small")  # 8 rows per shard.
  with pytest.raises(ValueError, match="integers"):
    lookup(named(np.array([[1.5]], np.float32)))
  with pytest.raises(ValueError, match="integers or strings"):
    lookup.preprocess(np.array([[1.5]]))
  # One SparseCore's 17 samples name 17 distinct ids of shard 0.
  crowded = np.tile(ids_owned_by(0, 17, seed=3), 8).reshape(8, 17)
  with pytest.raises(ValueError, match="more distinct ids than its 8 rows"):
    lookup.preprocess(crowded)
  with pytest.raises(ValueError, match=r"72 ids found no row.*than its 8 rows"):
    lookup(named(crowded.astype(np.int32)))
  # Host buffers of another shape.
  inputs, _ = lookup.preprocess(np.arange(6).reshape(2, 3))
  with pytest.raises(ValueError, match="lhs_"):
    lookup(named(np.zeros((8, 17), np.int32)), sparsecore_inputs=inputs)


def test_buffers_of_any_shape_are_the_lookups(mesh):
  """Capped windows (`max_ids_per_partition`) hide the samples per
  SparseCore from the buffers' shapes: the trainer still finds, validates
  and resolves them; on one device the sample order tells the shape."""
  lookup = hashed_lookup(mesh, 1024, name="capped", max_ids_per_partition=8)
  # 32 samples per SparseCore, 4 for each shard: within the limit of 8.
  ids = np.stack(
    [ids_owned_by(p, 4 * 8, seed=10 + p) for p in range(8)], 1
  ).reshape(8, 32)
  inputs, _ = lookup.preprocess(ids)
  assert fits(lookup, inputs)
  lookup.validate(inputs)
  resolved = lookup.resolve_ids(inputs, step=0)
  assert counters(lookup)[1] == len(np.unique(ids))
  tokens = named(np.zeros((8, 32), np.int32))
  held = pzsc.hashed_rows(lookup)["capped"]
  want = held.rows[np.searchsorted(held.ids, ids.reshape(-1))]
  np.testing.assert_array_equal(
    values(lookup(tokens, sparsecore_inputs=resolved)).reshape(-1, D), want
  )
  # A range table's capped buffers hide the samples per SparseCore: the
  # check reads them from the buffers' sample ids.
  ranged = pzsc.SparseCoreLookup.from_config(
    "ranged",
    None,
    1000,
    {"embedding": D},
    mesh,
    pzsc.SGDOptimizerSpec(learning_rate=LR),
    max_ids_per_partition=8,
  )
  inputs, _ = ranged.preprocess(np.arange(256).reshape(8, 32))
  assert fits(ranged, inputs)
  assert ranged.config_of(inputs).plan.stacks[0].samples_per_sc == 8
  ranged.validate(inputs)
  one = hashed_lookup(Mesh(np.array(jax.devices()[:1]), ("d",)), 64, "one")
  ids = np.array([[5, -5, 5], [2**50, 7, -(2**62)]], np.int64)
  inputs, _ = one.preprocess(ids)
  assert inputs.sample_order is not None
  assert one.config_of(inputs).plan.stacks[0].samples_per_sc == 6
  one.validate(inputs)
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1),
    LookupModel(one),
    optax.sgd(0.1),
    lambda *, model, state, rng, tokens, sparsecore_inputs: (
      jnp.sum(values(model(tokens, sparsecore_inputs=sparsecore_inputs))),
      state,
      {},
    ),
  )
  trainer.step(
    tokens=named(np.zeros((2, 3), np.int32)), sparsecore_inputs=inputs
  )
  assert counters(trainer.model.lookup)[1] == 5
