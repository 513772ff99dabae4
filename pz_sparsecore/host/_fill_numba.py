"""The numba fill of the lookup buffers (private to `fill`).

`fill_buffers` does all the per-SparseCore work of `fill.fill` (one batch of
`preprocess.preprocess_for_plan`) in one parallel loop over work items
`w = (stack, local device, local SparseCore)`. It takes named structures of
flat arrays (`Batch`, `Features`, `Stacks`, `Outputs`) and of scalars
(`Scalars`), prepared and validated by `fill.py`; it trusts them. The
buffer format (alignment, padding) is `buffer_format`'s.

Per work item, in phases:

1. `_pack_entries`: walk the item's rows (features of the stack in
   `row_offset` order, rows in order), computing for every id its physical
   row in the stack `key = p * V_shard + local_row` with
   `p = (id + rotation) % N` and `local_row = id // N + row_offset_in_shard`,
   its SC-local sample id and its gain (weight over the sample's combiner
   divisor). Each entry is packed as `key << 32 | insertion_index`, and the
   radix histograms are taken on the way.
2. `_radix_sort`: stable LSD radix sort by `key` (at most 11 bits per pass).
   Insertion order is monotone in the sample id, so entries end up sorted by
   (partition, local row, sample). Unweighted stacks pack the sample id
   instead of the insertion index (their gain depends on the sample only).
3. `_write_segment` walks the partitions (found by binary search in the
   sorted keys, partition `p` holding keys `[p * V_shard, (p + 1) * V_shard)`):
   `_write_partition` merges
   duplicate (sample, row) pairs, counts pairs and distinct rows (the stats,
   before dropping), applies the drop rule and writes the partition; `_pad`
   fills its alignment gap and, after the last partition, the rest of the
   segment with `PAD_ID` / `PAD_ID` / NaN.

Between 1 and 2, for a plan of one device, `_write_sample_order` copies
the packed entries, still in insertion order (sample-major), into the
forward's sample order (`host.sample_order`).

`fill_buffers` runs `_fill_item` (the phases) for every work item in
parallel; numba threads the `prange` loop and the call releases the GIL.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from pz_sparsecore.core import buffer_format

_RADIX_BITS = 11

COMBINER_SUM = 0
COMBINER_MEAN = 1
COMBINER_SQRTN = 2

# Phases that write through a named structure take it as an argument and are
# ordinary jitted calls: numba's dead-code elimination keeps writes through a
# tuple's arrays only where the tuple is a function argument. Pure helpers
# are inlined. `error_model="numpy"`: a mean over no weights divides by zero.
_phase = numba.njit(cache=True, nogil=True, error_model="numpy")
_inline = numba.njit(cache=True, inline="always")
_round_up = _inline(buffer_format.round_up)


class Batch(NamedTuple):
  """The ids of every stack: every feature's rows end to end.

  Attributes:
    values: int32 or int64 ids.
    weights: float32 weights aligned with `values`, read only for weighted
      features (empty when no feature is weighted).
    row_splits: int64 `[rows + 1]`; row `r` is
      `values[row_splits[r]:row_splits[r + 1]]`.
    item_size: int64 `[items]`, the ids of each work item.
  """

  values: np.ndarray
  weights: np.ndarray
  row_splits: np.ndarray
  item_size: np.ndarray


class Features(NamedTuple):
  """Per feature (stack by stack, in sample order), int64.

  Attributes:
    first_row: The feature's first row in `Batch.row_splits`.
    rows_per_sc: `n_f`, its rows per SparseCore.
    sample_offset: Its first SparseCore-local sample.
    row_offset_in_shard: Its table's first row in every shard.
    shard_rotation: Its table's rotation.
    weighted: bool, whether it has weights.
  """

  first_row: np.ndarray
  rows_per_sc: np.ndarray
  sample_offset: np.ndarray
  row_offset_in_shard: np.ndarray
  shard_rotation: np.ndarray
  weighted: np.ndarray


class Stacks(NamedTuple):
  """Per stack, int64.

  Attributes:
    first_feature: `[T + 1]`; stack `t` has the features
      `[first_feature[t], first_feature[t + 1])`.
    combiner: `COMBINER_SUM`, `COMBINER_MEAN` or `COMBINER_SQRTN`.
    max_ids: `max_ids_per_partition`.
    max_unique: `max_unique_ids_per_partition`.
    rows_per_shard: `V_shard`.
    key_bits: Bits of the largest physical row, `V_shard * N - 1`.
    coo_per_sc: Entries of one SparseCore segment.
    coo_offset: The stack's first entry in `Outputs`' COO buffers.
    row_pointer_offset: Its first entry in `Outputs.row_pointers`.
    samples_per_sc: Samples of one SparseCore.
    weighted: bool, whether any of its features has weights.
  """

  first_feature: np.ndarray
  combiner: np.ndarray
  max_ids: np.ndarray
  max_unique: np.ndarray
  rows_per_shard: np.ndarray
  key_bits: np.ndarray
  coo_per_sc: np.ndarray
  coo_offset: np.ndarray
  row_pointer_offset: np.ndarray
  samples_per_sc: np.ndarray
  weighted: np.ndarray


class Scalars(NamedTuple):
  """The sizes and the drop switch shared by every work item.

  Attributes:
    num_local_devices: L.
    num_sc: S.
    num_shards: N (a power of two).
    log2_shards: log2(N).
    row_pointers_per_sc: `max(N, 8)`.
    allow_id_dropping: Drop pairs over the limits.
    count_raw_ids: Write `Outputs.raw_ids`.
    sample_order: Write `Outputs.order_rows` / `order_gains`.
  """

  num_local_devices: int
  num_sc: int
  num_shards: int
  log2_shards: int
  row_pointers_per_sc: int
  allow_id_dropping: bool
  count_raw_ids: bool
  sample_order: bool


class Outputs(NamedTuple):
  """What the kernel writes.

  Attributes:
    row_pointers: int32, every stack's block at `Stacks.row_pointer_offset`.
    embedding_ids: int32, every stack's block at `Stacks.coo_offset`.
    sample_ids: int32, likewise.
    gains: float32, likewise.
    obs_ids: int32 `[items, N]`, pairs sent to each partition.
    obs_unique: int32 `[items, N]`, distinct rows sent to each partition.
    required: int32 `[items]`, `sum_p r8(pairs_p)`.
    dropped: int64 `[items]`, raw ids dropped.
    overflowed: int64 `[items]`, of which for lack of room.
    raw_ids: int32, like `gains`: the raw ids merged into each entry
      (written only with `Scalars.count_raw_ids`; else empty).
    order_rows: int32, every stack's sample order (`host.sample_order`),
      written only with `Scalars.sample_order` (else empty): per item,
      the start of its output row `sid` at `order_starts[w] + sid` (and
      the device's end after its last SparseCore's rows), the pairs' rows
      at `order_pairs[w] + 2 k`.
    order_gains: float32, the same memory: the pairs' gains at
      `order_pairs[w] + 2 k + 1`.
    order_starts: int64 `[items]`, see `order_rows`.
    order_pairs: int64 `[items]`, see `order_rows`; -1: the item does not
      fit its device's order.
    order_first: int64 `[items]`, the index of the item's first pair
      among its device's pairs.
    order_ok: bool `[items]`, whether the item's samples came in
      non-decreasing order (its pairs then grouped by output row).
  """

  row_pointers: np.ndarray
  embedding_ids: np.ndarray
  sample_ids: np.ndarray
  gains: np.ndarray
  obs_ids: np.ndarray
  obs_unique: np.ndarray
  required: np.ndarray
  dropped: np.ndarray
  overflowed: np.ndarray
  raw_ids: np.ndarray
  order_rows: np.ndarray
  order_gains: np.ndarray
  order_starts: np.ndarray
  order_pairs: np.ndarray
  order_first: np.ndarray
  order_ok: np.ndarray


class _Entries(NamedTuple):
  """One work item's packed entries and sort state."""

  keys: np.ndarray  # key << 32 | low, in insertion order
  tmp: np.ndarray  # radix sort scratch
  hist: np.ndarray  # [passes, 2**digit_bits] digit counts
  sample: np.ndarray  # per entry (weighted stacks)
  gain: np.ndarray  # per entry (weighted stacks)
  sample_gain: np.ndarray  # per sample (unweighted stacks)
  passes: int
  digit_bits: int


class _Segment(NamedTuple):
  """Where and under which limits one work item writes."""

  start: int  # first COO entry of the segment
  size: int
  row_pointers: int  # first row pointer of the segment
  rows_per_shard: int
  max_ids: int
  max_unique: int
  weighted: bool
  allow_id_dropping: bool
  count_raw_ids: bool


@_inline
def _entries(n, stacks, t):
  """Scratch for `n` entries of stack `t`."""
  key_bits = stacks.key_bits[t]
  passes = 0
  digit_bits = 1
  if key_bits > 0:
    passes = (key_bits + _RADIX_BITS - 1) // _RADIX_BITS
    digit_bits = (key_bits + passes - 1) // passes
  weighted = stacks.weighted[t]
  # Weighted stacks pack the insertion index (gain and sample per entry);
  # unweighted ones pack the sample (one gain per sample).
  return _Entries(
    keys=np.empty(n, np.int64),
    tmp=np.empty(n, np.int64),
    hist=np.zeros((max(passes, 1), 1 << digit_bits), np.int64),
    sample=np.empty(n if weighted else 0, np.int32),
    gain=np.empty(n if weighted else 0, np.float32),
    sample_gain=np.empty(
      0 if weighted else stacks.samples_per_sc[t], np.float32
    ),
    passes=passes,
    digit_bits=digit_bits,
  )


@_inline
def _divisor(combiner, weighted, weights, a, b):
  """The combiner divisor of the sample of ids `[a, b)`."""
  if combiner == COMBINER_MEAN:
    if not weighted:
      return np.float64(b - a)
    total = 0.0
    for j in range(a, b):
      total += np.float64(weights[j])
    return total
  if combiner == COMBINER_SQRTN:
    if not weighted:
      return np.sqrt(np.float64(b - a))
    sq = 0.0
    for j in range(a, b):
      wj = np.float64(weights[j])
      sq += wj * wj
    return np.sqrt(sq)
  return 1.0


@_phase
def _pack_entries(batch, features, stacks, scalars, t, sc, entries):
  """Packs the entries of stack `t` on SparseCore `sc` (`d * S + s`)."""
  values, weights, row_splits = batch.values, batch.weights, batch.row_splits
  keys, hist = entries.keys, entries.hist
  passes, digit_bits = entries.passes, entries.digit_bits
  mask = (1 << digit_bits) - 1
  shard_rows = stacks.rows_per_shard[t]
  weighted_stack = stacks.weighted[t]
  last_shard, log2_shards = scalars.num_shards - 1, scalars.log2_shards
  k = 0
  for f in range(stacks.first_feature[t], stacks.first_feature[t + 1]):
    rows = features.rows_per_sc[f]
    r0 = features.first_row[f] + sc * rows
    shift = features.shard_rotation[f]
    local_offset = features.row_offset_in_shard[f]
    weighted = features.weighted[f]
    for r in range(rows):
      a = row_splits[r0 + r]
      b = row_splits[r0 + r + 1]
      # Upstream's sample id: within the SparseCore's samples, even where
      # the offsets come from another batch size (a plan not for tables).
      sid = (features.sample_offset[f] + r) % stacks.samples_per_sc[t]
      divisor = _divisor(stacks.combiner[t], weighted, weights, a, b)
      unit_gain = np.float32(1.0 / divisor)
      if not weighted_stack:
        entries.sample_gain[sid] = unit_gain
      for j in range(a, b):
        e = np.int64(values[j])
        p = (e + shift) & last_shard
        key = p * shard_rows + (e >> log2_shards) + local_offset
        for q in range(passes):
          hist[q, (key >> (q * digit_bits)) & mask] += 1
        if weighted_stack:
          keys[k] = (key << 32) | k
          entries.sample[k] = sid
          if weighted:
            entries.gain[k] = np.float32(np.float64(weights[j]) / divisor)
          else:
            entries.gain[k] = unit_gain
        else:
          keys[k] = (key << 32) | sid
        k += 1


@_phase
def _write_sample_order(w, entries, n, weighted, samples, capacity, last, out):
  """Copies item `w`'s `n` packed entries, in insertion order, into its
  part of the sample order: per entry its physical row (the table row of a
  one-device plan) and gain; per output row of its `samples` the index of
  its first pair (with `last`, the SparseCore last on its device, also the
  end, and zeros in the device's unused pairs of its `capacity`). Records
  whether the samples never decreased (else the order is not used)."""
  starts, pairs = out.order_starts[w], out.order_pairs[w]
  first = out.order_first[w]
  if pairs < 0:
    return
  row = 0  # The first output row whose start is not written yet.
  for k in range(n):
    v = entries.keys[k]
    low = v & 0xFFFFFFFF
    if weighted:
      sid = np.int64(entries.sample[low])
      g = entries.gain[low]
    else:
      sid = low
      g = entries.sample_gain[low]
    if sid < row - 1:
      out.order_ok[w] = False
      return
    while row <= sid:
      out.order_rows[starts + row] = first + k
      row += 1
    out.order_rows[pairs + 2 * k] = v >> 32
    out.order_gains[pairs + 2 * k + 1] = g
  while row < samples + last:
    out.order_rows[starts + row] = first + n
    row += 1
  if last:  # The device's unused pairs: zeros, every value defined.
    out.order_rows[pairs + 2 * n : pairs + 2 * (capacity - first)] = 0
  out.order_ok[w] = True


@_phase
def _radix_sort(entries, n):
  """Stable sort of the first `n` packed entries by `key`.

  Consumes the digit counts in `entries.hist`. Returns the array (`keys` or
  `tmp`) holding the result.
  """
  digit_bits = entries.digit_bits
  mask = (1 << digit_bits) - 1
  src = entries.keys
  dst = entries.tmp
  for q in range(entries.passes):
    shift = 32 + q * digit_bits
    counts = entries.hist[q]
    if n == 0 or counts[(src[0] >> shift) & mask] == n:
      continue  # All in one bucket: nothing would move.
    total = 0
    for b in range(mask + 1):
      c = counts[b]
      counts[b] = total
      total += c
    for i in range(n):
      v = src[i]
      b = (v >> shift) & mask
      dst[counts[b]] = v
      counts[b] += 1
    src, dst = dst, src
  return src


@_inline
def _segment(stacks, scalars, t, sc):
  """Where stack `t`'s SparseCore `sc` writes, and its limits."""
  size = stacks.coo_per_sc[t]
  return _Segment(
    start=stacks.coo_offset[t] + sc * size,
    size=size,
    row_pointers=stacks.row_pointer_offset[t]
    + sc * scalars.row_pointers_per_sc,
    rows_per_shard=stacks.rows_per_shard[t],
    max_ids=stacks.max_ids[t],
    max_unique=stacks.max_unique[t],
    weighted=stacks.weighted[t],
    allow_id_dropping=scalars.allow_id_dropping,
    count_raw_ids=scalars.count_raw_ids,
  )


@_phase
def _write_partition(srt, i, end, pos, row_base, entries, seg, out):
  """Merges, counts, drops and writes the sorted entries `[i, end)`.

  Writes from segment position `pos` on. Returns the position after the last
  written entry, the (sample, row) pairs and distinct rows seen, the raw ids
  dropped and, of those, the ones dropped for lack of room.
  """
  pairs = unique = dropped = overflowed = 0
  prev_key = np.int64(-1)
  prev_sid = np.int64(-1)
  col_ok = True
  kept = False
  written = False
  while i < end:
    v = srt[i]
    i += 1
    key = v >> 32
    low = v & 0xFFFFFFFF
    if seg.weighted:
      sid = np.int64(entries.sample[low])
      g = entries.gain[low]
    else:
      sid = low
      g = entries.sample_gain[low]
    if key == prev_key and sid == prev_sid:
      if written:
        out.gains[seg.start + pos - 1] += g
        if seg.count_raw_ids:
          out.raw_ids[seg.start + pos - 1] += 1
      else:
        dropped += 1
        if kept:
          overflowed += 1
      continue
    pairs += 1
    if key != prev_key:
      unique += 1
      col_ok = unique <= seg.max_unique
      prev_key = key
    prev_sid = sid
    kept = (not seg.allow_id_dropping) or (pairs <= seg.max_ids and col_ok)
    written = kept and pos < seg.size
    if written:
      out.embedding_ids[seg.start + pos] = key - row_base
      out.sample_ids[seg.start + pos] = sid
      out.gains[seg.start + pos] = g
      if seg.count_raw_ids:
        out.raw_ids[seg.start + pos] = 1
      pos += 1
    else:
      dropped += 1
      if kept:
        overflowed += 1
  return pos, pairs, unique, dropped, overflowed


@_phase
def _pad(out, start, stop):
  """Fills COO entries `[start, stop)` with the padding values."""
  for j in range(start, stop):
    out.embedding_ids[j] = buffer_format.PAD_ID
    out.sample_ids[j] = buffer_format.PAD_ID
    out.gains[j] = buffer_format.PAD_GAIN


@_phase
def _write_segment(w, srt, entries, seg, scalars, out):
  """Writes work item `w`'s partitions, row pointers, padding and stats."""
  num_shards = scalars.num_shards
  pos = i = dropped = overflowed = need = 0
  for p in range(num_shards):
    end = len(srt)
    if p < num_shards - 1:
      end = np.searchsorted(srt, ((p + 1) * seg.rows_per_shard) << 32)
    pos, pairs, unique, d, o = _write_partition(
      srt, i, end, pos, p * seg.rows_per_shard, entries, seg, out
    )
    i = end
    dropped += d
    overflowed += o
    out.obs_ids[w, p] = pairs
    out.obs_unique[w, p] = unique
    need += _round_up(pairs)
    out.row_pointers[seg.row_pointers + p] = pos
    aligned = _round_up(pos)
    _pad(out, seg.start + pos, seg.start + aligned)
    pos = aligned
  rp_end = seg.row_pointers + scalars.row_pointers_per_sc
  out.row_pointers[seg.row_pointers + num_shards : rp_end] = pos
  _pad(out, seg.start + pos, seg.start + seg.size)
  out.required[w] = need
  out.dropped[w] = dropped
  out.overflowed[w] = overflowed


@_phase
def _fill_item(w, batch, features, stacks, scalars, out):
  """Fills work item `w`: pack, sort, then merge, drop and write."""
  items_per_stack = scalars.num_local_devices * scalars.num_sc
  t = w // items_per_stack
  sc = w % items_per_stack  # d * S + s
  n = batch.item_size[w]
  entries = _entries(n, stacks, t)
  _pack_entries(batch, features, stacks, scalars, t, sc, entries)
  if scalars.sample_order:
    last = sc % scalars.num_sc == scalars.num_sc - 1
    _write_sample_order(
      w,
      entries,
      n,
      stacks.weighted[t],
      stacks.samples_per_sc[t],
      stacks.coo_per_sc[t] * scalars.num_sc,
      last,
      out,
    )
  srt = _radix_sort(entries, n)
  seg = _segment(stacks, scalars, t, sc)
  _write_segment(w, srt, entries, seg, scalars, out)


@numba.njit(cache=True, parallel=True, nogil=True)
def fill_buffers(batch, features, stacks, scalars, out):
  """Fills the output buffers and per-SparseCore stats of every work item.

  Args:
    batch: The ids (`Batch`).
    features: Per feature (`Features`).
    stacks: Per stack (`Stacks`).
    scalars: The sizes (`Scalars`).
    out: Where to write (`Outputs`).
  """
  # The work item is a function of its own, not the loop body: a parfor
  # loses the writes through arrays held in a tuple (numba issue 5872).
  num_stacks = len(stacks.first_feature) - 1
  num_items = num_stacks * scalars.num_local_devices * scalars.num_sc
  for w in numba.prange(num_items):
    _fill_item(w, batch, features, stacks, scalars, out)
