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
* ids not sorted inside their partition (in a minibatch, whose partitions
  are ordered by bucket, then row: a row's entries not consecutive);
* minibatch counts outside `[1, 64]` or not the same on every device;
* sample ids outside `[0, samples per SparseCore)`;
* gains that are NaN or infinite;
* more entries for one owner device than its routing window holds (stacks
  on the activation exchange), or more distinct rows in one partition than
  the row exchange's window holds (stacks on the row exchange).

It reads only this process's shards, one device at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES
from pz_sparsecore.core.plan import FeaturePlan, Plan, StackPlan
from pz_sparsecore.core.preprocessed import PreprocessedInput
from pz_sparsecore.device import exchange


def validate_input(
  plan: Plan,
  inputs: PreprocessedInput,
  modes: Mapping[str, str] | None = None,
) -> None:
  """Raises `ValueError` naming the first entry the kernels would not use.

  Args:
    plan: The layer's plan (`embed.config.plan`).
    inputs: Buffers shaped as `preprocess` returns them (global arrays,
      or host arrays holding every device's blocks in device order).
    modes: Stack name -> its exchange mode (`Topology.exchange_of`); by
      default `"local"` on one device, else `"activations"`. Each mode
      checks what its windows need (`exchange.base.Mode`).

  Raises:
    ValueError: Naming the feature (or the stack's features), the device,
      SparseCore and partition, the buffer, the position and the value.
  """
  counts = None
  if inputs.num_minibatches is not None:
    counts = dict(_device_blocks(inputs.num_minibatches, plan.num_devices))
    _check_counts(counts)
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
    default = exchange.LOCAL if plan.num_devices == 1 else exchange.ACTIVATIONS
    mode = exchange.mode_module((modes or {}).get(stack.name, default))
    for (device, rp), (_, ids), (_, sids), (_, gains) in blocks:
      buffers = (rp, ids, sids, gains)
      if counts is None:
        segments = _segments(plan, stack, device, buffers)
      else:
        segments = _minibatch_segments(
          plan, stack, device, buffers, int(counts[device][0])
        )
      for where, segment_plan, segment in segments:
        segment_stack = segment_plan.stack(stack.name)
        _Segment(
          segment_stack,
          segment_plan,
          mode,
          where,
          *segment,
          grouped=counts is not None,
        ).check()


def _segments(plan: Plan, stack: StackPlan, device: int, buffers):
  """`(where, plan, buffers)` of each SparseCore segment of a device."""
  s = plan.num_sc_per_device
  for sc in range(s):
    where = f"device {device}, SparseCore {sc}"
    yield where, plan, tuple(b.reshape(s, -1)[sc] for b in buffers)


def _check_counts(counts: dict[int, np.ndarray]) -> None:
  """Every device's minibatch count is in `[1, 64]`, and all are equal."""
  values = {device: int(c[0]) for device, c in counts.items()}
  for device, value in values.items():
    if not 1 <= value <= MAX_MINIBATCHES:
      raise ValueError(
        f"num_minibatches of device {device} is {value}, outside [1, "
        f"{MAX_MINIBATCHES}]"
      )
  if len(set(values.values())) > 1:
    raise ValueError(
      f"num_minibatches differs across devices ({values}); every device "
      "runs the same minibatches"
    )


def _minibatch_segments(
  plan: Plan, stack: StackPlan, device: int, buffers, count: int
):
  """`(where, plan, buffers)` of each SparseCore's minibatches of a device,
  cut out as the device cuts them (`minibatching.minibatch_inputs`), in the
  format of `plan.single_minibatch(plan)`."""
  rp, *coo = buffers
  rp = rp.astype(np.int64)
  small = plan_lib.single_minibatch(plan)
  per_sc = small.stack(stack.name).coo_per_sc
  rpp = buffer_format.row_pointers_per_sc(plan.num_shards)
  fills = (buffer_format.PAD_ID, buffer_format.PAD_ID, buffer_format.PAD_GAIN)
  size = coo[0].size
  padded = [
    np.concatenate([buf, np.full(per_sc, fill, buf.dtype)])
    for buf, fill in zip(coo, fills, strict=True)
  ]
  for sc in range(plan.num_sc_per_device):
    for m in range(count):
      where = f"device {device}, SparseCore {sc}, minibatch {m}"
      k = sc * count + m
      start = 0 if k == 0 else int(buffer_format.round_up(rp[k * rpp - 1]))
      if not 0 <= start <= size:
        raise ValueError(
          f"stack {stack.name!r}, {where}: it starts at position {start} "
          f"(the rounded-up row_pointers[{k * rpp - 1}]), outside the "
          f"buffer's [0, {size}]"
        )
      yield (
        where,
        small,
        (
          rp[k * rpp : (k + 1) * rpp] - start,
          *(buf[start : start + per_sc] for buf in padded),
        ),
      )


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
    self,
    stack: StackPlan,
    plan: Plan,
    mode: exchange.Mode,
    where: str,
    *buffers,
    grouped: bool = False,
  ):
    self.stack, self.plan, self.mode, self.where = stack, plan, mode, where
    # Minibatches need a row's entries together, not sorted.
    self.grouped = grouped
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
    self.mode.check_windows(self, starts, ends)
    for p in range(self.num_shards):
      if starts[p] < ends[p]:
        self.check_partition(p, int(starts[p]), int(ends[p]))

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
    if self.grouped:
      self.check_grouped(p, begin, ids, owner)
    else:
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
    self.mode.check_partition(self, p, ids)

  def check_grouped(
    self, p: int, begin: int, ids: np.ndarray, owner: np.ndarray
  ) -> None:
    """A row's entries are consecutive (a minibatch orders its partition
    by bucket, then row): no row starts two runs."""
    runs = np.flatnonzero(np.diff(ids, prepend=ids[:1] - 1) != 0)
    _, first = np.unique(ids[runs], return_index=True)
    if first.size < runs.size:
      again = np.setdiff1d(np.arange(runs.size), first)[0]
      j = runs[again]
      self.fail(
        _feature_of(self.stack, owner[j]),
        p,
        f"embedding_ids are not grouped by row in the partition: "
        f"embedding_ids[{begin + j}] = {ids[j]} starts a second run of "
        "that row (a row's entries must be consecutive)",
      )

  def check_rows(
    self,
    feature: FeaturePlan,
    p: int,
    begin: int,
    positions: np.ndarray,
    ids: np.ndarray,
  ) -> None:
    """The feature's ids lie in its table's rows of the shard (a hashed
    table's: its places, any row of the stack's shard, `host.hashed_ids`)."""
    setting = feature.spec.table_spec.setting_in_stack
    lo = feature.row_offset_in_shard
    hi = lo + setting.padded_vocab_size // self.num_shards
    if feature.spec.table_spec.is_hashed:
      hi = self.stack.rows_per_shard
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
