"""Upstream's device side: `tpu_sparse_dense_matmul(_grad)` in a shard_map.

An upstream training step written as its Shakespeare example writes it
(`jax.shard_map` over the tables' mesh axis, the variables of
`init_embedding_variables`) runs with its imports changed; the activations
and the updated tables are checked against numpy on the logical tables.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pz_sparsecore as pzsc
from pz_sparsecore.compat.lib.nn import (
  embedding,
  embedding_spec,
  table_stacking,
)
from pz_sparsecore.core import plan as plan_lib

BATCH, DIM, S = 64, 8, 4
LR = 0.25


def _specs(limit=64, scale=1):
  sgd = embedding_spec.SGDOptimizerSpec(learning_rate=LR)
  adagrad = embedding_spec.AdagradOptimizerSpec(
    learning_rate=LR, initial_accumulator_value=0.5
  )
  tables = [
    embedding_spec.TableSpec(
      vocabulary_size=vocab,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(1.0),
      optimizer=optimizer,
      combiner="sum",
      name=name,
      max_ids_per_partition=limit,
      max_unique_ids_per_partition=limit,
    )
    for name, vocab, optimizer in (
      ("a", 64 * scale, sgd),
      ("b", 40 * scale, sgd),
      ("c", 96 * scale, adagrad),
    )
  ]
  return {
    f"f{t.name}": embedding_spec.FeatureSpec(
      table_spec=t,
      input_shape=[BATCH, 3],
      output_shape=[BATCH, DIM],
      name=f"f{t.name}",
    )
    for t in tables
  }


def _setup(devices=None, limit=64, scale=1, minibatching=False):
  mesh = jax.sharding.Mesh(np.array(devices or jax.devices()), ("device",))
  g = mesh.size
  specs = _specs(limit, scale)
  table_stacking.stack_tables(specs, ["a", "b"], g, S)
  embedding.prepare_feature_specs_for_training(specs, g, S)
  rng = np.random.default_rng(0)
  ids = {
    name: rng.integers(0, f.table_spec.vocabulary_size, (BATCH, 3))
    for name, f in specs.items()
  }
  ids["fa"][:3] = [[0, 63, 63], [32, 31, 0], [1, 1, 1]]  # edges, duplicates
  buffers, _ = embedding.preprocess_sparse_dense_matmul_input(
    ids,
    None,
    specs,
    g,
    g,
    num_sc_per_device=S,
    enable_minibatching=minibatching,
  )
  sharding = NamedSharding(mesh, P("device"))
  buffers = jax.device_put(buffers, sharding)
  buffers = (
    dataclasses.replace(buffers, num_minibatches=None)
    if (not minibatching)
    else buffers
  )
  table_specs = {f.table_spec.name: f.table_spec for f in specs.values()}
  variables = embedding.init_embedding_variables(
    jax.random.key(3),
    table_specs,
    NamedSharding(mesh, P("device", None)),
    S,
    bypass_mesh_check=devices is not None,
  )
  return mesh, specs, ids, buffers, table_specs, variables


def _logical(table_specs, variables, slot=None, shards=None):
  """Logical tables (or one slot's) of the stacked variables."""
  arrays = {
    name: v.table if slot is None else getattr(v.slot, slot)
    for name, v in variables.items()
    if slot is None or hasattr(v.slot, slot)
  }
  specs = {
    name: t
    for name, t in table_specs.items()
    if t.setting_in_stack.stack_name in arrays
  }
  return {
    name: np.asarray(t)
    for name, t in table_stacking.unshard_and_unstack_tables(
      specs, arrays, shards or len(jax.devices()) * S
    ).items()
  }


def _step(mesh, specs, g, minibatching=False, forward=(), backward=()):
  """The jitted upstream-style forward and backward; `forward` and
  `backward` add keyword options to the device calls."""
  pd, pe = P("device"), P("device", None)
  forward = jax.shard_map(
    functools.partial(
      embedding.tpu_sparse_dense_matmul,
      global_device_count=g,
      feature_specs=specs,
      sharding_strategy="MOD",
      enable_minibatching=minibatching,
      **dict(forward),
    ),
    mesh=mesh,
    in_specs=(pd, pe),
    out_specs=pd,
    check_vma=False,
  )
  backward = jax.shard_map(
    functools.partial(
      embedding.tpu_sparse_dense_matmul_grad,
      feature_specs=specs,
      sharding_strategy="MOD",
      enable_minibatching=minibatching,
      **dict(backward),
    ),
    mesh=mesh,
    in_specs=(pd, pd, pe),
    out_specs=pe,
    check_vma=False,
  )
  return jax.jit(forward), jax.jit(backward, donate_argnums=2)


@pytest.mark.parametrize("minibatching", [False, True])
def test_upstream_device_step_equals_numpy(minibatching):
  """With minibatching: 2 devices, limits of 4 ids per partition (about a
  quarter of what a partition gets), so the batch splits."""
  if minibatching:
    mesh, specs, ids, buffers, table_specs, variables = _setup(
      jax.devices()[:2], limit=4, scale=16, minibatching=True
    )
    assert int(np.asarray(buffers.num_minibatches)[0]) > 1
  else:
    mesh, specs, ids, buffers, table_specs, variables = _setup()
  before = _logical(table_specs, variables, shards=mesh.size * S)
  forward, backward = _step(mesh, specs, mesh.size, minibatching)
  acts = forward(buffers, variables)
  # The Penzai layer of the same specs takes the same buffers.
  layer = pzsc.SparseCoreEmbed.from_config(
    "e",
    jax.random.key(0),
    embedding_spec.to_pz(specs),
    mesh,
    num_sc_per_device=S,
  )
  pzsc.set_logical_tables(layer, before)
  layer_acts = layer(buffers)
  for name, f in specs.items():
    want = before[f.table_spec.name][ids[name]].astype(np.float64).sum(1)
    np.testing.assert_allclose(acts[name], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
      layer_acts[name].unwrap("batch", "embedding"), want, rtol=1e-5, atol=1e-5
    )
  rng = np.random.default_rng(1)
  grads = {
    name: rng.normal(size=(BATCH, DIM)).astype(np.float32) for name in specs
  }
  n = mesh.size * S
  accumulator = _logical(table_specs, variables, "accumulator", n)["c"]
  new = backward(grads, buffers, variables)
  after = _logical(table_specs, new, shards=n)
  for name, f in specs.items():
    table = f.table_spec.name
    row_grad = np.zeros_like(before[table], np.float64)
    np.add.at(row_grad, ids[name], grads[name][:, None, :].astype(np.float64))
    touched = np.unique(ids[name])
    if table == "c":
      acc = accumulator.astype(np.float64) + row_grad**2
      want = before[table] - LR * row_grad / np.sqrt(acc)
      new_acc = _logical(table_specs, new, "accumulator", n)["c"]
      np.testing.assert_allclose(new_acc[touched], acc[touched], rtol=1e-5)
    else:
      want = before[table] - LR * row_grad
    np.testing.assert_allclose(
      after[table][touched], want[touched], rtol=1e-5, atol=1e-5
    )
    untouched = np.setdiff1d(np.arange(len(want)), touched)
    np.testing.assert_array_equal(
      after[table][untouched], before[table][untouched]
    )


def test_device_functions_refuse_outside_shard_map_then_work_inside():
  mesh, specs, _, buffers, _, variables = _setup()
  with pytest.raises(ValueError, match="inside jax.shard_map"):
    embedding.tpu_sparse_dense_matmul(
      buffers, variables, specs, global_device_count=mesh.size
    )
  forward, _ = _step(mesh, specs, mesh.size // 2)
  with pytest.raises(ValueError, match="global_device_count=4, but"):
    forward(buffers, variables)
  forward, _ = _step(mesh, specs, mesh.size)
  acts = forward(buffers, variables)
  assert set(acts) == set(specs)
  assert jnp.shape(acts["fa"]) == (BATCH, DIM)


@pytest.mark.parametrize("minibatching", [False, True])
def test_stacked_activations_gradients_and_row_limits(minibatching):
  """`perform_unstacking=False` gives each stack's activations, features'
  samples stacked per SparseCore; `perform_stacking=False` takes gradients
  shaped so and updates as per-feature ones do; `embedding_var_limits`
  clips the rows the batch updates and leaves the others alone."""
  if minibatching:
    setup = _setup(jax.devices()[:2], limit=4, scale=16, minibatching=True)
  else:
    setup = _setup()
  mesh, specs, ids, buffers, table_specs, variables = setup
  n = mesh.size * S
  before = _logical(table_specs, variables, shards=n)
  plan = plan_lib.build(embedding_spec.to_pz(specs), mesh.size, S)
  forward, _ = _step(mesh, specs, mesh.size, minibatching)
  per_feature = forward(buffers, variables)
  stacked_forward, _ = _step(
    mesh, specs, mesh.size, minibatching, forward={"perform_unstacking": False}
  )
  stacked = stacked_forward(buffers, variables)
  assert set(stacked) == {stack.name for stack in plan.stacks}
  rng = np.random.default_rng(2)
  grads = {
    name: rng.normal(size=(BATCH, DIM)).astype(np.float32) for name in specs
  }
  stacked_grads = {}
  for stack in plan.stacks:
    acts = np.asarray(stacked[stack.name]).reshape(mesh.size * S, -1, DIM)
    grad = np.zeros_like(acts)
    for f in stack.features:
      rows = slice(f.sample_offset, f.sample_offset + f.samples_per_sc)
      np.testing.assert_array_equal(
        acts[:, rows], np.asarray(per_feature[f.name]).reshape(n, -1, DIM)
      )
      grad[:, rows] = grads[f.name].reshape(n, -1, DIM)
    stacked_grads[stack.name] = grad.reshape(-1, DIM)
  # Stacked gradients update as per-feature ones.
  _, backward = _step(mesh, specs, mesh.size, minibatching)
  _, stacked_backward = _step(
    mesh, specs, mesh.size, minibatching, backward={"perform_stacking": False}
  )
  copy = jax.tree.map(jnp.copy, variables)
  want = _logical(table_specs, backward(grads, buffers, copy), shards=n)
  copy = jax.tree.map(jnp.copy, variables)
  got = _logical(
    table_specs, stacked_backward(stacked_grads, buffers, copy), shards=n
  )
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
  # Limits on stack "c": its updated rows clipped, the others untouched
  # (rows outside the limits that the batch does not reference included).
  c = specs["fc"].table_spec.setting_in_stack.stack_name
  _, limited_backward = _step(
    mesh,
    specs,
    mesh.size,
    minibatching,
    backward={"embedding_var_limits": {c: (-0.25, 0.5)}},
  )
  copy = jax.tree.map(jnp.copy, variables)
  got = _logical(table_specs, limited_backward(grads, buffers, copy), shards=n)
  touched = np.unique(ids["fc"])
  untouched = np.setdiff1d(np.arange(len(before["c"])), touched)
  np.testing.assert_allclose(
    got["c"][touched], np.clip(want["c"][touched], -0.25, 0.5), rtol=1e-6
  )
  np.testing.assert_array_equal(got["c"][untouched], before["c"][untouched])
  assert np.abs(before["c"][untouched]).max() > 0.5
  for name in ("a", "b"):
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="unknown"):
    _step(
      mesh,
      specs,
      mesh.size,
      minibatching,
      backward={"embedding_var_limits": {"unknown": (0.0, 1.0)}},
    )[1](grads, buffers, jax.tree.map(jnp.copy, variables))
