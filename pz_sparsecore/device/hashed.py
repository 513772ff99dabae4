"""The map of a hashed table's shard, in JAX (`core.hashed` has its rules).

`resolve_shard` is one call of one shard's map: the ids sent to the shard
in, each one's slot out, the map updated. It is written with JAX
operations only: the reference the compiled handler is checked against,
and the implementation wherever that handler is not built.

Cost: the hits are found for all ids at once (`n x W` compares); the
misses of a training call then take their slots one after another (a loop
of `misses` iterations, `W` compares each), since each may take a slot the
next one would have taken.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import buffer_format, hashed
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.plan import Plan
from pz_sparsecore.core.preprocessed import PreprocessedInput
from pz_sparsecore.core.specs import initializer_draw_key
from pz_sparsecore.device.exchange.base import own_buffer_shape
from pz_sparsecore.device.kernels import dispatch, ffi, reference
from pz_sparsecore.device.topology import Topology

_INT32_MAX = 2**31 - 1
_SIGN = jnp.int32(-(2**31))


class ShardMap(NamedTuple):
  """One shard's map.

  Attributes:
    ids: int32 `[C, 2]`: the id each slot holds (low, high word).
    seen: int32 `[C, 2]`: each slot's last step (`hashed.EMPTY` if free)
      and count.
  """

  ids: jax.Array
  seen: jax.Array


class Resolved(NamedTuple):
  """One call's result on one shard.

  Attributes:
    slots: int32 `[n]`: each id's slot, `hashed.REFUSED` for a refused or
      unseen id and for no id.
    reset: bool `[n]`: the first occurrence of each id given a slot in this
      call (its row and optimizer slots must be reset).
    map: The updated map.
    counts: int32 `[len(hashed.COUNTERS)]`: the call's changes of the
      shard's counters.
  """

  slots: jax.Array
  reset: jax.Array
  map: ShardMap
  counts: jax.Array


def decayed(count, last, step, decay_steps: int | None):
  """A count halved once per `decay_steps` steps since `last` (None or 0:
  never; only `lfu` counts decay)."""
  if not decay_steps:
    return count
  halvings = jnp.minimum((step - last) // decay_steps, 31)
  return jnp.right_shift(count, jnp.maximum(halvings, 0))


def _sorted_order(ids: jax.Array) -> jax.Array:
  """The permutation putting ids in ascending order of (table, id as an
  unsigned 64-bit word), absent ids (home -1) last."""
  absent = (ids[:, 2] < 0).astype(jnp.int32)
  # XOR with the sign bit orders int32 words as unsigned ones.
  hi, lo = ids[:, 1] ^ _SIGN, ids[:, 0] ^ _SIGN
  index = jnp.arange(ids.shape[0], dtype=jnp.int32)
  return jax.lax.sort((absent, ids[:, 3], hi, lo, index), num_keys=4)[4]


def _window(home, member, regions) -> tuple[jax.Array, jax.Array]:
  """Each id's window `[n, W]` in its table's region, and which of its
  `W` (the widest window of the stack) slots belong to it."""
  offsets = jnp.asarray([o for o, _ in regions], jnp.int32)[member]
  rows = jnp.asarray([c for _, c in regions], jnp.int32)[member]
  w = max(hashed.window(c) for _, c in regions)
  i = jnp.arange(w, dtype=jnp.int32)
  slots = offsets[:, None] + (home[:, None] + i) % rows[:, None]
  return slots, i < jnp.minimum(rows, hashed.PROBE_SLOTS)[:, None]


def _pick(
  slots, ok, seen, step, policy: hashed.Eviction
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A miss's slot among its window `slots` (`ok`: those of the window;
  `seen` their rows of the map): `(found, slot, evicts)`."""
  last, count = seen[:, 0], seen[:, 1]
  free = (last == hashed.EMPTY) & ok
  first_free = jnp.argmax(free)
  if policy.policy == "none":
    eligible = jnp.zeros_like(free)
  else:
    eligible = (last < step) & (last != hashed.EMPTY) & ok
    if policy.policy == "ttl":
      eligible &= step - last > policy.ttl_steps
  big = jnp.int32(_INT32_MAX)
  if policy.policy == "lfu":
    score = decayed(count, last, step, policy.decay_steps)
    best = jnp.min(jnp.where(eligible, score, big))
    eligible &= score == best
  best_last = jnp.min(jnp.where(eligible, last, big))
  eligible &= last == best_last
  victim = jnp.argmax(eligible)
  any_free = jnp.any(free)
  found = any_free | jnp.any(eligible)
  chosen = jnp.where(any_free, first_free, victim)
  return found, slots[chosen], found & ~any_free


def _hits(shard: ShardMap, s_ids, window, ok, first):
  """Which (first occurrences of) ids the map holds before the call, and
  their slots (`hashed.REFUSED` for the others)."""
  held = shard.ids[window]
  match = (
    ok
    & (shard.seen[window, 0] != hashed.EMPTY)
    & (held[..., 0] == s_ids[:, None, 0])
    & (held[..., 1] == s_ids[:, None, 1])
  )
  hit = first & jnp.any(match, axis=1)
  slot = jnp.where(
    hit,
    jnp.take_along_axis(window, jnp.argmax(match, axis=1)[:, None], 1)[:, 0],
    hashed.REFUSED,
  )
  return hit, slot


def _insert_misses(
  map_ids, seen, slot, s_ids, window, ok, miss, step, eviction
):
  """The misses take their slots one after another, in id order:
  `(map ids, seen, slot, counters' changes)`."""
  capacity = map_ids.shape[0]
  miss_order = jnp.argsort(~miss, stable=True)
  num_misses = jnp.sum(miss, dtype=jnp.int32)

  def insert(i, state):
    map_ids, seen, slot, counts = state
    at = miss_order[i]
    candidates = window[at]
    found, chosen, evicts = _pick(
      candidates, ok[at], seen[candidates], step, eviction
    )
    target = jnp.where(found, chosen, capacity)
    map_ids = map_ids.at[target].set(s_ids[at, :2], mode="drop")
    seen = seen.at[target].set(jnp.stack([step, jnp.int32(1)]), mode="drop")
    slot = slot.at[at].set(jnp.where(found, chosen, hashed.REFUSED))
    add = jnp.stack(
      [
        found & ~evicts,  # held
        found,  # inserted
        evicts,  # evicted
        ~found,  # refused
        jnp.bool_(False),  # unseen
      ]
    ).astype(jnp.int32)
    return map_ids, seen, slot, counts + add

  return jax.lax.fori_loop(
    0,
    num_misses,
    insert,
    (map_ids, seen, slot, jnp.zeros((len(hashed.COUNTERS),), jnp.int32)),
  )


def resolve_shard(
  ids: jax.Array,
  shard: ShardMap,
  step: jax.Array,
  *,
  eviction: hashed.Eviction,
  train: bool,
  regions: tuple[tuple[int, int], ...] | None = None,
) -> Resolved:
  """One call of one shard's map (`core.hashed`).

  Args:
    ids: int32 `[n, 4]`: low word, high word, home (within its table's
      region) and table of each id sent to the shard (home -1: no id); an
      id may come several times. `[n, 3]`: all of table 0.
    shard: The shard's map.
    step: int32, the current step (training; ignored in inference).
    eviction: The stack's policy.
    train: Insert and evict (training) or only look up (inference).
    regions: Per table of the stack, its `(first row, rows)` in the shard;
      None: one table of all the shard's rows.

  Returns:
    Each id's slot, which ones to reset, the new map and the counters'
    changes.
  """
  n = ids.shape[0]
  capacity = shard.ids.shape[0]
  regions = regions or ((0, capacity),)
  if ids.shape[1] == 3:
    ids = jnp.pad(ids, ((0, 0), (0, 1)))
  # A table index out of range reads as no id.
  bad = (ids[:, 3] < 0) | (ids[:, 3] >= len(regions))
  ids = ids.at[:, 2].set(jnp.where(bad, -1, ids[:, 2]))
  ids = ids.at[:, 3].set(jnp.where(bad, 0, ids[:, 3]))
  step = jnp.asarray(step, jnp.int32)
  order = _sorted_order(ids)
  s_ids = ids[order]
  present = s_ids[:, 2] >= 0
  same = jnp.all(s_ids[1:, (0, 1, 3)] == s_ids[:-1, (0, 1, 3)], axis=1)
  first = present & jnp.concatenate([jnp.ones((1,), bool), ~same])

  window, ok = _window(jnp.maximum(s_ids[:, 2], 0), s_ids[:, 3], regions)
  hit, slot = _hits(shard, s_ids, window, ok, first)
  miss = first & ~hit
  zero = jnp.int32(0)
  if not train:
    unseen = jnp.sum(miss, dtype=jnp.int32)
    counts = jnp.stack([zero, zero, zero, zero, unseen])
    return Resolved(
      _spread(slot, first, present, order),
      jnp.zeros((n,), bool),
      shard,
      counts,
    )

  seen = shard.seen
  hit_rows = jnp.where(hit, slot, capacity)
  old = seen[jnp.minimum(hit_rows, capacity - 1)]
  bumped = decayed(old[:, 1], old[:, 0], step, eviction.decay_steps)
  bumped = jnp.where(bumped < _INT32_MAX, bumped + 1, bumped)
  seen = seen.at[hit_rows].set(
    jnp.stack([jnp.broadcast_to(step, bumped.shape), bumped], 1), mode="drop"
  )

  map_ids, seen, slot, counts = _insert_misses(
    shard.ids, seen, slot, s_ids, window, ok, miss, step, eviction
  )
  reset_sorted = miss & (slot != hashed.REFUSED)
  reset = jnp.zeros((n,), bool).at[order].set(reset_sorted)
  return Resolved(
    _spread(slot, first, present, order),
    reset,
    ShardMap(map_ids, seen),
    counts,
  )


def resolve_shards(
  ids: jax.Array,
  shards: ShardMap,
  step: jax.Array,
  *,
  eviction: hashed.Eviction,
  train: bool,
  regions: tuple[tuple[int, int], ...] | None = None,
  implementation: str | None = None,
) -> Resolved:
  """`resolve_shard` of `S` shards at once (`ids` `[S, n, 4]`, the map's
  arrays `[S, C, 2]`; the result's arrays with a leading `S`), by the
  compiled handler where the platform has one, else by `resolve_shard`
  (`kernels.dispatch`: never silently; `implementation` as there)."""
  dispatch.check_implementation(implementation)

  def reference_fn(ids, map_ids, seen, step):
    got = jax.vmap(
      lambda w, m: resolve_shard(
        w, m, step, eviction=eviction, train=train, regions=regions
      )
    )(ids, ShardMap(map_ids, seen))
    return got.slots, got.reset, got.map.ids, got.map.seen, got.counts

  def ffi_fn(ids, map_ids, seen, step):
    return ffi.hashed_map_resolve(
      ids,
      map_ids,
      seen,
      step,
      policy=eviction.code,
      parameter=eviction.parameter,
      train=train,
      regions=regions,
    )

  fn = dispatch.choose(
    ffi.HASHED_MAP_TARGET, implementation, ffi_fn, reference_fn
  )
  slots, reset, map_ids, seen, counts = fn(
    ids, shards.ids, shards.seen, jnp.asarray(step, jnp.int32)
  )
  return Resolved(slots, reset, ShardMap(map_ids, seen), counts)


def _spread(slot, first, present, order) -> jax.Array:
  """Each id's slot in input order, from the slots of the first occurrences
  (`slot`, `first`, `present` in sorted order)."""
  group = jnp.cumsum(first.astype(jnp.int32)) - 1
  firsts = jnp.where(first, size=first.shape[0], fill_value=0)[0]
  by_group = slot[firsts]
  sorted_slots = jnp.where(
    present, by_group[jnp.maximum(group, 0)], hashed.REFUSED
  )
  return jnp.zeros_like(sorted_slots).at[order].set(sorted_slots)


def add_counters(counters: jax.Array, counts: jax.Array) -> jax.Array:
  """Counters plus a call's changes, saturating at 2**31 - 1."""
  room = _INT32_MAX - counters
  return counters + jnp.minimum(counts, room)


# ---------------------------------------------------------------------------
# A hashed stack over the mesh: ids to their owners, rows back to the
# buffers.


class StackMap(NamedTuple):
  """A hashed stack's map over all its shards (the layer's state).

  Attributes:
    ids: int32 `[N, C, 2]`, sharded like the table.
    seen: int32 `[N, C, 2]`, sharded like the table.
    counters: int32 `[N, len(hashed.COUNTERS)]`, sharded like the table.
    seed: uint32 `[2]`, replicated: the key new rows are drawn from (with
      each id folded in).
  """

  ids: jax.Array
  seen: jax.Array
  counters: jax.Array
  seed: jax.Array


def empty_map(num_shards: int, capacity: int, seed: jax.Array) -> StackMap:
  """A map holding no id (host arrays; place them like the table)."""
  return StackMap(
    ids=jnp.zeros((num_shards, capacity, 2), jnp.int32),
    seen=jnp.zeros((num_shards, capacity, 2), jnp.int32)
    .at[..., 0]
    .set(hashed.EMPTY),
    counters=jnp.zeros((num_shards, len(hashed.COUNTERS)), jnp.int32),
    seed=seed,
  )


def _table_words(stack) -> jax.Array:
  """Per member table, the int32 word folded into its rows' keys: its
  name's CRC-32 (so a row depends on its table and id, not on stacking)."""
  crcs = [zlib.crc32(t.name.encode()) for t in stack.tables]
  return jnp.asarray(np.array(crcs, np.uint32).view(np.int32))


def new_rows(stack, seed: jax.Array, words: jax.Array) -> jax.Array:
  """The initial rows `[n, D]` (float32) of ids given as `[n, 4]` words
  (low, high, home, table): the table's initializer drawn with `seed`
  folded with the table's name and the id's words, so a row depends on its
  table and id alone. Tables whose initializers draw alike share one draw
  (`specs.initializer_draw_key`)."""
  base = jax.random.wrap_key_data(seed)
  member = jnp.clip(words[:, 3], 0, len(stack.tables) - 1)
  table_word = _table_words(stack)[member]

  def draw(init, w, t):
    key = jax.random.fold_in(base, t)
    key = jax.random.fold_in(jax.random.fold_in(key, w[0]), w[1])
    try:
      row = init(key, (1, stack.dim), jnp.float32)
    except TypeError:
      row = init(key, (1, stack.dim))
    return jnp.asarray(row, jnp.float32).reshape(stack.dim)

  groups: dict[Any, list[int]] = {}
  for i, t in enumerate(stack.tables):
    key = initializer_draw_key(t.initializer)
    groups.setdefault(("member", i) if key is None else key, []).append(i)
  rows = jnp.zeros((words.shape[0], stack.dim), jnp.float32)
  for members in groups.values():
    init = stack.tables[members[0]].initializer
    drawn = jax.vmap(functools.partial(draw, init))(words, table_word)
    mine = jnp.isin(member, jnp.asarray(members))
    rows = jnp.where(mine[:, None], drawn, rows)
  return rows


RESET_CHUNK = 256
"""Rows drawn at a time for the ids given rows in a call, while that many
are left; the rest `RESET_TAIL` at a time: the draws cost O(new ids), not
O(ids sent), and waste fewer than `RESET_TAIL` rows."""

RESET_TAIL = 32


def _write_new_rows(stack, table, shard, target, words, seed):
  """`table` with each reset id's new row (`new_rows`) at `(shard,
  target)` (`target` out of range: no reset), drawn `RESET_CHUNK` ids at a
  time, then `RESET_TAIL` at a time."""
  capacity = table.shape[1]
  flat_target, flat_shard = target.reshape(-1), shard.reshape(-1)
  flat_words = words.reshape(-1, words.shape[-1])
  n = flat_target.shape[0]
  count = jnp.sum(flat_target < capacity, dtype=jnp.int32)
  big, tail = min(RESET_CHUNK, n), min(RESET_TAIL, n)
  at = jnp.nonzero(flat_target < capacity, size=n + big, fill_value=n)[0]
  # Index n (past the end) reads a padded entry whose target is dropped.
  flat_target = jnp.append(flat_target, capacity)
  flat_shard = jnp.append(flat_shard, 0)
  flat_words = jnp.concatenate([flat_words, flat_words[:1]])

  def chunks(size):
    def body(state):
      i, table = state
      pick = jax.lax.dynamic_slice_in_dim(at, i, size)
      rows = new_rows(stack, seed, flat_words[pick])
      table = table.at[flat_shard[pick], flat_target[pick]].set(
        rows.astype(table.dtype), mode="drop"
      )
      return i + size, table

    return body

  state = jax.lax.while_loop(
    lambda state: count - state[0] >= big, chunks(big), (jnp.int32(0), table)
  )
  _, table = jax.lax.while_loop(
    lambda state: state[0] < count, chunks(tail), state
  )
  return table


def _reset(stack, table, slots, slot_rows, reset, words, seed):
  """The table and optimizer slots with the reset rows of each local shard
  written (`slot_rows`, `reset`, `words`: `[S, n]`, `[S, n]`, `[S, n, 4]`)."""
  s, capacity = table.shape[0], table.shape[1]
  target = jnp.where(reset, slot_rows, capacity)
  shard = jnp.broadcast_to(
    jnp.arange(s, dtype=jnp.int32)[:, None], target.shape
  )
  table = _write_new_rows(stack, table, shard, target, words, seed)
  new_slots = []
  for value, init in zip(
    slots, stack.optimizer.slot_variables_initializers(), strict=True
  ):
    first = jnp.asarray(
      init(jax.random.key(0), (1, value.shape[-1])), value.dtype
    ).reshape(-1)
    new_slots.append(
      value.at[shard, target].set(
        jnp.broadcast_to(first, (*target.shape, value.shape[-1])),
        mode="drop",
      )
    )
  return table, tuple(new_slots)


def local_resolve(
  stack,
  topo,
  stack_map: StackMap,
  table: jax.Array,
  slots: tuple[jax.Array, ...],
  buffers,
  words: jax.Array,
  step: jax.Array,
  train: bool,
  cap: int,
  num_minibatches: jax.Array | None = None,
):
  """Per device, inside `shard_map`: the stack's ids resolved to rows.

  Args:
    stack: The stack's plan (of hashed tables).
    topo: The topology.
    stack_map: The device's part of the map (`[S, C, 2]`, `[S, C, 2]`,
      `[S, 5]`, the seed).
    table: `[S, C, D]`, the device's shards.
    slots: The optimizer slots, each `[S, C, w]`.
    buffers: The local `(row_pointers, embedding_ids, sample_ids, gains)`,
      ids being places (`host.hashed_ids`).
    words: The local `hashed_ids`, int32 `[S * N * cap * 4]`.
    step: int32, the step.
    train: Insert and evict, or only look up.
    cap: Places per local SparseCore and partition
      (`plan.hashed_places`).
    num_minibatches: For minibatched buffers, the device's count (the
      buffers' format: `host.minibatching`); None otherwise.

  Returns:
    `(stack_map, table, slots, embedding_ids, rows)`: the ids now rows
    (places of refused or unseen ids `PAD_ID`: they read zero and are not
    updated), and `rows`, int32 `[S, N, cap]`: the row of each local
    segment's place in each partition (-1: none).
  """
  g, s, axis = topo.num_devices, topo.num_sc_per_device, topo.axis
  n, capacity = g * s, stack.rows_per_shard
  sent = words.reshape(s, g, s, cap, hashed.KEY_WORDS)
  got = (
    jax.lax.all_to_all(sent, axis, 1, 1, tiled=True) if g > 1 else sent
  )  # [segment, source device, own shard, place, word]
  per_shard = got.transpose(2, 1, 0, 3, 4).reshape(s, -1, hashed.KEY_WORDS)
  resolved = resolve_shards(
    per_shard,
    ShardMap(stack_map.ids, stack_map.seen),
    step,
    eviction=stack.eviction,
    train=train,
    regions=stack.regions(n),
  )
  if train:
    table, slots = _reset(
      stack,
      table,
      slots,
      resolved.slots,
      resolved.reset,
      per_shard,
      stack_map.seed,
    )
  back = resolved.slots.reshape(s, g, s, cap).transpose(2, 1, 0, 3)
  if g > 1:
    back = jax.lax.all_to_all(back, axis, 1, 1, tiled=True)
  rows = back.reshape(s, n, cap)  # [segment, partition, place]

  rp, ids, sids, _ = buffers
  if num_minibatches is None:
    shape = own_buffer_shape(stack, g, s)
    valid, table_row, _ = reference.decode_entries(rp, ids, sids, shape)
    valid, table_row = valid.reshape(-1), table_row.reshape(-1)
    segment = jnp.arange(valid.size, dtype=jnp.int32) // shape.seg_len
    part = jnp.minimum(table_row // capacity, n - 1)
    place = table_row % capacity
  else:
    valid, segment, part, place = _minibatched_entries(
      rp, ids, num_minibatches, s, n, capacity
    )
  row = rows[segment, part, jnp.clip(place, 0, cap - 1)]
  row = jnp.where((place < cap) & (row >= 0), row, buffer_format.PAD_ID)
  new_ids = jnp.where(valid, row, ids)
  new_map = StackMap(
    resolved.map.ids,
    resolved.map.seen,
    add_counters(stack_map.counters, resolved.counts),
    stack_map.seed,
  )
  return new_map, table, slots, new_ids, rows


def _minibatched_entries(rp, ids, count, s: int, n: int, capacity: int):
  """Each entry of one device's minibatched buffers (`host.minibatching`):
  `(valid, local SparseCore, partition, place)`. Segment `k = sc * M + m`
  holds the ends of its `N` partitions as indices into the device's
  buffer, so the ends of every (segment, partition) in order rise, and an
  entry's is the first end past it."""
  m = jnp.clip(jnp.reshape(count, (-1,))[0], 1, buffer_format.MAX_MINIBATCHES)
  rpp = buffer_format.row_pointers_per_sc(n)
  ends = rp.reshape(-1, rpp)[:, :n].reshape(-1)
  index = jnp.arange(ids.shape[0], dtype=rp.dtype)
  j = jnp.searchsorted(ends, index, side="right").astype(jnp.int32)
  valid = (
    (j < s * m * n)
    & (ids != buffer_format.PAD_ID)
    & (ids >= 0)
    & (ids < capacity)
  )
  segment = jnp.clip(j // n // m, 0, s - 1)
  return valid, segment, j % n, ids


def resolved_order(stack, topo, order: jax.Array, rows: jax.Array):
  """A one-device sample order (`PreprocessedInput.sample_order`) whose
  pairs name places, with rows instead (`rows`: `[S, N, cap]` per segment,
  partition and place, as `local_resolve` found them). A batch with a
  refused or unseen id gets none (its first start -1: the forward then
  reads the buffers, which skip that id)."""
  s, b = topo.num_sc_per_device, stack.samples_per_sc
  capacity, cap = stack.rows_per_shard, rows.shape[-1]
  starts, pairs = order[: s * b + 1], order[s * b + 1 :].reshape(-1, 2)
  index = jnp.arange(pairs.shape[0], dtype=jnp.int32)
  used = (index < starts[-1]) & (starts[0] >= 0)
  segment = jnp.zeros_like(index)
  if s > 1:
    segment = jnp.clip(
      (jnp.searchsorted(starts, index, side="right") - 1) // b, 0, s - 1
    )
  part = jnp.clip(pairs[:, 0] // capacity, 0, rows.shape[1] - 1)
  place = pairs[:, 0] % capacity
  row = rows[segment, part, jnp.clip(place, 0, cap - 1)]
  missing = jnp.any(used & ((row < 0) | (place >= cap)))
  new = jnp.where(used, part * capacity + row, pairs[:, 0])
  starts = starts.at[0].set(jnp.where(missing, -1, starts[0]))
  return jnp.concatenate([starts, jnp.stack([new, pairs[:, 1]], 1).reshape(-1)])


def hashed_stacks(plan: Plan) -> list[Any]:
  """The plan's stacks of hashed tables."""
  return [stack for stack in plan.stacks if stack.is_hashed]


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3, 4))
def _resolve(static, train, maps, tables, slots, inputs, step):
  plan, topo = static
  if inputs.num_minibatches is not None:
    plan = plan_lib.with_minibatch_buffers(plan)
  stacks = hashed_stacks(plan)

  def body(maps, tables, slots, inputs, step):
    out = ({}, {}, {}, {}, {})
    for stack in stacks:
      name = stack.name
      buffers = (
        inputs.lhs_row_pointers[name],
        inputs.lhs_embedding_ids[name],
        inputs.lhs_sample_ids[name],
        inputs.lhs_gains[name],
      )
      parts = local_resolve(
        stack,
        topo,
        maps[name],
        tables[name] if train else None,
        slots[name] if train else (),
        buffers,
        inputs.hashed_ids[name],
        step,
        train,
        plan_lib.hashed_places(plan, stack),
        inputs.num_minibatches,
      )
      for o, part in zip(out, parts, strict=True):
        o[name] = part
      if inputs.sample_order is not None:
        out[4][name] = resolved_order(
          stack, topo, inputs.sample_order[name], out[4][name]
        )
    orders = out[4] if inputs.sample_order is not None else {}
    if not train:
      return out[0], out[3], orders
    return out[:4] + (orders,)

  axis = P(topo.axis)
  map_spec = StackMap(axis, axis, axis, P())
  names = [stack.name for stack in stacks]
  in_specs = (
    {k: map_spec for k in names},
    {k: axis for k in tables},
    {k: tuple(axis for _ in v) for k, v in slots.items()},
    jax.tree.map(lambda _: axis, inputs),
    P(),
  )
  out_specs = (
    {k: map_spec for k in names},
    *((in_specs[1], in_specs[2]) if train else ()),
    {k: axis for k in names},
    {k: axis for k in names} if inputs.sample_order is not None else {},
  )
  out = jax.shard_map(
    body,
    mesh=topo.mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    check_vma=False,
  )(maps, tables, slots, inputs, step)
  new_maps, new_ids, orders = out[0], out[-2], out[-1]
  resolved = dataclasses.replace(
    inputs,
    lhs_embedding_ids={**inputs.lhs_embedding_ids, **new_ids},
    hashed_ids=None,
    # Its pairs name rows now, as the buffers do.
    sample_order=None
    if inputs.sample_order is None
    else {**inputs.sample_order, **orders},
  )
  if train:
    return new_maps, out[1], out[2], resolved
  return new_maps, tables, slots, resolved


def resolve(
  plan: Plan,
  topology: Topology,
  maps: dict[str, StackMap],
  tables: dict[str, jax.Array],
  slots: dict[str, tuple[jax.Array, ...]],
  inputs: PreprocessedInput,
  step: jax.Array | int,
  *,
  train: bool,
) -> tuple[Any, Any, Any, PreprocessedInput]:
  """Every hashed stack's ids resolved to rows on their owners.

  In training (`train`), unseen ids are inserted (evicting by policy) and
  their rows and optimizer slots reset; in inference, unseen ids read a
  zero row and are counted. Donate `maps`, `tables` and `slots` (they are
  updated in place; the caller keeps the results).

  Args:
    plan: The plan of the layer's specs on the topology.
    topology: Mesh, sharding axis, SparseCores per device.
    maps: Hashed stack name -> its `StackMap`.
    tables: Hashed stack name -> its table `[N, C, D]`.
    slots: Hashed stack name -> its optimizer slots.
    inputs: Buffers from `preprocess` (with `hashed_ids`).
    step: The training step.
    train: Insert (training) or only look up (inference).

  Returns:
    `(maps, tables, slots, inputs)`: the inputs' hashed stacks' ids are
    rows and they carry no `hashed_ids` (other stacks as they were).
  """
  return _resolve(
    (plan, topology),
    bool(train),
    maps,
    tables,
    slots,
    inputs,
    jnp.asarray(step, jnp.int32),
  )
