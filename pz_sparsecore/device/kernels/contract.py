"""The kernels' contract: what a call's operands must be, checked once.

Both implementations (the FFI handlers in ``ffi.py`` and the pure-JAX
reference in ``reference.py``) read the same CSR-wrapped COO buffers
(``pz_sparsecore.core.buffer_format``) and one table shard. This module states
their contract and validates a call's arguments up front, so that a bad call
raises a ``ValueError`` in Python instead of failing inside XLA.

:func:`check_buffers` returns the call's :class:`BufferShape`, the static
sizes both implementations compute with. Example: 2 segments of 24 entries,
row pointers in blocks of 8, 4 partitions of 32 rows, a ``[64, 16]`` table
holding partitions 2 and 3::

  check_buffers(rp[16], ids[48], sids[48], gains[48], table[64, 16],
                num_segments=2, samples_per_segment=16, num_partitions=4,
                rows_per_partition=32, partition_begin=2)
  -> BufferShape(seg_len=24, rp_stride=8, num_table_partitions=2, dim=16,
                 num_outputs=32, num_rows=64, ...)

The backward also takes an optimizer by name, looked up in the optimizer
registry (``pz_sparsecore.core.optimizers``), or its entry (a custom
optimizer's, from ``optimizers.custom``): its slots, hyper-parameter vector and
static attributes (compile-time switches such as FTRL's
``multiply_linear_by_learning_rate``) are checked against the registry entry.
A static attribute the caller leaves out takes the default of the entry's
``update`` keyword.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from pz_sparsecore.core import optimizers, specs


@dataclasses.dataclass(frozen=True)
class BufferShape:
  """Static description of one call's buffers (all sizes are Python ints).

  Attributes:
    num_segments: SparseCore segments in the COO buffers.
    samples_per_segment: Output rows per segment.
    num_partitions: Partitions described by each segment's row pointers.
    rows_per_partition: Rows of one partition's table shard.
    partition_begin: First partition held by the table.
    num_table_partitions: Partitions held by the table.
    seg_len: Entries per segment.
    rp_stride: Row pointers per segment.
    dim: Embedding width.
    table_dtype: The table's storage dtype, by name (``TABLE_DTYPES``).
  """

  num_segments: int
  samples_per_segment: int
  num_partitions: int
  rows_per_partition: int
  partition_begin: int
  num_table_partitions: int
  seg_len: int
  rp_stride: int
  dim: int
  table_dtype: str = "float32"

  @property
  def num_outputs(self) -> int:
    return self.num_segments * self.samples_per_segment

  @property
  def num_rows(self) -> int:
    return self.num_table_partitions * self.rows_per_partition


def _check_array(x, name: str, dtype, ndim: int) -> None:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array, got {type(x).__name__}.")
  if x.dtype != dtype:
    raise ValueError(
      f"{name} must have dtype {np.dtype(dtype).name}, got {x.dtype}."
    )
  if x.ndim != ndim:
    raise ValueError(
      f"{name} must have rank {ndim}, got shape {tuple(x.shape)}."
    )


TABLE_DTYPES = specs.TABLE_DTYPES
"""The storage dtypes a table may have (``specs.TABLE_DTYPES``): rows are
read widened to float32, and an update writes a 16-bit row by stochastic
rounding (its seed: the ``rounding_seed`` operand)."""


def _check_table(x, name: str, dtypes: tuple[str, ...] = ("float32",)) -> None:
  """A table of rank >= 2 (`dtypes`): `[..., rows, dim]` flattened to rows.

  Tables may keep a leading shard axis (`[shards, rows, dim]`): reshaping
  them around the in-place update would make XLA copy the table.
  """
  if hasattr(x, "dtype") and np.dtype(x.dtype).name in dtypes:
    _check_array(x, name, x.dtype, max(getattr(x, "ndim", 2), 2))
    return
  if len(dtypes) > 1 and hasattr(x, "dtype"):
    raise ValueError(
      f"{name} must have dtype {', '.join(dtypes[:-1])} or {dtypes[-1]}, "
      f"got {x.dtype}."
    )
  _check_array(x, name, jnp.float32, max(getattr(x, "ndim", 2), 2))


def _check_sizes(**sizes: int) -> None:
  """Positive sizes, and a non-negative `partition_begin`."""
  for name, value in sizes.items():
    if name == "partition_begin":
      if int(value) != value or value < 0:
        raise ValueError(
          f"partition_begin must be a non-negative integer, got {value!r}."
        )
    elif int(value) != value or value <= 0:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def check_buffers(
  row_pointers,
  embedding_ids,
  sample_ids,
  gains,
  table,
  *,
  num_segments: int,
  samples_per_segment: int,
  num_partitions: int,
  rows_per_partition: int,
  partition_begin: int,
) -> BufferShape:
  """Validates the forward operands and returns their shape.

  Args:
    row_pointers: int32 ``[num_segments * rp_stride]``.
    embedding_ids: int32 ``[num_segments * seg_len]``.
    sample_ids: int32 ``[num_segments * seg_len]``.
    gains: float32 ``[num_segments * seg_len]``.
    table: ``[..., rows, dim]`` (float32, bfloat16 or float16: see
      ``TABLE_DTYPES``), rows a multiple of ``rows_per_partition``.
    num_segments: SparseCore segments in the buffers.
    samples_per_segment: Output rows per segment.
    num_partitions: Partitions per segment in the row pointers.
    rows_per_partition: Rows of one partition's table shard.
    partition_begin: First partition held by ``table``.

  Returns:
    The call's static sizes.

  Raises:
    ValueError: If a dtype, rank or size does not match the contract.
  """
  _check_sizes(
    num_segments=num_segments,
    samples_per_segment=samples_per_segment,
    num_partitions=num_partitions,
    rows_per_partition=rows_per_partition,
    partition_begin=partition_begin,
  )
  _check_array(row_pointers, "row_pointers", jnp.int32, 1)
  _check_array(embedding_ids, "embedding_ids", jnp.int32, 1)
  _check_array(sample_ids, "sample_ids", jnp.int32, 1)
  _check_array(gains, "gains", jnp.float32, 1)
  _check_table(table, "table", TABLE_DTYPES)
  table_rows = math.prod(table.shape[:-1])
  n = embedding_ids.shape[0]
  if sample_ids.shape[0] != n or gains.shape[0] != n:
    raise ValueError(
      "embedding_ids, sample_ids and gains must have the same length, got "
      f"{n}, {sample_ids.shape[0]} and {gains.shape[0]}."
    )
  if n % num_segments:
    raise ValueError(
      f"COO buffer length {n} is not a multiple of num_segments {num_segments}."
    )
  nrp = row_pointers.shape[0]
  if nrp % num_segments or nrp // num_segments < num_partitions:
    raise ValueError(
      f"row_pointers length {nrp} must be num_segments ({num_segments}) "
      f"times a stride >= num_partitions ({num_partitions})."
    )
  if table_rows % rows_per_partition:
    raise ValueError(
      f"table has {table_rows} rows, not a multiple of "
      f"rows_per_partition {rows_per_partition}."
    )
  return BufferShape(
    num_segments=int(num_segments),
    samples_per_segment=int(samples_per_segment),
    num_partitions=int(num_partitions),
    rows_per_partition=int(rows_per_partition),
    partition_begin=int(partition_begin),
    num_table_partitions=table_rows // rows_per_partition,
    seg_len=n // num_segments,
    rp_stride=nrp // num_segments,
    dim=table.shape[-1],
    table_dtype=np.dtype(table.dtype).name,
  )


def check_sample_order(sample_order, shape: BufferShape) -> None:
  """Validates the forward's optional sample-major order (see
  ``ops.sparse_dense_matmul``): int32, rank 1, empty (none) or
  ``num_outputs + 1`` starts followed by (row, gain bits) pairs.

  Raises:
    ValueError: If its dtype, rank or length does not fit.
  """
  _check_array(sample_order, "sample_order", jnp.int32, 1)
  n = sample_order.shape[0]
  extra = n - shape.num_outputs - 1
  if n and (extra < 0 or extra % 2):
    raise ValueError(
      f"sample_order has {n} values; expected {shape.num_outputs + 1} starts "
      "(one per output row, and the end) followed by (row, gain) pairs."
    )


def check_grad_operands(
  shape: BufferShape,
  activation_grad,
  table,
  slots: Sequence,
  optimizer: str | optimizers.Optimizer,
  hyperparameters,
  clip: tuple[float, float] | None,
  rounding_seed=None,
) -> optimizers.Optimizer:
  """Validates the backward's extra operands.

  Args:
    shape: The forward operands' shape (from :func:`check_buffers`).
    activation_grad: float32 ``[num_outputs, dim]``.
    table: The table, as given to :func:`check_buffers`.
    slots: One array per slot of the optimizer: shaped like ``table`` for a
      "table" slot, ``table.shape[:-1] + (width,)`` for another
      (``Slot.width``: 1 for "rowwise_1d").
    optimizer: The optimizer's registry name, or its entry.
    hyperparameters: float32 vector of the optimizer's hyper-parameters.
    clip: None, or a ``(min, max)`` pair with ``min <= max``.
    rounding_seed: For a 16-bit table, an integer scalar (int32 or uint32;
      e.g. the optimizer step): the stochastic rounding's seed. None for a
      float32 table.

  Returns:
    The optimizer's registry entry.

  Raises:
    ValueError: If the optimizer is unknown or an operand does not match the
      contract.
  """
  info = optimizers.get(optimizer)
  _check_array(activation_grad, "activation_grad", jnp.float32, 2)
  expected = (shape.num_outputs, shape.dim)
  if tuple(activation_grad.shape) != expected:
    raise ValueError(
      f"activation_grad must have shape {expected} (num_segments * "
      f"samples_per_segment, table width), got {tuple(activation_grad.shape)}."
    )
  if not isinstance(slots, (tuple, list)) or len(slots) != len(info.slot_names):
    raise ValueError(
      f"Optimizer {info.name!r} needs slots {info.slot_names}, got "
      f"{len(slots) if isinstance(slots, (tuple, list)) else slots!r}."
    )
  for spec, slot in zip(info.slots, slots, strict=True):
    name = spec.name
    _check_table(slot, f"slot {name!r}")
    want = (*table.shape[:-1], spec.width(shape.dim))
    if tuple(slot.shape) != want:
      if spec.shape is optimizers.SlotShape.TABLE:
        raise ValueError(
          f"slot {name!r} must have the table's shape {tuple(table.shape)}, "
          f"got {tuple(slot.shape)}."
        )
      raise ValueError(
        f"slot {name!r} must have shape {want} ({spec.width(shape.dim)} "
        f"value(s) per table row), got {tuple(slot.shape)}."
      )
  _check_array(hyperparameters, "hyperparameters", jnp.float32, 1)
  if hyperparameters.shape[0] != len(info.hyperparameter_names):
    raise ValueError(
      f"Optimizer {info.name!r} takes hyperparameters "
      f"{info.hyperparameter_names}, got a vector of length "
      f"{hyperparameters.shape[0]}."
    )
  if clip is not None:
    if len(clip) != 2 or not float(clip[0]) <= float(clip[1]):
      raise ValueError(f"clip must be a (min, max) pair, got {clip!r}.")
  if shape.table_dtype == "float32":
    if rounding_seed is not None:
      raise ValueError(
        "rounding_seed is for 16-bit tables (stochastic rounding); this "
        "table is float32."
      )
  elif (
    rounding_seed is None
    or not hasattr(rounding_seed, "dtype")
    or np.dtype(rounding_seed.dtype).name not in ("int32", "uint32")
    or getattr(rounding_seed, "size", 0) != 1
  ):
    raise ValueError(
      f"A {shape.table_dtype} table's update rounds stochastically: pass "
      "rounding_seed, one int32 or uint32 value (e.g. the optimizer step), "
      f"got {rounding_seed!r}."
    )
  return info


def static_attribute_defaults(info: optimizers.Optimizer) -> dict[str, Any]:
  """The default of each static attribute: its ``update`` keyword's default.

  Raises:
    ValueError: If ``update`` gives a static attribute no default.
  """
  params = inspect.signature(info.update).parameters
  defaults = {}
  for name in info.static_attributes:
    if name not in params or params[name].default is inspect.Parameter.empty:
      raise ValueError(
        f"Optimizer {info.name!r}: the update of static attribute {name!r} "
        "must be a keyword with a default."
      )
    defaults[name] = params[name].default
  return defaults


def check_static_attributes(
  info: optimizers.Optimizer, static_attributes: Mapping[str, Any] | None
) -> dict[str, Any]:
  """Validates a call's static attributes against the optimizer's entry.

  Args:
    info: The optimizer's registry entry.
    static_attributes: Values by name (a subset of
      ``info.static_attributes``), or None.

  Returns:
    A value for every static attribute of the optimizer: the given one,
    converted to the type of the default (e.g. ``bool``), else the default.

  Raises:
    ValueError: If a name is not a static attribute of the optimizer.
  """
  given = dict(static_attributes or {})
  unknown = sorted(set(given) - set(info.static_attributes))
  if unknown:
    raise ValueError(
      f"Optimizer {info.name!r} has no static attributes {unknown}; it takes "
      f"{info.static_attributes}."
    )
  values = static_attribute_defaults(info)
  for name, value in given.items():
    default = values[name]
    values[name] = (
      type(default)(value) if isinstance(default, (bool, int, float)) else value
    )
  return values
