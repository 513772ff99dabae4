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
from pz_sparsecore.nn.embed import (
  SparseCoreEmbed,
  find_embeds,
  named_table,
  variable_labels,
)
from pz_sparsecore.nn.host import from_host, to_host
from pz_sparsecore.nn.tables import logical_slots, logical_tables

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


def _embed_labels(model: Any) -> set[str]:
  """Labels of the tables and slots of every `SparseCoreEmbed` in `model`."""
  tables, slots = variable_labels(model)
  return tables | slots


def _embed_entry(
  embed: SparseCoreEmbed, arrays: dict[str, np.ndarray]
) -> dict[str, Any]:
  """Adds a layer's logical tables and slots to `arrays`; its manifest."""
  name = embed.config.name
  entry = {"tables": {}}
  for table, value in logical_tables(embed).items():
    key = f"embed/{name}/{table}"
    arrays[key] = value
    entry["tables"][table] = {"value": key, "slots": {}}
  for table, slots in logical_slots(embed).items():
    for slot, value in slots.items():
      key = f"embed/{name}/{table}/{slot}"
      arrays[key] = value
      entry["tables"][table]["slots"][slot] = key
  return entry


def _contents(model: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
  """The arrays to store (on the host) and the manifest describing them."""
  arrays: dict[str, np.ndarray] = {}
  manifest: dict[str, Any] = {
    "version": _FORMAT_VERSION,
    "embeds": {},
    "variables": {},
  }
  for embed in find_embeds(model):
    manifest["embeds"][embed.config.name] = _embed_entry(embed, arrays)
  embed_labels = _embed_labels(model)
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
  return arrays, manifest


def _write(
  directory: str,
  name: str,
  arrays: dict[str, np.ndarray],
  manifest: dict[str, Any],
) -> str:
  """Writes `directory/name` under a temporary name, then points LATEST."""
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
  return final


def _remove_others(directory: str, name: str) -> None:
  """Removes every checkpoint and temporary entry but `name`."""
  for entry in os.listdir(directory):
    if entry != name and (
      entry.startswith("ckpt_") or entry.startswith(".tmp")
    ):
      path = os.path.join(directory, entry)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        os.unlink(path)


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
  arrays, manifest = _contents(model)
  previous = _latest(directory)
  number = int(previous.split("_")[1]) + 1 if previous else 0
  name = f"ckpt_{number:06d}"
  if jax.process_index() != 0:
    return os.path.join(directory, name)
  final = _write(directory, name, arrays, manifest)
  _remove_others(directory, name)
  return final


def _stacked(
  embed: SparseCoreEmbed, logical: dict[str, np.ndarray], what: str
) -> dict[str, jax.Array]:
  plan = embed.config.plan
  missing = sorted(set(plan.tables) - set(logical))
  if missing:
    raise ValueError(
      f"checkpoint lacks {what} of tables {missing} of SparseCoreEmbed "
      f"{embed.config.name!r}"
    )
  stacked = layout.stack_and_shard_tables(
    plan.feature_specs, logical, plan.num_shards, pad_value=0.0
  )
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
        value=named_table(config, value), label=config.table_label(stack)
      )
    else:
      var.value = named_table(config, value)
  slot_vars = {s: dict(v) for s, v in embed.slots.items()}
  for stack_plan in config.plan.stacks:
    stack = stack_plan.name
    for slot in stack_plan.optimizer.slot_names():
      logical = {
        t: arrays[e["slots"][slot]]
        for t, e in entry["tables"].items()
        if slot in e["slots"]
      }
      value = _stacked(embed, logical, f"slot {slot!r}")[stack]
      var = slot_vars[stack][slot]
      if isinstance(var, pz.StateVariableSlot):
        slot_vars[stack][slot] = pz.StateVariable(
          value=named_table(config, value), label=config.slot_label(stack, slot)
        )
      else:
        var.value = named_table(config, value)
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
  embed_labels = _embed_labels(model)
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
