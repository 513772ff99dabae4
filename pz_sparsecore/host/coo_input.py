"""Reading sparse COO id batches: `(indices, values, dense_shape)` and BCOO.


A feature's batch may come as a sparse matrix in coordinate form, as
`tf.sparse.SparseTensor` holds it: `indices` `[n, 2]` (sample, position)
pairs, `values` `[n]` the ids at those positions, and `dense_shape`
`[batch, k]`. Sample `r`'s ids are the values of the entries whose row is
`r`, in order of their column; a sample with no entry is an empty row. Every
id weighs 1 (the SparseTensor form carries no weights).

`host.sparse_coo` preprocesses one such triple per feature. A 2-D
`jax.experimental.sparse.BCOO` is the JAX form of the same thing (its `data` are
the ids, its `indices` and `shape` the rest) and may be a leaf of
`preprocess_sparse_dense_matmul_input`'s `features` directly; its weights, if
any, are the `data` of a BCOO with the same indices, or an `[nse]` array aligned
with its data, in `features_weights` (None: all 1). Build such a BCOO from its
parts: `BCOO.fromdense` drops zeros, and 0 is an id.

Conversion to rows (`coo_rows`), vectorised over the entries: the entries
are put in row-major order (left as they are when already sorted, which
costs one comparison pass), the row splits are counted from the row
indices, and the values become the rows' ids. Example: `indices
[[2, 1], [0, 0], [2, 0], [0, 2]]`, `values [7, 3, 5, 4]`, `dense_shape
[4, 3]` give ids `[3, 4, 5, 7]` and row splits `[0, 2, 2, 4, 4]`, the rows
`[[3, 4], [], [5, 7], []]`.

Differences from jax-tpu-embedding, which assumes sorted, distinct indices
(and reads garbage, or aborts in a debug build, otherwise): unsorted indices
are sorted; an index outside `dense_shape` or given twice, mismatched
lengths and malformed arrays raise `ValueError` naming the feature and the
value; ids keep their integer dtype (upstream casts them to int32). A BCOO
entry whose index lies at or past its shape is padding, as in JAX (e.g.
`bcoo_sum_duplicates(..., nse=...)` writes such entries), and is skipped.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

_INT64_BITS = 64
_INT64_MAX = 2**63 - 1


def splits_from_lengths(lengths: Any) -> np.ndarray:
  """Splits (int64 `[B + 1]`, from 0) of `B` consecutive blocks.

  Example: lengths `[2, 0, 3]` give splits `[0, 2, 2, 5]`.
  """
  splits = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=splits[1:])
  return splits


def _index_array(name: str, indices: Any) -> np.ndarray:
  """`indices` as an integer `[n, 2]` array (an empty one from `[]`)."""
  array = np.asarray(indices)
  if array.size == 0:
    return np.zeros((0, 2), np.int64)
  if array.ndim != 2 or array.shape[1] != 2 or array.dtype.kind not in "iu":
    raise ValueError(
      f"feature {name!r}: indices must be an integer array of shape [n, 2] "
      f"(sample, position), got shape {array.shape} and dtype {array.dtype}"
    )
  if array.dtype == np.uint64:
    if array.max() > _INT64_MAX:
      raise ValueError(
        f"feature {name!r}: index {array.max()} is outside any dense_shape"
      )
    return array.astype(np.int64)
  return array


def _shape(name: str, dense_shape: Any) -> tuple[int, int]:
  array = np.asarray(dense_shape)
  if array.shape != (2,) or array.dtype.kind not in "iu" or np.any(array < 0):
    raise ValueError(
      f"feature {name!r}: dense_shape must be two non-negative integers "
      f"[batch, k], got {dense_shape!r}"
    )
  return int(array[0]), int(array[1])


def _entries(name: str, values: Any, count: int, what: str) -> np.ndarray:
  """`values` as a 1-D array of `count` entries (integers if empty)."""
  array = np.asarray(values)
  if array.ndim != 1 or len(array) != count:
    raise ValueError(
      f"feature {name!r}: {what} must be 1-D with one entry per index "
      f"({count}), got shape {array.shape}"
    )
  if count == 0 and array.dtype.kind not in "iu" and what == "values":
    return np.zeros(0, np.int32)
  return array


def _in_bounds(
  name: str,
  indices: np.ndarray,
  shape: tuple[int, int],
  padding: bool,
) -> np.ndarray | None:
  """Checks the indices against `shape`; the entries to keep (None: all).

  Raises:
    ValueError: On a negative index, or one at or past `shape` unless
      `padding` (then the entry is dropped).
  """
  if not len(indices):
    return None
  # Whole-array and single-column reductions: numpy reduces these several
  # times faster than `indices.max(axis=0)`.
  rows, cols = indices[:, 0], indices[:, 1]
  if indices.min() >= 0 and rows.max() < shape[0] and cols.max() < shape[1]:
    return None
  past = (rows >= shape[0]) | (cols >= shape[1])
  bad = (rows < 0) | (cols < 0)
  if not padding:
    bad |= past
  if bad.any():
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(
      f"feature {name!r}: index {indices[i].tolist()} at entry {i} is "
      f"outside dense_shape {list(shape)}"
    )
  return ~past


def _sort_keys(keys: np.ndarray) -> np.ndarray:
  """Sorts non-negative int64 `keys` in place; the permutation that sorts.

  Each key carries its position in its low bits, so one plain in-place sort
  (several times faster than `np.argsort`) gives both; `np.argsort` when
  the keys have no room for them.
  """
  shift = max(len(keys) - 1, 1).bit_length()
  if int(keys.max()) >> (_INT64_BITS - 1 - shift):
    order = np.argsort(keys)
    keys[:] = keys[order]
    return order
  keys <<= shift
  keys |= np.arange(len(keys))
  keys.sort()
  order = keys & ((1 << shift) - 1)
  keys >>= shift
  return order


def _row_major_order(
  name: str, indices: np.ndarray, shape: tuple[int, int]
) -> np.ndarray | None:
  """The permutation that sorts the entries by (row, column), or None.

  None when they already are in that order.

  Raises:
    ValueError: If two entries share an index.
  """
  rows, cols = indices[:, 0], indices[:, 1]
  if shape[0] * shape[1] <= _INT64_MAX:
    keys = rows.astype(np.int64, copy=False) * shape[1] + cols
    if np.all(keys[1:] > keys[:-1]):
      return None
    order = _sort_keys(keys)
    repeated = keys[1:] == keys[:-1]
  else:
    if np.all(
      (rows[1:] > rows[:-1])
      | ((rows[1:] == rows[:-1]) & (cols[1:] > cols[:-1]))
    ):
      return None
    order = np.lexsort((cols, rows))
    sorted_indices = indices[order]
    repeated = np.all(sorted_indices[1:] == sorted_indices[:-1], axis=1)
  if repeated.any():
    i = int(np.flatnonzero(repeated)[0])
    first, second = sorted(int(j) for j in order[i : i + 2])
    raise ValueError(
      f"feature {name!r}: index {indices[first].tolist()} is given twice "
      f"(entries {first} and {second}); each position holds one id"
    )
  return order


def coo_rows(
  name: str,
  indices: Any,
  values: Any,
  dense_shape: Any,
  weights: Any = None,
  *,
  padding: bool = False,
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
  """One feature's COO batch as `(values, row_splits)` ids and weights.

  Args:
    name: The feature's name (for errors).
    indices: Integer `[n, 2]` (sample, position) pairs, in any order.
    values: The `[n]` ids at those positions.
    dense_shape: `[batch, k]`.
    weights: None, or `[n]` weights aligned with `values`.
    padding: Skip entries whose index is at or past `dense_shape` (BCOO
      padding) instead of raising.

  Returns:
    The ids and the weights (None if `weights` is None), each a
    `(values, row_splits)` pair over `batch` rows in row-major order.

  Raises:
    ValueError: Naming the feature, on malformed arrays, mismatched
      lengths, an index outside `dense_shape` or an index given twice.
  """
  shape = _shape(name, dense_shape)
  index_array = _index_array(name, indices)
  ids = _entries(name, values, len(index_array), "values")
  if weights is not None:
    weights = _entries(name, weights, len(index_array), "weights")
  keep = _in_bounds(name, index_array, shape, padding)
  if keep is not None:
    index_array, ids = index_array[keep], ids[keep]
    weights = None if weights is None else weights[keep]
  order = _row_major_order(name, index_array, shape)
  if order is not None:
    ids = ids[order]
    weights = None if weights is None else weights[order]
  splits = splits_from_lengths(
    np.bincount(index_array[:, 0], minlength=shape[0])
  )
  return (ids, splits), None if weights is None else (weights, splits)


def is_bcoo(leaf: Any) -> bool:
  """Whether `leaf` is a `jax.experimental.sparse.BCOO`.

  Does not import `jax.experimental.sparse`: without it no BCOO exists.
  """
  bcoo = sys.modules.get("jax.experimental.sparse.bcoo")
  return bcoo is not None and isinstance(leaf, bcoo.BCOO)


def _check_same_sparsity(
  name: str, ids: Any, indices: np.ndarray, weights: Any
) -> None:
  """Raises unless the BCOO `weights` has the shape and indices of `ids`."""
  weight_indices = np.asarray(weights.indices)
  if weights.shape != ids.shape or weight_indices.shape != indices.shape:
    raise ValueError(
      f"feature {name!r}: a BCOO of weights must have the same indices as "
      f"its ids: weights of shape {weights.shape} with {weights.nse} "
      f"entries, ids of shape {ids.shape} with {ids.nse}"
    )
  differ = np.flatnonzero((weight_indices != indices).any(axis=1))
  if len(differ):
    i = int(differ[0])
    raise ValueError(
      f"feature {name!r}: a BCOO of weights must have the same indices as "
      f"its ids: entry {i} is {weight_indices[i].tolist()} in the weights, "
      f"{indices[i].tolist()} in the ids"
    )


def bcoo_rows(
  name: str, ids: Any, weights: Any = None
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
  """A BCOO feature's ids and weights as `(values, row_splits)` pairs.

  Args:
    name: The feature's name (for errors).
    ids: A 2-D `BCOO` (no batch or dense dimensions) whose data are ids.
    weights: None, a `BCOO` with the same indices whose data are the
      weights, or an `[nse]` array aligned with `ids.data`.

  Returns:
    As `coo_rows`; padding entries are skipped.

  Raises:
    ValueError: Naming the feature, on a BCOO that is not a plain 2-D
      matrix, weights that do not match it, or bad indices as `coo_rows`.
  """
  if ids.ndim != 2 or ids.n_batch or ids.n_dense:
    raise ValueError(
      f"feature {name!r}: a BCOO of ids must be 2-D [batch, k] with no "
      f"batch or dense dimensions, got shape {ids.shape}, n_batch="
      f"{ids.n_batch}, n_dense={ids.n_dense}"
    )
  indices = np.asarray(ids.indices)
  if is_bcoo(weights):
    _check_same_sparsity(name, ids, indices, weights)
    weights = weights.data
  return coo_rows(
    name,
    indices,
    np.asarray(ids.data),
    ids.shape,
    None if weights is None else np.asarray(weights),
    padding=True,
  )


# The leaf-format interface of `ragged_input.LEAF_FORMATS`.
FORMAT = "BCOO"
is_leaf = is_bcoo
to_rows = bcoo_rows
