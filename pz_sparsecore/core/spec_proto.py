"""The embedding spec proto: a stacked layout in jax-tpu-embedding's format.

jax-tpu-embedding describes a prepared layout (which tables share a stack,
how each table is padded, offset and rotated in the shards, where each
feature's samples and ids go) in one protobuf message, `EmbeddingSpecProto`
of package `third_party.py.jax_tpu_embedding.sparsecore_lib_proto`::

  EmbeddingSpecProto
    stacked_table_specs: StackedTableSpecProto  (one per stack)
      table_specs: TableSpecProto               (its tables)
        feature_specs: FeatureSpecProto         (the features reading them)

The message classes are built at import time from a `FileDescriptorProto`
written out below with upstream's file name, package, message and field
names, numbers and types, so bytes and text format are interchangeable with
upstream's generated `embedding_spec_pb2`. They live in a descriptor pool of
their own, so upstream's generated module (or another version of the schema)
can be imported next to this one.

`create_proto_from_feature_specs` writes prepared specs the way upstream
does: stacks in the order their first feature appears among the pytree
leaves, each stack's tables likewise, each table's features in leaf order;
the tables' own limits (`TableSpecProto` fields 5 and 6) are left unset.
`feature_specs_from_proto` reads a layout back into prepared, frozen
`FeatureSpec`s, in the proto's order, so writing them again gives the same
proto. A proto carries the layout and, since upstream's schema added them,
each table's `combiner` and `optimizer` (`core.optimizer_proto`; a schedule
is recorded by name only), not its initializer: `initializer` is an
argument, and `optimizer` and `combiner` are arguments that default to the
proto's; a stack's `suggested_coo_buffer_size_per_device` (FDO sets it) and
`quantization_config` come back as None, its `activation_mem_bytes_limit` as
written (the default where unset); tables whose proto limits are unset take
their stack's.

Example (`N = 4` shards): tables `a` (vocab 32, dim 14) and `b` (vocab 100,
dim 12) stacked as `a_b`, features `fa` (16 samples, table `a`), `fb1` (16
samples) and `fb2` (4 x 2 samples) on table `b`. `a` pads to 32 rows (8 per
shard), `b` to 128 (32 per shard, from row 8, rotated by 2), so the stack
has 160 rows of width 16 and 40 samples; `fb2` is written as::

  feature_specs {
    feature_name: "fb2"
    input_shape: 4  input_shape: 2
    output_shape: 4  output_shape: 2  output_shape: 12
    row_offset: 32     # after fa's and fb1's 16 samples each
    col_offset: 32     # b's row_offset_in_shard 8 x N
    col_shift: 2       # b's shard_rotation
  }
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from pz_sparsecore.core import layout, optimizer_proto
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import ALIGNMENT
from pz_sparsecore.core.specs import (
  FeatureIdTransformation,
  FeatureSpec,
  Initializer,
  OptimizerSpec,
  StackedTableSpec,
  TableSettingInStack,
  TableSpec,
  table_dtype,
)

PACKAGE = "third_party.py.jax_tpu_embedding.sparsecore_lib_proto"
"""The protobuf package of upstream's schema (part of every full name)."""

FILE_NAME = "jax_tpu_embedding/sparsecore/lib/proto/embedding_spec.proto"
"""The file name of upstream's schema."""

# Upstream's schema, message by message: (field, number, declared type).
# A declared type is a scalar (string, int64, float, bool), an enum or
# message of the schema, `repeated T`, `optional T` (proto3's explicit
# presence), `oneof:NAME T` (a member of oneof NAME) or `map<K, V>`.
# Numbers 4 of TableSpecProto and 4, 5 of StackedTableSpecProto are unused
# upstream and stay unused here.
_SCHEMA = {
  "FeatureSpecProto": (
    ("feature_name", 1, "string"),
    ("input_shape", 2, "repeated int64"),
    ("output_shape", 3, "repeated int64"),
    ("row_offset", 4, "int64"),
    ("col_offset", 5, "int64"),
    ("col_shift", 6, "int64"),
  ),
  "OptimizerSpecProto": (
    ("type", 1, "OptimizerSpecProto.OptimizerType"),
    ("learning_rate", 2, "oneof:learning_rate_spec float"),
    ("learning_rate_tag", 3, "oneof:learning_rate_spec string"),
    ("float_params", 4, "map<string, float>"),
    ("bool_params", 5, "map<string, bool>"),
  ),
  "TableSpecProto": (
    ("table_name", 1, "string"),
    ("vocab_size", 2, "int64"),
    ("embedding_dim", 3, "int64"),
    ("max_ids_per_partition", 5, "int64"),
    ("max_unique_ids_per_partition", 6, "int64"),
    ("padded_vocab_size", 7, "int64"),
    ("padded_embedding_dim", 8, "int64"),
    ("row_offset_in_shard", 9, "int64"),
    ("shard_rotation", 10, "int64"),
    ("feature_specs", 11, "repeated FeatureSpecProto"),
    ("combiner", 12, "string"),
    ("optimizer", 13, "OptimizerSpecProto"),
  ),
  "StackedTableSpecProto": (
    ("stack_name", 1, "string"),
    ("stack_vocab_size", 2, "int64"),
    ("stack_embedding_dim", 3, "int64"),
    ("total_sample_count", 6, "int64"),
    ("max_ids_per_partition", 7, "int64"),
    ("max_unique_ids_per_partition", 8, "int64"),
    ("num_sparsecores", 9, "int64"),
    ("table_specs", 10, "repeated TableSpecProto"),
    ("activation_mem_bytes_limit", 11, "optional int64"),
  ),
  "EmbeddingSpecProto": (
    ("stacked_table_specs", 1, "repeated StackedTableSpecProto"),
  ),
}

# Upstream's enums: (message, enum) -> value names, numbered from 0.
_ENUMS = {
  ("OptimizerSpecProto", "OptimizerType"): (
    "OPTIMIZER_TYPE_UNSPECIFIED",
    "SGD",
    "ADAGRAD",
    "ADAM",
    "FTRL",
    "F2A",
    "ADAGRAD_MOMENTUM",
    "CUSTOM",
  ),
}

_Field = descriptor_pb2.FieldDescriptorProto
_SCALAR_TYPES = {
  "string": _Field.TYPE_STRING,
  "int64": _Field.TYPE_INT64,
  "float": _Field.TYPE_FLOAT,
  "bool": _Field.TYPE_BOOL,
}


def _set_type(field: Any, type_name: str) -> None:
  """Sets `field`'s type: a scalar, or an enum or message of the schema."""
  if type_name in _SCALAR_TYPES:
    field.type = _SCALAR_TYPES[type_name]
    return
  is_enum = tuple(type_name.split(".")) in _ENUMS
  field.type = _Field.TYPE_ENUM if is_enum else _Field.TYPE_MESSAGE
  field.type_name = f".{PACKAGE}.{type_name}"


def _add_map_field(
  message: Any, owner: str, name: str, number: int, declared: str
) -> None:
  """A `map<K, V>` field: a repeated nested `NameEntry` message, as protoc
  writes it."""
  key, value = (t.strip() for t in declared[4:-1].split(","))
  entry_name = "".join(part.title() for part in name.split("_")) + "Entry"
  entry = message.nested_type.add(name=entry_name)
  entry.options.map_entry = True
  for entry_field, entry_number, entry_type in (
    ("key", 1, key),
    ("value", 2, value),
  ):
    _set_type(
      entry.field.add(
        name=entry_field, number=entry_number, label=_Field.LABEL_OPTIONAL
      ),
      entry_type,
    )
  message.field.add(
    name=name,
    number=number,
    label=_Field.LABEL_REPEATED,
    type=_Field.TYPE_MESSAGE,
    type_name=f".{PACKAGE}.{owner}.{entry_name}",
  )


def _add_message(file: Any, message_name: str, fields: Any) -> None:
  message = file.message_type.add(name=message_name)
  for (owner, enum_name), values in _ENUMS.items():
    if owner == message_name:
      enum = message.enum_type.add(name=enum_name)
      for number, value in enumerate(values):
        enum.value.add(name=value, number=number)
  oneofs: list[str] = []
  synthetic: list[tuple[Any, str]] = []
  for field_name, number, declared in fields:
    if declared.startswith("map<"):
      _add_map_field(message, message_name, field_name, number, declared)
      continue
    *qualifier, type_name = declared.split()
    field = message.field.add(
      name=field_name,
      number=number,
      label=_Field.LABEL_REPEATED
      if qualifier == ["repeated"]
      else _Field.LABEL_OPTIONAL,
    )
    _set_type(field, type_name)
    if qualifier and qualifier[0].startswith("oneof:"):
      oneof = qualifier[0].removeprefix("oneof:")
      if oneof not in oneofs:
        oneofs.append(oneof)
      field.oneof_index = oneofs.index(oneof)
    elif qualifier == ["optional"]:
      field.proto3_optional = True
      synthetic.append((field, f"_{field_name}"))
  # protoc declares a proto3 `optional`'s synthetic oneof after the real ones.
  for field, oneof in synthetic:
    field.oneof_index = len(oneofs)
    oneofs.append(oneof)
  for oneof in oneofs:
    message.oneof_decl.add(name=oneof)


def _file_descriptor_proto() -> descriptor_pb2.FileDescriptorProto:
  """Upstream's `embedding_spec.proto`, as protoc would describe it."""
  file = descriptor_pb2.FileDescriptorProto(
    name=FILE_NAME, package=PACKAGE, syntax="proto3"
  )
  file.options.java_multiple_files = True
  for message_name, fields in _SCHEMA.items():
    _add_message(file, message_name, fields)
  return file


# A pool of its own: the default pool may hold upstream's generated file,
# under the same name, perhaps from another version of the schema.
_POOL = descriptor_pool.DescriptorPool()
DESCRIPTOR = _POOL.AddSerializedFile(
  _file_descriptor_proto().SerializeToString()
)
"""The `FileDescriptor` of the schema."""


def _message_class(name: str) -> type:
  return message_factory.GetMessageClass(DESCRIPTOR.message_types_by_name[name])


FeatureSpecProto = _message_class("FeatureSpecProto")
OptimizerSpecProto = _message_class("OptimizerSpecProto")
TableSpecProto = _message_class("TableSpecProto")
StackedTableSpecProto = _message_class("StackedTableSpecProto")
EmbeddingSpecProto = _message_class("EmbeddingSpecProto")


def optimizer_spec_to_proto(
  optimizer: OptimizerSpec | None,
) -> OptimizerSpecProto | None:
  """A table's optimizer as an `OptimizerSpecProto` (`core.optimizer_proto`
  describes the message); None for None."""
  if optimizer is None:
    return None
  return optimizer_proto.write(optimizer, OptimizerSpecProto)


def proto_to_optimizer_spec(proto: Any | None) -> OptimizerSpec:
  """The frozen optimizer spec an `OptimizerSpecProto` describes; SGD with
  learning rate 0 for None (as upstream)."""
  if proto is None:
    return optimizer_proto.read(OptimizerSpecProto(learning_rate=0.0))
  return optimizer_proto.read(proto)


# ---------------------------------------------------------------------------
# Specs to proto.


def _require_topology(
  global_device_count: int | None, num_sparsecore_per_device: int | None
) -> None:
  if global_device_count is None:
    raise ValueError(
      "pass global_device_count, the number of devices the specs were "
      "prepared for"
    )
  if num_sparsecore_per_device is None:
    raise ValueError(
      "pass num_sparsecore_per_device, the SparseCores per device the specs "
      "were prepared for (pz_sparsecore does not read it from the host)"
    )


def create_proto_from_feature_specs(
  feature_specs: Any,
  global_device_count: int | None,
  num_sparsecore_per_device: int | None = None,
) -> EmbeddingSpecProto:
  """The layout of prepared `feature_specs` as an `EmbeddingSpecProto`.

  The same message as upstream's function of this name gives for the same
  layout.

  Args:
    feature_specs: A pytree of `FeatureSpec`s prepared with
      `prepare_feature_specs_for_training`.
    global_device_count: The devices the specs were prepared for.
    num_sparsecore_per_device: The SparseCores per device the specs were
      prepared for. Required: unlike upstream, None is not read from the
      host.

  Returns:
    The layout, stacks and tables in the order of their first feature among
    the pytree leaves.

  Raises:
    ValueError: If a count is missing or invalid, or the specs are not
      prepared (or were prepared for another number of shards).
  """
  _require_topology(global_device_count, num_sparsecore_per_device)
  # Raise on repeated names, unprepared specs or another shard count.
  layout.get_table_specs(feature_specs)
  plan_lib.build(feature_specs, global_device_count, num_sparsecore_per_device)
  num_sparsecores = int(global_device_count) * int(num_sparsecore_per_device)
  proto = EmbeddingSpecProto()
  stacks: dict[str, Any] = {}
  tables: dict[str, Any] = {}
  for feature in jax.tree.leaves(feature_specs):
    table = feature.table_spec
    stacked = table.stacked_table_spec
    if stacked.stack_name not in stacks:
      stacks[stacked.stack_name] = proto.stacked_table_specs.add(
        stack_name=stacked.stack_name,
        stack_vocab_size=stacked.stack_vocab_size,
        stack_embedding_dim=stacked.stack_embedding_dim,
        total_sample_count=stacked.total_sample_count,
        max_ids_per_partition=stacked.max_ids_per_partition,
        max_unique_ids_per_partition=stacked.max_unique_ids_per_partition,
        num_sparsecores=num_sparsecores,
        activation_mem_bytes_limit=stacked.activation_mem_bytes_limit,
      )
    if table.name not in tables:
      setting = table.setting_in_stack
      tables[table.name] = stacks[stacked.stack_name].table_specs.add(
        table_name=table.name,
        vocab_size=table.vocabulary_size,
        embedding_dim=table.embedding_dim,
        padded_vocab_size=setting.padded_vocab_size,
        padded_embedding_dim=setting.padded_embedding_dim,
        row_offset_in_shard=setting.row_offset_in_shard,
        shard_rotation=setting.shard_rotation,
        combiner=table.combiner,
        optimizer=optimizer_spec_to_proto(table.optimizer),
      )
    transform = feature.id_transformation
    tables[table.name].feature_specs.add(
      feature_name=feature.name,
      # A ragged dimension (None) is written as 0: the schema has no null.
      input_shape=[0 if d is None else d for d in feature.input_shape],
      output_shape=feature.output_shape,
      row_offset=transform.row_offset,
      col_offset=transform.col_offset,
      col_shift=transform.col_shift,
    )
  return proto


# ---------------------------------------------------------------------------
# Proto to specs.


def _as_embedding_spec(proto: Any) -> EmbeddingSpecProto:
  """`proto`, or a message of the same type from another pool, as ours."""
  if isinstance(proto, EmbeddingSpecProto):
    return proto
  full_name = getattr(getattr(proto, "DESCRIPTOR", None), "full_name", None)
  if full_name != EmbeddingSpecProto.DESCRIPTOR.full_name:
    raise ValueError(
      f"expected an EmbeddingSpecProto, got {type(proto).__name__}; parse "
      "serialized bytes with EmbeddingSpecProto.FromString"
    )
  return EmbeddingSpecProto.FromString(proto.SerializeToString())


def _num_sparsecores(proto: EmbeddingSpecProto) -> int:
  """The shard count `N` every stack of `proto` names, validated."""
  if not proto.stacked_table_specs:
    raise ValueError("the proto has no stacked_table_specs")
  first = proto.stacked_table_specs[0]
  n = first.num_sparsecores
  if n <= 0 or n & (n - 1):
    raise ValueError(
      f"stack {first.stack_name!r}: num_sparsecores must be a positive power "
      f"of two, got {n}"
    )
  for stack in proto.stacked_table_specs[1:]:
    if stack.num_sparsecores != n:
      raise ValueError(
        f"stack {stack.stack_name!r}: num_sparsecores "
        f"{stack.num_sparsecores} differs from stack {first.stack_name!r}'s "
        f"{n}; all stacks must be laid out on the same SparseCores"
      )
  return n


def _check_names(proto: EmbeddingSpecProto) -> list[str]:
  """Checks that names are present and unique; returns the table names."""
  seen: dict[str, set[str]] = {"stack": set(), "table": set(), "feature": set()}

  def claim(kind: str, name: str, where: str) -> None:
    if not name:
      raise ValueError(f"{where}: a {kind} has no name")
    if name in seen[kind]:
      raise ValueError(f"{kind} name {name!r} is used twice ({where})")
    seen[kind].add(name)

  tables = []
  for i, stack in enumerate(proto.stacked_table_specs):
    claim("stack", stack.stack_name, f"stacked_table_specs[{i}]")
    where = f"stack {stack.stack_name!r}"
    if not stack.table_specs:
      raise ValueError(f"{where} has no table_specs")
    for table in stack.table_specs:
      claim("table", table.table_name, where)
      if not table.feature_specs:
        raise ValueError(
          f"table {table.table_name!r} ({where}) has no feature_specs; every "
          "table needs a feature that looks it up"
        )
      for feature in table.feature_specs:
        claim("feature", feature.feature_name, f"table {table.table_name!r}")
      tables.append(table.table_name)
  return tables


def _per_table(value: Any, argument: str, tables: list[str]) -> dict[str, Any]:
  """`value` for every table: one value for all, or a mapping by name."""
  if not isinstance(value, Mapping):
    return dict.fromkeys(tables, value)
  missing = [t for t in tables if t not in value]
  if missing:
    raise ValueError(
      f"{argument} has no entry for tables {missing}; pass one per table, or "
      "one value for every table"
    )
  unknown = sorted(set(value) - set(tables))
  if unknown:
    raise ValueError(
      f"{argument} names tables {unknown} that the proto does not have (it "
      f"has {tables})"
    )
  return dict(value)


def _from_tables(
  proto: EmbeddingSpecProto, field: str, convert: Any
) -> dict[str, Any]:
  """Table name -> its `TableSpecProto` `field`, converted; raises naming
  the first table without one."""
  values = {}
  for stack in proto.stacked_table_specs:
    for table in stack.table_specs:
      present = (
        table.HasField(field) if field == "optimizer" else getattr(table, field)
      )
      if not present:
        raise ValueError(
          f"table {table.table_name!r} (stack {stack.stack_name!r}) has no "
          f"{field} in the proto; pass {field}="
        )
      values[table.table_name] = convert(getattr(table, field))
  return values


def _stack_setting(
  stack: Any, settings: Mapping[str, Any], argument: str
) -> Any:
  """The one value of `argument` that every table of `stack` shares."""
  values = [settings[t.table_name] for t in stack.table_specs]
  if any(v != values[0] for v in values[1:]):
    raise ValueError(
      f"stack {stack.stack_name!r}: its tables "
      f"{[t.table_name for t in stack.table_specs]} must share one {argument}"
      f", got {values}"
    )
  return values[0]


def _table_spec(
  table: Any,
  stacked: StackedTableSpec,
  initializer: Initializer,
  activation_dtype: Any,
) -> TableSpec:
  return TableSpec(
    name=table.table_name,
    vocabulary_size=table.vocab_size,
    embedding_dim=table.embedding_dim,
    initializer=initializer,
    optimizer=stacked.optimizer,
    combiner=stacked.combiner,
    dtype=stacked.dtype,
    activation_dtype=activation_dtype,
    max_ids_per_partition=(
      table.max_ids_per_partition or stacked.max_ids_per_partition
    ),
    max_unique_ids_per_partition=(
      table.max_unique_ids_per_partition or stacked.max_unique_ids_per_partition
    ),
    setting_in_stack=TableSettingInStack(
      stack_name=stacked.stack_name,
      padded_vocab_size=table.padded_vocab_size,
      padded_embedding_dim=table.padded_embedding_dim,
      row_offset_in_shard=table.row_offset_in_shard,
      shard_rotation=table.shard_rotation,
    ),
    stacked_table_spec=stacked,
  )


def _feature_spec(feature: Any, table: TableSpec) -> FeatureSpec:
  return FeatureSpec(
    name=feature.feature_name,
    table_spec=table,
    input_shape=tuple(
      d if d or not i else None for i, d in enumerate(feature.input_shape)
    ),
    output_shape=tuple(feature.output_shape),
    id_transformation=FeatureIdTransformation(
      row_offset=feature.row_offset,
      col_offset=feature.col_offset,
      col_shift=feature.col_shift,
    ),
  )


def _check_tables(
  stacked: StackedTableSpec, tables: list[TableSpec], n: int
) -> None:
  """Checks that the tables tile every shard of the stack, in row order."""
  row = 0
  for table in sorted(
    tables, key=lambda t: t.setting_in_stack.row_offset_in_shard
  ):
    setting, where = table.setting_in_stack, f"table {table.name!r}"
    padded, width = setting.padded_vocab_size, setting.padded_embedding_dim
    if padded < table.vocabulary_size or padded % (ALIGNMENT * n):
      raise ValueError(
        f"{where}: padded_vocab_size {padded} must be a multiple of "
        f"{ALIGNMENT} x {n} SparseCores of at least vocab_size "
        f"{table.vocabulary_size}"
      )
    if width != stacked.stack_embedding_dim or width % ALIGNMENT:
      raise ValueError(
        f"{where}: padded_embedding_dim {width} must be its stack's "
        f"stack_embedding_dim {stacked.stack_embedding_dim}, a multiple of "
        f"{ALIGNMENT}"
      )
    if setting.row_offset_in_shard != row:
      raise ValueError(
        f"{where}: row_offset_in_shard {setting.row_offset_in_shard} leaves a "
        f"gap or an overlap in stack {stacked.stack_name!r}; expected {row}"
      )
    if not 0 <= setting.shard_rotation < n:
      raise ValueError(
        f"{where}: shard_rotation {setting.shard_rotation} is not in [0, {n})"
      )
    row += padded // n
  if row * n != stacked.stack_vocab_size:
    raise ValueError(
      f"stack {stacked.stack_name!r}: stack_vocab_size "
      f"{stacked.stack_vocab_size} is not the sum {row * n} of its tables' "
      "padded_vocab_size"
    )


def _check_features(
  stacked: StackedTableSpec, features: list[FeatureSpec], n: int
) -> None:
  """Checks the features' sample ranges and id shifts within the stack."""
  sample = 0
  for feature in sorted(features, key=lambda f: f.id_transformation.row_offset):
    transform, where = feature.id_transformation, f"feature {feature.name!r}"
    setting = feature.table_spec.setting_in_stack
    if transform.row_offset != sample:
      raise ValueError(
        f"{where}: row_offset {transform.row_offset} leaves a gap or an "
        f"overlap in stack {stacked.stack_name!r}'s samples; expected {sample}"
      )
    expected = (setting.row_offset_in_shard * n, setting.shard_rotation)
    if (transform.col_offset, transform.col_shift) != expected:
      raise ValueError(
        f"{where}: (col_offset, col_shift) = "
        f"({transform.col_offset}, {transform.col_shift}) must be its "
        f"table's (row_offset_in_shard x {n}, shard_rotation) = {expected}"
      )
    sample += feature.sample_count
  if sample != stacked.total_sample_count:
    raise ValueError(
      f"stack {stacked.stack_name!r}: total_sample_count "
      f"{stacked.total_sample_count} is not the sum {sample} of its features' "
      "samples"
    )


def _stack_specs(
  stack: Any, n: int, arguments: Mapping[str, Mapping[str, Any]]
) -> list[FeatureSpec]:
  """The prepared feature specs of one stack, checked."""
  stacked = StackedTableSpec(
    stack_name=stack.stack_name,
    stack_vocab_size=stack.stack_vocab_size,
    stack_embedding_dim=stack.stack_embedding_dim,
    optimizer=_stack_setting(stack, arguments["optimizer"], "optimizer"),
    combiner=_stack_setting(stack, arguments["combiner"], "combiner"),
    total_sample_count=stack.total_sample_count,
    max_ids_per_partition=stack.max_ids_per_partition,
    max_unique_ids_per_partition=stack.max_unique_ids_per_partition,
    dtype=_stack_setting(stack, arguments["dtype"], "dtype"),
    **(
      {"activation_mem_bytes_limit": stack.activation_mem_bytes_limit}
      if stack.HasField("activation_mem_bytes_limit")
      else {}
    ),
  )
  tables, features = [], []
  for table_proto in stack.table_specs:
    name = table_proto.table_name
    tables.append(
      _table_spec(
        table_proto,
        stacked,
        arguments["initializer"][name],
        arguments["activation_dtype"][name],
      )
    )
    features += [
      _feature_spec(f, tables[-1]) for f in table_proto.feature_specs
    ]
  _check_tables(stacked, tables, n)
  _check_features(stacked, features, n)
  return features


def feature_specs_from_proto(
  proto: EmbeddingSpecProto,
  *,
  initializer: Initializer | Mapping[str, Initializer],
  optimizer: OptimizerSpec | Mapping[str, OptimizerSpec] | None = None,
  combiner: str | Mapping[str, str] | None = None,
  dtype: Any = "float32",
  activation_dtype: Any = "float32",
) -> list[FeatureSpec]:
  """Prepared `FeatureSpec`s of the layout an `EmbeddingSpecProto` describes.

  The proto does not hold the tables' initializers; give each either one
  value for every table or a mapping from table name to value, as for the
  optimizer and combiner, which default to the proto's. Tables of one
  stack must share their optimizer and combiner. The specs are ready
  for any `G x S` topology with `G * S` equal to the proto's
  `num_sparsecores`.

  Args:
    proto: The layout: an `EmbeddingSpecProto` of this module, or of
      upstream's `embedding_spec_pb2`.
    initializer: The tables' initializers.
    optimizer: The tables' optimizers; None reads each table's
      `TableSpecProto.optimizer` (a learning-rate schedule comes back as a
      `CallablePlaceholder`, which names it and cannot be evaluated).
    combiner: The tables' combiners ("sum", "mean" or "sqrtn"); None reads
      each table's `TableSpecProto.combiner`.
    dtype: How the tables' rows are stored (`TableSpec(dtype=...)`; the
      proto, upstream's schema, has no field for it): float32 (the
      default), bfloat16 or float16. Tables of one stack share it.
    activation_dtype: The dtype of the tables' activations
      (`TableSpec(activation_dtype=...)`, not in the proto either): float32
      (the default), bfloat16 or float16; tables of a stack may differ.

  Returns:
    The feature specs in the proto's order (stacks, their tables, their
    features), so that `create_proto_from_feature_specs` gives `proto`
    back. Stacks have no `suggested_coo_buffer_size_per_device` and no
    `quantization_config`.

  Raises:
    ValueError: Naming the stack, table or feature, if the proto misses a
      name, a table or a feature, repeats a name, is not a consistent
      layout on its `num_sparsecores`, or if an argument misses a table or
      differs between the tables of a stack, or if the optimizer or combiner
      is None and a table's proto has none.
  """
  proto = _as_embedding_spec(proto)
  n = _num_sparsecores(proto)
  tables = _check_names(proto)
  if optimizer is None:
    optimizer = _from_tables(proto, "optimizer", proto_to_optimizer_spec)
  if combiner is None:
    combiner = _from_tables(proto, "combiner", str)
  arguments = {
    "initializer": _per_table(initializer, "initializer", tables),
    "optimizer": _per_table(optimizer, "optimizer", tables),
    "combiner": _per_table(combiner, "combiner", tables),
    "dtype": {
      name: table_dtype(f"table {name!r}", value)
      for name, value in _per_table(dtype, "dtype", tables).items()
    },
    # Checked by TableSpec (no stack compares it).
    "activation_dtype": _per_table(
      activation_dtype, "activation_dtype", tables
    ),
  }
  return [
    feature
    for stack in proto.stacked_table_specs
    for feature in _stack_specs(stack, n, arguments)
  ]
