"""Delta checkpoints: the rows touched since the previous save.

A delta is a checkpoint like any other (`checkpoint.py`: one numbered
folder, an `arrays` item with a CRC-32C per chunk, a sealed manifest,
written and agreed on by the same code), except that each stack's table
and slots hold only the rows the trainer's steps touched since the previous
save (`_touched.py` tracks them). Dense variables and the trainer's state
are whole, as in a full checkpoint. Its manifest differs in two places::

  "delta": {"base": 100, "parent": 150},   # the chain's full checkpoint,
                                           # and the save before this one
  "embeds": {"emb": {"words": {"layout": {...},   # as saved
      "arrays": {"embeddings": "a0", "accumulator": "a1"},  # [K, W] rows
      "rows": "a5", ...}}}                 # [K] int64: shard * V_shard + row

The rows are addressed physically, `shard * V_shard + row` in the saved
layout, which the manifest records, so they map onto any layout: row `r`
of shard `s` in a table at row offset `o` with rotation `q` over `N` shards
is logical id `(r - o) * N + (s - q) % N` (`_ckpt_layout` has the
example), which another layout puts on shard `(id % N' + q') % N'`, row
`o' + id // N'`.

Saving. `parent_of_save` decides: with `delta=True` the save is a delta
onto the newest checkpoint of the directory, which must be the one the
trainer's bitmaps count from (its last save or restore there), else the
save is refused; with `full_every=K` it is a delta when it can be one and
its chain holds fewer than K checkpoints, else full. `described` swaps
each stack's arrays for its touched rows (`_touched.touched_rows`);
`saved` clears the bitmaps once the checkpoint is complete.

Restoring. `Chain.follow` follows the parents from the delta asked for
back to its full checkpoint, reading and verifying each manifest on the way
(a missing link or a damaged manifest is refused by name); `Chain.read`
checks every delta's manifest against the target as a full one is checked
and reads every delta's arrays (checksummed, each error naming the delta's
folder and file) before the full checkpoint is read; nothing is assigned
until all are read. `Chain.apply` then writes the deltas' rows over the full
checkpoint's tables and slots in step order, by logical id, on device
(each device its own shards, O(rows)), and takes the dense variables and
trainer leaves from the newest delta.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from pz_sparsecore.nn import _touched
from pz_sparsecore.nn._ckpt_layout import StackLayout, stack_layout
from pz_sparsecore.nn._ckpt_manifest import TABLE, Description, check
from pz_sparsecore.nn._ckpt_reads import Reads
from pz_sparsecore.nn._ckpt_steps import DELTA, chain
from pz_sparsecore.nn.embed import find_embeds
from pz_sparsecore.nn.tables import named_table, positional_table, slot_axis
from pz_sparsecore.nn.training import SparseCoreTrainer

ROWS = "rows"
"""The key of a delta stack's row addresses among its manifest entry's."""


# ---------------------------------------------------------------------------
# Saving.


def check_options(delta: Any, full_every: Any) -> None:
  """Raises unless `delta` is a bool and `full_every` None or an int >= 1,
  not both asked for."""
  if not isinstance(delta, bool):
    raise ValueError(f"delta must be True or False, got {delta!r}")
  if full_every is None:
    return
  if (
    isinstance(full_every, bool)
    or not isinstance(full_every, int)
    or full_every < 1
  ):
    raise ValueError(
      f"full_every must be None or an int >= 1, got {full_every!r}"
    )
  if delta:
    raise ValueError(
      "give delta=True or full_every=, not both (full_every= chooses)"
    )


def _touched_of(target: Any, option: str) -> _touched.Touched:
  if not isinstance(target, SparseCoreTrainer):
    raise ValueError(
      f"{option}: delta checkpoints need a SparseCoreTrainer built with "
      "track_touched=True (it tracks the rows its steps touch); a model's "
      "own steps are not tracked: save a full checkpoint (delta=False)"
    )
  if target.touched is None:
    raise ValueError(
      f"{option}: the trainer does not track the rows its steps touch: "
      "build it with SparseCoreTrainer.build(..., track_touched=True), or "
      "save a full checkpoint (delta=False)"
    )
  return target.touched


def _newest(directory: str) -> int | None:
  """The newest numbered folder of `directory`."""
  if not os.path.isdir(directory):
    return None
  numbered = [n for n in os.listdir(directory) if n.isdigit()]
  return max(map(int, numbered), default=None)


def parent_of_save(
  directory: str, target: Any, delta: bool, full_every: int | None
) -> int | None:
  """The step a save chains onto; None for a full save.

  Raises:
    ValueError: If `delta=True` and the save cannot be a delta (naming
      why); with `full_every=`, if the target does not track its rows.
  """
  if not delta and full_every is None:
    return None
  option = "delta=True" if delta else f"full_every={full_every}"
  touched = _touched_of(target, option)
  newest = _newest(directory)
  tracked = newest is not None and touched.since == (directory, newest)
  if full_every is not None:
    if not tracked or len(chain(directory, newest)) >= full_every:
      return None
    return newest
  if newest is None:
    raise ValueError(
      f"delta=True: {directory} holds no checkpoint for a delta to chain "
      "onto; save a full checkpoint first"
    )
  if not tracked:
    since = "since it was built"
    if touched.since is not None:
      since = f"since step {touched.since[1]} in {touched.since[0]}"
    raise ValueError(
      f"delta=True: the newest checkpoint of {directory} is step {newest}, "
      f"but the trainer tracks the rows touched {since}; save a full "
      "checkpoint (delta=False)"
    )
  return newest


def described(
  description: Description,
  target: SparseCoreTrainer,
  directory: str,
  parent: int,
) -> Description:
  """The description of a delta of `target` onto checkpoint `parent` of
  `directory`: each stack's arrays replaced by its touched rows and their
  addresses."""
  touched = target.touched.bitmaps
  for embed in find_embeds(target.model):
    config = embed.config
    entries = description.manifest["embeds"][config.name]
    for stack in config.plan.stacks:
      entry = entries[stack.name]
      label = config.table_label(stack.name)
      keys = list(entry["arrays"].values())
      rows, values = _touched.touched_rows(
        touched[label], [description.values[key] for key in keys]
      )
      description.values.update(zip(keys, values, strict=True))
      entry[ROWS] = description.add(rows, f"{label} (touched rows)")
  base = chain(directory, parent)[0]
  description.manifest[DELTA] = {"base": base, "parent": parent}
  return description


def saved(target: Any, directory: str, step: int) -> None:
  """After a complete save (full or delta): a tracking trainer's bitmaps
  count from it."""
  if isinstance(target, SparseCoreTrainer) and target.touched is not None:
    target.touched.clear(target.model, directory, step)


# ---------------------------------------------------------------------------
# Restoring.


def _host_args(manifest: Mapping[str, Any]) -> dict[str, Any]:
  """Every stack's rows and their addresses, read to the host."""
  args = {}
  for stacks in manifest["embeds"].values():
    for entry in stacks.values():
      for key in (entry[ROWS], *entry["arrays"].values()):
        args[key] = ocp.RestoreArgs(restore_type=np.ndarray)
  return args


def _stack_labels(config: Any) -> list[tuple[str, str | None]]:
  """(label, last axis) of every stack's table and slots of a layer."""
  out = []
  for stack in config.plan.stacks:
    out.append((config.table_label(stack.name), None))
    for slot in stack.optimizer.definition.slots:
      out.append(
        (config.slot_label(stack.name, slot.name), slot_axis(config, slot))
      )
  return out


@dataclasses.dataclass
class _Delta:
  """One delta read: its folder, manifest and arrays."""

  path: str
  manifest: dict[str, Any]
  arrays: dict[str, Any]


@dataclasses.dataclass
class Chain:
  """A delta's chain, read: its full checkpoint's folder and manifest (to
  be read by the caller), the deltas in step order, and the newest delta's
  dense variables and trainer leaves.

  A full checkpoint is a chain without deltas (`deltas` empty).
  """

  path: str
  manifest: dict[str, Any]
  deltas: list[_Delta]
  leaves: Reads | None

  @classmethod
  def follow(
    cls,
    directory: str,
    path: str,
    manifest: dict[str, Any],
    read_manifest: Callable[[str], dict[str, Any]],
  ) -> Chain:
    """Follows the parents of checkpoint `path` to its full checkpoint.

    Args:
      directory: The checkpoint directory.
      path: The checkpoint to restore.
      manifest: Its manifest (verified).
      read_manifest: Reads and verifies the manifest of a checkpoint.

    Raises:
      FileNotFoundError: If a checkpoint of the chain is missing.
      ValueError: If a manifest is damaged (naming its folder).
    """
    found = []
    while DELTA in manifest:
      found.append(_Delta(path, manifest, {}))
      step = manifest[DELTA]["parent"]
      parent = os.path.join(directory, str(step))
      if not os.path.isdir(parent):
        raise FileNotFoundError(
          f"{path}: this delta checkpoint chains onto step {step}, whose "
          f"folder {parent} is missing; restore_checkpoint(..., step="
          f"{manifest[DELTA]['base']}) restores its full checkpoint if "
          "it is there"
        )
      path, manifest = parent, read_manifest(parent)
    return cls(path, manifest, found[::-1], None)

  def read(
    self,
    read_arrays: Callable[[str, Mapping[str, Any], dict[str, Any]], Any],
    description: Description,
    cast_tables: bool,
  ) -> None:
    """Checks every delta against the target and reads its arrays.

    Args:
      read_arrays: `(path, manifest, restore args) -> arrays`, raising
        errors that name the checkpoint and the file.
      description: The target's description.
      cast_tables: As `restore_checkpoint`'s.

    Raises:
      FileNotFoundError: If a delta's data file is missing.
      ValueError: If a delta is damaged or does not match the target
        (naming its folder).
    """
    for delta in self.deltas:
      try:
        check(delta.manifest, description.manifest, cast_tables)
      except ValueError as e:
        raise ValueError(f"{delta.path}: {e}") from None
      args = _host_args(delta.manifest)
      if delta is self.deltas[-1]:  # The newest: its dense values too.
        self.leaves = Reads.plan_leaves(delta.manifest, description)
        args.update(self.leaves.args)
      delta.arrays = read_arrays(delta.path, delta.manifest, args)

  @property
  def newest(self) -> dict[str, Any]:
    """The manifest of the checkpoint asked for."""
    return self.deltas[-1].manifest if self.deltas else self.manifest

  def updates(self, model: Any) -> dict[str, tuple[str, np.ndarray, Any]]:
    """Per table or slot label of `model` that the deltas change: its
    stack, and the flat rows (in the model's layout of the stack) and
    their newest values."""
    out = {}
    if not self.deltas:
      return out
    for embed in find_embeds(model):
      config = embed.config
      for stack in config.plan.stacks:
        target = stack_layout(config.plan, stack)
        arrays = {TABLE: (config.table_label(stack.name), None)}
        for slot in stack.optimizer.definition.slots:
          arrays[slot.name] = (config.slot_label(stack.name, slot.name), slot)
        for name, (label, slot) in arrays.items():
          layout = target
          if slot is not None:
            layout = target.with_width(slot.width(target.dim))
          rows, data = self._rows(config.name, name, slot, layout)
          if rows is not None:
            out[label] = (stack.name, rows, data)
    return out

  def apply(
    self,
    model: Any,
    values: dict[str, Any],
    trainer_leaves: list[Any] | None,
    updates: Mapping[str, tuple[str, np.ndarray, Any]],
  ) -> tuple[dict[str, Any], list[Any] | None]:
    """The full checkpoint's values (by label) and trainer leaves with the
    deltas written over them: `updates` (of `updates`, less those already
    written while reading) on the devices, the newest delta's dense values
    and trainer leaves."""
    if not self.deltas:
      return values, trainer_leaves
    values = dict(values)
    for embed in find_embeds(model):
      config = embed.config
      for label, axis in _stack_labels(config):
        if label not in updates:
          continue
        stack, rows, data = updates[label]
        table = positional_table(config, values[label])
        values[label] = named_table(
          config, _put(config.topology, stack, table, rows, data), axis
        )
    values.update(self.leaves.values(self.deltas[-1].arrays))
    if trainer_leaves is not None:
      trainer_leaves = self.leaves.trainer_leaves(self.deltas[-1].arrays)
    return values, trainer_leaves

  def _rows(
    self, layer: str, name: str, slot: Any, target: StackLayout
  ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The flat rows in `target`'s layout and their values of array `name`
    (the table or a slot) of every delta; of a row in several, the
    newest's."""
    rows, data = [], []
    for delta in self.deltas:
      for entry in delta.manifest["embeds"][layer].values():
        if name not in entry["arrays"]:  # Holds none of target's tables.
          continue
        layout = StackLayout.from_json(entry["layout"])
        if slot is not None:
          layout = layout.with_width(slot.width(layout.dim))
        moved = _moved(
          layout,
          target,
          delta.arrays[entry[ROWS]],
          delta.arrays[entry["arrays"][name]],
        )
        if moved is not None:
          rows.append(moved[0])
          data.append(moved[1])
    if not rows:
      return None, None
    rows, data = np.concatenate(rows), np.concatenate(data)
    # The newest value of each row: the last of its occurrences.
    _, last = np.unique(rows[::-1], return_index=True)
    keep = np.sort(len(rows) - 1 - last)
    return rows[keep], data[keep]


def _moved(
  stored: StackLayout, target: StackLayout, rows: np.ndarray, data: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
  """A stored stack's rows (flat, in its layout) that belong to `target`'s
  tables, as flat rows of `target` and their values (None if none)."""
  if stored == target:
    return rows, data
  shard, row = np.divmod(rows, stored.rows_per_shard)
  n, nn = stored.num_shards, target.num_shards
  places = {t.name: t for t in target.tables}
  out_rows, out_data = [], []
  for t in stored.tables:
    new = places.get(t.name)
    if new is None:
      continue
    local = row - t.row_offset_in_shard
    inside = (local >= 0) & (local < t.padded_vocab // n)
    ids = local * n + (shard - t.shard_rotation) % n
    inside &= ids < t.vocab
    ids = ids[inside]
    moved = ((ids % nn + new.shard_rotation) % nn) * target.rows_per_shard
    out_rows.append(moved + new.row_offset_in_shard + ids // nn)
    values = np.zeros((ids.size, target.dim), data.dtype)
    values[:, : new.dim] = data[inside, : new.dim]
    out_data.append(values)
  if not out_rows:
    return None
  return np.concatenate(out_rows), np.concatenate(out_data)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _put_impl(topology, stack, table, rows, data):
  spec = topology.table_spec(stack)

  def body(table, rows, data):
    local, per_shard = table.shape[0], table.shape[1]
    shard, row = rows // per_shard, rows % per_shard
    if not topology.is_replicated(stack):
      shard = shard - jax.lax.axis_index(topology.axis) * local
    # Other devices' rows fall outside and are dropped.
    shard = jax.numpy.where((shard >= 0) & (shard < local), shard, local)
    return table.at[shard, row].set(data.astype(table.dtype), mode="drop")

  return jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(spec, jax.sharding.PartitionSpec(), jax.sharding.PartitionSpec()),
    out_specs=spec,
    check_vma=False,
  )(table, rows, data)


def _put(
  topology: Any, stack: str, table: jax.Array, rows: np.ndarray, data: Any
) -> jax.Array:
  """`table` (`[N, V_shard, W]`, donated) with flat `rows` set to `data`;
  each device writes its own shards' rows."""
  return _put_impl(topology, stack, table, rows.astype(np.int32), data)
