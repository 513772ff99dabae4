"""Tests of hashed tables' shard map (pz_sparsecore.device.hashed) and of the
hashes and policies it shares (pz_sparsecore.core.hashed).

References: the worked example of `core.hashed`'s docstring and small
hand-computed maps as literals; the plain-Python model of `hashed_model.py`
for random streams (compared after every call, bit for bit); invariants
checked on the JAX results alone; pure-Python SplitMix64 and BLAKE2b for the
hashes, with SplitMix64's published outputs for seed 0.
"""

from __future__ import annotations

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hashed_model import (
  EVICTED,
  HELD,
  INSERTED,
  INT32_MAX,
  REFUSED,
  UNSEEN,
  ShardModel,
  shard_input,
  unsigned_key,
)

from pz_sparsecore.core import hashed
from pz_sparsecore.core.hashed import Eviction
from pz_sparsecore.device import hashed as device_hashed
from pz_sparsecore.device.hashed import ShardMap
from pz_sparsecore.device.kernels import ffi

EMPTY = hashed.EMPTY
NO = hashed.REFUSED
MASK64 = (1 << 64) - 1

EVICTIONS = {
  "lru": Eviction("lru"),
  "lfu": Eviction("lfu"),
  "lfu_decay": Eviction("lfu", decay_steps=2),
  "ttl": Eviction("ttl", ttl_steps=8),
  "none": Eviction("none"),
}
CAPACITIES = (8, 40, 64, 200)
STEPS = 36
INFERENCE_EVERY = 4
ABSENT_FRACTION = 0.1
STEP_INCREMENTS = (0, 1, 1, 1, 2, 5)
SPECIAL_IDS = (
  -1,
  0,
  1,
  -2,
  2**63 - 1,
  -(2**63),
  2**31 - 1,
  2**31,
  2**32,
  -(2**31),
  2**32 + 2**31,
)


@functools.cache
def _resolve(eviction: Eviction, train: bool):
  return jax.jit(
    functools.partial(
      device_hashed.resolve_shard, eviction=eviction, train=train
    )
  )


def _empty(capacity: int) -> ShardMap:
  seen = np.zeros((capacity, 2), np.int32)
  seen[:, 0] = EMPTY
  return ShardMap(np.zeros((capacity, 2), np.int32), seen)


def _map(capacity: int, held: dict[int, tuple[int, int, int]]) -> ShardMap:
  """A map from `{slot: (int64 id, last step, count)}`."""
  shard = _empty(capacity)
  for slot, (raw, last, count) in held.items():
    lo, hi = hashed.key_words(np.array([raw], np.int64))
    shard.ids[slot] = (lo[0], hi[0])
    shard.seen[slot] = (last, count)
  return shard


def _input(rows: list[tuple[int, int]]) -> np.ndarray:
  """The `[n, 3]` input of `(int64 id, home)` rows (home -1: no id)."""
  raw = np.array([r for r, _ in rows], np.int64)
  lo, hi = hashed.key_words(raw)
  home = np.array([h for _, h in rows], np.int32)
  return np.stack([lo, hi, home], 1).astype(np.int32)


def _numpy(shard: ShardMap) -> ShardMap:
  return ShardMap(np.asarray(shard.ids), np.asarray(shard.seen))


def _run(shard: ShardMap, ids, step, eviction: Eviction, train: bool):
  """resolve_shard under jit, as NumPy arrays."""
  out = _resolve(eviction, train)(ids, shard, np.int32(step))
  return (
    np.asarray(out.slots),
    np.asarray(out.reset),
    _numpy(out.map),
    np.asarray(out.counts),
  )


def _held_ids(shard: ShardMap) -> dict[int, int]:
  """`{slot: unsigned id}` of the occupied slots."""
  return {
    s: unsigned_key(*shard.ids[s])
    for s in range(shard.ids.shape[0])
    if shard.seen[s, 0] != EMPTY
  }


def _check_invariants(before, ids, step, eviction, train, result):
  """What must hold of one call's result whatever the model says."""
  slots, reset, after, counts = result
  capacity = before.ids.shape[0]
  w = hashed.window(capacity)
  held = list(_held_ids(after).values())
  assert len(held) == len(set(held)), "two slots hold the same id"
  assert counts[INSERTED] == reset.sum()
  assert counts[HELD] + counts[EVICTED] == counts[INSERTED]
  if not train:
    np.testing.assert_array_equal(after.ids, before.ids)
    np.testing.assert_array_equal(after.seen, before.seen)
    assert not reset.any()
    assert (counts[:UNSEEN] == 0).all()
  if eviction.policy == "none":
    assert counts[EVICTED] == 0
    for slot, key in _held_ids(before).items():
      assert _held_ids(after)[slot] == key
  held_before = _held_ids(before)
  first_reset = {}
  for i, (lo, hi, home) in enumerate(ids):
    key = unsigned_key(lo, hi)
    slot = int(slots[i])
    if home < 0:
      assert slot == NO and not reset[i]
      continue
    if slot == NO:
      assert not reset[i]
      continue
    assert (slot - home) % capacity < w, "slot outside the id's window"
    assert unsigned_key(*after.ids[slot]) == key
    if reset[i]:
      assert key not in first_reset
      first_reset[key] = i
      assert key not in held_before.values()
      last = int(before.seen[slot, 0])
      if last != EMPTY:
        assert eviction.policy != "none"
        assert last < step, "evicted a slot seen in this step"
        if eviction.policy == "ttl":
          assert step - last > eviction.ttl_steps
    elif held_before.get(slot) != key:
      assert key in first_reset and first_reset[key] < i
      assert int(slots[first_reset[key]]) == slot


def _check_call(model, shard, ids, step, eviction, train):
  """One call on JAX and on the model: equal bit for bit. Returns the new
  map and the counters' changes."""
  result = _run(shard, ids, step, eviction, train)
  slots, reset, after, counts = result
  want_slots, want_reset, want_counts = model.call(ids, step, eviction, train)
  where = f"step {step}, train={train}, ids={ids.tolist()}"
  np.testing.assert_array_equal(slots, want_slots, err_msg=where)
  np.testing.assert_array_equal(reset, want_reset, err_msg=where)
  np.testing.assert_array_equal(after.ids, model.ids, err_msg=where)
  np.testing.assert_array_equal(after.seen, model.seen, err_msg=where)
  np.testing.assert_array_equal(counts, want_counts, err_msg=where)
  _check_invariants(shard, ids, step, eviction, train, result)
  return after, counts


# ---------------------------------------------------------------------------
# Hand-computed calls.


def _check_expected(shard, ids, step, eviction, train, slots, reset, counts):
  """JAX and the model against literals; returns JAX's new map."""
  model = ShardModel(shard.ids.shape[0], shard.ids, shard.seen)
  got_slots, got_reset, after, got_counts = _run(
    shard, ids, step, eviction, train
  )
  for name, s, r, c in (
    ("jax", got_slots, got_reset, got_counts),
    ("model", *model.call(ids, step, eviction, train)),
  ):
    np.testing.assert_array_equal(s, slots, err_msg=f"{name} slots")
    np.testing.assert_array_equal(r, reset, err_msg=f"{name} reset")
    np.testing.assert_array_equal(c, counts, err_msg=f"{name} counts")
  np.testing.assert_array_equal(after.ids, model.ids)
  np.testing.assert_array_equal(after.seen, model.seen)
  return after


def test_docstring_example():
  shard = _map(8, {2: (11, 3, 2), 5: (7, 4, 1)})
  ids = _input([(7, 1), (20, 2), (3, 5)])
  after = _check_expected(
    shard,
    ids,
    5,
    Eviction("lru"),
    True,
    slots=[5, 3, 6],
    reset=[False, True, True],
    counts=[2, 2, 0, 0, 0],
  )
  expected = _map(8, {2: (11, 3, 2), 5: (7, 5, 2), 3: (20, 5, 1), 6: (3, 5, 1)})
  np.testing.assert_array_equal(after.ids, expected.ids)
  np.testing.assert_array_equal(after.seen, expected.seen)


def test_inference_of_docstring_example():
  shard = _map(8, {2: (11, 3, 2), 5: (7, 4, 1)})
  ids = _input([(7, 1), (20, 2), (3, 5), (11, 0), (20, 2)])
  after = _check_expected(
    shard,
    ids,
    5,
    Eviction("lru"),
    False,
    slots=[5, NO, NO, 2, NO],
    reset=[False] * 5,
    counts=[0, 0, 0, 0, 2],
  )
  np.testing.assert_array_equal(after.seen, shard.seen)


def test_misses_in_unsigned_order():
  # One slot: the smallest id as an unsigned 64-bit word takes it. 2**31 has
  # low word 0x80000000 (negative as int32), 2**31 - 1 has 0x7fffffff; -1
  # is the largest unsigned word.
  ids = _input([(2**31, 0), (-1, 0), (2**31 - 1, 0), (2**32, 0)])
  after = _check_expected(
    _empty(1),
    ids,
    0,
    Eviction("lru"),
    True,
    slots=[NO, NO, 0, NO],
    reset=[False, False, True, False],
    counts=[1, 1, 0, 3, 0],
  )
  assert _held_ids(after) == {0: 2**31 - 1}
  ids = _input([(-1, 0), (2**63 - 1, 0), (-(2**63), 0)])
  _check_expected(
    _empty(1),
    ids,
    0,
    Eviction("lru"),
    True,
    slots=[NO, 0, NO],
    reset=[False, True, False],
    counts=[1, 1, 0, 2, 0],
  )


def test_victims_in_window_order_across_the_wraparound():
  # A full shard of 4, all last seen at step 2. Homes 3: window 3, 0, 1, 2.
  shard = _map(4, {s: (100 + s, 2, 1) for s in range(4)})
  ids = _input([(10, 3), (9, 3), (101, 0), (10, 3)])
  # 101 is a hit (slot 1, now seen); 9 takes slot 3 (first of the window),
  # then 10 the first slot of its window not seen in this step: slot 0.
  after = _check_expected(
    shard,
    ids,
    3,
    Eviction("lru"),
    True,
    slots=[0, 3, 1, 0],
    reset=[True, True, False, False],
    counts=[0, 2, 2, 0, 0],
  )
  assert _held_ids(after) == {0: 10, 1: 101, 2: 102, 3: 9}
  np.testing.assert_array_equal(after.seen, [[3, 1], [3, 2], [2, 1], [3, 1]])


def test_slots_seen_in_the_step_are_never_victims():
  # The same step twice: the first call's ids stay.
  shard = _map(2, {0: (1, 0, 1), 1: (2, 0, 1)})
  after = _check_expected(
    shard,
    _input([(5, 0)]),
    4,
    Eviction("lru"),
    True,
    slots=[0],
    reset=[True],
    counts=[0, 1, 1, 0, 0],
  )
  after = _check_expected(
    after,
    _input([(6, 0), (7, 0)]),
    4,
    Eviction("lru"),
    True,
    slots=[1, NO],
    reset=[True, False],
    counts=[0, 1, 1, 1, 0],
  )
  assert _held_ids(after) == {0: 5, 1: 6}


@pytest.mark.parametrize(
  "decay_steps, victim, hit_count", [(None, 2, 3), (2, 3, 1)]
)
def test_lfu(decay_steps, victim, hit_count):
  # Step 8. Counts 5, 2, 2, 9, last steps 1, 3, 2, 0. Without decay: the
  # count-2 slots 1 and 2, then the older, 2. Halving every 2 steps: all
  # counts become 0 (5 >> 3, 2 >> 2, 2 >> 3, 9 >> 4), the oldest is 3.
  # Slot 1's id is a hit: 2 + 1, or (2 >> 2) + 1.
  shard = _map(4, {0: (50, 1, 5), 1: (51, 3, 2), 2: (52, 2, 2), 3: (53, 0, 9)})
  ids = _input([(60, 0), (51, 0)])
  after = _check_expected(
    shard,
    ids,
    8,
    Eviction("lfu", decay_steps=decay_steps),
    True,
    slots=[victim, 1],
    reset=[True, False],
    counts=[0, 1, 1, 0, 0],
  )
  assert _held_ids(after)[victim] == 60
  np.testing.assert_array_equal(after.seen[victim], [8, 1])
  np.testing.assert_array_equal(after.seen[1], [8, hit_count])


def test_ttl():
  # Step 6, ttl 3: slots 1 and 2 (last steps 1, 2) have expired; slot 0
  # (last step 3) is exactly 3 steps old and stays. Slot 2's id is a hit:
  # its count grows by one (ttl does not decay counts) and the slot is no
  # longer a victim. Three misses: the smallest id takes slot 1, the
  # others are refused.
  shard = _map(4, {0: (40, 3, 1), 1: (41, 1, 7), 2: (42, 2, 4), 3: (43, 4, 1)})
  ids = _input([(71, 2), (70, 2), (72, 2), (42, 0)])
  after = _check_expected(
    shard,
    ids,
    6,
    Eviction("ttl", ttl_steps=3),
    True,
    slots=[NO, 1, NO, 2],
    reset=[False, True, False, False],
    counts=[0, 1, 1, 2, 0],
  )
  np.testing.assert_array_equal(after.seen, [[3, 1], [6, 1], [6, 5], [4, 1]])


@pytest.mark.parametrize(
  "policy, slots, counts",
  [("none", [NO, 64], [1, 1, 0, 1, 0]), ("lru", [0, 64], [1, 2, 1, 0, 0])],
)
def test_full_window_beside_free_slots(policy, slots, counts):
  # 100 slots, windows of 64: slots 0..63 held, 64..99 free. Home 0 sees
  # only held slots; home 40 reaches slot 64.
  shard = _map(100, {s: (1000 + s, 1, 1) for s in range(64)})
  _check_expected(
    shard,
    _input([(7, 0), (8, 40)]),
    2,
    Eviction(policy),
    True,
    slots=slots,
    reset=[True, True] if policy == "lru" else [False, True],
    counts=counts,
  )


def test_counts_saturate_and_decay_fully():
  shard = _map(3, {0: (1, 0, INT32_MAX), 1: (2, 0, INT32_MAX - 1)})
  after = _check_expected(
    shard,
    _input([(1, 0), (2, 0)]),
    1,
    Eviction("lru"),
    True,
    slots=[0, 1],
    reset=[False, False],
    counts=[0, 0, 0, 0, 0],
  )
  np.testing.assert_array_equal(after.seen[:2], [[1, INT32_MAX]] * 2)
  # 100 halvings of 2**31 - 1: 0, then the sighting.
  after = _check_expected(
    shard,
    _input([(1, 0)]),
    100,
    Eviction("lfu", decay_steps=1),
    True,
    slots=[0],
    reset=[False],
    counts=[0, 0, 0, 0, 0],
  )
  np.testing.assert_array_equal(after.seen[0], [100, 1])


def test_duplicates_and_absent_entries():
  # Reset marks the first occurrence in input order; entries with home -1
  # carry no id even when their words are a held or inserted id's.
  shard = _map(8, {4: (30, 2, 1)})
  ids = _input(
    [(30, -1), (21, 4), (20, 4), (20, 4), (21, 4), (30, 4), (20, -1)]
  )
  after = _check_expected(
    shard,
    ids,
    3,
    Eviction("lru"),
    True,
    slots=[NO, 6, 5, 5, 6, 4, NO],
    reset=[False, True, True, False, False, False, False],
    counts=[2, 2, 0, 0, 0],
  )
  _check_expected(
    after,
    _input([(21, 4), (22, -1), (22, 4), (20, 4), (22, 4), (21, 4)]),
    0,
    Eviction("lru"),
    False,
    slots=[6, NO, NO, 5, NO, 6],
    reset=[False] * 6,
    counts=[0, 0, 0, 0, 1],
  )


def test_same_low_word_different_ids():
  # Ids that differ only in the high word are different ids.
  shard = _map(4, {0: (5, 1, 1)})
  _check_expected(
    shard,
    _input([(5 + 2**32, 0), (5 - 2**32, 0), (5, 0)]),
    2,
    Eviction("lru"),
    True,
    slots=[1, 2, 0],
    reset=[True, True, False],
    counts=[2, 2, 0, 0, 0],
  )


# ---------------------------------------------------------------------------
# Random streams against the model.


def _with_home(rng, capacity: int, wanted: set[int], count: int) -> np.ndarray:
  """`count` random int64 ids whose home is in `wanted`."""
  out = []
  while len(out) < count:
    raw = rng.integers(-(2**63), 2**63 - 1, 4096, np.int64, endpoint=True)
    out.extend(raw[np.isin(hashed.homes(raw, capacity), list(wanted))])
  return np.array(out[:count], np.int64)


def _pool(rng, capacity: int) -> np.ndarray:
  """Ids of a stream: the special ids, ids crowding the homes around the
  wraparound (C-2, C-1, 0), and random ones; shuffled (Zipf ranks)."""
  crowd = _with_home(rng, capacity, {capacity - 2, capacity - 1, 0}, 8)
  crowd = np.concatenate(
    [crowd, _with_home(rng, capacity, {capacity - 1}, capacity // 3 + 4)]
  )
  spread = rng.integers(
    -(2**63), 2**63 - 1, capacity + 8, np.int64, endpoint=True
  )
  small = rng.integers(-50, 50, 8, np.int64)
  pool = np.unique(
    np.concatenate([np.array(SPECIAL_IDS, np.int64), crowd, spread, small])
  )
  return rng.permutation(pool)


def _batch_size(capacity: int) -> int:
  return min(max(12, capacity * 3 // 4), 96)


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("name", list(EVICTIONS))
def test_stream_matches_model(name, capacity):
  eviction = EVICTIONS[name]
  seed = list(EVICTIONS).index(name) * 1000 + capacity
  rng = np.random.default_rng(seed)
  pool = _pool(rng, capacity)
  weights = 1.0 / np.arange(1, len(pool) + 1) ** 0.9
  weights /= weights.sum()
  n = _batch_size(capacity)
  model = ShardModel(capacity)
  shard = _empty(capacity)
  step = int(rng.integers(0, 10))
  totals = np.zeros(len(hashed.COUNTERS), np.int64)
  evicted_ids: set[int] = set()
  returned = 0
  for call in range(STEPS):
    train = call % INFERENCE_EVERY != INFERENCE_EVERY - 1
    raw = rng.choice(pool, n, p=weights)
    absent = rng.random(n) < ABSENT_FRACTION
    ids = shard_input(raw, capacity, absent)
    if train:
      step += int(rng.choice(STEP_INCREMENTS))
      call_step = step
    else:
      call_step = int(rng.integers(-5, 2**20))  # ignored in inference
    before = _held_ids(shard)
    shard, counts = _check_call(model, shard, ids, call_step, eviction, train)
    after = _held_ids(shard)
    for slot, key in before.items():
      if after.get(slot) != key:
        evicted_ids.add(key)
    for slot, key in after.items():
      if before.get(slot) != key and key in evicted_ids:
        returned += 1
    totals += counts
  held = len(_held_ids(shard))
  assert held == totals[HELD]
  # The stream exercises what it is meant to: full windows, and evicted ids
  # coming back (or refusals where nothing may be evicted).
  assert held >= min(capacity, 64) // 2
  assert totals[UNSEEN] > 0
  if eviction.policy in ("lru", "lfu"):
    assert totals[EVICTED] > 0 and returned > 0
  else:
    assert totals[REFUSED] > 0
  if eviction.policy == "ttl":
    assert totals[EVICTED] > 0


# ---------------------------------------------------------------------------
# Hashes.

FIXED_IDS = (
  -1,
  0,
  1,
  2**63 - 1,
  -(2**63),
  12345,
  -987654321,
  2**32,
  2**31,
  0x9E3779B97F4A7C15 - 2**64,
)


def _mix64_py(x: int) -> int:
  z = x & MASK64
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
  return z ^ (z >> 31)


def _fixed_and_random_ids() -> list[int]:
  rng = np.random.default_rng(7)
  extra = rng.integers(-(2**63), 2**63 - 1, 64, np.int64, endpoint=True)
  return list(FIXED_IDS) + [int(x) for x in extra]


def test_mix64_is_splitmix64():
  # SplitMix64 from seed 0: the finalizer of k * 0x9E3779B97F4A7C15.
  golden = 0x9E3779B97F4A7C15
  published = (0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F)
  for k, want in enumerate(published, 1):
    raw = (k * golden) & MASK64
    signed = raw - (1 << 64) if raw >> 63 else raw
    assert int(hashed.mix64(np.array([signed], np.int64))[0]) == want
  ids = _fixed_and_random_ids()
  got = hashed.mix64(np.array(ids, np.int64))
  assert got.dtype == np.uint64
  assert [int(v) for v in got] == [_mix64_py(x) for x in ids]


@pytest.mark.parametrize("num_shards", [1, 3, 8, 1000003])
def test_owners(num_shards):
  ids = _fixed_and_random_ids()
  got = hashed.owners(np.array(ids, np.int64), num_shards)
  assert got.dtype == np.int64
  assert [int(v) for v in got] == [_mix64_py(x) % num_shards for x in ids]


@pytest.mark.parametrize("rows", [1, 8, 40, 200, 2**31 - 1])
def test_homes(rows):
  ids = _fixed_and_random_ids()
  got = hashed.homes(np.array(ids, np.int64), rows)
  assert got.dtype == np.int64
  assert [int(v) for v in got] == [(_mix64_py(x) >> 32) % rows for x in ids]


def test_string_ids():
  values = ["", "a", "user:12345", "ünïcødé ✓", b"", b"\x00\xff", "a" * 1000]
  got = hashed.string_ids(values)
  assert got.dtype == np.int64
  want = []
  for v in values:
    data = v.encode("utf-8") if isinstance(v, str) else v
    digest = hashlib.blake2b(data, digest_size=8).digest()
    want.append(int.from_bytes(digest, "little", signed=True))
  assert [int(v) for v in got] == want
  assert hashed.string_ids(["x"])[0] == hashed.string_ids([b"x"])[0]


def test_key_words():
  ids = _fixed_and_random_ids()
  lo, hi = hashed.key_words(np.array(ids, np.int64))
  assert lo.dtype == hi.dtype == np.int32

  def signed32(v):
    return v - (1 << 32) if v >> 31 else v

  assert [int(v) for v in lo] == [signed32(x & 0xFFFFFFFF) for x in ids]
  assert [int(v) for v in hi] == [signed32((x >> 32) & 0xFFFFFFFF) for x in ids]
  assert [unsigned_key(a, b) for a, b in zip(lo, hi, strict=True)] == [
    x & MASK64 for x in ids
  ]
  np.testing.assert_array_equal(hashed.ids_of_words(lo, hi), ids)


# ---------------------------------------------------------------------------
# Eviction.


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"policy": "fifo"}, "eviction policy must be one of"),
    ({"policy": "LRU"}, "eviction policy must be one of"),
    ({"policy": "ttl"}, "needs ttl_steps"),
    ({"policy": "ttl", "ttl_steps": 0}, "needs ttl_steps"),
    ({"policy": "ttl", "ttl_steps": -3}, "needs ttl_steps"),
    ({"policy": "ttl", "ttl_steps": True}, "needs ttl_steps"),
    ({"policy": "ttl", "ttl_steps": 2.0}, "needs ttl_steps"),
    ({"policy": "ttl", "ttl_steps": 2**31}, "needs ttl_steps"),
    ({"policy": "lru", "ttl_steps": 3}, "only for the 'ttl' policy"),
    ({"policy": "lfu", "ttl_steps": 3}, "only for the 'ttl' policy"),
    ({"policy": "lru", "decay_steps": 2}, "only for the 'lfu' policy"),
    ({"policy": "none", "decay_steps": 2}, "only for the 'lfu' policy"),
    ({"policy": "ttl", "ttl_steps": 3, "decay_steps": 2}, "'lfu' policy"),
    ({"policy": "lfu", "decay_steps": 0}, "decay_steps must be a positive"),
    ({"policy": "lfu", "decay_steps": -1}, "decay_steps must be a positive"),
    ({"policy": "lfu", "decay_steps": False}, "decay_steps must be a positive"),
    ({"policy": "lfu", "decay_steps": True}, "decay_steps must be a positive"),
  ],
)
def test_eviction_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    Eviction(**kwargs)


def test_eviction_values():
  assert Eviction() == Eviction("lru")
  assert [Eviction(p).code for p in ("lru", "lfu", "none")] == [0, 1, 3]
  ttl = Eviction("ttl", ttl_steps=np.int32(5))
  assert (ttl.code, ttl.parameter) == (2, 5)
  assert Eviction("lfu").parameter == 0
  assert Eviction("lfu", decay_steps=7).parameter == 7
  assert Eviction("lru").parameter == Eviction("none").parameter == 0
  assert Eviction("ttl", ttl_steps=2**31 - 1).ttl_steps == 2**31 - 1
  assert hashed.as_eviction("t", None) == Eviction("lru")
  assert hashed.as_eviction("t", "lfu") == Eviction("lfu")
  assert hashed.as_eviction("t", ttl) is ttl
  with pytest.raises(ValueError, match="table 't'.*needs ttl_steps"):
    hashed.as_eviction("t", "ttl")
  with pytest.raises(ValueError, match="table 't'.*must be an Eviction"):
    hashed.as_eviction("t", 3)


# ---------------------------------------------------------------------------
# The compiled handler against the JAX implementation.


def _random_call(rng, shards, capacity, regions, n):
  """`[S, n, 4]` ids of a few tables (duplicates, absent ids, homes at the
  wraparound) for shards whose regions are `regions`."""
  member = rng.integers(0, len(regions), (shards, n))
  pool = rng.integers(-(2**63), 2**63 - 1, 3 * n, dtype=np.int64)
  ids = pool[rng.integers(0, 3 * n, (shards, n))]
  lo, hi = hashed.key_words(ids.reshape(-1))
  rows = np.array([r for _, r in regions])[member]
  home = rng.integers(0, 1 << 30, (shards, n)) % rows
  home = np.where(rng.random((shards, n)) < 0.2, rows - 1, home)
  home = np.where(rng.random((shards, n)) < 0.1, -1, home)
  out = np.stack(
    [lo.reshape(shards, n), hi.reshape(shards, n), home, member], -1
  )
  return out.astype(np.int32)


@pytest.mark.skipif(
  not ffi.available(ffi.HASHED_MAP_TARGET), reason="no compiled handler"
)
@pytest.mark.parametrize(
  "eviction",
  [
    hashed.Eviction("lru"),
    hashed.Eviction("lfu", decay_steps=3),
    hashed.Eviction("lfu"),
    hashed.Eviction("ttl", ttl_steps=2),
    hashed.Eviction("none"),
  ],
  ids=lambda e: f"{e.policy}-{e.parameter}",
)
def test_compiled_handler_equals_the_jax_map(eviction):
  rng = np.random.default_rng(31)
  shards, capacity = 3, 200
  regions = ((0, 40), (40, 96), (136, 64))
  calls = {
    impl: jax.jit(
      functools.partial(
        device_hashed.resolve_shards,
        eviction=eviction,
        regions=regions,
        implementation=impl,
      ),
      static_argnames="train",
    )
    for impl in ("ffi", "reference")
  }
  maps = {
    impl: device_hashed.ShardMap(
      jnp.zeros((shards, capacity, 2), jnp.int32),
      jnp.asarray(np.full((shards, capacity, 2), [hashed.EMPTY, 0], np.int32)),
    )
    for impl in calls
  }
  step = 0
  for call in range(24):
    ids = _random_call(rng, shards, capacity, regions, 96)
    train = call % 5 != 4
    got = {
      impl: fn(jnp.asarray(ids), maps[impl], step, train=train)
      for impl, fn in calls.items()
    }
    a, b = got["ffi"], got["reference"]
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    maps = {impl: r.map for impl, r in got.items()}
    step += int(rng.integers(0, 3))
  # The stream filled windows: slots were taken (and, but for "none",
  # taken from other ids).
  seen = np.asarray(maps["ffi"].seen)
  assert (seen[..., 0] != hashed.EMPTY).mean() > 0.5


@pytest.mark.skipif(
  not ffi.available(ffi.HASHED_MAP_TARGET), reason="no compiled handler"
)
def test_compiled_handler_refuses_hostile_ids_and_keeps_the_map():
  rng = np.random.default_rng(37)
  regions = ((0, 40), (40, 24))
  ids = _random_call(rng, 2, 64, regions, 32)
  shard_map = device_hashed.ShardMap(
    jnp.zeros((2, 64, 2), jnp.int32),
    jnp.asarray(np.full((2, 64, 2), [hashed.EMPTY, 0], np.int32)),
  )
  good = device_hashed.resolve_shards(
    jnp.asarray(ids),
    shard_map,
    1,
    eviction=hashed.Eviction(),
    train=True,
    regions=regions,
    implementation="ffi",
  )
  bad = ids.copy()
  bad[1, 5, 2], bad[1, 5, 3] = 24, 1  # Home beyond table 1's 24 rows.
  with pytest.raises(Exception, match="home"):
    jax.block_until_ready(
      device_hashed.resolve_shards(
        jnp.asarray(bad),
        good.map,
        2,
        eviction=hashed.Eviction(),
        train=True,
        regions=regions,
        implementation="ffi",
      )
    )
  # The next call with good ids works on the map the first call left.
  again = device_hashed.resolve_shards(
    jnp.asarray(ids),
    good.map,
    2,
    eviction=hashed.Eviction(),
    train=True,
    regions=regions,
    implementation="ffi",
  )
  np.testing.assert_array_equal(np.asarray(again.slots), np.asarray(good.slots))
