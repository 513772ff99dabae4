"""Exact top-k retrieval over one table of a row-sharded stack, per device.

A stack is `[N, V_shard, D]` over G devices (S = N / G shards each, see
`core.layout`); a logical table holds the rows `[o, o + R)` of every shard
(`o = row_offset_in_shard`, `R = padded_vocab_size / N`) and its row `j` of
shard `g` is logical id::

  id = j * N + (g - rotation) % N                      (j = row - o)

the inverse of `layout.compute_physical_row_ids`. Ids at or above the
vocabulary size are padding; inside one shard the ids of a table grow with
the row, so shard `g` holds the real ids in its first
`ceil((vocab - c) / N)` rows of the table, `c = (g - rotation) % N`.

Per device, inside `shard_map` over the tables' shard axis, `top_k` scores
the queries against the table's rows of its own shards only (rows of the
other tables of the stack are never read, padding rows are masked to
-inf), in blocks of rows whose `[Q, rows]` scores stay under
`BLOCK_BYTES`. Each block keeps its best `k + E` candidates (E: the widest
exclusion list), the device merges its blocks' and drops the excluded
ids, keeping `k`, and one `all_gather` over the shard axis brings every
device's `k` to every device for the last merge. The table never leaves
its devices; a device sends `Q * k` scores and ids. Memory per device:
one block's scores and `Q * (k + E)` candidates per block, so very many
queries are best searched in batches (a block then holds more rows).

Order: by score, then by smaller id (the total order every merge sorts
by). Inside a block, `lax.top_k` breaks ties by position, which is id
order there (one shard, one table). A block of `B` rows first takes the
maximum of each run of `CHUNK` rows, keeps the best `k + E` runs (ties to
the earlier run), and picks its candidates among their rows: exact, since
every row of the block's best `k + E` lies in one of those runs, and
`B / CHUNK` times less work for `top_k`.

Scores are float32 (16-bit rows are widened); NaN scores count as -inf, and
-0.0 as 0.0. A result slot whose score is -inf (fewer than `k` real rows
outside the exclusions, or rows scoring -inf) holds id `NO_ID`.

Example: N = 4, a table of vocab 10 at rows `[24, 27)` of each shard with
rotation 1: shard 2 holds ids `(2 - 1) % 4 = 1`, 5, 9 at rows 24, 25, 26;
shard 0 holds ids 3, 7 at rows 24, 25 and padding (id 11) at row 26.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import layout
from pz_sparsecore.core.specs import TableSpec
from pz_sparsecore.device.topology import Topology

METRICS = ("dot", "cosine")
"""`dot`: `q . r`; `cosine`: `q . r / (|q| |r|)`, 0 where a norm is 0."""

NO_ID = -1
"""The id of a result slot that holds no row (its score is -inf)."""

_LAST_ID = np.iinfo(np.int32).max
"""A masked candidate's id while merging: after every real id."""

CHUNK = 32
"""Rows whose maximum a block's first selection ranks."""

BLOCK_BYTES = 64 << 20
"""The default most bytes of float32 scores (and of widened rows) one block
makes. Per block, `top_k` runs on one core while the matmul takes them
all: on 2 cores, 1,024 queries over 1M x 64 rows took 7.7 s in blocks of
4 MiB of scores, 1.8 s of 32 MiB and 1.6 s of 64 MiB (128 MiB: no
faster)."""


@dataclasses.dataclass(frozen=True)
class TableRows:
  """Where one logical table's rows lie in its stack (jit-static).

  Attributes:
    num_shards: N.
    row_offset: The table's first row in every shard.
    rows: The table's rows in every shard, `R = padded_vocab_size / N`.
    rotation: The table's shard rotation.
    vocabulary_size: Its real rows (ids `[0, vocabulary_size)`).
    dim: Its own width (the stack's further columns are padding).
  """

  num_shards: int
  row_offset: int
  rows: int
  rotation: int
  vocabulary_size: int
  dim: int

  @classmethod
  def of(cls, table: TableSpec, num_shards: int) -> TableRows:
    """The rows of a prepared table on `num_shards` shards."""
    setting = table.setting_in_stack
    return cls(
      num_shards=num_shards,
      row_offset=setting.row_offset_in_shard,
      rows=setting.padded_vocab_size // num_shards,
      rotation=setting.shard_rotation,
      vocabulary_size=table.vocabulary_size,
      dim=table.embedding_dim,
    )

  def first_id(self, shard):
    """The id at the table's first row of `shard` (ints or arrays)."""
    return (shard - self.rotation) % self.num_shards

  def logical_ids(self, shard, row):
    """Logical ids of rows `row` (of the shard, not of the table) of
    `shard`; at least `vocabulary_size` for padding rows. The inverse of
    `layout.compute_physical_row_ids`."""
    return layout.logical_row_ids(
      self.num_shards, self.rotation, self.row_offset, shard, row
    )

  def real_rows(self, shard):
    """How many of the table's rows of `shard` hold real ids (a prefix)."""
    n = self.num_shards
    count = (self.vocabulary_size - self.first_id(shard) + n - 1) // n
    return jnp.clip(count, 0, self.rows)


def block_rows(
  rows: TableRows, num_queries: int, widened: bool, block_bytes: int
) -> int:
  """Rows of one block: the table's rows of a shard if their scores fit
  in `block_bytes`, else a multiple of `CHUNK` whose scores (and, if the
  rows are copied to float32 or narrowed to the table's width, whose
  copy) do."""
  width = num_queries + (rows.dim if widened else 0)
  fit = block_bytes // (4 * width)
  if fit >= rows.rows:
    return rows.rows
  return min(rows.rows, max(CHUNK, fit // CHUNK * CHUNK))


def _clean(scores: jax.Array, valid: jax.Array) -> jax.Array:
  """Scores with masked rows and NaN at -inf and -0.0 at 0.0 (one total
  order for `top_k`, the merges' sort and the reference)."""
  scores = jnp.where(scores == 0, jnp.zeros_like(scores), scores)
  return jnp.where(valid & (scores == scores), scores, -jnp.inf)


def _scores(queries, query_scale, rows, metric):
  """`[Q, B]` float32 scores of `[B, dim]` rows."""
  rows = rows.astype(jnp.float32)
  # `q @ rows.T`, not a `dot_general` contracting both minor axes: XLA's
  # CPU backend fuses this form into a loop over the rows on every core
  # for a few queries (measured 9 ms against 14 for 1M x 64, one query).
  scores = jnp.matmul(
    queries,
    rows.T,
    precision=jax.lax.Precision.HIGHEST,
    preferred_element_type=jnp.float32,
  )
  if metric == "cosine":
    scores = scores * query_scale[:, None] * _inverse_norms(rows)[None, :]
  return scores


def _inverse_norms(x: jax.Array) -> jax.Array:
  """`1 / |x|` per row of `x`, 0 for a zero row."""
  norms = jnp.sqrt(jnp.sum(x * x, axis=-1))
  return jnp.where(norms > 0, 1 / jnp.where(norms > 0, norms, 1), 0)


def _block_top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The best `k` of `[Q, B]` scores and their positions, ties to the
  smaller position (the maxima of `CHUNK`-row runs first)."""
  q, b = scores.shape
  chunk = CHUNK if b % CHUNK == 0 else 8
  runs = b // chunk
  if b % chunk or 4 * k > runs:  # Few runs: the plain selection will do.
    return jax.lax.top_k(scores, k)
  maxima = jnp.max(scores.reshape(q, runs, chunk), axis=-1)
  best = jnp.sort(jax.lax.top_k(maxima, k)[1], axis=-1)
  positions = (best[:, :, None] * chunk + jnp.arange(chunk)).reshape(q, -1)
  values, picked = jax.lax.top_k(
    jnp.take_along_axis(scores, positions, axis=1), k
  )
  return values, jnp.take_along_axis(positions, picked, axis=1)


def _best(scores, ids, count: int):
  """The first `count` of `[Q, M]` candidates by score, then smaller id."""
  neg, ids = jax.lax.sort((-scores, ids), dimension=1, num_keys=2)
  return -neg[:, :count], ids[:, :count]


def _shard_candidates(table, index, shard, queries, query_scale, static):
  """`[Q, blocks * kb]` candidates (scores, ids) of the table's rows of one
  local shard (`table[index]`, global shard `shard`)."""
  rows, keep, metric, block = static
  n_blocks = -(-rows.rows // block)
  kb = min(keep, block)
  real = rows.real_rows(shard)

  def one(b):
    start = jnp.minimum(b * block, rows.rows - block)
    x = jax.lax.dynamic_slice(
      table, (index, rows.row_offset + start, 0), (1, block, rows.dim)
    )[0]
    j = start + jnp.arange(block)
    scores = _clean(
      _scores(queries, query_scale, x, metric),
      ((j >= b * block) & (j < real))[None, :],
    )
    values, positions = _block_top_k(scores, kb)
    ids = rows.logical_ids(shard, rows.row_offset + start + positions)
    return values, jnp.where(values == -jnp.inf, _LAST_ID, ids)

  if n_blocks == 1:
    return one(0)
  values, ids = jax.lax.map(one, jnp.arange(n_blocks))
  q = queries.shape[0]
  return (
    values.transpose(1, 0, 2).reshape(q, -1),
    ids.transpose(1, 0, 2).reshape(q, -1),
  )


def _drop(scores, ids, exclude):
  """Candidates whose id a query excludes, masked."""
  hit = jnp.any(ids[:, :, None] == exclude[:, None, :], axis=-1)
  return jnp.where(hit, -jnp.inf, scores), jnp.where(hit, _LAST_ID, ids)


def _local_top_k(
  table, queries, exclude, *, rows, topology, stack, k, metric, block_bytes
):
  """Per device: the best `k` of its shards (scores, ids), all gathered."""
  s = topology.num_sc_per_device
  device = jax.lax.axis_index(topology.axis)
  base = device * s if topology.is_replicated(stack) else 0
  queries = queries.astype(jnp.float32)
  query_scale = None
  if metric == "cosine":
    query_scale = _inverse_norms(queries)
  keep = k + exclude.shape[1]
  widened = table.dtype != jnp.float32 or rows.dim != table.shape[-1]
  block = block_rows(rows, queries.shape[0], widened, block_bytes)
  static = (rows, keep, metric, block)
  parts = [
    _shard_candidates(
      table, base + i, device * s + i, queries, query_scale, static
    )
    for i in range(s)
  ]
  scores = jnp.concatenate([p[0] for p in parts], axis=1)
  ids = jnp.concatenate([p[1] for p in parts], axis=1)
  scores, ids = _best(scores, ids, min(keep, scores.shape[1]))
  if exclude.shape[1]:
    scores, ids = _drop(scores, ids, exclude)
    scores, ids = _best(scores, ids, min(k, scores.shape[1]))
  scores = jax.lax.all_gather(scores, topology.axis, axis=1, tiled=True)
  ids = jax.lax.all_gather(ids, topology.axis, axis=1, tiled=True)
  return _best(scores, ids, min(k, scores.shape[1]))


def _finish(scores, ids, k: int):
  """`[Q, k]` results: missing slots and -inf scores as (-inf, `NO_ID`)."""
  missing = k - scores.shape[1]
  if missing > 0:
    scores = jnp.pad(scores, ((0, 0), (0, missing)), constant_values=-jnp.inf)
    ids = jnp.pad(ids, ((0, 0), (0, missing)), constant_values=_LAST_ID)
  empty = (scores == -jnp.inf) | (ids == _LAST_ID)
  return (
    jnp.where(empty, -jnp.inf, scores),
    jnp.where(empty, NO_ID, ids).astype(jnp.int32),
  )


@functools.partial(
  jax.jit,
  static_argnames=("rows", "topology", "stack", "k", "metric", "block_bytes"),
)
def top_k(
  table: jax.Array,
  queries: jax.Array,
  exclude: jax.Array,
  *,
  rows: TableRows,
  topology: Topology,
  stack: str,
  k: int,
  metric: str,
  block_bytes: int = BLOCK_BYTES,
) -> tuple[jax.Array, jax.Array]:
  """The best `k` rows of one table for each query, exactly.

  Args:
    table: The stack, `[N, V_shard, D_stack]`, as the topology holds it.
    queries: `[Q, dim]` queries (any float dtype; scored in float32).
    exclude: `[Q, E]` int32 ids no query `q` may get from `exclude[q]`
      (`NO_ID` pads; E may be 0).
    rows: Where the table lies in the stack.
    topology: The stack's topology.
    stack: The stack's name (whether it is replicated).
    k: Results per query.
    metric: One of `METRICS`.
    block_bytes: The most bytes of scores (and widened rows) of a block.

  Returns:
    `(scores, ids)`: `[Q, k]` float32 and int32, replicated over the mesh,
    best first (ties: smaller id first); slots past the real rows hold
    (-inf, `NO_ID`).
  """
  body = functools.partial(
    _local_top_k,
    rows=rows,
    topology=topology,
    stack=stack,
    k=k,
    metric=metric,
    block_bytes=block_bytes,
  )
  scores, ids = jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(topology.table_spec(stack), P(), P()),
    out_specs=(P(), P()),
    check_vma=False,
  )(table, queries, exclude)
  return _finish(scores, ids, k)
