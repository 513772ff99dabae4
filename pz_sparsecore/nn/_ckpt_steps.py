"""Which checkpoints a directory holds, by training step, and which to use.

Naming. A checkpoint's folder is named by the training step it holds: a
trainer's step (`trainer.state.value.step`, the steps it has taken); for a
model, the `step=` given to `save_checkpoint`, else the step after the
newest numbered folder in the directory (0 in an empty one). A directory
written by earlier versions has folders numbered by save (0, 1, 2, ...):
they read as steps 0, 1, 2, and a save after them goes on from there.

A save's step must be greater than every numbered folder in the directory.
A step that exists, or an older one, is refused with a `FileExistsError`
before anything is written: a checkpoint is never replaced, so the last
good one survives any crash, and a newer checkpoint from an abandoned run
never hides one saved after it. To go on from an older step (training
resumed from it), delete the newer checkpoints or save into a new
directory.

Complete. A checkpoint is complete when its folder is named by a bare
number and holds a pz_sparsecore manifest that reads. A temporary folder
(`<n>.orbax-checkpoint-tmp`, a save interrupted before its rename)
and a numbered folder without a readable manifest (a deletion interrupted
by an earlier version, or damage) are not checkpoints: the listing skips
them and `keep` does not count them. A restore reads the newest numbered
folder (or the one of `step=`) and refuses it by name if its manifest is
missing or damaged, rather than quietly reading an older checkpoint.

Keep. Only after the new checkpoint is complete (synced, renamed, the
directory synced) does process 0 delete the complete checkpoints beyond
the newest `keep`, and the numbered folders older than the new one that
are not complete. Each is renamed to a temporary name first, so a crash
while deleting leaves no partial checkpoint under a number (the next save
removes temporary folders). The new checkpoint always stays: with `keep=1`
the previous one goes only once the new one is complete. E.g. folders `0`,
`100`, `150.orbax-checkpoint-tmp` (a crash), `keep=2` and a trainer at
step 200: the save removes the temporary folder, writes `200`, then
deletes `0`; `100` and `200` remain.

Deltas. A delta checkpoint (`_ckpt_delta.py`) holds the rows touched
since its *parent*, the checkpoint saved before it, and names its *base*,
the full checkpoint its chain starts from: its manifest's `"delta":
{"base": 100, "parent": 150}`. `keep` counts deltas as checkpoints, and
keeps the chain of every checkpoint it keeps: with full `100`, deltas
`150`, `200` and `keep=1`, `100` and `150` stay beside `200`.

Listing. `list_checkpoints` reads the manifests only (and the folders'
sizes); `save_checkpoint` writes the facts it shows into the manifest::

  "saved": {"step": 200, "time": 1733000000.25, "num_devices": 8,
            "num_sc_per_device": 2, "num_processes": 2}

Checkpoints of earlier versions have no `"saved"` entry: their step is the
folder's number, their time the folder's modification time, their devices
x SparseCores those the stacks' limits record, and their processes
unknown (None).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import jax
from orbax.checkpoint.path import atomicity

from pz_sparsecore.nn.embed import find_embeds
from pz_sparsecore.nn.training import SparseCoreTrainer

MANIFEST_ITEM = "manifest"
"""The orbax item that holds a checkpoint's manifest."""
MANIFEST_FILE = os.path.join(MANIFEST_ITEM, "metadata")
"""The manifest's JSON file (the name orbax's JsonCheckpointHandler gives
it), read directly: the listing opens no orbax checkpoint."""
_FORMAT = "pz_sparsecore.checkpoint"
SAVED = "saved"
"""The manifest's key for what `stamp` records."""
DELTA = "delta"
"""The manifest's key of a delta checkpoint's base and parent steps."""


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """One complete checkpoint of a directory, as `list_checkpoints` finds it.

  Attributes:
    step: The training step it holds (its folder's name).
    time: When it was saved (UTC).
    num_devices: Devices its tables were sharded over.
    num_sc_per_device: SparseCores per device (None: a model without
      `SparseCoreEmbed` layers).
    num_processes: Processes that wrote it (None: an earlier version's
      checkpoint, which did not record it).
    size_bytes: Bytes of its files.
    path: Its folder.
    base: For a delta checkpoint, the step of the full checkpoint its
      chain starts from; None for a full checkpoint.
  """

  step: int
  time: datetime.datetime
  num_devices: int | None
  num_sc_per_device: int | None
  num_processes: int | None
  size_bytes: int
  path: str
  base: int | None = None

  @property
  def is_delta(self) -> bool:
    """Whether it holds only the rows touched since the previous save."""
    return self.base is not None


def _numbered(directory: str) -> list[int]:
  """The folders of `directory` named by a bare number, in step order."""
  if not os.path.isdir(directory):
    return []
  return sorted(
    int(name)
    for name in os.listdir(directory)
    if name.isdigit() and os.path.isdir(os.path.join(directory, name))
  )


def _manifest(path: str) -> dict[str, Any] | None:
  """The manifest of the checkpoint at `path`; None if it has none that
  reads (the folder is then not a complete checkpoint)."""
  try:
    with open(os.path.join(path, MANIFEST_FILE)) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(manifest, dict) or manifest.get("format") != _FORMAT:
    return None
  return manifest


def steps(directory: str) -> list[int]:
  """The steps of the complete checkpoints of `directory`, oldest first."""
  return [
    step
    for step in _numbered(directory)
    if _manifest(os.path.join(directory, str(step))) is not None
  ]


def _check_step(step: Any) -> None:
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    raise ValueError(f"step must be None or an int >= 0, got {step!r}")


def choose(directory: str, step: int | None) -> tuple[str, int]:
  """The checkpoint a restore reads: `(path, step)`.

  The newest folder named by a bare number (or the one of `step`), whether
  or not its manifest reads: a committed folder was renamed into place
  whole, so one whose manifest is missing or damaged was damaged after the
  save, and the restore refuses it by name (`_ckpt_integrity`) rather than
  quietly reading an older checkpoint; `step=` picks an older one.

  Args:
    directory: The checkpoint directory (absolute).
    step: The training step asked for; None: the newest.

  Returns:
    The checkpoint's folder and step.

  Raises:
    FileNotFoundError: If there is no checkpoint (of `step`), listing the
      steps there are.
    ValueError: If `step` is not None or an int >= 0.
  """
  if step is not None:
    _check_step(step)
  numbered = _numbered(directory)
  if step is None and numbered:
    step = numbered[-1]
  if step in numbered:
    return os.path.join(directory, str(step)), step
  if not numbered:
    raise FileNotFoundError(f"no checkpoint in {directory}")
  raise FileNotFoundError(
    f"no checkpoint of step {step} in {directory}; its steps are "
    f"{steps(directory)} (pz_sparsecore.list_checkpoints shows them)"
  )


def save_step(directory: str, target: Any, step: int | None) -> int:
  """The step a save of `target` is named by (see the module docstring).

  Raises:
    ValueError: If `step` is invalid, or given for a trainer and not its
      step.
    FileExistsError: If the step is not after every numbered folder.
  """
  if step is not None:
    _check_step(step)
  if isinstance(target, SparseCoreTrainer):
    own = int(target.state.value.step)
    if step is not None and step != own:
      raise ValueError(
        f"step={step}, but the trainer is at step {own}: a trainer's "
        "checkpoint is named by its own step (leave step out)"
      )
    step = own
  numbered = _numbered(directory)
  if step is None:
    return numbered[-1] + 1 if numbered else 0
  if numbered and step <= numbered[-1]:
    what = "exists" if step in numbered else "is older than the newest"
    raise FileExistsError(
      f"cannot save step {step} in {directory}: a checkpoint of step "
      f"{step} {what} (folders {numbered}); checkpoints are never "
      "replaced. Delete the folders from step "
      f"{min(n for n in numbered if n >= step)} on to save from this step "
      "again, or save into another directory"
    )
  return step


def stamp(step: int, target: Any) -> dict[str, Any]:
  """The manifest's `"saved"` entry for a save of `target` at `step`."""
  model = target.model if isinstance(target, SparseCoreTrainer) else target
  embeds = find_embeds(model)
  devices, sparsecores = jax.device_count(), None
  if embeds:
    plan = embeds[0].config.plan
    devices, sparsecores = plan.num_devices, plan.num_sc_per_device
  return {
    "step": step,
    "time": time.time(),
    "num_devices": devices,
    "num_sc_per_device": sparsecores,
    "num_processes": jax.process_count(),
  }


def parent(manifest: Mapping[str, Any]) -> int | None:
  """The step a delta checkpoint's manifest chains onto; None for a full
  checkpoint."""
  delta = manifest.get(DELTA)
  return None if delta is None else int(delta["parent"])


def chain(directory: str, step: int) -> list[int]:
  """The steps of checkpoint `step`'s chain, its full checkpoint first and
  `step` last (`[step]` for a full one), as far as their manifests read."""
  out = []
  while step is not None and step not in out:
    out.append(step)
    manifest = _manifest(os.path.join(directory, str(step)))
    step = None if manifest is None else parent(manifest)
  return out[::-1]


def _chains(directory: str, kept: set[int]) -> set[int]:
  """`kept` and every checkpoint the chains of its deltas go through."""
  return {found for step in kept for found in chain(directory, step)}


def remove_old(directory: str, newest: int, keep: int | None) -> None:
  """Deletes what `keep` does not keep, once step `newest` is complete.

  Only process 0 deletes; the others return at once.
  """
  if keep is None or jax.process_index() != 0:
    return
  complete = steps(directory)
  kept = _chains(directory, set(complete[-keep:]) | {newest})
  for found in _numbered(directory):
    if found < newest and found not in kept:
      path = os.path.join(directory, str(found))
      doomed = f"{path}{atomicity.TMP_DIR_SUFFIX}-deleted-{time.time_ns()}"
      os.rename(path, doomed)
      shutil.rmtree(doomed)


def _size(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.stat(os.path.join(root, name)).st_size
      except FileNotFoundError:  # Deleted meanwhile by another process.
        continue
  return total


def _topology(manifest: Mapping[str, Any]) -> tuple[Any, Any]:
  """Devices x SparseCores of an earlier version's manifest (its stacks'
  limits record them)."""
  for stacks in manifest.get("embeds", {}).values():
    for stack in stacks.values():
      topology = stack.get("limits", {}).get("topology")
      if topology:
        return topology["num_devices"], topology["num_sc_per_device"]
  return None, None


def _info(path: str, step: int, manifest: Mapping[str, Any]) -> CheckpointInfo:
  saved = manifest.get(SAVED)
  if saved is None:  # An earlier version's checkpoint.
    devices, sparsecores = _topology(manifest)
    saved = {
      "time": os.stat(path).st_mtime,
      "num_devices": devices,
      "num_sc_per_device": sparsecores,
      "num_processes": None,
    }
  return CheckpointInfo(
    step=step,
    time=datetime.datetime.fromtimestamp(saved["time"], datetime.UTC),
    num_devices=saved["num_devices"],
    num_sc_per_device=saved["num_sc_per_device"],
    num_processes=saved["num_processes"],
    size_bytes=_size(path),
    path=path,
    base=None if DELTA not in manifest else int(manifest[DELTA]["base"]),
  )


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
  """The complete checkpoints in `directory`, oldest step first.

  Reads each checkpoint's manifest only (no arrays), so it is cheap; a
  temporary folder of an interrupted save is not listed. Restore one with
  `restore_checkpoint(directory, target, step=info.step)`::

    for info in pzsc.list_checkpoints(ckpt_dir):
      print(info.step, info.time, info.num_devices, info.size_bytes)

  A delta checkpoint's `base` is the step of its chain's full checkpoint.

  Args:
    directory: A directory written by `save_checkpoint` (a missing one has
      none).

  Returns:
    One `CheckpointInfo` per complete checkpoint, by step.
  """
  directory = os.path.abspath(os.fspath(directory))
  found = []
  for step in _numbered(directory):
    path = os.path.join(directory, str(step))
    manifest = _manifest(path)
    if manifest is None:
      continue
    try:
      found.append(_info(path, step, manifest))
    except FileNotFoundError:  # Deleted meanwhile by another process.
      continue
  return found
