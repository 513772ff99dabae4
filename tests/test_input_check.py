"""Hand-built buffers: `SparseCoreEmbed.validate` names the first bad entry.

Buffers from `preprocess` always pass (several topologies, a stack of two
tables with rotation, ragged rows with duplicates and empty rows). Each
kind of bad entry is written into a copy of such a batch and must be
refused with a `ValueError` naming the feature and the value; the layer then
accepts the original batch again.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz
from test_parallel import _batch, _feature_specs

import pz_sparsecore as pzsc
from pz_sparsecore.core import buffer_format
from pz_sparsecore.nn.embed import SparseCoreEmbed

TOPOLOGIES = [(1, 1), (1, 4), (2, 2), (4, 2), (8, 1)]


def _embed(g, s):
  mesh = Mesh(np.array(jax.devices()[:g]), ("device",))
  return SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _feature_specs(g, s),
    mesh,
    num_sc_per_device=s,
    feature_axes={"f_seq": ("batch", "seq")},
  )


@pytest.fixture(scope="module", params=[(1, 2), (4, 2)], ids=str)
def layer(request):
  embed = _embed(*request.param)
  inputs, _ = embed.preprocess(*_batch(0))
  return embed, inputs


def _host(inputs):
  return jax.tree.map(np.array, inputs)


def _with(inputs, field, stack, values):
  """`inputs` with one stack's buffer replaced (global, same sharding)."""
  old = getattr(inputs, field)
  new = jax.device_put(values, old[stack].sharding)
  return dataclasses.replace(inputs, **{field: {**old, stack: new}})


def _first_partition(host, stack, plan, length):
  """(begin, end) of the first partition of device 0, SparseCore 0 with at
  least `length` entries; the stack's row pointers per SparseCore."""
  stack_plan = plan.stack(stack)
  rp = host.lhs_row_pointers[stack][: stack_plan.row_pointers_per_sc]
  ends = rp[: plan.num_devices * plan.num_sc_per_device]
  starts = buffer_format.partition_starts(ends, np)
  for begin, end in zip(starts, ends, strict=True):
    if end - begin >= length:
      return int(begin), int(end)
  raise AssertionError("no partition long enough")


@pytest.mark.parametrize("g, s", TOPOLOGIES)
def test_preprocessed_buffers_pass(g, s):
  embed = _embed(g, s)
  for seed in range(3):
    inputs, _ = embed.preprocess(*_batch(seed))
    embed.validate(inputs)
    embed.validate(_host(inputs))


def _corrupt(kind, host, plan):
  """(field, stack, new values, expected message part) for one bad kind."""
  stack = "stk"
  begin, end = _first_partition(host, stack, plan, 2)
  ids = host.lhs_embedding_ids[stack].copy()
  sids = host.lhs_sample_ids[stack].copy()
  gains = host.lhs_gains[stack].copy()
  rp = host.lhs_row_pointers[stack].copy()
  if kind == "negative id":
    ids[begin] = -3
    return "lhs_embedding_ids", stack, ids, r"= -3 is outside its table"
  if kind == "padding id":
    ids[end - 1] = buffer_format.PAD_ID
    return "lhs_embedding_ids", stack, ids, "the padding id"
  if kind == "id past the shard":
    ids[end - 1] = plan.stack(stack).rows_per_shard + 5
    return "lhs_embedding_ids", stack, ids, "is outside its table"
  if kind == "unsorted ids":
    ids[begin], ids[begin + 1] = ids[begin + 1] + 1, ids[begin]
    return "lhs_embedding_ids", stack, ids, "not sorted|outside its table"
  if kind == "bad sample id":
    sids[begin] = plan.stack(stack).samples_per_sc
    return "lhs_sample_ids", stack, sids, r"sample_ids\[\d+\] = \d+ is outside"
  if kind == "NaN gain":
    gains[begin] = np.nan
    return "lhs_gains", stack, gains, "is not finite"
  if kind == "decreasing row pointers":
    rp[1] = rp[0] - 1 if rp[0] > 0 else -1
    return "lhs_row_pointers", stack, rp, "row_pointers"
  if kind == "row pointer past the segment":
    rp[0] = plan.stack(stack).coo_per_sc + 1
    return "lhs_row_pointers", stack, rp, r"row_pointers\[0\] = \d+ is outside"
  raise AssertionError(kind)


KINDS = [
  "negative id",
  "padding id",
  "id past the shard",
  "unsorted ids",
  "bad sample id",
  "NaN gain",
  "decreasing row pointers",
  "row pointer past the segment",
]


@pytest.mark.parametrize("kind", KINDS)
def test_bad_entries_are_named_then_good_input_works(layer, kind):
  embed, inputs = layer
  field, stack, values, match = _corrupt(kind, _host(inputs), embed.config.plan)
  bad = _with(inputs, field, stack, values)
  with pytest.raises(ValueError, match=match) as info:
    embed.validate(bad)
  assert "stack 'stk'" in str(info.value)
  with pytest.raises(ValueError, match=match):
    embed(bad, validate=True)
  # The next action: the layer still takes the good batch.
  embed.validate(inputs)
  expected = embed(inputs)
  again = embed(inputs, validate=True)
  for name in expected:
    np.testing.assert_array_equal(
      again[name].unwrap(*again[name].named_shape),
      expected[name].unwrap(*expected[name].named_shape),
    )


def test_id_in_another_tables_rows_names_the_feature(layer):
  """A stacked feature whose id points into its neighbour table's rows."""
  embed, inputs = layer
  plan = embed.config.plan
  host = _host(inputs)
  stack = plan.stack("stk")
  first, second = stack.features[0], stack.features[-1]
  assert first.row_offset_in_shard != second.row_offset_in_shard
  ids, sids = host.lhs_embedding_ids["stk"], host.lhs_sample_ids["stk"]
  begin, end = _first_partition(host, "stk", plan, 1)
  offsets = np.array([f.sample_offset for f in stack.features])
  owner = np.searchsorted(offsets, sids[begin:end], side="right") - 1
  j = begin + int(np.flatnonzero(owner == 0)[0])
  ids = ids.copy()
  ids[j] = second.row_offset_in_shard
  bad = _with(inputs, "lhs_embedding_ids", "stk", np.sort(ids))
  with pytest.raises(ValueError, match=f"feature '{first.name}'"):
    embed.validate(bad)


def test_window_overflow_is_named():
  embed = _embed(4, 2)
  inputs, _ = embed.preprocess(*_batch(0))
  host = _host(inputs)
  stack = embed.config.plan.stack("stk")
  rp = host.lhs_row_pointers["stk"].copy()
  n = 8
  # Device 0, SparseCore 0: push partition 1's end (owner device 0) past
  # the routing window, keeping the pointers non-decreasing.
  rp[1:n] = np.maximum(rp[1:n], stack.window + 8)
  bad = _with(inputs, "lhs_row_pointers", "stk", rp)
  with pytest.raises(ValueError, match="routing window"):
    embed.validate(bad)


def _row_exchange_layer():
  """One table on 2 devices by the row exchange, 8 distinct rows a window."""
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=1000,
    embedding_dim=8,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    combiner="sum",
    max_ids_per_partition=64,
    max_unique_ids_per_partition=8,
  )
  feature = pzsc.FeatureSpec(
    name="f", table_spec=table, input_shape=(64, 1), output_shape=(64, 8)
  )
  mesh = Mesh(np.array(jax.devices()[:2]), ("device",))
  return SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), {"f": feature}, mesh, exchange="rows"
  )


def test_distinct_rows_past_the_row_window_are_named():
  embed = _row_exchange_layer()
  # Device 0's 32 samples ask partition 0 (even ids) for 8 distinct rows.
  ids = np.tile(np.arange(16), 4).reshape(64, 1)
  inputs, _ = embed.preprocess({"f": ids})
  embed.validate(inputs)
  host = _host(inputs)
  begin, end = _first_partition(host, "t", embed.config.plan, 1)
  local = host.lhs_embedding_ids["t"].copy()
  assert len(np.unique(local[begin:end])) == 8
  # A ninth distinct row, still sorted: the exchange has no room for it.
  local[end - 1] = local[end - 2] + 1
  bad = _with(inputs, "lhs_embedding_ids", "t", local)
  with pytest.raises(ValueError, match="9 distinct rows, more than the row"):
    embed.validate(bad)
  # Unchecked, the row is skipped (never read out of bounds); the original
  # batch then validates and looks up as before.
  embed(bad, validate=False)
  embed.validate(inputs)
  expected = np.asarray(pzsc.logical_tables(embed)["t"])[ids[:, 0]]
  out = embed(inputs)["f"].unwrap("batch", "embedding")
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_validate_refuses_traced_buffers(layer):
  embed, inputs = layer

  @jax.jit
  def f(inputs):
    embed.validate(inputs)
    return 0

  with pytest.raises(ValueError, match="outside jit"):
    f(inputs)


def _loss_fn(*, model, state, rng, inputs):
  del rng
  acts = model(inputs)
  loss = sum(
    jax.numpy.sum(a.unwrap(*a.named_shape) ** 2) for a in acts.values()
  )
  return loss, state, {}


def test_trainer_checks_the_first_step_and_changes_nothing():
  embed = _embed(2, 2)
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.1), _loss_fn
  )
  inputs, _ = embed.preprocess(*_batch(0))
  field, stack, values, match = _corrupt(
    "negative id", _host(inputs), embed.config.plan
  )
  before = pzsc.logical_tables(trainer.model)
  with pytest.raises(ValueError, match=match):
    trainer.step(inputs=_with(inputs, field, stack, values))
  after = pzsc.logical_tables(trainer.model)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name])
  assert int(trainer.state.value.step) == 0
  trainer.step(inputs=inputs)
  assert int(trainer.state.value.step) == 1


def test_unused_named_side_input_is_still_ignored(layer):
  embed, inputs = layer
  out = embed(inputs, validate=False, token=pz.nx.wrap(np.zeros(3)))
  assert set(out) == set(embed.config.plan.features)
