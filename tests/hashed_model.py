"""A plain-Python model of one shard's map of a hashed table.

It follows the rules of the module docstring of `pz_sparsecore.core.hashed`
literally, with Python loops and Python ints: ids as unsigned 64-bit
integers, windows as lists of slots, victims as the minimum of a tuple
`(score..., position in the window)`. It is slow and only used by the tests,
as the oracle for `pz_sparsecore.device.hashed.resolve_shard` (which must
match it bit for bit). It does not validate its inputs; give it valid ones,
with training steps that never go backwards.
"""

from __future__ import annotations

import numpy as np

from pz_sparsecore.core import hashed

INT32_MAX = 2**31 - 1
WORD = 0xFFFFFFFF

HELD, INSERTED, EVICTED, REFUSED, UNSEEN = range(len(hashed.COUNTERS))


def unsigned_key(lo: int, hi: int) -> int:
  """The id of int32 words `lo`, `hi` as an unsigned 64-bit Python int."""
  return (int(hi) & WORD) << 32 | (int(lo) & WORD)


def decayed(count: int, last: int, step: int, decay_steps: int | None) -> int:
  """`count` halved once per `decay_steps` steps since `last` (None: never)."""
  if not decay_steps:
    return count
  return count >> ((step - last) // decay_steps)


def shard_input(
  ids: np.ndarray, capacity: int, absent: np.ndarray | None = None
) -> np.ndarray:
  """The int32 `[n, 3]` input of a shard of `capacity` rows for int64 ids.

  Args:
    ids: int64 `[n]` raw ids.
    capacity: The shard's rows.
    absent: bool `[n]`, or None: entries that carry no id (home -1; their
      words are still those of `ids`).

  Returns:
    Low word, high word and home of each id.
  """
  ids = np.asarray(ids, np.int64)
  lo, hi = hashed.key_words(ids)
  home = hashed.homes(ids, capacity)
  if absent is not None:
    home = np.where(absent, -1, home)
  return np.stack([lo, hi, home], 1).astype(np.int32)


class ShardModel:
  """One shard's map: `ids` int32 `[C, 2]` (low, high word) and `seen`
  int32 `[C, 2]` (last step, `hashed.EMPTY` if free; count).

  Attributes:
    ids: The id of each slot.
    seen: Each slot's last step and count.
  """

  def __init__(
    self,
    capacity: int,
    ids: np.ndarray | None = None,
    seen: np.ndarray | None = None,
  ):
    self.capacity = capacity
    if ids is None:
      ids = np.zeros((capacity, 2), np.int32)
    if seen is None:
      seen = np.zeros((capacity, 2), np.int32)
      seen[:, 0] = hashed.EMPTY
    self.ids = np.array(ids, np.int32)
    self.seen = np.array(seen, np.int32)

  def window(self, home: int) -> list[int]:
    """The slots of the window starting at `home`, in window order."""
    w = hashed.window(self.capacity)
    return [(home + i) % self.capacity for i in range(w)]

  def _holder(self, slot: int) -> int | None:
    """The unsigned id a slot holds, None if free."""
    if int(self.seen[slot, 0]) == hashed.EMPTY:
      return None
    return unsigned_key(self.ids[slot, 0], self.ids[slot, 1])

  def _find(self, key: int, home: int) -> int | None:
    """The slot of `key` in its window, None if absent."""
    found = [s for s in self.window(home) if self._holder(s) == key]
    if len(found) > 1:
      raise AssertionError(f"id {key:#x} held by slots {found}")
    return found[0] if found else None

  def _victim(
    self, home: int, step: int, eviction: hashed.Eviction
  ) -> tuple[int | None, bool]:
    """A miss's slot: `(slot or None, evicts)`."""
    window = self.window(home)
    for slot in window:
      if int(self.seen[slot, 0]) == hashed.EMPTY:
        return slot, False
    if eviction.policy == "none":
      return None, False
    candidates = []
    for position, slot in enumerate(window):
      last, count = int(self.seen[slot, 0]), int(self.seen[slot, 1])
      if last >= step:
        continue  # seen in this step
      if eviction.policy == "ttl" and step - last <= eviction.ttl_steps:
        continue  # not expired
      if eviction.policy == "lfu":
        score = (decayed(count, last, step, eviction.decay_steps), last)
      else:
        score = (last,)
      candidates.append((score, position, slot))
    if not candidates:
      return None, False
    return min(candidates)[2], True

  def call(
    self,
    ids: np.ndarray,
    step: int,
    eviction: hashed.Eviction,
    train: bool,
  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One call of the map; updates `ids` and `seen` in training.

    Args:
      ids: int32 `[n, 3]`: low word, high word, home (-1: no id).
      step: The current step (training).
      eviction: The table's policy.
      train: Training (insert, evict) or inference (look up only).

    Returns:
      `(slots, reset, counts)`: int32 `[n]` slots (`hashed.REFUSED` for
      refused, unseen and absent entries), bool `[n]` the first occurrence
      in input order of each id given a slot by insertion, int32 `[5]` the
      changes of the counters `hashed.COUNTERS`.
    """
    ids = np.asarray(ids)
    n = ids.shape[0]
    step = int(step)
    distinct: dict[int, dict] = {}
    for i in range(n):
      lo, hi, home = (int(v) for v in ids[i])
      if home < 0:
        continue
      key = unsigned_key(lo, hi)
      if key not in distinct:
        distinct[key] = {"first": i, "lo": lo, "hi": hi, "home": home}
    counts = [0] * len(hashed.COUNTERS)
    slot_of: dict[int, int] = {}

    # Hits, against the map before the call.
    misses = []
    for key, entry in distinct.items():
      slot = self._find(key, entry["home"])
      if slot is None:
        misses.append(key)
      else:
        slot_of[key] = slot
    if not train:
      counts[UNSEEN] = len(misses)
    else:
      for slot in slot_of.values():
        last, count = int(self.seen[slot, 0]), int(self.seen[slot, 1])
        count = decayed(count, last, step, eviction.decay_steps)
        self.seen[slot] = (step, min(count + 1, INT32_MAX))

    # Misses, one after another in ascending unsigned order.
    inserted = set()
    if train:
      for key in sorted(misses):
        entry = distinct[key]
        slot, evicts = self._victim(entry["home"], step, eviction)
        if slot is None:
          counts[REFUSED] += 1
          continue
        counts[INSERTED] += 1
        counts[EVICTED if evicts else HELD] += 1
        self.ids[slot] = (entry["lo"], entry["hi"])
        self.seen[slot] = (step, 1)
        slot_of[key] = slot
        inserted.add(key)

    slots = np.full((n,), hashed.REFUSED, np.int32)
    reset = np.zeros((n,), bool)
    for i in range(n):
      lo, hi, home = (int(v) for v in ids[i])
      if home < 0:
        continue
      key = unsigned_key(lo, hi)
      slots[i] = slot_of.get(key, hashed.REFUSED)
      reset[i] = key in inserted and distinct[key]["first"] == i
    return slots, reset, np.array(counts, np.int32)
