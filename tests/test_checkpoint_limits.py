"""Checkpoints carry the limits in force: a resume needs no FDO again.

A trainer runs two steps, takes limits from FDO statistics of them
(`update_limits`), runs one more and is saved; it then runs on,
uninterrupted. The references are that trainer's own layer (its plan, the
buffers its `preprocess` makes) and its values after the uninterrupted
steps; a freshly built trainer with the default limits is restored from
the checkpoint and must match them, bit for bit, on 1 and 8 devices.
Restoring onto another topology or stacking keeps the target's limits for
the stacks they were not measured for; a checkpoint written before limits
were stored restores with the target's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import warnings
from typing import Any

import jax
import numpy as np
import pytest
from test_checkpoint import (
  SOME_TABLES,
  _probe_trainer,
  _run,
  _trainer_values,
  _unstacked,
  assert_same_values,
)
from test_training import build_model, feature_specs, make_batch, mesh_of

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout
from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.embed import SparseCoreEmbed

SAVED_AT, TOTAL = 3, 5


def limits_of(embed) -> dict[str, tuple]:
  """Each stack's limits in force, from the layer's plan."""
  return {
    stack.name: (
      stack.spec.max_ids_per_partition,
      stack.spec.max_unique_ids_per_partition,
      stack.spec.suggested_coo_buffer_size_per_device,
    )
    for stack in embed.config.plan.stacks
  }


def buffer_sizes_of(embed) -> dict[str, tuple]:
  """Each stack's buffer and routing-window sizes, from the layer's plan."""
  return {
    stack.name: (
      stack.coo_per_device,
      stack.coo_per_sc,
      stack.row_pointers_per_sc,
      stack.window,
      stack.unique_window,
    )
    for stack in embed.config.plan.stacks
  }


def next_inputs(embed) -> list[np.ndarray]:
  """The buffers of the batch after the save, preprocessed by `embed`."""
  inputs, _ = embed.preprocess(*make_batch(100 + SAVED_AT, SOME_TABLES))
  return [np.asarray(leaf) for leaf in jax.tree.leaves(inputs)]


@contextlib.contextmanager
def step_compiles():
  """Collects the trainer step's compilations inside the block."""
  seen = []

  class Handler(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith("Compiling jit(_trainer_step)"):
        seen.append(record)

  handler, logger = Handler(logging.WARNING), logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles(True):
      yield seen
  finally:
    logger.removeHandler(handler)


def assert_same_arrays(got: list, want: list) -> None:
  assert len(got) == len(want)
  for a, b in zip(got, want, strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


@dataclasses.dataclass(frozen=True)
class Saved:
  """A trainer on `g` x 1 with limits from FDO, saved after `SAVED_AT` steps.

  Attributes:
    g: Its device count.
    directory: The checkpoint directory.
    limits: Its layer's limits at the save.
    sizes: Its layer's buffer sizes at the save.
    inputs: The next batch's buffers, preprocessed by its layer.
    values: Its values at the save.
    losses: Its losses over `TOTAL` uninterrupted steps.
    compiles: The step's compilations over its first two steps.
    final: Its values after them.
  """

  g: int
  directory: Any
  limits: dict[str, tuple]
  sizes: dict[str, tuple]
  inputs: list[np.ndarray]
  values: dict[str, np.ndarray]
  losses: list[float]
  compiles: int
  final: dict[str, np.ndarray]


@pytest.fixture(scope="module", params=[1, 8], ids=["1x1", "8x1"])
def saved(request, tmp_path_factory) -> Saved:
  g = request.param
  base = tmp_path_factory.mktemp(f"limits{g}")
  trainer = _probe_trainer(g, 1, key=1)
  fdo = pzsc.NPZFileFDOClient(str(base / "fdo"))
  for step in range(2):  # _run's batches, with their statistics recorded.
    fdo.record(
      trainer.model.embed.preprocess(*make_batch(100 + step, SOME_TABLES))[1]
    )
  with step_compiles() as compiles:
    losses = _run(trainer, range(2))
  fdo.publish()
  trainer = pzsc.update_limits(trainer, fdo.load(), headroom=2.0)
  losses += _run(trainer, range(2, SAVED_AT))
  directory = base / "ckpt"
  save_checkpoint(directory, trainer)
  embed = trainer.model.embed
  at_save = dict(
    limits=limits_of(embed),
    sizes=buffer_sizes_of(embed),
    inputs=next_inputs(embed),
    values=_trainer_values(trainer),
  )
  losses += _run(trainer, range(SAVED_AT, TOTAL))
  return Saved(
    g,
    directory,
    **at_save,
    losses=losses,
    compiles=len(compiles),
    final=_trainer_values(trainer),
  )


def test_manifest_holds_the_limits_and_what_they_were_set_for(saved):
  newest = pzsc.list_checkpoints(saved.directory)[-1].path
  with open(os.path.join(newest, "manifest", "metadata")) as f:
    stacks = json.load(f)["embeds"]["emb"]
  assert set(stacks) == set(saved.limits) == {"sgd", "adam", "pa_pb"}
  for name, entry in stacks.items():
    kept = entry["limits"]
    assert (
      kept["max_ids_per_partition"],
      kept["max_unique_ids_per_partition"],
      kept["suggested_coo_buffer_size_per_device"],
    ) == saved.limits[name]
    assert kept["topology"] == {"num_devices": saved.g, "num_sc_per_device": 1}
    want_features = {"pa_pb": ["f_pa", "f_pb"]}.get(name, [f"f_{name}"])
    assert [f["name"] for f in kept["features"]] == want_features
    assert {f["samples"] for f in kept["features"]} == {32}
  # FDO set them: none is the default any more.
  assert all(v != (256, 256, None) for v in saved.limits.values())


def test_resume_restores_the_limits_and_trains_bit_for_bit(saved):
  fresh = _probe_trainer(saved.g, 1, key=9)
  assert limits_of(fresh.model.embed) != saved.limits  # The defaults.
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # Nothing to say on the same topology.
    resumed = restore_checkpoint(saved.directory, fresh)
  embed = resumed.model.embed
  assert limits_of(embed) == saved.limits
  assert buffer_sizes_of(embed) == saved.sizes
  # The restored layer shares the target's variables.
  assert embed.tables["sgd"] is fresh.model.embed.tables["sgd"]
  assert_same_arrays(next_inputs(embed), saved.inputs)
  with step_compiles() as compiles:
    losses = _run(resumed, range(SAVED_AT, TOTAL))
  # As often as a freshly built trainer's: only the new trainer's own.
  assert len(compiles) == saved.compiles
  assert saved.losses[:SAVED_AT] + losses == saved.losses
  assert_same_values(_trainer_values(resumed), saved.final)


def test_saved_limits_win_over_the_target_s_unless_asked(saved):
  # A target with limits of its own (40 per table; the pair's stack 256).
  own = limits_of(build_model(saved.g, 1, SOME_TABLES, limit=40).embed)
  assert own["sgd"] == (40, 40, None) and own != saved.limits
  for mode, expected in (("checkpoint", saved.limits), ("target", own)):
    target = build_model(saved.g, 1, SOME_TABLES, limit=40)
    restored = restore_checkpoint(saved.directory, target, limits=mode)
    assert limits_of(restored.embed) == expected, mode
  with pytest.raises(ValueError, match=r"limits must be one of .* 'saved'"):
    restore_checkpoint(saved.directory, target, limits="saved")


# The tests below restore the 8-device checkpoint elsewhere.
from_eight = pytest.mark.parametrize("saved", [8], indirect=True, ids=["8x1"])


@from_eight
@pytest.mark.parametrize("g,s", [(2, 1), (4, 2)], ids=["2x1", "4x2"])
def test_another_topology_keeps_the_target_limits(saved, g, s):
  # Limits measured for 8 devices x 1 SparseCore are not applied to 2 x 1
  # or 4 x 2 (8 shards too, but other SparseCores send to them).
  fresh = _probe_trainer(g, s, key=9)
  own = limits_of(fresh.model.embed)
  assert all(own[name] != saved.limits[name] for name in own)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # A supported restore: nothing to say.
    resumed = restore_checkpoint(saved.directory, fresh)
  assert limits_of(resumed.model.embed) == own
  assert_same_values(_trainer_values(resumed), saved.values)
  # It trains on with its own limits, and FDO on this topology sets new
  # ones (update_limits accepts statistics measured with this layer).
  embed = resumed.model.embed
  _, stats = embed.preprocess(*make_batch(100 + SAVED_AT, SOME_TABLES))
  assert np.isfinite(_run(resumed, range(SAVED_AT, SAVED_AT + 1))[0])
  refreshed = pzsc.update_limits(resumed, stats, headroom=2.0)
  assert limits_of(refreshed.model.embed) != own


@from_eight
def test_another_stacking_keeps_the_target_limits_of_that_stack(saved):
  # The pair stacked the other way round: its stack keeps its own limits;
  # the stacks laid out as saved take theirs.
  other = layout.stack_tables(
    _unstacked(feature_specs(8, 1, SOME_TABLES)), ["pb", "pa"], 8, 1, 0
  )
  embed = SparseCoreEmbed.from_config("emb", None, other, mesh_of(8))
  own = limits_of(embed)
  assert own["pb_pa"] != saved.limits["pa_pb"]
  target = dataclasses.replace(build_model(8, 1, SOME_TABLES), embed=embed)
  restored = restore_checkpoint(saved.directory, target)
  assert limits_of(restored.embed) == {
    "sgd": saved.limits["sgd"],
    "adam": saved.limits["adam"],
    "pb_pa": own["pb_pa"],
  }


def test_a_checkpoint_without_limits_keeps_the_target_s(saved, tmp_path):
  # As written before the limits were stored: no "limits" in the manifest.
  old = tmp_path / "old"
  shutil.copytree(saved.directory, old)
  newest = pzsc.list_checkpoints(old)[-1].path
  path = old / os.path.basename(newest) / "manifest" / "metadata"
  manifest = json.loads(path.read_text())
  del manifest["crc32"]  # Nor a checksum.
  for stacks in manifest["embeds"].values():
    for entry in stacks.values():
      del entry["limits"]
  path.write_text(json.dumps(manifest))
  fresh = _probe_trainer(saved.g, 1, key=9)
  own = limits_of(fresh.model.embed)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    resumed = restore_checkpoint(old, fresh)
  assert limits_of(resumed.model.embed) == own != saved.limits
  assert resumed.model.embed.config == fresh.model.embed.config
  assert_same_values(_trainer_values(resumed), saved.values)
  assert np.isfinite(_run(resumed, range(SAVED_AT, SAVED_AT + 1))[0])
