"""Taking an update back: its rows read first, checked, written back.

`apply_gradients(..., guard=True)` reads, per stack and device, the local
rows the batch references and their values and slots' values before the
in-place update (`referenced_rows`, `rows_of`), and whether every updated
value is finite; `undo_unless` writes the old values back unless told to
keep the update. All of it is O(batch): the table is never copied. With
minibatches, each minibatch's guard fills row `m` of `[MAX_MINIBATCHES,
...]` arrays (`stacked_guards`, `put_guard`), flattened at the end
(`flat_guard`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES
from pz_sparsecore.core.plan import Plan
from pz_sparsecore.device import topology as topology_lib
from pz_sparsecore.device.kernels import contract, reference
from pz_sparsecore.device.topology import Topology


def zero_depending_on(values) -> jax.Array:
  """A float32 zero that XLA cannot compute before `values`.

  The rows read before the in-place update must be read before it
  overwrites them. A data dependency of the update's operands on the reads
  orders them (fusion does not keep an optimization barrier's order, and
  without an order XLA copies the whole table to keep the old rows alive).
  Non-finite values add 0 too.
  """
  total = sum(jnp.sum(x) for x in jax.tree.leaves(values))
  return jnp.where(jnp.abs(total) < 1.0, total, 0.0) * 0.0


def referenced_rows(buffers, table, shape: dict[str, int]) -> jax.Array:
  """Per entry, its row of the local `[S * V_shard]` rows (or past them)."""
  buffer_shape = contract.check_buffers(
    *buffers, table, partition_begin=0, **shape
  )
  _, rows, _ = reference.decode_entries(*buffers[:3], buffer_shape)
  return rows


def _row_index(table: jax.Array, rows: jax.Array) -> Any:
  """Index of local rows in a `[S, V_shard, D]` or `[S * V_shard, D]`
  table."""
  if table.ndim == 2:
    return rows
  v = table.shape[1]
  return rows // v, rows % v


def rows_of(table: jax.Array, rows: jax.Array) -> jax.Array:
  """`[E, D]` rows of the local table (zeros past its rows)."""
  return table.at[_row_index(table, rows)].get(mode="fill", fill_value=0.0)


def put_rows(table: jax.Array, rows: jax.Array, values: jax.Array):
  """`table` with `values` written into `rows` (rows past it are skipped)."""
  return table.at[_row_index(table, rows)].set(values, mode="drop")


def stacked_guards(tables, first):
  """`[64, ...]` guard arrays holding the first minibatch's guard: rows
  past the local table (undo skips them) and zeros elsewhere, `finite`
  kept as a scalar."""
  out = {}
  for name, (rows, table_rows, slot_rows, finite) in first.items():
    past = tables[name].shape[0] * tables[name].shape[1]
    stacked = (
      jnp.full((MAX_MINIBATCHES, *rows.shape), past, rows.dtype),
      *(
        jnp.zeros((MAX_MINIBATCHES, *x.shape), x.dtype)
        for x in (table_rows, *slot_rows)
      ),
    )
    out[name] = (stacked, finite)
  return put_guard(out, first, 0)


def put_guard(guards, part, m):
  """`guards` with minibatch `m`'s guard `part` written in."""
  out = {}
  for name, (stacked, finite) in guards.items():
    rows, table_rows, slot_rows, ok = part[name]
    values = (rows, table_rows, *slot_rows)
    stacked = tuple(
      jax.lax.dynamic_update_index_in_dim(x, v, m, 0)
      for x, v in zip(stacked, values, strict=True)
    )
    out[name] = (stacked, finite & ok)
  return out


def flat_guard(guards, name) -> tuple[Any, ...]:
  """The stack's guard in `_local_update`'s form, minibatches flattened
  (empty without a guard)."""
  if name not in guards:
    return ()
  stacked, finite = guards[name]
  rows, table_rows, *slot_rows = (x.reshape(-1, *x.shape[2:]) for x in stacked)
  return ((rows, table_rows, tuple(slot_rows), finite),)


class UpdateGuard(NamedTuple):
  """What undoing one layer's fused update needs, per stack (O(batch)).

  Attributes:
    rows: Per device and entry, the entry's local table row (past the
      local rows for entries that update nothing).
    table_rows: Those rows' values before the update.
    slot_rows: The slots' values of those rows before the update.
    finite: Whether every updated row and slot value is finite.
  """

  rows: dict[str, jax.Array]
  table_rows: dict[str, jax.Array]
  slot_rows: dict[str, tuple[jax.Array, ...]]
  finite: dict[str, jax.Array]


def undo_unless(
  plan: Plan,
  topology: Topology,
  tables: dict[str, jax.Array],
  slots: dict[str, tuple[jax.Array, ...]],
  guard: UpdateGuard,
  keep: jax.Array,
) -> tuple[dict[str, jax.Array], dict[str, tuple[jax.Array, ...]]]:
  """Unless `keep`, writes the guarded rows' old values back, in place.

  Args:
    plan: The plan of the layer's specs on the topology.
    topology: Mesh, sharding axis, SparseCores per device.
    tables: The updated tables (donate them for an in-place write).
    slots: The updated slots.
    guard: From `apply_gradients(..., guard=True)`.
    keep: Scalar bool: keep the update.

  Returns:
    `(tables, slots)`, restored where `keep` is false.
  """
  topology_lib.check_plan(plan, topology)
  return _undo_impl((plan, topology), tables, slots, guard, keep)


@functools.partial(jax.jit, static_argnums=0)
def _undo_impl(static, tables, slots, guard, keep):
  plan, topology = static

  def body(tables, slots, guard, keep):
    new_tables, new_slots = {}, {}
    for stack in plan.stacks:
      name = stack.name
      rows = guard.rows[name]

      def restored(x, old, rows=rows):
        return put_rows(x, rows, jnp.where(keep, rows_of(x, rows), old))

      new_tables[name] = restored(tables[name], guard.table_rows[name])
      new_slots[name] = tuple(
        restored(x, old)
        for x, old in zip(slots[name], guard.slot_rows[name], strict=True)
      )
    return new_tables, new_slots

  axis = P(topology.axis)
  # The guard's rows are per device (a replicated stack's copies each
  # keep their own, equal ones); the tables and slots as they are placed.
  rows_specs = {stack.name: axis for stack in plan.stacks}
  guard_specs = UpdateGuard(
    rows_specs,
    rows_specs,
    {k: tuple(axis for _ in v) for k, v in slots.items()},
    {k: P() for k in rows_specs},
  )
  table_specs = {s.name: topology.table_spec(s.name) for s in plan.stacks}
  slot_specs = {k: tuple(table_specs[k] for _ in v) for k, v in slots.items()}
  return jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(table_specs, slot_specs, guard_specs, P()),
    out_specs=(table_specs, slot_specs),
    check_vma=False,
  )(tables, slots, guard, keep)
