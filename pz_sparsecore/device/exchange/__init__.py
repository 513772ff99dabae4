"""How a stack's lookups cross devices, and what each way costs.

With `G > 1` devices every device holds `S` shards of each stack and its own
slice of the batch, so each step moves data between devices. Two exchanges
do it with static shapes; both run the same kernels on the same shards and
give the same activations and updates (up to float summation order).

* **activations**: each source sends every owner its window of entries
  (`W = S * r8(max_ids_per_partition)` per SparseCore segment); the owner
  computes partial activations for *every* source's samples and sends them
  back (`[G, S * B_sc, D]`); the backward all-gathers every device's
  activation gradients. Its traffic grows with G at a fixed local batch.
* **rows**: each source sends every owner the *distinct* rows its segments
  ask of it (`Wu = S * r8(max_unique_ids_per_partition)` ids per segment);
  the owner returns those rows, the source combines them with its gains;
  the backward sends each owner the per-row gradient sums of its rows. With
  limits that follow the load (FDO), `G * Wu` stays near the local distinct
  ids, so the traffic stays flat in G.

Bytes per device (one stack, `G > 1`; every collective counted once, an
all-to-all by its operand, an all-gather by its result; 4-byte values;
`B = S * samples_per_sc` local samples, `D` the stack width)::

               routing (ids out)   forward (values back)  backward (grads)
  activations  4 G S (S + 3 W)     4 G B D                4 G B D
  rows         4 G S (S + Wu)      4 G S Wu D             4 G S Wu D

A lookup moves routing + forward, a separate `apply_gradients` call
routing + backward, and a compiled train step (both in one jit, where XLA
sends the routing once) routing + forward + backward. With one device
nothing moves (mode "local").

Example: G = 8, S = 1, 256 samples x 8 ids per device, D = 32, limits
tuned to the load (max ids 301, max distinct ids 300 per partition): the
activations route 4*8*(1 + 3*304) = 29,216 bytes and move 4*8*256*32 =
262,144 each way, 553,504 a step; the rows route 4*8*(1 + 304) = 9,760 and
move 4*8*304*32 = 311,296 each way, 632,352 a step. With 8 distinct ids
per sample the rows pay off only above G = 8: at G = 64 with limits 40 / 40
a step moves 4.23 MB of activations against 0.67 MB of rows.

`"auto"` picks, per stack, the mode with fewer predicted bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from pz_sparsecore.device.exchange import activations, local, replicated, rows
from pz_sparsecore.device.exchange.base import (
  ExchangeBytes,
  Mode,
  Sizes,
  compiled_bytes,
)

AUTO = "auto"
ACTIVATIONS = activations.NAME
ROWS = rows.NAME
LOCAL = local.NAME
REPLICATED = replicated.NAME
MODULES: Mapping[str, ModuleType] = {
  m.NAME: m for m in (local, activations, rows, replicated)
}
"""Every exchange mode's module (`base.Mode`), by name: a new mode is one
more module of this package, listed here."""
_CROSSING = tuple(
  m.NAME
  for m in MODULES.values()
  if m.CROSSES_DEVICES and getattr(m, "SHARDED", True)
)
"""The modes that exchange a sharded stack across devices, in the order
`auto` prefers on a tie (the later one)."""
MODES = (AUTO, *_CROSSING)
"""What `SparseCoreEmbed.from_config(exchange=...)` accepts."""


def mode_module(mode: str) -> Mode:
  """The module of exchange mode `mode` (`"local"` included).

  Raises:
    ValueError: Naming the value and the modes.
  """
  if mode not in MODULES:
    raise ValueError(
      f"exchange mode must be one of {tuple(MODULES)}, got {mode!r}"
    )
  return MODULES[mode]


def predict_bytes(
  mode: str,
  *,
  num_devices: int,
  num_sc_per_device: int,
  samples_per_device: int,
  dim: int,
  max_ids_per_partition: int,
  max_unique_ids_per_partition: int,
  table_rows: int = 0,
) -> ExchangeBytes:
  """Predicted collective bytes per device per step for one stack.

  Args:
    mode: `"activations"`, `"rows"` or `"replicated"` (each mode's
      `predicted_bytes`).
    num_devices: G; this and the other sizes as `base.Sizes` describes
      them.
    num_sc_per_device: S.
    samples_per_device: Local samples of the stack.
    dim: The stack's width.
    max_ids_per_partition: The stack's limit of ids per partition.
    max_unique_ids_per_partition: Its limit of distinct ids per partition.
    table_rows: Its rows, `N * V_shard` (the replicated placement needs
      them).

  Returns:
    The bytes of the routing, the forward and the backward, each
    all-to-all counted by its operand and each all-gather by its result
    (as `compiled_bytes` reads them from the compiled HLO); zero with one
    device.

  Raises:
    ValueError: On an unknown mode or a non-positive size.
  """
  sizes = Sizes(
    num_devices=num_devices,
    num_sc_per_device=num_sc_per_device,
    samples_per_device=samples_per_device,
    dim=dim,
    max_ids_per_partition=max_ids_per_partition,
    max_unique_ids_per_partition=max_unique_ids_per_partition,
    table_rows=table_rows,
  )
  for name, value in sizes._asdict().items():
    if int(value) != value or value < (name != "table_rows"):
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
  if mode not in (*_CROSSING, REPLICATED):
    raise ValueError(
      f"exchange mode must be one of {(*_CROSSING, REPLICATED)}, got {mode!r}"
    )
  if int(num_devices) == 1:
    return ExchangeBytes(0, 0, 0)
  return MODULES[mode].predicted_bytes(Sizes(*(int(v) for v in sizes)))


def stack_sizes(
  stack: Any, num_devices: int, num_sc_per_device: int
) -> dict[str, int]:
  """`predict_bytes`' sizes of one planned stack (a `core.plan.StackPlan`)
  on `num_devices` x `num_sc_per_device`."""
  spec = stack.spec
  return dict(
    num_devices=num_devices,
    num_sc_per_device=num_sc_per_device,
    samples_per_device=stack.samples_per_sc * num_sc_per_device,
    dim=stack.dim,
    max_ids_per_partition=spec.max_ids_per_partition,
    max_unique_ids_per_partition=spec.max_unique_ids_per_partition,
    table_rows=stack.rows_per_shard * num_devices * num_sc_per_device,
  )


@dataclasses.dataclass(frozen=True)
class Exchange:
  """The exchange one stack uses, and why.

  Attributes:
    mode: `"activations"`, `"rows"`, `"local"` (one device) or
      `"replicated"` (a stack held whole by every device).
    requested: What the layer was asked for (`"auto"` or a mode).
    by_mode: Predicted bytes of each mode that crosses devices.
  """

  mode: str
  requested: str
  by_mode: Mapping[str, ExchangeBytes]

  @property
  def module(self) -> Mode:
    """The module that implements `mode`."""
    return MODULES[self.mode]

  @property
  def reason(self) -> str:
    """One line: the mode and the predicted bytes behind it."""
    if self.mode == LOCAL:
      return "local: one device, nothing crosses devices"
    if self.mode == REPLICATED:
      sharded = min(self.by_mode[m].step for m in _CROSSING)
      return (
        f"replicated: on every device, {_kb(self.by_mode[REPLICATED].step)} "
        f"per device per step (sharded: {_kb(sharded)})"
      )
    how = "chosen" if self.requested == AUTO else "forced"
    costs = [
      f"{_kb(self.by_mode[m].step)}{' per device per step' * (i == 0)} with {m}"
      for i, m in enumerate(reversed(_CROSSING))
    ]
    return f"{self.mode} ({how}): {', '.join(costs)}"


def _kb(count: int) -> str:
  return f"{count / 1000:,.1f} KB"


def check_mode(mode: str) -> str:
  """`mode` if it is one of `MODES`.

  Raises:
    ValueError: Naming the value and the accepted modes.
  """
  if mode not in MODES:
    raise ValueError(f"exchange must be one of {MODES}, got {mode!r}")
  return mode


def choose(
  requested: str,
  *,
  num_devices: int,
  num_sc_per_device: int,
  samples_per_sc: int,
  dim: int,
  max_ids_per_partition: int,
  max_unique_ids_per_partition: int,
) -> Exchange:
  """The exchange of one stack: `requested`, or the cheaper one for auto.

  Args:
    requested: One of `MODES`.
    num_devices: G.
    num_sc_per_device: S.
    samples_per_sc: The stack's samples per SparseCore.
    dim: The stack's width.
    max_ids_per_partition: The stack's limit of ids per partition.
    max_unique_ids_per_partition: Its limit of distinct ids per partition.

  Returns:
    The mode and the predicted bytes of every mode.
  """
  sizes = dict(
    num_devices=num_devices,
    num_sc_per_device=num_sc_per_device,
    samples_per_device=samples_per_sc * num_sc_per_device,
    dim=dim,
    max_ids_per_partition=max_ids_per_partition,
    max_unique_ids_per_partition=max_unique_ids_per_partition,
  )
  by_mode = {m: predict_bytes(m, **sizes) for m in _CROSSING}
  if num_devices == 1:
    mode = LOCAL
  elif check_mode(requested) == AUTO:
    mode = min(by_mode, key=lambda m: (by_mode[m].step, -_CROSSING.index(m)))
  else:
    mode = requested
  return Exchange(mode, requested, by_mode)


__all__ = [
  "ACTIVATIONS",
  "AUTO",
  "LOCAL",
  "MODES",
  "MODULES",
  "REPLICATED",
  "ROWS",
  "Exchange",
  "ExchangeBytes",
  "Mode",
  "Sizes",
  "check_mode",
  "choose",
  "compiled_bytes",
  "mode_module",
  "predict_bytes",
  "stack_sizes",
]
