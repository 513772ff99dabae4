"""Hashed stacks restored onto another number of shards.

A hashed table's rows belong to the ids its map holds, not to positions
(`core.hashed`): on another number of shards each id has another owner and
another window. A restore onto another topology therefore re-sends every
held id to its new owner: the stored map is read to the host; each stored
row is found where the relayout (`_ckpt_layout.relayout`, which moves rows
as a range table's) put it; the ids take slots on their new owners in
ascending (table, id) order, each the first free slot of its window; and
the rows and optimizer slots move there on the devices, bit for bit. An id
whose window on its new owner is full, or whose stored row lies beyond the
new table's padded rows, is dropped and counted as evicted. The ids keep
their last step and count; the counters' totals move to shard 0 (each
shard's `held` is its own).

Only the number of shards (devices x SparseCores) may differ: the same
tables stacked alike, each with the same capacity.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_sparsecore.core import hashed, layout
from pz_sparsecore.host import _hashed_numba
from pz_sparsecore.nn._ckpt_layout import StackLayout, stack_layout
from pz_sparsecore.nn.embed import MAP_PARTS, find_embeds
from pz_sparsecore.nn.tables import (
  ROW_AXIS,
  SHARD_AXIS,
  last_axis,
  positional_table,
)

MOVED_PARTS = ("ids", "seen", "counters")
"""The map parts shaped by the shards (the seed is not)."""


def moved(stored: Mapping[str, Any], target: Mapping[str, Any]) -> set[str]:
  """Labels of map parts saved for another number of shards than the
  target's (`stored`, `target`: the manifests' `"variables"`)."""
  out = set()
  for label, entry in target.items():
    _, _, part = label.rpartition(".")
    kept = stored.get(label)
    if part.removeprefix("map_") not in MOVED_PARTS or kept is None:
      continue
    if kept["leaf"] and entry["leaf"]:
      if kept["leaf"]["shape"][0] != entry["leaf"]["shape"][0]:
        out.add(label)
  return out


def rehome(
  model: Any, stored: Mapping[str, Any], values: dict[str, Any]
) -> dict[str, Any]:
  """`values` (label -> restored value) with every hashed stack whose map
  was saved for another number of shards moved onto the model's."""
  values = dict(values)
  for embed in find_embeds(model):
    config = embed.config
    layer = stored["embeds"][config.name]
    for stack in config.plan.stacks:
      if not stack.is_hashed:
        continue
      labels = {p: config.map_label(stack.name, p) for p in MAP_PARTS}
      if values[labels["ids"]].shape[0] == config.topology.num_shards:
        continue
      old = StackLayout.from_json(layer[stack.name]["layout"])
      _rehome_stack(embed, stack, old, labels, values)
  return values


def held_slots(
  stack: Any, num_shards: int, member: np.ndarray, raw: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """Where held ids go on `num_shards` shards of a hashed stack: each id's
  owner and slot, the ids taking, in ascending order of table (`member`)
  then id as an unsigned word, the first free slot of their windows
  (`core.hashed`; slot -1: none free). A restore onto another shard count
  and a serving load place the ids so."""
  n = num_shards
  regions = stack.regions(n)
  first = np.array([f for f, _ in regions], np.int64)
  rows = np.array([r for _, r in regions], np.int64)
  owner = hashed.owners(raw, n)
  home = np.empty(len(raw), np.int64)
  for i, r in enumerate(rows):
    home[member == i] = hashed.homes(raw[member == i], int(r))
  order = np.lexsort((raw.view(np.uint64), member))
  free = np.ones((n, stack.rows_per_shard), bool)
  slot = np.full(len(raw), -1, np.int64)
  slot[order] = _hashed_numba.rehome(
    owner[order], home[order], member[order], first, rows, free
  )
  return owner, slot


def _held(old: StackLayout, ids, seen):
  """Every held id of the stored map: its table, words, last step, count,
  and its logical row in its table (where the relayout moved its row)."""
  n = old.num_shards
  shard, slot = np.nonzero(seen[..., 0] != hashed.EMPTY)
  member = np.zeros(len(slot), np.int64)
  for i, t in enumerate(old.tables):
    rows = t.padded_vocab // n
    member[
      (slot >= t.row_offset_in_shard) & (slot < t.row_offset_in_shard + rows)
    ] = i
  first = np.array([t.row_offset_in_shard for t in old.tables])[member]
  rotation = np.array([t.shard_rotation for t in old.tables])[member]
  logical = layout.logical_row_ids(n, rotation, first, shard, slot)
  return member, ids[shard, slot], seen[shard, slot], logical


def _rehome_stack(embed, stack, old: StackLayout, labels, values) -> None:
  config = embed.config
  topo = config.topology
  n = topo.num_shards
  new = stack_layout(config.plan, stack)
  ids = np.asarray(values[labels["ids"]])
  seen = np.asarray(values[labels["seen"]])
  counters = np.asarray(values[labels["counters"]]).astype(np.int64)
  member, words, kept, logical = _held(old, ids, seen)
  raw = hashed.ids_of_words(words[:, 0], words[:, 1])
  owner, slot = held_slots(stack, n, member, raw)
  padded = np.array([t.padded_vocab for t in new.tables])[member]
  slot[logical >= padded] = -1
  keep = slot >= 0
  # Where the relayout put each stored row, and where it goes now.
  rotation = np.array([t.shard_rotation for t in new.tables])[member]
  offset = np.array([t.row_offset_in_shard for t in new.tables])[member]
  source = ((logical + rotation) % n) * new.rows_per_shard + (
    logical // n + offset
  )
  target = owner * new.rows_per_shard + slot
  source, target = source[keep], target[keep]
  table_label = config.table_label(stack.name)
  slot_labels = [
    config.slot_label(stack.name, s) for s in stack.optimizer.slot_names()
  ]
  for label in (table_label, *slot_labels):
    values[label] = _moved(config, values[label], source, target)
  new_ids = np.zeros((n, stack.rows_per_shard, 2), np.int32)
  new_seen = np.zeros((n, stack.rows_per_shard, 2), np.int32)
  new_seen[..., 0] = hashed.EMPTY
  new_ids[owner[keep], slot[keep]] = words[keep]
  new_seen[owner[keep], slot[keep]] = kept[keep]
  new_counters = np.zeros((n, len(hashed.COUNTERS)), np.int64)
  new_counters[0, 1:] = counters[:, 1:].sum(0)
  new_counters[0, 2] += int((~keep).sum())
  np.add.at(new_counters[:, 0], owner[keep], 1)
  new_counters = np.minimum(new_counters, 2**31 - 1).astype(np.int32)
  for part, array in (
    ("ids", new_ids),
    ("seen", new_seen),
    ("counters", new_counters),
  ):
    values[labels[part]] = jax.device_put(array, topo.sharding(array.ndim))


def _moved(config, value, source: np.ndarray, target: np.ndarray):
  """A relaid-out table (or slot) with rows `source` moved to `target`
  (flat rows of `[N * V_shard]`) and every other row zero."""
  array = positional_table(config, value)
  names = (SHARD_AXIS, ROW_AXIS, last_axis(config, value))
  shape = array.shape

  def move(a):
    flat = a.reshape(-1, shape[-1])
    out = jnp.zeros_like(flat).at[target].set(flat[source])
    return out.reshape(shape)

  return pz.nx.wrap(jax.jit(move, out_shardings=array.sharding)(array)).tag(
    *names
  )
