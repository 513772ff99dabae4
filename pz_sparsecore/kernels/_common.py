"""Constants, optimizer metadata and argument checks shared by the kernels.

Both implementations (the FFI handlers in ``ffi.py`` and the pure-JAX
reference in ``reference.py``) read the same CSR-wrapped COO buffers; this
module states their contract once and validates arguments up front, so that a
bad call raises a ``ValueError`` in Python instead of failing inside XLA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

#: Id written into alignment gaps and unused tails of the COO buffers.
PAD_ID = 2**31 - 1
#: Every partition of a segment starts at a multiple of this many entries.
PARTITION_ALIGNMENT = 8


@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
  """What the fused backward needs to know about one optimizer.

  Attributes:
    slot_names: Names of the slot variables, in operand order.
    hyperparameter_names: Names of the entries of the hyper-parameter vector,
      in order.
  """

  slot_names: tuple[str, ...]
  hyperparameter_names: tuple[str, ...]


#: Optimizers of the fused backward, by name.
OPTIMIZERS: dict[str, OptimizerInfo] = {
  "sgd": OptimizerInfo((), ("learning_rate",)),
  "adagrad": OptimizerInfo(("accumulator",), ("learning_rate",)),
  "adagrad_momentum": OptimizerInfo(
    ("accumulator", "momentum"),
    (
      "learning_rate",
      "momentum",
      "beta2",
      "epsilon",
      "exponent",
      "use_nesterov",
    ),
  ),
  "adam": OptimizerInfo(
    ("momentum", "velocity"), ("alpha_t", "beta_1", "beta_2", "epsilon_hat")
  ),
  "ftrl": OptimizerInfo(
    ("accumulator", "linear"),
    ("learning_rate", "learning_rate_power", "l1", "l2", "beta"),
  ),
}


@dataclasses.dataclass(frozen=True)
class BufferLayout:
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


def _check_table(x, name: str) -> None:
  """A float32 table of rank >= 2: `[..., rows, dim]` flattened to rows.

  Tables may keep a leading shard axis (`[shards, rows, dim]`): reshaping
  them around the in-place update would make XLA copy the table.
  """
  _check_array(x, name, jnp.float32, max(getattr(x, "ndim", 2), 2))


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
) -> BufferLayout:
  """Validates the forward operands and returns their layout.

  Raises:
    ValueError: If a dtype, rank or size does not match the contract.
  """
  for name, value in (
    ("num_segments", num_segments),
    ("samples_per_segment", samples_per_segment),
    ("num_partitions", num_partitions),
    ("rows_per_partition", rows_per_partition),
  ):
    if int(value) != value or value <= 0:
      raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  if int(partition_begin) != partition_begin or partition_begin < 0:
    raise ValueError(
      f"partition_begin must be a non-negative integer, got "
      f"{partition_begin!r}."
    )
  _check_array(row_pointers, "row_pointers", jnp.int32, 1)
  _check_array(embedding_ids, "embedding_ids", jnp.int32, 1)
  _check_array(sample_ids, "sample_ids", jnp.int32, 1)
  _check_array(gains, "gains", jnp.float32, 1)
  _check_table(table, "table")
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
  return BufferLayout(
    num_segments=int(num_segments),
    samples_per_segment=int(samples_per_segment),
    num_partitions=int(num_partitions),
    rows_per_partition=int(rows_per_partition),
    partition_begin=int(partition_begin),
    num_table_partitions=table_rows // rows_per_partition,
    seg_len=n // num_segments,
    rp_stride=nrp // num_segments,
    dim=table.shape[-1],
  )


def check_grad_operands(
  layout: BufferLayout,
  activation_grad,
  table,
  slots: Sequence,
  optimizer: str,
  hyperparameters,
  clip: tuple[float, float] | None,
) -> OptimizerInfo:
  """Validates the backward's extra operands; returns the optimizer's info.

  Raises:
    ValueError: If an operand does not match the contract.
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(
      f"Unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZERS)}."
    )
  info = OPTIMIZERS[optimizer]
  _check_array(activation_grad, "activation_grad", jnp.float32, 2)
  expected = (layout.num_outputs, layout.dim)
  if tuple(activation_grad.shape) != expected:
    raise ValueError(
      f"activation_grad must have shape {expected} (num_segments * "
      f"samples_per_segment, table width), got {tuple(activation_grad.shape)}."
    )
  if not isinstance(slots, (tuple, list)) or len(slots) != len(info.slot_names):
    raise ValueError(
      f"Optimizer {optimizer!r} needs slots {info.slot_names}, got "
      f"{len(slots) if isinstance(slots, (tuple, list)) else slots!r}."
    )
  for name, slot in zip(info.slot_names, slots, strict=True):
    _check_table(slot, f"slot {name!r}")
    if tuple(slot.shape) != tuple(table.shape):
      raise ValueError(
        f"slot {name!r} must have the table's shape {tuple(table.shape)}, "
        f"got {tuple(slot.shape)}."
      )
  _check_array(hyperparameters, "hyperparameters", jnp.float32, 1)
  if hyperparameters.shape[0] != len(info.hyperparameter_names):
    raise ValueError(
      f"Optimizer {optimizer!r} takes hyperparameters "
      f"{info.hyperparameter_names}, got a vector of length "
      f"{hyperparameters.shape[0]}."
    )
  if clip is not None:
    if len(clip) != 2 or not float(clip[0]) <= float(clip[1]):
      raise ValueError(f"clip must be a (min, max) pair, got {clip!r}.")
  return info
