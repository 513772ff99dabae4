"""16-bit tables from the public API: `TableSpec(dtype=...)` through the
layer, the trainer and checkpoints.

References: the same model with float32 tables holding the same values
(the activation gradients are given, so both see the same row gradients:
their slots match bit for bit and their tables within a 16-bit step per
update), and a second run of the 16-bit model (the same bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_training as tt
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout, specs
from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.training import SparseCoreTrainer

# Table name -> (optimizer, combiner, vocab, dim).
TABLES = {
  "a": (specs.AdagradOptimizerSpec(learning_rate=0.1), "sum", 90, 16),
  "b": (
    specs.RowwiseAdagradOptimizerSpec(learning_rate=0.1),
    "sum",
    60,
    16,
  ),
  "c": (specs.SGDOptimizerSpec(learning_rate=0.2), "mean", 40, 8),
}


def _features(g, s, dtypes, activations):
  return {
    name: f.replace(
      table_spec=f.table_spec.replace(
        dtype=dtypes[name[2:]], activation_dtype=activations[name[2:]]
      )
    )
    for name, f in tt.feature_specs(g, s, TABLES).items()
  }


def _model(g, s, dtype, seed=0, activations=jnp.float32):
  dtypes = dtype if isinstance(dtype, dict) else dict.fromkeys(TABLES, dtype)
  if not isinstance(activations, dict):
    activations = dict.fromkeys(TABLES, activations)
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(seed),
    _features(g, s, dtypes, activations),
    tt.mesh_of(g),
    num_sc_per_device=s,
  )
  # Initial values representable in bfloat16: both models start equal.
  start = {
    k: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)
    for k, v in tt.initial_tables(11, TABLES).items()
  }
  pzsc.set_logical_tables(embed, start)
  return tt.ProbeModel(
    embed=embed, w=pz.Parameter(value=jnp.asarray(tt.W0), label="w")
  )


def _train(model, steps=3, grad_dtypes=None):
  """`steps` steps of `tt.loss_fn` (given activation gradients; with
  `grad_dtypes`, feature -> dtype, each rounded to nearest in that dtype
  and widened back first)."""
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(tt.DENSE_LR), tt.loss_fn
  )
  for step in range(steps):
    ids, weights = tt.make_batch(100 + step, TABLES)
    inputs, _ = trainer.model.embed.preprocess(ids, weights)
    grads = tt.act_grads(3 + step, TABLES)
    if grad_dtypes is not None:
      grads = {
        k: v.astype(jnp.dtype(grad_dtypes[k])).astype(np.float32)
        for k, v in grads.items()
      }
    trainer.step(
      inputs=inputs, grads={k: jnp.asarray(v) for k, v in grads.items()}
    )
  return trainer


@pytest.mark.parametrize(
  "dtype,g,s", [(jnp.bfloat16, 4, 2), (jnp.float16, 1, 1)]
)
def test_a_16_bit_layer_trains_as_the_float32_one(dtype, g, s):
  model = _model(g, s, dtype)
  for stack, var in model.embed.tables.items():
    assert var.value.dtype == dtype, stack
  for slots in model.embed.slots.values():
    assert all(v.value.dtype == jnp.float32 for v in slots.values())
  got = _train(model).model.embed
  want = _train(_model(g, s, jnp.float32)).model.embed
  tables, slots = pzsc.logical_tables(got), pzsc.logical_slots(got)
  want_tables, want_slots = (
    pzsc.logical_tables(want),
    pzsc.logical_slots(want),
  )
  # The row gradients are the same: so are the slots.
  for name in TABLES:
    for slot, value in slots.get(name, {}).items():
      np.testing.assert_array_equal(
        value, want_slots[name][slot], err_msg=f"{name} {slot}"
      )
    # Three updates, each rounded to one of two 16-bit neighbours: at most
    # one step of the largest magnitude the table holds, per update.
    bits = 7 if dtype == jnp.bfloat16 else 10
    largest = np.abs(want_tables[name]).max()
    spacing = 2.0 ** (np.floor(np.log2(largest)) - bits)
    np.testing.assert_allclose(
      np.asarray(tables[name], np.float32),
      want_tables[name],
      rtol=0,
      atol=3 * spacing,
      err_msg=name,
    )
    assert tables[name].dtype == jnp.dtype(dtype)
  # A second run gives the same bits.
  again = pzsc.logical_tables(_train(_model(g, s, dtype)).model.embed)
  for name in TABLES:
    np.testing.assert_array_equal(
      tables[name].view(np.uint16), again[name].view(np.uint16)
    )


def test_tables_of_different_dtypes_never_share_a_stack():
  model = _model(4, 2, {"a": jnp.bfloat16, "b": jnp.bfloat16, "c": "float32"})
  plan = model.embed.config.plan
  dtypes = {t: plan.stack_of_table[t].dtype.name for t in TABLES}
  assert dtypes == {"a": "bfloat16", "b": "bfloat16", "c": "float32"}
  same = {**TABLES, "d": TABLES["a"]}
  features = tt.feature_specs(4, 2, same)
  features = {
    k: f.replace(
      table_spec=f.table_spec.replace(
        dtype=jnp.bfloat16 if k == "f_d" else jnp.float32
      )
    )
    for k, f in features.items()
  }
  groups = layout.compatible_table_groups(features, 4, 2)
  assert ["a"] in groups and ["d"] in groups
  with pytest.raises(ValueError, match=r"different dtypes \('a': float32, "):
    layout.stack_tables(features, ["a", "d"], 4, 2)
  # The same tables in one dtype stack.
  layout.stack_tables(tt.feature_specs(4, 2, same), ["a", "d"], 4, 2)


def _table_x(**dtypes):
  """Table "x" (table "a"'s settings) with `dtypes` (dtype=...,
  activation_dtype=...)."""
  opt, combiner, vocab, dim = TABLES["a"]
  return specs.TableSpec(
    name="x",
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.zeros,
    optimizer=opt,
    combiner=combiner,
    **dtypes,
  )


def test_a_table_dtype_outside_the_list_is_refused():
  with pytest.raises(ValueError, match=r"table 'x': dtype must be one of"):
    _table_x(dtype=jnp.int8)
  assert _table_x(dtype="bfloat16").dtype == jnp.bfloat16


def test_checkpoint_keeps_the_dtype_and_refuses_another(tmp_path):
  trainer = _train(_model(4, 2, jnp.bfloat16), steps=1)
  save_checkpoint(tmp_path, trainer.model)
  want = pzsc.logical_tables(trainer.model.embed)
  with pytest.raises(
    ValueError, match=r"checkpoint dtype bfloat16, model float32"
  ):
    restore_checkpoint(tmp_path, _model(4, 2, jnp.float32, seed=5))
  for g, s in ((4, 2), (1, 1)):
    restored = restore_checkpoint(tmp_path, _model(g, s, jnp.bfloat16, seed=5))
    got = pzsc.logical_tables(restored.embed)
    for name in TABLES:
      np.testing.assert_array_equal(
        got[name].view(np.uint16), want[name].view(np.uint16)
      )


def test_checkpoint_restores_across_dtypes_with_an_explicit_cast(tmp_path):
  # A float32 model whose rows are not all representable in 16 bits.
  model = _model(4, 2, jnp.float32)
  rng = np.random.default_rng(7)
  values = {
    name: rng.normal(size=(vocab, dim)).astype(np.float32)
    for name, (_, _, vocab, dim) in TABLES.items()
  }
  pzsc.set_logical_tables(model.embed, values)
  wide = tmp_path / "wide"
  save_checkpoint(wide, model)
  for dtype in (jnp.bfloat16, jnp.float16):
    target = _model(4, 2, dtype, seed=5)
    with pytest.raises(ValueError, match=r"cast_tables=True"):
      restore_checkpoint(wide, target)
    with pytest.raises(ValueError, match=r"cast_tables must be True or"):
      restore_checkpoint(wide, target, cast_tables="yes")
    # The user's next call, with the cast, on another topology too.
    for g, s in ((4, 2), (1, 1)):
      restored = restore_checkpoint(
        wide, _model(g, s, dtype, seed=5), cast_tables=True
      )
      got = pzsc.logical_tables(restored.embed)
      for name in TABLES:
        assert got[name].dtype == jnp.dtype(dtype)
        # numpy's cast: to nearest, ties to even.
        want = values[name].astype(jnp.dtype(dtype))
        np.testing.assert_array_equal(
          got[name].view(np.uint16), want.view(np.uint16)
        )
  # 16 bits to float32 widens exactly; slots stay float32.
  narrow = tmp_path / "narrow"
  trainer = _train(_model(4, 2, jnp.bfloat16), steps=1)
  save_checkpoint(narrow, trainer.model)
  restored = restore_checkpoint(
    narrow, _model(1, 1, jnp.float32, seed=5), cast_tables=True
  )
  got = pzsc.logical_tables(restored.embed)
  want = pzsc.logical_tables(trainer.model.embed)
  for name in TABLES:
    assert got[name].dtype == np.float32
    np.testing.assert_array_equal(got[name], want[name].astype(np.float32))
  got_slots = pzsc.logical_slots(restored.embed)
  want_slots = pzsc.logical_slots(trainer.model.embed)
  assert set(got_slots) == set(want_slots) == {"a", "b"}  # "c" is SGD.
  for name, slots in want_slots.items():
    for slot, value in slots.items():
      assert value.dtype == np.float32
      np.testing.assert_array_equal(got_slots[name][slot], value)


def test_describe_and_specs_name_a_16_bit_dtype():
  model = _model(4, 2, {"a": jnp.bfloat16, "b": jnp.bfloat16, "c": "float16"})
  text = pzsc.viz.describe(model.embed)
  stacks = [line for line in text.splitlines() if "stack '" in line]
  assert len(stacks) == 3  # Three optimizers.
  assert sum(" x 16 bfloat16, " in line for line in stacks) == 2
  assert sum(" x 8 float16, " in line for line in stacks) == 1
  spec = model.embed.config.plan.stack_of_table["a"].spec
  assert "bfloat16" in pzsc.viz.describe(spec)
  # float32, the default, is not named.
  plain = pzsc.viz.describe(_model(4, 2, jnp.float32).embed)
  assert "float32" not in plain and "bfloat16" not in plain


@pytest.mark.parametrize("g,s", [(4, 2), (1, 1)])
def test_activations_in_a_16_bit_dtype_on_request(g, s):
  """Each feature's activations in its table's `activation_dtype` (float32
  sums rounded to nearest); the loss's gradient then comes in that dtype,
  and the update reads it widened: the tables equal those of a float32
  model given the same gradients rounded to that dtype."""
  acts = {"a": jnp.bfloat16, "b": jnp.float16, "c": jnp.float32}
  tables = {"a": jnp.float32, "b": jnp.bfloat16, "c": jnp.float32}
  model = _model(g, s, tables, activations=acts)
  plain = _model(g, s, tables)
  ids, weights = tt.make_batch(100, TABLES)
  inputs, _ = model.embed.preprocess(ids, weights)
  got, want = model.embed(inputs), plain.embed(inputs)
  for name, dtype in acts.items():
    value = got[f"f_{name}"].unwrap("batch", "embedding")
    assert value.dtype == jnp.dtype(dtype), name
    wide = want[f"f_{name}"].unwrap("batch", "embedding")
    assert wide.dtype == jnp.float32
    np.testing.assert_array_equal(
      np.asarray(value), np.asarray(wide.astype(dtype)), err_msg=name
    )
  # The specs' summaries name a 16-bit activation dtype.
  feature = model.embed.config.plan.features["f_a"].spec
  assert "output [32, 16] bfloat16;" in pzsc.viz.describe(feature)
  assert "activations bfloat16" in pzsc.viz.describe(feature.table_spec)
  trained = _train(model).model.embed
  grad_dtypes = {f"f_{name}": dtype for name, dtype in acts.items()}
  reference = _train(plain, grad_dtypes=grad_dtypes).model.embed
  for name, value in pzsc.logical_tables(trained).items():
    want_table = pzsc.logical_tables(reference)[name]
    assert value.dtype == want_table.dtype, name
    np.testing.assert_array_equal(
      np.asarray(value, np.float32),
      np.asarray(want_table, np.float32),
      err_msg=name,
    )
  for name, slots in pzsc.logical_slots(reference).items():
    for slot, value in slots.items():
      np.testing.assert_array_equal(
        pzsc.logical_slots(trained)[name][slot], value, err_msg=name
      )


def test_an_activation_dtype_outside_the_list_is_refused():
  with pytest.raises(
    ValueError, match=r"table 'x': activation_dtype must be one of .*int32"
  ):
    _table_x(activation_dtype=jnp.int32)
  assert _table_x().activation_dtype == jnp.float32
  # The user's next call, with a dtype of the list (any spelling).
  table = _table_x(dtype="bfloat16", activation_dtype="bfloat16")
  assert table.activation_dtype == jnp.bfloat16 == table.dtype
