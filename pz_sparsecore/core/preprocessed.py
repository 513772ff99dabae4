"""The types that cross stages: one batch's buffers and its stats.

`host.preprocess` writes them, `device` reads the buffers, `host.fdo` reads
the stats, `nn` passes both along and `viz` draws them. Their format is
`buffer_format`'s; the worked example is in `host.preprocess`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import numpy as np


class SparseDenseMatmulInput(NamedTuple):
  """The four buffers of a batch, per stack name (upstream's grouping)."""

  lhs_row_pointers: Mapping[str, Any]
  lhs_embedding_ids: Mapping[str, Any]
  lhs_sample_ids: Mapping[str, Any]
  lhs_gains: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """The batch of buffers preprocessed for another sample count than the
  feature specs' (`SparseCoreEmbed.preprocess` of any batch size).

  Per feature (the plan's leaf order), global sizes of its first sample
  axis: `padded` is the bucket the buffers were built for (the specs'
  batch with this size: `nn.batching`), `samples` what the layer's call
  returns (the real samples, or `padded` when the padding is kept).
  Example: a layer specified for 4,096 samples given 1,000 on 8 shards:
  `padded=(1024,)`, `samples=(1000,)`.
  """

  samples: tuple[int, ...]
  padded: tuple[int, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PreprocessedInput:
  """The CSR-wrapped COO buffers of one batch, per stack name.

  Shapes are `[L, R_dev]` / `[L, C_dev]` with `has_leading_dimension=True`,
  else flat `[L * R_dev]` / `[L * C_dev]`.

  Attributes:
    lhs_row_pointers: int32 partition ends, `max(N, 8)` per SparseCore.
    lhs_embedding_ids: int32 row of the id inside its owner's shard.
    lhs_sample_ids: int32 SparseCore-local sample of the id.
    lhs_gains: float32 weight of the entry.
    num_minibatches: None, or for minibatched buffers (`minibatching`)
      int32 `[L]` (`[L, 1]` with a leading dimension): every device's
      number of minibatches, the same on all.
    sample_order: None, or (buffers of a one-device plan) per stack the
      forward's sample order, int32 `[L * O_dev]` / `[L, O_dev]`: the
      lookups grouped by output row, which the CPU forward reads instead of
      sorting the buffers (`host.sample_order`). Not upstream's: its
      buffers are the four above, unchanged. Code that changes the four
      after preprocessing drops it (`dataclasses.replace(inputs,
      sample_order=None)`): the forward would sum the old lookups.
    hashed_ids: None, or per hashed stack (`core.hashed`) the distinct ids
      each local SparseCore sends each partition, int32 `[L * H_dev]` /
      `[L, H_dev]` (`plan.hashed_ids_per_device`): `[S, N, cap, 3]` per
      device, by their place in the partition (`lhs_embedding_ids` holds
      that place until the ids are resolved to rows: `device.hashed`).
      Resolved buffers have none.
    batch: None for buffers of the specs' batch; else the `BatchShape` of
      a batch of another size (static: each one compiles the call once).
  """

  lhs_row_pointers: dict[str, Any]
  lhs_embedding_ids: dict[str, Any]
  lhs_sample_ids: dict[str, Any]
  lhs_gains: dict[str, Any]
  num_minibatches: Any = None
  sample_order: Any = None
  hashed_ids: Any = None
  batch: BatchShape | None = dataclasses.field(
    default=None, metadata=dict(static=True)
  )

  @property
  def sparse_dense_matmul_input(self) -> SparseDenseMatmulInput:
    """The four buffers as one named tuple, as upstream's `PreprocessedInput`
    holds them."""
    return SparseDenseMatmulInput(
      self.lhs_row_pointers,
      self.lhs_embedding_ids,
      self.lhs_sample_ids,
      self.lhs_gains,
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseDenseMatmulInputStats:
  """Per-stack statistics of one batch, measured before any dropping.

  Attributes:
    max_ids_per_partition: int32 `[L * N]`: for local device `d` and
      partition `p`, the most (sample, id) pairs one of the device's
      SparseCores sends to `p`.
    max_unique_ids_per_partition: int32 `[L * N]`: the same for distinct ids.
    required_buffer_size_per_sc: int32 `[L * S]`: COO entries each
      SparseCore needs, `sum_p r8(pairs_p)`.
    id_drop_counters: The number of raw ids dropped (limits or overflow).
  """

  max_ids_per_partition: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )
  max_unique_ids_per_partition: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )
  required_buffer_size_per_sc: dict[str, Any] = dataclasses.field(
    default_factory=dict
  )
  id_drop_counters: dict[str, Any] = dataclasses.field(default_factory=dict)

  def get_required_buffer_size_per_device(
    self, stack_name: str, num_sc_per_device: int | None = None
  ) -> int | None:
    """COO entries one device needs for `stack_name`, or None if unknown.

    The largest per-SparseCore need times the SparseCores per device
    (`num_sc_per_device`, by default the number of recorded values).
    """
    if stack_name not in self.required_buffer_size_per_sc:
      return None
    values = np.asarray(self.required_buffer_size_per_sc[stack_name])
    num_sc = num_sc_per_device or values.size
    return int(np.max(values) * num_sc) if values.size else None

  def set_required_buffer_size_per_device(
    self,
    stack_name: str,
    required_buffer_size_per_device: int,
    num_sc_per_device: int | None = None,
  ) -> None:
    """Records `required_buffer_size_per_device` for `stack_name`.

    Stored per SparseCore (the size divided evenly over `num_sc_per_device`
    values, by default as many as already recorded for the stack).

    Raises:
      ValueError: If the stack has no recorded value and `num_sc_per_device`
        is not given.
    """
    current = self.required_buffer_size_per_sc.get(stack_name)
    num_sc = num_sc_per_device or (0 if current is None else np.size(current))
    if not num_sc:
      raise ValueError(
        "num_sc_per_device must be provided if the table is not present "
        f"(stack {stack_name!r} has no required_buffer_size_per_sc yet)."
      )
    self.required_buffer_size_per_sc[stack_name] = np.full(
      num_sc, required_buffer_size_per_device / num_sc
    )
