"""The forward's sample order: each batch's lookups grouped by output row.

The COO buffers are sorted by table row, which the fused update wants; the
forward sums per output row (sample), so the CPU forward would first sort
every batch's entries by sample. For a plan of one device (its lookups all
local), the fill writes that order as it packs the ids, still in input
order: `PreprocessedInput.sample_order`, per stack and device one int32
block of

    starts[num_outputs + 1], then C_dev pairs (table row, gain bits)

where output row `r = s * B_sc + sid` (SparseCore `s`, its sample `sid`)
has the pairs `[starts[r], starts[r + 1])`: every id of the sample, in
input order, duplicates not merged, with the gain the buffers give it.
`starts[0] == -1` marks a batch without one (its ids dropped or overflowing
the block, or samples out of order): the forward then sorts as before.

Example: one SparseCore, samples `[[3, 1], [], [3]]`, sum combiner, rows
identical to ids, `C_dev = 8`: starts `[0, 2, 2, 3]`, pairs `(3, 1.0),
(1, 1.0), (3, 1.0)` and five unused pairs.

Multi-device plans route entries between devices before the lookup and
minibatched buffers split them: neither gets a sample order (None).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.host import blocks as blocks_lib


def applies(plan: plan_lib.Plan) -> bool:
  """Whether buffers for `plan` carry a sample order (one device, one
  minibatch; a hashed stack's names places, made rows on the device with
  its buffers: `device.hashed`)."""
  return plan.num_devices == 1 and plan.minibatches == 1


def values_per_device(plan: plan_lib.Plan, stack: plan_lib.StackPlan) -> int:
  """Length of one device's block of `stack`: starts, then pairs."""
  num_outputs = plan.num_sc_per_device * stack.samples_per_sc
  return num_outputs + 1 + 2 * stack.coo_per_device


def shapes(plan: plan_lib.Plan) -> dict[str, int] | None:
  """Stack name -> values per device, or None without a sample order."""
  if not applies(plan):
    return None
  return {s.name: values_per_device(plan, s) for s in plan.stacks}


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a call's sample order lies in its flat array (`num_local`
  devices, every stack).

  Attributes:
    blocks: Stack `t`'s blocks (its `L` devices' one after the other),
      aligned for `device_put` (`host.blocks`).
    devices: `[T, L]`: the first value (start 0) of each device's block.
    starts: `[T * L * S]`: per work item `(t, d, s)`, where its first
      output row's start goes.
    pairs: `[T, L, 1]`: where each device's pairs begin.
    capacity: `[T, 1]`: the pairs of one device's block (`C_dev`).
    samples: `[T]`: the plan's samples per SparseCore.
  """

  blocks: blocks_lib.Blocks
  devices: np.ndarray
  starts: np.ndarray
  pairs: np.ndarray
  capacity: np.ndarray
  samples: np.ndarray


@functools.lru_cache(maxsize=64)
def layout(plan: plan_lib.Plan, num_local: int) -> Layout:
  """The (cached) `Layout` of `plan`'s buffers for `num_local` devices."""
  num_sc = plan.num_sc_per_device
  per_device = np.array([values_per_device(plan, s) for s in plan.stacks])
  blocks = blocks_lib.Blocks.aligned(per_device * num_local)
  devices = blocks.parts(per_device, num_local)
  samples = np.array([s.samples_per_sc for s in plan.stacks], np.int64)
  starts = (
    devices[:, :, None] + (samples[:, None] * np.arange(num_sc))[:, None, :]
  )
  return Layout(
    blocks=blocks,
    devices=devices.astype(np.int64),
    starts=starts.reshape(-1).astype(np.int64),
    pairs=(devices + num_sc * samples[:, None] + 1)[:, :, None],
    capacity=np.array([[s.coo_per_device] for s in plan.stacks], np.int64),
    samples=samples,
  )


def item_bases(
  plan: plan_lib.Plan,
  num_local: int,
  item_size: np.ndarray,
  samples_per_sc: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Where every work item `w = (t, d, s)` writes (see
  `_fill_numba.Outputs`): its first start, its first pair (-1 for an item
  that cannot write: its device's ids exceed the block, or the batch's
  samples per SparseCore are not the plan's) and that pair's index among
  its device's."""
  at = layout(plan, num_local)
  sizes = item_size.reshape(len(plan.stacks), num_local, -1)
  ends = np.cumsum(sizes, axis=2)
  first = ends - sizes
  fits = (ends[:, :, -1:] <= at.capacity[:, :, None]) & (
    samples_per_sc == at.samples
  )[:, None, None]
  pairs = np.where(fits, at.pairs + 2 * first, -1)
  return at.starts, pairs.reshape(-1), first.reshape(-1)


def finish(
  plan: plan_lib.Plan,
  num_local: int,
  flat: np.ndarray,
  order_pairs: np.ndarray,
  order_ok: np.ndarray,
  dropped: np.ndarray,
) -> None:
  """Marks -1 the blocks of devices where an item could not write, saw
  samples out of order or dropped ids (the buffers then hold fewer lookups
  than the pairs); their other values are zeros."""
  shape = (len(plan.stacks), num_local, -1)
  usable = (
    (order_pairs.reshape(shape) >= 0)
    & order_ok.reshape(shape)
    & (dropped.reshape(shape) == 0)
  ).all(axis=2)
  at = layout(plan, num_local)
  for t, d in zip(*np.nonzero(~usable), strict=True):
    start = at.devices[t, d]
    flat[start : start + values_per_device(plan, plan.stacks[t])] = 0
    flat[start] = -1
