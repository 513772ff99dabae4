"""Choosing a checkpoint: folders named by training step, `step=`, the
listing, `keep`, and checkpoints of the earlier format.

Through the public API only; the references are the values the test set
before each save. `data/checkpoint_88290d7` holds checkpoints written by
the code of commit 88290d7 (folders numbered by save, manifests without
the save's step, time and topology) of `build(...)` at `set_version(1)`
and `set_version(2)`.
"""

from __future__ import annotations

import datetime
import os
import shutil

import checkpoint_writer
import jax
import numpy as np
import pytest
import treescope
from penzai import pz
from test_checkpoint import _probe_trainer, _run, _trainer_values

import pz_sparsecore as pzsc

VOCAB, DIM = 16, 8
OLD = os.path.join(os.path.dirname(__file__), "data", "checkpoint_88290d7")
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def build(rng):
  """checkpoint_writer's layer with a 16 x 8 table, and a bias."""
  embed = checkpoint_writer.build(rng, vocab=VOCAB, dim=DIM)
  bias = pz.nn.AddBias.from_config("bias", rng, {"dim": DIM})
  return pz.nn.Sequential([embed, bias])


def values(k: int) -> dict[str, np.ndarray]:
  """Version k: the table, its slot and the bias."""
  rows = np.arange(VOCAB * DIM, dtype=np.float32).reshape(VOCAB, DIM)
  return {
    "table": rows + k,
    "accumulator": rows * k + 1,
    "bias": np.full(DIM, k, np.float32),
  }


def set_version(model, k: int) -> None:
  want = values(k)
  embed, bias = model.sublayers
  pzsc.set_logical_tables(embed, {"t": want["table"]})
  pzsc.set_logical_slots(embed, {"t": {"accumulator": want["accumulator"]}})
  bias.bias.value = pz.nx.wrap(want["bias"]).tag("dim")


def assert_version(model, k: int) -> None:
  embed, bias = model.sublayers
  got = {
    "table": pzsc.logical_tables(embed)["t"],
    "accumulator": pzsc.logical_slots(embed)["t"]["accumulator"],
    "bias": np.asarray(bias.bias.value.unwrap("dim")),
  }
  for name, want in values(k).items():
    np.testing.assert_array_equal(got[name], want, err_msg=name)


def save_versions(directory, steps, **kwargs):
  """Saves version k at step k for each k (keeping all, unless told)."""
  model = build(jax.random.key(0))
  kwargs.setdefault("keep", None)
  for k in steps:
    set_version(model, k)
    pzsc.save_checkpoint(directory, model, step=k, **kwargs)
  return model


def restored(directory, **kwargs):
  return pzsc.restore_checkpoint(directory, build(None), **kwargs)


def listed(directory) -> list[int]:
  return [info.step for info in pzsc.list_checkpoints(directory)]


def folders(directory) -> list[str]:
  return sorted(os.listdir(directory), key=lambda n: (len(n), n))


# ---------------------------------------------------------------------------
# step=, and the listing.


def test_step_restores_an_older_checkpoint(tmp_path):
  save_versions(tmp_path, [3, 5, 8])
  assert folders(tmp_path) == ["3", "5", "8"]
  assert_version(restored(tmp_path), 8)
  for k in (3, 5):
    assert_version(restored(tmp_path, step=k), k)


def test_a_trainer_is_saved_under_its_step_and_restored_from_any(tmp_path):
  trainer = _probe_trainer(1, 1, key=1)
  want = {}
  for start, k in ((0, 2), (2, 3)):
    _run(trainer, range(start, k))
    path = pzsc.save_checkpoint(tmp_path, trainer, keep=None)
    assert path == os.path.join(tmp_path, str(k))
    want[k] = _trainer_values(trainer)
  assert folders(tmp_path) == ["2", "3"]
  for step in (2, None):
    got = pzsc.restore_checkpoint(
      tmp_path, _probe_trainer(1, 1, key=9), step=step
    )
    k = step or 3
    assert int(got.state.value.step) == k
    have = _trainer_values(got)
    assert set(have) == set(want[k])
    for name, value in want[k].items():
      np.testing.assert_array_equal(have[name], value, err_msg=name)
  with pytest.raises(ValueError, match="the trainer is at step 3"):
    pzsc.save_checkpoint(tmp_path, trainer, step=4)


def test_list_checkpoints(tmp_path):
  before = datetime.datetime.now(datetime.UTC)
  model = save_versions(tmp_path, [10, 20])
  pzsc.save_checkpoint(tmp_path, model, keep=None)  # The next step: 21.
  infos = pzsc.list_checkpoints(tmp_path)
  assert [i.step for i in infos] == [10, 20, 21]
  times = [i.time for i in infos]
  assert before - datetime.timedelta(seconds=1) <= times[0]
  assert times == sorted(times)
  assert times[-1] <= datetime.datetime.now(datetime.UTC)
  for info in infos:
    assert (info.num_devices, info.num_sc_per_device) == (1, 1)
    assert info.num_processes == 1
    assert info.path == os.path.join(tmp_path, str(info.step))
    assert info.size_bytes > VOCAB * DIM * 4 * 2  # Table and slot at least.
  with pytest.raises(AttributeError):
    infos[0].step = 1  # Frozen.
  assert repr(infos[0]).startswith("CheckpointInfo(step=10, time=")
  assert "step=10" in treescope.render_to_text(infos[0])
  assert pzsc.list_checkpoints(tmp_path / "missing") == []


def test_unknown_step(tmp_path):
  save_versions(tmp_path, [10, 20])
  with pytest.raises(FileNotFoundError, match=r"its steps are \[10, 20\]"):
    restored(tmp_path, step=7)
  with pytest.raises(ValueError, match="step must be None or an int >= 0"):
    restored(tmp_path, step=-1)
  with pytest.raises(FileNotFoundError, match="no checkpoint in"):
    restored(tmp_path / "missing")


@pytest.mark.parametrize("step,what", [(20, "exists"), (15, "is older")])
def test_an_existing_or_older_step_is_refused(tmp_path, step, what):
  model = save_versions(tmp_path, [10, 20])
  set_version(model, 99)
  with pytest.raises(FileExistsError, match=f"step {step} {what}"):
    pzsc.save_checkpoint(tmp_path, model, step=step)
  assert folders(tmp_path) == ["10", "20"]
  assert_version(restored(tmp_path), 20)


# ---------------------------------------------------------------------------
# keep: complete checkpoints only, never the last good one.


def test_keep_counts_complete_checkpoints_only(tmp_path):
  save_versions(tmp_path, [1, 2, 3])
  # A save of step 9 interrupted before its rename, and a numbered folder
  # without its manifest (a deletion interrupted).
  shutil.copytree(tmp_path / "3", tmp_path / f"9{TMP_SUFFIX}-123")
  shutil.copytree(tmp_path / "3", tmp_path / "4")
  shutil.rmtree(tmp_path / "4" / "manifest")
  assert listed(tmp_path) == [1, 2, 3]
  # The newest numbered folder is refused by name, not passed over.
  with pytest.raises(FileNotFoundError, match="4/manifest"):
    restored(tmp_path)
  assert_version(restored(tmp_path, step=3), 3)
  save_versions(tmp_path, [5], keep=2)
  assert folders(tmp_path) == ["3", "5"]
  assert_version(restored(tmp_path, step=3), 3)
  save_versions(tmp_path, [6, 7], keep=1)
  assert folders(tmp_path) == ["7"]


def test_keep_deletes_only_after_the_new_checkpoint_is_complete(
  tmp_path, monkeypatch
):
  save_versions(tmp_path, [1])
  renames = []
  real_rename = os.rename

  def rename(src, dst, *args, **kwargs):
    renames.append((os.path.basename(src), os.path.basename(dst)))
    real_rename(src, dst, *args, **kwargs)

  monkeypatch.setattr(os, "rename", rename)
  save_versions(tmp_path, [2], keep=1)
  commit = next(i for i, (_, dst) in enumerate(renames) if dst == "2")
  gone = next(i for i, (src, _) in enumerate(renames) if src == "1")
  assert commit < gone and TMP_SUFFIX in renames[gone][1]
  assert folders(tmp_path) == ["2"]

  def full(fd):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(os, "fsync", full)
  with pytest.raises(OSError, match="No space left"):
    save_versions(tmp_path, [3], keep=1)
  monkeypatch.undo()
  assert listed(tmp_path) == [2]
  assert_version(restored(tmp_path), 2)


# ---------------------------------------------------------------------------
# Checkpoints of the earlier format.


def test_checkpoints_of_the_earlier_format(tmp_path):
  directory = tmp_path / "old"
  shutil.copytree(OLD, directory)
  infos = pzsc.list_checkpoints(directory)
  assert [i.step for i in infos] == [0, 1]
  for info in infos:
    assert (info.num_devices, info.num_sc_per_device) == (1, 1)
    assert info.num_processes is None and info.size_bytes > 0
  assert_version(restored(directory), 2)
  assert_version(restored(directory, step=0), 1)
  # A model's next save goes on from the newest folder.
  model = build(jax.random.key(0))
  set_version(model, 3)
  assert pzsc.save_checkpoint(directory, model) == os.path.join(directory, "2")
  assert folders(directory) == ["2"]
  assert_version(restored(directory), 3)
