"""Checkpoints of models and trainers with `SparseCoreEmbed` layers.

`save_checkpoint(directory, target)` stores a Penzai model, or a whole
`SparseCoreTrainer` (model, step, optax state, loss-function state and root
key); `restore_checkpoint(directory, target)` reads the newest checkpoint
(or that of `step=`) back into a model or trainer built the same way, on
any topology; `list_checkpoints(directory)` lists them.

Format. Checkpoints are written with orbax-checkpoint. `directory` holds one
sub-directory per save, named by its training step (`_ckpt_steps.py` says
how a step is chosen, which folders count and what `keep` deletes); each
holds up to three orbax items: `tables`, every stack's table and slots as
the devices hold them (`[N, V_shard, D]`, MOD-sharded; a delta's: the
touched rows and their addresses), as zarr v2 arrays written and read a
chunk at a time (`_ckpt_tables.py`); `arrays`, the other arrays (dense
variables by label, a trainer's state leaf by leaf), a flat dict in orbax's
OCDBT/TensorStore format; and `manifest`
(JSON, described in `_ckpt_manifest.py`), which says what every array is,
holds each stack's layout and the CRC-32 of every stored chunk, checked on
every restore before anything is assigned (`_ckpt_integrity.py`).

Writes are parallel and per process: every process writes the shards its
devices hold (chunk files of `tables`, orbax's `ocdbt.process_<i>` files of
`arrays`), nothing is gathered to one host, and the directory must be on a
file system every process sees. A save holds a few chunks of a table beside
it and a restore the table once (a 100M x 64 bfloat16 table saves and
restores on a 24 GiB machine). `max_host_bytes` caps the bytes a process
holds in flight between storage and memory (a table's chunk, and one device
shard of any other array, must fit under it). The processes agree on the
checkpoint they restore and the step they save, and a failure on one
reaches all within a second as an exception (`_ckpt_agree.py`).

Atomicity. A save writes into `<n>.orbax-checkpoint-tmp`, syncs every file
and directory, renames it to `<n>` and syncs `directory`; only then are
the checkpoints beyond the newest `keep` deleted. The newest complete
directory named by a bare number is the checkpoint: a crash at any point
leaves the previous one (or the new one, if the rename happened)
restorable, and the next save removes the temporary directories of
interrupted saves.

Restore onto another topology. The manifest records each stack's layout; a
stack whose layout equals the model's is read straight into its shards, any
other is read sharded over the model's mesh and its rows are moved on device
(`_ckpt_layout.relayout`), so a checkpoint from 8 devices x 1 SparseCore
restores onto 4 x 2, 1 x 1 or another stacking of the same tables with
identical values.

Deltas. A `SparseCoreTrainer` built with `track_touched=True` tracks the
rows its steps touch (`_touched.py`); `save_checkpoint(..., delta=True)`
(or `full_every=K`: a full checkpoint every K saves, deltas between)
writes a checkpoint of those rows and their slots only, with everything
else whole, that chains onto the previous save. A restore of a delta reads
its chain's full checkpoint and writes the deltas' rows over it in order,
by logical row, on any topology (`_ckpt_delta.py`). `keep` keeps every
checkpoint that a kept delta's chain needs; `list_checkpoints` gives each
delta's full checkpoint (`CheckpointInfo.base`).

Limits. Each stack's preprocessing limits in force
(`max_ids_per_partition`, `max_unique_ids_per_partition`,
`suggested_coo_buffer_size_per_device`, e.g. set by `update_limits` from
FDO) are saved with the topology and features they were set for. By
default a restore gives a stack the saved limits wherever they hold (the
same devices x SparseCores, the same layout of the stack, the same features
and samples), so a resumed job preprocesses its next batch into the buffers
it had before the save without applying FDO again; any other stack keeps
the target's limits (`_ckpt_limits.py` says why there is no conversion).

Validation. The whole manifest is compared with the target before anything
is read or assigned: layer and table names, shapes, dtypes, optimizers and
slots, dense variables' labels, kinds, shapes, dtypes and axis names, and a
trainer's state. The first mismatch is a `ValueError` naming it, e.g.
`variable 'head.w': checkpoint shape (64, 8), model (32, 8)`, and the
target is unchanged.

Resuming training::

  trainer = pzsc.SparseCoreTrainer.build(key, model, optax.adam(1e-3), loss)
  ...  # k steps
  pzsc.save_checkpoint(ckpt_dir, trainer)

  # Later, perhaps on another topology:
  trainer = pzsc.SparseCoreTrainer.build(key, build_model(), optimizer, loss)
  trainer = pzsc.restore_checkpoint(ckpt_dir, trainer)  # step k, same key
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.path import atomicity
from penzai import pz

from pz_sparsecore.nn._ckpt_agree import (
  Operation,
  PeerError,
  local_only,
  synced,
)
from pz_sparsecore.nn._ckpt_delta import (
  Chain,
  check_options,
  described,
  parent_of_save,
  saved,
)
from pz_sparsecore.nn._ckpt_hashed import rehome
from pz_sparsecore.nn._ckpt_integrity import (
  block_shape,
  chunk_digests,
  merged,
  read_arrays,
  read_manifest,
  seal,
)
from pz_sparsecore.nn._ckpt_limits import check_mode, restore_limits
from pz_sparsecore.nn._ckpt_manifest import (
  SLOTS,
  Description,
  check,
  describe,
  restored_trainer,
)
from pz_sparsecore.nn._ckpt_reads import Reads
from pz_sparsecore.nn._ckpt_steps import (
  MANIFEST_ITEM,
  SAVED,
  CheckpointInfo,
  choose,
  list_checkpoints,
  remove_old,
  save_step,
  stamp,
)
from pz_sparsecore.nn._ckpt_tables import (
  ITEM as _TABLES,
)
from pz_sparsecore.nn._ckpt_tables import (
  TablesHandler,
  TablesSave,
  read_all,
  stored_keys,
)
from pz_sparsecore.nn.training import SparseCoreTrainer

__all__ = [
  "CheckpointInfo",
  "PeerError",
  "list_checkpoints",
  "restore_checkpoint",
  "save_checkpoint",
]

_ARRAYS = "arrays"
_MANIFEST = MANIFEST_ITEM
_CHUNK_BYTES = 32 * 2**20
"""Largest stored chunk: a read onto another topology rounds to chunks."""
_LOG = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# orbax: handlers, the durable rename, the newest committed step.


def _sync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _sync_tree(path: str) -> None:
  """Syncs every file and directory under `path`, children first."""
  for root, _, files in os.walk(path, topdown=False):
    for name in files:
      _sync(os.path.join(root, name))
    _sync(root)


class _DurableRename(atomicity.AtomicRenameTemporaryPath):
  """orbax's atomic rename, made durable.

  The temporary directory's files are synced before the rename and the
  parent directory after it, so a checkpoint under its final name has all
  its bytes on disk even across a power loss.
  """

  async def finalize(self) -> None:
    await asyncio.to_thread(_sync_tree, os.fspath(self.get()))
    await super().finalize()
    final = os.fspath(self.get_final())
    await asyncio.to_thread(_sync_tree, final)
    await asyncio.to_thread(_sync, os.path.dirname(final))


def _check_options(keep: int | None, max_host_bytes: int | None) -> None:
  for name, value in (("keep", keep), ("max_host_bytes", max_host_bytes)):
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be None or a positive int, got {value!r}")


def _handlers(
  max_host_bytes: int | None, op: Operation | None = None
) -> dict[str, Any]:
  """orbax's handlers of the two items; a save's (`op` given) end at a
  sync point of `op` once written (`_ckpt_agree`)."""
  # Uncompressed: trained float tables shrink by a tenth under zstd, and
  # compressing them doubles the time of a save.
  arrays = ocp.PyTreeCheckpointHandler(
    handler_impl=ocp.BasePyTreeCheckpointHandler(
      save_concurrent_bytes=max_host_bytes,
      restore_concurrent_bytes=max_host_bytes,
      use_compression=False,
      # zarr v2, its chunks' CRC-32s in the manifest (`_ckpt_integrity`).
      use_zarr3=False,
    )
  )
  handlers = {
    _ARRAYS: arrays,
    _TABLES: TablesHandler(_CHUNK_BYTES, max_host_bytes),
    _MANIFEST: ocp.JsonCheckpointHandler(),
  }
  if op is None:
    return handlers
  return {item: synced(h, op, item) for item, h in handlers.items()}


def _check_cap(
  description: Description, max_host_bytes: int | None, tables: list[str]
) -> None:
  """Raises if one device's piece of an array (one chunk of a stack's
  `tables`) does not fit under the cap."""
  if max_host_bytes is None:
    return
  for key, value in description.values.items():
    shape = np.shape(value)
    if key in tables:
      shape = block_shape(value, _CHUNK_BYTES, edges=True)
    elif isinstance(value, jax.Array):
      shape = value.sharding.shard_shape(value.shape)
    size = math.prod(shape) * np.dtype(value.dtype).itemsize
    if size >= max_host_bytes:
      raise ValueError(
        f"max_host_bytes {max_host_bytes} is too small for one device's "
        f"piece of {description.names[key]!r} ({size} bytes)"
      )


def _storable(value: Any) -> Any:
  """Global arrays stay on their devices (orbax writes each process's
  shards); anything else is one process's copy, stored from the host by
  process 0."""
  if isinstance(value, jax.Array) and value.committed:
    if jax.process_count() == 1 or not value.is_fully_addressable:
      return value
  return np.asarray(value)


# ---------------------------------------------------------------------------
# Saving.


def save_checkpoint(
  directory: str | os.PathLike,
  target: Any,
  *,
  step: int | None = None,
  keep: int | None = 1,
  max_host_bytes: int | None = None,
  delta: bool = False,
  full_every: int | None = None,
) -> str:
  """Saves a model or a `SparseCoreTrainer`; returns the checkpoint's path.

  With several processes every process calls it with the same arguments.

  The checkpoint's folder is named by its training step: a trainer's own
  step; for a model, `step`, else the step after the newest folder in
  `directory` (0 in an empty one). The step must be greater than every
  checkpoint's there: an existing checkpoint is never replaced. Once the
  new checkpoint is complete, the complete checkpoints beyond the newest
  `keep` are deleted (`_ckpt_steps.py` says which folders count), but
  never a checkpoint that a kept delta's chain needs.

  Deltas. A trainer built with `track_touched=True` can save a *delta*:
  the table rows (and their slots) its steps touched since its previous
  save, with the dense variables and its state whole. A restore of a delta
  reads the chain's full checkpoint and applies its deltas in order, onto
  any topology, bit for bit what a full save would have restored.

  Args:
    directory: The checkpoint directory (created if missing), on a file
      system every process can read and write.
    target: A Penzai model (with bound variables) or a trainer (its model,
      step, optax state, loss-function state and root key).
    step: The training step of a model's checkpoint (None: the step after
      the newest); for a trainer, None or the trainer's step.
    keep: How many complete checkpoints to keep (the newest, the new one
      among them); None keeps all.
    max_host_bytes: Most bytes this process holds in flight between its
      devices and storage at once; None is unlimited.
    delta: Save a delta onto the newest checkpoint of `directory`, which
      must be the trainer's previous save (or the checkpoint it was
      restored from).
    full_every: Instead of `delta`: a full checkpoint every `full_every`
      saves and deltas between (a save is full when the newest chain
      already holds `full_every` checkpoints, or when the newest checkpoint
      is not the trainer's previous save, e.g. the first one).

  Returns:
    The path of the new checkpoint.

  Raises:
    ValueError: If a variable's value cannot be stored, an option is
      invalid, or `delta=True` and the save cannot be a delta (the target
      is not a trainer that tracks its rows, or the newest checkpoint is not
      its previous save).
    FileExistsError: If `directory` has a checkpoint of this step or a
      later one (nothing is written then).
  """
  with Operation(f"save_checkpoint({os.fspath(directory)!r})") as op:
    return _save(
      op, directory, target, step, keep, max_host_bytes, delta, full_every
    )


def _save(
  op: Operation,
  directory: str | os.PathLike,
  target: Any,
  step: int | None,
  keep: int | None,
  max_host_bytes: int | None,
  delta: bool = False,
  full_every: int | None = None,
) -> str:
  """`save_checkpoint` between the sync points of `op` (`_ckpt_agree`)."""
  _check_options(keep, max_host_bytes)
  check_options(delta, full_every)
  directory = os.path.abspath(os.fspath(directory))
  parent = parent_of_save(directory, target, delta, full_every)
  description = describe(target)
  if parent is not None:
    description = described(description, target, directory, parent)
  tables = stored_keys(description.manifest)
  _check_cap(description, max_host_bytes, tables)
  arrays = {key: _storable(v) for key, v in description.values.items()}
  stacks = {key: arrays.pop(key) for key in tables}
  save_args = {
    key: ocp.SaveArgs(chunk_byte_size=_CHUNK_BYTES) for key in arrays
  }
  step = save_step(directory, target, step)
  op.agree_step("step", f"the step to save in {directory}", step)
  op.agree_step(
    "parent", f"the checkpoint a delta in {directory} chains onto", parent
  )
  description.manifest[SAVED] = stamp(step, target)
  description.manifest[_TABLES] = tables
  digests = merged(
    op.sync(
      "digests",
      "hashing the arrays",
      chunk_digests({**arrays, **stacks}, _CHUNK_BYTES, frozenset(stacks)),
    )
  )
  options = ocp.CheckpointManagerOptions(
    max_to_keep=None,  # remove_old: orbax would count incomplete folders.
    enable_async_checkpointing=False,
    cleanup_tmp_directories=True,
    temporary_path_class=_DurableRename,
  )
  with ocp.CheckpointManager(
    epath.Path(directory),
    item_handlers=_handlers(max_host_bytes, op),
    options=options,
  ) as manager:
    items = {
      _ARRAYS: ocp.args.PyTreeSave(arrays, save_args=save_args),
      _TABLES: TablesSave(stacks),
      _MANIFEST: ocp.args.JsonSave(seal(description.manifest, digests)),
    }
    if not arrays:  # orbax refuses an empty tree.
      del items[_ARRAYS]
    if not stacks:
      del items[_TABLES]
    manager.save(step, args=ocp.args.Composite(**items))
  saved(target, directory, step)
  remove_old(directory, step, keep)
  op.sync("done", "removing the old checkpoints")
  return os.path.join(directory, str(step))


# ---------------------------------------------------------------------------
# Restoring.


def _assign(model: Any, values: Mapping[str, Any]) -> Any:
  """Writes restored values (by label) into the model; cannot fail."""

  def fill(slot):
    kind = (
      pz.Parameter if isinstance(slot, pz.ParameterSlot) else pz.StateVariable
    )
    return kind(value=values[slot.label], label=slot.label)

  model = pz.select(model).at_instances_of(SLOTS).apply(fill)
  for var in pz.unbind_variables(model)[1]:
    var.value = values[var.label]
  return model


def restore_checkpoint(
  directory: str | os.PathLike,
  target: Any,
  *,
  step: int | None = None,
  max_host_bytes: int | None = None,
  limits: str = "checkpoint",
  cast_tables: bool = False,
) -> Any:
  """Restores the newest checkpoint in `directory` into a model or trainer.

  `step=N` restores the checkpoint of training step N instead
  (`list_checkpoints(directory)` lists the steps there are). The restored
  step is logged (logger `pz_sparsecore.nn.checkpoint`, level INFO); a
  restored trainer holds it (`trainer.state.value.step`).

  The target may use another topology or stacking than the one saved.
  Bound variables are updated in place; variable slots (a model built with
  `init_base_rng=None`) are filled with new variables; values that were
  not committed to devices stay uncommitted. A trainer gets the saved step,
  optax state, loss-function state and root key. A model restores from a
  trainer's checkpoint too. With several processes every process calls it.

  Limits. With `limits="checkpoint"` (the default) each stack takes the
  preprocessing limits saved with it (`max_ids_per_partition`,
  `max_unique_ids_per_partition`, `suggested_coo_buffer_size_per_device`)
  where they hold: on the same devices x SparseCores, for the same layout
  of the stack and the same features with the same samples. They win over
  the target's own limits there, so a layer built afresh gets the plan it
  had at the save, and its `preprocess` makes the same buffers. Any other
  stack (another topology or stacking) keeps the target's limits, as its
  builder chose them: limits are per-partition counts, those of other
  partitions were never measured, and none are converted; measure FDO
  statistics with the restored layer to set them (`update_limits`).
  `limits="target"` keeps the target's limits everywhere (e.g. limits just
  set from FDO on new data). A checkpoint written without limits keeps
  the target's. The returned object's layers carry the restored limits
  (layers are frozen: a re-specified layer is a new one sharing the
  target's variables), so preprocess with them, e.g.
  `restored.model.embed.preprocess`.

  Table dtypes. A table is restored in the dtype it was saved in: a
  model whose table has another dtype (`TableSpec(dtype=...)`) is refused,
  unless `cast_tables=True`, which casts the stored rows to the model's
  dtype as they are read (to the nearest 16-bit value, ties to even, from
  float32; exactly, from a 16-bit dtype to float32). Optimizer slots are
  float32 in every dtype and restored as they are.

  Args:
    directory: A directory written by `save_checkpoint`.
    target: The model or `SparseCoreTrainer` to restore into.
    step: The training step to restore; None: the newest complete
      checkpoint.
    max_host_bytes: Most bytes this process holds in flight between storage
      and its devices at once; None is unlimited.
    limits: "checkpoint" (the saved limits where they hold) or "target"
      (the target's own).
    cast_tables: Whether a table saved in another dtype than the model's is
      cast to the model's (False: refused).

  Returns:
    The restored model, or the restored trainer (use the returned object:
    its root key is new, and its layers have the restored limits).

  Raises:
    FileNotFoundError: If `directory` holds no complete checkpoint (of
      `step`: the message lists the steps there are).
    ValueError: If the checkpoint does not match the target (naming the
      first difference) or an option is invalid; nothing is changed then.
  """
  with Operation(f"restore_checkpoint({os.fspath(directory)!r})") as op:
    return _restore(
      op, directory, target, step, max_host_bytes, limits, cast_tables
    )


class _Reader:
  """Reads checkpoints' manifests and arrays for a restore."""

  def __init__(self, max_host_bytes: int | None):
    self._max_host_bytes = max_host_bytes
    self._checkpointer = ocp.Checkpointer(
      ocp.CompositeCheckpointHandler(**_handlers(max_host_bytes)),
      # No barrier in orbax: the sync point after the reads is the barrier.
      multiprocessing_options=local_only(),
    )

  def manifest(self, path: str) -> dict[str, Any]:
    """The verified manifest of checkpoint `path`."""
    return read_manifest(
      lambda: self._checkpointer.restore(
        path, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()})
      )[_MANIFEST],
      path,
    )

  def arrays(
    self,
    path: str,
    stored: Mapping[str, Any],
    args: dict,
    patches: Mapping[str, Any] | None = None,
  ) -> dict[str, Any]:
    """The arrays of `args` from checkpoint `path`: those of its `tables`
    item a chunk at a time (`patches`: rows written over them, by key),
    the others with orbax; a missing or damaged file raises."""
    tables = set(stored.get(_TABLES, ()))
    rest = {k: a for k, a in args.items() if k not in tables}
    arrays = {}
    if rest:
      arrays = read_arrays(
        lambda: self._checkpointer.restore(
          path,
          args=ocp.args.Composite(
            **{
              _ARRAYS: ocp.args.PyTreeRestore(
                item=dict.fromkeys(rest, 0),
                restore_args=rest,
                partial_restore=True,
              )
            }
          ),
        )[_ARRAYS],
        path,
        stored,
      )
    tables = {k: a for k, a in args.items() if k in tables}
    arrays.update(
      read_all(path, stored, tables, self._max_host_bytes, patches or {})
    )
    return arrays


def _restore(
  op: Operation,
  directory: str | os.PathLike,
  target: Any,
  step: int | None,
  max_host_bytes: int | None,
  limits: str,
  cast_tables: bool,
) -> Any:
  """`restore_checkpoint` between the sync points of `op`
  (`_ckpt_agree`)."""
  _check_options(None, max_host_bytes)
  check_mode(limits)
  if not isinstance(cast_tables, bool):
    raise ValueError(f"cast_tables must be True or False, got {cast_tables!r}")
  directory = os.path.abspath(os.fspath(directory))
  path, step = choose(directory, step)
  op.agree_step("step", f"the checkpoint to restore from {directory}", step)
  _LOG.info("restoring step %d from %s", step, path)
  reader = _Reader(max_host_bytes)
  manifest_of, arrays_of = reader.manifest, reader.arrays

  # A delta's chain: its full checkpoint is read as any, its deltas after.
  chain = Chain.follow(directory, path, manifest_of(path), manifest_of)
  path, stored = chain.path, chain.manifest
  description = describe(target)
  try:
    check(stored, description.manifest, cast_tables)
    model = restore_limits(
      target.model if isinstance(target, SparseCoreTrainer) else target,
      chain.newest["embeds"],
      description.manifest["embeds"],
      limits,
    )
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  chain.read(arrays_of, description, cast_tables)
  reads = Reads.plan(stored, description, model)
  # A delta's rows of a stack read as stored are written as it is read,
  # on the host (no second copy of the table); the others' on the devices.
  tables = set(stored.get(_TABLES, ()))
  updates = chain.updates(model)
  patches = {}
  for label, (_, rows, data) in list(updates.items()):
    key = reads.stored_key(label)
    if key in tables:
      patches[key] = (rows, data)
      del updates[label]
  arrays = arrays_of(path, stored, reads.args, patches)
  op.sync("read", f"reading {path}")
  leaves = None if reads.trainer is None else reads.trainer_leaves(arrays)
  values, leaves = chain.apply(model, reads.values(arrays), leaves, updates)
  values = rehome(model, stored, values)
  if reads.trainer is None:
    return _assign(model, values)
  restored = restored_trainer(
    target,
    description.trainer_treedef,
    leaves,
    _assign(model, values),
    chain.newest.get("fit_stats"),
  )
  saved(restored, directory, step)
  return restored
