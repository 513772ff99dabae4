"""Numba kernels of the host-side preprocessor (private).

`fill_buffers` does all the per-SparseCore work of
`preprocess.preprocess_sparse_dense_matmul_input` in one parallel loop over
work items `w = (stack, local device, local SparseCore)`. Every argument is a
flat array prepared (and validated) by `preprocess.py`; the kernel trusts it.

Per work item:

1. Walk the item's rows (features of the stack in `row_offset` order, rows in
   order), computing for every id its physical row in the stack
   `key = p * V_shard + local_row` with `p = (id + rotation) % N` and
   `local_row = id // N + row_offset_in_shard`, its SC-local sample id and its
   gain (weight over the sample's combiner divisor). Each entry is packed as
   `key << 32 | insertion_index`.
2. Stable LSD radix sort by `key` (at most 11 bits per pass). Insertion order
   is monotone in the sample id, so entries end up sorted by
   (partition, local row, sample). Unweighted stacks pack the sample id
   instead of the insertion index (their gain depends on the sample only).
3. Walk the sorted entries once per partition: merge duplicate
   (sample, row) pairs, count pairs and distinct rows (the stats, before
   dropping), apply the drop rule and write the 8-aligned partitions, padding
   every unused slot with `PAD_ID` / `PAD_ID` / NaN.
"""

from __future__ import annotations

import numba
import numpy as np

PAD_ID = 2**31 - 1
_ALIGN = 8
_RADIX_BITS = 11

COMBINER_SUM = 0
COMBINER_MEAN = 1
COMBINER_SQRTN = 2


@numba.njit(cache=True, inline="always")
def _round8(x):
  return (x + (_ALIGN - 1)) // _ALIGN * _ALIGN


@numba.njit(cache=True, inline="always")
def _radix_plan(key_bits):
  """(passes, bits per pass) of an LSD radix sort over `key_bits` bits."""
  if key_bits <= 0:
    return 0, 1
  passes = (key_bits + _RADIX_BITS - 1) // _RADIX_BITS
  return passes, (key_bits + passes - 1) // passes


@numba.njit(cache=True)
def _radix_sort(keys, tmp, n, hist, passes, digit_bits):
  """Stable sort of packed `key << 32 | low` entries of `keys[:n]` by `key`.

  `hist[q]` holds the digit counts of pass `q` (computed by the caller);
  `tmp` is scratch. Returns the array (`keys` or `tmp`) holding the result.
  """
  mask = (1 << digit_bits) - 1
  src = keys
  dst = tmp
  for q in range(passes):
    shift = 32 + q * digit_bits
    counts = hist[q]
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


@numba.njit(cache=True, parallel=True, nogil=True, error_model="numpy")
def fill_buffers(
  values,
  weights,
  row_splits,
  f_row_base,
  f_rows_per_sc,
  f_sample_offset,
  f_local_offset,
  f_shift,
  f_weighted,
  stack_feature_ptr,
  stack_features,
  stack_combiner,
  stack_max_ids,
  stack_max_unique,
  stack_shard_rows,
  stack_key_bits,
  stack_coo_per_sc,
  stack_coo_offset,
  stack_rp_offset,
  stack_weighted,
  stack_samples_per_sc,
  item_size,
  num_local_devices,
  num_sc,
  num_shards,
  log2_shards,
  rp_per_sc,
  allow_id_dropping,
  out_row_pointers,
  out_ids,
  out_sample_ids,
  out_gains,
  obs_ids,
  obs_unique,
  required,
  dropped,
  overflowed,
):
  """Fills the output buffers and per-SC stats of every work item.

  Feature arrays (`f_*`) are indexed by feature, `stack_*` by stack;
  `item_size[w]` is the number of ids of work item `w`. Outputs: `out_*`
  (flat, each stack's block at `stack_*_offset`), `obs_ids` and `obs_unique`
  `[items, N]`, `required`, `dropped`, `overflowed` `[items]`.
  """
  items_per_stack = num_local_devices * num_sc
  num_items = (len(stack_feature_ptr) - 1) * items_per_stack
  pad_gain = np.float32(np.nan)
  for w in numba.prange(num_items):
    t = w // items_per_stack
    sc_global = w % items_per_stack  # d * S + s
    d = sc_global // num_sc
    s = sc_global % num_sc
    n = item_size[w]
    shard_rows = stack_shard_rows[t]
    combiner = stack_combiner[t]
    weighted_stack = stack_weighted[t]
    passes, digit_bits = _radix_plan(stack_key_bits[t])
    mask = (1 << digit_bits) - 1
    keys = np.empty(n, np.int64)
    tmp = np.empty(n, np.int64)
    hist = np.zeros((max(passes, 1), mask + 1), np.int64)
    counts = np.zeros(num_shards, np.int64)
    # Weighted stacks pack the insertion index (gain and sample per entry);
    # unweighted ones pack the sample (one gain per sample).
    entry_sample = np.empty(n if weighted_stack else 0, np.int32)
    entry_gain = np.empty(n if weighted_stack else 0, np.float32)
    sample_gain = np.empty(
      0 if weighted_stack else stack_samples_per_sc[t], np.float32
    )

    # 1. Entries in insertion order, with the radix histograms.
    k = 0
    for fi in range(stack_feature_ptr[t], stack_feature_ptr[t + 1]):
      f = stack_features[fi]
      rows = f_rows_per_sc[f]
      r0 = f_row_base[f] + sc_global * rows
      shift = f_shift[f]
      local_offset = f_local_offset[f]
      weighted = f_weighted[f]
      for r in range(rows):
        a = row_splits[r0 + r]
        b = row_splits[r0 + r + 1]
        sid = f_sample_offset[f] + r
        divisor = 1.0
        if combiner == COMBINER_MEAN:
          if weighted:
            divisor = 0.0
            for j in range(a, b):
              divisor += np.float64(weights[j])
          else:
            divisor = np.float64(b - a)
        elif combiner == COMBINER_SQRTN:
          if weighted:
            sq = 0.0
            for j in range(a, b):
              wj = np.float64(weights[j])
              sq += wj * wj
            divisor = np.sqrt(sq)
          else:
            divisor = np.sqrt(np.float64(b - a))
        unit_gain = np.float32(1.0 / divisor)
        if not weighted_stack:
          sample_gain[sid] = unit_gain
        for j in range(a, b):
          e = np.int64(values[j])
          p = (e + shift) & (num_shards - 1)
          key = p * shard_rows + (e >> log2_shards) + local_offset
          counts[p] += 1
          for q in range(passes):
            hist[q, (key >> (q * digit_bits)) & mask] += 1
          if weighted_stack:
            keys[k] = (key << 32) | k
            entry_sample[k] = sid
            if weighted:
              entry_gain[k] = np.float32(np.float64(weights[j]) / divisor)
            else:
              entry_gain[k] = unit_gain
          else:
            keys[k] = (key << 32) | sid
          k += 1

    # 2. Sort by (partition, local row), stable.
    srt = _radix_sort(keys, tmp, n, hist, passes, digit_bits)

    # 3. Merge, count, drop, write.
    max_ids = stack_max_ids[t]
    max_unique = stack_max_unique[t]
    seg_len = stack_coo_per_sc[t]
    seg = stack_coo_offset[t] + d * (num_sc * seg_len) + s * seg_len
    rp = stack_rp_offset[t] + sc_global * rp_per_sc
    pos = 0
    i = 0
    n_dropped = 0
    n_overflow = 0
    need = 0
    for p in range(num_shards):
      end = i + counts[p]
      pairs = 0
      unique = 0
      prev_key = np.int64(-1)
      prev_sid = -1
      col_ok = True
      kept = False
      written = False
      row_base = p * shard_rows
      while i < end:
        v = srt[i]
        i += 1
        key = v >> 32
        low = v & 0xFFFFFFFF
        if weighted_stack:
          sid = np.int64(entry_sample[low])
          g = entry_gain[low]
        else:
          sid = low
          g = sample_gain[low]
        if key == prev_key and sid == prev_sid:
          if written:
            out_gains[seg + pos - 1] += g
          else:
            n_dropped += 1
            if kept:
              n_overflow += 1
          continue
        pairs += 1
        if key != prev_key:
          unique += 1
          col_ok = unique <= max_unique
          prev_key = key
        prev_sid = sid
        kept = (not allow_id_dropping) or (pairs <= max_ids and col_ok)
        if kept and pos < seg_len:
          out_ids[seg + pos] = key - row_base
          out_sample_ids[seg + pos] = sid
          out_gains[seg + pos] = g
          pos += 1
          written = True
        else:
          written = False
          n_dropped += 1
          if kept:
            n_overflow += 1
      obs_ids[w, p] = pairs
      obs_unique[w, p] = unique
      need += _round8(pairs)
      out_row_pointers[rp + p] = pos
      aligned = _round8(pos)
      for j in range(pos, aligned):
        out_ids[seg + j] = PAD_ID
        out_sample_ids[seg + j] = PAD_ID
        out_gains[seg + j] = pad_gain
      pos = aligned
    for p in range(num_shards, rp_per_sc):
      out_row_pointers[rp + p] = pos
    for j in range(pos, seg_len):
      out_ids[seg + j] = PAD_ID
      out_sample_ids[seg + j] = PAD_ID
      out_gains[seg + j] = pad_gain
    required[w] = need
    dropped[w] = n_dropped
    overflowed[w] = n_overflow
