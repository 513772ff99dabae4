"""Table stacking and MOD sharding: where every logical row lives.

A *stack* is one physical array holding one or more logical tables that share
an optimizer, a combiner and (after padding) a row width. The stack is split
into `N = global_device_count * num_sc_per_device` shards, one per (virtual)
SparseCore, and device `d` holds shards `d*S .. d*S+S-1` contiguously, so the
global array `[N * V_shard, D]` is sharded over devices with
`PartitionSpec(axis, None)`.

Inside the stack, table `t` is padded to `padded_vocab_size` (a multiple of
`8 * N`, so every shard gets a multiple of 8 rows) and to the stack's padded
width, and occupies rows `[row_offset_in_shard, + padded_vocab_size / N)` of
every shard. Its logical row `i` lives on shard `(i % N + shard_rotation) % N`
at row `row_offset_in_shard + i // N` of that shard, i.e. at physical row::

  ((i % N + rotation) % N) * V_shard + row_offset_in_shard + i // N

Example (N = 4): tables `tb` (vocab 72) and `ta` (vocab 40) stacked in that
order with rotation 1. `tb` pads to 96 rows (24 per shard, offset 0,
rotation 0); `ta` pads to 64 (16 per shard, offset 24, rotation 1); each shard
has `V_shard = 40` rows. Id 13 of `ta` goes to shard `(13 % 4 + 1) % 4 = 2`,
row `24 + 13 // 4 = 27`, physical row `2 * 40 + 27 = 107`.

Rotation spreads the small ids of several tables over different shards; by
default table `k` of a stack is rotated by `k * num_sc_per_device`.

Features follow the same bookkeeping on the sample axis: the features of a
stack are concatenated in one global batch, feature `f` starting at
`row_offset`; its ids are shifted by `col_offset = row_offset_in_shard * N`
and rotated by `col_shift = shard_rotation`.

All functions here return new specs; the arguments are never mutated.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pz_sparsecore.core import optimizers
from pz_sparsecore.core.buffer_format import (
  ALIGNMENT,
  compute_theoretical_max_coo_buffer_size,
  num_shards,
  round_up,
)
from pz_sparsecore.core.specs import (
  DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
  DEFAULT_MAX_IDS_PER_PARTITION,
  DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION,
  FeatureIdTransformation,
  FeatureSpec,
  StackedTableSpec,
  TableSettingInStack,
  TableSpec,
  not_a_feature_spec,
)

_MAX_STACK_NAME_DISPLAY = 50
_STACK_NAME_HASH_LENGTH = 12

LimitsCallable = Callable[[str, int], int]


def get_default_limits(name: str, batch_size: int) -> int:
  """The default per-partition limit of a multi-table stack (256)."""
  del name, batch_size
  return 256


def keep_table_limits(name: str, sample_count: int) -> int:
  """A marker to pass as `stack_to_max_ids_per_partition` and/or
  `stack_to_max_unique_ids_per_partition` of `stack_tables` and
  `auto_stack_tables`: a stack of several tables gets the sum of its member
  tables' limits (each table's bound still holds for its share of a
  partition's ids, so their sum bounds the stack's), and, with the first,
  the sum of their suggested buffer sizes when every member has one.
  `SparseCoreEmbed.from_config` stacks with it.
  """
  raise TypeError(
    f"keep_table_limits is a marker for stack_tables / auto_stack_tables, "
    f"not a limits function (called for {name!r}, {sample_count} samples)"
  )


def _feature_leaves(feature_specs: Any) -> list[FeatureSpec]:
  leaves = jax.tree.leaves(feature_specs)
  for leaf in leaves:
    if not isinstance(leaf, FeatureSpec):
      raise not_a_feature_spec(leaf)
  return leaves


def check_feature_names(feature_specs: Any) -> None:
  """Raises if two features share a name (the message is upstream's)."""
  seen = set()
  for feature in _feature_leaves(feature_specs):
    if feature.name in seen:
      raise ValueError(f"Feature spec {feature.name} is already defined.")
    seen.add(feature.name)


def _tables(feature_specs: Any) -> dict[str, TableSpec]:
  tables: dict[str, TableSpec] = {}
  for feature in _feature_leaves(feature_specs):
    table = feature.table_spec
    seen = tables.setdefault(table.name, table)
    if seen != table:
      raise ValueError(
        f"table name {table.name!r} is used by two different TableSpecs "
        f"(feature {feature.name!r})"
      )
  return tables


def get_table_specs(feature_specs: Any) -> dict[str, TableSpec]:
  """The tables of `feature_specs` by name, in first-appearance order.

  Raises:
    ValueError: If two features share a name, or two different tables do.
  """
  check_feature_names(feature_specs)
  return _tables(feature_specs)


def get_stacked_table_specs(feature_specs: Any) -> dict[str, StackedTableSpec]:
  """The stacks of prepared `feature_specs` by stack name.

  Raises:
    ValueError: If the specs were not prepared for training.
  """
  check_feature_names(feature_specs)
  stacks: dict[str, StackedTableSpec] = {}
  for table in _tables(feature_specs).values():
    if table.stacked_table_spec is None:
      raise ValueError(
        f"table {table.name!r} is not prepared; call "
        "prepare_feature_specs_for_training first"
      )
    stacks.setdefault(
      table.stacked_table_spec.stack_name, table.stacked_table_spec
    )
  return stacks


def get_table_stacks(table_specs: Any) -> dict[str, list[TableSpec]]:
  """The member tables of each stack, in row order inside the shards.

  Args:
    table_specs: A pytree of prepared `TableSpec`s or `FeatureSpec`s.

  Returns:
    Stack name (first-appearance order) → its tables, by
    `row_offset_in_shard`.
  """
  stacks: dict[str, list[TableSpec]] = {}
  for table in _table_list(table_specs):
    stacks.setdefault(table.setting_in_stack.stack_name, []).append(table)
  return {
    name: sorted(tables, key=lambda t: t.setting_in_stack.row_offset_in_shard)
    for name, tables in stacks.items()
  }


def _stack_name(table_names: Sequence[str], use_short_stack_names: bool) -> str:
  name = "_".join(table_names)
  if not use_short_stack_names or len(name) <= _MAX_STACK_NAME_DISPLAY:
    return name
  digest = hashlib.sha256(name.encode("utf-8")).hexdigest()
  return (
    name[:_MAX_STACK_NAME_DISPLAY] + "..." + digest[:_STACK_NAME_HASH_LENGTH]
  )


def _replace_features(
  feature_specs: Any,
  tables: Mapping[str, TableSpec],
  transformations: Mapping[str, FeatureIdTransformation],
) -> Any:
  """`feature_specs` with the given tables and id transformations swapped in."""

  def update(feature: FeatureSpec) -> FeatureSpec:
    if feature.table_spec.name not in tables:
      stacked = feature.table_spec.stacked_table_spec is not None
      if stacked and feature.id_transformation is None:  # stacked by hand
        return feature.replace(id_transformation=FeatureIdTransformation())
      return feature
    return feature.replace(
      table_spec=tables[feature.table_spec.name],
      id_transformation=transformations[feature.name],
    )

  return jax.tree.map(update, feature_specs)


def stack_tables(
  feature_specs: Any,
  table_names: Sequence[str],
  global_device_count: int,
  num_sc_per_device: int,
  rotation: int | None = None,
  stack_to_max_ids_per_partition: LimitsCallable = get_default_limits,
  stack_to_max_unique_ids_per_partition: LimitsCallable = get_default_limits,
  stack_name: str | None = None,
  fail_on_excess_padding: bool = False,
  *,
  activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
) -> Any:
  """Stacks the named tables into one physical table.

  Tables are laid out in the given order; table `k` is rotated by
  `k * rotation mod N` (rotation defaults to `num_sc_per_device`). Features
  of member tables, in pytree order, get consecutive sample offsets.

  Args:
    feature_specs: A pytree of `FeatureSpec`s.
    table_names: The tables to stack, in layout order.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: (Virtual) SparseCores per device.
    rotation: Shard rotation step between consecutive tables.
    stack_to_max_ids_per_partition: `(stack_name, sample_count) -> limit`,
      used for stacks of several tables.
    stack_to_max_unique_ids_per_partition: As above for unique ids.
    stack_name: Name of the stack; defaults to the table names joined by "_".
    fail_on_excess_padding: Raise if the members' padded widths differ.
    activation_mem_bytes_limit: The activation limit the stack was grouped
      under, recorded in its `StackedTableSpec` (not checked here).

  Returns:
    New feature specs with the stack filled in.

  Raises:
    ValueError: On unknown, repeated or already stacked tables, a used stack
      name, or members with different optimizers, combiners, quantization
      configs or dtypes.
  """
  n = num_shards(global_device_count, num_sc_per_device)
  table_names = list(table_names)
  if not table_names:
    raise ValueError("stack_tables needs at least one table name")
  stack_name = stack_name or _stack_name(table_names, True)
  tables = _tables(feature_specs)
  _check_stackable(tables, table_names, stack_name)
  members = [tables[name] for name in table_names]
  _check_hashed_members(members, stack_name)
  stack_dim = _stack_width(members, stack_name, fail_on_excess_padding)
  rotation = num_sc_per_device if rotation is None else rotation
  settings = _member_settings(members, stack_name, stack_dim, rotation, n)
  transformations, sample_count = _sample_offsets(
    _feature_leaves(feature_specs), settings, n
  )
  if sample_count == 0:
    raise ValueError(f"stack {stack_name!r}: no feature uses its tables")
  limits = _stack_limits(
    members,
    stack_name,
    sample_count,
    stack_to_max_ids_per_partition,
    stack_to_max_unique_ids_per_partition,
    global_device_count,
    num_sc_per_device,
  )
  stacked = _stacked_spec(
    members[0],
    stack_name,
    sum(s.padded_vocab_size for s in settings.values()),
    stack_dim,
    sample_count,
    {**limits, "activation_mem_bytes_limit": activation_mem_bytes_limit},
  )
  new_tables = {
    t.name: t.replace(
      setting_in_stack=settings[t.name], stacked_table_spec=stacked
    )
    for t in members
  }
  return _replace_features(feature_specs, new_tables, transformations)


def _check_hashed_members(members: list[TableSpec], stack_name: str) -> None:
  """Raises if a stack would mix hashed and range tables, or hashed tables
  of different eviction policies (one map serves a hashed stack)."""
  hashed = [t for t in members if t.is_hashed]
  if not hashed or len(hashed) == len(members) == 1:
    return
  plain = [t.name for t in members if not t.is_hashed]
  if plain:
    raise ValueError(
      f"stack {stack_name!r}: hashed table {hashed[0].name!r} cannot share "
      f"a stack with table {plain[0]!r}, which takes ids in a range"
    )
  other = [t for t in hashed if t.eviction != hashed[0].eviction]
  if other:
    raise ValueError(
      f"stack {stack_name!r}: hashed tables {hashed[0].name!r} and "
      f"{other[0].name!r} have different evictions ({hashed[0].eviction} "
      f"and {other[0].eviction}); tables of one stack share one"
    )


def _check_stackable(
  tables: Mapping[str, TableSpec], table_names: list[str], stack_name: str
) -> None:
  """Raises unless the named tables can form a new stack `stack_name`."""
  repeated = [t for t, c in collections.Counter(table_names).items() if c > 1]
  if repeated:
    raise ValueError(f"Table {repeated[0]} is repeated in group {stack_name}.")
  for name in table_names:
    if name not in tables:
      raise ValueError(f"stack {stack_name!r}: unknown table {name!r}")
    if tables[name].stacked_table_spec is not None:
      raise ValueError(
        f"Table {name} is already stacked (in "
        f"{tables[name].setting_in_stack.stack_name})."
      )
  used = {
    t.setting_in_stack.stack_name
    for t in tables.values()
    if t.stacked_table_spec is not None
  }
  if stack_name in used:
    raise ValueError(f"stack name {stack_name!r} is already used")
  first = tables[table_names[0]]
  for name in table_names[1:]:
    if tables[name].optimizer != first.optimizer:
      raise ValueError(
        f"tables {table_names} in stack {stack_name!r} have different "
        "optimizers"
      )
    if tables[name].combiner != first.combiner:
      raise ValueError(
        f"tables {table_names} in stack {stack_name!r} have different combiners"
      )
    if tables[name].quantization_config != first.quantization_config:
      raise ValueError(
        f"tables {table_names} in stack {stack_name!r} have different "
        "quantization configs"
      )
    if tables[name].dtype != first.dtype:
      raise ValueError(
        f"tables {table_names} in stack {stack_name!r} have different "
        f"dtypes ({first.name!r}: {first.dtype.name}, {name!r}: "
        f"{tables[name].dtype.name}); a stack has one dtype"
      )
  check_logical_dims(
    stack_name, first.optimizer, [tables[name] for name in table_names]
  )


def check_logical_dims(
  stack_name: str, optimizer: Any, tables: Sequence[TableSpec]
) -> None:
  """Raises unless the tables of a stack whose optimizer averages over each
  table's own width (`needs_logical_dim`: row-wise Adagrad) have one
  `embedding_dim`."""
  if not optimizer.definition.needs_logical_dim:
    return
  dims = {t.name: t.embedding_dim for t in tables}
  if len(set(dims.values())) > 1:
    raise ValueError(
      f"tables {sorted(dims)} in stack {stack_name!r} have different "
      f"embedding_dims {dims}; their optimizer {optimizer.short_name()} "
      "averages over each table's own width, so it needs one"
    )


def _stack_width(
  members: list[TableSpec], stack_name: str, fail_on_excess_padding: bool
) -> int:
  """The stack's row width: the widest member's, rounded up to 8."""
  padded_dims = {t.name: round_up(t.embedding_dim) for t in members}
  if fail_on_excess_padding and len(set(padded_dims.values())) > 1:
    raise ValueError(
      f"stack {stack_name!r}: padded widths {padded_dims} differ; stack tables "
      "whose widths round up to the same multiple of 8"
    )
  return max(padded_dims.values())


def _member_settings(
  members: list[TableSpec], stack_name: str, dim: int, rotation: int, n: int
) -> dict[str, TableSettingInStack]:
  return compute_table_to_setting_in_stack(
    stack_name,
    [t.name for t in members],
    dim,
    {t.name: _padded_vocab(t, n) for t in members},
    n,
    rotation,
  )


def compute_table_to_setting_in_stack(
  stack_name: str,
  table_names: Sequence[str],
  padded_embedding_dim: int,
  table_to_padded_vocab_size: Mapping[str, int],
  num_shards: int,
  rotation: int,
) -> dict[str, TableSettingInStack]:
  """Each member's rows in every shard: one after another, table `k`
  rotated by `k * rotation mod N`.

  Example: tables a (padded to 32 rows) and b (128) on N = 4 shards with
  rotation 2: a holds rows [0, 8) of every shard, b rows [8, 40), rotated
  by 2.

  Args:
    stack_name: The stack's name.
    table_names: The member tables, in layout order.
    padded_embedding_dim: The stack's width.
    table_to_padded_vocab_size: Each member's padded vocabulary (a
      multiple of `8 * N`).
    num_shards: `N`, the SparseCores the stack is sharded over.
    rotation: The shard rotation step between consecutive tables.

  Returns:
    Table name -> its `TableSettingInStack`.

  Raises:
    ValueError: If a member has no padded vocabulary size.
  """
  settings: dict[str, TableSettingInStack] = {}
  row_offset_in_shard = 0
  for k, name in enumerate(table_names):
    if name not in table_to_padded_vocab_size:
      raise ValueError(
        f"stack {stack_name!r}: table {name!r} has no entry in "
        "table_to_padded_vocab_size; give every member's padded vocabulary"
      )
    settings[name] = TableSettingInStack(
      stack_name=stack_name,
      padded_vocab_size=table_to_padded_vocab_size[name],
      padded_embedding_dim=padded_embedding_dim,
      row_offset_in_shard=row_offset_in_shard,
      shard_rotation=(k * rotation) % num_shards,
    )
    row_offset_in_shard += table_to_padded_vocab_size[name] // num_shards
  return settings


def _padded_vocab(table: TableSpec, n: int) -> int:
  """The vocabulary rounded up so that every shard gets a multiple of 8."""
  return round_up(table.vocabulary_size, ALIGNMENT * n)


def _sample_offsets(
  features: list[FeatureSpec],
  settings: Mapping[str, TableSettingInStack],
  n: int,
) -> tuple[dict[str, FeatureIdTransformation], int]:
  """Consecutive sample offsets for the features of the stacked tables."""
  transformations: dict[str, FeatureIdTransformation] = {}
  sample_count = 0
  for feature in features:
    setting = settings.get(feature.table_spec.name)
    if setting is None:
      continue
    transformations[feature.name] = FeatureIdTransformation(
      row_offset=sample_count,
      col_offset=setting.row_offset_in_shard * n,
      col_shift=setting.shard_rotation,
    )
    sample_count += feature.sample_count
  return transformations, sample_count


def _stack_limits(
  members: list[TableSpec],
  stack_name: str,
  sample_count: int,
  max_ids: LimitsCallable,
  max_unique: LimitsCallable,
  global_device_count: int,
  num_sc_per_device: int,
) -> dict[str, Any]:
  """A stack's limits: its table's when alone, else from the callables (or
  the members' sums: `keep_table_limits`; the summed buffer size is capped
  at the largest the summed limit allows, which no batch can overflow)."""
  if len(members) == 1:
    return _table_limits(members[0])
  limits = {}
  for field, fn in (
    ("max_ids_per_partition", max_ids),
    ("max_unique_ids_per_partition", max_unique),
  ):
    limits[field] = (
      sum(getattr(t, field) for t in members)
      if fn is keep_table_limits
      else fn(stack_name, sample_count)
    )
  sizes = [t.suggested_coo_buffer_size_per_device for t in members]
  if max_ids is keep_table_limits and None not in sizes:
    limits["suggested_coo_buffer_size_per_device"] = min(
      sum(sizes),
      compute_theoretical_max_coo_buffer_size(
        limits["max_ids_per_partition"], global_device_count, num_sc_per_device
      ),
    )
  return limits


def _table_limits(table: TableSpec) -> dict[str, Any]:
  """A one-table stack keeps its table's limits and buffer size."""
  return dict(
    max_ids_per_partition=table.max_ids_per_partition,
    max_unique_ids_per_partition=table.max_unique_ids_per_partition,
    suggested_coo_buffer_size_per_device=(
      table.suggested_coo_buffer_size_per_device
    ),
  )


def _stacked_spec(
  first: TableSpec,
  stack_name: str,
  vocab: int,
  dim: int,
  sample_count: int,
  limits: Mapping[str, Any],
) -> StackedTableSpec:
  return StackedTableSpec(
    stack_name=stack_name,
    stack_vocab_size=vocab,
    stack_embedding_dim=dim,
    optimizer=first.optimizer,
    combiner=first.combiner,
    total_sample_count=sample_count,
    quantization_config=first.quantization_config,
    dtype=first.dtype,
    **limits,
  )


def auto_stack_tables(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int,
  rotation: int | None = None,
  stack_to_max_ids_per_partition: LimitsCallable = get_default_limits,
  stack_to_max_unique_ids_per_partition: LimitsCallable = get_default_limits,
  *,
  use_short_stack_names: bool = True,
  activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
) -> Any:
  """Stacks every group of compatible tables.

  Tables (in first-appearance order) are grouped by padded width, optimizer,
  combiner, quantization config and dtype; each group is split greedily so
  that a stack's activation memory per SparseCore (`padded_dim * samples /
  N * 4` bytes per table) stays within `activation_mem_bytes_limit`. Each
  group becomes one stack.

  Returns:
    New feature specs (still to be passed to
    `prepare_feature_specs_for_training`).
  """
  result = feature_specs
  for stack in compatible_table_groups(
    feature_specs,
    global_device_count,
    num_sc_per_device,
    activation_mem_bytes_limit,
  ):
    result = stack_tables(
      result,
      stack,
      global_device_count,
      num_sc_per_device,
      rotation=rotation,
      stack_to_max_ids_per_partition=stack_to_max_ids_per_partition,
      stack_to_max_unique_ids_per_partition=(
        stack_to_max_unique_ids_per_partition
      ),
      stack_name=_stack_name(stack, use_short_stack_names),
      activation_mem_bytes_limit=activation_mem_bytes_limit,
    )
  return result


def compatible_table_groups(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int,
  activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
  apart: frozenset[str] = frozenset(),
) -> list[list[str]]:
  """The stacks `auto_stack_tables` forms, as lists of table names.

  Unstacked tables (in first-appearance order) grouped by padded width
  (the exact width for a row-wise optimizer's tables), optimizer, combiner,
  quantization config and dtype (and by membership of
  `apart`: tables placed differently never share a stack), each group
  split greedily by activation memory per SparseCore (see
  `auto_stack_tables`). A table alone in its group is a list of one.
  """
  n = num_shards(global_device_count, num_sc_per_device)
  features = _feature_leaves(feature_specs)
  tables = _tables(feature_specs)
  samples: dict[str, int] = collections.Counter()
  for feature in features:
    samples[feature.table_spec.name] += feature.sample_count // n
  groups: dict[tuple[Any, ...], list[str]] = {}
  for name, table in tables.items():
    if table.stacked_table_spec is not None:
      continue
    # A row-wise optimizer's mean divides by the table's own width: such
    # tables stack with tables of that exact width only.
    width = (
      table.embedding_dim
      if table.optimizer.definition.needs_logical_dim
      else round_up(table.embedding_dim)
    )
    key = (
      width,
      table.optimizer,
      table.combiner,
      table.quantization_config,
      table.dtype,
      name in apart,
      # Hashed tables stack with hashed ones of the same eviction policy.
      table.eviction,
    )
    groups.setdefault(key, []).append(name)

  def mem_bytes(name: str) -> int:
    return round_up(tables[name].embedding_dim) * samples[name] * 4

  memory = {name: mem_bytes(name) for name in tables}
  return split_groups_by_memory_limit(
    list(groups.values()), memory, activation_mem_bytes_limit
  )


def readable_stack_name(table_names: Sequence[str]) -> str:
  """A stack's name that says what it holds: its tables joined by "_" when
  that is short (at most 50 characters), else `"<first>_and_<k>_more"`
  (a table belongs to one stack, so names stay distinct)."""
  name = "_".join(table_names)
  if len(name) <= _MAX_STACK_NAME_DISPLAY:
    return name
  return f"{table_names[0]}_and_{len(table_names) - 1}_more"


def stack_compatible_tables(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int,
  apart: frozenset[str] = frozenset(),
) -> Any:
  """Stacks every group of compatible unstacked tables
  (`compatible_table_groups`; the tables in `apart`, e.g. the replicated
  ones, stack only among themselves), keeping each table's limits
  (`keep_table_limits`), with readable names (`readable_stack_name`);
  tables alone in their group stay unstacked. `SparseCoreEmbed.from_config`
  does this unless told `stacking=None`.
  """
  result = feature_specs
  for group in compatible_table_groups(
    feature_specs, global_device_count, num_sc_per_device, apart=apart
  ):
    if len(group) < 2:
      continue
    result = stack_tables(
      result,
      group,
      global_device_count,
      num_sc_per_device,
      stack_to_max_ids_per_partition=keep_table_limits,
      stack_to_max_unique_ids_per_partition=keep_table_limits,
      stack_name=readable_stack_name(group),
    )
  return result


def _valency(feature: FeatureSpec) -> int | None:
  """Ids per sample that `feature`'s specs declare (`input_shape` over its
  sample count, rounded up), or None if `input_shape` has unknown sizes."""
  dims = tuple(feature.input_shape)
  if any(d is None for d in dims):
    return None
  return max(1, -(-math.prod(dims) // feature.sample_count))


def has_default_limits(table: TableSpec) -> bool:
  """Whether a table's limits are still upstream's defaults (256 ids and
  256 distinct ids per partition, no buffer size)."""
  return (
    table.max_ids_per_partition == DEFAULT_MAX_IDS_PER_PARTITION
    and table.max_unique_ids_per_partition
    == DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION
    and table.suggested_coo_buffer_size_per_device is None
  )


def worst_case_limits(
  feature_specs: Any, global_device_count: int, num_sc_per_device: int
) -> Any:
  """`feature_specs` with limits that no batch of the declared shapes
  exceeds, for every unstacked table whose limits are still upstream's
  defaults.

  One SparseCore preprocesses `sample_count / N` samples of each feature
  (N = devices x SparseCores), each with at most `valency` ids (the
  feature's `input_shape` over its sample count: `[batch, k]` -> `k`), so
  at worst it sends all `c = sum(samples / N * valency)` of a table's ids to
  one partition. Where `c` is above upstream's default of 256,
  `max_ids_per_partition = c` and the buffer holds every id of the
  device's SparseCores, each partition 8-aligned:
  `suggested_coo_buffer_size_per_device = S * (c + 7 * N)`; otherwise the
  default stays (a declared valency is informative only: ragged rows may be
  longer, and 256 keeps admitting what it admitted). Distinct ids are
  bounded by a partition's rows too: `max_unique_ids_per_partition =
  min(max_ids_per_partition, padded_vocab / N)`. The activation exchange's
  window then holds every id a SparseCore has, the row exchange's every
  distinct id (or row) it can have; FDO statistics (`pzsc.update_limits`)
  tighten them to what the data needs.

  Tables with limits of their own, or already stacked, and tables with a
  feature whose `input_shape` has unknown sizes keep theirs. Ragged rows
  longer than their feature's declared valency can still exceed these
  limits, with the usual error naming the stack.
  """
  n = num_shards(global_device_count, num_sc_per_device)
  counts: dict[str, int | None] = {}
  for feature in _feature_leaves(feature_specs):
    table = feature.table_spec
    if table.stacked_table_spec is not None or not has_default_limits(table):
      continue
    valency = _valency(feature)
    seen = counts.get(table.name, 0)
    if valency is None or seen is None:
      counts[table.name] = None
      continue
    counts[table.name] = seen + -(-feature.sample_count // n) * valency
  tables = {}
  for table in _tables(feature_specs).values():
    c = counts.get(table.name)
    if c is None:
      continue
    limits: dict[str, Any] = {}
    if c > DEFAULT_MAX_IDS_PER_PARTITION:
      limits = dict(
        max_ids_per_partition=c,
        suggested_coo_buffer_size_per_device=min(
          num_sc_per_device * (c + (ALIGNMENT - 1) * n),
          compute_theoretical_max_coo_buffer_size(
            c, global_device_count, num_sc_per_device
          ),
        ),
      )
    limits["max_unique_ids_per_partition"] = min(
      limits.get("max_ids_per_partition", table.max_ids_per_partition),
      _padded_vocab(table, n) // n,
    )
    tables[table.name] = table.replace(**limits)

  def update(feature: FeatureSpec) -> FeatureSpec:
    table = tables.get(feature.table_spec.name)
    return feature if table is None else feature.replace(table_spec=table)

  return jax.tree.map(update, feature_specs)


def split_groups_by_memory_limit(
  groups: Sequence[Sequence[str]],
  table_to_activation_mem_bytes: Mapping[str, int],
  activation_mem_bytes_limit: int,
) -> list[list[str]]:
  """Splits each group of table names so no part exceeds the memory limit.

  Tables are placed greedily, in order, into the first part of their group
  with room (a table above the limit on its own gets a part of its own).

  Args:
    groups: Groups of table names.
    table_to_activation_mem_bytes: Activation bytes per SparseCore of each
      table.
    activation_mem_bytes_limit: The most bytes one part may hold.

  Returns:
    The parts, group by group.
  """
  parts: list[list[str]] = []
  for group in groups:
    split: list[list[str]] = []
    for name in group:
      need = table_to_activation_mem_bytes[name]
      for candidate in split:
        total = sum(table_to_activation_mem_bytes[t] for t in candidate)
        if total + need <= activation_mem_bytes_limit:
          candidate.append(name)
          break
      else:
        split.append([name])
    parts.extend(split)
  return parts


def with_batch_sizes(
  feature_specs: Any,
  sizes: Sequence[int],
  global_device_count: int,
  num_sc_per_device: int,
) -> Any:
  """Prepared `feature_specs` for another batch: each feature's first sample
  axis resized to its entry of `sizes` (leaf order, global samples).

  The stacks keep their tables and layout; the sample side moves: each
  stack's features get consecutive sample offsets in their order
  (`row_offset`) and the stack's `total_sample_count` is their sum.
  `input_shape`'s first size scales with the batch (it is informative).
  A stack whose samples shrink keeps its limits; one whose samples grow
  `k`-fold gets `ceil(k)` times its limits and buffer size (each
  SparseCore has that many times the samples: the worst case scales so),
  distinct ids at most a shard's rows, the buffer at most the theoretical
  maximum. Example: features `a` and `b` of one stack, 64 samples each,
  resized to 16: `b`'s samples start at 16 instead of 64, the stack holds
  32, its limits unchanged.

  Args:
    feature_specs: Specs prepared (`prepare_feature_specs_for_training`).
    sizes: The new first-axis size of every feature.
    global_device_count: Devices of the topology (for the buffer bound).
    num_sc_per_device: SparseCores per device.

  Returns:
    New prepared specs of the same structure.

  Raises:
    ValueError: If `sizes` does not have one positive size per feature.
  """
  leaves, treedef = jax.tree.flatten(feature_specs)
  sizes = [int(x) for x in sizes]
  if len(sizes) != len(leaves) or min(sizes, default=1) < 1:
    raise ValueError(
      f"{len(leaves)} features need as many positive batch sizes, got {sizes}"
    )
  resized = []
  for spec, size in zip(leaves, sizes, strict=True):
    old = spec.output_shape[0]
    shape = list(spec.input_shape)
    if shape and shape[0] is not None and shape[0] % old == 0:
      shape[0] = shape[0] // old * size
    resized.append(
      spec.replace(
        input_shape=tuple(shape),
        output_shape=(size, *spec.output_shape[1:]),
      )
    )
  by_stack: dict[str, list[int]] = collections.defaultdict(list)
  for i, spec in enumerate(leaves):
    by_stack[spec.table_spec.setting_in_stack.stack_name].append(i)
  totals = {}
  for name, members in by_stack.items():
    start = 0
    order = sorted(
      members,
      key=lambda i: (
        (leaves[i].id_transformation or FeatureIdTransformation()).row_offset
      ),
    )
    for i in order:
      transform = resized[i].id_transformation
      if transform is not None:
        resized[i] = resized[i].replace(
          id_transformation=dataclasses.replace(transform, row_offset=start)
        )
      start += resized[i].sample_count
    totals[name] = start
  out = []
  for spec in resized:
    table = spec.table_spec
    stacked = _grown_limits(
      table.stacked_table_spec,
      totals[table.setting_in_stack.stack_name],
      global_device_count,
      num_sc_per_device,
    )
    out.append(
      spec.replace(table_spec=table.replace(stacked_table_spec=stacked))
    )
  return jax.tree.unflatten(treedef, out)


def _grown_limits(
  stacked: StackedTableSpec, samples: int, g: int, s: int
) -> StackedTableSpec:
  """`stacked` for `samples` samples (`with_batch_sizes`' limits rule)."""
  k = -(-samples // stacked.total_sample_count)
  if k <= 1:
    return stacked.replace(total_sample_count=samples)
  ids = stacked.max_ids_per_partition * k
  size = stacked.suggested_coo_buffer_size_per_device
  if size is not None:
    size = min(size * k, compute_theoretical_max_coo_buffer_size(ids, g, s))
  return stacked.replace(
    total_sample_count=samples,
    max_ids_per_partition=ids,
    max_unique_ids_per_partition=min(
      stacked.max_unique_ids_per_partition * k,
      max(stacked.stack_vocab_size // num_shards(g, s), 1),
      ids,
    ),
    suggested_coo_buffer_size_per_device=size,
  )


def prepare_feature_specs_for_training(
  feature_specs: Any, global_device_count: int, num_sc_per_device: int
) -> Any:
  """Fills in stacking for every table that is not stacked yet.

  Each unstacked table becomes a one-table stack named after it. Features
  sharing such a table are ordered by feature name and get consecutive
  sample offsets. Tables already stacked are kept as they are, even if laid
  out for another topology (as upstream; the layer and the kernels check the
  layout where they size tables), and their features without an id
  transformation get (0, 0, 0).

  Args:
    feature_specs: A pytree of `FeatureSpec`s.
    global_device_count: Devices the tables are sharded over.
    num_sc_per_device: (Virtual) SparseCores per device.

  Returns:
    New feature specs, ready for preprocessing.

  Raises:
    ValueError: On a bad topology or duplicate names.
  """
  n = num_shards(global_device_count, num_sc_per_device)
  features = _feature_leaves(feature_specs)
  tables = _tables(feature_specs)
  by_table: dict[str, list[FeatureSpec]] = collections.defaultdict(list)
  for feature in features:
    by_table[feature.table_spec.name].append(feature)

  stacked_names = {
    t.setting_in_stack.stack_name
    for t in tables.values()
    if t.stacked_table_spec is not None
  }
  new_tables: dict[str, TableSpec] = {}
  transformations: dict[str, FeatureIdTransformation] = {}
  for name, table in tables.items():
    if table.stacked_table_spec is None and name in stacked_names:
      raise ValueError(
        f"table {name!r} would become a one-table stack named {name!r}, but "
        "a stack of other tables already has that name; pass another "
        "stack_name to stack_tables"
      )
    if table.stacked_table_spec is not None:
      # Kept as stacked, even for another topology (as upstream): the layer
      # and the kernels check the layout where they size tables.
      continue
    members = sorted(by_table[name], key=lambda f: f.name)
    sample_count = 0
    for feature in members:
      transformations[feature.name] = FeatureIdTransformation(
        row_offset=sample_count
      )
      sample_count += feature.sample_count
    padded_vocab = _padded_vocab(table, n)
    padded_dim = round_up(table.embedding_dim)
    new_tables[name] = table.replace(
      setting_in_stack=TableSettingInStack(
        stack_name=name,
        padded_vocab_size=padded_vocab,
        padded_embedding_dim=padded_dim,
      ),
      stacked_table_spec=_stacked_spec(
        table,
        name,
        padded_vocab,
        padded_dim,
        sample_count,
        _table_limits(table),
      ),
    )
  return _replace_features(feature_specs, new_tables, transformations)


# ---------------------------------------------------------------------------
# Logical <-> physical rows and tables.


def _table_list(table_specs: Any) -> list[TableSpec]:
  """Unique `TableSpec`s from a pytree of table or feature specs."""
  seen: dict[str, TableSpec] = {}
  for leaf in jax.tree.leaves(table_specs):
    table = leaf.table_spec if isinstance(leaf, FeatureSpec) else leaf
    if not isinstance(table, TableSpec):
      raise ValueError(f"expected TableSpec leaves, got {type(leaf).__name__}")
    if table.stacked_table_spec is None:
      raise ValueError(
        f"table {table.name!r} is not prepared; call "
        "prepare_feature_specs_for_training first"
      )
    seen.setdefault(table.name, table)
  return list(seen.values())


def physical_row_ids(
  table_spec: TableSpec, ids: np.ndarray, num_shards: int
) -> np.ndarray:
  """Flat physical rows `[N * V_shard]` of logical rows `ids` of a table.

  Raises:
    ValueError: If an id is outside `[0, vocabulary_size)`.
  """
  ids = np.asarray(ids)
  vocab = table_spec.vocabulary_size
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    bad = ids[(ids < 0) | (ids >= vocab)].flat[0]
    raise ValueError(
      f"table {table_spec.name!r}: row {int(bad)} outside [0, {vocab})"
    )
  setting = table_spec.setting_in_stack
  return compute_physical_row_ids(
    num_shards,
    table_spec.stacked_table_spec.stack_vocab_size,
    setting.shard_rotation,
    setting.row_offset_in_shard,
    ids,
  )


def compute_physical_row_ids(
  num_sparse_cores: int,
  stack_vocab_size: int,
  shard_rotation: int,
  row_offset_in_shard: int,
  row_ids: Any,
) -> Any:
  """Rows of the stacked `[N * V_shard, D]` table of a table's logical rows.

  Plain arithmetic on ints, NumPy or JAX arrays (it traces under `jit` and
  `pmap`), without range checks: row `i` lives on shard
  `(i % N + shard_rotation) % N` at row `i // N + row_offset_in_shard`.
  """
  shard_rows = stack_vocab_size // num_sparse_cores
  shard = (row_ids % num_sparse_cores + shard_rotation) % num_sparse_cores
  return shard * shard_rows + row_ids // num_sparse_cores + row_offset_in_shard


def logical_row_ids(
  num_sparse_cores: int,
  shard_rotation: int,
  row_offset_in_shard: int,
  shard: Any,
  row: Any,
) -> Any:
  """The logical rows of rows `row` of shards `shard` (the inverse of
  `compute_physical_row_ids`): `(row - row_offset_in_shard) * N + (shard -
  shard_rotation) % N`. Plain arithmetic on ints, NumPy or JAX arrays;
  rows outside the table give ids outside `[0, padded_vocab_size)`."""
  n = num_sparse_cores
  return (row - row_offset_in_shard) * n + (shard - shard_rotation) % n


def stack_and_shard_tables(
  table_specs: Any,
  tables: Mapping[str, Any],
  num_shards: int,
  pad_value: float = np.nan,
  *,
  slot_shape: optimizers.SlotShapeLike = None,
) -> dict[str, Any]:
  """Logical tables → stacked, MOD-sharded physical tables.

  Args:
    table_specs: A pytree of prepared `TableSpec`s (or `FeatureSpec`s).
    tables: Table name → `[vocab, dim]` array (or a pytree of such arrays,
      e.g. slots); every table of a stack must be given.
    num_shards: N = devices x SparseCores.
    pad_value: Value of padding rows and columns.
    slot_shape: None (or "table") for tables and table-shaped slots; for
      optimizer slots of another shape (`optimizers.SlotShape`), the arrays
      are the slot's logical shape (`[vocab]` for "rowwise_1d", `[vocab, k]`
      for width k) and the result `[N, V_shard, width]`.

  Returns:
    Stack name → `[N, V_shard, D]` float32 numpy array (or pytree thereof).

  Raises:
    ValueError: On a missing table or a shape mismatch.
  """
  slot = optimizers.Slot("", shape=slot_shape)
  out: dict[str, Any] = {}
  for stack_name, members in get_table_stacks(table_specs).items():
    stacked_spec = members[0].stacked_table_spec
    v_shard = stacked_spec.stack_vocab_size // num_shards
    dim = slot.width(stacked_spec.stack_embedding_dim)
    for table in members:
      if table.name not in tables:
        raise ValueError(f"stack {stack_name!r}: table {table.name!r} missing")
    structure = jax.tree.structure(tables[members[0].name])

    def stack_leaves(*leaves, members=members, v_shard=v_shard, dim=dim):
      stacked = np.full((num_shards, v_shard, dim), pad_value, np.float32)
      for table, values in zip(members, leaves, strict=True):
        values = np.asarray(values, dtype=np.float32)
        expected = slot.logical_shape(
          table.vocabulary_size, table.embedding_dim
        )
        if values.shape != expected:
          raise ValueError(
            f"table {table.name!r}: expected shape {expected}, got "
            f"{values.shape}"
          )
        setting = table.setting_in_stack
        rows = setting.padded_vocab_size // num_shards
        padded = np.full(
          (setting.padded_vocab_size, dim), pad_value, np.float32
        )
        width = slot.width(table.embedding_dim)
        padded[: expected[0], :width] = values.reshape(expected[0], width)
        sharded = padded.reshape(rows, num_shards, dim).swapaxes(0, 1)
        sharded = np.roll(sharded, setting.shard_rotation, axis=0)
        offset = setting.row_offset_in_shard
        stacked[:, offset : offset + rows] = sharded
      return stacked

    member_trees = [tables[t.name] for t in members]
    for table, tree in zip(members, member_trees, strict=True):
      if jax.tree.structure(tree) != structure:
        raise ValueError(
          f"stack {stack_name!r}: table {table.name!r} has a different "
          "structure from its stack mates"
        )
    out[stack_name] = jax.tree.map(stack_leaves, *member_trees)
  return out


def unshard_and_unstack_tables(
  table_specs: Any,
  stacked_tables: Mapping[str, Any],
  num_shards: int,
  *,
  slot_shape: optimizers.SlotShapeLike = None,
) -> dict[str, Any]:
  """Stacked physical tables → logical tables; the inverse of stacking.

  Args:
    table_specs: A pytree of prepared `TableSpec`s (or `FeatureSpec`s).
    stacked_tables: Stack name → `[N, V_shard, D]` or `[N * V_shard, D]`
      array (or a pytree of such arrays).
    num_shards: N = devices x SparseCores.
    slot_shape: As in `stack_and_shard_tables`: for optimizer slots of
      another shape than the table's, the stacked arrays are
      `[N, V_shard, width]` and the results the slot's logical shape.

  Returns:
    Table name → `[vocab, dim]` numpy array (or pytree thereof).

  Raises:
    ValueError: On a missing stack or a shape mismatch.
  """
  slot = optimizers.Slot("", shape=slot_shape)
  out: dict[str, Any] = {}
  for table in _table_list(table_specs):
    stacked_spec = table.stacked_table_spec
    stack_name = stacked_spec.stack_name
    if stack_name not in stacked_tables:
      raise ValueError(f"table {table.name!r}: stack {stack_name!r} missing")
    out[table.name] = jax.tree.map(
      lambda leaf, table=table: _unstack_leaf(table, leaf, num_shards, slot),
      stacked_tables[stack_name],
    )
  return out


def _unstack_leaf(
  table: TableSpec, stacked: Any, n: int, slot: optimizers.Slot
) -> np.ndarray:
  """One logical table (or slot) out of one stacked array."""
  stacked_spec = table.stacked_table_spec
  stacked = np.asarray(stacked)
  dim = slot.width(stacked_spec.stack_embedding_dim)
  if stacked.size != stacked_spec.stack_vocab_size * dim:
    raise ValueError(
      f"stack {stacked_spec.stack_name!r}: expected "
      f"{stacked_spec.stack_vocab_size} x {dim} values, got shape "
      f"{stacked.shape}"
    )
  setting = table.setting_in_stack
  rows = setting.padded_vocab_size // n
  stacked = stacked.reshape(n, -1, dim)
  offset = setting.row_offset_in_shard
  values = np.roll(
    stacked[:, offset : offset + rows], -setting.shard_rotation, 0
  )
  values = values.swapaxes(0, 1).reshape(-1, dim)
  values = values[: table.vocabulary_size, : slot.width(table.embedding_dim)]
  return values.reshape(
    slot.logical_shape(table.vocabulary_size, table.embedding_dim)
  ).copy()
