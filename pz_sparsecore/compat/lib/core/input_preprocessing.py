"""jax-tpu-embedding's `lib/core/input_preprocessing` over pz_sparsecore.

Upstream's module is a readable Python reference of SparseCore input
preprocessing for one table on one device. Here the buffers come from
pz_sparsecore's own preprocessor (`pz_sparsecore.host.preprocess`), run on a
one-feature, one-table spec (combiner "sum", vocabulary covering the largest
id, no stacking offsets or rotation) with one local device out of
`len(mesh.devices)`. With no rotation and offset, pz_sparsecore's MOD layout
is upstream's: id `e` goes to partition `e % N` at local row `e // N`, with
`N = len(mesh.devices) * num_sc_per_device`.

Buffers (`buffer_format`): per local SparseCore, one segment of
`r8(max_ids_per_partition) * N` COO entries and `max(N, 8)` row pointers;
partitions sorted by (local row, sample), 8-aligned, duplicates of one id in
one sample merged with their weights added, padding `PADDING_VALUE` /
`PADDING_VALUE` / NaN. Row pointers count from the start of their segment.

Minibatching (`enable_minibatching=True`, `features` a list of `M` batches)
packs each minibatch's segments back to back under one global COO index:
SparseCore 0's segments of minibatches 0 .. M-1, then SparseCore 1's, and so
on, each cut to its aligned end. The buffers hold `M` times the entries of
one batch. Example, `S = 1`, `N = 2`, two minibatches whose segments end at
`[2, 9, 16, ...]` and `[3, 8, 8, ...]` (row pointers of the second shifted
by 16)::

  row_pointers  [2, 9, 16, 16, 16, 16, 16, 16,  19, 24, 24, 24, 24, 24, 24, 24]
  entries       mb 0 in [0, 16), mb 1 in [16, 24), padding up to 32

Each minibatch is preprocessed on its own (its own samples per SparseCore and
limit checks) and the segments are moved, not recomputed.

Differences from upstream's reference: `N` must be a power of two; a batch
must be non-empty and divide over the SparseCores (upstream silently drops
the rows past the last whole SparseCore); `max_unique_ids_per_partition` must
be positive; ids must be non-negative integers; `features_weights` may be
None (unit weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pz_sparsecore as pzsc
from pz_sparsecore.compat.utils import utils
from pz_sparsecore.core import buffer_format
from pz_sparsecore.host import ragged_input

__all__ = ["preprocess_sparse_dense_matmul_input"]

_TABLE = "table"


def preprocess_sparse_dense_matmul_input(
  features: Any,
  features_weights: Any,
  mesh: jax.sharding.Mesh,
  *,
  max_ids_per_partition: int,
  max_unique_ids_per_partition: int,
  num_sc_per_device: int = -1,
  sharding_strategy: str = "MOD",
  enable_minibatching: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Preprocesses one table's batch into one device's CSR-wrapped COO buffers.

  Args:
    features: The ids: a dense `[batch, k]` array or a ragged sequence of
      rows (1-D arrays or lists, possibly empty). With minibatching, a
      sequence of such batches.
    features_weights: Weights shaped like `features` (None: all 1).
    mesh: The mesh; `len(mesh.devices)` devices hold the table.
    max_ids_per_partition: Limit on merged (sample, id) pairs one
      SparseCore sends to one partition; sizes the buffers.
    max_unique_ids_per_partition: Limit on distinct ids one SparseCore
      sends to one partition.
    num_sc_per_device: SparseCores per device; not positive: those of the
      mesh's first device (`utils.num_sparsecores_per_device`).
    sharding_strategy: Only "MOD".
    enable_minibatching: `features` is a list of minibatches, packed as the
      module docstring shows.

  Returns:
    `(row_pointers, col_ids, row_ids, gains)`: int32 `[M * S * max(N, 8)]`
    partition ends, int32 local rows, int32 SparseCore-local samples and
    float32 gains, each `[M * S * r8(max_ids_per_partition) * N]` (`M = 1`
    without minibatching).

  Raises:
    ValueError: On a non-positive limit, features that are not 1-D or 2-D,
      features and weights of different lengths, another sharding strategy,
      an empty mesh, input pz_sparsecore cannot preprocess (see the module
      docstring), or a partition over a limit.
  """
  setup = _Setup.checked(
    features,
    features_weights,
    mesh,
    max_ids_per_partition=max_ids_per_partition,
    max_unique_ids_per_partition=max_unique_ids_per_partition,
    num_sc_per_device=num_sc_per_device,
    sharding_strategy=sharding_strategy,
    enable_minibatching=enable_minibatching,
  )
  if enable_minibatching:
    weights = features_weights
    if weights is None:
      weights = [None] * len(features)
    minibatches = [
      _device_buffers(f"features[{m}]", ids, w, setup)
      for m, (ids, w) in enumerate(zip(features, weights, strict=True))
    ]
    buffers = _pack_minibatches(minibatches, setup.num_sc_per_device)
  else:
    buffers = _device_buffers("features", features, features_weights, setup)
  row_pointers, col_ids, row_ids, gains = buffers
  return (
    jnp.asarray(row_pointers, jnp.int32),
    jnp.asarray(col_ids, jnp.int32),
    jnp.asarray(row_ids, jnp.int32),
    jnp.asarray(gains, jnp.float32),
  )


@dataclasses.dataclass(frozen=True)
class _Setup:
  """The validated topology and limits of one call."""

  global_device_count: int
  num_sc_per_device: int
  max_ids_per_partition: int
  max_unique_ids_per_partition: int

  @classmethod
  def checked(
    cls,
    features: Any,
    features_weights: Any,
    mesh: jax.sharding.Mesh,
    *,
    max_ids_per_partition: int,
    max_unique_ids_per_partition: int,
    num_sc_per_device: int,
    sharding_strategy: str,
    enable_minibatching: bool,
  ) -> _Setup:
    """Upstream's argument checks, in its order; SparseCores from the mesh."""
    for name, limit in (
      ("max_ids_per_partition", max_ids_per_partition),
      ("max_unique_ids_per_partition", max_unique_ids_per_partition),
    ):
      if limit <= 0:
        raise ValueError(f"{name} must be positive, got {limit}.")
    ndim = None if enable_minibatching else _ndim(features)
    if ndim is not None and ndim not in (1, 2):
      raise ValueError(f"features must be 1D or 2D, got {ndim}D.")
    if features_weights is not None and len(features) != len(features_weights):
      raise ValueError(
        "features and features_weights must have the same length, got "
        f"{len(features)} and {len(features_weights)}."
      )
    if sharding_strategy != "MOD":
      raise ValueError(
        "Currently only MOD sharding strategy is supported, got "
        f"{sharding_strategy!r}."
      )
    global_device_count = len(mesh.devices)
    if global_device_count <= 0:
      raise ValueError(
        f"global_device_count must be positive, got {global_device_count}."
      )
    if num_sc_per_device <= 0:
      first = np.asarray(mesh.devices).flat[0]
      num_sc_per_device = utils.num_sparsecores_per_device(first)
    return cls(
      global_device_count,
      num_sc_per_device,
      max_ids_per_partition,
      max_unique_ids_per_partition,
    )


def _ndim(features: Any) -> int:
  """Upstream's rank of a batch: 1 for ragged rows numpy cannot stack."""
  try:
    return np.ndim(features)
  except ValueError:
    return 1


def _rows(batch: Any) -> Any:
  """A batch in a form `ragged_input` reads: a dense array, or a list of
  rows, object rows (a 2-D object array's) turned into numbers."""
  if isinstance(batch, (list, tuple)) or (
    isinstance(batch, np.ndarray) and batch.dtype == object
  ):
    rows = [np.asarray(row) for row in batch]
    return [np.array(r.tolist()) if r.dtype == object else r for r in rows]
  return np.asarray(batch)


def _ragged(name: str, batch: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
  ragged = ragged_input.to_ragged(name, _rows(batch), what)
  return ragged.values, ragged.splits


def _device_buffers(
  name: str, features: Any, features_weights: Any, setup: _Setup
) -> list[np.ndarray]:
  """One batch through pz_sparsecore's preprocessor, on one local device.

  Returns:
    The flat numpy `[row_pointers, embedding_ids, sample_ids, gains]`.
  """
  ids = _ragged(name, features, "ids")
  weights = None
  if features_weights is not None:
    weights = _ragged(name, features_weights, "weights")
  values, splits = ids
  # Any vocabulary past the largest id gives upstream's MOD layout.
  vocabulary_size = max(int(values.max()) + 1, 1) if values.size else 1
  num_rows = max(len(splits) - 1, 1)
  table = pzsc.TableSpec(
    name=_TABLE,
    vocabulary_size=vocabulary_size,
    embedding_dim=buffer_format.ALIGNMENT,
    initializer=jax.nn.initializers.zeros,
    optimizer=pzsc.SGDOptimizerSpec(),
    combiner="sum",
    max_ids_per_partition=setup.max_ids_per_partition,
    max_unique_ids_per_partition=setup.max_unique_ids_per_partition,
  )
  feature = pzsc.FeatureSpec(
    name=name,
    table_spec=table,
    input_shape=[num_rows, None],
    output_shape=[num_rows, table.embedding_dim],
  )
  specs = pzsc.prepare_feature_specs_for_training(
    [feature], setup.global_device_count, setup.num_sc_per_device
  )
  inputs, _ = pzsc.preprocess_sparse_dense_matmul_input(
    [ids],
    None if weights is None else [weights],
    specs,
    local_device_count=1,
    global_device_count=setup.global_device_count,
    num_sc_per_device=setup.num_sc_per_device,
  )
  buffers = [
    np.asarray(inputs.lhs_row_pointers[_TABLE]),
    np.asarray(inputs.lhs_embedding_ids[_TABLE]),
    np.asarray(inputs.lhs_sample_ids[_TABLE]),
    np.asarray(inputs.lhs_gains[_TABLE]),
  ]
  coo_size = buffer_format.compute_theoretical_max_coo_buffer_size(
    setup.max_ids_per_partition,
    setup.global_device_count,
    setup.num_sc_per_device,
  )
  rp_size = buffer_format.compute_row_pointers_size_per_device(
    setup.global_device_count, setup.num_sc_per_device
  )
  sizes = [rp_size] + [coo_size] * 3
  if [b.size for b in buffers] != sizes:
    raise RuntimeError(
      f"pz_sparsecore returned buffers of {[b.size for b in buffers]} "
      f"entries where upstream's layout has {sizes}"
    )
  return buffers


def _pack_minibatches(
  minibatches: Sequence[list[np.ndarray]], num_sc_per_device: int
) -> list[np.ndarray]:
  """Upstream's minibatching buffers from each minibatch's device buffers.

  For each SparseCore, then each minibatch, the segment (cut to the aligned
  end of its last partition) moves to the next free, 8-aligned position of
  one global buffer, and its row pointers shift by that position.
  """
  num_sc = num_sc_per_device
  if not minibatches:  # Upstream's buffers of no minibatch: all empty.
    return [np.zeros(0, np.int32)] * 3 + [np.zeros(0, np.float32)]
  segments = [
    [np.asarray(buffer).reshape(num_sc, -1) for buffer in minibatch]
    for minibatch in minibatches
  ]
  coo_per_batch = minibatches[0][1].size
  packed = [
    np.full(coo_per_batch * len(minibatches), pad, dtype)
    for pad, dtype in (
      (buffer_format.PAD_ID, np.int32),
      (buffer_format.PAD_ID, np.int32),
      (buffer_format.PAD_GAIN, np.float32),
    )
  ]
  row_pointers = []
  start = 0
  for sc in range(num_sc):
    for rp, *coo in segments:
      end = int(buffer_format.round_up(int(rp[sc, -1])))
      for out, segment in zip(packed, coo, strict=True):
        out[start : start + end] = segment[sc, :end]
      row_pointers.append(rp[sc] + start)
      start += end
  return [np.concatenate(row_pointers), *packed]
