"""Interrupted saves: the previous checkpoint stays restorable, and the next
saves and restores work.

A writer process is killed (SIGKILL) at random points of its save loop; the
states such a kill can leave (a temporary directory, an old checkpoint not
yet deleted, one half deleted) and a save that fails with an I/O error are
also made deterministically. After each, the test does what a user does
next: restore, save twice, restore again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import checkpoint_writer  # noqa: E402

from pz_sparsecore.nn.checkpoint import (  # noqa: E402
  restore_checkpoint,
  save_checkpoint,
)

WRITER = os.path.join(os.path.dirname(__file__), "checkpoint_writer.py")
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def restored_version(directory) -> int:
  embed = restore_checkpoint(directory, checkpoint_writer.build(None))
  return checkpoint_writer.version(embed)


def save_twice_and_restore(directory, start: int) -> None:
  """The user's next action: two saves, then a restore of the newest."""
  embed = checkpoint_writer.build(jax.random.key(1))
  for k in (start, start + 1):
    checkpoint_writer.set_version(embed, k)
    save_checkpoint(directory, embed)
  assert restored_version(directory) == start + 1
  entries = sorted(os.listdir(directory))
  assert len(entries) == 1 and entries[0].isdigit(), entries


@pytest.mark.parametrize("seed", [0, 1])
def test_killed_writer_leaves_a_restorable_checkpoint(tmp_path, seed):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(
    [sys.executable, WRITER, str(tmp_path)],
    stdout=subprocess.PIPE,
    text=True,
    env=env,
  )
  try:
    # Two saves first, so that the kill lands after a save that deleted an
    # older checkpoint, however slow saves are on a loaded machine.
    for k in (1, 2):
      assert proc.stdout.readline().startswith(f"saved {k}")
    time.sleep(np.random.default_rng(seed).uniform(0.05, 1.0))
    proc.send_signal(signal.SIGKILL)
    rest = proc.communicate(timeout=60)[0]
  finally:
    proc.kill()
  saved = [1, 2] + [int(line.split()[1]) for line in rest.splitlines()]
  # The newest complete save, or the one in flight if its rename landed.
  assert restored_version(tmp_path) in (saved[-1], saved[-1] + 1)
  save_twice_and_restore(tmp_path, saved[-1] + 10)


def _half(directory: str) -> None:
  """Deletes every other file under `directory`."""
  files = sorted(
    os.path.join(root, name)
    for root, _, names in os.walk(directory)
    for name in names
  )
  for path in files[::2]:
    os.unlink(path)


def _tmp_dir(directory) -> None:
  # A save of step 2 killed while writing.
  shutil.copytree(directory / "1", directory / f"2{TMP_SUFFIX}-123")
  _half(directory / f"2{TMP_SUFFIX}-123")
  shutil.rmtree(directory / "0")


def _old_half_deleted(directory) -> None:
  # Killed while deleting step 0 after committing step 1.
  _half(directory / "0")


def _failed_sync(directory, monkeypatch) -> None:
  # A save of step 2 whose data cannot be synced (disk full).
  shutil.rmtree(directory / "0")
  embed = checkpoint_writer.build(jax.random.key(0))
  checkpoint_writer.set_version(embed, 7)

  def full(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(OSError, match="No space left"):
    save_checkpoint(directory, embed)
  monkeypatch.undo()
  assert any(TMP_SUFFIX in name for name in os.listdir(directory))


PHASES = {
  "tmp-dir": lambda d, mp: _tmp_dir(d),
  "old-not-deleted": lambda d, mp: None,
  "old-half-deleted": lambda d, mp: _old_half_deleted(d),
  "failed-sync": _failed_sync,
}


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_interrupted_save_then_save_twice(tmp_path, monkeypatch, phase):
  embed = checkpoint_writer.build(jax.random.key(0))
  for k in (1, 2):  # Steps 0 and 1, both kept.
    checkpoint_writer.set_version(embed, k)
    save_checkpoint(tmp_path, embed, keep=None)
  PHASES[phase](tmp_path, monkeypatch)
  assert restored_version(tmp_path) == 2
  save_twice_and_restore(tmp_path, 5)


def test_keep_the_newest(tmp_path):
  embed = checkpoint_writer.build(jax.random.key(0))
  for k in range(1, 5):
    checkpoint_writer.set_version(embed, k)
    path = save_checkpoint(tmp_path, embed, keep=2)
  assert sorted(os.listdir(tmp_path)) == ["2", "3"]
  assert path == os.path.join(tmp_path, "3")
  assert restored_version(tmp_path) == 4
  with pytest.raises(ValueError, match="keep must be None or a positive int"):
    save_checkpoint(tmp_path, embed, keep=0)


def test_data_is_synced_before_the_rename_and_the_directory_after(
  tmp_path, monkeypatch
):
  events = []
  real_fsync, real_rename = os.fsync, os.rename

  def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    real_fsync(fd)

  def rename(src, dst, *args, **kwargs):
    events.append(("rename", os.fspath(src), os.fspath(dst)))
    real_rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "rename", rename)
  embed = checkpoint_writer.build(jax.random.key(0))
  path = save_checkpoint(tmp_path, embed)
  monkeypatch.undo()
  commit = next(
    i for i, e in enumerate(events) if e[0] == "rename" and e[2] == path
  )
  tmp = events[commit][1]
  synced = {e[1] for e in events[:commit] if e[0] == "fsync"}
  files = [
    os.path.relpath(os.path.join(root, name), path)
    for root, dirs, names in os.walk(path)
    for name in names + dirs
  ]
  assert len(files) > 5
  # Every file and directory the rename publishes was synced before it
  # (under its temporary name), except the commit marks orbax writes last.
  unsynced = [
    f
    for f in files
    if os.path.join(tmp, f) not in synced
    and not f.endswith(("commit_success.txt", "_CHECKPOINT_METADATA"))
  ]
  assert not unsynced
  assert ("fsync", str(tmp_path)) in events[commit + 1 :]
  assert ("fsync", path) in events[commit + 1 :]
