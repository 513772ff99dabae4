"""A plain-Python reference of the preprocessor, written for clarity.

It follows upstream's preprocessing algorithm literally (the module
docstring of `pz_sparsecore.host.preprocess` states it): per stack, per
local device and SparseCore, a dict of (partition, local row, sample) ->
gain, sorted, then the drop rule and the
8-aligned layout. It is slow and only used by the tests, as the oracle for
`pz_sparsecore.host.preprocess` (which must match it byte for byte). It does not
validate its inputs; give it valid ones.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from pz_sparsecore.core.specs import FeatureSpec
from pz_sparsecore.host.preprocess import (
  PAD_ID,
  PreprocessedInput,
  SparseDenseMatmulInputStats,
)


def _r8(x: int) -> int:
  return (x + 7) // 8 * 8


def _rows(leaf: Any) -> list[list[int]]:
  """A feature leaf as a list of rows of Python ints."""
  if isinstance(leaf, tuple):
    values, splits = leaf
    return [
      [int(v) for v in values[splits[i] : splits[i + 1]]]
      for i in range(len(splits) - 1)
    ]
  return [[int(v) for v in row] for row in leaf]


def _weight_rows(leaf: Any) -> list[list[float]]:
  if isinstance(leaf, tuple):
    values, splits = leaf
    values = np.asarray(values, np.float32)
    return [
      [float(v) for v in values[splits[i] : splits[i + 1]]]
      for i in range(len(splits) - 1)
    ]
  return [[float(np.float32(v)) for v in row] for row in leaf]


def _divisor(combiner: str, weights: list[float]) -> float:
  if combiner == "mean":
    total = 0.0
    for w in weights:
      total += w
    return total
  if combiner == "sqrtn":
    total = 0.0
    for w in weights:
      total += w * w
    return math.sqrt(total)
  return 1.0


def reference_preprocess(
  features: Any,
  features_weights: Any,
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  *,
  num_sc_per_device: int,
  has_leading_dimension: bool = False,
  allow_id_dropping: bool = False,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Same inputs and outputs as `preprocess_sparse_dense_matmul_input`.

  Limits are never enforced by raising: the stats tell whether they were
  exceeded.
  """
  is_spec = lambda x: isinstance(x, FeatureSpec)
  specs, treedef = jax.tree.flatten(feature_specs, is_leaf=is_spec)
  leaves = treedef.flatten_up_to(features)
  if features_weights is None:
    weight_leaves = [None] * len(specs)
  else:
    weight_leaves = treedef.flatten_up_to(features_weights)
  num_local, num_sc = local_device_count, num_sc_per_device
  n = global_device_count * num_sc
  rp_per_sc = max(n, 8)

  stacks: dict[str, list[int]] = {}
  for i, spec in enumerate(specs):
    stacks.setdefault(spec.table_spec.setting_in_stack.stack_name, []).append(i)

  out = {k: {} for k in ("rp", "ids", "sids", "gains")}
  stats = {k: {} for k in ("max_ids", "max_unique", "required", "dropped")}
  for stack_name, members in stacks.items():
    members.sort(key=lambda i: specs[i].id_transformation.row_offset)
    stacked = specs[members[0]].table_spec.stacked_table_spec
    max_ids = stacked.max_ids_per_partition
    max_unique = stacked.max_unique_ids_per_partition
    c_max = _r8(max_ids) * num_sc * n
    if stacked.suggested_coo_buffer_size_per_device is None:
      coo_dev = c_max
    else:
      step = 8 * num_sc
      coo_dev = -(-stacked.suggested_coo_buffer_size_per_device // step) * step
    coo_sc = coo_dev // num_sc

    rp = np.zeros((num_local, num_sc, rp_per_sc), np.int32)
    ids = np.full((num_local, num_sc, coo_sc), PAD_ID, np.int32)
    sids = np.full((num_local, num_sc, coo_sc), PAD_ID, np.int32)
    gains = np.full((num_local, num_sc, coo_sc), np.nan, np.float32)
    seen_ids = np.zeros((num_local, num_sc, n), np.int32)
    seen_unique = np.zeros((num_local, num_sc, n), np.int32)
    required = np.zeros((num_local, num_sc), np.int32)
    dropped = 0
    rows = {i: _rows(leaves[i]) for i in members}
    weight_rows = {
      i: None if weight_leaves[i] is None else _weight_rows(weight_leaves[i])
      for i in members
    }

    for d in range(num_local):
      for s in range(num_sc):
        pairs: dict[tuple[int, int, int], np.float32] = {}
        occurrences: dict[tuple[int, int, int], int] = {}
        for i in members:
          spec = specs[i]
          transform = spec.id_transformation
          per_sc = len(rows[i]) // (num_local * num_sc)
          start = (d * num_sc + s) * per_sc
          for r in range(start, start + per_sc):
            row = rows[i][r]
            if weight_rows[i] is None:
              w = [1.0] * len(row)
            else:
              w = weight_rows[i][r]
            divisor = _divisor(stacked.combiner, w)
            sample = r - start + transform.row_offset // n
            for e, we in zip(row, w, strict=True):
              col = (
                (e + transform.col_shift) % n
                + (e - e % n)
                + transform.col_offset
              )
              key = (col % n, col // n, sample)
              with np.errstate(divide="ignore", invalid="ignore"):
                g = np.float32(np.float64(we) / np.float64(divisor))
              pairs[key] = pairs.get(key, np.float32(0)) + g
              occurrences[key] = occurrences.get(key, 0) + 1

        by_partition: dict[int, list[tuple[int, int]]] = {}
        for p, local, sample in sorted(pairs):
          by_partition.setdefault(p, []).append((local, sample))
        pos = 0
        for p in range(n):
          entries = by_partition.get(p, [])
          cols: dict[int, int] = {}  # local row -> rank among distinct rows
          for local, _ in entries:
            cols.setdefault(local, len(cols))
          seen_ids[d, s, p] = len(entries)
          seen_unique[d, s, p] = len(cols)
          required[d, s] += _r8(len(entries))
          for k, (local, sample) in enumerate(entries):
            key = (p, local, sample)
            keep = not allow_id_dropping or (
              k < max_ids and cols[local] < max_unique
            )
            if keep and pos < coo_sc:
              ids[d, s, pos] = local
              sids[d, s, pos] = sample
              gains[d, s, pos] = pairs[key]
              pos += 1
            else:
              dropped += occurrences[key]
          rp[d, s, p] = pos
          pos = _r8(pos)
        rp[d, s, n:] = pos

    shape_rp = (num_local, -1) if has_leading_dimension else (-1,)
    out["rp"][stack_name] = rp.reshape(shape_rp)
    out["ids"][stack_name] = ids.reshape(shape_rp)
    out["sids"][stack_name] = sids.reshape(shape_rp)
    out["gains"][stack_name] = gains.reshape(shape_rp)
    stats["max_ids"][stack_name] = seen_ids.max(axis=1).reshape(-1)
    stats["max_unique"][stack_name] = seen_unique.max(axis=1).reshape(-1)
    stats["required"][stack_name] = required.reshape(-1)
    stats["dropped"][stack_name] = dropped

  return (
    PreprocessedInput(
      lhs_row_pointers=out["rp"],
      lhs_embedding_ids=out["ids"],
      lhs_sample_ids=out["sids"],
      lhs_gains=out["gains"],
    ),
    SparseDenseMatmulInputStats(
      max_ids_per_partition=stats["max_ids"],
      max_unique_ids_per_partition=stats["max_unique"],
      required_buffer_size_per_sc=stats["required"],
      id_drop_counters=stats["dropped"],
    ),
  )
