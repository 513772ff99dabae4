"""Pure-JAX reference of the sparse-dense matmul and its fused backward.

This is the test oracle for the C++ handlers and the fallback on platforms
without a compiled handler. It decodes the CSR-wrapped COO buffers into a
per-entry validity mask, table row and output row with ``jnp`` ops, gathers
with ``jnp.take`` and reduces with ``jax.ops.segment_sum``; invalid entries
(padding, out-of-range ids or sample ids, partitions outside the table) are
masked out, never clamped.

The backward forms each referenced row's gradient from the unique rows of the
batch (``jnp.unique`` with a static size), so its work and memory are
O(entries x dim), never O(vocabulary). The per-row optimizer equations
(research notes, section 4.3) live in :func:`apply_optimizer`, the only copy
of them in Python.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pz_sparsecore.kernels import _common


def decode_entries(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  layout: _common.BufferLayout,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Decodes the buffers into per-entry (valid, table_row, output_row).

  Args:
    row_pointers: int32 ``[num_segments * rp_stride]``.
    embedding_ids: int32 ``[num_segments * seg_len]``.
    sample_ids: int32 ``[num_segments * seg_len]``.
    layout: The validated buffer layout.

  Returns:
    A bool mask of valid entries, each entry's row in the table, and its
    output row ``segment * samples_per_segment + sample_id``; the rows of
    invalid entries are ``num_rows`` and ``num_outputs`` (out of range).
  """
  lay = layout
  rp = row_pointers.reshape(lay.num_segments, lay.rp_stride)
  rp = rp[:, : lay.num_partitions]
  ends = jnp.minimum(rp, lay.seg_len)
  # Clamping before rounding avoids int32 overflow and keeps empty ranges
  # empty: a start at or past seg_len can never hold an entry.
  prev = jnp.clip(rp[:, :-1], 0, lay.seg_len)
  align = _common.PARTITION_ALIGNMENT
  starts = jnp.concatenate(
    [
      jnp.zeros((lay.num_segments, 1), jnp.int32),
      (prev + align - 1) // align * align,
    ],
    axis=1,
  )
  offsets = jnp.arange(lay.seg_len, dtype=jnp.int32)
  # Partition of each offset: the last one starting at or before it.
  part = (
    jax.vmap(lambda s: jnp.searchsorted(s, offsets, side="right"))(starts) - 1
  )
  part_end = jnp.take_along_axis(ends, jnp.maximum(part, 0), axis=1)
  in_partition = (part >= 0) & (offsets[None, :] < part_end)
  local = part - lay.partition_begin
  in_table = (local >= 0) & (local < lay.num_table_partitions)
  ids = embedding_ids.reshape(lay.num_segments, lay.seg_len)
  sids = sample_ids.reshape(lay.num_segments, lay.seg_len)
  valid = (
    in_partition
    & in_table
    & (ids != _common.PAD_ID)
    & (ids >= 0)
    & (ids < lay.rows_per_partition)
    & (sids >= 0)
    & (sids < lay.samples_per_segment)
  )
  table_row = jnp.where(
    valid, local * lay.rows_per_partition + ids, lay.num_rows
  )
  segment = jnp.arange(lay.num_segments, dtype=jnp.int32)[:, None]
  out_row = jnp.where(
    valid, segment * lay.samples_per_segment + sids, lay.num_outputs
  )
  return valid.reshape(-1), table_row.reshape(-1), out_row.reshape(-1)


def sparse_dense_matmul(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  layout: _common.BufferLayout,
) -> jax.Array:
  """Reference forward: ``out[k * B + sid] += gain * table[row]``.

  Args:
    row_pointers: int32 row pointers.
    embedding_ids: int32 rows inside each partition's shard.
    sample_ids: int32 segment-local sample ids.
    gains: float32 gains.
    table: float32 ``[num_rows, dim]`` table holding the layout's partitions.
    layout: The validated buffer layout.

  Returns:
    float32 ``[num_segments * samples_per_segment, dim]`` activations.
  """
  valid, table_row, out_row = decode_entries(
    row_pointers, embedding_ids, sample_ids, layout
  )
  rows = jnp.take(table, table_row, axis=0, mode="fill", fill_value=0)
  contrib = jnp.where(valid[:, None], gains[:, None] * rows, 0.0)
  return jax.ops.segment_sum(
    contrib, out_row, num_segments=layout.num_outputs
  ).astype(jnp.float32)


def apply_optimizer(
  optimizer: str,
  table_rows: jax.Array,
  slot_rows: Sequence[jax.Array],
  grads: jax.Array,
  hyperparameters: jax.Array,
  *,
  multiply_linear_by_learning_rate: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Applies one optimizer step to rows (elementwise; notes section 4.3).

  Args:
    optimizer: One of ``_common.OPTIMIZERS``.
    table_rows: float32 rows of the table, ``[n, dim]``.
    slot_rows: The matching rows of each slot variable.
    grads: float32 row gradients, ``[n, dim]``.
    hyperparameters: float32 vector in the optimizer's order.
    multiply_linear_by_learning_rate: FTRL's static variant.

  Returns:
    The updated rows and slot rows.
  """
  w, g, h = table_rows, grads, hyperparameters
  if optimizer == "sgd":
    return w - h[0] * g, ()
  if optimizer == "adagrad":
    (a,) = slot_rows
    a = a + g * g
    return w - h[0] * g / jnp.sqrt(a), (a,)
  if optimizer == "adagrad_momentum":
    a, m = slot_rows
    lr, momentum, beta2, eps, exponent, nesterov = (h[i] for i in range(6))
    a = jnp.where(beta2 == 1.0, a + g * g, beta2 * a + (1.0 - beta2) * g * g)
    scaled = jnp.power(a + eps, -1.0 / exponent) * g
    m = momentum * m + scaled
    delta = jnp.where(nesterov != 0.0, momentum * m + scaled, m)
    return w - lr * delta, (a, m)
  if optimizer == "adam":
    m, v = slot_rows
    alpha, b1, b2, eps = (h[i] for i in range(4))
    m = m + (1.0 - b1) * (g - m)
    v = v + (1.0 - b2) * (g * g - v)
    return w - alpha * m / (jnp.sqrt(v) + eps), (m, v)
  if optimizer == "ftrl":
    a, lin = slot_rows
    lr, k, l1, l2, beta = (h[i] for i in range(5))
    a_new = a + g * g
    p_new = jnp.power(a_new, -k)
    dp = p_new - jnp.power(a, -k)
    if multiply_linear_by_learning_rate:
      lin = lin + lr * g - dp * w
      l1s = l1 * lr
      den = p_new + 2.0 * lr * l2 + beta
    else:
      lin = lin + g - (dp / lr) * w
      l1s = l1
      den = (p_new + beta) / lr + 2.0 * l2
    num = jnp.where(l1 == 0.0, -lin, jnp.clip(lin, -l1s, l1s) - lin)
    return num / den, (a_new, lin)
  raise ValueError(f"Unknown optimizer {optimizer!r}.")


def sparse_dense_matmul_grad(
  activation_grad: jax.Array,
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  slots: Sequence[jax.Array],
  layout: _common.BufferLayout,
  *,
  optimizer: str,
  hyperparameters: jax.Array,
  clip: tuple[float, float] | None = None,
  multiply_linear_by_learning_rate: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Reference fused backward: row gradients, then one optimizer step per row.

  Args:
    activation_grad: float32 ``[num_segments * samples_per_segment, dim]``.
    row_pointers: int32 row pointers.
    embedding_ids: int32 rows inside each partition's shard.
    sample_ids: int32 segment-local sample ids.
    gains: float32 gains.
    table: float32 ``[num_rows, dim]``.
    slots: The optimizer's slot variables, each shaped like ``table``.
    layout: The validated buffer layout.
    optimizer: One of ``_common.OPTIMIZERS``.
    hyperparameters: float32 vector in the optimizer's order.
    clip: Optional ``(min, max)`` for the updated table rows.
    multiply_linear_by_learning_rate: FTRL's static variant.

  Returns:
    The new table and slots; rows not referenced by a valid entry are
    unchanged.
  """
  slots = tuple(slots)
  valid, table_row, out_row = decode_entries(
    row_pointers, embedding_ids, sample_ids, layout
  )
  num_entries = valid.shape[0]
  if num_entries == 0:
    return table, slots
  act = jnp.take(activation_grad, out_row, axis=0, mode="fill", fill_value=0)
  contrib = jnp.where(valid[:, None], gains[:, None] * act, 0.0)
  num_rows = layout.num_rows
  # Group the entries by table row (a sort, not a vocabulary-sized scatter).
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
  referenced = uniq < num_rows
  rows = jnp.take(table, uniq, axis=0, mode="fill", fill_value=0)
  slot_rows = [
    jnp.take(s, uniq, axis=0, mode="fill", fill_value=1) for s in slots
  ]
  new_rows, new_slot_rows = apply_optimizer(
    optimizer,
    rows,
    slot_rows,
    grads,
    hyperparameters,
    multiply_linear_by_learning_rate=multiply_linear_by_learning_rate,
  )
  if clip is not None:
    new_rows = jnp.clip(new_rows, clip[0], clip[1])
  target = jnp.where(referenced, uniq, num_rows)
  new_table = table.at[target].set(new_rows, mode="drop")
  new_slots = tuple(
    s.at[target].set(r, mode="drop")
    for s, r in zip(slots, new_slot_rows, strict=True)
  )
  return new_table, new_slots
