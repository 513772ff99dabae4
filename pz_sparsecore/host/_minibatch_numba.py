"""The numba half of minibatching (private to `minibatching`).

Both phases read the first pass: the buffers `fill.fill` wrote with
the limits lifted (every SparseCore segment holds all its merged entries,
partitions in order, each sorted by (local row, sample)) and the raw ids
merged into each entry.

* `count_buckets` (per work item `w` = (stack, local device, SparseCore)):
  puts every entry in its bucket, `HighwayHash(col_id) & 63` with
  `col_id = local_row * N + partition` (with `use_buckets=False`, all in
  bucket 0), orders each partition's entries by (bucket, position), and
  counts per (partition, bucket) the entries and the distinct rows; then
  the item's split, `split_of` of every partition's counts against the
  stack's limits, OR-ed.
* `write_minibatches` (per (stack, local device)): lays out the segments
  of SparseCore 0's minibatches, then SparseCore 1's, and so on, in one
  run over the device's COO buffer, as upstream's `FillBufferSegment`:
  row pointers hold absolute ends, every partition starts 8-aligned, a
  bucket keeps the entries within its limits (with `allow_id_dropping`),
  and a buffer that fills up drops the rest of the entries.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core.buffer_format import MAX_MINIBATCHES
from pz_sparsecore.host import _highwayhash

_njit = numba.njit(cache=True, nogil=True)
_round_up = numba.njit(cache=True, inline="always")(buffer_format.round_up)


class FirstPass(NamedTuple):
  """The first pass's buffers and where every work item's segment lies.

  Attributes:
    row_pointers: int32, relative ends, `row_pointers_per_sc` per item.
    embedding_ids, sample_ids, gains: The merged entries.
    raw_ids: int32, raw ids merged into each entry.
    coo_start: int64 `[items]`, each item's first entry.
    rp_start: int64 `[items]`, each item's first row pointer.
  """

  row_pointers: np.ndarray
  embedding_ids: np.ndarray
  sample_ids: np.ndarray
  gains: np.ndarray
  raw_ids: np.ndarray
  coo_start: np.ndarray
  rp_start: np.ndarray


class Buckets(NamedTuple):
  """What `count_buckets` writes.

  Attributes:
    order: int32 like `FirstPass.gains`: per partition, the positions of
      its entries (relative to the item's segment) in (bucket, position)
      order.
    starts: int32 `[items, N, 65]`: bucket `b` of partition `p` holds
      `order[p_start + starts[w, p, b] : p_start + starts[w, p, b + 1]]`.
    unique: int32 `[items, N, 64]`: distinct rows per bucket.
    split: int64 `[items]`: the item's split bits.
  """

  order: np.ndarray
  starts: np.ndarray
  unique: np.ndarray
  split: np.ndarray


@_njit
def split_of(counts: np.ndarray, limit: int) -> np.int64:
  """Upstream's `ComputeMinibatchingSplit` of 64 bucket counts.

  Walks the binary tree over the buckets bottom up; a node whose children
  sum over `limit` is split (its bit set, in level order) and keeps the
  larger child, else the children are added. `counts` is overwritten.
  """
  split = np.int64(0)
  index = 0
  size = 2
  while size <= MAX_MINIBATCHES:
    for i in range(0, MAX_MINIBATCHES, size):
      left = counts[i]
      right = counts[i + size // 2]
      if left + right > limit:
        split |= np.int64(1) << index
        counts[i] = max(left, right)
      else:
        counts[i] = left + right
      index += 1
    size *= 2
  return split


@_njit
def _partition_range(first, rp_start, p):
  """Entries `[start, end)` of partition `p` of a first-pass segment."""
  end = first.row_pointers[rp_start + p]
  start = 0 if p == 0 else _round_up(first.row_pointers[rp_start + p - 1])
  return start, end


@_njit
def _count_item(w, first, num_shards, use_buckets, max_ids, max_unique, out):
  base, rp = first.coo_start[w], first.rp_start[w]
  seed = _highwayhash.bucket_seed()
  ids = np.zeros(MAX_MINIBATCHES, np.int32)
  split = np.int64(0)
  for p in range(num_shards):
    start, end = _partition_range(first, rp, p)
    ids[:] = 0
    uniq = out.unique[w, p]
    prev_row = np.int64(-1)
    bucket = np.empty(end - start, np.int32)
    for j in range(start, end):
      row = np.int64(first.embedding_ids[base + j])
      b = 0
      if use_buckets:
        b = _highwayhash.bucket_of(seed, np.int32(row * num_shards + p))
      bucket[j - start] = b
      ids[b] += 1
      if row != prev_row:
        uniq[b] += 1
        prev_row = row
    starts = out.starts[w, p]
    starts[0] = 0
    for b in range(MAX_MINIBATCHES):
      starts[b + 1] = starts[b] + ids[b]
    fill = starts[:MAX_MINIBATCHES].copy()
    for j in range(start, end):
      b = bucket[j - start]
      out.order[base + start + fill[b]] = j
      fill[b] += 1
    split |= split_of(ids, max_ids)
    split |= split_of(uniq.copy(), max_unique)
  out.split[w] = split


@numba.njit(cache=True, nogil=True, parallel=True)
def count_buckets(first, item_stack, num_shards, use_buckets, limits, out):
  """Buckets, orders and counts every item's entries; its split bits.

  Args:
    first: The `FirstPass`.
    item_stack: int64 `[items]`, each item's stack.
    num_shards: N.
    use_buckets: Hash into 64 buckets (else everything is bucket 0).
    limits: int64 `[stacks, 2]`: max ids and max unique ids.
    out: The `Buckets` to write (`unique` zeroed).
  """
  for w in numba.prange(len(item_stack)):
    t = item_stack[w]
    _count_item(
      w, first, num_shards, use_buckets, limits[t, 0], limits[t, 1], out
    )


class Layout(NamedTuple):
  """Where one (stack, local device) pair writes, and its limits.

  Attributes:
    first_item: int64 `[pairs]`, the pair's SparseCore 0 work item.
    rp_start: int64 `[pairs]`, its first output row pointer.
    coo_start: int64 `[pairs]`, its first output COO entry.
    coo_size: int64 `[pairs]`, its COO entries per device.
    limits: int64 `[pairs, 2]`: max ids and max unique ids.
    groups: int64 `[M + 1]`: minibatch `g` holds buckets
      `[groups[g], groups[g + 1])`.
  """

  first_item: np.ndarray
  rp_start: np.ndarray
  coo_start: np.ndarray
  coo_size: np.ndarray
  limits: np.ndarray
  groups: np.ndarray


class Output(NamedTuple):
  """The minibatched buffers (flat, every stack's block) and drop counts.

  Attributes:
    row_pointers, embedding_ids, sample_ids, gains: The buffers.
    dropped: int64 `[pairs]`, raw ids over a bucket's limits.
    overflowed: int64 `[pairs]`, entries that found no room.
  """

  row_pointers: np.ndarray
  embedding_ids: np.ndarray
  sample_ids: np.ndarray
  gains: np.ndarray
  dropped: np.ndarray
  overflowed: np.ndarray


@_njit
def _kept_entries(w, p, b0, b1, first, buckets, max_ids, max_unique, drop):
  """Partition `p`'s entries of buckets `[b0, b1)` that a bucket keeps
  (positions relative to the item's segment) and the raw ids dropped."""
  base = first.coo_start[w]
  start, _ = _partition_range(first, first.rp_start[w], p)
  starts = buckets.starts[w, p]
  kept = np.empty(starts[b1] - starts[b0], np.int64)
  n = 0
  dropped = 0
  for b in range(b0, b1):
    unique = 0
    prev_row = np.int64(-1)
    for i in range(starts[b + 1] - starts[b]):
      j = buckets.order[base + start + starts[b] + i]
      row = np.int64(first.embedding_ids[base + j])
      if row != prev_row:
        unique += 1
        prev_row = row
      if drop and (i >= max_ids or unique > max_unique):
        dropped += first.raw_ids[base + j]
      else:
        kept[n] = j
        n += 1
  return kept[:n], dropped


class _Cursor(NamedTuple):
  """Upstream's fill state in one segment: row pointer, COO index,
  partition, and the entries processed of `total`."""

  row: int
  coo: int
  partition: int
  processed: int


@_njit
def _room(row, coo, processed, total, row_end, coo_end):
  """Upstream's `ValidIndices`: whether the fill may go on."""
  if processed == total and coo == coo_end:
    return True
  return row < row_end and coo < coo_end


@_njit
def _pad_to_alignment(out, base, coo, coo_end):
  """Pads from `coo` to the next multiple of 8 (at most `coo_end`)."""
  while coo % buffer_format.ALIGNMENT != 0 and coo < coo_end:
    out.embedding_ids[base + coo] = buffer_format.PAD_ID
    out.sample_ids[base + coo] = buffer_format.PAD_ID
    out.gains[base + coo] = buffer_format.PAD_GAIN
    coo += 1
  return coo


@_njit
def _advance(c, target, total, row_end, seg, out):
  """Closes partitions up to `target`: writes each one's end and pads the
  next start to alignment, while there is room (upstream's
  `AdvanceAndPadPartitions`)."""
  row, coo, part = c.row, c.coo, c.partition
  while part < target:
    if not _room(row, coo, c.processed, total, row_end, seg.coo_end):
      break
    out.row_pointers[seg.rp_base + row] = coo
    row += 1
    coo = _pad_to_alignment(out, seg.coo_base, coo, seg.coo_end)
    part += 1
  return _Cursor(row, coo, part, c.processed)


class _Pair(NamedTuple):
  """One (stack, local device) pair's output block and limits."""

  rp_base: int
  coo_base: int
  coo_end: int
  max_ids: int
  max_unique: int
  drop: bool


@_njit
def _segment(w, k, b0, b1, coo, first, buckets, seg, num_shards, rpp, out):
  """Fills segment `k` (item `w`, buckets `[b0, b1)`) from COO index `coo`
  (relative to the pair's block, as its row pointers are); returns the
  index after it, the raw ids dropped and the entries that found no room.
  """
  parts = []
  dropped = total = 0
  for p in range(num_shards):
    kept, d = _kept_entries(
      w, p, b0, b1, first, buckets, seg.max_ids, seg.max_unique, seg.drop
    )
    parts.append(kept)
    dropped += d
    total += len(kept)
  row_end = (k + 1) * rpp
  c = _Cursor(k * rpp, coo, 0, 0)
  src = first.coo_start[w]
  overflowed = 0
  for p in range(num_shards):
    for j in parts[p]:
      c = _advance(c, p, total, row_end, seg, out)
      if not _room(c.row, c.coo, c.processed, total, row_end, seg.coo_end):
        overflowed = total - c.processed
        break
      at = seg.coo_base + c.coo
      out.embedding_ids[at] = first.embedding_ids[src + j]
      out.sample_ids[at] = first.sample_ids[src + j]
      out.gains[at] = first.gains[src + j]
      c = _Cursor(c.row, c.coo + 1, c.partition, c.processed + 1)
    if overflowed:
      break
  c = _advance(c, num_shards, total, row_end, seg, out)
  out.row_pointers[seg.rp_base + c.row : seg.rp_base + row_end] = c.coo
  return c.coo, dropped, overflowed


@_njit
def _write_pair(q, first, buckets, lay, num_sc, num_shards, rpp, drop, out):
  seg = _Pair(
    rp_base=lay.rp_start[q],
    coo_base=lay.coo_start[q],
    coo_end=lay.coo_size[q],
    max_ids=lay.limits[q, 0],
    max_unique=lay.limits[q, 1],
    drop=drop,
  )
  num_minibatches = len(lay.groups) - 1
  coo = dropped = overflowed = 0
  for s in range(num_sc):
    w = lay.first_item[q] + s
    for g in range(num_minibatches):
      k = s * num_minibatches + g
      coo, d, o = _segment(
        w,
        k,
        lay.groups[g],
        lay.groups[g + 1],
        coo,
        first,
        buckets,
        seg,
        num_shards,
        rpp,
        out,
      )
      dropped += d
      overflowed += o
      coo = _pad_to_alignment(out, seg.coo_base, coo, seg.coo_end)
  # Upstream leaves the rest undefined: empty segments and padding here.
  rp_end = num_sc * MAX_MINIBATCHES * rpp
  out.row_pointers[
    seg.rp_base + num_sc * num_minibatches * rpp : seg.rp_base + rp_end
  ] = coo
  for j in range(coo, seg.coo_end):
    out.embedding_ids[seg.coo_base + j] = buffer_format.PAD_ID
    out.sample_ids[seg.coo_base + j] = buffer_format.PAD_ID
    out.gains[seg.coo_base + j] = buffer_format.PAD_GAIN
  out.dropped[q] = dropped
  out.overflowed[q] = overflowed


@numba.njit(cache=True, nogil=True, parallel=True)
def write_minibatches(first, buckets, lay, num_sc, num_shards, rpp, drop, out):
  """Writes every (stack, local device) pair's minibatched buffers.

  Args:
    first: The `FirstPass`.
    buckets: `count_buckets`' output.
    lay: The `Layout`.
    num_sc: S.
    num_shards: N.
    rpp: Row pointers per segment, `max(N, 8)`.
    drop: Drop entries over a bucket's limits.
    out: The `Output` to write.
  """
  for q in numba.prange(len(lay.first_item)):
    _write_pair(q, first, buckets, lay, num_sc, num_shards, rpp, drop, out)
