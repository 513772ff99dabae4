"""jax-tpu-embedding's `lib/nn/table_stacking` over pz_sparsecore.

Stacking fills the given (compat) specs in place and returns None; the
table layout functions are pz_sparsecore's.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore.compat.lib.nn import embedding_spec
from pz_sparsecore.core import layout
from pz_sparsecore.core.layout import (
  compute_physical_row_ids,
  compute_table_to_setting_in_stack,
  get_default_limits,
)
from pz_sparsecore.core.specs import DEFAULT_ACTIVATION_MEM_BYTES_LIMIT

__all__ = [
  "DEFAULT_ACTIVATION_MEM_BYTES_LIMIT",
  "auto_stack_tables",
  "compute_physical_row_ids",
  "compute_table_to_setting_in_stack",
  "get_default_limits",
  "get_row_ids_in_stacked_table",
  "get_row_ids_in_stacked_tables",
  "stack_and_shard_feature_tables",
  "unstack_and_unshard_stacked_tables",
  "get_table_stacks",
  "stack_and_shard_tables",
  "stack_tables",
  "unshard_and_unstack_tables",
]


def stack_tables(
  features: Any, table_names: Sequence[str], *args: Any, **kwargs: Any
) -> None:
  """Stacks the named tables into one, in place (see `layout.stack_tables`)."""
  frozen = layout.stack_tables(
    embedding_spec.to_pz(features), table_names, *args, **kwargs
  )
  embedding_spec.write_back(features, frozen)


def auto_stack_tables(features: Any, *args: Any, **kwargs: Any) -> None:
  """Stacks every group of compatible tables, in place
  (`activation_mem_bytes_limit=None` is the default limit, as upstream)."""
  if kwargs.get("activation_mem_bytes_limit", 0) is None:
    kwargs["activation_mem_bytes_limit"] = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT
  frozen = layout.auto_stack_tables(
    embedding_spec.to_pz(features), *args, **kwargs
  )
  embedding_spec.write_back(features, frozen)


def _tables_to_pz(table_specs: Any) -> Any:
  def convert(spec: Any) -> Any:
    if isinstance(spec, embedding_spec.FeatureSpec):
      spec = spec.table_spec
    return embedding_spec.table_to_pz(spec)

  return jax.tree.map(
    convert,
    table_specs,
    is_leaf=lambda x: isinstance(
      x, embedding_spec.TableSpec | embedding_spec.FeatureSpec
    ),
  )


def get_table_stacks(table_specs: Any) -> dict[str, list[Any]]:
  """Stack name -> its member tables, in row order inside the shards."""
  compat = {
    t.name: t
    for t in jax.tree.leaves(table_specs)
    if isinstance(t, embedding_spec.TableSpec)
  }
  stacks = layout.get_table_stacks(_tables_to_pz(table_specs))
  return {
    name: [compat.get(t.name, t) for t in members]
    for name, members in stacks.items()
  }


def _delete(tree: Any) -> None:
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      leaf.delete()


def stack_and_shard_tables(
  table_specs: Any,
  tables: Any,
  num_shards: int,
  pad_value: float = float("nan"),
  *,
  delete_input: bool = False,
) -> dict[str, Any]:
  """Logical tables -> stacked, MOD-sharded tables.

  With `delete_input`, the input arrays are deleted once the stacked tables
  exist (so peak memory holds the two only briefly).
  """
  stacked = layout.stack_and_shard_tables(
    _tables_to_pz(table_specs), tables, num_shards, pad_value
  )
  if delete_input:
    jax.block_until_ready(stacked)
    _delete(tables)
  return stacked


def unshard_and_unstack_tables(
  table_specs: Any,
  stacked_tables: Mapping[str, Any],
  num_shards: int,
  *,
  donate: bool = False,
) -> Any:
  """Stacked tables -> logical tables (`donate` deletes the inputs)."""
  tables = layout.unshard_and_unstack_tables(
    _tables_to_pz(table_specs), stacked_tables, num_shards
  )
  if donate:
    jax.block_until_ready(tables)
    _delete(stacked_tables)
  return tables


def _split_groups_by_memory_limit(
  groups: list[list[str]],
  table_to_activation_mem_bytes: Mapping[str, int],
  activation_mem_bytes_limit: int,
) -> list[list[str]]:
  return layout.split_groups_by_memory_limit(
    groups, table_to_activation_mem_bytes, activation_mem_bytes_limit
  )


# ---------------------------------------------------------------------------
# The same on an `EmbeddingSpecProto` (`pz_sparsecore.core.spec_proto`).


def _physical_rows(stack: Any, table: Any) -> np.ndarray:
  return compute_physical_row_ids(
    stack.num_sparsecores,
    stack.stack_vocab_size,
    table.shard_rotation,
    table.row_offset_in_shard,
    np.arange(table.vocab_size),
  )


def _unstack_and_unshard_stacked_table(
  stacked_table: jax.Array, stacked_table_specs: Any, donate: bool = False
) -> dict[str, jax.Array]:
  """Table name -> `[vocab, dim]` table, from one stacked table and its proto.

  The results keep the stacked table's sharding.
  """
  stack = stacked_table_specs
  sharding = getattr(stacked_table, "sharding", None)
  flat = jnp.reshape(stacked_table, (-1, stack.stack_embedding_dim))
  tables = {}
  for table in stack.table_specs:
    rows = _physical_rows(stack, table)
    out = jnp.take(flat, rows, axis=0)[:, : table.embedding_dim]
    tables[table.table_name] = (
      jax.device_put(out, sharding) if sharding is not None else out
    )
  if donate:
    jax.block_until_ready(tables)
    _delete(stacked_table)
  return tables


def unstack_and_unshard_stacked_tables(
  stacked_tables: dict[str, jax.Array],
  embedding_specs: Any,
  donate: bool = False,
) -> dict[str, jax.Array]:
  """Table name -> `[vocab, dim]` table, for every stack of the proto."""
  tables = {}
  for stack in embedding_specs.stacked_table_specs:
    if stack.stack_name not in stacked_tables:
      raise ValueError(f"stack {stack.stack_name!r} not in `stacked_tables`")
    tables.update(
      _unstack_and_unshard_stacked_table(
        stacked_tables[stack.stack_name], stack, donate
      )
    )
  return tables


def stack_and_shard_feature_tables(
  feature_tables: dict[str, jax.Array],
  embedding_specs: Any,
  delete_input: bool = False,
) -> dict[str, jax.Array]:
  """Stack name -> stacked, MOD-sharded table, zero-padded, from a proto.

  Every input table must have the same sharding; the stacked tables get it.

  Raises:
    ValueError: On a missing table, a shape that does not match the proto,
      or inputs with different shardings.
  """
  shardings = {getattr(t, "sharding", None) for t in feature_tables.values()}
  if len(shardings) > 1:
    raise ValueError(
      f"All feature tables must have the same sharding. Found {shardings}."
    )
  sharding = shardings.pop() if shardings else None
  result = {}
  for stack in embedding_specs.stacked_table_specs:
    out = jnp.zeros(
      (stack.stack_vocab_size, stack.stack_embedding_dim), jnp.float32
    )
    for table in stack.table_specs:
      value = feature_tables.get(table.table_name)
      if value is None:
        raise ValueError(f"{table.table_name}' not found in `feature_tables`.")
      if tuple(value.shape) != (table.vocab_size, table.embedding_dim):
        raise ValueError(
          f"table {table.table_name!r}: shape {tuple(value.shape)}, the proto "
          f"says ({table.vocab_size}, {table.embedding_dim})"
        )
      out = out.at[_physical_rows(stack, table), : table.embedding_dim].set(
        jnp.asarray(value, out.dtype)
      )
    result[stack.stack_name] = (
      jax.device_put(out, sharding) if sharding is not None else out
    )
  if delete_input:
    jax.block_until_ready(result)
    _delete(feature_tables)
  return result


def get_row_ids_in_stacked_table(
  stack_table_spec: Any, table_spec: Any, row_ids: Sequence[int]
) -> list[int]:
  """Rows of the stacked table of a table's logical `row_ids` (from protos).

  Raises:
    ValueError: If a row id is not below the table's vocabulary size.
  """
  result = []
  for row in row_ids:
    if not 0 <= row < table_spec.vocab_size:
      raise ValueError(
        f"{row} exceeds available vocabulary size [{table_spec.vocab_size}]."
      )
    result.append(
      int(
        compute_physical_row_ids(
          stack_table_spec.num_sparsecores,
          stack_table_spec.stack_vocab_size,
          table_spec.shard_rotation,
          table_spec.row_offset_in_shard,
          row,
        )
      )
    )
  return result


def get_row_ids_in_stacked_tables(
  embedding_spec_proto: Any, row_ids: Mapping[str, Sequence[int]]
) -> dict[str, list[int]]:
  """Stack name -> stacked rows of the tables' logical `row_ids`."""
  result: dict[str, list[int]] = collections.defaultdict(list)
  for stack in embedding_spec_proto.stacked_table_specs:
    for table in stack.table_specs:
      if table.table_name in row_ids:
        result[stack.stack_name].extend(
          get_row_ids_in_stacked_table(stack, table, row_ids[table.table_name])
        )
  return result
