"""Limits that never refuse the first batch, and `fit` refreshing them."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout, specs

BATCH, K, DIM = 1024, 4, 8


_INIT = jax.nn.initializers.normal(1.0)


def _table(name, vocab, **limits):
  return specs.TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=DIM,
    initializer=_INIT,
    optimizer=specs.SGDOptimizerSpec(learning_rate=20.0),
    combiner="sum",
    **limits,
  )


def _features():
  table, small = _table("t", 5000), _table("s", 40)
  return {
    "a": specs.FeatureSpec(
      name="a",
      table_spec=table,
      input_shape=(BATCH, K),
      output_shape=(BATCH, DIM),
    ),
    "b": specs.FeatureSpec(
      name="b",
      table_spec=small,
      input_shape=(BATCH, 2),
      output_shape=(BATCH, DIM),
    ),
  }


@pytest.fixture(scope="module")
def mesh():
  return Mesh(np.array(jax.devices()), ("device",))


def _one_partition_batch(rng, n, vocab=5000):
  """Ids that all live on one shard (multiples of `n`), distinct within
  each SparseCore's samples."""
  pool = np.arange(0, vocab, n)
  a = np.concatenate(
    [rng.choice(pool, size=(BATCH // n, K), replace=False) for _ in range(n)]
  )
  return {"a": a, "b": rng.integers(0, 40, (BATCH, 2))}


def _reference(embed, batch):
  tables = pzsc.logical_tables(embed)
  return {
    "a": np.asarray(tables["t"])[batch["a"]].sum(axis=1),
    "b": np.asarray(tables["s"])[batch["b"]].sum(axis=1),
  }


def test_worst_case_limits_follow_the_declared_shapes():
  seq_table = _table("seq", 100)
  own = _table("own", 10_000, max_ids_per_partition=64)
  ragged = own.replace(name="ragged", max_ids_per_partition=256)
  base = _features()
  features = {
    **base,
    # A second feature of table t: its ids add to t's worst case.
    "c": specs.FeatureSpec(
      name="c",
      table_spec=base["a"].table_spec,
      input_shape=(BATCH, 3),
      output_shape=(BATCH, DIM),
    ),
    # One id per sample of a [BATCH, 16] sequence.
    "seq": specs.FeatureSpec(
      name="seq",
      table_spec=seq_table,
      input_shape=(BATCH, 16),
      output_shape=(BATCH, 16, DIM),
    ),
    "own": specs.FeatureSpec(
      name="own",
      table_spec=own,
      input_shape=(BATCH, 2),
      output_shape=(BATCH, DIM),
    ),
    "ragged": specs.FeatureSpec(
      name="ragged",
      table_spec=ragged,
      input_shape=(BATCH, None),
      output_shape=(BATCH, DIM),
    ),
  }
  g, s = 4, 2
  n = g * s
  got = {
    f.name: f.table_spec
    for f in jax.tree.leaves(layout.worst_case_limits(features, g, s))
  }
  per_sc_t = BATCH // n * (K + 3)
  assert got["a"].max_ids_per_partition == per_sc_t
  # Bounded by a partition's rows: 5000 padded to 5056 over 8 shards.
  assert got["a"].max_unique_ids_per_partition == min(per_sc_t, 5056 // n)
  assert got["a"].suggested_coo_buffer_size_per_device == s * (per_sc_t + 7 * n)
  # At most upstream's 256 ids: the default stays (a declared valency is
  # informative); distinct ids are bounded by a partition's rows (40 rows
  # padded to 64).
  assert BATCH // n * 2 <= 256
  assert got["b"].max_ids_per_partition == 256
  assert got["b"].suggested_coo_buffer_size_per_device is None
  assert got["b"].max_unique_ids_per_partition == 64 // n
  assert got["seq"].max_ids_per_partition == BATCH * 16 // n
  assert got["seq"].max_unique_ids_per_partition == 128 // n
  # Limits of their own, or no bound on the ids per sample: kept.
  assert got["own"] == own
  assert got["ragged"] == ragged


def test_default_limits_admit_a_batch_on_one_partition(mesh):
  """The first batch, with every id of every SparseCore on one partition,
  passes the default limits and looks up right; upstream's 256 would refuse
  it, and the refusal carries the stats that admit it."""
  rng = np.random.default_rng(0)
  n = len(mesh.devices.flat)
  batch = _one_partition_batch(rng, n)
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _features(), mesh
  )
  inputs, stats = embed.preprocess(batch)
  got = embed(inputs)
  want = _reference(embed, batch)
  for name in batch:
    np.testing.assert_allclose(
      np.asarray(got[name].unwrap("batch", "embedding")),
      want[name],
      rtol=1e-5,
      atol=1e-5,
    )
  (stack,) = embed.config.plan.stacks
  assert int(np.max(stats.max_ids_per_partition[stack.name])) >= BATCH // n * K

  strict = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _features(), mesh, limits="specs"
  )
  with pytest.raises(pzsc.LimitsExceededError, match="over max_ids") as e:
    strict.preprocess(batch)
  assert isinstance(e.value, ValueError)
  # The user's next action: limits from the refused batch's stats.
  admitted = pzsc.update_limits(strict, e.value.stats, headroom=1.25)
  inputs, _ = admitted.preprocess(batch)
  got = admitted(inputs)
  want = _reference(admitted, batch)
  np.testing.assert_allclose(
    np.asarray(got["a"].unwrap("batch", "embedding")),
    want["a"],
    rtol=1e-5,
    atol=1e-5,
  )


def test_from_config_refuses_an_unknown_limits_mode(mesh):
  with pytest.raises(ValueError, match="limits must be one of"):
    pzsc.SparseCoreEmbed.from_config(
      "emb", jax.random.key(0), _features(), mesh, limits="tight"
    )


def _loss_fn(*, model, state, rng, inputs):
  del rng
  acts = model(inputs)
  loss = sum(jnp.mean(jnp.sin(a.unwrap(*a.named_shape))) for a in acts.values())
  return loss, state, {"loss": loss}


def _zipf_batches(count, seed):
  rng = np.random.default_rng(seed)
  return [
    {
      "a": np.minimum(rng.zipf(1.3, (BATCH, K)) - 1, 4999),
      "b": rng.integers(0, 40, (BATCH, 2)),
    }
    for _ in range(count)
  ]


def _trainer(mesh):
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(3), _features(), mesh
  )
  return pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.1), _loss_fn
  )


def test_fit_refreshes_limits_and_redoes_a_refused_batch(mesh, caplog):
  """`fit(refresh_limits_every=3)` calibrates the worst-case limits on the
  first batch before compiling, then a batch over them is refreshed for
  and redone, and training equals a run whose limits never changed."""
  n = len(mesh.devices.flat)
  batches = _zipf_batches(6, 0)
  # Step 7: every id of every SparseCore on one partition.
  batches.insert(6, _one_partition_batch(np.random.default_rng(1), n))
  batches += _zipf_batches(2, 1)

  def prep(trainer):
    return lambda b: {"inputs": trainer.model.preprocess(b)[0]}

  plain = _trainer(mesh)
  initial = pzsc.logical_tables(plain.model)
  plain_aux = plain.fit(batches, prep(plain))
  # Training moved the rows well beyond the tolerance below.
  assert (
    np.abs(pzsc.logical_tables(plain.model)["t"] - initial["t"]).max() > 0.1
  )
  worst = plain.model.config.plan.stacks[0].spec

  trainer = _trainer(mesh)
  seen = []
  caplog.clear()
  with (
    jax.log_compiles(True),
    caplog.at_level("WARNING"),
    pytest.warns(pzsc.LimitsRaisedWarning, match="step 6"),
  ):
    aux = trainer.fit(
      batches,
      prep(trainer),
      refresh_limits_every=3,
      headroom=1.25,
      callback=lambda i, a: seen.append(
        (i, trainer.model.config.plan.stacks[0].spec.max_ids_per_partition)
      ),
    )
  compiles = sum(
    r.getMessage().startswith("Compiling jit(_trainer_step)")
    for r in caplog.records
  )
  assert [i for i, _ in seen] == list(range(len(batches)))
  assert len(aux) == len(batches)
  limits = [limit for _, limit in seen]
  # Calibrated on the first batch before the first step (the Zipf batches
  # need a fraction of the worst case), kept by the later refreshes, raised
  # for the refused batch.
  assert limits[0] < worst.max_ids_per_partition / 2
  assert limits[:6] == [limits[0]] * 6
  assert limits[6] > limits[5]
  # The first compile (calibrated) and one for the raised limits.
  assert compiles == 2
  # Same limits as FDO over every batch with the same headroom would give.
  stats = None
  for b in batches:
    _, s = plain.model.preprocess(b)
    stats = s if stats is None else pzsc.merge_stats(stats, s)
  want = pzsc.update_limits(plain.model, stats, headroom=1.25)
  got_spec = trainer.model.config.plan.stacks[0].spec
  assert (
    got_spec.max_ids_per_partition
    == want.config.plan.stacks[0].spec.max_ids_per_partition
  )
  np.testing.assert_allclose(
    [float(a["loss"]) for a in aux],
    [float(a["loss"]) for a in plain_aux],
    rtol=1e-5,
  )
  # Up to summation order (the limits can change a stack's exchange).
  for name, table in pzsc.logical_tables(trainer.model).items():
    np.testing.assert_allclose(
      table, pzsc.logical_tables(plain.model)[name], rtol=1e-4, atol=1e-4
    )


def test_fit_refuses_bad_refresh_arguments(mesh):
  trainer = _trainer(mesh)
  for bad in (0, -1, 2.5, "3"):
    with pytest.raises(ValueError, match="refresh_limits_every"):
      trainer.fit([], refresh_limits_every=bad)
  with pytest.raises(ValueError, match="headroom"):
    trainer.fit([], refresh_limits_every=2, headroom=0.5)
  # The next action: a valid call runs.
  assert trainer.fit([], refresh_limits_every=2) == []


def test_merge_stats_takes_the_larger_counts_and_refuses_other_topologies(
  mesh,
):
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), _features(), mesh
  )
  batches = _zipf_batches(2, 5)
  (_, a), (_, b) = (embed.preprocess(x) for x in batches)
  merged = pzsc.merge_stats(a, b)
  for field in (
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "required_buffer_size_per_sc",
  ):
    for stack, value in getattr(merged, field).items():
      np.testing.assert_array_equal(
        value,
        np.maximum(getattr(a, field)[stack], getattr(b, field)[stack]),
      )
  # Statistics of 4 devices do not merge with those of 8, naming the stack.
  small = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _features(),
    Mesh(np.array(jax.devices()[:4]), ("device",)),
  )
  _, c = small.preprocess(batches[0])
  (stack,) = embed.config.plan.stacks
  with pytest.raises(ValueError, match=f"stack '{stack.name}'.*different"):
    pzsc.merge_stats(a, c)
  # The next action: statistics of one topology merge, and set limits.
  refreshed = pzsc.update_limits(embed, merged, headroom=1.25)
  refreshed.preprocess(batches[1])


def _epoch_trainer(mesh):
  """One feature of one id per sample, batches of 64 (the epoch loop's)."""
  spec = specs.FeatureSpec(
    name="a",
    table_spec=_table("t", 1000),
    input_shape=(64, 1),
    output_shape=(64, DIM),
  )
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(3), {"a": spec}, mesh
  )
  return pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.1), _loss_fn
  )


def _epoch():
  """20 batches of 64 uniform ids, the last one all one id (over the
  limits that the other 19 need)."""
  rng = np.random.default_rng(7)
  batches = [{"a": rng.integers(0, 1000, (64, 1))} for _ in range(19)]
  return batches + [{"a": np.full((64, 1), 5)}]


def _step_compiles(records) -> int:
  return sum(
    r.getMessage().startswith("Compiling jit(_trainer_step)") for r in records
  )


def _limits_of(trainer):
  spec = trainer.model.config.plan.stacks[0].spec
  return spec.max_ids_per_partition, spec.max_unique_ids_per_partition


def _fit_epoch(trainer, caplog):
  """One `fit` call over `_epoch()` refreshing every 10 steps: its aux
  outputs, the step's compilations and the `LimitsRaisedWarning`s."""
  caplog.clear()
  with (
    jax.log_compiles(True),
    caplog.at_level("WARNING"),
    warnings.catch_warnings(record=True) as said,
  ):
    warnings.simplefilter("always")
    aux = trainer.fit(
      _epoch(),
      lambda b: {"inputs": trainer.model.preprocess(b)[0]},
      refresh_limits_every=10,
    )
  raised = [w for w in said if issubclass(w.category, pzsc.LimitsRaisedWarning)]
  return aux, _step_compiles(caplog.records), len(raised)


def test_an_epoch_loop_of_fit_calls_compiles_no_more_after_its_first_epoch(
  mesh, caplog
):
  """Three `fit` calls over the same epoch: the first calibrates, then
  raises the limits for the last batch (two compilations, one warning);
  the next ones keep the limits the first epoch needed (none)."""
  trainer = _epoch_trainer(mesh)
  compiles, limits = [], []
  for epoch in range(3):
    aux, step_compiles, raised = _fit_epoch(trainer, caplog)
    assert len(aux) == 20
    compiles.append(step_compiles)
    limits.append(_limits_of(trainer))
    assert raised == (1 if epoch == 0 else 0)
  assert compiles == [2, 0, 0]
  assert limits[0] == limits[1] == limits[2]
  # The limits admit the all-one-id batch: each SparseCore's 8 samples on
  # one partition.
  assert limits[0][0] >= 64 // len(mesh.devices.flat)


def test_fit_without_refresh_raises_limits_for_a_batch_over_them(mesh):
  """Without `refresh_limits_every`, a batch over the limits is redone
  with raised limits (said once), and training equals a run whose limits
  admitted every batch from the start."""
  batches = _epoch()
  batches.insert(5, {"a": np.full((64, 1), 3)})  # A second one over them.

  def prep(t):
    return lambda b: {"inputs": t.model.preprocess(b)[0]}

  wide = _epoch_trainer(mesh)
  want = wide.fit(batches, prep(wide))  # Worst-case limits: no refusal.
  trainer = _epoch_trainer(mesh)
  # Limits the uniform batches fit, the repeated ids do not.
  stats = None
  for b in batches:
    if len(np.unique(b["a"])) > 1:
      _, s = trainer.model.preprocess(b)
      stats = s if stats is None else pzsc.merge_stats(stats, s)
  object.__setattr__(trainer, "model", pzsc.update_limits(trainer.model, stats))
  small = _limits_of(trainer)
  with pytest.raises(pzsc.LimitsExceededError):
    trainer.model.preprocess(batches[5])
  with pytest.warns(pzsc.LimitsRaisedWarning, match="step 5") as said:
    got = trainer.fit(batches, prep(trainer))
  assert len(said) == 1
  assert _limits_of(trainer)[0] >= 64 // len(mesh.devices.flat) > small[0]
  np.testing.assert_allclose(
    [float(a["loss"]) for a in got],
    [float(a["loss"]) for a in want],
    rtol=1e-5,
  )


def test_fit_statistics_are_saved_with_the_checkpoint(mesh, tmp_path, caplog):
  """A trainer restored from a checkpoint keeps `fit`'s statistics: its
  next epoch compiles the step once (a new trainer's first compile) and
  raises no limit, where one restored without them (an older checkpoint)
  shrinks its limits on the first batch and raises them again."""
  trainer = _epoch_trainer(mesh)
  _fit_epoch(trainer, caplog)
  pzsc.save_checkpoint(tmp_path / "ckpt", trainer)
  trained = _limits_of(trainer)

  def next_epoch(restored):
    return _fit_epoch(restored, caplog)[1:]

  restored = pzsc.restore_checkpoint(tmp_path / "ckpt", _epoch_trainer(mesh))
  assert restored.limit_stats is not None
  assert _limits_of(restored) == trained
  assert next_epoch(restored) == (1, 0)
  assert _limits_of(restored) == trained
  # Without them: the limits shrink on the first batch, then grow back.
  without = pzsc.restore_checkpoint(tmp_path / "ckpt", _epoch_trainer(mesh))
  object.__setattr__(without, "limit_stats", None)
  assert next_epoch(without) == (2, 1)
