"""Training: the fused sparse updates against a numpy restatement.

The model's loss is `sum_f sum(acts_f * C_f) + 0.5 * |w - target|^2` for
fixed random `C_f`, so the gradient with respect to feature `f`'s
activations is `C_f` and each referenced row's gradient is
`sum over entries (b, j) with id r of gain_bj * C_f[b]`. The numpy reference
applies every optimizer's per-row equations (as upstream writes them; the
registry's docstrings in `pz_sparsecore.core.optimizers`) once per
referenced row per step, with the true step for Adam's bias correction and
for a step-dependent learning rate, and leaves every other row untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz
from penzai.toolshed import basic_training

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout, specs
from pz_sparsecore.device.routing import TableGradientError
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.training import (
  NonFiniteInputError,
  NonFiniteUpdateError,
  SparseCoreTrainer,
)

BATCH = 32
HOT_ID = 7  # Referenced by every sample: its gradient sums over all devices.


def _sgd_lr(step):
  return 0.2 / (1.0 + step)


# Table name → (optimizer, combiner, vocab, dim).
OPTIMIZERS = {
  "sgd": (specs.SGDOptimizerSpec(learning_rate=_sgd_lr), "sum", 90, 8),
  "adagrad": (
    specs.AdagradOptimizerSpec(
      learning_rate=0.1, initial_accumulator_value=0.3
    ),
    "mean",
    90,
    8,
  ),
  "adagrad_momentum": (
    specs.AdagradMomentumOptimizerSpec(learning_rate=0.05),
    "sqrtn",
    90,
    8,
  ),
  "adagrad_momentum_nesterov": (
    specs.AdagradMomentumOptimizerSpec(
      learning_rate=0.05,
      momentum=0.8,
      beta2=0.9,
      epsilon=1e-6,
      exponent=4.0,
      use_nesterov=True,
      initial_accumulator_value=0.2,
      initial_momentum_value=0.01,
    ),
    "sum",
    90,
    8,
  ),
  "adam": (
    specs.AdamOptimizerSpec(learning_rate=0.01, beta_1=0.8, beta_2=0.95),
    "sum",
    90,
    16,
  ),
  "ftrl": (
    specs.FTRLOptimizerSpec(
      learning_rate=0.1,
      l1_regularization_strength=0.05,
      l2_regularization_strength=0.1,
      beta=0.1,
    ),
    "sum",
    90,
    5,
  ),
  "ftrl_mlr": (
    specs.FTRLOptimizerSpec(
      learning_rate=0.1,
      learning_rate_power=-0.6,
      l1_regularization_strength=0.02,
      l2_regularization_strength=0.1,
      beta=0.2,
      initial_accumulator_value=0.5,
      initial_linear_value=0.05,
      multiply_linear_by_learning_rate=True,
    ),
    "mean",
    90,
    8,
  ),
}
PAIR_OPTIMIZER = specs.AdagradOptimizerSpec(learning_rate=0.1)
PAIR = {
  "pa": (PAIR_OPTIMIZER, "sum", 40, 8),
  "pb": (PAIR_OPTIMIZER, "sum", 72, 8),
}
TABLES = {**OPTIMIZERS, **PAIR}


def feature_specs(
  g: int, s: int, tables=TABLES, limit: int | None = None
) -> dict[str, specs.FeatureSpec]:
  """One feature per table; `limit` sets both per-partition limits."""
  limits = {}
  if limit is not None:
    limits = dict(
      max_ids_per_partition=limit, max_unique_ids_per_partition=limit
    )
  out = {}
  for name, (opt, combiner, vocab, dim) in tables.items():
    table = specs.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(0.5),
      optimizer=opt,
      combiner=combiner,
      **limits,
    )
    out[f"f_{name}"] = specs.FeatureSpec(
      name=f"f_{name}",
      table_spec=table,
      input_shape=(BATCH, 4),
      output_shape=(BATCH, dim),
    )
  if "pa" in tables:
    out = layout.stack_tables(out, ["pa", "pb"], g, s, rotation=1)
  return out


def make_batch(seed: int, tables=TABLES):
  """Ragged weighted ids; rows >= 2/3 vocab stay unreferenced."""
  rng = np.random.RandomState(seed)
  ids, weights = {}, {}
  for name, (_, _, vocab, _) in tables.items():
    rows, ws = [], []
    for b in range(BATCH):
      n = rng.randint(0, 4)
      row = [HOT_ID] + list(rng.randint(0, 2 * vocab // 3, n))
      if b % 3 == 0:
        row.append(row[-1])  # A duplicate.
      if b == 5:
        row.append(0)
      rows.append(np.asarray(row, np.int32))
      ws.append(rng.uniform(0.5, 1.5, len(row)).astype(np.float32))
    ids[f"f_{name}"], weights[f"f_{name}"] = rows, ws
  return ids, weights


def initial_tables(seed: int, tables=TABLES) -> dict[str, np.ndarray]:
  rng = np.random.RandomState(seed)
  return {
    name: rng.normal(0, 0.5, (vocab, dim)).astype(np.float32)
    for name, (_, _, vocab, dim) in tables.items()
  }


def act_grads(seed: int, tables=TABLES) -> dict[str, np.ndarray]:
  rng = np.random.RandomState(seed)
  return {
    f"f_{name}": rng.normal(size=(BATCH, dim)).astype(np.float32)
    for name, (_, _, _, dim) in tables.items()
  }


# ---------------------------------------------------------------------------
# Numpy restatement of the per-row equations.


def initial_slots(opt) -> dict[str, float]:
  if isinstance(opt, specs.SGDOptimizerSpec):
    return {}
  if isinstance(opt, specs.AdagradOptimizerSpec):
    return {"accumulator": opt.initial_accumulator_value}
  if isinstance(opt, specs.AdagradMomentumOptimizerSpec):
    return {
      "accumulator": opt.initial_accumulator_value,
      "momentum": opt.initial_momentum_value,
    }
  if isinstance(opt, specs.AdamOptimizerSpec):
    return {"momentum": 0.0, "velocity": 0.0}
  if isinstance(opt, specs.FTRLOptimizerSpec):
    return {
      "accumulator": opt.initial_accumulator_value,
      "linear": opt.initial_linear_value,
    }
  raise AssertionError(opt)


def row_update(opt, w, slots, g, step):
  """One optimizer step on rows `w` [R, D] with gradient `g`; float64."""
  s = dict(slots)
  lr = (
    opt.learning_rate(step)
    if callable(opt.learning_rate)
    else (opt.learning_rate)
  )
  if isinstance(opt, specs.SGDOptimizerSpec):
    return w - lr * g, s
  if isinstance(opt, specs.AdagradOptimizerSpec):
    a = s["accumulator"] + g**2
    return w - lr * g / np.sqrt(a), {"accumulator": a}
  if isinstance(opt, specs.AdagradMomentumOptimizerSpec):
    a = s["accumulator"]
    if opt.beta2 == 1.0:
      a = a + g**2
    else:
      a = opt.beta2 * a + (1 - opt.beta2) * g**2
    scaled = (a + opt.epsilon) ** (-1.0 / opt.exponent) * g
    m = opt.momentum * s["momentum"] + scaled
    delta = opt.momentum * m + scaled if opt.use_nesterov else m
    return w - lr * delta, {"accumulator": a, "momentum": m}
  if isinstance(opt, specs.AdamOptimizerSpec):
    t = step + 1
    c = np.sqrt(1 - opt.beta_2**t)
    alpha = lr * c / (1 - opt.beta_1**t)
    eps = opt.epsilon * c
    m = s["momentum"] + (1 - opt.beta_1) * (g - s["momentum"])
    v = s["velocity"] + (1 - opt.beta_2) * (g**2 - s["velocity"])
    return w - alpha * m / (np.sqrt(v) + eps), {"momentum": m, "velocity": v}
  if isinstance(opt, specs.FTRLOptimizerSpec):
    k = opt.learning_rate_power
    l1, l2, beta = (
      opt.l1_regularization_strength,
      opt.l2_regularization_strength,
      opt.beta,
    )
    a, lin = s["accumulator"], s["linear"]
    a_new = a + g**2
    dp = a_new ** (-k) - a ** (-k)
    if opt.multiply_linear_by_learning_rate:
      lin = lin + lr * g - dp * w
      l1s = l1 * lr
      den = a_new ** (-k) + 2 * lr * l2 + beta
    else:
      lin = lin + g - dp / lr * w
      l1s = l1
      den = (a_new ** (-k) + beta) / lr + 2 * l2
    num = -lin if l1 == 0 else np.clip(lin, -l1s, l1s) - lin
    return num / den, {"accumulator": a_new, "linear": lin}
  raise AssertionError(opt)


def gains(row_weights: np.ndarray, combiner: str) -> np.ndarray:
  w = np.asarray(row_weights, np.float64)
  if combiner == "sum":
    return w
  if combiner == "mean":
    return w / w.sum()
  return w / np.sqrt((w**2).sum())


class Reference:
  """Logical tables and slots, stepped with the numpy equations.

  `initial_slots` and `row_update` are the equations; a subclass adds
  optimizers by overriding them.
  """

  initial_slots = staticmethod(initial_slots)
  row_update = staticmethod(row_update)

  def __init__(self, tables: dict[str, np.ndarray], table_specs=TABLES):
    self.specs = table_specs
    self.tables = {k: v.astype(np.float64) for k, v in tables.items()}
    self.slots = {
      name: {
        k: np.full(tables[name].shape, np.float32(v), np.float64)
        for k, v in self.initial_slots(opt).items()
      }
      for name, (opt, *_) in table_specs.items()
    }

  def step(self, ids, weights, grads, step: int) -> dict[str, np.ndarray]:
    """Applies one step; returns table → referenced rows."""
    touched = {}
    for name, (opt, combiner, vocab, dim) in self.specs.items():
      feature = f"f_{name}"
      g = np.zeros((vocab, dim))
      for b, row in enumerate(ids[feature]):
        gain = gains(weights[feature][b], combiner)
        for r, gj in zip(row, gain, strict=True):
          g[r] += gj * grads[feature][b].astype(np.float64)
      rows = np.unique(np.concatenate(ids[feature]))
      w, slots = self.row_update(
        opt,
        self.tables[name][rows],
        {k: v[rows] for k, v in self.slots[name].items()},
        g[rows],
        step,
      )
      self.tables[name][rows] = w
      for k, v in slots.items():
        self.slots[name][k][rows] = v
      touched[name] = rows
    return touched


def check_against(embed, ref: Reference, touched, before) -> None:
  """Referenced rows match the reference; the others are bit-identical."""
  tables = pzsc.logical_tables(embed)
  slots = pzsc.logical_slots(embed)
  for name in ref.specs:
    rows = touched[name]
    other = np.setdiff1d(np.arange(ref.tables[name].shape[0]), rows)
    assert len(other) > 0
    np.testing.assert_allclose(
      tables[name], ref.tables[name], rtol=2e-4, atol=2e-5, err_msg=name
    )
    np.testing.assert_array_equal(
      tables[name][other], before[0][name][other], err_msg=name
    )
    assert set(slots.get(name, {})) == set(ref.slots[name]), name
    for slot, value in ref.slots[name].items():
      np.testing.assert_allclose(
        slots[name][slot],
        value,
        rtol=2e-4,
        atol=2e-5,
        err_msg=f"{name}.{slot}",
      )
      np.testing.assert_array_equal(
        slots[name][slot][other], before[1][name][slot][other]
      )


# ---------------------------------------------------------------------------
# The model.


@pz.pytree_dataclass
class ProbeModel(pz.nn.Layer):
  """A SparseCoreEmbed beside one dense parameter."""

  embed: SparseCoreEmbed
  w: pz.ParameterValue

  def __call__(self, inputs, /, **side_inputs):
    return self.embed(inputs, **side_inputs)


TARGET = np.linspace(-1.0, 1.0, 6).astype(np.float32)
W0 = np.zeros(6, np.float32)
DENSE_LR = 0.5


def linear_loss(acts, grads):
  total = 0.0
  for name, value in acts.items():
    total += jnp.sum(value.unwrap("batch", "embedding") * grads[name])
  return total


def loss_fn(*, model, state, rng, inputs, grads):
  del rng
  loss = linear_loss(model(inputs), grads)
  loss += 0.5 * jnp.sum((model.w.value - TARGET) ** 2)
  return loss, state, {"loss": loss}


def mesh_of(g: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:g]), ("device",))


def build_model(
  g: int,
  s: int,
  tables=TABLES,
  seed: int = 0,
  exchange: str = "auto",
  limit: int | None = None,
) -> ProbeModel:
  embed = SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(seed),
    feature_specs(g, s, tables, limit),
    mesh_of(g),
    num_sc_per_device=s,
    exchange=exchange,
  )
  pzsc.set_logical_tables(embed, initial_tables(11, tables))
  return ProbeModel(
    embed=embed, w=pz.Parameter(value=jnp.asarray(W0), label="w")
  )


def snapshot(embed):
  return pzsc.logical_tables(embed), pzsc.logical_slots(embed)


@pytest.mark.parametrize(
  "g,s,exchange",
  [
    (1, 1, "auto"),
    (8, 1, "activations"),
    (8, 1, "rows"),
    (4, 2, "activations"),
    (4, 2, "rows"),
  ],
)
def test_trainer_matches_numpy_optimizers(g, s, exchange):
  model = build_model(g, s, exchange=exchange)
  stacks = model.embed.config.plan.stacks
  modes = {model.embed.config.topology.exchange_of(x).mode for x in stacks}
  assert modes == {"local" if g == 1 else exchange}
  assert pz.select(model).at_instances_of(SparseCoreEmbed).count() == 1
  ref = Reference(initial_tables(11))
  # Fresh slots hold the optimizers' initial values.
  before = snapshot(model.embed)
  for name in TABLES:
    for slot, value in ref.slots[name].items():
      np.testing.assert_array_equal(before[1][name][slot], value)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(DENSE_LR), loss_fn
  )
  grads = act_grads(3)
  for step in range(3):
    ids, weights = make_batch(100 + step)
    inputs, _ = trainer.model.embed.preprocess(ids, weights)
    old_table = trainer.model.embed.tables["adam"].value.data_array
    aux = trainer.step(
      inputs=inputs, grads={k: jnp.asarray(v) for k, v in grads.items()}
    )
    assert np.isfinite(float(aux["loss"]))
    # Donated: the update happened in the old buffer.
    assert old_table.is_deleted()
    touched = ref.step(ids, weights, grads, step)
    check_against(trainer.model.embed, ref, touched, before)
    before = snapshot(trainer.model.embed)
  assert int(trainer.state.value.step) == 3
  # Dense parameters follow optax: w <- w - lr (w - target), three times.
  np.testing.assert_allclose(
    np.asarray(trainer.model.w.value),
    TARGET + (W0 - TARGET) * (1 - DENSE_LR) ** 3,
    rtol=1e-6,
    atol=1e-6,
  )


SMALL = {k: OPTIMIZERS[k] for k in ("adam", "ftrl")}


def test_apply_gradients_under_variable_jit():
  embed = build_model(8, 1, SMALL).embed
  grads = act_grads(4, SMALL)

  @functools.partial(pz.variable_jit, donate_variables=True)
  def train_step(embed, inputs, grads, step):
    acts = embed(inputs)
    g_acts = jax.grad(linear_loss)(acts, grads)
    assert isinstance(g_acts["f_adam"], pz.nx.NamedArray)
    embed.apply_gradients(inputs, g_acts, step)

  ref = Reference(initial_tables(11, SMALL), SMALL)
  before = snapshot(embed)
  for step in range(3):
    ids, weights = make_batch(200 + step, SMALL)
    inputs, _ = embed.preprocess(ids, weights)
    old = embed.tables["adam"].value.data_array
    train_step(embed, inputs, grads, jnp.asarray(step))
    assert old.is_deleted()
    touched = ref.step(ids, weights, grads, step)
    check_against(embed, ref, touched, before)
    before = snapshot(embed)


# ---------------------------------------------------------------------------
# Tables are never differentiated.


def test_penzai_stateful_trainer_raises_table_gradient_error():
  model = build_model(2, 1, SMALL)
  inputs, _ = model.embed.preprocess(*make_batch(0, SMALL))
  grads = {k: jnp.asarray(v) for k, v in act_grads(0, SMALL).items()}
  trainer = basic_training.StatefulTrainer.build(
    jax.random.key(0), model, optax.adam(1e-3), loss_fn
  )
  with pytest.raises(TableGradientError, match="never take a dense gradient"):
    trainer.step(inputs=inputs, grads=grads)
  assert issubclass(TableGradientError, ValueError)


def test_jax_grad_wrt_table_raises():
  embed = build_model(1, 1, SMALL).embed
  inputs, _ = embed.preprocess(*make_batch(0, SMALL))
  grads = act_grads(0, SMALL)
  unbound, params = pz.unbind_params(embed, freeze=True)

  def loss(params):
    return linear_loss(pz.bind_variables(unbound, params)(inputs), grads)

  with pytest.raises(TableGradientError, match="SparseCoreTrainer"):
    jax.grad(loss)(params)


# ---------------------------------------------------------------------------
# Non-finite steps.


def assert_same_snapshot(after, before):
  """Every table and slot in `after` equals `before`, bit for bit."""
  assert set(after[0]) == set(before[0])
  for name in before[0]:
    np.testing.assert_array_equal(after[0][name], before[0][name])
    for slot in before[1][name]:
      np.testing.assert_array_equal(after[1][name][slot], before[1][name][slot])


def test_check_finite_names_step_and_table_and_keeps_state():
  model = build_model(2, 1, SMALL)
  grads = {k: jnp.asarray(v) for k, v in act_grads(0, SMALL).items()}

  def nan_loss_fn(*, model, state, rng, inputs, grads):
    del rng
    acts = model(inputs)
    # sqrt of a negative: NaN loss and NaN activation gradients for "adam".
    bad = jnp.sum(jnp.sqrt(acts["f_adam"].unwrap("batch", "embedding") - 1e3))
    loss = linear_loss(acts, grads) + bad
    return loss, state, {}

  trainer = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), loss_fn, check_finite=True
  )
  inputs, _ = model.embed.preprocess(*make_batch(0, SMALL))
  trainer.step(inputs=inputs, grads=grads)  # One good step first.
  before = snapshot(trainer.model.embed)
  w_before = np.asarray(trainer.model.w.value)
  bad = dataclasses.replace(trainer, loss_fn=nan_loss_fn)
  inputs, _ = model.embed.preprocess(*make_batch(1, SMALL))
  with pytest.raises(NonFiniteUpdateError) as info:
    bad.step(inputs=inputs, grads=grads)
  message = str(info.value)
  assert "step 1" in message
  assert "emb/adam.embeddings" in message
  assert "emb/ftrl.embeddings" not in message
  after = snapshot(bad.model.embed)
  assert_same_snapshot(after, before)
  np.testing.assert_array_equal(np.asarray(bad.model.w.value), w_before)


def test_check_finite_nan_loss_from_log_of_negative():
  model = build_model(1, 1, SMALL)
  grads = {k: jnp.asarray(v) for k, v in act_grads(0, SMALL).items()}

  def log_loss_fn(*, model, state, rng, inputs, grads):
    del rng
    loss = jnp.log(-jnp.abs(linear_loss(model(inputs), grads)) - 1.0)
    return loss, state, {}

  trainer = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), log_loss_fn, check_finite=True
  )
  before = snapshot(trainer.model.embed)
  inputs, _ = model.embed.preprocess(*make_batch(0, SMALL))
  with pytest.raises(NonFiniteUpdateError, match=r"step 0: .*loss"):
    trainer.step(inputs=inputs, grads=grads)
  after = snapshot(trainer.model.embed)
  assert_same_snapshot(after, before)


# ---------------------------------------------------------------------------
# No vocabulary-sized temporaries in the compiled step.

_SHAPE = re.compile(r"\b(?:f32|f64|bf16|s32|u32|pred)\[([0-9,]*)\]")


def _elements(dims: str) -> int:
  return int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1


def tanh_loss_fn(*, model, state, rng, inputs, grads):
  """The activation gradient depends on the lookup (as in real models)."""
  del rng
  acts = model(inputs)
  loss = 0.0
  for name, value in acts.items():
    loss += jnp.sum(jnp.tanh(value.unwrap("batch", "embedding")) * grads[name])
  loss += 0.5 * jnp.sum((model.w.value - TARGET) ** 2)
  return loss, state, {"loss": loss}


@functools.cache
def _lowered_step(g: int, minibatching: bool = False):
  """The trainer's jitted step for a vocab-2**16 Adagrad table on g devices
  (on minibatched buffers: a loop over the minibatches)."""
  vocab, dim = 2**16, 24
  tables = {
    "big": (specs.AdagradOptimizerSpec(learning_rate=0.1), "sum", vocab, dim)
  }
  model = build_model(g, 1, tables)
  trainer = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), tanh_loss_fn
  )
  inputs, _ = model.embed.preprocess(
    *make_batch(0, tables), enable_minibatching=minibatching
  )
  grads = {k: jnp.asarray(v) for k, v in act_grads(0, tables).items()}
  stateless, variables = pz.unbind_variables(trainer.model)
  groups = {"dense": [], "tables": [], "slots": []}
  for var in variables:
    if var.label == "emb/big.embeddings":
      groups["tables"].append(var)
    elif var.label.startswith("emb/big."):
      groups["slots"].append(var)
    else:
      groups["dense"].append(var)
  frozen = {k: pz.freeze_variables(tuple(v)) for k, v in groups.items()}
  # Positional, in the order SparseCoreTrainer.step passes them.
  lowered = trainer.step_fn.lower(
    trainer.root_rng,
    trainer.state.value,
    stateless,
    frozen["dense"],
    (),
    (),
    frozen["tables"],
    frozen["slots"],
    trainer.step_options,
    {"inputs": inputs, "grads": grads},
  )
  return lowered, lowered.compile().as_text(), vocab * dim // g


def _big_instructions(hlo: str, per_device: int) -> list[tuple[str, str]]:
  """(opcode, line) of compiled instructions with a table-sized array."""
  big = []
  for line in hlo.splitlines():
    line = line.strip()
    match = re.match(r"(?:ROOT )?%?[\w.\-]+ = (.*?) ([\w\-]+)\(", line)
    if not match:
      continue
    shapes, opcode = match.groups()
    sizes = [_elements(d) for d in _SHAPE.findall(shapes)]
    if any(size >= per_device for size in sizes):
      big.append((opcode, line[:200]))
  return big


@pytest.mark.parametrize("g", [1, 8])
def test_step_computes_no_dense_table_gradient(g):
  lowered, hlo, per_device = _lowered_step(g)
  big = _big_instructions(hlo, per_device)
  assert big, "the table should appear in the compiled step"
  # Nothing table-sized is computed: no dot, scatter, broadcast, add, ...
  # (copies are the subject of the next test).
  allowed = {
    "parameter",
    "custom-call",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "copy",
    "fusion",
  }
  offenders = [line for opcode, line in big if opcode not in allowed]
  assert not offenders, "\n".join(offenders)
  for opcode, line in big:
    if opcode == "fusion":
      assert "copy_fusion" in line, line
  # The donated table and slot alias outputs of the step.
  assert re.search(r"input_output_alias=\{ \{\d+\}: \(\d+", hlo)
  # Nor in the unoptimised program (global shapes before partitioning).
  text = lowered.as_text()
  for line in text.splitlines():
    if any(
      f"stablehlo.{op}" in line
      for op in (
        "dot_general",
        "scatter",
        "broadcast_in_dim",
        "add",
        "multiply",
      )
    ):
      for shape in re.findall(r"tensor<([0-9x]+)xf32>", line):
        n = int(np.prod([int(x) for x in shape.split("x")]))
        assert n < per_device, line[:200]


@pytest.mark.parametrize(
  "g,minibatching", [(1, False), (8, False), (1, True), (8, True)]
)
def test_step_updates_table_in_place_without_copies(g, minibatching):
  _, hlo, per_device = _lowered_step(g, minibatching)
  big = _big_instructions(hlo, per_device)
  allowed = {
    "parameter",
    "custom-call",
    "get-tuple-element",
    "tuple",
    "bitcast",
    # The minibatches' loop carries the table through its iterations.
    "while",
  }
  offenders = [line for opcode, line in big if opcode not in allowed]
  assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("exchange", ["activations", "rows"])
def test_check_finite_catches_overflowing_updates_and_recovers(exchange):
  """Finite loss and gradients whose squares overflow Adam's velocity: the
  step is refused with every row, slot and dense parameter as it was, and
  the next step with sane gradients trains."""
  model = build_model(4, 2, SMALL, exchange=exchange)
  grads = {k: jnp.asarray(v) for k, v in act_grads(0, SMALL).items()}
  huge = {k: v * 1e25 if k == "f_adam" else v for k, v in grads.items()}
  trainer = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), loss_fn, check_finite=True
  )
  inputs, _ = model.embed.preprocess(*make_batch(0, SMALL))
  before = snapshot(trainer.model.embed)
  w_before = np.asarray(trainer.model.w.value)
  with pytest.raises(NonFiniteUpdateError) as info:
    trainer.step(inputs=inputs, grads=huge)
  message = str(info.value)
  assert "step 0" in message
  assert "emb/adam.embeddings (updated rows)" in message
  assert "emb/ftrl" not in message
  after = snapshot(trainer.model.embed)
  assert_same_snapshot(after, before)
  np.testing.assert_array_equal(np.asarray(trainer.model.w.value), w_before)
  # The refused step still counted (Adam's bias correction reads it).
  assert int(trainer.state.value.step) == 1
  # The next action: a sane step trains, as an unguarded trainer would.
  assert_next_step_as_unguarded(
    trainer, build_model(4, 2, SMALL, exchange=exchange), inputs, grads, before
  )


def assert_next_step_as_unguarded(trainer, model, inputs, grads, before):
  """After one refused step, `trainer`'s next step equals an unguarded
  trainer's second step on `model` (the same initial values), and changes
  every table."""
  plain = SparseCoreTrainer.build(
    jax.random.key(0), model, optax.sgd(0.1), loss_fn
  )
  plain.state.value = dataclasses.replace(
    plain.state.value, step=jnp.ones((), jnp.int32)
  )
  trainer.step(inputs=inputs, grads=grads)
  plain.step(inputs=inputs, grads=grads)
  ours, theirs = snapshot(trainer.model.embed), snapshot(plain.model.embed)
  for name in ours[0]:
    np.testing.assert_allclose(ours[0][name], theirs[0][name], rtol=1e-6)
    assert not np.array_equal(ours[0][name], before[0][name])


def test_trainer_compiles_once_then_once_more_after_a_limits_refresh(caplog):
  """Five steps, one compilation (the step counter, optax's state, the loss
  function's state and the dense parameters come back placed as they went
  in); an FDO limits refresh changes the buffer shapes: one more; five more
  steps, no more."""
  model = build_model(8, 1)

  def counting_loss_fn(*, model, state, rng, inputs, grads):
    loss, _, aux = loss_fn(
      model=model, state=None, rng=rng, inputs=inputs, grads=grads
    )
    return loss, state + 1, aux

  trainer = SparseCoreTrainer.build(
    jax.random.key(1),
    model,
    optax.adam(0.01),
    counting_loss_fn,
    jnp.zeros((), jnp.int32),
  )
  grads = {k: jnp.asarray(v) for k, v in act_grads(3).items()}

  def compiles(trainer, seed):
    caplog.clear()
    stats = None
    with jax.log_compiles(True), caplog.at_level("WARNING"):
      for step in range(5):
        batch = make_batch(seed + step)
        inputs, stats = trainer.model.embed.preprocess(*batch)
        trainer.step(inputs=inputs, grads=grads)
    records = [r.getMessage() for r in caplog.records]
    return sum(
      m.startswith("Compiling jit(_trainer_step)") for m in records
    ), stats

  count, stats = compiles(trainer, 200)
  assert count == 1
  trainer = pzsc.update_limits(trainer, stats, headroom=2.0)
  count, _ = compiles(trainer, 300)
  assert count == 1
  count, _ = compiles(trainer, 400)
  assert count == 0
  assert int(trainer.state.value.step) == 15
  assert int(trainer.state.value.loss_fn_state) == 15


def _busy_processes(n: int) -> list[subprocess.Popen]:
  return [
    subprocess.Popen([sys.executable, "-c", "while True: pass"])
    for _ in range(n)
  ]


def test_unblocked_loop_beside_busy_processes_keeps_two_steps_in_flight():
  """A plain loop of `step` on 8 CPU devices (collectives every step)
  beside two busy processes: `step` never returns with more than
  `max_steps_in_flight` steps unfinished, every earlier one is done, and
  the loop ends with the right step count (an unbounded backlog can make
  XLA's CPU collectives abort the process)."""
  model = build_model(8, 1, exchange="activations")
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(DENSE_LR), loss_fn
  )
  assert trainer.max_steps_in_flight == 2
  grads = {k: jnp.asarray(v) for k, v in act_grads(4).items()}
  embed = trainer.model.embed
  batches = [embed.preprocess(*make_batch(s))[0] for s in range(4)]
  busy = _busy_processes(2)
  try:
    markers = []
    for step in range(60):
      trainer.step(inputs=batches[step % 4], grads=grads)
      in_flight = [marker for marker, _ in trainer.grouping.in_flight]
      assert len(in_flight) <= 2
      markers.extend(m for m in in_flight if all(m is not x for x in markers))
      waited = [m for m in markers if all(m is not x for x in in_flight)]
      assert all(m.is_ready() for m in waited)
  finally:
    for p in busy:
      p.kill()
      p.wait()
  assert int(trainer.state.value.step) == 60
  with pytest.raises(ValueError, match="max_steps_in_flight"):
    SparseCoreTrainer.build(
      jax.random.key(1), model, optax.sgd(0.1), loss_fn, max_steps_in_flight=0
    )


def test_non_finite_input_is_named_first_and_the_step_skipped():
  """check_finite: a NaN in a float input is named as the first non-finite
  value in data-flow order (before the loss and the gradients it causes);
  nothing changes; the next step with finite inputs trains."""
  model = build_model(1, 1, tables=SMALL)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(DENSE_LR), loss_fn, check_finite=True
  )
  grads = {k: jnp.asarray(v) for k, v in act_grads(3, SMALL).items()}
  bad = dict(grads, f_adam=grads["f_adam"].at[2, 1].set(jnp.nan))
  inputs, _ = trainer.model.embed.preprocess(*make_batch(7, SMALL))
  before = snapshot(trainer.model.embed)
  with pytest.raises(
    NonFiniteUpdateError,
    match=r"step 0: the first non-finite value, in data-flow order .* is "
    r"input \['grads'\]\['f_adam'\] \(also non-finite: .*emb/adam",
  ):
    trainer.step(inputs=inputs, grads=bad)
  assert_same_snapshot(snapshot(trainer.model.embed), before)
  aux = trainer.step(inputs=inputs, grads=grads)
  assert np.isfinite(float(aux["loss"]))
  after = snapshot(trainer.model.embed)
  assert not np.array_equal(after[0]["adam"], before[0]["adam"])


def test_default_guard_names_a_non_finite_input_when_its_step_is_waited_for():
  """Without check_finite nothing waits for a step to finish: the step with
  a NaN input is reported (NonFiniteInputError, naming it and the input)
  by the call that waits for it, two steps later, or by `wait`."""
  model = build_model(1, 1, tables=SMALL)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.sgd(DENSE_LR), loss_fn
  )
  grads = {k: jnp.asarray(v) for k, v in act_grads(3, SMALL).items()}
  bad = dict(grads, f_ftrl=grads["f_ftrl"].at[0, 0].set(jnp.inf))
  inputs, _ = trainer.model.embed.preprocess(*make_batch(8, SMALL))
  trainer.step(inputs=inputs, grads=grads)  # step 0
  trainer.step(inputs=inputs, grads=bad)  # step 1
  trainer.step(inputs=inputs, grads=grads)  # step 2
  with pytest.raises(
    NonFiniteInputError, match=r"step 1: .*input \['grads'\]\['f_ftrl'\]"
  ):
    trainer.step(inputs=inputs, grads=grads)  # step 3 waits for step 1
  trainer.wait()  # Steps 2 and 3 had finite inputs.
  assert int(trainer.state.value.step) == 4
  # The same through `wait` when the bad step is the last one.
  trainer.step(inputs=inputs, grads=bad)
  with pytest.raises(NonFiniteInputError, match="step 4"):
    trainer.wait()


def test_limits_from_another_topology_are_refused_naming_both():
  """Statistics measured on 8 devices x 1 SparseCore applied to a layer on
  4 x 1, or on 4 x 2 (as many partitions, other SparseCores): refused,
  naming both; the next action, statistics measured on the layer's own
  topology, applies."""
  _, stats8 = build_model(8, 1).embed.preprocess(*make_batch(1))
  for g, s in ((4, 1), (4, 2)):
    model = build_model(g, s)
    with pytest.raises(
      ValueError,
      match=rf"measured on 8 devices x 1 SparseCores .* this layer runs on "
      rf"{g} devices x {s} SparseCores",
    ):
      pzsc.update_limits(model, stats8)
  # The next action (on 4 x 2): its own statistics apply, and it trains.
  _, own = model.embed.preprocess(*make_batch(1))
  refreshed = pzsc.update_limits(model, own, headroom=2.0)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), refreshed, optax.sgd(DENSE_LR), loss_fn
  )
  inputs, _ = refreshed.embed.preprocess(*make_batch(2))
  grads = {k: jnp.asarray(v) for k, v in act_grads(2).items()}
  assert np.isfinite(float(trainer.step(inputs=inputs, grads=grads)["loss"]))


def test_compiler_options_reach_the_step():
  """Options given to `build` reach XLA: an unknown one is refused by the
  compiler on the first step; the same trainer built without it then
  trains."""
  grads = {k: jnp.asarray(v) for k, v in act_grads(3).items()}
  model = build_model(8, 1)
  refused = SparseCoreTrainer.build(
    jax.random.key(1),
    model,
    optax.adam(0.01),
    loss_fn,
    compiler_options={"xla_no_such_option": True},
  )
  inputs, _ = refused.model.embed.preprocess(*make_batch(500))
  with pytest.raises(Exception, match="xla_no_such_option"):
    refused.step(inputs=inputs, grads=grads)
  trainer = SparseCoreTrainer.build(
    jax.random.key(1), model, optax.adam(0.01), loss_fn
  )
  trainer.step(inputs=inputs, grads=grads)
  assert int(trainer.state.value.step) == 1
