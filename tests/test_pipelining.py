"""The pipelined step (`nn.pipelining`, and compat's
`embedding_pipelining_utils`) against a numpy restatement of its schedule.

K batches of random ids (ragged, with duplicates and empty samples) train
two tables (SGD and Adagrad) and a linear head `pred = sum_f acts_f @ w_f`,
loss `mean((pred - y)^2)`, through K + 2 pipeline steps on 8 devices. The
numpy reference runs the batches one after the other with the pipeline's
staleness written out: batch k is looked up in U_{max(k-1, 0)} (the tables
after batches 0 .. k-2), its update applied to U_k gives U_{k+1}, the head
is not stale. Its losses and tables must be the pipeline's; those of the
unpipelined schedule (batch k in U_k) must not.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.compat.lib.nn import (
  embedding,
  embedding_pipelining_utils,
  embedding_spec,
  table_stacking,
)
from pz_sparsecore.nn import pipelining

BATCH, DIM, K = 32, 4, 4
SGD_LR, ADAGRAD_LR, ACC0, HEAD_LR = 0.3, 0.2, 0.5, 0.1
# Table, vocabulary, optimizer of each feature.
FEATURES = {"fa": ("a", 40, "sgd"), "fb": ("b", 24, "adagrad")}


def _batches(seed=0):
  """K batches: feature -> list of id rows, and labels."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(K):
    ids = {}
    for name, (_, vocab, _) in FEATURES.items():
      rows = []
      for _ in range(BATCH):
        row = rng.integers(0, vocab, rng.integers(0, 5))
        if len(row) >= 2 and rng.random() < 0.5:
          row[-1] = row[0]  # a duplicate id in the sample
        rows.append(row.astype(np.int32))
      rows[0] = np.zeros(0, np.int32)  # an empty sample in every batch
      ids[name] = rows
    out.append((ids, rng.normal(size=BATCH).astype(np.float32)))
  return out


def _ragged(rows):
  leaf = np.empty(len(rows), object)
  leaf[:] = rows
  return leaf


def _reference(batches, tables, accumulator, head, stale):
  """Losses and U_0 .. U_K (tables, Adagrad accumulator) of the schedule."""
  tables = {k: v.astype(np.float64) for k, v in tables.items()}
  acc = accumulator.astype(np.float64)
  head = {k: v.astype(np.float64) for k, v in head.items()}
  states = [({k: v.copy() for k, v in tables.items()}, acc.copy())]
  losses = []
  for k, (ids, labels) in enumerate(batches):
    read = states[max(k - 1, 0) if stale else k][0]
    acts = {
      f: np.stack([read[FEATURES[f][0]][r].sum(0) for r in rows])
      for f, rows in ids.items()
    }
    pred = sum(acts[f] @ head[f] for f in acts)
    losses.append(np.mean((pred - labels) ** 2))
    d_pred = 2 * (pred - labels) / BATCH
    for f in acts:
      grad_acts = d_pred[:, None] * head[f][None, :]
      head[f] = head[f] - HEAD_LR * (d_pred @ acts[f])
      table, _, optimizer = FEATURES[f]
      row_grad = np.zeros_like(tables[table])
      for row, g in zip(ids[f], grad_acts, strict=True):
        np.add.at(row_grad, row, g)
      touched = np.unique(np.concatenate(ids[f]))
      if optimizer == "sgd":
        tables[table][touched] -= SGD_LR * row_grad[touched]
      else:
        acc[touched] += row_grad[touched] ** 2
        tables[table][touched] -= (
          ADAGRAD_LR * row_grad[touched] / np.sqrt(acc[touched])
        )
    states.append(({k: v.copy() for k, v in tables.items()}, acc.copy()))
  return np.array(losses), states


def _head_stage(optimizer):
  """The TensorCore stage: the head's loss, its SGD update, the activation
  gradients; the train state is (w, optax state, step), its aux the step."""

  def tc(acts, labels, train_state, sc_fwd_aux=None):
    del sc_fwd_aux
    w, opt_state, step = train_state

    def loss_of(w, acts):
      pred = sum(_plain(acts[f]) @ w[f] for f in w)
      return jnp.mean((pred - labels) ** 2)

    loss, (g_w, g_acts) = jax.value_and_grad(loss_of, (0, 1))(w, acts)
    updates, opt_state = optimizer.update(g_w, opt_state, w)
    w = optax.apply_updates(w, updates)
    return g_acts, loss, (w, opt_state, step + 1), step

  return tc


def _plain(x):
  if isinstance(x, pz.nx.NamedArray):
    return x.unwrap("batch", "embedding")
  return x


def _head(seed=1):
  rng = np.random.default_rng(seed)
  return {f: rng.normal(size=DIM).astype(np.float32) for f in FEATURES}


def _layer(mesh):
  optimizers = {
    "sgd": pzsc.SGDOptimizerSpec(learning_rate=SGD_LR),
    "adagrad": pzsc.AdagradOptimizerSpec(
      learning_rate=ADAGRAD_LR, initial_accumulator_value=ACC0
    ),
  }
  specs = {}
  for name, (table, vocab, optimizer) in FEATURES.items():
    spec = pzsc.TableSpec(
      name=table,
      vocabulary_size=vocab,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(1.0),
      optimizer=optimizers[optimizer],
      combiner="sum",
    )
    specs[name] = pzsc.FeatureSpec(
      name=name,
      table_spec=spec,
      input_shape=[BATCH, None],
      output_shape=[BATCH, DIM],
    )
  return pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), specs, mesh, num_sc_per_device=2
  )


def _state_of(layer):
  tables = pzsc.logical_tables(layer)
  return tables, pzsc.logical_slots(layer)["b"]["accumulator"]


def _run(first, inputs, train_state, variables, stages, read, **kw):
  """K + 2 pipeline steps, blocking on each; the valid outputs, and
  `read(variables)` after every step (before the next donates them).
  `jit_shardings` (optional): the step's in and out shardings."""
  sc_fwd, tc, sc_bwd = stages
  shardings = kw.pop("jit_shardings", {})
  state = pipelining.get_initial_state(
    first, train_state, variables, sc_fwd, tc, **kw
  )
  if shardings:
    state = jax.device_put(state, shardings["in_shardings"][3])

  def train_step(batch, train_state, variables, state, fake_tc_step):
    return pipelining.step(
      batch,
      train_state,
      variables,
      state,
      sc_fwd,
      tc,
      sc_bwd,
      fake_tc_step=fake_tc_step,
    )

  run = jax.jit(
    train_step, static_argnums=4, donate_argnums=(1, 2, 3), **shardings
  )
  structure = jax.tree.structure(state)
  losses, after = [], []
  for t in range(pipelining.get_pipeline_train_steps(K)):
    batch = inputs[t] if t < K else jax.tree.map(jnp.zeros_like, inputs[-1])
    valid = pipelining.is_output_valid(t, K)
    out, _, train_state, variables, state = run(
      batch, train_state, variables, state, not valid
    )
    assert jax.tree.structure(state) == structure
    assert int(state.pipeline_step) == t + 1
    if valid:
      losses.append(float(out))
    after.append(read(variables))
  return np.array(losses), after


def _check(losses, states_after, batches, initial):
  tables0, acc0, head0 = initial
  want, states = _reference(batches, tables0, acc0, head0, stale=True)
  np.testing.assert_allclose(losses, want, rtol=1e-5, atol=1e-5)
  for t, (tables, acc) in enumerate(states_after):
    ref_tables, ref_acc = states[max(t - 1, 0)]
    if t < pipelining.PIPELINE_DEPTH:  # warm-up: nothing written at all
      for name in tables:
        np.testing.assert_array_equal(tables[name], tables0[name])
      np.testing.assert_array_equal(acc, acc0)
    for name in tables:
      np.testing.assert_allclose(
        tables[name], ref_tables[name], rtol=1e-5, atol=1e-5
      )
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-5, atol=1e-5)
  # The staleness matters: the unpipelined schedule differs from batch 1.
  plain, _ = _reference(batches, tables0, acc0, head0, stale=False)
  np.testing.assert_allclose(losses[0], plain[0], rtol=1e-5)
  assert np.all(np.abs(losses[1:] - plain[1:]) > 1e-4)


def test_layer_pipeline_equals_stale_reference():
  mesh = Mesh(np.array(jax.devices()), ("d",))
  layer = _layer(mesh)
  stages = pipelining.embed_stages(layer)
  tables0, acc0 = _state_of(layer)
  head = _head()
  batches = _batches()
  labels = NamedSharding(mesh, P("d"))
  inputs = [
    pipelining.CurrentStepInput(
      sparse_inputs=layer.preprocess(
        {f: _ragged(rows) for f, rows in ids.items()}
      )[0],
      dense_inputs=jax.device_put(y, labels),
    )
    for ids, y in batches
  ]
  optimizer = optax.sgd(HEAD_LR)
  w = {f: jnp.asarray(v) for f, v in head.items()}
  train_state = (w, optimizer.init(w), jnp.zeros((), jnp.int32))
  losses, after = _run(
    inputs[0],
    inputs,
    train_state,
    stages.variables,
    (stages.sc_fwd, _head_stage(optimizer), stages.sc_bwd),
    lambda v: (v, _state_of(stages.layer(v))),
    sparse_input_sharding=labels,
  )
  _check(losses, [s for _, s in after], batches, (tables0, acc0, head))
  # The trained values go back into the model's own variables.
  stages.assign(after[-1][0])
  tables, _ = _state_of(layer)
  for name in tables:
    np.testing.assert_array_equal(tables[name], after[-1][1][0][name])


def test_initial_state_by_abstract_evaluation():
  """`get_initial_state` under `jax.eval_shape` gives the shapes of the
  concrete state (the layer's stages, nothing run)."""
  mesh = Mesh(np.array(jax.devices()), ("d",))
  layer = _layer(mesh)
  stages = pipelining.embed_stages(layer)
  ids, y = _batches()[0]
  first = pipelining.CurrentStepInput(
    sparse_inputs=layer.preprocess({f: _ragged(r) for f, r in ids.items()})[0],
    dense_inputs=jnp.asarray(y),
  )
  optimizer = optax.sgd(HEAD_LR)
  w = {f: jnp.asarray(v) for f, v in _head().items()}
  train_state = (w, optimizer.init(w), jnp.zeros((), jnp.int32))
  make = functools.partial(
    pipelining.get_initial_state,
    sc_fwd_function=stages.sc_fwd,
    tc_function=_head_stage(optimizer),
  )
  abstract = jax.eval_shape(make, first, train_state, stages.variables)
  concrete = make(first, train_state, stages.variables)
  assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
  pairs = zip(*map(jax.tree.leaves, (abstract, concrete)), strict=True)
  for a, c in pairs:
    assert (a.shape, a.dtype) == (c.shape, c.dtype)
  acts = concrete.last_step_inputs.embedding_activations
  assert set(acts) == set(FEATURES)
  assert acts["fa"].named_shape == {"batch": BATCH, "embedding": DIM}
  zeros = jax.tree.leaves(concrete.last_step_inputs.sparse_inputs)
  assert not any(np.any(x) for x in zeros)


def _compat_setup(mesh):
  """Upstream-style specs and variables (4 SparseCores per device)."""
  optimizers = {
    "sgd": embedding_spec.SGDOptimizerSpec(learning_rate=SGD_LR),
    "adagrad": embedding_spec.AdagradOptimizerSpec(
      learning_rate=ADAGRAD_LR, initial_accumulator_value=ACC0
    ),
  }
  specs = {
    name: embedding_spec.FeatureSpec(
      name=name,
      table_spec=embedding_spec.TableSpec(
        vocabulary_size=vocab,
        embedding_dim=DIM,
        initializer=jax.nn.initializers.normal(1.0),
        optimizer=optimizers[optimizer],
        combiner="sum",
        name=table,
      ),
      input_shape=[BATCH, None],
      output_shape=[BATCH, DIM],
    )
    for name, (table, vocab, optimizer) in FEATURES.items()
  }
  embedding.prepare_feature_specs_for_training(specs, mesh.size, 4)
  table_specs = {f.table_spec.name: f.table_spec for f in specs.values()}
  variables = embedding.init_embedding_variables(
    jax.random.key(3), table_specs, NamedSharding(mesh, P("d", None)), 4
  )
  return specs, table_specs, variables


def _compat_logical(table_specs, variables, shards):
  tables = {
    name: np.asarray(t)
    for name, t in table_stacking.unshard_and_unstack_tables(
      table_specs, {k: v.table for k, v in variables.items()}, shards
    ).items()
  }
  acc = table_stacking.unshard_and_unstack_tables(
    {"b": table_specs["b"]},
    {k: v.slot.accumulator for k, v in variables.items() if k == "b"},
    shards,
  )["b"]
  return tables, np.asarray(acc)


def test_compat_default_stages_equal_stale_reference():
  """Upstream's pattern: default stage functions, shardings from
  `get_pipeline_state_sharding`, zero inputs to drain."""
  ep = embedding_pipelining_utils
  mesh = Mesh(np.array(jax.devices()), ("d",))
  batch_sharding = NamedSharding(mesh, P("d"))
  specs, table_specs, variables = _compat_setup(mesh)
  shards = mesh.size * 4
  tables0, acc0 = _compat_logical(table_specs, variables, shards)
  head = _head()
  batches = _batches(seed=5)
  inputs = []
  for ids, y in batches:
    buffers, _ = embedding.preprocess_sparse_dense_matmul_input(
      {f: _ragged(rows) for f, rows in ids.items()},
      None,
      specs,
      local_device_count=mesh.size,
      global_device_count=mesh.size,
      num_sc_per_device=4,
    )
    inputs.append(
      jax.device_put(
        ep.CurrentStepInput(sparse_inputs=buffers, dense_inputs=y),
        batch_sharding,
      )
    )
  state_sharding = ep.get_pipeline_state_sharding(
    pipeline_state_cls=ep.PipelineState[
      ep.DefaultSparseInputs,
      jax.Array,
      ep.DefaultEmbeddingActivations,
      ep.DefaultEmbeddingGradients,
      ep.DefaultTcAux,
      ep.DefaultScFwdAux,
      jax.Array,
    ],  # fmt: skip
    dense_input_sharding=batch_sharding,
    sparse_input_sharding=batch_sharding,
    pipeline_output_sharding=NamedSharding(mesh, P()),
    tc_aux_sharding=NamedSharding(mesh, P()),
  )
  activations = state_sharding.last_step_inputs.embedding_activations
  assert activations == batch_sharding
  replicated = NamedSharding(mesh, P())
  tables = NamedSharding(mesh, P("d", None))
  optimizer = optax.sgd(HEAD_LR)
  w = {f: jnp.asarray(v) for f, v in head.items()}
  train_state = (w, optimizer.init(w), jnp.zeros((), jnp.int32))
  stages = (
    ep.get_default_sc_fwd_function(specs, mesh),
    _head_stage(optimizer),
    ep.get_default_sc_bwd_function(specs, mesh),
  )
  losses, after = _run(
    inputs[0],
    inputs,
    train_state,
    variables,
    stages,
    lambda v: _compat_logical(table_specs, v, shards),
    sparse_input_sharding=batch_sharding,
    dense_input_sharding=batch_sharding,
    jit_shardings={
      "in_shardings": (batch_sharding, replicated, tables, state_sharding),
      "out_shardings": (
        replicated,
        replicated,
        replicated,
        tables,
        state_sharding,
      ),
    },
  )
  _check(losses, after, batches, (tables0, acc0, head))


def test_bad_arguments_raise_value_errors():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
  with pytest.raises(ValueError, match=r"global_mesh must be 1d, got 2"):
    embedding_pipelining_utils.get_default_sc_fwd_function({}, mesh)
  with pytest.raises(ValueError, match="num_steps must be >= 0, got -1"):
    pipelining.get_pipeline_train_steps(-1)
  assert [pipelining.is_output_valid(t, 3) for t in range(5)] == [
    False,
    True,
    True,
    True,
    False,
  ]
