"""The interface every exchange mode implements, and the bytes it moves.

An exchange mode is one module of this package (`local`, `activations`,
`rows`) with the functions of `Mode`; `routing` calls them per stack, under
`shard_map`, and `input_check` asks each what it needs of the buffers. A
new mode is one more such module, listed in `exchange.MODULES`.

The byte model counts every collective once, an all-to-all by its operand
and an all-gather by its result, as `compiled_bytes` reads them from
compiled HLO, so a mode's `predicted_bytes` can be checked against the
program XLA actually runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, NamedTuple, Protocol

import jax

from pz_sparsecore.core.plan import StackPlan
from pz_sparsecore.device.kernels import contract

VALUE_BYTES = 4
"""Bytes of one id, row pointer, gain or activation value (32 bits)."""


class Sizes(NamedTuple):
  """What the byte model needs of one stack on one topology.

  Attributes:
    num_devices: G, devices the tables are sharded over.
    num_sc_per_device: S, SparseCores per device.
    samples_per_device: Local samples of the stack (all its features).
    dim: The stack's (padded) width.
    max_ids_per_partition: The stack's limit of ids per partition.
    max_unique_ids_per_partition: Its limit of distinct ids per partition.
    table_rows: The stack's rows, `N * V_shard` (the replicated
      placement all-reduces a gradient of that many rows); 0 if unknown.
  """

  num_devices: int
  num_sc_per_device: int
  samples_per_device: int
  dim: int
  max_ids_per_partition: int
  max_unique_ids_per_partition: int
  table_rows: int = 0


Buffers = tuple[jax.Array, jax.Array, jax.Array, jax.Array]
"""One device's `(row_pointers, embedding_ids, sample_ids, gains)`."""


def own_buffer_shape(
  stack: StackPlan, num_devices: int, num_sc_per_device: int
) -> contract.BufferShape:
  """The shape of one device's own buffers: its `S` segments against all
  `N` partitions of the stack (for decoding them on the device)."""
  n = num_devices * num_sc_per_device
  return contract.BufferShape(
    num_segments=num_sc_per_device,
    samples_per_segment=stack.samples_per_sc,
    num_partitions=n,
    rows_per_partition=stack.rows_per_shard,
    partition_begin=0,
    num_table_partitions=n,
    seg_len=stack.coo_per_sc,
    rp_stride=stack.row_pointers_per_sc,
    dim=stack.dim,
  )


class Mode(Protocol):
  """What one exchange mode's module provides (`topo` is a
  `device.topology.Topology`; the functions run per device, inside
  `shard_map` over `topo.axis`)."""

  NAME: str
  CROSSES_DEVICES: bool

  def lookup(
    self, stack: StackPlan, topo: Any, table: jax.Array, buffers: Buffers
  ) -> jax.Array:
    """The local samples' activations `[S * B_sc, D]`."""

  def owner_operands(
    self, stack: StackPlan, topo: Any, buffers: Buffers, grad: jax.Array
  ) -> tuple[jax.Array, Buffers, dict[str, int]]:
    """What the owner's fused update reads: `(grad, buffers, kernel
    sizes)`, from `grad`, the `[S * B_sc, D]` gradient of the local
    activations."""

  def predicted_bytes(self, sizes: Sizes) -> ExchangeBytes:
    """Collective bytes per device per step (`G > 1`)."""

  def check_windows(self, segment: Any, starts: Any, ends: Any) -> None:
    """Raises (through `segment.fail`) if one source segment's partitions
    (`starts`, `ends`: numpy) do not fit the mode's windows."""

  def check_partition(self, segment: Any, partition: int, ids: Any) -> None:
    """Raises (through `segment.fail`) if one partition's sorted ids do not
    fit the mode's windows."""


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
