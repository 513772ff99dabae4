"""Topology-independent checkpoints of models with `SparseCoreEmbed` layers.

A checkpoint stores every embedding table and slot in its *logical* form
(`[vocab, dim]` per table, unstacked and unsharded) plus every other variable
of the model by label, so a model saved on one topology (say 8 devices x 1
SparseCore) restores onto another (4 x 2, 1 x 1) with identical outputs.

Layout of `directory`::

  LATEST               name of the newest complete checkpoint
  ckpt_000002/
    manifest.json      what is stored, and the array keys
    arrays.npz         the arrays

A save writes a fresh `ckpt_<n>` under a temporary name, syncs it, renames it
into place, then atomically replaces `LATEST`, and only then removes older
checkpoints. A crash at any point leaves `LATEST` naming a complete
checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from penzai import pz

from pz_sparsecore import layout
from pz_sparsecore.nn.embed import SparseCoreEmbed, _named, from_host, to_host
from pz_sparsecore.nn.training import embeds_of

_LATEST = "LATEST"
_MANIFEST = "manifest.json"
_ARRAYS = "arrays.npz"
_FORMAT_VERSION = 1


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _latest(directory: str) -> str | None:
  try:
    with open(os.path.join(directory, _LATEST)) as f:
      name = f.read().strip()
  except FileNotFoundError:
    return None
  return name or None


def _host_value(label: str, value: Any) -> tuple[np.ndarray, list[str] | None]:
  if isinstance(value, pz.nx.NamedArray | pz.nx.NamedArrayView):
    value = value.as_namedarrayview()
    names = list(value.named_shape)
    data = value.unwrap(*names) if not value.positional_shape else None
    if data is None:
      raise ValueError(f"variable {label!r}: positional axes are not supported")
    return to_host(data), names
  if isinstance(value, jax.Array | np.ndarray | np.generic | int | float):
    return to_host(value), None
  raise ValueError(
    f"variable {label!r}: cannot checkpoint a value of type "
    f"{type(value).__name__} (only arrays and NamedArrays)"
  )


def save_checkpoint(directory: str | os.PathLike, model: Any) -> str:
  """Saves `model`'s variables; returns the checkpoint's path.

  With several processes every process must call it (the tables are
  gathered collectively) and process 0 writes; `directory` must be on a
  file system every process can read for `restore_checkpoint`.

  Args:
    directory: Checkpoint directory (created if missing).
    model: A Penzai model (with bound variables).

  Returns:
    The path of the new checkpoint.

  Raises:
    ValueError: If a variable's value cannot be stored.
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  arrays: dict[str, np.ndarray] = {}
  manifest: dict[str, Any] = {
    "version": _FORMAT_VERSION,
    "embeds": {},
    "variables": {},
  }
  embed_labels = set()
  for embed in embeds_of(model):
    name = embed.config.name
    entry = {"tables": {}}
    for table, value in embed.logical_tables().items():
      key = f"embed/{name}/{table}"
      arrays[key] = value
      entry["tables"][table] = {"value": key, "slots": {}}
    for table, slots in embed.logical_slots().items():
      for slot, value in slots.items():
        key = f"embed/{name}/{table}/{slot}"
        arrays[key] = value
        entry["tables"][table]["slots"][slot] = key
    manifest["embeds"][name] = entry
    embed_labels.update(v.label for v in embed.tables.values())
    embed_labels.update(
      v.label for slots in embed.slots.values() for v in slots.values()
    )
  _, variables = pz.unbind_variables(model)
  for index, var in enumerate(variables):
    if var.label in embed_labels:
      continue
    label = str(var.label)
    value, names = _host_value(label, var.value)
    key = f"var/{index}"
    arrays[key] = value
    manifest["variables"][label] = {
      "kind": "parameter" if isinstance(var, pz.Parameter) else "state",
      "value": key,
      "axes": names,
    }

  previous = _latest(directory)
  number = int(previous.split("_")[1]) + 1 if previous else 0
  name = f"ckpt_{number:06d}"
  if jax.process_index() != 0:
    return os.path.join(directory, name)
  tmp = tempfile.mkdtemp(prefix=".tmp_ckpt_", dir=directory)
  try:
    with open(os.path.join(tmp, _ARRAYS), "wb") as f:
      np.savez(f, **arrays)
      f.flush()
      os.fsync(f.fileno())
    with open(os.path.join(tmp, _MANIFEST), "w") as f:
      json.dump(manifest, f, indent=1)
      f.flush()
      os.fsync(f.fileno())
    _fsync_dir(tmp)
    final = os.path.join(directory, name)
    os.replace(tmp, final)
    fd, latest_tmp = tempfile.mkstemp(prefix=".tmp_latest_", dir=directory)
    with os.fdopen(fd, "w") as f:
      f.write(name)
      f.flush()
      os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(directory, _LATEST))
    _fsync_dir(directory)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  for entry in os.listdir(directory):
    if entry != name and (
      entry.startswith("ckpt_") or entry.startswith(".tmp")
    ):
      path = os.path.join(directory, entry)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.unlink(path)
  return final


def _stacked(
  embed: SparseCoreEmbed, logical: dict[str, np.ndarray], what: str
) -> dict[str, jax.Array]:
  specs = embed.config.feature_specs
  n = embed.config.topology.num_shards
  missing = sorted(set(layout.get_table_specs(specs)) - set(logical))
  if missing:
    raise ValueError(
      f"checkpoint lacks {what} of tables {missing} of SparseCoreEmbed "
      f"{embed.config.name!r}"
    )
  stacked = layout.stack_and_shard_tables(specs, logical, n, pad_value=0.0)
  sharding = embed.config.topology.sharding(3)
  return {k: from_host(v, sharding) for k, v in stacked.items()}


def _restore_embed(
  embed: SparseCoreEmbed, entry: dict[str, Any], arrays: Any
) -> SparseCoreEmbed:
  config = embed.config
  tables = {t: arrays[e["value"]] for t, e in entry["tables"].items()}
  new_tables = _stacked(embed, tables, "values")
  table_vars = dict(embed.tables)
  for stack, value in new_tables.items():
    var = table_vars[stack]
    if isinstance(var, pz.ParameterSlot):
      table_vars[stack] = pz.Parameter(
        value=_named(config, value), label=config.table_label(stack)
      )
    else:
      var.value = _named(config, value)
  slot_vars = {s: dict(v) for s, v in embed.slots.items()}
  for stack, spec in config.stacks.items():
    for slot in spec.optimizer.slot_names():
      logical = {
        t: arrays[e["slots"][slot]]
        for t, e in entry["tables"].items()
        if slot in e["slots"]
      }
      value = _stacked(embed, logical, f"slot {slot!r}")[stack]
      var = slot_vars[stack][slot]
      if isinstance(var, pz.StateVariableSlot):
        slot_vars[stack][slot] = pz.StateVariable(
          value=_named(config, value), label=config.slot_label(stack, slot)
        )
      else:
        var.value = _named(config, value)
  return dataclasses.replace(embed, tables=table_vars, slots=slot_vars)


def _restored_value(old: Any, value: np.ndarray, names: list[str] | None):
  old = getattr(old, "data_array", old)
  if isinstance(old, jax.Array) and old.committed:
    array = from_host(value, old.sharding)
  else:
    # Uncommitted, like a fresh Penzai parameter: placing it on one device
    # would clash under jit with the mesh-sharded tables and inputs.
    array = jax.numpy.asarray(value)
  if names is None:
    return array
  return pz.nx.wrap(array).tag(*names)


def restore_checkpoint(directory: str | os.PathLike, model: Any) -> Any:
  """Restores the newest checkpoint in `directory` into `model`.

  Variables already bound are updated in place; variable slots (a model
  built with `init_base_rng=None`) are filled with new variables. The model
  may use a different topology than the one that was saved.

  Args:
    directory: A directory written by `save_checkpoint`.
    model: The model to restore into.

  Returns:
    The model with every variable restored (the same object when nothing
    was a slot).

  Raises:
    FileNotFoundError: If `directory` holds no complete checkpoint.
    ValueError: If the checkpoint does not match the model.
  """
  directory = os.fspath(directory)
  name = _latest(directory)
  if name is None:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  path = os.path.join(directory, name)
  with open(os.path.join(path, _MANIFEST)) as f:
    manifest = json.load(f)
  if manifest.get("version") != _FORMAT_VERSION:
    raise ValueError(
      f"{path}: unknown checkpoint version {manifest.get('version')}"
    )
  with np.load(os.path.join(path, _ARRAYS), allow_pickle=False) as npz:
    arrays = {k: npz[k] for k in npz.files}

  def restore_embed(embed):
    entry = manifest["embeds"].get(embed.config.name)
    if entry is None:
      raise ValueError(
        f"checkpoint {path} has no SparseCoreEmbed {embed.config.name!r}; it "
        f"has {sorted(manifest['embeds'])}"
      )
    return _restore_embed(embed, entry, arrays)

  model = pz.select(model).at_instances_of(SparseCoreEmbed).apply(restore_embed)
  embed_labels = set()
  for embed in embeds_of(model):
    embed_labels.update(v.label for v in embed.tables.values())
    embed_labels.update(
      v.label for slots in embed.slots.values() for v in slots.values()
    )
  stored = manifest["variables"]

  def restore_slot(slot):
    entry = stored.get(str(slot.label))
    if entry is None:
      raise ValueError(f"checkpoint {path} has no variable {slot.label!r}")
    value = _restored_value(None, arrays[entry["value"]], entry["axes"])
    if isinstance(slot, pz.ParameterSlot):
      return pz.Parameter(value=value, label=slot.label)
    return pz.StateVariable(value=value, label=slot.label)

  model = (
    pz.select(model)
    .at_instances_of(pz.ParameterSlot | pz.StateVariableSlot)
    .apply(restore_slot)
  )
  _, variables = pz.unbind_variables(model)
  for var in variables:
    if var.label in embed_labels:
      continue
    entry = stored.get(str(var.label))
    if entry is None:
      raise ValueError(f"checkpoint {path} has no variable {var.label!r}")
    var.value = _restored_value(
      var.value, arrays[entry["value"]], entry["axes"]
    )
  return model
