"""Minibatching on the Penzai path: `SparseCoreEmbed.preprocess(...,
enable_minibatching=True)`, the layer's lookup, its fused update and the
trainer (with and without its finite-update guard).

Limits far below what a partition gets make every batch split; the
activations are checked against numpy gathers of the logical tables, and
the trained tables and slots against the numpy optimizer restatement of
`test_training`, so minibatching must give what one unsplit step gives.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_training import (
  OPTIMIZERS,
  ProbeModel,
  Reference,
  assert_next_step_as_unguarded,
  assert_same_snapshot,
  build_model,
  check_against,
  gains,
  initial_tables,
  loss_fn,
  snapshot,
)

from pz_sparsecore.nn.training import NonFiniteUpdateError, SparseCoreTrainer

BATCH = 32
LIMIT = 4  # Splits the test batches on 2 x 2 SparseCores.
TABLES = {k: OPTIMIZERS[k] for k in ("adagrad", "adam")}


def _model(g: int, s: int, exchange: str = "auto", limit=LIMIT) -> ProbeModel:
  return build_model(g, s, TABLES, exchange=exchange, limit=limit)


def _batch(seed: int):
  """Ragged weighted ids: 0 to 4 per sample (an empty row, duplicates), in
  the first 2/3 of each table (the rest stays unreferenced)."""
  rng = np.random.RandomState(seed)
  ids, weights = {}, {}
  for name, (_, _, vocab, _) in TABLES.items():
    rows, ws = [], []
    for b in range(BATCH):
      row = rng.randint(0, 2 * vocab // 3, 0 if b == 3 else rng.randint(1, 5))
      if b % 5 == 0 and row.size:
        row = np.append(row, row[0])  # A duplicate.
      rows.append(row.astype(np.int32))
      ws.append(rng.uniform(0.5, 1.5, row.size).astype(np.float32))
    ids[f"f_{name}"], weights[f"f_{name}"] = rows, ws
  return ids, weights


def _grads(seed: int) -> dict[str, jax.Array]:
  rng = np.random.RandomState(seed)
  return {
    f"f_{name}": jnp.asarray(rng.normal(size=(BATCH, dim)), jnp.float32)
    for name, (_, _, _, dim) in TABLES.items()
  }


def _want_activations(tables, ids, weights):
  out = {}
  for name, (_, combiner, _, dim) in TABLES.items():
    feature = f"f_{name}"
    acts = np.zeros((BATCH, dim))
    for b, row in enumerate(ids[feature]):
      if row.size:
        gain = gains(weights[feature][b], combiner)
        acts[b] = (gain[:, None] * tables[name][row]).sum(0)
    out[feature] = acts
  return out


def _minibatches(inputs) -> int:
  counts = np.asarray(inputs.num_minibatches)
  assert len(set(counts.tolist())) == 1, counts
  return int(counts[0])


# Per topology, limits that split every batch into several minibatches
# without one bucket over them.
@pytest.mark.parametrize(
  "g,s,exchange,limit",
  [
    (1, 2, "auto", 6),
    (2, 2, "rows", 4),
    (4, 2, "activations", 3),
  ],
)
def test_trainer_steps_on_minibatches_equal_numpy(g, s, exchange, limit):
  model = _model(g, s, exchange, limit)
  embed = model.embed
  ids, weights = _batch(0)
  with pytest.raises(ValueError, match="max_ids_per_partition"):
    embed.preprocess(ids, weights)
  inputs, stats = embed.preprocess(ids, weights, enable_minibatching=True)
  assert _minibatches(inputs) > 1
  # The stats are those of the whole batch: over the limits.
  assert max(int(np.max(v)) for v in stats.max_ids_per_partition.values()) > (
    limit
  )
  acts = embed(inputs)
  want = _want_activations(initial_tables(11, TABLES), ids, weights)
  for feature, value in acts.items():
    np.testing.assert_allclose(
      value.unwrap("batch", "embedding"), want[feature], rtol=1e-5, atol=1e-5
    )
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(0.5), loss_fn
  )
  ref = Reference(initial_tables(11, TABLES), TABLES)
  before = snapshot(trainer.model.embed)
  for step in range(3):
    ids, weights = _batch(10 + step)
    inputs, _ = trainer.model.embed.preprocess(
      ids, weights, enable_minibatching=True
    )
    assert _minibatches(inputs) > 1
    grads = _grads(step)
    trainer.step(inputs=inputs, grads=grads)
    touched = ref.step(
      ids, weights, {k: np.asarray(v) for k, v in grads.items()}, step
    )
    check_against(trainer.model.embed, ref, touched, before)
    before = snapshot(trainer.model.embed)


def test_within_the_limits_one_minibatch_equals_the_plain_step():
  """A batch that fits is one minibatch; the step equals the plain one."""
  minibatched = _model(2, 2, limit=None)
  plain = _model(2, 2, limit=None)
  ids, weights = _batch(0)
  inputs, _ = minibatched.embed.preprocess(
    ids, weights, enable_minibatching=True
  )
  assert _minibatches(inputs) == 1
  plain_inputs, _ = plain.embed.preprocess(ids, weights)
  trainers = [
    SparseCoreTrainer.build(jax.random.key(1), m, optax.sgd(0.5), loss_fn)
    for m in (minibatched, plain)
  ]
  trainers[0].step(inputs=inputs, grads=_grads(0))
  trainers[1].step(inputs=plain_inputs, grads=_grads(0))
  assert_same_snapshot(
    snapshot(trainers[0].model.embed), snapshot(trainers[1].model.embed)
  )


def test_guarded_minibatched_step_refuses_then_trains():
  """Gradients whose squares overflow Adam's velocity: the guarded trainer
  refuses the step with every minibatch's rows restored, then trains on
  sane gradients as an unguarded trainer does."""
  check_guarded_minibatched_step(2, 2, LIMIT)


def check_guarded_minibatched_step(g: int, s: int, limit: int) -> None:
  """The body of the test above on ``g`` devices x ``s`` SparseCores
  (test_gpu.py runs it on one GPU)."""
  model = _model(g, s, limit=limit)
  trainer = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), loss_fn, check_finite=True
  )
  ids, weights = _batch(0)
  inputs, _ = model.embed.preprocess(ids, weights, enable_minibatching=True)
  assert _minibatches(inputs) > 1
  grads = _grads(0)
  huge = {k: v * 1e25 if k == "f_adam" else v for k, v in grads.items()}
  before = snapshot(trainer.model.embed)
  with pytest.raises(NonFiniteUpdateError, match="emb/adam"):
    trainer.step(inputs=inputs, grads=huge)
  assert_same_snapshot(snapshot(trainer.model.embed), before)
  # The next action: a sane step, equal to an unguarded trainer's.
  assert_next_step_as_unguarded(
    trainer, _model(g, s, limit=limit), inputs, grads, before
  )


def _with(inputs, stack: str, field: str, index: int, value):
  """`inputs` with one device-buffer entry of `stack`'s `field` changed."""
  buffers = dict(getattr(inputs, field))
  host = np.array(buffers[stack])
  host[index] = value
  buffers[stack] = jax.device_put(host, buffers[stack].sharding)
  return dataclasses.replace(inputs, **{field: buffers})


def test_validate_names_the_minibatch_then_good_buffers_train():
  model = _model(2, 2)
  embed = model.embed
  inputs, _ = embed.preprocess(*_batch(0), enable_minibatching=True)
  embed.validate(inputs)
  count = _minibatches(inputs)
  stack = "adam"
  # An id of minibatch 1 past its table's rows.
  ids = np.asarray(inputs.lhs_embedding_ids[stack])
  rp = np.asarray(inputs.lhs_row_pointers[stack])
  rpp = rp.size // 2 // (64 * 2)
  start = int(-(-rp[rpp - 1] // 8) * 8)  # Minibatch 1 of SparseCore 0.
  assert rp[2 * rpp - 1] > start
  bad = _with(inputs, stack, "lhs_embedding_ids", start, 10**6)
  assert ids[start] != 10**6
  with pytest.raises(ValueError, match="SparseCore 0, minibatch 1.*1000000"):
    embed.validate(bad)
  counts = np.asarray(inputs.num_minibatches).copy()
  for wrong, match in (
    ([0, 0], "outside \\[1, 64\\]"),
    ([65, 65], "outside \\[1, 64\\]"),
    ([count, count - 1], "differs across devices"),
  ):
    counts[:] = wrong
    odd = dataclasses.replace(
      inputs,
      num_minibatches=jax.device_put(
        counts.astype(np.int32), inputs.num_minibatches.sharding
      ),
    )
    with pytest.raises(ValueError, match=match):
      embed.validate(odd)
  # The trainer checks its first step's buffers, refuses, changes nothing;
  # the next step with good buffers trains.
  trainer = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), loss_fn
  )
  before = snapshot(trainer.model.embed)
  with pytest.raises(ValueError, match="minibatch 1"):
    trainer.step(inputs=bad, grads=_grads(0))
  assert_same_snapshot(snapshot(trainer.model.embed), before)
  trainer.step(inputs=inputs, grads=_grads(0))
  assert not np.array_equal(
    snapshot(trainer.model.embed)[0]["adam"], before[0]["adam"]
  )


def test_layer_refuses_another_layers_minibatched_buffers():
  ours = _model(2, 2).embed
  other = _model(2, 1, limit=6).embed
  inputs, _ = other.preprocess(*_batch(0), enable_minibatching=True)
  with pytest.raises(ValueError, match="minibatched buffers"):
    ours(inputs)
  odd = dataclasses.replace(inputs, num_minibatches=jnp.ones((3,), jnp.int32))
  mine, _ = ours.preprocess(*_batch(0), enable_minibatching=True)
  with pytest.raises(ValueError, match="num_minibatches is int32\\[3\\]"):
    ours(dataclasses.replace(mine, num_minibatches=odd.num_minibatches))
  assert set(ours(mine)) == {f"f_{name}" for name in TABLES}
