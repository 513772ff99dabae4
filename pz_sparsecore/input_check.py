"""Checks the contents of a `PreprocessedInput` against its plan, on the host.

`preprocess` always writes buffers in the canonical form the format
describes (`buffer_format.py`). Buffers built by hand (read from files,
converted from another preprocessor, produced by a user's data pipeline)
may not be; the kernels never read or write outside their tables whatever
the buffers hold, but they skip what they cannot use (an id outside its
shard, a bad sample id, an entry past a routing window), so a hand-built
batch can lose ids without a word. `validate_input` finds the first such
entry and names it:

* row pointers outside `[0, entries per SparseCore]` or decreasing;
* ids that are padding, negative, past the shard's rows, or inside another
  table's rows than the one of the feature their sample belongs to;
* ids not sorted inside their partition;
* sample ids outside `[0, samples per SparseCore)`;
* gains that are NaN or infinite;
* more entries for one owner device than its routing window holds (stacks
  on the activation exchange), or more distinct rows in one partition than
  the row exchange's window holds (stacks on the row exchange).

It reads only this process's shards, one device at a time.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax
import numpy as np

from pz_sparsecore import buffer_format
from pz_sparsecore.plan import FeaturePlan, Plan, StackPlan
from pz_sparsecore.preprocess import PreprocessedInput


def validate_input(
  plan: Plan,
  inputs: PreprocessedInput,
  row_exchange_stacks: Collection[str] = (),
) -> None:
  """Raises `ValueError` naming the first entry the kernels would not use.

  Args:
    plan: The layer's plan (`embed.config.plan`).
    inputs: Buffers shaped as `preprocess` returns them (global arrays,
      or host arrays holding every device's blocks in device order).
    row_exchange_stacks: The stacks that cross devices by the row exchange
      (the others by the activation exchange).

  Raises:
    ValueError: Naming the feature (or the stack's features), the device,
      SparseCore and partition, the buffer, the position and the value.
  """
  for stack in plan.stacks:
    blocks = zip(
      *(
        _device_blocks(getattr(inputs, field)[stack.name], plan.num_devices)
        for field in (
          "lhs_row_pointers",
          "lhs_embedding_ids",
          "lhs_sample_ids",
          "lhs_gains",
        )
      ),
      strict=True,
    )
    for (device, rp), (_, ids), (_, sids), (_, gains) in blocks:
      s = plan.num_sc_per_device
      for sc in range(s):
        _Segment(
          stack,
          plan,
          stack.name in row_exchange_stacks,
          f"device {device}, SparseCore {sc}",
          rp.reshape(s, -1)[sc],
          ids.reshape(s, -1)[sc],
          sids.reshape(s, -1)[sc],
          gains.reshape(s, -1)[sc],
        ).check()


def _device_blocks(value: Any, num_devices: int):
  """`(device position, its block)` for each block this process holds."""
  if isinstance(value, jax.Array):
    size = value.shape[0] // num_devices
    seen = set()
    for shard in value.addressable_shards:
      start = shard.index[0].start or 0
      if start in seen:
        continue
      seen.add(start)
      yield start // size, np.asarray(shard.data).reshape(-1)
    return
  value = np.asarray(value).reshape(num_devices, -1)
  yield from enumerate(value)


class _Segment:
  """One SparseCore's segment of one stack on one device."""

  def __init__(
    self, stack: StackPlan, plan: Plan, rows: bool, where: str, *buffers
  ):
    self.stack, self.plan, self.rows, self.where = stack, plan, rows, where
    self.rp, self.ids, self.sids, self.gains = buffers
    self.num_shards = plan.num_devices * plan.num_sc_per_device

  def fail(self, feature: str, partition: int | None, message: str):
    part = "" if partition is None else f", partition {partition}"
    raise ValueError(
      f"{feature} (stack {self.stack.name!r}, {self.where}{part}): {message}"
    )

  @property
  def stack_features(self) -> str:
    return f"features {[f.name for f in self.stack.features]}"

  def check(self) -> None:
    ends = self.rp[: self.num_shards].astype(np.int64)
    limit = self.stack.coo_per_sc
    for p, end in enumerate(ends):
      if not 0 <= end <= limit:
        self.fail(
          self.stack_features,
          p,
          f"row_pointers[{p}] = {end} is outside [0, {limit}]",
        )
      if p and end < ends[p - 1]:
        self.fail(
          self.stack_features,
          p,
          f"row_pointers decrease: row_pointers[{p}] = {end} < "
          f"row_pointers[{p - 1}] = {ends[p - 1]}",
        )
    starts = buffer_format.partition_starts(ends, np)
    self.check_windows(starts, ends)
    for p in range(self.num_shards):
      if starts[p] < ends[p]:
        self.check_partition(p, int(starts[p]), int(ends[p]))

  def check_windows(self, starts: np.ndarray, ends: np.ndarray) -> None:
    """Each owner device's partitions fit the routing window."""
    if self.plan.num_devices == 1 or self.rows:
      return
    s, window = self.plan.num_sc_per_device, self.stack.window
    for owner in range(self.plan.num_devices):
      first, last = owner * s, owner * s + s - 1
      used = int(max(ends[last], starts[first]) - starts[first])
      if used > window:
        self.fail(
          self.stack_features,
          None,
          f"{used} entries (positions {starts[first]}..{ends[last]}) go to "
          f"device {owner}, more than its routing window of {window} "
          f"(num_sc_per_device x r8(max_ids_per_partition)); raise "
          "max_ids_per_partition or preprocess with preprocess()",
        )

  def check_partition(self, p: int, begin: int, end: int) -> None:
    ids = self.ids[begin:end].astype(np.int64)
    sids = self.sids[begin:end].astype(np.int64)
    gains = self.gains[begin:end]
    bad = np.flatnonzero((sids < 0) | (sids >= self.stack.samples_per_sc))
    if bad.size:
      j = bad[0]
      self.fail(
        self.stack_features,
        p,
        f"sample_ids[{begin + j}] = {sids[j]} is outside [0, "
        f"{self.stack.samples_per_sc})",
      )
    offsets = np.array([f.sample_offset for f in self.stack.features])
    owner = np.searchsorted(offsets, sids, side="right") - 1
    for index, feature in enumerate(self.stack.features):
      mine = np.flatnonzero(owner == index)
      if mine.size:
        self.check_rows(feature, p, begin, mine, ids[mine])
    bad = np.flatnonzero(~np.isfinite(gains))
    if bad.size:
      j = bad[0]
      self.fail(
        _feature_of(self.stack, owner[j]),
        p,
        f"gains[{begin + j}] = {gains[j]} is not finite",
      )
    bad = np.flatnonzero(np.diff(ids) < 0)
    if bad.size:
      j = bad[0] + 1
      self.fail(
        _feature_of(self.stack, owner[j]),
        p,
        f"embedding_ids are not sorted in the partition: "
        f"embedding_ids[{begin + j}] = {ids[j]} < "
        f"embedding_ids[{begin + j - 1}] = {ids[j - 1]}",
      )
    if self.rows and self.plan.num_devices > 1:
      self.check_distinct(p, ids)

  def check_distinct(self, p: int, ids: np.ndarray) -> None:
    """The partition's distinct rows fit the row exchange's window."""
    cap = self.stack.unique_window // self.plan.num_sc_per_device
    distinct = int(np.count_nonzero(np.diff(ids))) + 1
    if distinct > cap:
      self.fail(
        self.stack_features,
        p,
        f"{distinct} distinct rows, more than the row exchange's window of "
        f"{cap} (r8(max_unique_ids_per_partition)); raise "
        "max_unique_ids_per_partition or preprocess with preprocess()",
      )

  def check_rows(
    self,
    feature: FeaturePlan,
    p: int,
    begin: int,
    positions: np.ndarray,
    ids: np.ndarray,
  ) -> None:
    """The feature's ids lie in its table's rows of the shard."""
    setting = feature.spec.table_spec.setting_in_stack
    lo = feature.row_offset_in_shard
    hi = lo + setting.padded_vocab_size // self.num_shards
    bad = np.flatnonzero((ids < lo) | (ids >= hi))
    if bad.size:
      j = bad[0]
      value = ids[j]
      what = "the padding id" if value == buffer_format.PAD_ID else value
      self.fail(
        f"feature {feature.name!r}",
        p,
        f"embedding_ids[{begin + positions[j]}] = {what} is outside its "
        f"table {feature.spec.table_spec.name!r}'s rows [{lo}, {hi}) of "
        "the shard",
      )


def _feature_of(stack: StackPlan, index: int) -> str:
  return f"feature {stack.features[int(index)].name!r}"
