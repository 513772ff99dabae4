"""compat's custom optimizer lowering: StableHLO text of a row update.

The modules are run (through the module-call primitive, which executes
any StableHLO text) and compared with the update computed in numpy. A
`CustomOptimizerSpec` given only `stablehlo=` trains through upstream's
device step (`tpu_sparse_dense_matmul_grad` in a `shard_map`), and its
tables equal those of the same function given as `custom_computation_fn`
and a numpy restatement of the optimizer.
"""

from __future__ import annotations

import collections
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.mlir import ir
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pz_sparsecore.compat.lib.nn import custom_optimizer_lowering as lowering
from pz_sparsecore.compat.lib.nn import (
  embedding,
  embedding_spec,
  table_stacking,
)

_ROW = np.array([[-2.0, 0.5, 3.0, 7.0]], np.float32)
_GRAD = np.array([[1.0, -4.0, 2.0, -1.0]], np.float32)
_LR = np.full((1, 4), 0.5, np.float32)


def _run(text: str, *args: np.ndarray, results: int) -> list[np.ndarray]:
  """Executes a module of `[1, 4]` float32 operands and results."""
  row = jax.ShapeDtypeStruct((1, 4), jnp.float32)
  out = jax.jit(
    lambda *a: lowering._call_module_p.bind(
      *a, module=text, results=(row,) * results
    )
  )(*args)
  return [np.asarray(x) for x in out]


def _sgd(grad, row, lr):
  return row - lr * grad


def _adagrad(grad, row, accumulator, lr):
  accumulator = accumulator + grad * grad
  return row - lr * grad / jnp.sqrt(accumulator), accumulator


def test_apply_clipping():
  values = jnp.array([-2.0, 0.0, 2.0, 5.0])
  np.testing.assert_array_equal(lowering.apply_clipping(values), values)
  np.testing.assert_array_equal(
    lowering.apply_clipping(values, min_value=0.0), [0, 0, 2, 5]
  )
  np.testing.assert_array_equal(
    lowering.apply_clipping(values, max_value=3.0), [-2, 0, 2, 3]
  )
  np.testing.assert_array_equal(
    lowering.apply_clipping(values, 0.0, 3.0), [0, 0, 2, 3]
  )


@pytest.mark.parametrize("limits", [(None, None), (0.0, 3.0), (None, 1.0)])
def test_lowered_sgd_runs(limits):
  text = lowering.lower_to_stablehlo(_sgd, 4, 0, 1, *limits)
  assert "func.func public @main" in text and "stablehlo" in text
  (row,) = _run(text, _GRAD, _ROW, _LR, results=1)
  expected = _ROW - 0.5 * _GRAD  # [-2.5, 2.5, 2, 7.5]
  lo, hi = limits
  expected = np.clip(expected, -np.inf if lo is None else lo, hi or np.inf)
  np.testing.assert_allclose(row, expected)


def test_lowered_adagrad_clips_the_row_only():
  text = lowering.lower_to_stablehlo(_adagrad, 4, 1, 1, -1.0, 1.0)
  accumulator = np.ones((1, 4), np.float32)
  row, new_accumulator = _run(text, _GRAD, _ROW, accumulator, _LR, results=2)
  expected_acc = accumulator + _GRAD**2  # [2, 17, 5, 2]
  np.testing.assert_allclose(new_accumulator, expected_acc)
  expected = _ROW - 0.5 * _GRAD / np.sqrt(expected_acc)
  np.testing.assert_allclose(row, np.clip(expected, -1, 1), rtol=1e-6)


def test_wrap_with_limits():
  raw = lowering.lower_to_stablehlo(_sgd, 4, 0, 1)
  assert lowering.wrap_stablehlo_with_limits(raw, 4, 0, 1) == raw
  assert lowering.wrap_stablehlo_with_limits(raw.encode(), 4, 0, 1) == raw
  wrapped = lowering.wrap_stablehlo_with_limits(raw, 4, 0, 1, 0.0, 2.0)
  (row,) = _run(wrapped, _GRAD, _ROW, _LR, results=1)
  np.testing.assert_allclose(row, [[0.0, 2.0, 2.0, 2.0]])
  adagrad = lowering.lower_to_stablehlo(_adagrad, 4, 1, 1)
  wrapped = lowering.wrap_stablehlo_with_limits(adagrad, 4, 1, 1, None, 0.0)
  accumulator = np.ones((1, 4), np.float32)
  row, new_accumulator = _run(wrapped, _GRAD, _ROW, accumulator, _LR, results=2)
  np.testing.assert_allclose(new_accumulator, accumulator + _GRAD**2)
  assert (row <= 0).all()


def test_bad_counts():
  with pytest.raises(ValueError, match="embedding_dim must be an integer"):
    lowering.lower_to_stablehlo(_sgd, 0)
  with pytest.raises(ValueError, match="num_slot_variables"):
    lowering.wrap_stablehlo_with_limits("", 4, -1, 1, 0.0)


# ---------------------------------------------------------------------------
# CustomOptimizerSpec(stablehlo=...).

_DIM, _VOCAB, _BATCH, _S, _RATE = 8, 64, 32, 4, 0.5
_ACC0 = 0.1


def _spec(**kwargs) -> embedding_spec.CustomOptimizerSpec:
  return embedding_spec.CustomOptimizerSpec(learning_rate=_RATE, **kwargs)


def test_spec_takes_stablehlo_as_upstream():
  cls = embedding_spec.CustomOptimizerSpec
  text = cls.lower_to_stablehlo(_sgd, _DIM, 0, 1)
  assert text == lowering.lower_to_stablehlo(_sgd, _DIM, 0, 1)
  clipped = cls.lower_to_stablehlo(_sgd, _DIM, 0, 1, -1.0, 1.0)
  assert clipped == lowering.lower_to_stablehlo(_sgd, _DIM, 0, 1, -1.0, 1.0)
  assert cls.wrap_stablehlo_with_limits(text, _DIM, 0, 1) == text
  assert cls.wrap_stablehlo_with_limits(
    text, _DIM, 0, 1, None, 1.0
  ) == lowering.wrap_stablehlo_with_limits(text, _DIM, 0, 1, None, 1.0)

  spec = _spec(stablehlo=text)
  assert spec.stablehlo == text and spec.custom_computation_fn is None
  assert spec == _spec(stablehlo=text)
  assert hash(spec) == hash(_spec(stablehlo=text))
  assert spec != _spec(stablehlo=clipped)
  assert spec != _spec(custom_computation_fn=_sgd)
  assert spec != _spec(custom_computation_fn=_sgd, stablehlo=text)
  assert "stablehlo=" in repr(spec)

  frozen = spec.to_pz()
  assert frozen.custom_computation_fn == lowering.StableHLOUpdate(text)
  assert frozen == _spec(stablehlo=text.encode()).to_pz()
  assert hash(frozen) == hash(_spec(stablehlo=text).to_pz())
  assert frozen != _spec(stablehlo=clipped).to_pz()
  back = embedding_spec.optimizer_from_pz(frozen)
  assert back == spec and back.stablehlo == text
  # An MLIR module is read as its text.
  with mlir.make_ir_context() as context:
    module = ir.Module.parse(text, context=context)
  parsed = _spec(stablehlo=module).to_pz().custom_computation_fn
  assert parsed == lowering.StableHLOUpdate(str(module))
  assert len(inspect.signature(parsed).parameters) == 3
  # Given both, the module is what runs, as upstream.
  both = _spec(custom_computation_fn=_sgd, stablehlo=text).to_pz()
  assert both == frozen


def test_spec_refuses_a_module_that_does_not_fit():
  with pytest.raises(ValueError, match="Either stablehlo or custom_comp"):
    _spec().to_pz()
  with pytest.raises(ValueError, match="not a StableHLO module"):
    _spec(stablehlo="not a module").to_pz()
  # SGD's three operands for an optimizer with one slot (four).
  text = lowering.lower_to_stablehlo(_sgd, _DIM, 0, 1)
  with pytest.raises(ValueError, match="function of 4 arguments"):
    _spec(
      stablehlo=text,
      slot_variable_initializers_tuple=(jax.nn.initializers.zeros,),
    ).to_pz()


def _features(optimizer) -> dict[str, embedding_spec.FeatureSpec]:
  table = embedding_spec.TableSpec(
    name="t",
    vocabulary_size=_VOCAB,
    embedding_dim=_DIM,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=optimizer,
    combiner="sum",
  )
  return {
    "f": embedding_spec.FeatureSpec(
      name="f",
      table_spec=table,
      input_shape=[_BATCH, 3],
      output_shape=[_BATCH, _DIM],
    )
  }


def _train(optimizer, batches, limits=None):
  """The logical table and slots after upstream's device step on
  `batches` of `(ids, activation gradients)`, on 2 devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("device",))
  specs = _features(optimizer)
  embedding.prepare_feature_specs_for_training(specs, 2, _S)
  # Written back in place: the stack holds this very optimizer.
  assert specs["f"].table_spec.stacked_table_spec.optimizer is optimizer
  table_specs = {"t": specs["f"].table_spec}
  variables = embedding.init_embedding_variables(
    jax.random.key(0),
    table_specs,
    NamedSharding(mesh, P("device", None)),
    _S,
    bypass_mesh_check=True,
  )
  pd = P("device")
  backward = jax.shard_map(
    functools.partial(
      embedding.tpu_sparse_dense_matmul_grad,
      feature_specs=specs,
      embedding_var_limits=None if limits is None else {"t": limits},
    ),
    mesh=mesh,
    in_specs=(pd, pd, P("device", None)),
    out_specs=P("device", None),
    check_vma=False,
  )
  backward = jax.jit(backward, donate_argnums=2)
  for ids, grads in batches:
    inputs, _ = embedding.preprocess_sparse_dense_matmul_input(
      {"f": ids}, None, specs, 2, 2, num_sc_per_device=_S
    )
    variables = backward({"f": grads}, inputs, variables)

  def logical(arrays):
    return np.asarray(
      table_stacking.unshard_and_unstack_tables(
        table_specs, {"t": arrays}, 2 * _S
      )["t"]
    )

  (stack,) = variables.values()
  assert type(stack.slot) is type(optimizer.slot_variables_initializers())
  return logical(stack.table), [logical(s) for s in stack.slot]


def _numpy_train(table, batches, adagrad, limits):
  """SGD or Adagrad restated in float64 on the rows each batch touches."""
  table = table.astype(np.float64)
  acc = np.full_like(table, _ACC0)
  lo, hi = limits or (-np.inf, np.inf)
  for ids, grads in batches:
    g = np.zeros_like(table)
    np.add.at(g, ids, grads[:, None, :].astype(np.float64))
    rows = np.unique(ids)
    if adagrad:
      acc[rows] += g[rows] ** 2
      step = g[rows] / np.sqrt(acc[rows])
    else:
      step = g[rows]
    table[rows] = np.clip(table[rows] - _RATE * step, lo, hi)
  return table, acc


def _batches(n=3):
  rng = np.random.default_rng(7)
  return [
    (
      rng.integers(0, _VOCAB, (_BATCH, 3)),
      rng.normal(size=(_BATCH, _DIM)).astype(np.float32),
    )
    for _ in range(n)
  ]


Accumulator = collections.namedtuple("Accumulator", ["accumulator"])


@pytest.mark.parametrize(
  "adagrad,limits,clip_by",
  [
    (False, None, None),
    (True, (-0.6, 0.6), "lowering"),
    (True, (None, 0.4), "wrapping"),
  ],
)
def test_stablehlo_only_spec_trains(adagrad, limits, clip_by):
  """The module clips (lowered or wrapped with the limits); the function
  is clipped by the device step's `embedding_var_limits`, as upstream's
  kernels clip. Slots given as a plain tuple come back as one."""
  fn, slots = _sgd, 0
  inits = ()
  if adagrad:  # Upstream's tests give a plain tuple; a namedtuple names.
    fn, slots = _adagrad, 1
    inits = (jax.nn.initializers.constant(_ACC0),)
    if clip_by == "wrapping":
      inits = Accumulator(*inits)
  lo, hi = limits or (None, None)
  cls = embedding_spec.CustomOptimizerSpec
  if clip_by == "wrapping":
    raw = cls.lower_to_stablehlo(fn, _DIM, slots, 1)
    text = cls.wrap_stablehlo_with_limits(raw, _DIM, slots, 1, lo, hi)
  else:
    text = cls.lower_to_stablehlo(fn, _DIM, slots, 1, lo, hi)
  batches = _batches()
  from_module, module_slots = _train(
    _spec(stablehlo=text, slot_variable_initializers_tuple=inits), batches
  )
  from_fn, fn_slots = _train(
    _spec(custom_computation_fn=fn, slot_variable_initializers_tuple=inits),
    batches,
    limits,
  )
  np.testing.assert_allclose(from_module, from_fn, rtol=1e-6, atol=1e-6)
  for a, b in zip(module_slots, fn_slots, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  initial, _ = _train(
    _spec(custom_computation_fn=fn, slot_variable_initializers_tuple=inits),
    [],
  )
  limits = None if limits is None else (lo or -np.inf, hi)
  want, acc = _numpy_train(initial, batches, adagrad, limits)
  np.testing.assert_allclose(from_module, want, rtol=1e-5, atol=1e-5)
  if adagrad:
    np.testing.assert_allclose(module_slots[0], acc, rtol=1e-5)
  if limits is not None:  # The limits bind: touched rows reach them.
    touched = from_module[np.unique(np.concatenate([i for i, _ in batches]))]
    assert (touched <= hi).all() and (touched == np.float32(hi)).any()
