"""LaProp, F2A and custom optimizers against NumPy restatements of upstream.

The equations are jax-tpu-embedding's (v0.1.0): LaProp and F2A as its
`sparse_dense_matmul_grad_with_{laprop,f2a}.py` lowerings write them, their
hyper-parameters as `LaPropOptimizerSpec.get_decay_rate` and
`F2AOptimizerSpec.get_hyperparameters` compute them, and a custom optimizer
as `CustomOptimizerSpec` runs its function: once per referenced row, on
`[1, dim]` arguments `(grad, table, *slots, learning_rate)`.

NumPy below restates them in float64 from the specs' fields alone (the decay
rate and the step included), so the kernels' step-dependent hyper-parameters
are checked too. Rows the batch does not reference, and their slots, must come
back bit-identical.
"""

from __future__ import annotations

import collections
import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_training as tt
import user_compile
from numerics import assert_close
from test_kernels import _grad_call, _slots, _table, make_buffers, row_grads

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs
from pz_sparsecore.device import kernels
from pz_sparsecore.nn.training import SparseCoreTrainer

DIM = 8
# Steps 0 (decay 0, max(t, 1) = 1), 1 and 9 (F2A's multiplier capped).
STEPS = (0, 1, 9)

LAPROP = specs.LaPropOptimizerSpec(
  learning_rate=0.02, b1=0.8, b2=0.9, eps=1e-6, initial_slot_value=0.01
)
F2A = specs.F2AOptimizerSpec(
  learning_rate=0.1,
  rho=0.9,
  l1_regularization_strength=0.01,
  l2_regularization_strength=0.02,
  max_lr_multiplier=2.5,
)


# ---------------------------------------------------------------------------
# NumPy restatement (float64).


def np_decay_rate(b2: float, step: int) -> float:
  return b2 * (1 - b2**step) / (1 - b2 ** (step + 1))


def np_row_update(opt, w, slots: dict, g, step: int):
  """One step of LaProp or F2A on rows `w` with gradient `g`."""
  lr = (
    opt.learning_rate(step)
    if callable(opt.learning_rate)
    else opt.learning_rate
  )
  if isinstance(opt, specs.LaPropOptimizerSpec):
    decay = np_decay_rate(opt.b2, step)
    nu = decay * slots["nu"] + (1 - decay) * (g * g + opt.eps)
    mu = opt.b1 * slots["mu"] + np.sqrt(1 - opt.b1**2) * g / np.sqrt(nu)
    return w - lr * mu, {"mu": mu, "nu": nu}
  if isinstance(opt, specs.F2AOptimizerSpec):
    n = slots["local_step"] + 1
    f = np.minimum((max(step, 1) / n) ** opt.rho, opt.max_lr_multiplier)
    a = slots["accumulator"] + g * g
    update = (
      f * g / np.sqrt(a)
      + opt.l1_regularization_strength * np.sign(w)
      + opt.l2_regularization_strength * w
    )
    return w - lr * update, {"accumulator": a, "local_step": n}
  raise AssertionError(opt)


# ---------------------------------------------------------------------------
# Specs: upstream's signatures, hyper-parameters, slots and checks.


def _adagrad_fn(grad, table, accumulator, lr):
  accumulator = accumulator + grad * grad
  return table - lr * grad / jnp.sqrt(accumulator), accumulator


def _sgd_fn(grad, table, lr):
  return table - lr * grad


AdagradSlots = collections.namedtuple("AdagradSlots", ["accumulator"])


def _params(cls) -> list[tuple[str, object]]:
  return [
    (p.name, p.default) for p in inspect.signature(cls).parameters.values()
  ]


def test_signatures_match_upstream():
  assert _params(specs.LaPropOptimizerSpec) == [
    ("learning_rate", 0.001),
    ("b1", 0.9),
    ("b2", 0.95),
    ("eps", 1e-30),
    ("rms_clip_threshold", None),
    ("initial_slot_value", 0.0),
  ]
  assert _params(specs.F2AOptimizerSpec) == [
    ("learning_rate", 0.01),
    ("rho", 0.5),
    ("initial_accumulator_value", 0.1),
    ("initial_local_step_value", 0.0),
    ("l1_regularization_strength", 0.0),
    ("l2_regularization_strength", 0.0),
    ("max_lr_multiplier", 1e6),
  ]
  assert _params(specs.CustomOptimizerSpec) == [
    ("learning_rate", 0.001),
    ("custom_computation_fn", None),
    ("slot_variable_initializers_tuple", ()),
    ("short_name_str", "custom"),
    ("slot_shapes", None),
  ]
  for name in (
    "LaPropOptimizerSpec",
    "F2AOptimizerSpec",
    "CustomOptimizerSpec",
  ):
    assert getattr(pzsc, name) is getattr(specs, name)
  assert specs.LaPropOptimizerSpec().short_name() == "laprop"
  assert specs.F2AOptimizerSpec().short_name() == "f2a"
  custom = specs.CustomOptimizerSpec(0.1, _sgd_fn, (), "mine")
  assert custom.short_name() == "mine"
  assert custom == specs.CustomOptimizerSpec(0.1, _sgd_fn, (), "mine")
  assert hash(custom) == hash(
    specs.CustomOptimizerSpec(0.1, _sgd_fn, (), "mine")
  )
  assert custom != specs.CustomOptimizerSpec(
    0.1, lambda g, w, lr: w, (), "mine"
  )
  assert specs.F2AOptimizerSpec(rho=0.5) != specs.F2AOptimizerSpec(rho=0.6)


def _floats(values) -> list[float]:
  return [float(v) for v in values]


def test_laprop_hyperparameters_follow_the_step():
  spec = specs.LaPropOptimizerSpec(
    learning_rate=lambda step: 0.1 / (1 + step), b1=0.8, b2=0.9, eps=1e-6
  )
  for step in (0, 1, 9, 500):
    want = [0.1 / (1 + step), 0.8, np_decay_rate(0.9, step), 1e-6]
    assert_close(_floats(spec.get_hyperparameters(step)), want, rtol=1e-6)
  # Under jit, with a traced step.
  got = jax.jit(spec.get_hyperparameters)(jnp.int32(9))
  assert_close(float(got[2]), np_decay_rate(0.9, 9), rtol=1e-6)
  # Without a step upstream decays by b2 itself.
  assert float(
    specs.LaPropOptimizerSpec(b2=0.9).get_decay_rate()
  ) == np.float32(0.9)
  assert float(spec.get_decay_rate(0)) == 0.0


def test_f2a_hyperparameters_carry_the_step():
  spec = specs.F2AOptimizerSpec(
    learning_rate=lambda step: 1.0 - 0.01 * step,
    rho=0.5,
    l1_regularization_strength=0.01,
    l2_regularization_strength=0.02,
    max_lr_multiplier=1e5,
  )
  want = _floats(np.float32([1.0, 0.5, 0.01, 0.02, 1e5, 0.0]))
  assert _floats(spec.get_hyperparameters(0)) == want
  # No step: step 0, for the schedule too (as upstream).
  assert _floats(spec.get_hyperparameters()) == want
  got = _floats(spec.get_hyperparameters(7))
  assert got[0] == np.float32(0.93) and got[-1] == 7.0


def test_slot_initialisers():
  key = jax.random.key(0)
  laprop = specs.LaPropOptimizerSpec(initial_slot_value=0.02)
  inits = laprop.slot_variables_initializers()
  assert inits._fields == ("mu", "nu") == laprop.slot_names()
  for init in inits:
    np.testing.assert_array_equal(
      init(key, (3, 2)), np.full((3, 2), 0.02, np.float32)
    )
  f2a = specs.F2AOptimizerSpec(
    initial_accumulator_value=0.3, initial_local_step_value=2.0
  )
  inits = f2a.slot_variables_initializers()
  assert inits._fields == ("accumulator", "local_step") == f2a.slot_names()
  np.testing.assert_array_equal(
    inits.accumulator(key, (1, 5)), np.full((1, 5), 0.3, np.float32)
  )
  np.testing.assert_array_equal(inits.local_step(key, (1, 5)), [[2.0] * 5])
  # Custom: the user's initialisers, named by their NamedTuple or position.
  named = AdagradSlots(jax.nn.initializers.constant(0.1))
  spec = specs.CustomOptimizerSpec(0.1, _adagrad_fn, named)
  assert spec.slot_variables_initializers() is named
  assert spec.slot_names() == ("accumulator",)
  plain = specs.CustomOptimizerSpec(0.1, _adagrad_fn, [named.accumulator])
  assert plain.slot_names() == ("slot_0",)
  assert plain.slot_variables_initializers() == (named.accumulator,)
  assert spec.get_hyperparameters(3) == (jnp.float32(0.1),)


@pytest.mark.parametrize(
  "cls,kwargs,field",
  [
    (
      specs.LaPropOptimizerSpec,
      {"rms_clip_threshold": 1.0},
      "rms_clip_threshold",
    ),
    (specs.LaPropOptimizerSpec, {"b1": 1.5}, "b1"),
    (specs.LaPropOptimizerSpec, {"b2": 1.0}, "b2"),
    (specs.LaPropOptimizerSpec, {"b2": float("nan")}, "b2"),
    (specs.LaPropOptimizerSpec, {"eps": 0.0}, "eps"),
    (
      specs.LaPropOptimizerSpec,
      {"initial_slot_value": -1.0},
      "initial_slot_value",
    ),
    (specs.LaPropOptimizerSpec, {"learning_rate": np.inf}, "learning_rate"),
    (specs.F2AOptimizerSpec, {"rho": np.inf}, "rho"),
    (
      specs.F2AOptimizerSpec,
      {"initial_accumulator_value": 0.0},
      "initial_accumulator_value",
    ),
    (
      specs.F2AOptimizerSpec,
      {"initial_local_step_value": -1.0},
      "initial_local_step_value",
    ),
    (
      specs.F2AOptimizerSpec,
      {"l1_regularization_strength": -0.1},
      "l1_regularization_strength",
    ),
    (specs.F2AOptimizerSpec, {"max_lr_multiplier": 0.0}, "max_lr_multiplier"),
    (specs.CustomOptimizerSpec, {}, "custom_computation_fn"),
    (
      specs.CustomOptimizerSpec,
      {
        "custom_computation_fn": _sgd_fn,
        "slot_variable_initializers_tuple": (1,),
      },
      "slot_variable_initializers_tuple",
    ),
    (
      specs.CustomOptimizerSpec,
      {"custom_computation_fn": _sgd_fn, "short_name_str": ""},
      "short_name_str",
    ),
    (
      specs.CustomOptimizerSpec,
      {
        "custom_computation_fn": _sgd_fn,
        "slot_variable_initializers_tuple": (jax.nn.initializers.zeros,),
      },
      "custom_computation_fn",
    ),
  ],
)
def test_bad_hyperparameters_name_optimizer_and_field(cls, kwargs, field):
  with pytest.raises(ValueError, match=rf"^{cls.__name__}: {field} must be"):
    cls(**kwargs)


# ---------------------------------------------------------------------------
# The fused update of one shard, over several steps.


def _multi_step_buffers():
  """Three batches; partition 2 is empty, hot rows recur across segments."""
  bufs = [
    make_buffers(
      60 + i, num_segments=2, num_partitions=4, empty_partitions=(2,)
    )
    for i in range(len(STEPS))
  ]
  counts = collections.Counter((p, r) for k, p, r, s, g in bufs[0].entries)
  assert max(counts.values()) > 2  # Rows with several entries.
  return bufs


@pytest.mark.parametrize("impl", ["ffi", "reference"])
@pytest.mark.parametrize("spec", [LAPROP, F2A], ids=["laprop", "f2a"])
def test_fused_update_matches_numpy_over_steps(spec, impl):
  bufs = _multi_step_buffers()
  table = _table(bufs[0], DIM, seed=1)
  slots = _slots(spec.short_name(), table, seed=2)
  names = spec.slot_names()
  want_w = table.astype(np.float64)
  want = {n: s.astype(np.float64) for n, s in zip(names, slots, strict=True)}
  state = (jnp.asarray(table), tuple(jnp.asarray(s) for s in slots))
  rng = np.random.default_rng(3)
  touched = set()
  for step, buf in zip(STEPS, bufs, strict=True):
    act = rng.normal(size=(2 * buf.samples_per_segment, DIM)).astype(np.float32)
    hp = jnp.stack(spec.get_hyperparameters(step))
    state = _grad_call(
      buf, act, *state, spec.short_name(), hp, impl, **buf.layout()
    )
    grads = row_grads(buf, act, table.shape[0])
    rows = np.asarray(sorted(grads))
    g = np.stack([grads[r] for r in rows])
    w, new = np_row_update(
      spec, want_w[rows], {n: v[rows] for n, v in want.items()}, g, step
    )
    want_w[rows] = w
    for n in names:
      want[n][rows] = new[n]
    touched.update(rows.tolist())
  untouched = np.setdiff1d(np.arange(table.shape[0]), sorted(touched))
  assert len(untouched) >= bufs[0].rows_per_partition  # The empty partition.
  for name, got, w, old in zip(
    ("table", *names),
    (state[0], *state[1]),
    (want_w, *want.values()),
    (table, *slots),
    strict=True,
  ):
    got = np.asarray(got)
    assert_close(got, w, rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(got[untouched], old[untouched], err_msg=name)


# ---------------------------------------------------------------------------
# Custom optimizers.


@pytest.mark.parametrize(
  "builtin,fn,inits",
  [
    ("sgd", _sgd_fn, ()),
    ("adagrad", _adagrad_fn, AdagradSlots(jax.nn.initializers.constant(0.1))),
  ],
)
def test_custom_equals_the_builtin_it_restates(builtin, fn, inits):
  spec = specs.CustomOptimizerSpec(0.05, fn, inits, f"custom_{builtin}")
  buf = make_buffers(7, num_segments=2, num_partitions=4, empty_partitions=(1,))
  table = _table(buf, DIM, seed=1)
  slots = _slots(builtin, table, seed=2)
  act = np.random.default_rng(3).normal(size=(32, DIM)).astype(np.float32)
  hp = jnp.stack(spec.get_hyperparameters(0))
  call = functools.partial(_grad_call, buf, act, table, slots, **buf.layout())
  got = call(spec.definition, hp, None)
  # The same equations in the same summation order: bit-identical.
  want = call(builtin, hp, "reference")
  compiled = call(builtin, hp, "ffi")
  referenced = sorted(row_grads(buf, act, table.shape[0]))
  untouched = np.setdiff1d(np.arange(table.shape[0]), referenced)
  for g, w, c, old in zip(
    (got[0], *got[1]),
    (want[0], *want[1]),
    (compiled[0], *compiled[1]),
    (table, *slots),
    strict=True,
  ):
    g = np.asarray(g)
    np.testing.assert_array_equal(g, np.asarray(w))
    assert_close(g, np.asarray(c), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(g[untouched], old[untouched])
  assert not np.array_equal(np.asarray(got[0])[referenced], table[referenced])


def test_custom_has_no_compiled_handler_and_checks_its_function():
  buf = make_buffers(5, num_segments=1, num_partitions=2)
  table = _table(buf, DIM, seed=1)
  act = np.ones((16, DIM), np.float32)
  spec = specs.CustomOptimizerSpec(0.1, _sgd_fn, (), "mine")
  with pytest.raises(ValueError, match="no compiled handler"):
    _grad_call(
      buf, act, table, (), spec.definition, [0.1], "ffi", **buf.layout()
    )
  # The function must return the row and one array per slot.
  bad = specs.CustomOptimizerSpec(
    0.1, lambda g, w, a, lr: w - lr * g, (jax.nn.initializers.zeros,), "bad"
  )
  with pytest.raises(
    ValueError, match=r"CustomOptimizerSpec 'bad': .* 2 float32"
  ):
    _grad_call(
      buf, act, table, (table,), bad.definition, [0.1], None, **buf.layout()
    )


def _shapes_and_table_writers(rows_per_partition: int):
  """The custom update's jaxpr, and its compiled HLO, for one vocabulary."""
  spec = specs.CustomOptimizerSpec(
    0.1, _adagrad_fn, (jax.nn.initializers.ones,), "mine"
  )
  buf = make_buffers(
    3,
    num_segments=2,
    num_partitions=4,
    rows_per_partition=rows_per_partition,
    seg_len=256,
  )
  vocab = 4 * rows_per_partition
  table = jnp.zeros((vocab, DIM))

  def step(act, bufs, table, accumulator):
    return kernels.sparse_dense_matmul_grad(
      act,
      *bufs,
      table,
      (accumulator,),
      optimizer=spec.definition,
      hyperparameters=jnp.ones((1,), jnp.float32),
      **buf.layout(),
    )

  args = (jnp.ones((32, DIM)), buf.args(), table, jnp.ones_like(table))
  jaxpr = jax.make_jaxpr(step)(*args)
  hlo = (
    jax.jit(step, donate_argnums=(2, 3))
    .lower(*args)
    .compile(user_compile.OPTIONS)
    .as_text()
  )
  return _eqns(jaxpr.jaxpr), hlo, (vocab, DIM)


def _eqns(jaxpr):
  """Every equation of `jaxpr` and of the jaxprs inside it."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _eqns(inner)


def test_custom_update_work_does_not_grow_with_the_vocabulary():
  other = {}
  for rows_per_partition in (2**6, 2**14):
    eqns, hlo, table_shape = _shapes_and_table_writers(rows_per_partition)
    shapes = collections.Counter()
    for eqn in eqns:
      for var in eqn.outvars:
        shape = tuple(var.aval.shape)
        if shape == table_shape:
          # Only the scatters of the updated rows into table and slot.
          assert eqn.primitive.name == "scatter", eqn
        else:
          shapes[shape] += 1
    other[rows_per_partition] = shapes
    # Compiled: the donated table and slot are updated in place (aliased,
    # never copied); table-sized instructions are only the parameters, the
    # scatters (and the fusions wrapping them) and the result tuple.
    assert re.search(r"input_output_alias=\{ \{0\}: \(5, .*\{1\}: \(6,", hlo)
    dims = ",".join(map(str, table_shape))
    for line in hlo.splitlines():
      if f"f32[{dims}]" in line and " = " in line:
        assert re.search(r"= .*\b(parameter|scatter|fusion|tuple)\(", line), (
          line
        )
        assert "copy" not in line, line
  # Every other intermediate has the same shape whatever the vocabulary.
  assert other[2**6] == other[2**14]


# ---------------------------------------------------------------------------
# Training through the public path.


class Reference(tt.Reference):
  """test_training's numpy reference, with LaProp, F2A and the custom
  optimizers (each checked against the built-in it restates)."""

  BUILTIN = {
    "custom_sgd": lambda opt: specs.SGDOptimizerSpec(opt.learning_rate),
    "custom_adagrad": lambda opt: specs.AdagradOptimizerSpec(
      opt.learning_rate, initial_accumulator_value=0.3
    ),
  }

  @staticmethod
  def initial_slots(opt):
    if isinstance(opt, specs.CustomOptimizerSpec):
      opt = Reference.BUILTIN[opt.short_name()](opt)
    if isinstance(opt, specs.LaPropOptimizerSpec):
      return {"mu": opt.initial_slot_value, "nu": opt.initial_slot_value}
    if isinstance(opt, specs.F2AOptimizerSpec):
      return {
        "accumulator": opt.initial_accumulator_value,
        "local_step": opt.initial_local_step_value,
      }
    return tt.initial_slots(opt)

  @staticmethod
  def row_update(opt, w, slots, g, step):
    if isinstance(opt, specs.CustomOptimizerSpec):
      return tt.row_update(
        Reference.BUILTIN[opt.short_name()](opt), w, slots, g, step
      )
    if isinstance(opt, (specs.LaPropOptimizerSpec, specs.F2AOptimizerSpec)):
      return np_row_update(opt, w, slots, g, step)
    return tt.row_update(opt, w, slots, g, step)


TABLES = {
  "laprop": (LAPROP, "sum", 90, 8),
  "f2a": (F2A, "mean", 90, 8),
  "custom_sgd": (
    specs.CustomOptimizerSpec(tt._sgd_lr, _sgd_fn, (), "custom_sgd"),
    "sqrtn",
    90,
    5,
  ),
  "custom_adagrad": (
    specs.CustomOptimizerSpec(
      0.1,
      _adagrad_fn,
      AdagradSlots(jax.nn.initializers.constant(0.3)),
      "custom_adagrad",
    ),
    "sum",
    90,
    8,
  ),
}


@pytest.mark.parametrize("g,s,exchange", [(1, 1, "auto"), (4, 2, "rows")])
def test_trainer_matches_numpy(g, s, exchange):
  model = tt.build_model(g, s, TABLES, exchange=exchange)
  ref = Reference(tt.initial_tables(11, TABLES), TABLES)
  before = tt.snapshot(model.embed)
  for name in TABLES:
    for slot, value in ref.slots[name].items():
      np.testing.assert_array_equal(before[1][name][slot], value)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(tt.DENSE_LR), tt.loss_fn
  )
  grads = tt.act_grads(3, TABLES)
  for step in range(3):
    ids, weights = tt.make_batch(100 + step, TABLES)
    inputs, _ = trainer.model.embed.preprocess(ids, weights)
    old = trainer.model.embed.tables["custom_adagrad"].value.data_array
    trainer.step(
      inputs=inputs, grads={k: jnp.asarray(v) for k, v in grads.items()}
    )
    assert old.is_deleted()  # Donated: updated in place.
    touched = ref.step(ids, weights, grads, step)
    tt.check_against(trainer.model.embed, ref, touched, before)
    before = tt.snapshot(trainer.model.embed)


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_adagrad_from_a_zero_accumulator_leaves_zero_gradients_alone(impl):
  # Upstream's Adagrad takes initial_accumulator_value=0; a component whose
  # gradient has been 0 keeps its value (upstream writes 0 / 0 = NaN).
  spec = pzsc.AdagradOptimizerSpec(
    learning_rate=0.1, initial_accumulator_value=0.0
  )
  buf = make_buffers(
    11, num_segments=2, num_partitions=4, empty_partitions=(2,)
  )
  table = _table(buf, DIM, seed=1)
  accumulator = np.zeros_like(table)
  act = np.random.default_rng(5).normal(size=(32, DIM)).astype(np.float32)
  act[:, ::3] = 0.0  # every third component gets no gradient
  hp = jnp.stack(spec.get_hyperparameters(0))
  new_table, (new_acc,) = _grad_call(
    buf, act, table, (accumulator,), "adagrad", hp, impl, **buf.layout()
  )
  want_w, want_a = table.astype(np.float64), accumulator.astype(np.float64)
  for row, g in row_grads(buf, act, table.shape[0]).items():
    want_a[row] = g * g
    nonzero = want_a[row] > 0
    want_w[row, nonzero] -= 0.1 * g[nonzero] / np.sqrt(want_a[row, nonzero])
  assert np.isfinite(np.asarray(new_table)).all()
  assert_close(np.asarray(new_acc), want_a, rtol=1e-5, atol=1e-7)
  assert_close(np.asarray(new_table), want_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(new_table)[:, ::3], table[:, ::3])
