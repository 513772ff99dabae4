"""Stacked tables in a checkpoint: their layout, and moving rows on device.

A checkpoint stores each stack's table and slots exactly as the devices hold
them: `[N, V_shard, D]`, MOD-sharded (see `layout.py`). Beside them the
manifest records the stack's `StackLayout`: N, V_shard, D and, per member
table, its vocabulary, width, padded vocabulary, first row in every shard and
shard rotation. Restoring onto the same layout reads the arrays straight into
their shards. Restoring onto another one (other device or SparseCore count,
other stacking) reads the stored arrays sharded over the new mesh and moves
the rows with one jitted program per stack (`relayout`): slice, roll,
reshape and transpose, which XLA partitions into collective permutes and
all-to-alls. Nothing is gathered on a host, and a device's temporary memory
stays a small multiple of its own share of the table (measured on 8 CPU
devices with 100k x 64 tables: at most twice its share, and four times for a
stack of two tables restored onto more devices than it had shards).

Example: table `ta` (vocab 40, dim 8) saved on N = 4 shards at row offset 24
with rotation 1, restored alone onto N = 2. Stored, its logical row 13 sits
on shard `(13 % 4 + 1) % 4 = 2` at row `24 + 13 // 4 = 27`. `relayout` cuts
rows `[24, 24 + 64 / 4)` of every stored shard and rolls the shards back by
one, so that row `i` sits at `a[i % 4, i // 4]` (13 at `a[1, 3]`). With
`k = 4 / 2`, `a.reshape(2, 2, 16, 8)` holds row `4r + 2q + s'` at
`[q, s', r]`; moved to `[s', r, q]` and reshaped to `[2, 32, 8]`, it holds
row `i` at `[i % 2, i // 2]`. The first `48 / 2` rows of each shard are the
new padded vocabulary (48): row 13 lands on shard 1, row 6.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import round_up
from pz_sparsecore.device import topology as topology_lib


@dataclasses.dataclass(frozen=True)
class TablePlacement:
  """Where one table's rows live in its stack.

  Attributes:
    name: The table's name.
    vocab: Logical rows.
    dim: Logical width.
    padded_vocab: Rows after padding (a multiple of `8 * N`).
    row_offset_in_shard: First row of the table in every shard.
    shard_rotation: Shard of logical row 0.
  """

  name: str
  vocab: int
  dim: int
  padded_vocab: int
  row_offset_in_shard: int
  shard_rotation: int


@dataclasses.dataclass(frozen=True)
class StackLayout:
  """The physical layout of one stacked table (hashable, jit-static).

  Attributes:
    num_shards: N, shards of the stack.
    rows_per_shard: V_shard.
    dim: D, the stack's padded width.
    tables: The member tables in row order.
  """

  num_shards: int
  rows_per_shard: int
  dim: int
  tables: tuple[TablePlacement, ...]

  @property
  def shape(self) -> tuple[int, int, int]:
    return (self.num_shards, self.rows_per_shard, self.dim)

  def with_width(self, width: int) -> StackLayout:
    """The layout of a slot `width` values per row (a row-wise slot: 1),
    each member's columns `width` too: the rows move as the table's."""
    if width == self.dim:
      return self
    return dataclasses.replace(
      self,
      dim=width,
      tables=tuple(dataclasses.replace(t, dim=width) for t in self.tables),
    )

  def to_json(self) -> dict[str, Any]:
    """The layout as the manifest stores it."""
    out = dataclasses.asdict(self)
    out["tables"] = [dataclasses.asdict(t) for t in self.tables]
    return out

  @classmethod
  def from_json(cls, entry: dict[str, Any]) -> StackLayout:
    """The inverse of `to_json`."""
    return cls(
      num_shards=int(entry["num_shards"]),
      rows_per_shard=int(entry["rows_per_shard"]),
      dim=int(entry["dim"]),
      tables=tuple(TablePlacement(**t) for t in entry["tables"]),
    )


def stack_layout(plan: plan_lib.Plan, stack: plan_lib.StackPlan) -> StackLayout:
  """The layout of `stack` as the plan lays it out.

  Args:
    plan: The layer's plan.
    stack: One of its stacks.

  Returns:
    The stack's layout.
  """
  tables = []
  for table in stack.tables:
    setting = table.setting_in_stack
    tables.append(
      TablePlacement(
        name=table.name,
        vocab=table.vocabulary_size,
        dim=table.embedding_dim,
        padded_vocab=setting.padded_vocab_size,
        row_offset_in_shard=setting.row_offset_in_shard,
        shard_rotation=setting.shard_rotation,
      )
    )
  return StackLayout(
    num_shards=plan.num_shards,
    rows_per_shard=stack.rows_per_shard,
    dim=stack.dim,
    tables=tuple(tables),
  )


def read_sharding(
  stored: StackLayout, topology: topology_lib.Topology
) -> tuple[NamedSharding, tuple[int, int, int]]:
  """How to read a stored stack onto `topology`'s mesh for `relayout`.

  The stored shards are split over the sharding axis when their count
  divides over it; otherwise (fewer stored shards than devices) the rows
  are split instead, padded up to a multiple of the device count (the
  padding reads as zeros and `relayout` never looks at it).

  Args:
    stored: The layout in the checkpoint.
    topology: The model's topology.

  Returns:
    The sharding and the global shape to read with.
  """
  n, rows, dim = stored.shape
  g = topology.num_devices
  if n % g == 0:
    return NamedSharding(topology.mesh, P(topology.axis)), stored.shape
  spec = P(None, topology.axis)
  return NamedSharding(topology.mesh, spec), (n, round_up(rows, g), dim)


@dataclasses.dataclass(frozen=True)
class Source:
  """Where `relayout` finds one member table of the new stack.

  Attributes:
    array: Index of the stored array among `relayout`'s inputs.
    num_shards: N of the stored stack.
    placement: The table's placement in the stored stack.
  """

  array: int
  num_shards: int
  placement: TablePlacement


def _table(
  stored: jax.Array,
  source: Source,
  t: TablePlacement,
  target: StackLayout,
  sharding: NamedSharding,
) -> jax.Array:
  """One table of the new stack: `[N_new, padded_vocab / N_new, D_new]`.

  With the rotations undone, logical row `i` sits at `a[i % No, i // No]`
  and goes to `b[i % Nn, i // Nn]`. Both `No` and `Nn` are powers of two,
  so one divides the other by `k` and the move is one reshape, transpose
  and reshape whose sharded axis stays major: XLA partitions it into
  collective permutes and all-to-alls, never a gather of the table.
  """
  p, no, nn = source.placement, source.num_shards, target.num_shards
  rows_in, rows_out = p.padded_vocab // no, t.padded_vocab // nn
  start = p.row_offset_in_shard
  a = stored[:, start : start + rows_in, : t.dim]
  a = jnp.roll(a, -p.shard_rotation, axis=0)  # a[s, r] = row r * No + s
  if no >= nn:
    # Row r * No + q * Nn + s' = (r * k + q) * Nn + s'.
    k = no // nn
    b = a.reshape(k, nn, rows_in, t.dim).transpose(1, 2, 0, 3)
    b = jax.lax.with_sharding_constraint(
      b, NamedSharding(sharding.mesh, P(sharding.spec[0]))
    )
    b = b.reshape(nn, rows_in * k, t.dim)[:, :rows_out]
  else:
    # Row (j * k + q) * No + s = j * Nn + q * No + s.
    k = nn // no
    a = jnp.pad(a, ((0, 0), (0, rows_out * k - rows_in), (0, 0)))
    b = a.reshape(no, rows_out, k, t.dim).transpose(2, 0, 1, 3)
    b = b.reshape(nn, rows_out, t.dim)
    if no % sharding.mesh.shape[sharding.spec[0]]:
      # Read split by rows (`read_sharding`): keep them split up to here,
      # so that XLA moves them to the shard axis with one all-to-all.
      b = jax.lax.with_sharding_constraint(
        b, NamedSharding(sharding.mesh, P(None, sharding.spec[0]))
      )
  b = jax.lax.with_sharding_constraint(b, sharding)
  # b[s, r] = row r * Nn + s; rows past the vocabulary are padding.
  ids = jax.lax.broadcasted_iota(jnp.int32, b.shape[:2], 1) * nn
  ids = ids + jax.lax.broadcasted_iota(jnp.int32, b.shape[:2], 0)
  b = jnp.where((ids < t.vocab)[:, :, None], b, 0)
  b = jnp.pad(b, ((0, 0), (0, 0), (0, target.dim - t.dim)))
  return jnp.roll(b, t.shard_rotation, axis=0)


@jax.jit(static_argnames=("sources", "target", "sharding"))
def _relayout(
  stored: tuple[jax.Array, ...],
  sources: tuple[Source, ...],
  target: StackLayout,
  sharding: NamedSharding,
) -> jax.Array:
  regions = [
    _table(stored[s.array], s, t, target, sharding)
    for s, t in zip(sources, target.tables, strict=True)
  ]
  out = jnp.concatenate(regions, axis=1)
  return jax.lax.with_sharding_constraint(out, sharding)


def relayout(
  stored: Sequence[jax.Array],
  sources: Sequence[Source],
  target: StackLayout,
  sharding: NamedSharding,
) -> jax.Array:
  """Builds a stack in `target`'s layout from stored stacks, on device.

  Args:
    stored: The stored arrays the new stack's tables come from, read with
      `read_sharding`.
    sources: Per member table of `target` (in its row order), where it is.
    target: The new stack's layout.
    sharding: The new stack's sharding (`topology.table_sharding(stack)`).

  Returns:
    The `[N, V_shard, D]` stack; padding rows and columns are zero.
  """
  return _relayout(tuple(stored), tuple(sources), target, sharding)
