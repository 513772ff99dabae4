"""Public kernels: the sparse-dense matmul and its fused optimizer backward.

Both functions take one device's CSR-wrapped COO buffers (see the package
docstring and ``pz_sparsecore.core.buffer_format``) and one table shard,
validate them up front (``contract``: ``ValueError`` on a bad dtype, rank or
size) and dispatch to an implementation:

* ``implementation=None``: the C++ FFI handler where one is compiled for the
  platform the call is lowered for (CPU; CUDA for a build with the CUDA
  handlers),
  else the pure-JAX reference, with a warning (``dispatch``). The choice
  happens at lowering time through ``jax.lax.platform_dependent``, so one
  traced function serves every backend.
* ``"ffi"``: the handler (the call fails to lower on a platform without one).
* ``"reference"``: the pure-JAX reference (``reference.py``).

The fused update of a custom optimizer (``CustomOptimizerSpec``, passed as
its entry ``spec.definition``) has no compiled handler on any platform: its
JAX row update runs in the reference backward, on the referenced rows only
(O(entries), in place when the table and slots are donated), for
``implementation`` None or ``"reference"``; ``"ffi"`` is an error.

``pz_sparsecore.backend_info()`` reports which one runs where. Both
implementations accept any buffer contents: unsorted, negative or huge ids
and sample ids are skipped or summed exactly as the contract says; row
pointers whose partition starts decrease make the handlers raise (see
``csrc/coo_layout.h``).

Both work under ``jit`` and inside ``shard_map`` (they act on the local
shard). Under ``vmap`` the FFI handlers run once per batch element
(``vmap_method="sequential"``); the reference batches natively.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pz_sparsecore.core import optimizers
from pz_sparsecore.device.kernels import contract, dispatch, ffi, reference


def _grad_fn(impl, shape: contract.BufferShape, **kwargs):
  """``impl`` (a backward) as a function of the dispatched operands (the
  rounding seed is one: a 16-bit table's, else an unused 0)."""

  def fn(grad, rp, ids, sids, gains, table, hyper, seed, *slots):
    return impl(
      grad,
      rp,
      ids,
      sids,
      gains,
      table,
      slots,
      shape,
      hyperparameters=hyper,
      rounding_seed=None if shape.table_dtype == "float32" else seed,
      **kwargs,
    )

  return fn


def _as_matrices(fn, dim: int):
  """Runs a reference backward on `[rows, dim]` views of the table/slots."""

  def wrapped(grad, rp, ids, sids, gains, table, hyper, seed, *slots):
    # Each slot by its own width ("table" slots: dim; row-wise: 1).
    flat = [
      table.reshape(-1, dim),
      *(x.reshape(-1, x.shape[-1]) for x in slots),
    ]
    new_table, new_slots = fn(
      grad, rp, ids, sids, gains, flat[0], hyper, seed, *flat[1:]
    )
    return new_table.reshape(table.shape), tuple(
      x.reshape(old.shape) for x, old in zip(new_slots, slots, strict=True)
    )

  return wrapped


def _raise_device_errors_if_eager(result):
  """After an eager call on a GPU: waits for ``result``, then raises the
  error the CUDA handlers recorded (``ffi.raise_device_errors``). Under a
  trace, returns at once (the caller reads its results later)."""
  leaves = jax.tree.leaves(result)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    return
  if any(d.platform == "gpu" for x in leaves for d in x.devices()):
    jax.block_until_ready(result)
    ffi.raise_device_errors()


def sparse_dense_matmul(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  *,
  num_segments: int,
  samples_per_segment: int,
  num_partitions: int,
  rows_per_partition: int,
  partition_begin: int = 0,
  quantization: tuple[float, float, int] | None = None,
  sample_order: jax.Array | None = None,
  implementation: str | None = None,
) -> jax.Array:
  """Looks up and combines embedding rows: one device's forward.

  For every valid entry ``(row e, sample i, gain g)`` of partition ``p`` in
  segment ``k``: ``out[k * samples_per_segment + i] += g * table[(p -
  partition_begin) * rows_per_partition + e]``. Entries with the padding id,
  an id outside ``[0, rows_per_partition)``, a sample id outside
  ``[0, samples_per_segment)`` or a partition outside the table's window
  ``[partition_begin, partition_begin + table.shape[0] / rows_per_partition)``
  are skipped.

  Args:
    row_pointers: int32 ``[num_segments * rp_stride]``, ``rp_stride >=
      num_partitions``; partition ``p`` of segment ``k`` spans entries
      ``[r8(rp[p - 1]), rp[p])`` of the segment (``r8``: round up to 8).
    embedding_ids: int32 ``[num_segments * seg_len]`` rows in the shards.
    sample_ids: int32 ``[num_segments * seg_len]`` segment-local samples.
    gains: float32 ``[num_segments * seg_len]``.
    table: ``[num_table_partitions * rows_per_partition, dim]``, float32,
      bfloat16 or float16 (rows widened to float32 exactly; the output is
      float32).
    num_segments: SparseCore segments in the buffers.
    samples_per_segment: Output rows per segment.
    num_partitions: Partitions per segment in the row pointers.
    rows_per_partition: Rows of one partition's table shard.
    partition_begin: First partition held by ``table``.
    quantization: None, or a quantized table's ``(min_value, max_value,
      num_buckets)``: every value is read through the rule of
      ``reference.quantize`` (clipped, rounded to the nearest level).
    sample_order: None, or the buffers' lookups in sample-major order, as
      the preprocessor writes them for one device: int32 ``[num_outputs +
      1 + 2 * n]``, ``starts`` (output row ``r``'s entries are ``[starts[r],
      starts[r + 1])``) then ``n`` pairs (row of ``table``, gain's float32
      bits); a first start of -1 means none. The CPU handler then sums
      these instead of sorting the buffers by sample: the same sums, up to
      float rounding where the pairs are the raw ids before duplicates
      were merged. It refuses starts that decrease or pass ``n`` and rows
      outside the table. The CUDA handler and the reference read the
      buffers. Pairs that do not restate the buffers give another result;
      nothing is read outside the table.
    implementation: ``None`` (FFI where compiled, else reference),
      ``"ffi"`` or ``"reference"``.

  Returns:
    float32 ``[num_segments * samples_per_segment, dim]`` activations.

  Raises:
    ValueError: If an operand's dtype, rank or size is inconsistent.
    ExtensionMismatchError: If the compiled extension was built for another
      ABI version or other optimizers and ``implementation`` is not
      ``"reference"``.

  The CPU handler fails at run time with XLA's INVALID_ARGUMENT error (a
  ``ValueError``, or ``jax.errors.JaxRuntimeError`` when it surfaces after
  dispatch) if the row pointers make partition starts decrease; the CUDA
  handler then returns zeros and records the error on the device, raised as
  a ``ValueError`` by an eager call once its result is ready, and by
  ``pz_sparsecore.device.kernels.raise_device_errors`` (see there) under
  ``jit``. The reference does not check them.
  """
  dispatch.check_implementation(implementation)
  shape = contract.check_buffers(
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    table,
    num_segments=num_segments,
    samples_per_segment=samples_per_segment,
    num_partitions=num_partitions,
    rows_per_partition=rows_per_partition,
    partition_begin=partition_begin,
  )
  if sample_order is None:
    sample_order = jnp.zeros((0,), jnp.int32)
  contract.check_sample_order(sample_order, shape)
  fn = dispatch.choose(
    ffi.FORWARD_TARGET,
    implementation,
    lambda *a: ffi.sparse_dense_matmul(*a, shape, quantization),
    lambda *a: reference.sparse_dense_matmul(
      *a[:4], a[4].reshape(-1, shape.dim), shape, quantization
    ),
  )
  out = fn(row_pointers, embedding_ids, sample_ids, gains, table, sample_order)
  _raise_device_errors_if_eager(out)
  return out


def sparse_dense_matmul_grad(
  activation_grad: jax.Array,
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  slots: Sequence[jax.Array],
  *,
  optimizer: str | optimizers.Optimizer,
  hyperparameters: jax.Array,
  num_segments: int,
  samples_per_segment: int,
  num_partitions: int,
  rows_per_partition: int,
  partition_begin: int = 0,
  clip: tuple[float, float] | None = None,
  static_attributes: Mapping[str, Any] | None = None,
  rounding_seed: jax.Array | None = None,
  implementation: str | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Backward of :func:`sparse_dense_matmul` fused with an optimizer step.

  Every table row referenced by at least one valid entry (a gain of 0
  counts) gets the gradient ``sum(gain * activation_grad[k *
  samples_per_segment + i])`` over all its entries in all segments, and the
  optimizer is applied once to the row and its slots (equations: the
  registry entry's ``update`` and docstring in
  ``pz_sparsecore.core.optimizers``). The new table row (not the slots) is then
  clipped to ``clip`` if given. Other rows and slots are returned
  bit-identical. Work is O(entries), independent of the table size.

  The FFI handler updates ``table`` and ``slots`` in place: they are aliased
  to the results, so callers must donate them (e.g. ``jax.jit(step,
  donate_argnums=...)``) and must not use the old arrays afterwards. Without
  donation XLA copies them first (correct, but O(table)).

  Args:
    activation_grad: float32 ``[num_segments * samples_per_segment, dim]``.
    row_pointers: int32 row pointers (as in the forward).
    embedding_ids: int32 rows in the shards (as in the forward).
    sample_ids: int32 segment-local samples (as in the forward).
    gains: float32 gains (as in the forward).
    table: ``[num_table_partitions * rows_per_partition, dim]``, float32,
      bfloat16 or float16 (``contract.TABLE_DTYPES``): a 16-bit table's
      rows are updated in float32 and stored by stochastic rounding
      (``reference.stochastic_round``), seeded with ``rounding_seed``; its
      slots stay float32.
    slots: The optimizer's slot variables in its ``slot_names`` order, each
      shaped like ``table``: ``()`` for sgd, ``(accumulator, linear)`` for
      ftrl.
    optimizer: A registry name (``"sgd"``, ..., ``"f2a"``) or an entry
      (``spec.definition``; a custom optimizer's: see the module doc).
    hyperparameters: float32 vector in the optimizer's
      ``hyperparameter_names`` order, e.g. ftrl ``(lr, lr_power, l1, l2,
      beta)``; adam's arrive bias-corrected. An operand, so a new value
      never recompiles.
    num_segments: SparseCore segments in the buffers.
    samples_per_segment: Output rows per segment.
    num_partitions: Partitions per segment in the row pointers.
    rows_per_partition: Rows of one partition's table shard.
    partition_begin: First partition held by ``table``.
    clip: Optional ``(min, max)`` applied to updated table rows.
    static_attributes: The optimizer's compile-time switches by name (its
      entry's ``static_attributes``, e.g. ftrl's
      ``{"multiply_linear_by_learning_rate": True}``); left out: defaults.
    rounding_seed: A 16-bit table's (only): one int32 or uint32 value, e.g.
      the optimizer step, so that a run is reproducible.
    implementation: ``None`` (FFI where compiled, else reference),
      ``"ffi"`` or ``"reference"``.

  Returns:
    ``(new_table, new_slots)`` with ``new_slots`` a tuple in slot order.

  Raises:
    ValueError: If an operand's dtype, rank or size is inconsistent, the
      optimizer is unknown or a static attribute is not the optimizer's.
    ExtensionMismatchError: If the compiled extension was built for another
      ABI version or other optimizers and ``implementation`` is not
      ``"reference"``.

  The CPU handler fails at run time with XLA's INVALID_ARGUMENT error (a
  ``ValueError``, or ``jax.errors.JaxRuntimeError`` when it surfaces after
  dispatch), before writing anything, if the row pointers make partition
  starts decrease; the CUDA handler then changes nothing and records the
  error on the device (raised as in :func:`sparse_dense_matmul`). The
  reference does not check them.
  """
  dispatch.check_implementation(implementation)
  shape = contract.check_buffers(
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    table,
    num_segments=num_segments,
    samples_per_segment=samples_per_segment,
    num_partitions=num_partitions,
    rows_per_partition=rows_per_partition,
    partition_begin=partition_begin,
  )
  info = contract.check_grad_operands(
    shape,
    activation_grad,
    table,
    slots,
    optimizer,
    hyperparameters,
    clip,
    rounding_seed,
  )
  kwargs = dict(
    clip=None if clip is None else (float(clip[0]), float(clip[1])),
    static_attributes=contract.check_static_attributes(info, static_attributes),
  )
  fn = dispatch.choose(
    ffi.grad_target(info.name) if info.compiled else None,
    implementation,
    _grad_fn(
      ffi.sparse_dense_matmul_grad, shape, optimizer=info.name, **kwargs
    ),
    _as_matrices(
      _grad_fn(
        reference.sparse_dense_matmul_grad, shape, optimizer=info, **kwargs
      ),
      shape.dim,
    ),
  )
  new_table, new_slots = fn(
    activation_grad,
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    table,
    hyperparameters,
    jnp.zeros((), jnp.uint32) if rounding_seed is None else rounding_seed,
    *slots,
  )
  _raise_device_errors_if_eager((new_table, new_slots))
  return new_table, tuple(new_slots)
