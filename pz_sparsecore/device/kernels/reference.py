"""Pure-JAX reference of the sparse-dense matmul and its fused backward.

This is the test oracle for the C++ handlers and the fallback on platforms
without a compiled handler. It decodes the CSR-wrapped COO buffers into a
per-entry validity mask, table row and output row with ``jnp`` ops, gathers
with ``jnp.take`` and reduces with ``jax.ops.segment_sum``; invalid entries
(padding, out-of-range ids or sample ids, partitions outside the table) are
masked out, never clamped.

The backward forms each referenced row's gradient from the unique rows of the
batch (a sort of the entries by row), so its work and memory are
O(entries x dim), never O(vocabulary). It then applies the optimizer's row
update from the registry (``pz_sparsecore.core.optimizers``, whose
docstrings write each optimizer's equations), the only copy of the
equations in Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pz_sparsecore.core import buffer_format, optimizers
from pz_sparsecore.device.kernels import contract


def decode_entries(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  shape: contract.BufferShape,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Decodes the buffers into per-entry (valid, table_row, output_row).

  Args:
    row_pointers: int32 ``[num_segments * rp_stride]``.
    embedding_ids: int32 ``[num_segments * seg_len]``.
    sample_ids: int32 ``[num_segments * seg_len]``.
    shape: The validated buffer shape.

  Returns:
    A bool mask of valid entries, each entry's row in the table, and its
    output row ``segment * samples_per_segment + sample_id``; the rows of
    invalid entries are ``num_rows`` and ``num_outputs`` (out of range).
  """
  rp = row_pointers.reshape(shape.num_segments, shape.rp_stride)
  # Clamping before rounding avoids int32 overflow and keeps empty ranges
  # empty: a start at or past seg_len can never hold an entry.
  ends = jnp.clip(rp[:, : shape.num_partitions], 0, shape.seg_len)
  starts = buffer_format.partition_starts(ends, xp=jnp)
  offsets = jnp.arange(shape.seg_len, dtype=jnp.int32)
  # Partition of each offset: the last one starting at or before it.
  part = (
    jax.vmap(lambda s: jnp.searchsorted(s, offsets, side="right"))(starts) - 1
  )
  part_end = jnp.take_along_axis(ends, jnp.maximum(part, 0), axis=1)
  in_partition = (part >= 0) & (offsets[None, :] < part_end)
  local = part - shape.partition_begin
  in_table = (local >= 0) & (local < shape.num_table_partitions)
  ids = embedding_ids.reshape(shape.num_segments, shape.seg_len)
  sids = sample_ids.reshape(shape.num_segments, shape.seg_len)
  valid = (
    in_partition
    & in_table
    & (ids != buffer_format.PAD_ID)
    & (ids >= 0)
    & (ids < shape.rows_per_partition)
    & (sids >= 0)
    & (sids < shape.samples_per_segment)
  )
  table_row = jnp.where(
    valid, local * shape.rows_per_partition + ids, shape.num_rows
  )
  segment = jnp.arange(shape.num_segments, dtype=jnp.int32)[:, None]
  out_row = jnp.where(
    valid, segment * shape.samples_per_segment + sids, shape.num_outputs
  )
  return valid.reshape(-1), table_row.reshape(-1), out_row.reshape(-1)


def quantize(
  values: jax.Array, quantization: tuple[float, float, int]
) -> jax.Array:
  """Table values as a quantized lookup reads them.

  `(min_value, max_value, num_buckets)`: a value is clipped to
  `[min_value, max_value]` and rounded (half to even) to the nearest of the
  `num_buckets` evenly spaced levels `min_value + k * step`, `step =
  (max_value - min_value) / (num_buckets - 1)`, all in float32.
  """
  lo, hi, buckets = quantization
  lo, hi = jnp.float32(lo), jnp.float32(hi)
  step = (hi - lo) / jnp.float32(buckets - 1)
  level = jnp.round((jnp.clip(values, lo, hi) - lo) / step)
  return lo + level * step


def sparse_dense_matmul(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  shape: contract.BufferShape,
  quantization: tuple[float, float, int] | None = None,
) -> jax.Array:
  """Reference forward: ``out[k * B + sid] += gain * table[row]``.

  Args:
    row_pointers: int32 row pointers.
    embedding_ids: int32 rows inside each partition's shard.
    sample_ids: int32 segment-local sample ids.
    gains: float32 gains.
    table: float32 ``[num_rows, dim]`` table holding the call's partitions.
    shape: The validated buffer shape.
    quantization: None, or `(min_value, max_value, num_buckets)`: the rows
      are read through :func:`quantize`.

  Returns:
    float32 ``[num_segments * samples_per_segment, dim]`` activations.
  """
  valid, table_row, out_row = decode_entries(
    row_pointers, embedding_ids, sample_ids, shape
  )
  rows = jnp.take(table, table_row, axis=0, mode="fill", fill_value=0)
  rows = rows.astype(jnp.float32)  # A 16-bit table's rows, widened.
  if quantization is not None:
    rows = quantize(rows, quantization)
  contrib = jnp.where(valid[:, None], gains[:, None] * rows, 0.0)
  return jax.ops.segment_sum(
    contrib, out_row, num_segments=shape.num_outputs
  ).astype(jnp.float32)


def _sum_by_row(
  table_row: jax.Array, contrib: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
  """Sums per-entry gradients by table row.

  Groups the entries by row with a sort, not a vocabulary-sized scatter.

  Returns:
    ``(uniq, grads)``, one element per entry: the distinct rows in order,
    then ``num_rows`` (out of range); and each distinct row's gradient.
  """
  num_entries = table_row.shape[0]
  order = jnp.argsort(table_row, stable=True)
  sorted_rows = table_row[order]
  starts = jnp.concatenate(
    [jnp.ones((1,), bool), sorted_rows[1:] != sorted_rows[:-1]]
  )
  group = jnp.cumsum(starts) - 1
  grads = jax.ops.segment_sum(contrib[order], group, num_segments=num_entries)
  uniq = (
    jnp.full((num_entries,), num_rows, jnp.int32).at[group].set(sorted_rows)
  )
  return uniq, grads


def sparse_dense_matmul_grad(
  activation_grad: jax.Array,
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  slots: Sequence[jax.Array],
  shape: contract.BufferShape,
  *,
  optimizer: str | optimizers.Optimizer,
  hyperparameters: jax.Array,
  clip: tuple[float, float] | None = None,
  static_attributes: Mapping[str, Any] | None = None,
  rounding_seed: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Reference fused backward: row gradients, then one optimizer step per row.

  A 16-bit table's rows are widened to float32, updated, and stored by
  :func:`stochastic_round` seeded with ``rounding_seed``, numbering the rows
  from ``partition_begin * rows_per_partition`` (as the handlers do).

  Args:
    activation_grad: float32 ``[num_segments * samples_per_segment, dim]``.
    row_pointers: int32 row pointers.
    embedding_ids: int32 rows inside each partition's shard.
    sample_ids: int32 segment-local sample ids.
    gains: float32 gains.
    table: float32 ``[num_rows, dim]``.
    slots: The optimizer's slot variables, each shaped like ``table``.
    shape: The validated buffer shape.
    optimizer: A name in the optimizer registry, or an entry (a custom
      optimizer's).
    hyperparameters: float32 vector in the optimizer's order.
    clip: Optional ``(min, max)`` for the updated table rows.
    static_attributes: The optimizer's static attributes, passed to its
      ``update`` as keywords (left out: their defaults).

  Returns:
    The new table and slots; rows not referenced by a valid entry are
    unchanged.
  """
  slots = tuple(slots)
  valid, table_row, out_row = decode_entries(
    row_pointers, embedding_ids, sample_ids, shape
  )
  if valid.shape[0] == 0:
    return table, slots
  act = jnp.take(activation_grad, out_row, axis=0, mode="fill", fill_value=0)
  contrib = jnp.where(valid[:, None], gains[:, None] * act, 0.0)
  num_rows = shape.num_rows
  uniq, grads = _sum_by_row(table_row, contrib, num_rows)
  rows = jnp.take(table, uniq, axis=0, mode="fill", fill_value=0)
  rows = rows.astype(jnp.float32)
  slot_rows = [
    jnp.take(s, uniq, axis=0, mode="fill", fill_value=1) for s in slots
  ]
  new_rows, new_slot_rows = optimizers.get(optimizer).update(
    rows, slot_rows, grads, hyperparameters, **(static_attributes or {})
  )
  if clip is not None:
    new_rows = jnp.clip(new_rows, clip[0], clip[1])
  if table.dtype != jnp.float32:
    first = shape.partition_begin * shape.rows_per_partition
    new_rows = stochastic_round(
      new_rows, table.dtype, rounding_seed, first + uniq
    )
  target = jnp.where(uniq < num_rows, uniq, num_rows)
  new_table = table.at[target].set(new_rows, mode="drop")
  new_slots = tuple(
    s.at[target].set(r, mode="drop")
    for s, r in zip(slots, new_slot_rows, strict=True)
  )
  return new_table, new_slots


# --- stochastic rounding (csrc/table_dtype.h) ---------------------------------


def _mix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser (uint32, wrapping)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def rounding_bits(seed, rows: jax.Array, dim: int) -> jax.Array:
  """uint32 ``[len(rows), dim]``: the random bits of element (row, col) of
  an update seeded with ``seed`` (rows numbered in the whole stacked table:
  below 2^31 here)."""
  seed = jnp.asarray(seed).reshape(()).astype(jnp.uint32)
  row_mix = _mix32(
    rows.astype(jnp.uint32) ^ _mix32(jnp.uint32(0) + jnp.uint32(0x9E3779B9))
  )
  col_mix = _mix32(jnp.arange(dim, dtype=jnp.uint32) + jnp.uint32(0x632BE59B))
  return _mix32(seed ^ row_mix[:, None] ^ col_mix[None, :])


def stochastic_round(values: jax.Array, dtype, seed, rows: jax.Array):
  """float32 ``[len(rows), dim]`` rounded to ``dtype`` (bfloat16 or
  float16) stochastically: to the neighbour above (in magnitude) with
  probability ``(abs(x) - abs(lower)) / (abs(upper) - abs(lower))``, so that
  the expectation is x, with :func:`rounding_bits`; NaN stays NaN, inf
  stays inf, and a value rounded past the largest finite one becomes inf."""
  bits = rounding_bits(seed, rows, values.shape[-1])
  b = jax.lax.bitcast_convert_type(values.astype(jnp.float32), jnp.uint32)
  if jnp.dtype(dtype) == jnp.bfloat16:
    special = (b & 0x7F800000) == 0x7F800000
    nan = special & ((b & 0x7FFFFF) != 0)
    out = jnp.where(
      special,
      (b >> 16) | jnp.where(nan, jnp.uint32(0x40), jnp.uint32(0)),
      (b + (bits >> 16)) >> 16,
    )
    return jax.lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.bfloat16)
  if jnp.dtype(dtype) != jnp.float16:
    raise ValueError(f"stochastic_round: no rounding to {dtype}.")
  sign = (b >> 16) & 0x8000
  a = b & 0x7FFFFFFF
  special = sign | jnp.where(
    a > 0x7F800000, jnp.uint32(0x7E00), jnp.uint32(0x7C00)
  )
  up = (a + (bits & 0x1FFF)) & jnp.uint32(0xFFFFE000)
  normal = jnp.where(
    up >= 0x47800000, sign | 0x7C00, sign | ((up - 0x38000000) >> 13)
  )
  scaled = jax.lax.bitcast_convert_type(a, jnp.float32) * jnp.float32(2.0**24)
  whole = jnp.floor(scaled)
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  small = sign | (
    whole.astype(jnp.uint32) + ((scaled - whole) > u).astype(jnp.uint32)
  )
  out = jnp.where(
    a >= 0x7F800000, special, jnp.where(a >= 0x38800000, normal, small)
  )
  return jax.lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.float16)
