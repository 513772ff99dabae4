"""A `SparseCoreLookup`'s table in vocabulary order, as Penzai shows it.

A `SparseCoreLookup` keeps its table in *physical* order: one `[N, V_shard,
D]` `NamedArray` with axes `("sc_shard", "sc_row", "sc_embedding")`, token
`i` at shard `(i % N + rotation) % N`, row `i // N + row_offset`
(`layout.compute_physical_row_ids` owns the formula). Penzai's
`EmbeddingTable` keeps `{vocabulary: V, **embedding_axes}` instead.
`vocabulary_view` gives that view, so that a converted lookup can be read
(and compared) as the `EmbeddingLookup` it replaced::

  lookup = pzsc.SparseCoreLookup.from_lookup(dense, mesh=mesh, optimizer=opt)
  pzsc.viz.vocabulary_view(lookup)  # == dense.table.embeddings.value
  pzsc.viz.vocabulary_view(lookup, rows=slice(0, 16))  # {vocabulary: 16, ...}

Example: vocabulary 1000, embedding `{"embedding": 16}`, N = 8 shards of 128
rows, rotation 0. Token 13 lives at shard 5, row 1; `rows=[0, 7, 8, 999]`
reads shards 0, 7, 0, 7 at rows 0, 0, 1, 124 and returns `{vocabulary: 4,
embedding: 16}`.

The rows are gathered on the devices in one jitted call: each device picks
the requested rows it holds and the results are summed over the mesh, so
only the requested rows move (a 2^24-row table can be sampled without
gathering it). The result is a replicated device array.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_sparsecore.core import layout

__all__ = ["vocabulary_view"]


@functools.partial(jax.jit, static_argnums=2)
def _gather(table: jax.Array, ids: jax.Array, config: Any) -> jax.Array:
  """Rows `ids` (in range) of a lookup's `[N, V_shard, D]` table, `[K, D']`
  with `D'` the product of the embedding axes' sizes."""
  stack = config.plan.stacks[0]
  setting = stack.tables[0].setting_in_stack
  n = config.topology.num_shards
  flat = layout.compute_physical_row_ids(
    n,
    stack.spec.stack_vocab_size,
    setting.shard_rotation,
    setting.row_offset_in_shard,
    ids,
  )
  # Indexing the shard and row axes directly (not a reshape to `[N *
  # V_shard, D]`) lets XLA gather locally and all-reduce the K rows.
  shard, row = jnp.divmod(flat, stack.spec.stack_vocab_size // n)
  return table[shard, row, : config.dim]


def _row_ids(config: Any, rows: Any) -> np.ndarray:
  """`rows` as checked int32 token ids.

  Raises:
    ValueError: Naming the lookup's label, for rows that are not a slice or
      a 1-D integer array, or ids outside `[0, vocab_size)`.
  """
  vocab = config.vocab_size
  if rows is None:
    rows = slice(None)
  if isinstance(rows, slice):
    return np.arange(*rows.indices(vocab), dtype=np.int32)
  ids = np.asarray(rows)
  if ids.ndim != 1 or not (
    ids.size == 0 or np.issubdtype(ids.dtype, np.integer)
  ):
    raise ValueError(
      f"vocabulary_view of {config.label!r}: rows must be None, a slice or a "
      f"1-D integer array of token ids, got {ids.dtype} of shape {ids.shape}"
    )
  bad = (ids < 0) | (ids >= vocab)
  if bad.any():
    where = int(np.argmax(bad))
    raise ValueError(
      f"vocabulary_view of {config.label!r}: token id {int(ids[where])} at "
      f"position {where} of rows is outside [0, {vocab})"
    )
  return ids.astype(np.int32)


def vocabulary_view(lookup: Any, rows: Any = None) -> pz.nx.NamedArray:
  """A `SparseCoreLookup`'s table in vocabulary order, as `EmbeddingTable`'s.

  Args:
    lookup: A `SparseCoreLookup` with its table bound (a `pz.Parameter`).
    rows: None for the whole vocabulary; a slice of it; or a 1-D integer
      array of token ids (in any order, repeats allowed). Only these rows
      are gathered.

  Returns:
    A `NamedArray` with axes `{vocabulary_axis: K, **embedding_axes}`, `K`
    the number of rows: for a lookup made by `from_lookup`, with `rows=None`,
    the values of the `EmbeddingLookup`'s table.

  Raises:
    ValueError: If `lookup` is not a `SparseCoreLookup` or its table is
      unbound, or (naming its label) for bad `rows` or ids outside
      `[0, vocab_size)`.
  """
  from pz_sparsecore.nn.lookup import SparseCoreLookup
  from pz_sparsecore.nn.tables import positional_table

  if not isinstance(lookup, SparseCoreLookup):
    raise ValueError(
      "vocabulary_view takes a SparseCoreLookup, got "
      f"{type(lookup).__name__}; for a SparseCoreEmbed's tables use "
      "pzsc.logical_tables(embed)"
    )
  config = lookup.config
  var = lookup.tables[config.feature]
  if isinstance(var, pz.ParameterSlot):
    raise ValueError(
      f"vocabulary_view of {config.label!r}: the table is an unbound "
      "ParameterSlot; build the layer with an init_base_rng or restore a "
      "checkpoint first"
    )
  ids = _row_ids(config, rows)
  table = positional_table(config, var.value)
  values = _gather(table, jnp.asarray(ids), config)
  names = [name for name, _ in config.embedding_axes]
  sizes = [size for _, size in config.embedding_axes]
  values = values.reshape(ids.size, *sizes)
  return pz.nx.wrap(values).tag(config.vocabulary_axis, *names)
