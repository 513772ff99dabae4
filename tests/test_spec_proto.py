"""Tests of the embedding spec proto (pz_sparsecore.core.spec_proto).

The schema is checked against a table written out from upstream's
`embedding_spec.proto` (jax-tpu-embedding at 566086d), the wire format against
hand-encoded bytes, and the layout against hand-computed values; none of
them is derived from the module's own descriptor code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import descriptor_pool, message_factory, text_format

import pz_sparsecore as pzsc
from pz_sparsecore.compat.lib.proto import embedding_spec_pb2
from pz_sparsecore.core import spec_proto

_PACKAGE = "third_party.py.jax_tpu_embedding.sparsecore_lib_proto"

# Upstream's embedding_spec.proto: (message, field, number, type, repeated).
_UPSTREAM_SCHEMA = [
  ("FeatureSpecProto", "feature_name", 1, "string", False),
  ("FeatureSpecProto", "input_shape", 2, "int64", True),
  ("FeatureSpecProto", "output_shape", 3, "int64", True),
  ("FeatureSpecProto", "row_offset", 4, "int64", False),
  ("FeatureSpecProto", "col_offset", 5, "int64", False),
  ("FeatureSpecProto", "col_shift", 6, "int64", False),
  ("OptimizerSpecProto", "type", 1, "OptimizerType", False),
  ("OptimizerSpecProto", "learning_rate", 2, "float", False),
  ("OptimizerSpecProto", "learning_rate_tag", 3, "string", False),
  ("OptimizerSpecProto", "float_params", 4, "FloatParamsEntry", True),
  ("OptimizerSpecProto", "bool_params", 5, "BoolParamsEntry", True),
  ("TableSpecProto", "table_name", 1, "string", False),
  ("TableSpecProto", "vocab_size", 2, "int64", False),
  ("TableSpecProto", "embedding_dim", 3, "int64", False),
  ("TableSpecProto", "max_ids_per_partition", 5, "int64", False),
  ("TableSpecProto", "max_unique_ids_per_partition", 6, "int64", False),
  ("TableSpecProto", "padded_vocab_size", 7, "int64", False),
  ("TableSpecProto", "padded_embedding_dim", 8, "int64", False),
  ("TableSpecProto", "row_offset_in_shard", 9, "int64", False),
  ("TableSpecProto", "shard_rotation", 10, "int64", False),
  ("TableSpecProto", "feature_specs", 11, "FeatureSpecProto", True),
  ("TableSpecProto", "combiner", 12, "string", False),
  ("TableSpecProto", "optimizer", 13, "OptimizerSpecProto", False),
  ("StackedTableSpecProto", "stack_name", 1, "string", False),
  ("StackedTableSpecProto", "stack_vocab_size", 2, "int64", False),
  ("StackedTableSpecProto", "stack_embedding_dim", 3, "int64", False),
  ("StackedTableSpecProto", "total_sample_count", 6, "int64", False),
  ("StackedTableSpecProto", "max_ids_per_partition", 7, "int64", False),
  ("StackedTableSpecProto", "max_unique_ids_per_partition", 8, "int64", False),
  ("StackedTableSpecProto", "num_sparsecores", 9, "int64", False),
  ("StackedTableSpecProto", "table_specs", 10, "TableSpecProto", True),
  ("StackedTableSpecProto", "activation_mem_bytes_limit", 11, "int64", False),
  (
    "EmbeddingSpecProto",
    "stacked_table_specs",
    1,
    "StackedTableSpecProto",
    True,
  ),
]


def _init(key, shape, dtype=None):
  return jax.numpy.zeros(shape, dtype or jax.numpy.float32)


def _table(name, vocab, dim, **kwargs) -> pzsc.TableSpec:
  kwargs.setdefault("optimizer", pzsc.SGDOptimizerSpec())
  return pzsc.TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=_init,
    combiner="sum",
    **kwargs,
  )


def _features() -> dict[str, pzsc.FeatureSpec]:
  """Tables a (32 x 14), b (100 x 12), c (1000 x 40, Adagrad); 5 features."""
  a, b = _table("a", 32, 14), _table("b", 100, 12)
  c = _table(
    "c",
    1000,
    40,
    optimizer=pzsc.AdagradOptimizerSpec(),
    max_ids_per_partition=64,
  )
  specs = [
    ("fa", a, [16, 1], [16, 14]),
    ("fb1", b, [16, 3], [16, 12]),
    ("fb2", b, [4, 2], [4, 2, 12]),
    ("zc", c, [32, 5], [32, 40]),
    ("yc", c, [8, 5], [8, 40]),
  ]
  return {
    name: pzsc.FeatureSpec(
      name=name, table_spec=t, input_shape=i, output_shape=o
    )
    for name, t, i, o in specs
  }


def _stacked(devices=2, sc=2):
  """`_features` with a and b stacked (a first), c alone, in list order."""
  features = _features()
  listed = [features[n] for n in ("fa", "fb1", "fb2", "zc", "yc")]
  listed = pzsc.stack_tables(listed, ["a", "b"], devices, sc)
  return pzsc.prepare_feature_specs_for_training(
    listed, global_device_count=devices, num_sc_per_device=sc
  )


def _arguments(specs) -> dict:
  tables = pzsc.get_table_specs(specs).values()
  return dict(
    initializer={t.name: t.initializer for t in tables},
    optimizer={t.name: t.optimizer for t in tables},
    combiner="sum",
  )


# ---------------------------------------------------------------------------
# Schema and wire format.


# Upstream's OptimizerSpecProto.OptimizerType, numbered from 0.
_UPSTREAM_OPTIMIZER_TYPES = [
  "OPTIMIZER_TYPE_UNSPECIFIED",
  "SGD",
  "ADAGRAD",
  "ADAM",
  "FTRL",
  "F2A",
  "ADAGRAD_MOMENTUM",
  "CUSTOM",
]


def test_schema_matches_upstream():
  field = spec_proto.FeatureSpecProto.DESCRIPTOR.fields[0]
  type_names = {
    field.TYPE_STRING: "string",
    field.TYPE_INT64: "int64",
    field.TYPE_FLOAT: "float",
  }
  found = []
  for message in (
    "FeatureSpecProto",
    "OptimizerSpecProto",
    "TableSpecProto",
    "StackedTableSpecProto",
    "EmbeddingSpecProto",
  ):
    descriptor = getattr(spec_proto, message).DESCRIPTOR
    assert descriptor.full_name == f"{_PACKAGE}.{message}"
    for field in descriptor.fields:
      kind = (
        (field.message_type or field.enum_type).name
        if field.message_type is not None or field.enum_type is not None
        else type_names[field.type]
      )
      found.append((message, field.name, field.number, kind, field.is_repeated))
  assert found == _UPSTREAM_SCHEMA
  optimizer = spec_proto.OptimizerSpecProto.DESCRIPTOR
  enum = optimizer.enum_types_by_name["OptimizerType"]
  assert [v.name for v in enum.values] == _UPSTREAM_OPTIMIZER_TYPES
  assert [v.number for v in enum.values] == list(range(8))
  assert [
    f.name for f in optimizer.oneofs_by_name["learning_rate_spec"].fields
  ] == [
    "learning_rate",
    "learning_rate_tag",
  ]
  for name, value in (("float_params", "float"), ("bool_params", "bool")):
    entry = optimizer.fields_by_name[name].message_type
    assert entry.GetOptions().map_entry
    key, val = entry.fields
    assert (key.name, key.number, key.type) == ("key", 1, key.TYPE_STRING)
    assert (val.name, val.number) == ("value", 2)
    assert val.type == getattr(val, f"TYPE_{value.upper()}")
  limit = spec_proto.StackedTableSpecProto.DESCRIPTOR.fields_by_name[
    "activation_mem_bytes_limit"
  ]
  assert limit.has_presence  # proto3 `optional`
  assert spec_proto.DESCRIPTOR.package == _PACKAGE
  assert spec_proto.DESCRIPTOR.name == (
    "jax_tpu_embedding/sparsecore/lib/proto/embedding_spec.proto"
  )


def test_compat_module_exposes_the_classes():
  for name in (
    "FeatureSpecProto",
    "TableSpecProto",
    "StackedTableSpecProto",
    "EmbeddingSpecProto",
    "DESCRIPTOR",
  ):
    assert getattr(embedding_spec_pb2, name) is getattr(spec_proto, name)
  assert pzsc.EmbeddingSpecProto is spec_proto.EmbeddingSpecProto


def test_wire_format():
  feature = spec_proto.FeatureSpecProto(
    feature_name="f", input_shape=[16, 1], row_offset=3, col_shift=300
  )
  # 1: "f"; 2: packed [16, 1]; 4: 3; 6: 300 as a two-byte varint.
  expected = b"\x0a\x01f" + b"\x12\x02\x10\x01" + b"\x20\x03" + b"\x30\xac\x02"
  assert feature.SerializeToString() == expected
  table = spec_proto.TableSpecProto(table_name="t", shard_rotation=2)
  table.feature_specs.add(feature_name="f")
  assert table.SerializeToString() == b"\x0a\x01t\x50\x02\x5a\x03\x0a\x01f"


def test_wire_format_of_the_new_fields():
  optimizer = spec_proto.OptimizerSpecProto(
    type=spec_proto.OptimizerSpecProto.ADAM,
    learning_rate=0.5,
    float_params={"e": 2.0},
    bool_params={"n": True},
  )
  # 1: ADAM (3); 2: float 0.5 (00 00 00 3f); 4: entry {1: "e", 2: 2.0f};
  # 5: entry {1: "n", 2: true}.
  expected = (
    b"\x08\x03"
    + b"\x15\x00\x00\x00\x3f"
    + b"\x22\x08\x0a\x01e\x15\x00\x00\x00\x40"
    + b"\x2a\x05\x0a\x01n\x10\x01"
  )
  assert optimizer.SerializeToString() == expected
  tagged = spec_proto.OptimizerSpecProto(learning_rate_tag="s")
  assert tagged.SerializeToString() == b"\x1a\x01s"
  table = spec_proto.TableSpecProto(
    combiner="sum", optimizer=spec_proto.OptimizerSpecProto(type=1)
  )
  # 12: "sum"; 13: {1: SGD}.
  assert table.SerializeToString() == b"\x62\x03sum\x6a\x02\x08\x01"
  stack = spec_proto.StackedTableSpecProto()
  assert stack.SerializeToString() == b""
  stack.activation_mem_bytes_limit = 0  # present, though 0
  assert stack.SerializeToString() == b"\x58\x00"


# ---------------------------------------------------------------------------
# Specs to proto.

# Hand-computed for N = 2 x 2: a pads to 32 (8 rows per shard), b to 128
# (32 per shard from row 8, rotation 2), c to 1024 (width 40); b's features
# follow fa's 16 samples; c's features are ordered by name (yc, then zc).
_EXPECTED_TEXT = """
stacked_table_specs {
  stack_name: "a_b"  stack_vocab_size: 160  stack_embedding_dim: 16
  total_sample_count: 40  max_ids_per_partition: 256
  max_unique_ids_per_partition: 256  num_sparsecores: 4
  activation_mem_bytes_limit: 2097152
  table_specs {
    table_name: "a"  vocab_size: 32  embedding_dim: 14
    padded_vocab_size: 32  padded_embedding_dim: 16
    row_offset_in_shard: 0  shard_rotation: 0
    feature_specs {
      feature_name: "fa"  input_shape: [16, 1]  output_shape: [16, 14]
      row_offset: 0  col_offset: 0  col_shift: 0
    }
    combiner: "sum"  optimizer { type: SGD  learning_rate: 0.001 }
  }
  table_specs {
    table_name: "b"  vocab_size: 100  embedding_dim: 12
    padded_vocab_size: 128  padded_embedding_dim: 16
    row_offset_in_shard: 8  shard_rotation: 2
    feature_specs {
      feature_name: "fb1"  input_shape: [16, 3]  output_shape: [16, 12]
      row_offset: 16  col_offset: 32  col_shift: 2
    }
    feature_specs {
      feature_name: "fb2"  input_shape: [4, 2]  output_shape: [4, 2, 12]
      row_offset: 32  col_offset: 32  col_shift: 2
    }
    combiner: "sum"  optimizer { type: SGD  learning_rate: 0.001 }
  }
}
stacked_table_specs {
  stack_name: "c"  stack_vocab_size: 1024  stack_embedding_dim: 40
  total_sample_count: 40  max_ids_per_partition: 64
  max_unique_ids_per_partition: 256  num_sparsecores: 4
  activation_mem_bytes_limit: 2097152
  table_specs {
    table_name: "c"  vocab_size: 1000  embedding_dim: 40
    padded_vocab_size: 1024  padded_embedding_dim: 40
    feature_specs {
      feature_name: "zc"  input_shape: [32, 5]  output_shape: [32, 40]
      row_offset: 8
    }
    feature_specs {
      feature_name: "yc"  input_shape: [8, 5]  output_shape: [8, 40]
      row_offset: 0
    }
    combiner: "sum"
    optimizer {
      type: ADAGRAD  learning_rate: 0.001
      float_params { key: "initial_accumulator_value"  value: 0.1 }
    }
  }
}
"""


def test_known_layout_text():
  proto = pzsc.create_proto_from_feature_specs(
    _stacked(), global_device_count=2, num_sparsecore_per_device=2
  )
  expected = text_format.Parse(_EXPECTED_TEXT, pzsc.EmbeddingSpecProto())
  assert text_format.MessageToString(proto) == text_format.MessageToString(
    expected
  )


def test_order_follows_pytree_leaves():
  # Keys a..e hold yc, zc, fb2, fb1, fa: the leaves come in that order.
  specs = dict(zip("edcba", _stacked(), strict=True))
  proto = pzsc.create_proto_from_feature_specs(specs, 2, 2)
  stacks = {s.stack_name: s for s in proto.stacked_table_specs}
  assert list(stacks) == ["c", "a_b"]
  assert [t.table_name for t in stacks["a_b"].table_specs] == ["b", "a"]
  features = stacks["c"].table_specs[0].feature_specs
  assert [f.feature_name for f in features] == ["yc", "zc"]


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(global_device_count=None), "pass global_device_count"),
    (dict(num_sparsecore_per_device=None), "pass num_sparsecore_per_device"),
    (dict(global_device_count=4), "another topology"),
  ],
)
def test_create_errors(change, match):
  arguments = dict(global_device_count=2, num_sparsecore_per_device=2)
  arguments.update(change)
  with pytest.raises(ValueError, match=match):
    pzsc.create_proto_from_feature_specs(_stacked(), **arguments)


def test_create_needs_prepared_specs():
  with pytest.raises(ValueError, match="not prepared"):
    pzsc.create_proto_from_feature_specs(list(_features().values()), 2, 2)


# ---------------------------------------------------------------------------
# Proto to specs.


@pytest.mark.parametrize("devices, sc", [(1, 1), (2, 2), (4, 2), (8, 4)])
@pytest.mark.parametrize("auto", [False, True])
def test_round_trip(devices, sc, auto):
  if auto:
    specs = pzsc.auto_stack_tables(_features(), devices, sc)
    specs = pzsc.prepare_feature_specs_for_training(specs, devices, sc)
  else:
    specs = _stacked(devices, sc)
  proto = pzsc.create_proto_from_feature_specs(specs, devices, sc)
  back = pzsc.feature_specs_from_proto(proto, **_arguments(specs))
  assert pzsc.create_proto_from_feature_specs(back, devices, sc) == proto
  assert {f.name: f for f in back} == {
    f.name: f for f in jax.tree.leaves(specs)
  }
  assert all(
    s.suggested_coo_buffer_size_per_device is None
    for s in pzsc.get_stacked_table_specs(back).values()
  )


def test_reads_a_message_of_another_pool():
  """Upstream's generated class has the same full name in another pool."""
  pool = descriptor_pool.DescriptorPool()
  file = pool.AddSerializedFile(spec_proto.DESCRIPTOR.serialized_pb)
  other = message_factory.GetMessageClass(
    file.message_types_by_name["EmbeddingSpecProto"]
  )
  assert other is not pzsc.EmbeddingSpecProto
  specs = _stacked()
  proto = pzsc.create_proto_from_feature_specs(specs, 2, 2)
  foreign = other.FromString(proto.SerializeToString())
  back = pzsc.feature_specs_from_proto(foreign, **_arguments(specs))
  assert pzsc.create_proto_from_feature_specs(back, 2, 2) == proto


def test_one_value_for_every_table():
  specs = _stacked()
  proto = pzsc.create_proto_from_feature_specs(specs, 2, 2)
  back = pzsc.feature_specs_from_proto(
    proto,
    initializer=_init,
    optimizer=pzsc.AdamOptimizerSpec(),
    combiner="mean",
  )
  stacks = pzsc.get_stacked_table_specs(back)
  assert stacks["c"].optimizer == pzsc.AdamOptimizerSpec()
  assert {s.combiner for s in stacks.values()} == {"mean"}


def test_16_bit_tables_from_a_proto():
  """The proto has no dtype (upstream's schema): the argument gives it,
  in any spelling, per table or for all; the layout is unchanged."""
  specs = _stacked()
  proto = pzsc.create_proto_from_feature_specs(specs, 2, 2)
  arguments = _arguments(specs)
  back = pzsc.feature_specs_from_proto(
    proto,
    **arguments,
    dtype={"a": jnp.bfloat16, "b": "bfloat16", "c": np.dtype("float16")},
  )
  stacks = pzsc.get_stacked_table_specs(back)
  assert {name: s.dtype.name for name, s in stacks.items()} == {
    "a_b": "bfloat16",
    "c": "float16",
  }
  assert {f.table_spec.name: f.table_spec.dtype.name for f in back} == {
    "a": "bfloat16",
    "b": "bfloat16",
    "c": "float16",
  }
  assert pzsc.create_proto_from_feature_specs(back, 2, 2) == proto
  # The default: float32.
  plain = pzsc.feature_specs_from_proto(proto, **arguments)
  assert {f.table_spec.dtype.name for f in plain} == {"float32"}
  assert {f.table_spec.activation_dtype.name for f in plain} == {"float32"}
  # Activation dtypes per table; tables of a stack may differ.
  acts = pzsc.feature_specs_from_proto(
    proto,
    **arguments,
    activation_dtype={"a": "bfloat16", "b": "float32", "c": jnp.float16},
  )
  assert {
    f.table_spec.name: f.table_spec.activation_dtype.name for f in acts
  } == {
    "a": "bfloat16",
    "b": "float32",
    "c": "float16",
  }
  assert pzsc.create_proto_from_feature_specs(acts, 2, 2) == proto


def _find(proto, name):
  """The stack, table or feature message named `name`."""
  for stack in proto.stacked_table_specs:
    if stack.stack_name == name:
      return stack
    for table in stack.table_specs:
      if table.table_name == name:
        return table
      for feature in table.feature_specs:
        if feature.feature_name == name:
          return feature
  raise KeyError(name)


def _clear(field):
  def edit(proto, name):
    _find(proto, name).ClearField(field)

  return edit


def _set(field, value):
  def edit(proto, name):
    setattr(_find(proto, name), field, value)

  return edit


def _rename(proto, name):
  _find(proto, name).feature_name = "fa"


def _all_stacks(field, value):
  def edit(proto, name):
    del name
    for stack in proto.stacked_table_specs:
      setattr(stack, field, value)

  return edit


@pytest.mark.parametrize(
  "name, edit, match",
  [
    ("a_b", _clear("table_specs"), "stack 'a_b' has no table_specs"),
    ("b", _clear("feature_specs"), "table 'b' .*has no feature_specs"),
    ("fb2", _rename, "feature name 'fa' is used twice"),
    ("c", _clear("stack_name"), r"stacked_table_specs\[1\]: a stack has no"),
    ("c", _set("num_sparsecores", 8), "stack 'c': num_sparsecores 8 differs"),
    (None, _all_stacks("num_sparsecores", 3), "positive power of two, got 3"),
    ("a_b", _set("stack_vocab_size", 192), "stack 'a_b': stack_vocab_size"),
    ("c", _set("total_sample_count", 41), "stack 'c': total_sample_count"),
    ("a_b", _clear("max_ids_per_partition"), "'a_b': max_ids_per_partition"),
    ("b", _set("padded_vocab_size", 112), "table 'b': padded_vocab_size"),
    ("b", _set("padded_embedding_dim", 24), "table 'b': padded_embedding_dim"),
    ("b", _set("row_offset_in_shard", 7), "table 'b': row_offset_in_shard 7"),
    ("b", _set("shard_rotation", 4), r"table 'b': shard_rotation 4 .*\[0, 4\)"),
    ("fb2", _set("col_shift", 1), "feature 'fb2': .*col_shift"),
    ("fb2", _set("row_offset", 24), "feature 'fb2': row_offset 24"),
    ("fa", _clear("output_shape"), "feature 'fa': output_shape"),
  ],
)
def test_bad_proto(name, edit, match):
  specs = _stacked()
  proto = pzsc.create_proto_from_feature_specs(specs, 2, 2)
  edit(proto, name)
  with pytest.raises(ValueError, match=match):
    pzsc.feature_specs_from_proto(proto, **_arguments(specs))


def test_empty_proto():
  with pytest.raises(ValueError, match="no stacked_table_specs"):
    pzsc.feature_specs_from_proto(
      pzsc.EmbeddingSpecProto(),
      initializer=_init,
      optimizer=pzsc.SGDOptimizerSpec(),
      combiner="sum",
    )


@pytest.mark.parametrize(
  "change, match",
  [
    (
      dict(optimizer={"a": pzsc.SGDOptimizerSpec()}),
      r"no entry for tables \['b', 'c'\]",
    ),
    (
      dict(initializer={"a": _init, "b": _init, "c": _init, "x": _init}),
      r"tables \['x'\] that the proto",
    ),
    (
      dict(combiner={"a": "sum", "b": "mean", "c": "sum"}),
      "stack 'a_b': .*share one combiner",
    ),
    (dict(combiner="max"), "stack 'a_b': unknown combiner 'max'"),
    (dict(initializer=0.5), "table 'a': initializer must be callable"),
    (
      dict(dtype={"a": "bfloat16", "b": "float32", "c": "float32"}),
      "stack 'a_b': .*share one dtype",
    ),
    (dict(dtype="int8"), r"table 'a': dtype must be one of"),
    (
      dict(activation_dtype="int8"),
      r"table 'a': activation_dtype must be one of .*'int8'",
    ),
  ],
)
def test_bad_arguments(change, match):
  specs = _stacked()
  proto = pzsc.create_proto_from_feature_specs(specs, 2, 2)
  arguments = _arguments(specs)
  arguments.update(change)
  with pytest.raises(ValueError, match=match):
    pzsc.feature_specs_from_proto(proto, **arguments)


def test_not_a_proto():
  with pytest.raises(ValueError, match="expected an EmbeddingSpecProto"):
    pzsc.feature_specs_from_proto(
      b"bytes",
      initializer=_init,
      optimizer=pzsc.SGDOptimizerSpec(),
      combiner="sum",
    )
