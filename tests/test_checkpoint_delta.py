"""Delta checkpoints: the rows a trainer touched since its previous save.

Through the public API; the references are full checkpoints of the same
state and the trainer's own values (`_trainer_values`: logical tables and
slots, the dense parameter, the trainer's state and key), compared bit for
bit.
"""

from __future__ import annotations

import dataclasses
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_checkpoint import (
  DENSE_OPTIMIZER,
  SOME_TABLES,
  _run,
  _trainer_values,
  noisy_loss_fn,
)
from test_training import (
  act_grads,
  build_model,
  feature_specs,
  make_batch,
  mesh_of,
)

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.training import SparseCoreTrainer


def _trainer(g: int, s: int, tables=SOME_TABLES, track: bool = True):
  return SparseCoreTrainer.build(
    jax.random.key(1),
    build_model(g, s, tables),
    DENSE_OPTIMIZER,
    noisy_loss_fn,
    initial_loss_fn_state=jnp.zeros((), jnp.int32),
    track_touched=track,
  )


def _assert_bit_exact(got: dict, want: dict) -> None:
  assert set(got) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(
      np.atleast_1d(got[name]).view(np.uint8),
      np.atleast_1d(value).view(np.uint8),
      err_msg=name,
    )


def _chain(directory) -> tuple[SparseCoreTrainer, dict]:
  """A trainer on 8 devices x 1 SparseCore: a full checkpoint and three
  deltas, training steps between (make_batch's batches hold duplicates and
  leave a third of every table untouched); the trainer's values at each."""
  trainer = _trainer(8, 1)
  want = {}
  for start, stop, delta in ((0, 2, False), (2, 3, True), (3, 5, True)):
    _run(trainer, range(start, stop))
    pzsc.save_checkpoint(directory, trainer, delta=delta, keep=None)
    want[stop] = _trainer_values(trainer)
  # The same batch again: every row it touches was touched before.
  _run(trainer, range(4, 5))
  pzsc.save_checkpoint(directory, trainer, delta=True, keep=None)
  want[6] = _trainer_values(trainer)
  return trainer, want


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
  directory = tmp_path_factory.mktemp("chain")
  trainer, want = _chain(directory)
  full = tmp_path_factory.mktemp("full")
  pzsc.save_checkpoint(full, trainer)
  return directory, full, want


def test_the_listing_shows_deltas_and_their_base(chain):
  directory, _, _ = chain
  listed = [
    (i.step, i.base, i.is_delta) for i in pzsc.list_checkpoints(directory)
  ]
  assert listed == [(2, None, False), (3, 2, True), (5, 2, True), (6, 2, True)]


@pytest.mark.parametrize("g, s", [(8, 1), (4, 2)])
def test_a_chain_restores_bit_exact_against_a_full_save(chain, g, s):
  directory, full, want = chain
  for step in (None, 3, 5):
    got = pzsc.restore_checkpoint(directory, _trainer(g, s), step=step)
    assert int(got.state.value.step) == (step or 6)
    _assert_bit_exact(_trainer_values(got), want[step or 6])
  from_full = pzsc.restore_checkpoint(full, _trainer(g, s))
  _assert_bit_exact(_trainer_values(from_full), want[6])


def test_a_delta_onto_another_topology_chains_on(tmp_path):
  """Saved on 8 x 1, restored onto 4 x 2, trained, a delta saved there:
  the chain restores onto 2 x 1."""
  trainer = _trainer(8, 1)
  _run(trainer, range(2))
  pzsc.save_checkpoint(tmp_path, trainer)
  resumed = pzsc.restore_checkpoint(tmp_path, _trainer(4, 2))
  _run(resumed, range(2, 4))
  pzsc.save_checkpoint(tmp_path, resumed, delta=True)
  got = pzsc.restore_checkpoint(tmp_path, _trainer(2, 1))
  want = _trainer_values(resumed)
  _assert_bit_exact(_trainer_values(got), want)


def test_minibatched_steps_are_tracked(tmp_path):
  trainer = _trainer(8, 1)
  pzsc.save_checkpoint(tmp_path, trainer)
  grads = {k: jnp.asarray(v) for k, v in act_grads(3, SOME_TABLES).items()}
  for step in range(2):
    inputs, _ = trainer.model.embed.preprocess(
      *make_batch(200 + step, SOME_TABLES), enable_minibatching=True
    )
    assert inputs.num_minibatches is not None
    trainer.step(inputs=inputs, grads=grads)
  pzsc.save_checkpoint(tmp_path, trainer, delta=True)
  got = pzsc.restore_checkpoint(tmp_path, _trainer(4, 2))
  _assert_bit_exact(_trainer_values(got), _trainer_values(trainer))


BIG = {
  "big": (
    specs.AdagradOptimizerSpec(learning_rate=0.1),
    "sum",
    16384,
    16,
  )
}


def test_a_delta_is_as_large_as_its_touched_rows(tmp_path):
  trainer = _trainer(2, 1, BIG)
  grads = {k: jnp.asarray(v) for k, v in act_grads(3, BIG).items()}

  def run(steps):
    for step in steps:
      inputs, _ = trainer.model.embed.preprocess(*make_batch(step, BIG))
      trainer.step(inputs=inputs, grads=grads)

  pzsc.save_checkpoint(tmp_path, trainer, keep=None)
  before = pzsc.logical_tables(trainer.model.embed)["big"]
  run(range(1))
  pzsc.save_checkpoint(tmp_path, trainer, delta=True, keep=None)
  touched_one = before != pzsc.logical_tables(trainer.model.embed)["big"]
  run(range(1, 17))
  pzsc.save_checkpoint(tmp_path, trainer, delta=True, keep=None)
  full, one, many = (i.size_bytes for i in pzsc.list_checkpoints(tmp_path))
  row = 16 * 4 + 4 + 8  # A row, its accumulator and its address.
  rows_one = np.count_nonzero(touched_one.any(axis=1))
  assert one < full / 20
  # Beyond a fixed part (the dense values, the manifest, orbax's metadata),
  # the bytes of the rows.
  assert many - one > 8 * rows_one * row


def _flip_largest(checkpoint: str) -> str:
  """64 bytes inverted in the middle of the largest chunk file (of the
  stacks' rows, in the `tables` item)."""
  files = glob.glob(os.path.join(checkpoint, "tables", "*", "[0-9]*"))
  path = max(files, key=os.path.getsize)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    data = f.read(64)
    f.seek(-len(data), os.SEEK_CUR)
    f.write(bytes(b ^ 0xFF for b in data))
  return path


def test_a_damaged_delta_is_refused_by_name(tmp_path):
  trainer = _trainer(8, 1)
  _run(trainer, range(2))
  pzsc.save_checkpoint(tmp_path, trainer, keep=None)
  want = _trainer_values(trainer)
  _run(trainer, range(2, 4))
  pzsc.save_checkpoint(tmp_path, trainer, delta=True, keep=None)
  damaged = _flip_largest(os.path.join(tmp_path, "4"))
  target = _trainer(8, 1)
  before = _trainer_values(target)
  with pytest.raises(ValueError) as error:
    pzsc.restore_checkpoint(tmp_path, target)
  assert os.path.join(str(tmp_path), "4") in str(error.value)
  assert damaged in str(error.value)
  _assert_bit_exact(_trainer_values(target), before)  # Unchanged.
  got = pzsc.restore_checkpoint(tmp_path, target, step=2)
  _assert_bit_exact(_trainer_values(got), want)


def test_a_missing_link_is_refused_by_name(tmp_path):
  trainer = _trainer(1, 1)
  pzsc.save_checkpoint(tmp_path, trainer, keep=None)
  for start in (0, 1):
    _run(trainer, range(start, start + 1))
    pzsc.save_checkpoint(tmp_path, trainer, delta=True, keep=None)
  os.rename(tmp_path / "1", tmp_path / "gone")
  with pytest.raises(FileNotFoundError, match="step=0"):
    pzsc.restore_checkpoint(tmp_path, _trainer(1, 1))


def test_keep_keeps_the_chains_of_kept_deltas(tmp_path):
  trainer = _trainer(1, 1)
  steps = []
  for k, delta in enumerate((False, True, True, False, True)):
    _run(trainer, range(k, k + 1))
    path = pzsc.save_checkpoint(tmp_path, trainer, delta=delta, keep=1)
    steps.append(int(os.path.basename(path)))
    kept = [i.step for i in pzsc.list_checkpoints(tmp_path)]
    if k == 2:  # Full 1, deltas 2 and 3: the chain of 3 stays whole.
      assert kept == steps[:3]
    if k == 3:  # A full one: the rest go.
      assert kept == [4]
  assert [i.step for i in pzsc.list_checkpoints(tmp_path)] == [4, 5]
  want = _trainer_values(trainer)
  got = pzsc.restore_checkpoint(tmp_path, _trainer(1, 1))
  _assert_bit_exact(_trainer_values(got), want)


def test_full_every(tmp_path):
  trainer = _trainer(1, 1)
  for k in range(5):
    _run(trainer, range(k, k + 1))
    pzsc.save_checkpoint(tmp_path, trainer, full_every=2, keep=None)
  bases = [i.base for i in pzsc.list_checkpoints(tmp_path)]
  assert bases == [None, 1, None, 3, None]


def test_a_delta_needs_tracking(tmp_path):
  untracked = _trainer(1, 1, track=False)
  pzsc.save_checkpoint(tmp_path, untracked)
  with pytest.raises(ValueError, match="track_touched=True"):
    pzsc.save_checkpoint(tmp_path, untracked, delta=True, step=5)
  with pytest.raises(ValueError, match="SparseCoreTrainer"):
    pzsc.save_checkpoint(tmp_path, untracked.model, delta=True)
  tracked = _trainer(1, 1)
  with pytest.raises(ValueError, match="save a full checkpoint"):
    pzsc.save_checkpoint(tmp_path, tracked, delta=True)  # Not its save.
  with pytest.raises(ValueError, match="no checkpoint"):
    pzsc.save_checkpoint(tmp_path / "empty", tracked, delta=True)
  with pytest.raises(ValueError, match="not both"):
    pzsc.save_checkpoint(tmp_path, tracked, delta=True, full_every=3)
  assert [i.step for i in pzsc.list_checkpoints(tmp_path)] == [0]


def test_a_chain_casts_as_a_full_checkpoint_does(chain):
  """`cast_tables`: float32 tables of a chain read into bfloat16 ones equal
  the same state's full checkpoint read into them, and the trainer's
  values rounded to bfloat16 (to nearest, ties to even)."""
  directory, full, want = chain

  def bf16_model():
    features = {
      name: dataclasses.replace(
        f, table_spec=dataclasses.replace(f.table_spec, dtype="bfloat16")
      )
      for name, f in feature_specs(4, 2, SOME_TABLES).items()
    }
    embed = SparseCoreEmbed.from_config(
      "emb", None, features, mesh_of(4), num_sc_per_device=2
    )
    return dataclasses.replace(build_model(4, 2, SOME_TABLES), embed=embed)

  restored = [
    pzsc.restore_checkpoint(path, bf16_model(), cast_tables=True)
    for path in (directory, full)
  ]
  for model in restored:
    tables = pzsc.logical_tables(model.embed)
    assert set(tables) == set(SOME_TABLES)
    stacks = {k: v.value.dtype for k, v in model.embed.tables.items()}
    # The pair's stack keeps its float32 (its stacked spec's dtype).
    assert stacks == {
      "sgd": jnp.bfloat16,
      "adam": jnp.bfloat16,
      "pa_pb": np.float32,
    }, stacks
    for name, value in tables.items():
      dtype = np.float32 if name in ("pa", "pb") else jnp.bfloat16
      rounded = want[6][name].astype(dtype).astype(np.float32)
      np.testing.assert_array_equal(
        np.asarray(value, np.float32).view(np.uint32),
        rounded.view(np.uint32),
        name,
      )
