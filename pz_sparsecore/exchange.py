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
import math
import re

from pz_sparsecore.buffer_format import routing_window

AUTO = "auto"
ACTIVATIONS = "activations"
ROWS = "rows"
LOCAL = "local"
MODES = (AUTO, ACTIVATIONS, ROWS)
"""What `SparseCoreEmbed.from_config(exchange=...)` accepts."""

_VALUE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class ExchangeBytes:
  """Collective bytes one device moves for one stack.

  Attributes:
    routing: The ids and row pointers sent to their owners.
    forward: The values sent back (partial activations or rows).
    backward: The gradients (gathered activation gradients or row sums).
  """

  routing: int
  forward: int
  backward: int

  @property
  def lookup(self) -> int:
    """A lookup alone."""
    return self.routing + self.forward

  @property
  def update(self) -> int:
    """An `apply_gradients` call alone."""
    return self.routing + self.backward

  @property
  def step(self) -> int:
    """A train step: lookup and update in one jit, the routing sent once."""
    return self.routing + self.forward + self.backward


def predict_bytes(
  mode: str,
  *,
  num_devices: int,
  num_sc_per_device: int,
  samples_per_device: int,
  dim: int,
  max_ids_per_partition: int,
  max_unique_ids_per_partition: int,
) -> ExchangeBytes:
  """Predicted collective bytes per device per step for one stack.

  Args:
    mode: `"activations"` or `"rows"`.
    num_devices: G, devices the tables are sharded over.
    num_sc_per_device: S, SparseCores per device.
    samples_per_device: Local samples of the stack (all its features).
    dim: The stack's (padded) width.
    max_ids_per_partition: The stack's limit of ids per partition.
    max_unique_ids_per_partition: Its limit of distinct ids per partition.

  Returns:
    The bytes of the routing, the forward and the backward, each
    all-to-all counted by its operand and each all-gather by its result
    (as `compiled_bytes` reads them from the compiled HLO).

  Raises:
    ValueError: On an unknown mode or a non-positive size.
  """
  g, s = int(num_devices), int(num_sc_per_device)
  sizes = dict(
    num_devices=g,
    num_sc_per_device=s,
    samples_per_device=samples_per_device,
    dim=dim,
    max_ids_per_partition=max_ids_per_partition,
    max_unique_ids_per_partition=max_unique_ids_per_partition,
  )
  for name, value in sizes.items():
    if int(value) != value or value <= 0:
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
  if g == 1:
    return ExchangeBytes(0, 0, 0)
  if mode == ACTIVATIONS:
    window = routing_window(s, max_ids_per_partition)
    routing = g * s * (s + 3 * window)
    values = g * int(samples_per_device) * int(dim)
  elif mode == ROWS:
    window = routing_window(s, max_unique_ids_per_partition)
    routing = g * s * (s + window)
    values = g * s * window * int(dim)
  else:
    raise ValueError(
      f"exchange mode must be {ACTIVATIONS!r} or {ROWS!r}, got {mode!r}"
    )
  return ExchangeBytes(
    routing=_VALUE_BYTES * routing,
    forward=_VALUE_BYTES * values,
    backward=_VALUE_BYTES * values,
  )


@dataclasses.dataclass(frozen=True)
class Exchange:
  """The exchange one stack uses, and why.

  Attributes:
    mode: `"activations"`, `"rows"` or `"local"` (one device).
    requested: What the layer was asked for (`"auto"` or a mode).
    activations: Predicted bytes of the activation exchange.
    rows: Predicted bytes of the row exchange.
  """

  mode: str
  requested: str
  activations: ExchangeBytes
  rows: ExchangeBytes

  @property
  def reason(self) -> str:
    """One line: the mode and the predicted bytes behind it."""
    if self.mode == LOCAL:
      return "local: one device, nothing crosses devices"
    how = "chosen" if self.requested == AUTO else "forced"
    return (
      f"{self.mode} ({how}): {_kb(self.rows.step)} per device per step "
      f"with rows, {_kb(self.activations.step)} with activations"
    )


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
    The mode and the predicted bytes of both.
  """
  sizes = dict(
    num_devices=num_devices,
    num_sc_per_device=num_sc_per_device,
    samples_per_device=samples_per_sc * num_sc_per_device,
    dim=dim,
    max_ids_per_partition=max_ids_per_partition,
    max_unique_ids_per_partition=max_unique_ids_per_partition,
  )
  by_mode = {m: predict_bytes(m, **sizes) for m in (ACTIVATIONS, ROWS)}
  if num_devices == 1:
    mode = LOCAL
  elif check_mode(requested) == AUTO:
    mode = min(by_mode, key=lambda m: (by_mode[m].step, m != ROWS))
  else:
    mode = requested
  return Exchange(mode, requested, by_mode[ACTIVATIONS], by_mode[ROWS])


_COLLECTIVES = (
  "all-to-all",
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "collective-permute",
)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def compiled_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes per device of each kind of collective in compiled HLO text.

  Each collective is counted by its result on one device (for an
  all-to-all the same size as its operand; for an all-gather the gathered
  array), as `predict_bytes` counts them.

  Args:
    hlo_text: `jax.jit(f).lower(...).compile().as_text()`.

  Returns:
    Collective kind (e.g. `"all-to-all"`) → bytes; kinds absent are left
    out.
  """
  totals: dict[str, int] = {}
  for line in hlo_text.splitlines():
    lhs, _, rhs = line.partition(" = ")
    op = next((c for c in _COLLECTIVES if f" {c}(" in f" {rhs}"), None)
    if op is None or f"{op}-done(" in rhs:
      continue
    result = rhs[: rhs.index(f"{op}")]
    count = 0
    for dtype, dims in _SHAPE.findall(result):
      size = math.prod(int(d) for d in dims.split(",") if d)
      count += size * _DTYPE_BYTES.get(dtype, 8 if "64" in dtype else 4)
    totals[op] = totals.get(op, 0) + count
  return totals
