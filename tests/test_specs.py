"""Tests of the table, feature and optimizer specs (pz_sparsecore.core.specs).

Expectations are literals from the upstream jax-tpu-embedding 0.1.0 API
(constructor signatures, defaults, hyper-parameter orders) and numpy
restatements of the Adam bias correction.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pz_sparsecore.core import specs
from pz_sparsecore.core.specs import (
  AdagradMomentumOptimizerSpec,
  AdagradOptimizerSpec,
  AdamOptimizerSpec,
  FeatureSpec,
  FTRLOptimizerSpec,
  SGDOptimizerSpec,
  TableSpec,
)

_EMPTY = inspect.Parameter.empty
_KW = inspect.Parameter.KEYWORD_ONLY


def _init(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, dtype)


def _table(**overrides) -> TableSpec:
  kwargs = dict(
    name="t",
    vocabulary_size=32,
    embedding_dim=8,
    initializer=_init,
    optimizer=SGDOptimizerSpec(),
    combiner="sum",
  )
  kwargs.update(overrides)
  return TableSpec(**kwargs)


def _params(cls) -> list[tuple[str, object]]:
  return [
    (p.name, p.default) for p in inspect.signature(cls).parameters.values()
  ]


# ---------------------------------------------------------------------------
# Signatures and defaults (upstream's, field by field).

_OPTIMIZER_SIGNATURES = {
  SGDOptimizerSpec: [("learning_rate", 0.001)],
  AdagradOptimizerSpec: [
    ("learning_rate", 0.001),
    ("initial_accumulator_value", 0.1),
  ],
  AdagradMomentumOptimizerSpec: [
    ("learning_rate", 0.001),
    ("momentum", 0.9),
    ("beta2", 1.0),
    ("epsilon", 1e-10),
    ("exponent", 2.0),
    ("use_nesterov", False),
    ("initial_accumulator_value", 0.1),
    ("initial_momentum_value", 0.0),
  ],
  AdamOptimizerSpec: [
    ("learning_rate", 0.001),
    ("beta_1", 0.9),
    ("beta_2", 0.999),
    ("epsilon", 1e-08),
  ],
  FTRLOptimizerSpec: [
    ("learning_rate", 0.01),
    ("learning_rate_power", -0.5),
    ("l1_regularization_strength", 0.0),
    ("l2_regularization_strength", 0.0),
    ("beta", 0.0),
    ("initial_accumulator_value", 0.1),
    ("initial_linear_value", 0.0),
    ("multiply_linear_by_learning_rate", False),
  ],
}


@pytest.mark.parametrize("cls", list(_OPTIMIZER_SIGNATURES))
def test_optimizer_signature_matches_upstream(cls):
  assert _params(cls) == _OPTIMIZER_SIGNATURES[cls]


def test_table_spec_signature_matches_upstream():
  params = list(inspect.signature(TableSpec).parameters.values())
  expected = [
    ("name", _EMPTY),
    ("vocabulary_size", _EMPTY),
    ("embedding_dim", _EMPTY),
    ("initializer", _EMPTY),
    ("optimizer", _EMPTY),
    ("combiner", _EMPTY),
    ("max_ids_per_partition", 256),
    ("max_unique_ids_per_partition", 256),
    ("suggested_coo_buffer_size_per_device", None),
    ("quantization_config", None),
  ]
  assert [(p.name, p.default) for p in params[: len(expected)]] == expected
  assert all(p.kind == _KW for p in params)
  # Anything beyond upstream's public fields must be optional.
  assert all(p.default is not _EMPTY for p in params[len(expected) :])


def test_feature_spec_signature_matches_upstream():
  params = list(inspect.signature(FeatureSpec).parameters.values())
  names = ["name", "table_spec", "input_shape", "output_shape"]
  assert [p.name for p in params[:4]] == names
  assert all(p.default is _EMPTY for p in params[:4])
  assert all(p.kind == _KW for p in params)
  assert all(p.default is not _EMPTY for p in params[4:])


def test_table_spec_defaults():
  table = _table()
  assert table.max_ids_per_partition == 256
  assert table.max_unique_ids_per_partition == 256
  assert table.suggested_coo_buffer_size_per_device is None
  assert table.quantization_config is None
  assert table.stacked_table_spec is None
  setting = table.setting_in_stack
  assert setting.stack_name == "t"
  assert setting.padded_vocab_size == 32
  assert setting.padded_embedding_dim == 8
  assert setting.row_offset_in_shard == 0
  assert setting.shard_rotation == 0


def test_positional_table_spec_rejected():
  with pytest.raises(TypeError):
    TableSpec("t", 32, 8, _init, SGDOptimizerSpec(), "sum")


# ---------------------------------------------------------------------------
# Frozen records.


def test_specs_are_frozen():
  table = _table()
  feature = FeatureSpec(
    name="f", table_spec=table, input_shape=[4, 2], output_shape=[4, 8]
  )
  with pytest.raises(dataclasses.FrozenInstanceError):
    table.vocabulary_size = 64
  with pytest.raises(dataclasses.FrozenInstanceError):
    feature.name = "g"
  with pytest.raises(dataclasses.FrozenInstanceError):
    SGDOptimizerSpec().learning_rate = 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    AdamOptimizerSpec().beta_1 = 0.5


def test_replace_returns_new_spec():
  table = _table()
  bigger = table.replace(vocabulary_size=64)
  assert bigger.vocabulary_size == 64
  assert table.vocabulary_size == 32


# ---------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize("combiner", ["max", "", "SUM", None])
def test_unknown_combiner(combiner):
  with pytest.raises(ValueError, match="combiner"):
    _table(combiner=combiner)


@pytest.mark.parametrize(
  "field",
  [
    "vocabulary_size",
    "embedding_dim",
    "max_ids_per_partition",
    "max_unique_ids_per_partition",
    "suggested_coo_buffer_size_per_device",
  ],
)
@pytest.mark.parametrize("value", [0, -3])
def test_non_positive_sizes(field, value):
  with pytest.raises(ValueError, match=field):
    _table(**{field: value})


def test_quantization_config_must_be_a_config():
  with pytest.raises(ValueError, match="quantization"):
    _table(quantization_config=object())


def test_output_dim_exceeds_embedding_dim_refused_by_the_layer():
  # Accepted in a spec (upstream checks it only when activations are
  # unstacked); the layer, which makes the activations, refuses it.
  from jax.sharding import Mesh

  from pz_sparsecore import SparseCoreEmbed

  table = _table(embedding_dim=8)
  wide = FeatureSpec(
    name="f", table_spec=table, input_shape=[8], output_shape=[8, 9]
  )
  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  with pytest.raises(ValueError, match=r"feature 'f': output_shape\[-1\]=9"):
    SparseCoreEmbed.from_config("e", jax.random.key(0), [wide], mesh)
  ok = wide.replace(output_shape=[8, 8])
  embed = SparseCoreEmbed.from_config("e", jax.random.key(0), [ok], mesh)
  assert embed is not None


def test_quantization_config_checks_its_fields():
  from pz_sparsecore import QuantizationConfig

  config = QuantizationConfig(min_value=-1.0, max_value=1.0, num_buckets=16)
  table = _table(embedding_dim=8, quantization_config=config)
  assert table.quantization_config.as_tuple() == (-1.0, 1.0, 16)
  with pytest.raises(ValueError, match="num_buckets must be >= 2"):
    QuantizationConfig(min_value=0.0, max_value=1.0, num_buckets=1)
  with pytest.raises(ValueError, match="min_value must be < max_value"):
    QuantizationConfig(min_value=1.0, max_value=1.0, num_buckets=4)
  with pytest.raises(ValueError, match="quantization_config must be"):
    _table(embedding_dim=8, quantization_config=(0.0, 1.0, 4))


def test_feature_sample_count():
  feature = FeatureSpec(
    name="f",
    table_spec=_table(),
    input_shape=[4, 3, 2],
    output_shape=[4, 3, 8],
  )
  assert feature.sample_count == 12


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
  "cls, field",
  [
    (SGDOptimizerSpec, "learning_rate"),
    (AdagradOptimizerSpec, "initial_accumulator_value"),
    (AdagradMomentumOptimizerSpec, "momentum"),
    (AdagradMomentumOptimizerSpec, "epsilon"),
    (AdamOptimizerSpec, "learning_rate"),
    (AdamOptimizerSpec, "beta_1"),
    (AdamOptimizerSpec, "beta_2"),
    (AdamOptimizerSpec, "epsilon"),
    (FTRLOptimizerSpec, "learning_rate_power"),
    (FTRLOptimizerSpec, "l1_regularization_strength"),
    (FTRLOptimizerSpec, "beta"),
  ],
)
def test_non_finite_hyperparameters(cls, field, bad):
  with pytest.raises(ValueError, match=field):
    cls(**{field: bad})


def test_non_optimizer_rejected():
  with pytest.raises(ValueError, match="optimizer"):
    _table(optimizer="sgd")


# ---------------------------------------------------------------------------
# Hyper-parameters.


def _as_floats(values) -> list[float]:
  for v in values:
    assert jnp.asarray(v).dtype == jnp.float32
    assert jnp.shape(v) == ()
  return [float(v) for v in values]


def test_sgd_and_adagrad_hyperparameters():
  assert _as_floats(SGDOptimizerSpec(0.25).get_hyperparameters()) == [0.25]
  adagrad = AdagradOptimizerSpec(learning_rate=0.5)
  assert _as_floats(adagrad.get_hyperparameters(3)) == [0.5]


@pytest.mark.parametrize("nesterov", [False, True])
def test_adagrad_momentum_hyperparameters(nesterov):
  spec = AdagradMomentumOptimizerSpec(
    learning_rate=0.5,
    momentum=0.75,
    beta2=0.875,
    epsilon=0.125,
    exponent=4.0,
    use_nesterov=nesterov,
  )
  assert _as_floats(spec.get_hyperparameters(7)) == [
    0.5,
    0.75,
    0.875,
    0.125,
    4.0,
    1.0 if nesterov else 0.0,
  ]


def test_ftrl_hyperparameters():
  spec = FTRLOptimizerSpec(
    learning_rate=0.5,
    learning_rate_power=-0.25,
    l1_regularization_strength=0.125,
    l2_regularization_strength=2.0,
    beta=0.75,
  )
  assert _as_floats(spec.get_hyperparameters()) == [
    0.5,
    -0.25,
    0.125,
    2.0,
    0.75,
  ]


def _adam_reference(lr, b1, b2, eps, step):
  # The betas enter as float32; 1 - f32(0.999) differs from 0.001 by 1e-5
  # relative, so round them first and evaluate the formula in float64.
  b1, b2 = float(np.float32(b1)), float(np.float32(b2))
  t = step + 1
  c = np.sqrt(1.0 - b2**t)
  return [lr * c / (1.0 - b1**t), b1, b2, eps * c]


@pytest.mark.parametrize("step", [None, 0, 5])
@pytest.mark.parametrize(
  "lr, b1, b2, eps", [(0.001, 0.9, 0.999, 1e-8), (0.1, 0.5, 0.75, 0.01)]
)
def test_adam_bias_correction(step, lr, b1, b2, eps):
  spec = AdamOptimizerSpec(learning_rate=lr, beta_1=b1, beta_2=b2, epsilon=eps)
  got = _as_floats(spec.get_hyperparameters(step))
  expected = _adam_reference(lr, b1, b2, eps, 0 if step is None else step)
  np.testing.assert_allclose(got, expected, rtol=2e-6)


def test_adam_step_zero_literal():
  # t = 1: c = sqrt(1 - 0.999), alpha = 0.001 * c / 0.1, eps_hat = 1e-8 * c
  # (tolerance covers float32 rounding of beta_2 = 0.999).
  got = _as_floats(AdamOptimizerSpec().get_hyperparameters(0))
  c = math.sqrt(0.001)
  np.testing.assert_allclose(got, [0.01 * c, 0.9, 0.999, 1e-8 * c], rtol=1e-5)


def test_learning_rate_forms():
  assert float(SGDOptimizerSpec(0.5).get_learning_rate()) == 0.5
  assert float(SGDOptimizerSpec(lambda: 0.25).get_learning_rate(9)) == 0.25
  schedule = SGDOptimizerSpec(lambda step: 0.5 * step)
  assert float(schedule.get_learning_rate(3)) == 1.5
  assert float(schedule.get_hyperparameters(4)[0]) == 2.0
  with pytest.raises(ValueError, match="step"):
    schedule.get_learning_rate()
  with pytest.raises(ValueError, match="step"):
    AdamOptimizerSpec(lambda step: 0.1).get_hyperparameters(None)


def test_scalar_array_learning_rate_is_hashable_float():
  spec = SGDOptimizerSpec(jnp.float32(0.5))
  assert float(spec.get_learning_rate()) == 0.5
  assert spec == SGDOptimizerSpec(0.5)
  hash(spec)


def test_hyperparameters_under_jit_with_traced_step():
  spec = AdamOptimizerSpec(
    learning_rate=lambda step: 0.1 / (1.0 + step), beta_1=0.5, beta_2=0.75
  )
  hyper = jax.jit(spec.get_hyperparameters)
  for step in (0, 5):
    got = [float(v) for v in hyper(jnp.int32(step))]
    lr = 0.1 / (1.0 + step)
    np.testing.assert_allclose(
      got, _adam_reference(lr, 0.5, 0.75, 1e-8, step), rtol=2e-6
    )
  ftrl = FTRLOptimizerSpec(learning_rate=lambda step: 0.5 * step)
  got = jax.jit(ftrl.get_hyperparameters)(jnp.float32(2.0))
  assert [float(v) for v in got] == [1.0, -0.5, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------
# Slots.


@pytest.mark.parametrize(
  "spec, expected",
  [
    (SGDOptimizerSpec(), {}),
    (AdagradOptimizerSpec(), {"accumulator": 0.1}),
    (AdagradOptimizerSpec(initial_accumulator_value=0.5), {"accumulator": 0.5}),
    (
      AdagradMomentumOptimizerSpec(
        initial_accumulator_value=0.25, initial_momentum_value=0.5
      ),
      {"accumulator": 0.25, "momentum": 0.5},
    ),
    (AdamOptimizerSpec(), {"momentum": 0.0, "velocity": 0.0}),
    (FTRLOptimizerSpec(), {"accumulator": 0.1, "linear": 0.0}),
    (
      FTRLOptimizerSpec(initial_accumulator_value=1.0, initial_linear_value=2),
      {"accumulator": 1.0, "linear": 2.0},
    ),
  ],
)
def test_slot_initializers(spec, expected):
  slots = spec.slot_variables_initializers()
  assert tuple(slots._fields) == tuple(expected)
  assert spec.slot_names() == tuple(expected)
  key = jax.random.key(0)
  for name, value in expected.items():
    init = getattr(slots, name)
    array = np.asarray(init(key, (3, 8)))
    assert array.shape == (3, 8)
    assert array.dtype == np.float32
    np.testing.assert_array_equal(array, np.full((3, 8), value, np.float32))


def test_short_names():
  assert SGDOptimizerSpec().short_name() == "sgd"
  assert AdagradOptimizerSpec().short_name() == "adagrad"
  assert AdagradMomentumOptimizerSpec().short_name() == "adagrad_momentum"
  assert AdamOptimizerSpec().short_name() == "adam"
  assert FTRLOptimizerSpec().short_name() == "ftrl"


# ---------------------------------------------------------------------------
# Equality and hashing (decides stack grouping).


def test_optimizer_equality_and_hash():
  assert AdamOptimizerSpec() == AdamOptimizerSpec()
  assert hash(AdamOptimizerSpec()) == hash(AdamOptimizerSpec())
  assert AdamOptimizerSpec() != AdamOptimizerSpec(beta_1=0.8)
  assert AdamOptimizerSpec() != AdamOptimizerSpec(learning_rate=0.01)
  assert AdagradOptimizerSpec() != AdagradOptimizerSpec(
    initial_accumulator_value=0.2
  )
  # Different classes with the same learning rate differ.
  assert SGDOptimizerSpec(0.1) != AdagradOptimizerSpec(0.1)
  assert len({SGDOptimizerSpec(), SGDOptimizerSpec(), AdamOptimizerSpec()}) == 2


def test_table_and_feature_equality_and_hash():
  a, b = _table(), _table()
  assert a == b and hash(a) == hash(b)
  assert a != _table(vocabulary_size=64)
  assert a != _table(optimizer=SGDOptimizerSpec(0.5))
  fa = FeatureSpec(name="f", table_spec=a, input_shape=[4], output_shape=[4, 8])
  fb = FeatureSpec(
    name="f", table_spec=b, input_shape=(4,), output_shape=(4, 8)
  )
  assert fa == fb and hash(fa) == hash(fb)
  assert len({fa, fb}) == 1


def test_stacked_table_spec_validation():
  kwargs = dict(
    stack_name="s",
    stack_vocab_size=64,
    stack_embedding_dim=8,
    optimizer=SGDOptimizerSpec(),
    combiner="mean",
    total_sample_count=16,
  )
  spec = specs.StackedTableSpec(**kwargs)
  assert spec.max_ids_per_partition == 256
  assert spec.max_unique_ids_per_partition == 256
  assert spec.suggested_coo_buffer_size_per_device is None
  assert spec.replace(max_ids_per_partition=7).max_ids_per_partition == 7
  assert spec.max_ids_per_partition == 256
  with pytest.raises(ValueError, match="combiner"):
    specs.StackedTableSpec(**{**kwargs, "combiner": "max"})
  with pytest.raises(ValueError, match="max_ids_per_partition"):
    spec.replace(max_ids_per_partition=0)
