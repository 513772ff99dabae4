"""Row-wise optimizer state: `RowwiseAdagradOptimizerSpec` and slot shapes.

The references are numpy restatements in float64: FBGEMM's exact row-wise
Adagrad (`np_rowwise_adagrad`), and for custom slot shapes the user's
function restated per row.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_training as tt
from numerics import assert_close
from penzai import pz
from test_kernels import _grad_call, _table, make_buffers, row_grads

import pz_sparsecore as pzsc
from pz_sparsecore.core import optimizers, specs
from pz_sparsecore.device import replication
from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.training import NonFiniteUpdateError, SparseCoreTrainer
from pz_sparsecore.viz import treescope as viz_treescope

ROWWISE = specs.RowwiseAdagradOptimizerSpec(
  learning_rate=0.2, epsilon=1e-6, initial_accumulator_value=0.05
)


def np_rowwise_adagrad(w, a, g, *, lr, eps, dim, wd=0.0, mode="none"):
  """FBGEMM's exact row-wise Adagrad on rows `w` [R, D] with accumulators
  `a` [R] and summed gradients `g` [R, D], float64; the mean square runs
  over the table's own first `dim` columns."""
  w, a, g = (np.asarray(x, np.float64) for x in (w, a, g))
  gd = g + wd * w if mode == "l2" else g
  a = a + (gd[:, :dim] ** 2).sum(axis=1) / dim
  m = lr / (np.sqrt(a) + eps)
  corr = {"l2": 1 - m * wd, "decoupled": 1 - lr * wd}.get(mode, 1.0)
  return np.asarray(corr)[..., None] * w - m[:, None] * g, a


# ---------------------------------------------------------------------------
# The fused update.


IMPLS = ["ffi", "reference"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
  "mode,wd", [("none", 0.0), ("l2", 0.05), ("decoupled", 0.1)]
)
def test_fused_update_matches_numpy(impl, mode, wd):
  # Duplicates across samples and segments, a row referenced only with gain
  # 0, rows on partition boundaries; width 16 with the table's own 12
  # columns (a stack padded to 16).
  buf = make_buffers(9, num_segments=3, num_partitions=4)
  table = _table(buf, 16, seed=1)
  acc = np.random.default_rng(2).uniform(0, 0.5, (table.shape[0], 1))
  acc = acc.astype(np.float32)
  act = np.random.default_rng(3).normal(size=(48, 16)).astype(np.float32)
  spec = specs.RowwiseAdagradOptimizerSpec(
    learning_rate=0.05, epsilon=1e-6, weight_decay=wd, weight_decay_mode=mode
  )
  hp = jnp.stack(spec.get_hyperparameters(0, embedding_dim=12))
  new, (new_acc,) = _grad_call(
    buf, act, table, (acc,), "rowwise_adagrad", hp, impl, **buf.layout()
  )
  new, new_acc = np.asarray(new), np.asarray(new_acc)
  assert new_acc.shape == acc.shape == (table.shape[0], 1)
  grads = row_grads(buf, act, table.shape[0])
  rows = np.asarray(sorted(grads))
  assert 2 * buf.rows_per_partition - 2 in grads  # Referenced with gain 0.
  want_w, want_a = np_rowwise_adagrad(
    table[rows],
    acc[rows, 0],
    np.stack([grads[r] for r in rows]),
    lr=0.05,
    eps=1e-6,
    dim=12,
    wd=wd,
    mode=mode,
  )
  assert_close(new[rows], want_w, rtol=1e-5, atol=1e-6)
  assert_close(new_acc[rows, 0], want_a, rtol=1e-5, atol=1e-7)
  other = np.setdiff1d(np.arange(table.shape[0]), rows)
  assert len(other) > 0
  np.testing.assert_array_equal(new[other], table[other])
  np.testing.assert_array_equal(new_acc[other], acc[other])


@pytest.mark.parametrize("impl", IMPLS)
def test_a_table_shaped_accumulator_is_refused_then_the_right_one_works(impl):
  buf = make_buffers(3, num_segments=2, num_partitions=2)
  table = _table(buf, 8, seed=1)
  act = np.ones((32, 8), np.float32)
  hp = jnp.stack(ROWWISE.get_hyperparameters(0, embedding_dim=8))
  with pytest.raises(ValueError, match=r"slot 'accumulator' must have shape"):
    _grad_call(
      buf,
      act,
      table,
      (np.zeros_like(table),),
      "rowwise_adagrad",
      hp,
      impl,
      **buf.layout(),
    )
  acc = np.zeros((table.shape[0], 1), np.float32)
  new, (new_acc,) = _grad_call(
    buf, act, table, (acc,), "rowwise_adagrad", hp, impl, **buf.layout()
  )
  assert np.isfinite(np.asarray(new)).all()
  assert (np.asarray(new_acc) >= 0).all() and np.asarray(new_acc).any()


def test_spec_refuses_undefined_updates_and_needs_the_width():
  with pytest.raises(ValueError, match="epsilon and initial_accumulator_value"):
    specs.RowwiseAdagradOptimizerSpec(epsilon=0.0)
  with pytest.raises(ValueError, match="weight_decay_mode must be"):
    specs.RowwiseAdagradOptimizerSpec(weight_decay_mode="l1")
  with pytest.raises(ValueError, match="weight_decay must be >= 0"):
    specs.RowwiseAdagradOptimizerSpec(weight_decay=-1.0)
  spec = specs.RowwiseAdagradOptimizerSpec()
  assert (spec.learning_rate, spec.epsilon, spec.initial_accumulator_value) == (
    0.01,
    1e-8,
    0.0,
  )
  assert spec.slot_shapes() == (optimizers.SlotShape.ROWWISE_1D,)
  with pytest.raises(ValueError, match="embedding_dim"):
    spec.get_hyperparameters(0)
  got = [float(x) for x in spec.get_hyperparameters(0, embedding_dim=12)]
  assert got == pytest.approx([0.01, 1e-8, 12.0, 0.0, 0.0])


# ---------------------------------------------------------------------------
# The layer and the trainer.

# Two row-wise tables of width 12 (one stack, padded to 16), one of width
# 16 (its own stack: the mean divides by the table's own width) and an
# Adagrad table of width 12.
TABLES = {
  "ra": (ROWWISE, "sum", 90, 12),
  "rb": (ROWWISE, "sum", 72, 12),
  "rc": (ROWWISE, "sum", 60, 16),
  "ad": (specs.AdagradOptimizerSpec(learning_rate=0.1), "sum", 40, 12),
}


class Reference(tt.Reference):
  """`test_training`'s reference with row-wise accumulators `[vocab]`."""

  def __init__(self, tables, table_specs):
    super().__init__(tables, table_specs)
    for name, (opt, _, vocab, _) in table_specs.items():
      if isinstance(opt, specs.RowwiseAdagradOptimizerSpec):
        init = np.float32(opt.initial_accumulator_value)
        self.slots[name] = {"accumulator": np.full(vocab, init, np.float64)}

  @staticmethod
  def initial_slots(opt):
    if isinstance(opt, specs.RowwiseAdagradOptimizerSpec):
      return {}  # Set in __init__ (one value per row).
    return tt.initial_slots(opt)

  @staticmethod
  def row_update(opt, w, slots, g, step):
    if not isinstance(opt, specs.RowwiseAdagradOptimizerSpec):
      return tt.row_update(opt, w, slots, g, step)
    new_w, a = np_rowwise_adagrad(
      w,
      slots["accumulator"],
      g,
      lr=opt.learning_rate,
      eps=opt.epsilon,
      dim=w.shape[1],
      wd=opt.weight_decay,
      mode=opt.weight_decay_mode,
    )
    return new_w, {"accumulator": a}


def _trainer(model):
  return SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(tt.DENSE_LR), tt.loss_fn
  )


def _step(trainer, ref, step, grads=None):
  ids, weights = tt.make_batch(100 + step, TABLES)
  inputs, _ = trainer.model.embed.preprocess(ids, weights)
  grads = grads if grads is not None else tt.act_grads(3 + step, TABLES)
  trainer.step(
    inputs=inputs, grads={k: jnp.asarray(v) for k, v in grads.items()}
  )
  return ref.step(ids, weights, grads, step)


@pytest.mark.parametrize("g,s,exchange", [(1, 1, "auto"), (4, 2, "rows")])
def test_trainer_matches_numpy(g, s, exchange):
  model = tt.build_model(g, s, TABLES, exchange=exchange)
  plan = model.embed.config.plan
  assert sorted(t.name for t in plan.stack_of_table["ra"].tables) == [
    "ra",
    "rb",
  ]
  assert [t.name for t in plan.stack_of_table["rc"].tables] == ["rc"]
  # Physically [N, V_shard, 1], its last axis not the embedding axis.
  acc = model.embed.slots[plan.stack_of_table["ra"].name]["accumulator"]
  assert dict(acc.value.named_shape) == {
    "sc_shard": g * s,
    "sc_row": plan.stack_of_table["ra"].rows_per_shard,
    "sc_slot": 1,
  }
  ref = Reference(tt.initial_tables(11, TABLES), TABLES)
  before = tt.snapshot(model.embed)
  assert before[1]["ra"]["accumulator"].shape == (90,)
  assert before[1]["ad"]["accumulator"].shape == (40, 12)
  trainer = _trainer(model)
  for step in range(3):
    touched = _step(trainer, ref, step)
    tt.check_against(trainer.model.embed, ref, touched, before)
    before = tt.snapshot(trainer.model.embed)


def test_non_finite_gradient_is_skipped_then_training_goes_on():
  model = tt.build_model(8, 1, TABLES)
  ref = Reference(tt.initial_tables(11, TABLES), TABLES)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1),
    model,
    optax.sgd(tt.DENSE_LR),
    tt.loss_fn,
    check_finite=True,
  )
  before = tt.snapshot(trainer.model.embed)
  bad = tt.act_grads(3, TABLES)
  bad["f_ra"][0, 0] = np.nan
  ids, weights = tt.make_batch(100, TABLES)
  inputs, _ = trainer.model.embed.preprocess(ids, weights)
  with pytest.raises(NonFiniteUpdateError):
    trainer.step(
      inputs=inputs, grads={k: jnp.asarray(v) for k, v in bad.items()}
    )
  after = tt.snapshot(trainer.model.embed)
  for got, want in zip(after, before, strict=True):
    for name in TABLES:
      for leaf_got, leaf_want in zip(
        jax.tree.leaves(got[name]), jax.tree.leaves(want[name]), strict=True
      ):
        np.testing.assert_array_equal(leaf_got, leaf_want, err_msg=name)
  # The next step (the refused one's step counter has advanced).
  touched = _step(trainer, ref, 1)
  tt.check_against(trainer.model.embed, ref, touched, before)


def test_logical_slots_round_trip_and_a_wrong_shape_changes_nothing():
  model = tt.build_model(8, 1, TABLES)
  embed = model.embed
  before = pzsc.logical_slots(embed)
  with pytest.raises(ValueError, match=r"expected shape \(90,\)"):
    pzsc.set_logical_slots(
      embed,
      {
        "rc": {"accumulator": np.ones(60, np.float32)},
        "ra": {"accumulator": np.ones((90, 1), np.float32)},
      },
    )
  after = pzsc.logical_slots(embed)
  for name in TABLES:
    np.testing.assert_array_equal(
      after[name]["accumulator"], before[name]["accumulator"]
    )
  new = np.random.default_rng(0).uniform(0, 1, 90).astype(np.float32)
  pzsc.set_logical_slots(embed, {"ra": {"accumulator": new}})
  got = pzsc.logical_slots(embed)
  np.testing.assert_array_equal(got["ra"]["accumulator"], new)
  np.testing.assert_array_equal(
    got["rb"]["accumulator"], before["rb"]["accumulator"]
  )


def test_checkpoint_restores_across_topologies_and_names_the_slot_shape(
  tmp_path,
):
  model = tt.build_model(8, 1, TABLES)
  trainer = _trainer(model)
  ref = Reference(tt.initial_tables(11, TABLES), TABLES)
  _step(trainer, ref, 0)
  save_checkpoint(tmp_path, trainer.model)
  path = pathlib.Path(tmp_path) / "0" / "manifest" / "metadata"
  manifest = json.loads(path.read_text())
  stacks = manifest["embeds"]["emb"]
  shapes = {name: entry["slot_shapes"] for name, entry in stacks.items()}
  assert shapes[trainer.model.embed.config.plan.stack_of_table["rc"].name] == {
    "accumulator": "rowwise_1d"
  }
  assert shapes[trainer.model.embed.config.plan.stack_of_table["ad"].name] == {
    "accumulator": "table"
  }
  want = tt.snapshot(trainer.model.embed)
  for g, s in ((8, 1), (4, 2), (1, 1)):
    fresh = tt.build_model(g, s, TABLES, seed=5)
    restored = restore_checkpoint(tmp_path, fresh)
    got = tt.snapshot(restored.embed)
    for name in TABLES:
      np.testing.assert_array_equal(got[0][name], want[0][name], err_msg=name)
      np.testing.assert_array_equal(
        got[1][name]["accumulator"], want[1][name]["accumulator"]
      )
  # A model whose tables keep an accumulator per element is refused, naming
  # both slot shapes; the right model then restores.
  adagrad = {
    k: (specs.AdagradOptimizerSpec(learning_rate=0.2), *v[1:])
    for k, v in TABLES.items()
  }
  with pytest.raises(
    ValueError,
    match=r"checkpoint optimizer rowwise_adagrad \(slots "
    r"accumulator\[rowwise_1d\]\), model adagrad \(slots accumulator\)",
  ):
    restore_checkpoint(tmp_path, tt.build_model(8, 1, adagrad))
  restored = restore_checkpoint(tmp_path, tt.build_model(2, 1, TABLES))
  np.testing.assert_array_equal(
    tt.snapshot(restored.embed)[1]["rc"]["accumulator"],
    want[1]["rc"]["accumulator"],
  )


def test_replication_cost_and_treescope_count_one_value_per_row():
  model = tt.build_model(8, 1, TABLES)
  plan = model.embed.config.plan
  stack = plan.stack_of_table["rc"]
  cost = replication.cost(plan, stack)
  assert cost.replicated_bytes == 4 * 8 * stack.rows_per_shard * (16 + 1)
  adagrad = plan.stack_of_table["ad"]
  assert replication.cost(plan, adagrad).replicated_bytes == (
    4 * 8 * adagrad.rows_per_shard * (16 + 16)
  )
  assert viz_treescope.optimizer_summary(ROWWISE) == (
    "rowwise_adagrad(lr=0.2; accumulator per row)"
  )
  assert "accumulator per row" in pzsc.viz.describe(model.embed)


def test_tables_of_different_widths_never_share_a_row_wise_stack():
  features = tt.feature_specs(4, 1, TABLES)
  with pytest.raises(ValueError, match="different embedding_dims"):
    pzsc.stack_tables(features, ["ra", "rc"], 4, 1)
  stacked = pzsc.stack_tables(features, ["ra", "rb"], 4, 1)
  names = {f.table_spec.setting_in_stack.stack_name for f in stacked.values()}
  assert len(names) == 3


# ---------------------------------------------------------------------------
# Custom optimizers declare slot shapes, as upstream.


def _stats_fn(grad, table, stats, lr):
  # stats: [1, 3] = running (sum g, sum g^2, count) of the row.
  new = stats + jnp.concatenate(
    [
      jnp.sum(grad, axis=1, keepdims=True),
      jnp.sum(grad * grad, axis=1, keepdims=True),
      jnp.ones((1, 1), jnp.float32),
    ],
    axis=1,
  )
  return table - lr * grad / jnp.sqrt(1.0 + new[:, 1:2]), new


def _rowwise_fn(grad, table, acc, lr):
  # acc: [1], one value per row.
  acc = acc + jnp.mean(grad * grad)
  return table - lr * grad / jnp.sqrt(acc), acc


CUSTOM = {
  "stats": (
    specs.CustomOptimizerSpec(
      0.1,
      _stats_fn,
      (jax.nn.initializers.constant(0.0),),
      "stats",
      slot_shapes=(3,),
    ),
    "sum",
    50,
    8,
  ),
  "rw": (
    specs.CustomOptimizerSpec(
      0.1,
      _rowwise_fn,
      (jax.nn.initializers.constant(0.5),),
      "rowwise_custom",
      slot_shapes=("1d",),
    ),
    "sum",
    40,
    8,
  ),
}


def _custom_numpy(name, w, slot, g):
  lr = 0.1
  if name == "stats":
    new = slot + np.stack([g.sum(1), (g * g).sum(1), np.ones(len(g))], axis=1)
    return w - lr * g / np.sqrt(1 + new[:, 1:2]), new
  acc = slot + (g * g).mean(1)
  return w - lr * g / np.sqrt(acc)[:, None], acc


def test_custom_optimizers_with_shaped_slots_match_numpy():
  model = tt.build_model(4, 1, CUSTOM)
  slots = pzsc.logical_slots(model.embed)
  assert slots["stats"]["slot_0"].shape == (50, 3)
  assert slots["rw"]["slot_0"].shape == (40,)
  np.testing.assert_array_equal(slots["rw"]["slot_0"], 0.5)
  tables = {
    k: v.astype(np.float64) for k, v in tt.initial_tables(11, CUSTOM).items()
  }
  state = {
    k: {"slot_0": v["slot_0"].astype(np.float64)} for k, v in slots.items()
  }
  trainer = _trainer(model)
  for step in range(2):
    ids, weights = tt.make_batch(200 + step, CUSTOM)
    grads = tt.act_grads(7 + step, CUSTOM)
    inputs, _ = trainer.model.embed.preprocess(ids, weights)
    trainer.step(
      inputs=inputs, grads={k: jnp.asarray(v) for k, v in grads.items()}
    )
    for name, (_, combiner, vocab, dim) in CUSTOM.items():
      feature = f"f_{name}"
      g = np.zeros((vocab, dim))
      for b, row in enumerate(ids[feature]):
        gain = tt.gains(weights[feature][b], combiner)
        for r, gj in zip(row, gain, strict=True):
          g[r] += gj * grads[feature][b]
      rows = np.unique(np.concatenate(ids[feature]))
      tables[name][rows], state[name]["slot_0"][rows] = _custom_numpy(
        name, tables[name][rows], state[name]["slot_0"][rows], g[rows]
      )
  got_tables = pzsc.logical_tables(trainer.model.embed)
  got_slots = pzsc.logical_slots(trainer.model.embed)
  for name in CUSTOM:
    assert_close(got_tables[name], tables[name], 2e-4, 2e-5)
    assert_close(got_slots[name]["slot_0"], state[name]["slot_0"], 2e-4, 2e-5)


def test_custom_slot_shape_errors_name_the_shapes():
  with pytest.raises(ValueError, match="slot_shapes must be a tuple of 1"):
    specs.CustomOptimizerSpec(
      0.1, _rowwise_fn, (jax.nn.initializers.zeros,), slot_shapes=(1, 2)
    )
  with pytest.raises(ValueError, match="slot shape 'rows'"):
    specs.CustomOptimizerSpec(
      0.1, _rowwise_fn, (jax.nn.initializers.zeros,), slot_shapes=("rows",)
    )
  # A function returning a table-shaped slot for a row-wise one.
  wrong = specs.CustomOptimizerSpec(
    0.1,
    lambda g, w, a, lr: (w - lr * g, jnp.broadcast_to(a[:, None], w.shape)),
    (jax.nn.initializers.zeros,),
    "wrong",
    slot_shapes=("rowwise_1d",),
  )
  update = wrong.definition.update
  w = jnp.ones((3, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"shaped \[\(1, 8\), \(1,\)\]"):
    update(w, (jnp.zeros((3, 1), jnp.float32),), w, jnp.ones(1, jnp.float32))


# ---------------------------------------------------------------------------
# The compat namespace: upstream's device functions on a row-wise table.


def test_compat_device_step_equals_numpy():
  import test_compat_device as tcd

  from pz_sparsecore.compat.lib.nn import embedding, embedding_spec
  from pz_sparsecore.core import layout

  specs_ = tcd._specs()
  table = specs_["fc"].table_spec
  rowwise = specs.RowwiseAdagradOptimizerSpec(
    learning_rate=tcd.LR, epsilon=1e-6, initial_accumulator_value=0.5
  )
  specs_["fc"] = embedding_spec.FeatureSpec(
    table_spec=embedding_spec.TableSpec(
      vocabulary_size=table.vocabulary_size,
      embedding_dim=table.embedding_dim,
      initializer=table.initializer,
      optimizer=rowwise,
      combiner="sum",
      name="c",
      max_ids_per_partition=64,
      max_unique_ids_per_partition=64,
    ),
    input_shape=[tcd.BATCH, 3],
    output_shape=[tcd.BATCH, tcd.DIM],
    name="fc",
  )
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("device",))
  g, n = mesh.size, mesh.size * tcd.S
  embedding.prepare_feature_specs_for_training(specs_, g, tcd.S)
  rng = np.random.default_rng(0)
  ids = {
    name: rng.integers(0, f.table_spec.vocabulary_size, (tcd.BATCH, 3))
    for name, f in specs_.items()
  }
  ids["fc"][:2] = [[0, 95, 95], [1, 1, 1]]  # edges, duplicates
  buffers, _ = embedding.preprocess_sparse_dense_matmul_input(
    ids, None, specs_, g, g, num_sc_per_device=tcd.S
  )
  buffers = jax.device_put(buffers, jax.NamedSharding(mesh, jax.P("device")))
  table_specs = {f.table_spec.name: f.table_spec for f in specs_.values()}
  variables = embedding.init_embedding_variables(
    jax.random.key(3),
    table_specs,
    jax.NamedSharding(mesh, jax.P("device", None)),
    tcd.S,
  )
  stack = table_specs["c"].setting_in_stack.stack_name
  assert variables[stack].slot.accumulator.shape[-1] == 1

  def logical(variables, slot=None):
    value = variables[stack]
    value = value.table if slot is None else getattr(value.slot, slot)
    return layout.unshard_and_unstack_tables(
      {"fc": embedding_spec.to_pz(specs_)["fc"]},
      {stack: np.asarray(value)},
      n,
      slot_shape=None if slot is None else "rowwise_1d",
    )["c"]

  before, acc = logical(variables), logical(variables, "accumulator")
  np.testing.assert_array_equal(acc, 0.5)
  _, backward = tcd._step(mesh, specs_, g)
  grads = {
    name: rng.normal(size=(tcd.BATCH, tcd.DIM)).astype(np.float32)
    for name in specs_
  }
  new = backward(grads, buffers, variables)
  row_grad = np.zeros_like(before, np.float64)
  np.add.at(row_grad, ids["fc"], grads["fc"][:, None, :].astype(np.float64))
  touched = np.unique(ids["fc"])
  want_w, want_a = np_rowwise_adagrad(
    before[touched],
    acc[touched],
    row_grad[touched],
    lr=tcd.LR,
    eps=1e-6,
    dim=tcd.DIM,
  )
  assert_close(logical(new)[touched], want_w, 1e-5, 1e-5)
  assert_close(logical(new, "accumulator")[touched], want_a, 1e-5, 1e-6)
  other = np.setdiff1d(np.arange(len(before)), touched)
  np.testing.assert_array_equal(logical(new)[other], before[other])


def test_replicated_row_wise_table_trains_as_the_sharded_one():
  # rc replicated on every device: the row gradients are summed over the
  # devices, then each copy gets the same row-wise update.
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    tt.feature_specs(8, 1, TABLES),
    tt.mesh_of(8),
    placement={"rc": "replicated"},
  )
  assert embed.config.topology.is_replicated(
    embed.config.plan.stack_of_table["rc"].name
  )
  pzsc.set_logical_tables(embed, tt.initial_tables(11, TABLES))
  model = tt.ProbeModel(
    embed=embed, w=pz.Parameter(value=jnp.asarray(tt.W0), label="w")
  )
  ref = Reference(tt.initial_tables(11, TABLES), TABLES)
  before = tt.snapshot(model.embed)
  trainer = _trainer(model)
  for step in range(2):
    touched = _step(trainer, ref, step)
    tt.check_against(trainer.model.embed, ref, touched, before)
    before = tt.snapshot(trainer.model.embed)
