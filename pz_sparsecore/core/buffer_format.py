"""The CSR-wrapped COO buffer format: its constants, sizes and decoding.

Every module that writes, routes, reads or draws the lookup buffers takes
the format's facts from here: the partition alignment, the padding values,
the number of row pointers and COO entries per device, and how row pointers
decode into partition ranges.

Per stack, per device, per SparseCore segment (`N` partitions, `S`
SparseCores per device, `r8(x)` = `x` rounded up to :data:`ALIGNMENT`):

* `row_pointers`: `max(N, 8)` entries; entry `p < N` is the unaligned end of
  partition `p`, which starts at `r8(rp[p - 1])` (0 for `p = 0`); entries
  past `N` repeat the final aligned offset.
* `embedding_ids`, `sample_ids`, `gains`: one segment of `C_dev / S` entries,
  the partitions in order, each starting at a multiple of 8, unused slots
  holding :data:`PAD_ID` / :data:`PAD_ID` / NaN.

Example, one segment, `N = 2`::

  row_pointers  = [3, 10, 16, 16, 16, 16, 16, 16]
  partitions    = [0, 3) and [8, 10)          # r8(3) = 8
  valid entries = 3 + 2 = 5

`C_dev` is `r8(max_ids_per_partition) * S * N` (no batch can overflow it),
or a suggested size rounded up to a multiple of `8 * S`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ALIGNMENT = 8
"""Every partition of a segment starts at a multiple of this many entries;
every table's padded vocabulary per shard and padded width are multiples of
it too."""

MAX_MINIBATCHES = 64
"""Minibatched buffers hold this many minibatches at most (upstream's
`kMaxMinibatchingBuckets`), and minibatching hashes rows into this many
buckets: each minibatch is a run of consecutive buckets. Minibatched
buffers' sizes are per-minibatch sizes times it."""

MAX_LOCAL_BATCH_PER_DEVICE = 2**26 - 1
"""The most samples one device's share of a stack may hold (its features'
local rows over the local devices, summed). Upstream's preprocessing sorts
on a 64-bit key with 26 bits for them and refuses more; keeping its limit
keeps a batch accepted here accepted there, and keeps a device's COO
offsets in int32 up to 32 ids per sample."""

PAD_ID = 2**31 - 1
"""Padding value of `embedding_ids` and `sample_ids`."""

PAD_GAIN = np.float32(np.nan)
"""Padding value of `gains`."""


def round_up(value: Any, multiple: int = ALIGNMENT) -> Any:
  """`value` (an int or an integer array) rounded up to `multiple`."""
  return -(-value // multiple) * multiple


def num_shards(global_device_count: int, num_sc_per_device: int) -> int:
  """The number of table shards `N = devices x SparseCores`, validated.

  Raises:
    ValueError: If either count is not a positive integer or N is not a power
      of two.
  """
  for name, value in (
    ("global_device_count", global_device_count),
    ("num_sc_per_device", num_sc_per_device),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value <= 0:
      raise ValueError(f"{name} must be greater than 0, got {value!r}")
  n = int(global_device_count) * int(num_sc_per_device)
  if n & (n - 1):
    raise ValueError(
      f"the total number of SparseCores (devices x SparseCores = "
      f"{global_device_count} x {num_sc_per_device} = {n}) must be a power "
      "of 2"
    )
  return n


def row_pointers_per_sc(num_shards: int) -> int:
  """Row pointers of one SparseCore segment: `max(N, 8)`."""
  return max(num_shards, ALIGNMENT)


def compute_row_pointers_size_per_device(
  global_device_count: int, num_sc_per_device: int
) -> int:
  """Row pointers per device: `max(N, 8) * num_sc_per_device`.

  Raises:
    ValueError: If `N = global_device_count * num_sc_per_device` is not a
      power of two.
  """
  n = num_shards(global_device_count, num_sc_per_device)
  return row_pointers_per_sc(n) * num_sc_per_device


def compute_theoretical_max_coo_buffer_size(
  max_ids_per_partition: int,
  global_device_count: int,
  num_sc_per_device: int,
  minibatches: int = 1,
) -> int:
  """The COO buffer per device that no batch can overflow.

  Returns:
    `r8(max_ids_per_partition) * S * N`, times `minibatches` (each
    minibatch keeps the limit).
  """
  n = num_shards(global_device_count, num_sc_per_device)
  return round_up(max_ids_per_partition) * num_sc_per_device * n * minibatches


def coo_buffer_size_per_device(
  stack_name: str,
  max_ids_per_partition: int,
  suggested_size: int | None,
  global_device_count: int,
  num_sc_per_device: int,
  minibatches: int = 1,
) -> int:
  """A stack's COO entries per device: the theoretical maximum (for up to
  `minibatches` minibatches), or the suggested size rounded up to a
  multiple of `8 * S`.

  Raises:
    ValueError: If the suggested size exceeds the theoretical maximum.
  """
  c_max = compute_theoretical_max_coo_buffer_size(
    max_ids_per_partition, global_device_count, num_sc_per_device, minibatches
  )
  if suggested_size is None:
    return c_max
  size = round_up(suggested_size, ALIGNMENT * num_sc_per_device)
  if size > c_max:
    raise ValueError(
      f"stack {stack_name!r}: suggested_coo_buffer_size_per_device="
      f"{suggested_size} (rounded to {size}) exceeds the theoretical maximum "
      f"{c_max} = r8(max_ids_per_partition={max_ids_per_partition})"
      f" x {num_sc_per_device} SparseCores x "
      f"{global_device_count * num_sc_per_device} partitions"
      + (f" x {minibatches} minibatches" if minibatches > 1 else "")
    )
  return size


def routing_window(num_sc_per_device: int, limit: int) -> int:
  """Entries one SparseCore segment can send one device: `S * r8(limit)`.

  With `limit` a stack's `max_ids_per_partition` this is the activation
  exchange's window of entries; with its `max_unique_ids_per_partition`,
  the row exchange's window of distinct rows (`S` partitions per device,
  each 8-aligned).
  """
  return int(num_sc_per_device) * round_up(int(limit))


def partition_starts(ends: Any, xp: Any = np) -> Any:
  """Start of every partition from the ends `[..., P]` of one segment.

  Partition `p` starts at the aligned end of partition `p - 1` (0 for the
  first). Works on numpy (`xp=np`) and `jax.numpy` (`xp=jnp`) arrays.
  """
  zeros = xp.zeros(ends.shape[:-1] + (1,), ends.dtype)
  return xp.concatenate([zeros, round_up(ends[..., :-1])], axis=-1)


def count_valid_entries(
  row_pointers: np.ndarray, embedding_ids: np.ndarray, num_shards: int | None
) -> int:
  """Valid COO entries of one stack's concrete buffers.

  Args:
    row_pointers: The stack's row pointers, one block of `max(N, 8)` per
      SparseCore segment.
    embedding_ids: The stack's ids (read only as a fallback).
    num_shards: N; inferred from the number of row pointers when None (the
      global buffers of `N` segments hold `N * max(N, 8)` of them).

  Returns:
    The entries the row pointers delimit, or the ids that are not `PAD_ID`
    when the row pointers do not decode as `N` well-formed segments.
  """
  rp = np.asarray(row_pointers).astype(np.int64).reshape(-1)
  n = num_shards or _infer_num_shards(rp.size)
  if n is not None and rp.size == n * row_pointers_per_sc(n):
    ends = rp.reshape(n, row_pointers_per_sc(n))
    used = ends[:, :n] - partition_starts(ends[:, :n])
    tail_ok = np.all(ends[:, n:] == round_up(ends[:, n - 1 : n]))
    if np.all(used >= 0) and tail_ok:
      return int(used.sum())
  return int(np.count_nonzero(np.asarray(embedding_ids) != PAD_ID))


def _infer_num_shards(num_row_pointers: int) -> int | None:
  """N with `N * max(N, 8) == num_row_pointers`, or None."""
  n = 1
  while n * row_pointers_per_sc(n) <= num_row_pointers:
    if n * row_pointers_per_sc(n) == num_row_pointers:
      return n
    n *= 2
  return None
