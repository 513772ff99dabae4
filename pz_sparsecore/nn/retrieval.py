"""`top_k`: exact top-k retrieval over a layer's table, on its devices.

A two-tower or rating model scores queries against an item table held by a
`SparseCoreEmbed` (one of its tables, by name) or a `SparseCoreLookup`::

  scores, ids = pzsc.top_k(user_vectors, layer, 10, table="items",
                           exclude=seen_items)

Each device scores the queries against its own shards of the table only
and keeps its best candidates; one gather of `Q * k` candidates per device
and a merge give the result (`device.retrieval`). The table is never
gathered: the cost is that of one read of the table, spread over the
devices, with no host copy (the NumPy alternative over
`pzsc.logical_tables` copies every row to the host first).

The result is exact, and ordered by score, then by smaller id: rows with
equal scores come smallest id first, and a result equals a brute-force
search over the logical table (`logical_tables(layer)[table]`) id for id.
Scores are float32 (a bfloat16 or float16 table's rows are widened).
Padding rows of the shards and rows of the other tables of the stack are
never returned. When fewer than `k` rows remain (k above the vocabulary, or
most rows excluded), the last slots hold score -inf and id -1; a row
scoring NaN or -inf is never returned either (its slot is such a one).

Example: a table of 5 rows `[[1, 0], [0, 1], [1, 0], [2, 2], [0, 0]]`,
query `[1, 0]`, k = 4, excluding id 3: scores 1, 0, 1, 2, 0 give ids
`[0, 2, 1, 4]` with scores `[1, 1, 0, 0]` (ties to the smaller id); with
k = 6, slots 5 and 6 hold (-inf, -1).

Hashed tables (`TableSpec(ids="hashed")`) are refused: their ids are raw
int64 values held in the layer's map, whose order the devices' merge does
not follow; `pzsc.hashed_rows(layer)[table]` gives their ids and rows on
the host.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_sparsecore.device import retrieval
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.tables import positional_table

__all__ = ["top_k"]

EXCLUDE_ALIGNMENT = 8
"""A ragged exclusion list is padded to a multiple of this many ids, so
that calls with lists of nearby lengths share one compiled program."""


def _table_name(source: Any, table: str | None) -> str:
  """The table of `source` to search, checked."""
  if not isinstance(source, SparseCoreEmbed):
    raise ValueError(
      "top_k searches the table of a pzsc.SparseCoreEmbed or "
      f"pzsc.SparseCoreLookup, got {type(source).__name__}"
    )
  names = list(source.config.plan.tables)
  if table is None:
    if len(names) != 1:
      raise ValueError(
        f"the layer has {len(names)} tables {names}; name one with table="
      )
    return names[0]
  if table not in names:
    raise ValueError(f"unknown table {table!r}; the layer has {names}")
  return table


def _check_k(k: Any) -> int:
  if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 1:
    raise ValueError(f"k must be a positive int, got {k!r}")
  return int(k)


def _embedding_axes(source: SparseCoreEmbed) -> tuple[str, ...]:
  """The names of the embedding axes a named query holds."""
  axes = getattr(source.config, "embedding_axes", None)
  if axes is not None:  # A `SparseCoreLookup`'s.
    return tuple(name for name, _ in axes)
  return (source.config.embedding_axis,)


def _query_matrix(source: SparseCoreEmbed, name: str, queries: Any):
  """`queries` as a `[Q, dim]` array (a `NamedArray` unwrapped)."""
  dim = source.config.plan.tables[name].embedding_dim
  if isinstance(queries, pz.nx.NamedArrayBase):
    embedding = _embedding_axes(source)
    shape = dict(queries.named_shape)
    others = [a for a in shape if a not in embedding]
    if (
      queries.positional_shape
      or len(others) != 1
      or not set(embedding) <= set(shape)
    ):
      raise ValueError(
        f"named queries must have one query axis and the embedding axes "
        f"{embedding}, and no positional axes; got named axes {shape} and "
        f"positional shape {queries.positional_shape}"
      )
    queries = queries.unwrap(others[0], *embedding)
    queries = queries.reshape(queries.shape[0], -1)
  if not hasattr(queries, "shape"):
    queries = np.asarray(queries)
  if len(queries.shape) != 2 or queries.shape[0] < 1 or queries.shape[1] != dim:
    raise ValueError(
      f"queries must be [Q, {dim}] (Q >= 1; table {name!r} has "
      f"embedding_dim {dim}), got shape {tuple(queries.shape)}"
    )
  if not jnp.issubdtype(queries.dtype, jnp.floating):
    raise ValueError(f"queries must be floats, got {queries.dtype}")
  return queries


def _check_ids(name: str, vocab: int, ids: np.ndarray, low: int) -> None:
  """Raises unless every exclusion id of `[Q, E]` `ids` is in
  `[low, vocab)`, naming the first query with one that is not."""
  bad = (ids < low) | (ids >= vocab)
  if bad.any():
    q, e = np.argwhere(bad)[0]
    raise ValueError(
      f"exclude[{q}] of table {name!r} holds id {int(ids[q, e])}, outside "
      f"[{low}, {vocab})"
    )


def _ragged_exclude(name: str, vocab: int, exclude: list, num_queries: int):
  """A list of per-query id lists as a padded `[Q, E]` int32 array."""
  if len(exclude) != num_queries:
    raise ValueError(
      f"exclude has {len(exclude)} lists for {num_queries} queries"
    )
  lists = [np.asarray(ids).reshape(-1) for ids in exclude]
  for i, ids in enumerate(lists):
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"exclude[{i}] must hold integer ids, got {ids.dtype}")
  width = max(len(ids) for ids in lists)
  width = -(-width // EXCLUDE_ALIGNMENT) * EXCLUDE_ALIGNMENT
  # Padded with 0 to check (a -1 in a list is no id), then with NO_ID.
  out = np.zeros((num_queries, width), np.int64)
  for i, ids in enumerate(lists):
    out[i, : len(ids)] = ids
  _check_ids(name, vocab, out, 0)
  for i, ids in enumerate(lists):
    out[i, len(ids) :] = retrieval.NO_ID
  return out.astype(np.int32)


def _exclude_matrix(name: str, vocab: int, exclude: Any, num_queries: int):
  """`exclude` as a `[Q, E]` int32 array padded with `NO_ID`."""
  if exclude is None:
    return np.zeros((num_queries, 0), np.int32)
  if isinstance(exclude, list | tuple):
    return _ragged_exclude(name, vocab, exclude, num_queries)
  if not hasattr(exclude, "shape"):
    raise ValueError(
      "exclude must be None, a list of per-query id lists, or a [Q, E] "
      f"integer array padded with -1; got {type(exclude).__name__}"
    )
  if len(exclude.shape) != 2 or exclude.shape[0] != num_queries:
    raise ValueError(
      f"exclude must be [{num_queries}, E] (one row per query), got shape "
      f"{tuple(exclude.shape)}"
    )
  if not jnp.issubdtype(exclude.dtype, jnp.integer):
    raise ValueError(f"exclude must hold integer ids, got {exclude.dtype}")
  if not isinstance(exclude, jax.core.Tracer):
    _check_ids(name, vocab, np.asarray(exclude), retrieval.NO_ID)
  return jnp.asarray(exclude, jnp.int32)


def top_k(
  queries: Any,
  source: SparseCoreEmbed,
  k: int,
  *,
  table: str | None = None,
  exclude: Any = None,
  metric: str = "dot",
) -> tuple[jax.Array, jax.Array]:
  """The `k` best rows of a table for each query, exactly, on the devices.

  Works eagerly and under `jax.jit` (`k`, `table` and `metric` static),
  e.g. over `pz.unbind_variables(layer, freeze=True)`'s variables or in
  `pzsc.variable_jit`. Under `jit`, ids in `exclude` are not checked: ids
  outside the table exclude nothing.

  Args:
    queries: `[Q, dim]` floats (a JAX or NumPy array), `dim` the table's
      `embedding_dim`; or a `pz.nx.NamedArray` with one query axis (any
      name) and the layer's embedding axis (a `SparseCoreLookup`'s
      embedding axes, flattened in their order), no positional axes.
    source: A `SparseCoreEmbed` or a `SparseCoreLookup` (variables bound,
      mutable or frozen).
    k: Results per query (may exceed the table's rows).
    table: The table's name; optional if the layer has one table.
    exclude: None, or ids no query may get: a list of `Q` id lists (any
      lengths, duplicates allowed, ids in `[0, vocabulary_size)`), or a
      `[Q, E]` integer array padded with -1.
    metric: `"dot"` (`q . r`) or `"cosine"` (`q . r / (|q| |r|)`; a zero
      row or query scores 0).

  Returns:
    `(scores, ids)`: float32 and int32 `[Q, k]` JAX arrays, replicated over
    the layer's mesh, best first; equal scores in increasing id order.
    Slots without a row (fewer than `k` rows outside the exclusions) hold
    score -inf and id -1.

  Raises:
    ValueError: On a layer that is not a SparseCore layer, an unknown or
      unnamed table, a hashed table, `k < 1`, an unknown metric, queries of
      the wrong shape, or exclusion ids outside the table (when concrete).
  """
  name = _table_name(source, table)
  plan = source.config.plan
  spec = plan.tables[name]
  if spec.is_hashed:
    raise ValueError(
      f"table {name!r} is hashed: top_k searches tables of ids "
      "[0, vocabulary_size) only; pzsc.hashed_rows(layer)[" + repr(name) + "]"
      " gives a hashed table's ids and rows on the host"
    )
  k = _check_k(k)
  if metric not in retrieval.METRICS:
    raise ValueError(
      f"unknown metric {metric!r}; expected one of {retrieval.METRICS}"
    )
  queries = _query_matrix(source, name, queries)
  exclude = _exclude_matrix(
    name, spec.vocabulary_size, exclude, queries.shape[0]
  )
  stack = plan.stack_of_table[name].name
  return retrieval.top_k(
    positional_table(source.config, source.tables[stack].value),
    queries,
    exclude,
    rows=retrieval.TableRows.of(spec, plan.num_shards),
    topology=source.config.topology,
    stack=stack,
    k=k,
    metric=metric,
  )
