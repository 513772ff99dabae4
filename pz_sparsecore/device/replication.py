"""Which tables every device holds whole: the placement cost model.

A stack is either sharded over the devices (MOD sharding, ids and
activations or rows exchanged) or replicated (every device holds all of
it, looks up locally, and applies the same update as every other device
after an all-reduce of the row gradients: `exchange.replicated`).
`SparseCoreEmbed.from_config(placement="auto")` prices each table as a
stack of its own on the layer's topology (its limits as the specs give
them: worst case, or FDO's once applied) and replicates it when both hold:

* **memory**: its rows and optimizer slots take at most `max_bytes` per
  device (`padded_vocab * (padded_dim * the table dtype's bytes + 4 * the
  slots' widths)`, a "table" slot `padded_dim` wide, a row-wise one 1;
  default
  `DEFAULT_MAX_BYTES`, 1 MiB: a copy on every device must stay small
  beside the sharded tables);
* **traffic**: the replicated stack moves fewer predicted bytes per device
  per step than the cheaper sharded exchange (`exchange.predict_bytes`:
  replicated, the all-reduced row gradients `4 * rows * (dim + 1)`;
  sharded, the routing, the activations or rows out and the gradients
  back).

The model counts bytes only. It leaves out the fixed cost of one more
stack (its kernel calls and collectives: replicated tables never share a
stack with sharded ones) and that every device applies the whole update of
a replicated stack; where devices share a host's cores, as virtual CPU
devices do, those dominate for small tables. On this project's 26-table
DLRM over 8 virtual CPU devices (`benchmarks/dlrm.py --placement auto`) the
19 tables `auto` replicates made the step slower, not faster, so
`from_config`'s default placement is `"sharded"`; `"auto"` is for devices
that run apart (accelerators, hosts), where the bytes are the cost.

Tables stacked by hand are priced as their stack. With one device nothing
is replicated (every stack is local). A mapping table name ->
`"replicated"` / `"sharded"` overrides the choice per table (a stack's
tables must agree).

Example, 8 devices, one SparseCore each, batch 2048, one id per sample,
width 16, Adagrad (one slot), worst-case limits: a 1,000-row table pads to
1,024 rows and takes 4 * 1,024 * 16 * 2 = 131,072 bytes; replicated, a
step all-reduces 4 * 1,024 * 17 = 69,632 bytes against the activation
exchange's 135,200: replicated. A 100,000-row table (12.8 MB) stays
sharded whatever its traffic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pz_sparsecore.core.plan import Plan, StackPlan
from pz_sparsecore.device import exchange as exchange_lib

DEFAULT_MAX_BYTES = 1 << 20
"""Largest table (rows and slots, on one device) `auto` replicates."""

REPLICATED, SHARDED, AUTO = "replicated", "sharded", "auto"
PLACEMENTS = (REPLICATED, SHARDED)


@dataclasses.dataclass(frozen=True)
class Cost:
  """The price of one stack's two placements.

  Attributes:
    stack: The stack's name.
    tables: Its tables.
    replicated_bytes: Table and slots on one device, `N V_shard (D *
      the table dtype's bytes + 4 * the slots' widths)` (a "table" slot's
      width is D, a row-wise one's 1).
    replicated_step: Predicted bytes per device per step, replicated.
    sharded_step: The same for the cheaper sharded exchange.
  """

  stack: str
  tables: tuple[str, ...]
  replicated_bytes: int
  replicated_step: int
  sharded_step: int

  def replicate(self, max_bytes: int) -> bool:
    """The cost model's choice."""
    return (
      self.replicated_bytes <= max_bytes
      and self.replicated_step < self.sharded_step
    )


def cost(plan: Plan, stack: StackPlan) -> Cost:
  """The cost of placing `stack` either way on `plan`'s topology."""
  sizes = exchange_lib.stack_sizes(
    stack, plan.num_devices, plan.num_sc_per_device
  )
  sharded = min(
    exchange_lib.predict_bytes(mode, **sizes).step
    for mode in (exchange_lib.ACTIVATIONS, exchange_lib.ROWS)
  )
  replicated = exchange_lib.predict_bytes(exchange_lib.REPLICATED, **sizes).step
  # The table in its dtype, each slot in float32 at its width (D for a
  # "table" slot, 1 for a row-wise one).
  row_bytes = stack.dim * stack.dtype.itemsize + 4 * sum(
    stack.optimizer.definition.slot_widths(stack.dim)
  )
  memory = plan.num_shards * stack.rows_per_shard * row_bytes
  return Cost(
    stack.name,
    tuple(t.name for t in stack.tables),
    memory,
    replicated,
    sharded,
  )


def check_placement(placement: Any, table_names: Any) -> None:
  """Raises a `ValueError` unless `placement` is `"auto"`, `"sharded"`,
  or a mapping of known table names to `PLACEMENTS`."""
  if placement in (AUTO, SHARDED):
    return
  if not isinstance(placement, Mapping):
    raise ValueError(
      f"placement must be 'auto', 'sharded' or a dict table name -> "
      f"{PLACEMENTS}, got {placement!r}"
    )
  for name, value in placement.items():
    if name not in table_names:
      raise ValueError(
        f"placement names table {name!r}, which no feature uses; tables: "
        f"{sorted(table_names)}"
      )
    if value not in PLACEMENTS:
      raise ValueError(
        f"placement of table {name!r} must be one of {PLACEMENTS}, got "
        f"{value!r}"
      )


def replicated_tables(
  plan: Plan, placement: Any, max_bytes: int = DEFAULT_MAX_BYTES
) -> frozenset[str]:
  """The tables to replicate, from a plan of the tables before stacking.

  Args:
    plan: The layer's tables planned unstacked (hand-made stacks kept).
    placement: `"auto"` (the cost model, per stack), `"sharded"` (none),
      or a dict table name -> `"replicated"` / `"sharded"` (the rest auto).
    max_bytes: The memory bound of the cost model.

  Returns:
    Names of the replicated tables (none with one device).

  Raises:
    ValueError: On a bad `placement`, or a hand-made stack whose tables
      the mapping places differently (naming them).
  """
  check_placement(placement, set(plan.tables))
  if placement == SHARDED or plan.num_devices == 1:
    return frozenset()
  forced = {} if placement == AUTO else dict(placement)
  out: set[str] = set()
  for stack in plan.stacks:
    price = cost(plan, stack)
    asked = {forced[t] for t in price.tables if t in forced}
    if len(asked) > 1:
      raise ValueError(
        f"placement: the tables of stack {stack.name!r} ({list(price.tables)})"
        f" share one placement, got "
        f"{ {t: forced[t] for t in price.tables if t in forced} }"
      )
    choice = (
      asked.pop()
      if asked
      else (REPLICATED if price.replicate(max_bytes) else SHARDED)
    )
    if choice == REPLICATED:
      out.update(price.tables)
  return frozenset(out)
