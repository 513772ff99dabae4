"""The numba half of `hashed_ids` (private to it): places and key words.

`places` walks a hashed stack's raw ids once, one local SparseCore
segment per thread: it finds each distinct (partition, table, id) of the
segment in an open-addressing hash set and gives it the next place of its
(segment, partition) in order of first appearance; it writes each distinct
id's words into the key table as it goes. One pass, no sort: O(ids).
"""

from __future__ import annotations

import numba
import numpy as np

from pz_sparsecore.core.hashed import PROBE_SLOTS

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


@numba.njit(cache=True, nogil=True)
def _mix64(x: np.uint64) -> np.uint64:
  """`core.hashed.mix64` of one word."""
  z = x
  z = (z ^ (z >> np.uint64(30))) * _M1
  z = (z ^ (z >> np.uint64(27))) * _M2
  return z ^ (z >> np.uint64(31))


@numba.njit(cache=True, nogil=True)
def places(
  values: np.ndarray,
  row_splits: np.ndarray,
  first_row: np.ndarray,
  samples_per_sc: np.ndarray,
  member: np.ndarray,
  num_shards: int,
  member_rows: np.ndarray,
  keys: np.ndarray,
  place: np.ndarray,
) -> int:
  """Each id's place, and the key table; returns the most places any
  (segment, partition) needed.

  The local SparseCore segments are independent, each with its own hash
  set (small enough to stay in cache): segment `k` of feature `f` is its
  rows `[first_row[f] + k * samples_per_sc[f], ...)`, and its ids take
  places in order of first appearance, feature after feature.

  Args:
    values: int64 `[n]` raw ids, every feature's rows end to end.
    row_splits: int64 `[rows + 1]` over `values`.
    first_row: int64 `[F + 1]`, each feature's first row.
    samples_per_sc: int64 `[F]`, each feature's rows per segment.
    member: int64 `[F]`, each feature's table in the stack.
    num_shards: N.
    member_rows: int64, each table's rows per shard.
    keys: int32 `[segments, N, cap, 4]`, holding `[0, 0, -1, 0]`: written
      with (low word, high word, home, table) at each place below `cap`.
    place: int64 `[n]`, written: each id's place times N plus its
      partition (the id the preprocessor reads).
  """
  segments, cap = keys.shape[0], keys.shape[2]
  num_features, tables = len(member), len(member_rows)
  most = np.zeros(segments, np.int64)
  for k in range(segments):
    n = 0
    for f in range(num_features):
      a = first_row[f] + k * samples_per_sc[f]
      n += row_splits[a + samples_per_sc[f]] - row_splits[a]
    size = 1
    while size < 2 * n + 2:
      size *= 2
    mask = np.uint64(size - 1)
    slot_value = np.empty(size, np.int64)
    slot_group = np.full(size, -1, np.int64)
    slot_place = np.empty(size, np.int64)
    counts = np.zeros(num_shards, np.int64)
    for f in range(num_features):
      a = first_row[f] + k * samples_per_sc[f]
      t = member[f]
      rows = np.uint64(member_rows[t])
      for i in range(row_splits[a], row_splits[a + samples_per_sc[f]]):
        word = np.uint64(values[i])
        h = _mix64(word)
        owner = np.int64(h % np.uint64(num_shards))
        group = owner * tables + t
        probe = _mix64(h ^ np.uint64(group)) & mask
        while True:
          g = slot_group[probe]
          if g == -1:
            r = counts[owner]
            counts[owner] = r + 1
            slot_group[probe] = group
            slot_value[probe] = values[i]
            slot_place[probe] = r
            if r < cap:
              keys[k, owner, r, 0] = np.int32(np.int64(word & 0xFFFFFFFF))
              keys[k, owner, r, 1] = np.int32(np.int64(word >> 32))
              keys[k, owner, r, 2] = np.int64((h >> np.uint64(32)) % rows)
              keys[k, owner, r, 3] = t
            break
          if g == group and slot_value[probe] == values[i]:
            r = slot_place[probe]
            break
          probe = (probe + np.uint64(1)) & mask
        place[i] = r * num_shards + owner
    most[k] = counts.max() if num_shards else 0
  return most.max() if segments else 0


@numba.njit(cache=True, nogil=True)
def rehome(
  owner: np.ndarray,
  home: np.ndarray,
  member: np.ndarray,
  region_first: np.ndarray,
  region_rows: np.ndarray,
  free: np.ndarray,
) -> np.ndarray:
  """Slots for held ids on new shards, in the given order: each takes the
  first free slot of its window (`core.hashed`); -1 if none is free.

  Args:
    owner, home, member: int64 `[n]`: each id's new shard, home in its
      table's region, and table.
    region_first, region_rows: int64, each table's region in a shard.
    free: bool `[N, C]`, every slot free; written as slots are taken.

  Returns:
    int64 `[n]`: each id's slot in its shard (-1: dropped).
  """
  out = np.full(len(owner), -1, np.int64)
  for i in range(len(owner)):
    first, rows = region_first[member[i]], region_rows[member[i]]
    for j in range(min(rows, PROBE_SLOTS)):
      slot = first + (home[i] + j) % rows
      if free[owner[i], slot]:
        free[owner[i], slot] = False
        out[i] = slot
        break
  return out
