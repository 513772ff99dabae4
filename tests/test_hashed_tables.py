"""Hashed tables end to end: raw ids in, trained rows out.

The reference is independent of the layer: `hashed_model.ShardModel` (a
plain-Python model of each shard's map, fed every step's distinct ids of
the shard, owners from `core.hashed.owners`) says which id holds which
slot, and a dict id -> row (and optimizer state) trained with NumPy says
what the rows hold.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib

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
from pz_sparsecore.nn.tables import slot_arrays, table_arrays

B, K, D = 16, 3, 8
LR = 0.5


def mesh_of(g: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:g]), ("d",))


def table_spec(capacity, eviction="lru", optimizer=None, dtype=jnp.float32):
  return pzsc.TableSpec(
    name="users",
    vocabulary_size=capacity,
    embedding_dim=D,
    initializer=jax.nn.initializers.normal(0.1),
    optimizer=optimizer or pzsc.SGDOptimizerSpec(learning_rate=LR),
    combiner="sum",
    ids="hashed",
    eviction=eviction,
    dtype=dtype,
  )


def build(
  g,
  capacity,
  eviction="lru",
  s=1,
  optimizer=None,
  seed=0,
  spec_limits=None,
  shape=(B, K),
  **options,
):
  """A layer of one hashed feature "u" (`spec_limits`: its table's max ids
  and max unique ids per partition; `options` for `from_config`)."""
  table = table_spec(capacity, eviction, optimizer)
  if spec_limits is not None:
    table = dataclasses.replace(
      table,
      max_ids_per_partition=spec_limits[0],
      max_unique_ids_per_partition=spec_limits[1],
    )
  spec = pzsc.FeatureSpec(
    name="u", table_spec=table, input_shape=shape, output_shape=(shape[0], D)
  )
  return pzsc.SparseCoreEmbed.from_config(
    "e",
    jax.random.key(seed),
    {"u": spec},
    mesh_of(g),
    num_sc_per_device=s,
    **options,
  )


@pz.pytree_dataclass
class Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed

  def __call__(self, inputs, **side_inputs):
    return self.embed(inputs)


def loss_fn(*, model, state, rng, inputs, g):
  del rng
  acts = model(inputs)["u"].unwrap("batch", "embedding")
  loss = jnp.sum(acts * g)
  return loss, state, {"loss": loss}


def trainer_of(embed):
  return pzsc.SparseCoreTrainer.build(
    jax.random.key(1), Model(embed=embed), optax.sgd(0.1), loss_fn
  )


class Reference:
  """The maps (one `ShardModel` per shard) and the rows of each id."""

  def __init__(self, embed, eviction, adagrad=None):
    stack = embed.config.plan.stacks[0]
    self.stack = stack
    self.n = embed.config.plan.num_shards
    self.capacity = stack.rows_per_shard
    self.eviction = hashed.as_eviction("users", eviction)
    self.seed = jnp.asarray(np.asarray(embed.maps["users"]["seed"].value))
    self.shards = [
      hashed_model.ShardModel(self.capacity) for _ in range(self.n)
    ]
    self.rows, self.acc = {}, {}
    self.adagrad = adagrad  # (lr, initial accumulator) or None: SGD.
    self.counters = np.zeros(len(hashed.COUNTERS), np.int64)

  def initial_row(self, x: int) -> np.ndarray:
    # The initializer drawn with the seed folded with the table's name's
    # CRC-32 and the id's words.
    key = jax.random.wrap_key_data(self.seed)
    crc = np.array([zlib.crc32(b"users")], np.uint32).view(np.int32)[0]
    lo, hi = hashed.key_words(np.array([x], np.int64))
    key = jax.random.fold_in(jax.random.fold_in(key, crc), lo[0])
    key = jax.random.fold_in(key, hi[0])
    return np.asarray(
      jax.nn.initializers.normal(0.1)(key, (1, D), jnp.float32)
    )[0]

  def resolve(self, ids: np.ndarray, step: int, train: bool) -> set[int]:
    """The ids holding a row after the step's map calls."""
    flat = ids.reshape(-1)
    owner = hashed.owners(flat, self.n)
    held = set()
    for p in range(self.n):
      distinct = np.unique(flat[owner == p])
      if not len(distinct):
        continue
      got = self.shards[p].call(
        hashed_model.shard_input(distinct, self.capacity),
        step,
        self.eviction,
        train,
      )
      slots, reset, counts = got
      self.counters += np.asarray(counts)
      for x, slot, new in zip(distinct, slots, reset, strict=True):
        if slot < 0:
          continue
        held.add(int(x))
        if new:
          self.rows[int(x)] = self.initial_row(int(x))
          self.acc[int(x)] = (
            np.full(D, self.adagrad[1], np.float32) if self.adagrad else None
          )
    return held

  def forward(self, ids: np.ndarray, held: set[int]) -> np.ndarray:
    acts = np.zeros((len(ids), D), np.float32)
    for b, row in enumerate(ids):
      for x in row:
        if int(x) in held:
          acts[b] += self.rows[int(x)]
    return acts

  def train(self, ids: np.ndarray, g: np.ndarray, step: int) -> float:
    held = self.resolve(ids, step, True)
    loss = float(np.sum(self.forward(ids, held) * g))
    grads = {}
    for b, row in enumerate(ids):
      for x in row:
        if int(x) in held:
          grads[int(x)] = grads.get(int(x), 0) + g[b]
    for x, grad in grads.items():
      if self.adagrad is None:
        self.rows[x] = self.rows[x] - LR * grad
      else:
        self.acc[x] = self.acc[x] + grad * grad
        self.rows[x] = self.rows[x] - self.adagrad[0] * grad / np.sqrt(
          self.acc[x]
        )
    return loss


def check_state(embed, ref: Reference, atol=1e-5):
  """The layer's maps equal the reference's; each held id's row (and
  accumulator) equals its reference row."""
  parts = embed.maps["users"]
  ids = np.asarray(parts["ids"].value)
  seen = np.asarray(parts["seen"].value)
  table = np.asarray(table_arrays(embed)["users"])
  slots = slot_arrays(embed)["users"]
  for p, shard in enumerate(ref.shards):
    np.testing.assert_array_equal(ids[p], shard.ids)
    np.testing.assert_array_equal(seen[p], shard.seen)
    for c in np.flatnonzero(shard.seen[:, 0] != hashed.EMPTY):
      x = int(hashed.ids_of_words(shard.ids[c, :1], shard.ids[c, 1:])[0])
      np.testing.assert_allclose(table[p, c], ref.rows[x], atol=atol)
      if ref.adagrad:
        np.testing.assert_allclose(
          np.asarray(slots[0])[p, c], ref.acc[x], rtol=1e-5
        )
  np.testing.assert_array_equal(
    np.asarray(parts["counters"].value).sum(0), ref.counters
  )


def stream(seed: int, pool_size: int, steps: int):
  rng = np.random.default_rng(seed)
  pool = rng.integers(-(2**63), 2**63 - 1, size=pool_size, dtype=np.int64)
  pool[:3] = [-1, 0, 2**63 - 1]
  for _ in range(steps):
    ids = pool[rng.integers(0, pool_size, size=(B, K))]
    ids[1] = ids[0]  # Duplicates across samples.
    yield ids, rng.normal(size=(B, D)).astype(np.float32)


@pytest.mark.parametrize(
  "g,s,capacity,pool,eviction",
  [
    (1, 1, 64, 40, "lru"),  # Room for every id: no eviction.
    (8, 1, 64, 160, "lru"),  # 8 rows per shard: evictions.
    (4, 2, 64, 160, "lru"),  # The same 8 shards on another topology.
    (2, 1, 32, 80, hashed.Eviction("lfu", decay_steps=2)),
    (4, 1, 64, 120, hashed.Eviction("ttl", ttl_steps=1)),
    (4, 1, 32, 60, "none"),  # Full shards refuse new ids.
    # One device: the forward reads the preprocessor's sample order, its
    # places made rows (none with refused ids).
    (1, 1, 64, 120, "none"),
    (1, 2, 64, 120, "lru"),
  ],
)
def test_trainer_matches_reference(g, s, capacity, pool, eviction):
  embed = build(g, capacity, eviction, s=s)
  ref = Reference(embed, eviction)
  trainer = trainer_of(embed)
  for step, (ids, g_acts) in enumerate(stream(3, pool, 6)):
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    aux = trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    np.testing.assert_allclose(
      float(aux["loss"]), ref.train(ids, g_acts, step), rtol=1e-5, atol=1e-4
    )
  check_state(trainer.model.embed, ref)
  counters = ref.counters
  if pool <= capacity:
    assert counters[2] == 0 and counters[3] == 0  # evicted, refused
  elif eviction == "none":
    assert counters[2] == 0 and counters[3] > 0
  else:
    assert counters[2] > 0


@pytest.mark.parametrize("g,s", [(1, 1), (4, 1), (2, 2)])
def test_minibatched_batches_train_as_the_reference(g, s):
  """Limits of 4 ids per partition split the batches into minibatches:
  the maps, rows and counters are the reference's all the same."""
  embed = build(g, 64, s=s, spec_limits=(4, 4))
  ref = Reference(embed, "lru")
  trainer = trainer_of(embed)
  counts = []
  for step, (ids, g_acts) in enumerate(stream(21, 120, 5)):
    inputs, _ = trainer.model.embed.preprocess(
      {"u": ids}, enable_minibatching=True
    )
    counts.append(int(np.asarray(inputs.num_minibatches).max()))
    aux = trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    np.testing.assert_allclose(
      float(aux["loss"]), ref.train(ids, g_acts, step), rtol=1e-5, atol=1e-4
    )
  check_state(trainer.model.embed, ref)
  assert max(counts) > 1
  # Inference on minibatched buffers reads the held rows.
  ids, _ = next(stream(21, 120, 1))
  embed = trainer.model.embed
  inputs, stats = embed.preprocess({"u": ids}, enable_minibatching=True)
  got = embed(inputs)["u"]
  plain = pzsc.update_limits(embed, stats)
  want = plain(plain.preprocess({"u": ids})[0])["u"]
  np.testing.assert_allclose(
    np.asarray(got.unwrap("batch", "embedding")),
    np.asarray(want.unwrap("batch", "embedding")),
    rtol=1e-6,
  )


def test_a_batch_minibatches_cannot_hold_is_refused_naming_the_feature():
  """64 minibatches of 8 distinct ids per partition hold 512: a batch of
  600 distinct ids is refused; the next, with 100, works."""
  embed = build(1, 4096, spec_limits=(64, 8), shape=(600, 1))
  ids = np.arange(600, dtype=np.int64).reshape(600, 1) * 7919
  with pytest.raises(ValueError, match="'u'.*the 512 that 64 minibatches"):
    embed.preprocess({"u": ids}, enable_minibatching=True)
  inputs, _ = embed.preprocess({"u": ids % 100}, enable_minibatching=True)
  assert int(np.asarray(inputs.num_minibatches).max()) > 1
  embed.resolve_ids(inputs, step=0)
  assert int(np.asarray(embed.maps["users"]["counters"].value)[:, 1].sum()) == (
    len(np.unique(ids % 100))
  )


def test_same_shards_train_alike_on_any_topology():
  """8 shards on 8 x 1 and 4 x 2 devices: the same maps and rows."""
  results = []
  for g, s in ((8, 1), (4, 2), (2, 4)):
    trainer = trainer_of(build(g, 64, "lru", s=s))
    for ids, g_acts in stream(5, 160, 5):
      inputs, _ = trainer.model.embed.preprocess({"u": ids})
      trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    embed = trainer.model.embed
    results.append(
      [np.asarray(embed.maps["users"][p].value) for p in ("ids", "seen")]
      + [np.asarray(table_arrays(embed)["users"])]
    )
  for other in results[1:]:
    for a, b in zip(results[0], other, strict=True):
      np.testing.assert_array_equal(a, b)


def test_evicted_ids_start_afresh_with_their_optimizer_slots():
  adagrad = pzsc.AdagradOptimizerSpec(learning_rate=0.3)
  embed = build(4, 32, "lru", optimizer=adagrad)
  ref = Reference(embed, "lru", adagrad=(0.3, 0.1))
  trainer = trainer_of(embed)
  for step, (ids, g_acts) in enumerate(stream(7, 90, 6)):
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    ref.train(ids, g_acts, step)
  assert ref.counters[2] > 0
  check_state(trainer.model.embed, ref)


def test_same_stream_same_bits():
  def run():
    trainer = trainer_of(build(4, 32, "lfu"))
    for ids, g_acts in stream(9, 100, 4):
      inputs, _ = trainer.model.embed.preprocess({"u": ids})
      trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    embed = trainer.model.embed
    return [np.asarray(v.value) for v in embed.maps["users"].values()] + [
      np.asarray(table_arrays(embed)["users"])
    ]

  for a, b in zip(run(), run(), strict=True):
    np.testing.assert_array_equal(a, b)


def test_inference_reads_held_rows_and_counts_unseen():
  trainer = trainer_of(build(2, 64, "lru"))
  ((ids, g_acts),) = stream(11, 30, 1)
  inputs, _ = trainer.model.embed.preprocess({"u": ids})
  trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
  embed = trainer.model.embed
  before = [np.asarray(v.value) for v in embed.maps["users"].values()]
  table_before = np.asarray(table_arrays(embed)["users"])
  fresh = ids.copy()
  fresh[:, 0] = np.arange(B) + 10**12  # Never seen.
  inputs, _ = embed.preprocess({"u": fresh})
  acts = np.asarray(embed(inputs)["u"].unwrap("batch", "embedding"))
  # Each sample's known ids, through the map the model holds.
  ref = Reference(embed, "lru")
  stack = embed.config.plan.stacks[0]
  table = table_before
  owner = hashed.owners(fresh.reshape(-1), ref.n).reshape(fresh.shape)
  for b in range(B):
    want = np.zeros(D, np.float32)
    for x, p in zip(fresh[b], owner[b], strict=True):
      lo, hi = hashed.key_words(np.array([x]))
      row = np.flatnonzero(
        (before[0][p, :, 0] == lo[0])
        & (before[0][p, :, 1] == hi[0])
        & (before[1][p, :, 0] != hashed.EMPTY)
      )
      if len(row):
        want += table[p, row[0]]
    np.testing.assert_allclose(acts[b], want, atol=1e-6)
  after = [np.asarray(v.value) for v in embed.maps["users"].values()]
  for part, a, b in zip(embed.maps["users"], before, after, strict=True):
    if part == "counters":
      assert b[:, 4].sum() - a[:, 4].sum() == B  # unseen
      np.testing.assert_array_equal(a[:, :4], b[:, :4])
    else:
      np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(
    np.asarray(table_arrays(embed)["users"]), table_before
  )
  del stack


@pytest.mark.parametrize("fresh_ids", [5, 32, 33, 256, 257, 300, 600])
def test_new_rows_of_many_new_ids_in_one_call(fresh_ids):
  """Every id new in a call gets its own initial row and a fresh optimizer
  slot, however many there are (drawn 256 rows at a time, then 32; one
  shard, so that the counts fall on the chunks' boundaries)."""
  adagrad = pzsc.AdagradOptimizerSpec(0.1, 0.25)
  embed = build(1, 1024, optimizer=adagrad, seed=5, shape=(600, 1))
  rng = np.random.default_rng(fresh_ids)
  pool = rng.integers(-(2**63), 2**63 - 1, size=fresh_ids, dtype=np.int64)
  ids = pool[np.arange(600) % fresh_ids].reshape(600, 1)  # Duplicates.
  inputs, _ = embed.preprocess({"u": ids})
  embed.resolve_ids(inputs, step=0)
  ref = Reference(embed, "lru")
  held = ref.resolve(ids, 0, True)
  assert len(held) == fresh_ids
  ids_map = np.asarray(embed.maps["users"]["ids"].value)
  seen = np.asarray(embed.maps["users"]["seen"].value)
  table = np.asarray(table_arrays(embed)["users"])
  acc = np.asarray(slot_arrays(embed)["users"][0])
  for p, shard in enumerate(ref.shards):
    np.testing.assert_array_equal(ids_map[p], shard.ids)
    np.testing.assert_array_equal(seen[p], shard.seen)
    for c in np.flatnonzero(shard.seen[:, 0] != hashed.EMPTY):
      x = int(hashed.ids_of_words(shard.ids[c, :1], shard.ids[c, 1:])[0])
      np.testing.assert_allclose(table[p, c], ref.rows[x], atol=1e-6)
      np.testing.assert_array_equal(acc[p, c], np.full(D, 0.25, np.float32))


def test_hand_written_step_equals_trainer():
  ids_g = list(stream(13, 50, 3))
  trainer = trainer_of(build(4, 64, "lru"))
  for ids, g_acts in ids_g:
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def train_step(embed, inputs, g, step):
    inputs = embed.resolve_ids(inputs, step=step)
    acts = embed(inputs)["u"]
    embed.apply_gradients(inputs, {"u": g}, step)
    return acts

  embed = build(4, 64, "lru")
  for step, (ids, g_acts) in enumerate(ids_g):
    inputs, _ = embed.preprocess({"u": ids})
    train_step(embed, inputs, jnp.asarray(g_acts), step)
  for part in ("ids", "seen", "counters"):
    np.testing.assert_array_equal(
      np.asarray(embed.maps["users"][part].value),
      np.asarray(trainer.model.embed.maps["users"][part].value),
    )
  np.testing.assert_allclose(
    np.asarray(table_arrays(embed)["users"]),
    np.asarray(table_arrays(trainer.model.embed)["users"]),
    atol=1e-6,
  )


def test_input_forms_and_strings_give_the_same_rows():
  embed = build(2, 64, "lru")
  words = np.array([f"user-{i}" for i in range(B * K)]).reshape(B, K)
  as_ids = hashed.string_ids(words.reshape(-1)).reshape(B, K)

  def acts(features):
    inputs, _ = embed.preprocess({"u": features})
    resolved = embed.resolve_ids(inputs, step=0)
    return np.asarray(embed(resolved)["u"].unwrap("batch", "embedding"))

  want = acts(as_ids)
  for form in (
    words,
    words.astype(np.bytes_),
    [list(row) for row in words],
    np.array([np.array(row) for row in words] + [None], object)[:-1],
    (as_ids.reshape(-1), np.arange(B + 1) * K),
    as_ids.view(np.uint64),
  ):
    np.testing.assert_array_equal(acts(form), want)


@pytest.mark.parametrize(
  "features,match",
  [
    (np.full((B, K), 1.5), "'u'.*integers or strings"),
    (np.array([["a", None, "b"]] * B, object), "'u'.*mixed strings"),
  ],
)
def test_bad_ids_are_refused_naming_the_feature(features, match):
  embed = build(2, 64, "lru")
  with pytest.raises(ValueError, match=match):
    embed.preprocess({"u": features})
  # The next batch works.
  ids = np.arange(B * K, dtype=np.int64).reshape(B, K)
  inputs, _ = embed.preprocess({"u": ids})
  embed.resolve_ids(inputs, step=0)


def test_refusals():
  with pytest.raises(ValueError, match="eviction is for hashed tables"):
    pzsc.TableSpec(
      name="t",
      vocabulary_size=8,
      embedding_dim=4,
      initializer=jax.nn.initializers.zeros,
      optimizer=pzsc.SGDOptimizerSpec(),
      combiner="sum",
      eviction="lru",
    )
  with pytest.raises(ValueError, match="ids must be one of"):
    dataclasses.replace(table_spec(8), ids="raw")
  embed = build(1, 8, "lru")
  ids = np.arange(B * K, dtype=np.int64).reshape(B, K)
  with pytest.raises(ValueError, match="more distinct ids than its 8 rows"):
    embed.preprocess({"u": ids})
  embed = build(2, 64, "lru")
  inputs, _ = embed.preprocess({"u": ids})
  with pytest.raises(ValueError, match="resolve them first"):
    embed.apply_gradients(inputs, {"u": jnp.zeros((B, D))}, 0)
  spec = pzsc.FeatureSpec(
    name="u",
    table_spec=table_spec(64),
    input_shape=(B, K),
    output_shape=(B, D),
  )
  with pytest.raises(ValueError, match="cannot be replicated"):
    pzsc.SparseCoreEmbed.from_config(
      "e",
      jax.random.key(0),
      {"u": spec},
      mesh_of(2),
      placement={"users": "replicated"},
    )
  other = dataclasses.replace(
    table_spec(64), name="items", ids="range", eviction=None
  )
  specs = {
    "u": spec,
    "i": pzsc.FeatureSpec(
      name="i", table_spec=other, input_shape=(B, K), output_shape=(B, D)
    ),
  }
  with pytest.raises(ValueError, match="cannot share a stack"):
    pzsc.stack_tables(specs, ["users", "items"], 2, 1)
  # Auto stacking keeps the hashed table alone.
  embed = pzsc.SparseCoreEmbed.from_config(
    "e", jax.random.key(0), specs, mesh_of(2)
  )
  assert sorted(s.name for s in embed.config.plan.stacks) == ["items", "users"]


def test_logical_tables_give_ids_and_rows_and_checkpoints_keep_them(tmp_path):
  trainer = trainer_of(build(4, 64, "lru"))
  batches = list(stream(17, 120, 5))
  for ids, g_acts in batches[:3]:
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
  embed = trainer.model.embed
  held = pzsc.logical_tables(embed)["users"]
  assert isinstance(held, pzsc.HashedRows)
  parts = {k: np.asarray(v.value) for k, v in embed.maps["users"].items()}
  table = np.asarray(table_arrays(embed)["users"])
  assert len(held.ids) == int(parts["counters"][:, 0].sum())
  assert np.all(np.diff(held.ids) > 0)
  for x, row, p, c in zip(
    held.ids, held.rows, held.shards, held.slots, strict=True
  ):
    assert hashed.owners(np.array([x]), 4)[0] == p
    lo, hi = hashed.key_words(np.array([x]))
    assert tuple(parts["ids"][p, c]) == (lo[0], hi[0])
    np.testing.assert_array_equal(row, table[p, c])
  named = pzsc.logical_tables(embed, named=True)["users"]
  assert named.rows.named_shape == {"id": len(held.ids), "embedding": D}
  with pytest.raises(ValueError, match="is hashed"):
    pzsc.set_logical_tables(embed, {"users": np.zeros((64, D))})

  # Saved, restored into a fresh layer, trained on: the same as training on.
  pzsc.save_checkpoint(tmp_path / "ckpt", trainer, step=3)
  for ids, g_acts in batches[3:]:
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
  other = trainer_of(build(4, 64, "lru", seed=5))
  other = pzsc.restore_checkpoint(tmp_path / "ckpt", other)
  restored = pzsc.logical_tables(other.model.embed)["users"]
  np.testing.assert_array_equal(restored.ids, held.ids)
  np.testing.assert_array_equal(restored.rows, held.rows)
  for ids, g_acts in batches[3:]:
    inputs, _ = other.model.embed.preprocess({"u": ids})
    other.step(inputs=inputs, g=jnp.asarray(g_acts))
  for part in ("ids", "seen", "counters", "seed"):
    np.testing.assert_array_equal(
      np.asarray(other.model.embed.maps["users"][part].value),
      np.asarray(trainer.model.embed.maps["users"][part].value),
    )
  np.testing.assert_array_equal(
    np.asarray(table_arrays(other.model.embed)["users"]),
    np.asarray(table_arrays(trainer.model.embed)["users"]),
  )


def test_describe_and_pictures_show_the_map():
  trainer = trainer_of(build(4, 64, "lru"))
  for ids, g_acts in stream(17, 120, 3):
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
  embed = trainer.model.embed
  counters = np.asarray(embed.maps["users"]["counters"].value).sum(0)
  text = pzsc.viz.describe(embed)
  assert "hashed ids, capacity 64 x 8, eviction lru" in text
  assert f"map: {counters[0]} ids held of 64 rows" in text
  assert f"{counters[1]} inserted, {counters[2]} evicted, 0 refused" in text
  html = pzsc.viz.to_html(pzsc.viz.placement_figure(embed, "users"))
  assert "free slot" in html and "ids held per shard" in html
  held = np.asarray(embed.maps["users"]["seen"].value)[..., 0] >= 0
  assert ", ".join(map(str, held.sum(1))) in html
  # The layer's default view draws it too.
  assert "ids held per shard" in pzsc.viz.to_html(embed)


def test_restore_onto_other_shards_moves_every_id_to_its_owner(tmp_path):
  """Saved on 4 shards, restored on 8 and on 2 (x 2 SparseCores): every
  held id (unless its new window is full) on its new owner, with its row,
  optimizer slot, last step and count bit for bit; training goes on."""
  adagrad = pzsc.AdagradOptimizerSpec(learning_rate=0.3)
  trainer = trainer_of(build(4, 128, "lru", optimizer=adagrad))
  batches = list(stream(19, 100, 4))
  for ids, g_acts in batches[:2]:
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
  pzsc.save_checkpoint(tmp_path / "c", trainer, step=2)
  saved = pzsc.logical_tables(trainer.model.embed)["users"]
  saved_slots = np.asarray(slot_arrays(trainer.model.embed)["users"][0])
  saved_counters = np.asarray(
    trainer.model.embed.maps["users"]["counters"].value
  ).sum(0)
  for g, s in ((8, 1), (1, 2)):
    other = trainer_of(build(g, 128, "lru", s=s, optimizer=adagrad, seed=3))
    other = pzsc.restore_checkpoint(tmp_path / "c", other)
    embed = other.model.embed
    held = pzsc.logical_tables(embed)["users"]
    n = embed.config.plan.num_shards
    assert set(held.ids) <= set(saved.ids)
    counters = np.asarray(embed.maps["users"]["counters"].value).sum(0)
    dropped = len(saved.ids) - len(held.ids)
    assert counters[0] == len(held.ids)
    assert counters[2] == saved_counters[2] + dropped
    np.testing.assert_array_equal(
      counters[[1, 3, 4]], saved_counters[[1, 3, 4]]
    )
    np.testing.assert_array_equal(held.shards, hashed.owners(held.ids, n))
    at = np.searchsorted(saved.ids, held.ids)
    np.testing.assert_array_equal(held.rows, saved.rows[at])
    np.testing.assert_array_equal(held.last_seen, saved.last_seen[at])
    np.testing.assert_array_equal(held.counts, saved.counts[at])
    slots = np.asarray(slot_arrays(embed)["users"][0])
    np.testing.assert_array_equal(
      slots[held.shards, held.slots],
      saved_slots[saved.shards[at], saved.slots[at]],
    )
    # Each id in its window on its new owner.
    rows = embed.config.plan.stacks[0].rows_per_shard
    home = hashed.homes(held.ids, rows)
    assert np.all((held.slots - home) % rows < hashed.window(rows))
    # Training goes on: held ids are hits.
    for ids, g_acts in batches[2:]:
      inputs, _ = embed.preprocess({"u": ids})
      other.step(inputs=inputs, g=jnp.asarray(g_acts))
    assert np.isfinite(
      np.asarray(table_arrays(other.model.embed)["users"])
    ).all()


def test_hashed_tables_stack_and_train_as_apart():
  """Two hashed tables (one read by two features) in one stack: each keeps
  its own rows of every shard, and trains as it does in a stack of its
  own (the same ids, slots, steps, counts and rows)."""

  def specs():
    users, items = (
      table_spec(64),
      dataclasses.replace(table_spec(128), name="items"),
    )
    shape = {"input_shape": (B, K), "output_shape": (B, D)}
    return {
      "u": pzsc.FeatureSpec(name="u", table_spec=users, **shape),
      "v": pzsc.FeatureSpec(name="v", table_spec=users, **shape),
      "i": pzsc.FeatureSpec(name="i", table_spec=items, **shape),
    }

  def loss(*, model, state, rng, inputs, g):
    del rng
    acts = model(inputs)
    total = sum(
      jnp.sum(acts[k].unwrap("batch", "embedding") * g[j])
      for j, k in enumerate(("u", "v", "i"))
    )
    return total, state, {"loss": total}

  results = []
  for stacking in ("auto", None):
    embed = pzsc.SparseCoreEmbed.from_config(
      "e", jax.random.key(0), specs(), mesh_of(4), stacking=stacking
    )
    assert len(embed.config.plan.stacks) == (1 if stacking else 2)
    trainer = pzsc.SparseCoreTrainer.build(
      jax.random.key(1), Model(embed=embed), optax.sgd(0.1), loss
    )
    rng = np.random.default_rng(23)
    pool = rng.integers(-(2**63), 2**63 - 1, size=150, dtype=np.int64)
    for _ in range(5):
      feats = {k: pool[rng.integers(0, 150, (B, K))] for k in "uvi"}
      feats["i"][:2] = feats["u"][:2]  # The same ids in both tables.
      g = rng.normal(size=(3, B, D)).astype(np.float32)
      inputs, _ = trainer.model.embed.preprocess(feats)
      trainer.step(inputs=inputs, g=jnp.asarray(g))
    embed = trainer.model.embed
    counters = sum(
      np.asarray(parts["counters"].value).sum(0)
      for parts in embed.maps.values()
    )
    results.append((pzsc.logical_tables(embed), counters))
  (stacked, c1), (apart, c2) = results
  np.testing.assert_array_equal(c1, c2)
  assert c1[2] > 0  # Evictions happened.
  for name in ("users", "items"):
    a, b = stacked[name], apart[name]
    for field in ("ids", "shards", "slots", "last_seen", "counts"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_allclose(a.rows, b.rows, atol=1e-6)
  # An id in both tables has a row in each, drawn apart.
  both = np.intersect1d(stacked["users"].ids, stacked["items"].ids)
  assert len(both)
  x = both[0]
  rows = [
    held.rows[np.searchsorted(held.ids, x)]
    for held in (stacked["users"], stacked["items"])
  ]
  assert not np.allclose(rows[0], rows[1])


def test_a_batch_over_the_limits_is_refused_naming_the_feature():
  embed = build(2, 64, spec_limits=(64, 8), limits="specs")
  ids = np.arange(B * K, dtype=np.int64).reshape(B, K) * 7919 - 10**15
  with pytest.raises(ValueError, match=r"features \['u'\].*unique ids"):
    embed.preprocess({"u": ids})
  # Strings that read like numbers are ids like any other; a batch within
  # the limits goes through.
  few = np.array([["nan", "inf", "-1"]] * B)
  inputs, _ = embed.preprocess({"u": few})
  acts = embed(embed.resolve_ids(inputs, step=0))["u"]
  assert np.isfinite(np.asarray(acts.unwrap("batch", "embedding"))).all()


def test_delta_checkpoints_keep_the_maps(tmp_path):
  embed = build(4, 64, "lru")
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1),
    Model(embed=embed),
    optax.sgd(0.1),
    loss_fn,
    track_touched=True,
  )
  batches = list(stream(29, 140, 6))
  for step, (ids, g_acts) in enumerate(batches):
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    if step == 1:
      pzsc.save_checkpoint(tmp_path, trainer, step=2, keep=None)
    elif step > 1:
      pzsc.save_checkpoint(
        tmp_path, trainer, step=step + 1, keep=None, delta=True
      )
  restored = pzsc.restore_checkpoint(tmp_path, trainer_of(build(4, 64)))
  a = pzsc.logical_tables(restored.model.embed)["users"]
  b = pzsc.logical_tables(trainer.model.embed)["users"]
  for field in a._fields:
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  for part in ("ids", "seen", "counters", "seed"):
    np.testing.assert_array_equal(
      np.asarray(restored.model.embed.maps["users"][part].value),
      np.asarray(trainer.model.embed.maps["users"][part].value),
    )


def test_sixteen_bit_rowwise_hashed_table_trains():
  """A bfloat16 hashed table with row-wise Adagrad: the map as the model's,
  rows stored in bfloat16 and finite, one accumulator per row."""
  spec = pzsc.FeatureSpec(
    name="u",
    table_spec=dataclasses.replace(
      table_spec(64, optimizer=pzsc.RowwiseAdagradOptimizerSpec(0.2)),
      dtype=jnp.bfloat16,
    ),
    input_shape=(B, K),
    output_shape=(B, D),
  )
  embed = pzsc.SparseCoreEmbed.from_config(
    "e", jax.random.key(0), {"u": spec}, mesh_of(4)
  )
  ref = Reference(embed, "lru")
  trainer = trainer_of(embed)
  batches = list(stream(41, 120, 4))
  for step, (ids, g_acts) in enumerate(batches):
    inputs, _ = trainer.model.embed.preprocess({"u": ids})
    trainer.step(inputs=inputs, g=jnp.asarray(g_acts))
    ref.resolve(ids, step, True)
  embed = trainer.model.embed
  for p, shard in enumerate(ref.shards):
    np.testing.assert_array_equal(
      np.asarray(embed.maps["users"]["ids"].value)[p], shard.ids
    )
    np.testing.assert_array_equal(
      np.asarray(embed.maps["users"]["seen"].value)[p], shard.seen
    )
  assert table_arrays(embed)["users"].dtype == jnp.bfloat16
  assert slot_arrays(embed)["users"][0].shape[-1] == 1
  held = pzsc.logical_tables(embed)["users"]
  assert np.isfinite(held.rows).all() and len(held.ids) == 64


def test_bcoo_ids_and_fit_with_limits_refreshed():
  """Raw ids as a BCOO read as the dense batch does; `fit` refreshing the
  limits from the batches keeps the map (the new layer shares it)."""
  from jax.experimental import sparse

  embed = build(2, 64, "lru")
  rng = np.random.default_rng(43)
  dense = rng.integers(-(2**31), 2**31 - 1, size=(B, K)).astype(np.int32)

  def acts(features):
    inputs, _ = embed.preprocess({"u": features})
    resolved = embed.resolve_ids(inputs, step=0)
    return np.asarray(embed(resolved)["u"].unwrap("batch", "embedding"))

  want = acts(dense.astype(np.int64))
  where = np.stack(np.nonzero(np.ones((B, K))), 1)
  bcoo = sparse.BCOO(
    (jnp.asarray(dense.reshape(-1)), jnp.asarray(where)), shape=(B, K)
  )
  np.testing.assert_array_equal(acts(bcoo), want)

  trainer = trainer_of(build(4, 64, "lru"))
  ref = Reference(trainer.model.embed, "lru")
  batches = list(stream(3, 100, 6))

  def prep(batch):
    inputs, _ = trainer.model.embed.preprocess({"u": batch[0]})
    return {"inputs": inputs, "g": jnp.asarray(batch[1])}

  trainer.fit(batches, prep, refresh_limits_every=2)
  for step, (ids, g_acts) in enumerate(batches):
    ref.train(ids, g_acts, step)
  embed = trainer.model.embed
  assert embed.config.plan.stacks[0].spec.max_unique_ids_per_partition < 64
  check_state(embed, ref)
