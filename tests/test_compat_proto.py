"""The compat namespace's additions at upstream's 566086d: optimizer protos,
the activation limit, stacking helpers, estimates and renamed arguments.

Expected messages are written out by hand from upstream's schema and
formulas (enum numbers, field names, the worked example's numbers), not
produced by the code under test.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from google.protobuf import text_format

import pz_sparsecore as pzsc
from pz_sparsecore.compat.lib.nn import (
  embedding,
  embedding_proto_utils,
  embedding_spec,
  table_stacking,
)
from pz_sparsecore.compat.lib.proto import embedding_spec_pb2
from pz_sparsecore.compat.utils import utils
from pz_sparsecore.core import spec_proto

_Proto = embedding_spec_pb2.OptimizerSpecProto


def schedule(step):
  return 0.1 / (1 + step)


def other_schedule(step):
  return 0.2 / (1 + step)


# (spec, the message upstream writes for it, by hand).
_OPTIMIZERS = [
  (embedding_spec.SGDOptimizerSpec(learning_rate=0.5), "type: SGD "),
  (
    embedding_spec.AdagradOptimizerSpec(
      learning_rate=0.5, initial_accumulator_value=0.25
    ),
    'type: ADAGRAD float_params { key: "initial_accumulator_value" '
    "value: 0.25 }",
  ),
  (
    embedding_spec.AdamOptimizerSpec(
      learning_rate=0.5, beta_1=0.5, beta_2=0.75, epsilon=0.125
    ),
    'type: ADAM float_params { key: "beta_1" value: 0.5 } '
    'float_params { key: "beta_2" value: 0.75 } '
    'float_params { key: "epsilon" value: 0.125 }',
  ),
  (
    embedding_spec.FTRLOptimizerSpec(
      learning_rate=0.5,
      learning_rate_power=-0.5,
      l1_regularization_strength=0.25,
      l2_regularization_strength=0.5,
      beta=0.125,
      initial_accumulator_value=0.5,
      initial_linear_value=0.0,
      multiply_linear_by_learning_rate=True,
    ),
    'type: FTRL float_params { key: "beta" value: 0.125 } '
    'float_params { key: "initial_accumulator_value" value: 0.5 } '
    'float_params { key: "initial_linear_value" value: 0 } '
    'float_params { key: "l1_regularization_strength" value: 0.25 } '
    'float_params { key: "l2_regularization_strength" value: 0.5 } '
    'float_params { key: "learning_rate_power" value: -0.5 } '
    'bool_params { key: "multiply_linear_by_learning_rate" value: true }',
  ),
  (
    embedding_spec.AdagradMomentumOptimizerSpec(
      learning_rate=0.5, use_nesterov=True
    ),
    'type: ADAGRAD_MOMENTUM float_params { key: "beta2" value: 1 } '
    'float_params { key: "epsilon" value: 1e-10 } '
    'float_params { key: "exponent" value: 2 } '
    'float_params { key: "initial_accumulator_value" value: 0.1 } '
    'float_params { key: "initial_momentum_value" value: 0 } '
    'float_params { key: "momentum" value: 0.9 } '
    'bool_params { key: "use_nesterov" value: true }',
  ),
  (
    embedding_spec.F2AOptimizerSpec(learning_rate=0.5),
    'type: F2A float_params { key: "initial_accumulator_value" value: 0.1 } '
    'float_params { key: "initial_local_step_value" value: 0 } '
    'float_params { key: "l1_regularization_strength" value: 0 } '
    'float_params { key: "l2_regularization_strength" value: 0 } '
    'float_params { key: "max_lr_multiplier" value: 1e+06 } '
    'float_params { key: "rho" value: 0.5 }',
  ),
  # Not in upstream's enum: CUSTOM, no parameters (as upstream writes it).
  (embedding_spec.LaPropOptimizerSpec(learning_rate=0.5), "type: CUSTOM "),
]


def _expected(text: str) -> _Proto:
  return text_format.Parse(f"learning_rate: 0.5 {text}", _Proto())


@pytest.mark.parametrize(
  "optimizer, text", _OPTIMIZERS, ids=lambda x: type(x).__name__
)
def test_optimizer_to_proto(optimizer, text):
  proto = embedding.optimizer_spec_to_proto(optimizer)
  assert proto == _expected(text)
  # A frozen spec gives the same message.
  assert embedding.optimizer_spec_to_proto(optimizer.to_pz()) == proto


@pytest.mark.parametrize(
  "optimizer, text", _OPTIMIZERS[:-1], ids=lambda x: type(x).__name__
)
def test_optimizer_round_trip(optimizer, text):
  del text
  back = embedding.proto_to_optimizer_spec(
    embedding.optimizer_spec_to_proto(optimizer)
  )
  assert type(back) is type(optimizer)
  # Every value comes back rounded to float32 (the schema's float).
  for name, value in optimizer._values().items():
    if isinstance(value, bool):
      assert getattr(back, name) is value
    else:
      assert np.float32(getattr(back, name)) == np.float32(value), name


def test_custom_and_unset_read_back_as_sgd():
  custom = _Proto(type=_Proto.CUSTOM, learning_rate=0.5)
  assert embedding.proto_to_optimizer_spec(
    custom
  ) == embedding_spec.SGDOptimizerSpec(learning_rate=0.5)
  assert embedding.proto_to_optimizer_spec(
    None
  ) == embedding_spec.SGDOptimizerSpec(learning_rate=0.0)
  assert embedding.optimizer_spec_to_proto(None) is None


def test_optimizer_type_numbers():
  # Upstream's enum: UNSPECIFIED 0, SGD 1, ADAGRAD 2, ADAM 3, FTRL 4, F2A 5,
  # ADAGRAD_MOMENTUM 6, CUSTOM 7.
  expected = {
    1: embedding_spec.SGDOptimizerSpec,
    2: embedding_spec.AdagradOptimizerSpec,
    3: embedding_spec.AdamOptimizerSpec,
    4: embedding_spec.FTRLOptimizerSpec,
    5: embedding_spec.F2AOptimizerSpec,
    6: embedding_spec.AdagradMomentumOptimizerSpec,
  }
  for number, cls in expected.items():
    assert embedding.get_optimizer_class(number) is cls
    assert embedding.get_optimizer_type(cls) == number
    assert embedding.get_optimizer_type(getattr(pzsc, cls.__name__)) == number
  for number in (0, 7, 99):
    assert embedding.get_optimizer_class(number) is None
  for cls in (
    embedding_spec.LaPropOptimizerSpec,
    embedding_spec.CustomOptimizerSpec,
    pzsc.RowwiseAdagradOptimizerSpec,
    int,
  ):
    assert embedding.get_optimizer_type(cls) == 7
  assert embedding.get_optimizer_class is (
    embedding_proto_utils.get_optimizer_class
  )


def test_callable_learning_rate_is_a_tag():
  proto = embedding.optimizer_spec_to_proto(
    embedding_spec.SGDOptimizerSpec(learning_rate=schedule)
  )
  assert proto.WhichOneof("learning_rate_spec") == "learning_rate_tag"
  assert proto.learning_rate_tag == f"{__name__}.schedule"
  other = embedding.optimizer_spec_to_proto(
    embedding_spec.SGDOptimizerSpec(learning_rate=other_schedule)
  )
  assert other.learning_rate_tag != proto.learning_rate_tag
  back = embedding.proto_to_optimizer_spec(proto)
  placeholder = back.learning_rate
  assert placeholder == embedding_spec.CallablePlaceholder(
    f"{__name__}.schedule"
  )
  assert hash(placeholder) == hash(
    embedding_spec.CallablePlaceholder(f"{__name__}.schedule")
  )
  assert back != embedding.proto_to_optimizer_spec(other)
  with pytest.raises(RuntimeError, match="schedule"):
    back.get_learning_rate(3)
  # A placeholder keeps its tag when written again.
  assert embedding.optimizer_spec_to_proto(back) == proto
  # Two lambdas are told apart.
  a, b = (
    embedding.optimizer_spec_to_proto(
      embedding_spec.SGDOptimizerSpec(learning_rate=lambda s: s)
    ).learning_rate_tag
    for _ in range(2)
  )
  assert a and b and "<lambda>" not in a


def test_float_and_bool_params():
  spec = embedding_spec.AdagradMomentumOptimizerSpec(
    learning_rate=0.5, momentum=0.25, use_nesterov=True
  )
  assert spec.get_float_params() == {
    "momentum": 0.25,
    "beta2": 1.0,
    "epsilon": 1e-10,
    "exponent": 2.0,
    "initial_accumulator_value": 0.1,
    "initial_momentum_value": 0.0,
  }
  assert spec.get_bool_params() == {"use_nesterov": True}
  assert embedding_spec.SGDOptimizerSpec().get_float_params() == {}
  # rms_clip_threshold (None) is left out.
  assert set(embedding_spec.LaPropOptimizerSpec().get_float_params()) == {
    "b1",
    "b2",
    "eps",
    "initial_slot_value",
  }
  rebuilt = embedding_spec.AdamOptimizerSpec.from_float_and_bool_params(
    {"beta_1": 0.5, "unknown": 3.0}, {"use_nesterov": True}, learning_rate=0.25
  )
  assert rebuilt == embedding_spec.AdamOptimizerSpec(
    learning_rate=0.25, beta_1=0.5
  )


def _two_tables():
  def table(name, vocab):
    return embedding_spec.TableSpec(
      name=name,
      vocabulary_size=vocab,
      embedding_dim=14,
      initializer=jax.nn.initializers.zeros,
      optimizer=embedding_spec.SGDOptimizerSpec(learning_rate=0.5),
      combiner="sum",
    )

  return [
    embedding_spec.FeatureSpec(
      name=f"f{name}",
      table_spec=table(name, vocab),
      input_shape=[16, 1],
      output_shape=[16, 14],
    )
    for name, vocab in (("a", 32), ("b", 128))
  ]


@pytest.mark.parametrize("limit, expected", [(None, 2097152), (2**26, 2**26)])
def test_activation_limit_is_recorded(limit, expected):
  features = _two_tables()
  embedding.auto_stack_tables(
    features,
    global_device_count=2,
    num_sc_per_device=2,
    activation_mem_bytes_limit=limit,
  )
  stack = features[0].table_spec.stacked_table_spec
  assert stack.activation_mem_bytes_limit == expected
  proto = embedding.create_proto_from_feature_specs(features, 2, 2)
  stack_proto = proto.stacked_table_specs[0]
  assert stack_proto.HasField("activation_mem_bytes_limit")
  assert stack_proto.activation_mem_bytes_limit == expected
  table = stack_proto.table_specs[0]
  assert table.combiner == "sum"
  assert table.optimizer == text_format.Parse(
    "type: SGD learning_rate: 0.5", _Proto()
  )


def test_stack_tables_records_the_limit_and_the_default():
  assert embedding_spec.DEFAULT_ACTIVATION_MEM_BYTES_LIMIT == 2 * 1024 * 1024
  features = _two_tables()
  table_stacking.stack_tables(
    features, ["a", "b"], 2, 2, activation_mem_bytes_limit=1000
  )
  assert features[
    1
  ].table_spec.stacked_table_spec.activation_mem_bytes_limit == (1000)
  features = _two_tables()
  embedding.prepare_feature_specs_for_training(features, 2, 2)
  assert features[
    0
  ].table_spec.stacked_table_spec.activation_mem_bytes_limit == (2097152)
  with pytest.raises(ValueError, match="activation_mem_bytes_limit"):
    features[0].table_spec.stacked_table_spec.replace(
      activation_mem_bytes_limit=0
    )


def test_proto_gives_back_optimizer_combiner_and_limit():
  features = _two_tables()
  embedding.auto_stack_tables(
    features, 2, 2, activation_mem_bytes_limit=5 * 2**20
  )
  frozen = embedding_spec.to_pz(features)
  proto = pzsc.create_proto_from_feature_specs(frozen, 2, 2)
  back = pzsc.feature_specs_from_proto(
    proto, initializer=jax.nn.initializers.zeros
  )
  stack = pzsc.get_stacked_table_specs(back)["a_b"]
  assert stack.optimizer == pzsc.SGDOptimizerSpec(learning_rate=0.5)
  assert stack.combiner == "sum"
  assert stack.activation_mem_bytes_limit == 5 * 2**20
  proto.stacked_table_specs[0].table_specs[1].ClearField("optimizer")
  with pytest.raises(ValueError, match="table 'b' .* has no optimizer"):
    pzsc.feature_specs_from_proto(proto, initializer=jax.nn.initializers.zeros)


def test_compute_table_to_setting_in_stack():
  # a: 32 rows on 4 shards = 8 per shard; b: 128 = 32 per shard from row 8,
  # rotated by 2; c after them from row 40, rotated by 4 % 4 = 0.
  settings = table_stacking.compute_table_to_setting_in_stack(
    stack_name="s",
    table_names=["a", "b", "c"],
    padded_embedding_dim=16,
    table_to_padded_vocab_size={"a": 32, "b": 128, "c": 32},
    num_shards=4,
    rotation=2,
  )
  assert {
    name: (x.row_offset_in_shard, x.shard_rotation, x.padded_vocab_size)
    for name, x in settings.items()
  } == {"a": (0, 0, 32), "b": (8, 2, 128), "c": (40, 0, 32)}
  assert {x.stack_name for x in settings.values()} == {"s"}
  assert {x.padded_embedding_dim for x in settings.values()} == {16}
  with pytest.raises(ValueError, match="table 'x'"):
    table_stacking.compute_table_to_setting_in_stack("s", ["x"], 16, {}, 4, 2)


def _prepared():
  features = _two_tables()
  embedding.prepare_feature_specs_for_training(features, 2, 2)
  return features


def _stats():
  stats = embedding.SparseDenseMatmulInputStats(
    max_ids_per_partition={"a": np.array([12]), "b": np.array([20])},
    max_unique_ids_per_partition={"a": np.array([4]), "b": np.array([9])},
  )
  return stats


def test_update_preprocessing_parameters_takes_upstreams_keyword():
  by_upstream, by_ours = _prepared(), _prepared()
  embedding.update_preprocessing_parameters(
    by_upstream, updated_params=_stats(), num_sc_per_device=2
  )
  embedding.update_preprocessing_parameters(by_ours, stats=_stats())
  for a, b in zip(by_upstream, by_ours, strict=True):
    assert a.table_spec.stacked_table_spec == b.table_spec.stacked_table_spec
  stack = by_upstream[1].table_spec.stacked_table_spec
  assert (stack.max_ids_per_partition, stack.max_unique_ids_per_partition) == (
    20,
    9,
  )
  with pytest.raises(ValueError, match="pass the stats once"):
    embedding.update_preprocessing_parameters(_prepared())
  with pytest.raises(ValueError, match="pass the stats once"):
    embedding.update_preprocessing_parameters(
      _prepared(), _stats(), stats=_stats()
    )


def test_sparse_dense_matmul_input():
  features = _prepared()
  ids = np.arange(16).reshape(16, 1) % 32
  inputs, _ = embedding.preprocess_sparse_dense_matmul_input(
    [ids, ids], None, features, 2, 2, num_sc_per_device=2
  )
  grouped = inputs.sparse_dense_matmul_input
  assert isinstance(grouped, embedding.SparseDenseMatmulInput)
  assert grouped._fields == (
    "lhs_row_pointers",
    "lhs_embedding_ids",
    "lhs_sample_ids",
    "lhs_gains",
  )
  assert grouped.lhs_row_pointers is inputs.lhs_row_pointers
  assert grouped.lhs_gains is inputs.lhs_gains


def test_estimate_preprocessing_parameters():
  # 4096 samples, 4 x 4 SparseCores, valency 10: 256 samples and 2560
  # lookups per SparseCore; busiest partition 1.25 * (0.2 * 2560 + 0.8 *
  # 2560 / 16 + 2 * sqrt(160)) = 831.6; buffer 1.2 * 1024 * 10 + 14 * 16.
  busiest = 1.25 * (512 + 128 + 2 * math.sqrt(160))
  assert 831 < busiest < 832
  assert utils.estimate_preprocessing_parameters(
    global_batch_size=4096,
    global_device_count=4,
    num_sc_per_device=4,
    valency=10,
  ) == {
    "max_ids_per_partition": 832,
    "max_unique_ids_per_partition": 416,
    "suggested_coo_buffer_size_per_device": 12512,
  }
  # Few lookups: the buffer is the SparseCores' share of the limit.
  small = utils.estimate_preprocessing_parameters(
    global_batch_size=64,
    global_device_count=1,
    num_sc_per_device=4,
    valency=1,
    hot_shard_fraction=1.0,
    headroom_factor=1.0,
  )
  # 16 lookups per SparseCore, all hot: 16 + 0 + 2 * sqrt(4) = 20 -> 24;
  # buffer max(4 * 24, 1.2 * 64 + 56 = 132.8) -> 133 rounded to 32: 160.
  assert small == {
    "max_ids_per_partition": 24,
    "max_unique_ids_per_partition": 16,
    "suggested_coo_buffer_size_per_device": 160,
  }
  with pytest.raises(ValueError, match="valency must be positive, got 0"):
    utils.estimate_preprocessing_parameters(
      global_batch_size=64,
      global_device_count=1,
      num_sc_per_device=4,
      valency=0,
    )


def test_the_message_classes_are_the_cores():
  assert embedding_spec_pb2.OptimizerSpecProto is spec_proto.OptimizerSpecProto
