"""Host input conversion: id and weight batches to flat, checked arrays.

The preprocessor accepts, per feature, a batch in any of these forms:

* a dense `[batch, k]` integer array (`k` ids per sample);
* a list or a 1-D object array of 1-D integer arrays, one per sample, possibly
  empty (ragged rows);
* a `(values, row_splits)` tuple: sample `i` holds
  `values[row_splits[i]:row_splits[i + 1]]`.

Ids may have any integer dtype and must lie in `[0, vocabulary_size)`;
weights (optional, per feature) have the ids' shape and must be finite as
float32. A bad batch raises `ValueError` naming the feature, the value and the
sample. Inputs are never modified.

`read_batch` converts the features of a chunk of stacks into one `FlatBatch`:
every feature's rows end to end over one flat id array. Example: feature `a`
with rows `[[3, 8], [5]]` and feature `b` with `(values=[1, 2, 2],
row_splits=[0, 0, 3])` give `values = [3, 8, 5, 1, 2, 2]`,
`row_splits = [0, 2, 3, 3, 6]` and `first_row = [0, 2]`. The fast path
concatenates every row of every feature at once; anything unusual (float or
mixed dtypes, malformed rows) goes through the per-feature conversion, which
names the offending feature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
  from pz_sparsecore.plan import FeaturePlan


@dataclasses.dataclass(frozen=True)
class Ragged:
  """One feature's batch as flat values and row splits (int64 `[B + 1]`)."""

  values: np.ndarray
  splits: np.ndarray

  @property
  def num_rows(self) -> int:
    return len(self.splits) - 1


@dataclasses.dataclass(frozen=True)
class FlatBatch:
  """The features of a chunk, their rows end to end, converted and checked.

  Attributes:
    values: int32 or int64 ids of every row of every feature.
    weights: float32 weights aligned with `values` over the weighted
      features (undefined elsewhere); empty when no feature is weighted.
    row_splits: int64 `[rows + 1]`, row `r` being
      `values[row_splits[r]:row_splits[r + 1]]`.
    first_row: int64, each feature's first row.
    num_rows: int64, each feature's rows.
    weighted: bool, whether each feature has weights.
  """

  values: np.ndarray
  weights: np.ndarray
  row_splits: np.ndarray
  first_row: np.ndarray
  num_rows: np.ndarray
  weighted: np.ndarray


def leaves_like(treedef: Any, tree: Any, what: str) -> list[Any]:
  """The subtrees of `tree` at the leaf positions of `treedef`.

  Raises:
    ValueError: If `tree` does not have `treedef`'s structure.
  """
  try:
    return treedef.flatten_up_to(tree)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"{what} must have the same tree structure as feature_specs "
      f"({treedef}): {e}"
    ) from e


def splits_from_lengths(lengths: Any) -> np.ndarray:
  """Splits (int64 `[B + 1]`, from 0) of `B` consecutive blocks.

  Example: lengths `[2, 0, 3]` give splits `[0, 2, 2, 5]`.
  """
  splits = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=splits[1:])
  return splits


def _describe(leaf: Any) -> str:
  if isinstance(leaf, np.ndarray):
    return f"array of shape {leaf.shape} and dtype {leaf.dtype}"
  return type(leaf).__name__


def _bad_rows(name: str, what: str, error: Exception) -> ValueError:
  return ValueError(
    f"feature {name!r}: every row of ragged {what} must be a 1-D array: {error}"
  )


def _concat_rows(name: str, rows: Any, what: str) -> Ragged:
  """Concatenates ragged rows (an object array or a list of 1-D arrays)."""
  try:
    lengths = np.fromiter(map(len, rows), np.int64, count=len(rows))
  except TypeError as e:
    raise _bad_rows(name, what, e) from e
  splits = splits_from_lengths(lengths)
  if len(lengths) == 0:
    return Ragged(np.zeros(0, np.int32), splits)
  try:
    values = np.concatenate(rows)
  except (ValueError, TypeError) as e:
    raise _bad_rows(name, what, e) from e
  if values.ndim != 1 or len(values) != splits[-1]:
    raise ValueError(f"feature {name!r}: rows of ragged {what} must be 1-D")
  if values.dtype.kind not in "iu" and what == "ids":
    # Empty rows made with np.array([]) are float64; ignore their dtype.
    nonempty = [r for r in rows if len(r)]
    values = np.concatenate(nonempty) if nonempty else np.zeros(0, np.int32)
    if values.dtype.kind not in "iu":
      for i, row in enumerate(rows):
        row = np.asarray(row)
        if row.size and row.dtype.kind not in "iu":
          raise ValueError(
            f"feature {name!r}: ids must be integers, got dtype {row.dtype} "
            f"at sample {i}"
          )
  return Ragged(values, splits)


def _from_tuple(name: str, leaf: tuple[Any, ...], what: str) -> Ragged:
  """Checks a `(values, row_splits)` tuple."""
  if len(leaf) != 2:
    raise ValueError(
      f"feature {name!r}: a tuple of {what} must be (values, row_splits), "
      f"got {len(leaf)} items"
    )
  values = np.asarray(leaf[0])
  splits = np.asarray(leaf[1])
  if values.ndim != 1:
    raise ValueError(
      f"feature {name!r}: the values of (values, row_splits) {what} must "
      f"be 1-D, got shape {values.shape}"
    )
  if splits.ndim != 1 or len(splits) < 1 or splits.dtype.kind not in "iu":
    raise ValueError(
      f"feature {name!r}: row_splits of {what} must be a 1-D integer array "
      f"starting at 0, got {_describe(splits)}"
    )
  splits = splits.astype(np.int64)
  if (
    splits[0] != 0
    or splits[-1] != len(values)
    or np.any(splits[1:] < splits[:-1])
  ):
    raise ValueError(
      f"feature {name!r}: row_splits of {what} must rise from 0 to "
      f"len(values)={len(values)}, got {splits[0]} .. {splits[-1]}"
    )
  return Ragged(values, splits)


def to_ragged(name: str, leaf: Any, what: str) -> Ragged:
  """Converts one feature's ids (or weights) to values and row splits.

  Args:
    name: The feature's name (for errors).
    leaf: The batch, in one of the module's forms.
    what: "ids" or "weights" (for errors).

  Returns:
    The batch as a `Ragged`.

  Raises:
    ValueError: If `leaf` is not a batch in one of the accepted forms.
  """
  if isinstance(leaf, tuple):
    return _from_tuple(name, leaf, what)
  if isinstance(leaf, list):
    return _concat_rows(name, leaf, what)
  if isinstance(leaf, np.ndarray) and leaf.dtype == object:
    if leaf.ndim != 1:
      raise ValueError(
        f"feature {name!r}: a ragged object array of {what} must be 1-D, got "
        f"shape {leaf.shape}"
      )
    return _concat_rows(name, leaf, what)
  try:
    array = np.asarray(leaf)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"feature {name!r}: cannot read {what} from {_describe(leaf)}: {e}"
    ) from e
  if array.ndim != 2:
    raise ValueError(
      f"feature {name!r}: dense {what} must be 2-D [batch, k], got shape "
      f"{array.shape} (use x[:, None] for one id per sample, or a ragged "
      "format)"
    )
  batch, k = array.shape
  return Ragged(array.reshape(-1), np.arange(batch + 1, dtype=np.int64) * k)


def _sample_of(splits: np.ndarray, index: int) -> int:
  return int(np.searchsorted(splits, index, side="right")) - 1


def check_ids(name: str, ids: Ragged, vocab: int) -> None:
  """Checks that `ids` are integers in `[0, vocab)`.

  Raises:
    ValueError: Naming the first bad id and its sample.
  """
  values = ids.values
  if values.dtype.kind not in "iu":
    raise ValueError(
      f"feature {name!r}: ids must be integers, got dtype {values.dtype}"
    )
  if not values.size:
    return
  if values.min() >= 0 and values.max() < vocab:
    return
  bad = int(np.flatnonzero((values < 0) | (values >= vocab))[0])
  raise ValueError(
    f"feature {name!r}: id {values[bad]} outside [0, {vocab}) at sample "
    f"{_sample_of(ids.splits, bad)}"
  )


def check_weights(name: str, weights: Ragged, ids: Ragged) -> np.ndarray:
  """Float32 weights aligned with `ids`, validated.

  Raises:
    ValueError: If the weights are not real, finite (as float32) numbers
      shaped like the ids.
  """
  if weights.values.dtype.kind not in "iuf":
    raise ValueError(
      f"feature {name!r}: weights must be real numbers, got dtype "
      f"{weights.values.dtype}"
    )
  if weights.num_rows != ids.num_rows:
    raise ValueError(
      f"feature {name!r}: {weights.num_rows} rows of weights for "
      f"{ids.num_rows} rows of ids"
    )
  if not np.array_equal(weights.splits, ids.splits):
    row = int(np.flatnonzero(weights.splits != ids.splits)[0]) - 1
    lengths = np.diff(ids.splits), np.diff(weights.splits)
    raise ValueError(
      f"feature {name!r}: sample {row} has {lengths[0][row]} ids but "
      f"{lengths[1][row]} weights"
    )
  with np.errstate(over="ignore", invalid="ignore"):
    values = weights.values.astype(np.float32)
  if values.size and not np.isfinite(values).all():
    bad = int(np.flatnonzero(~np.isfinite(values))[0])
    raise ValueError(
      f"feature {name!r}: weight {weights.values[bad]} is not finite (as "
      f"float32) at sample {_sample_of(ids.splits, bad)}"
    )
  return values


def _concat_all(
  features: Sequence[FeaturePlan], leaves: list[Any]
) -> tuple[np.ndarray, list[np.ndarray]] | None:
  """Every row of every feature in one array, or None when unusual."""
  pieces: list[Any] = []
  splits = []
  for feature, leaf in zip(features, leaves, strict=True):
    if isinstance(leaf, list) or (
      isinstance(leaf, np.ndarray) and leaf.dtype == object and leaf.ndim == 1
    ):
      try:
        lengths = np.fromiter(map(len, leaf), np.int64, count=len(leaf))
      except TypeError:
        return None
      split = splits_from_lengths(lengths)
      pieces.extend(leaf)
    else:
      ids = to_ragged(feature.name, leaf, "ids")
      split = ids.splits
      pieces.append(ids.values)
    splits.append(split)
  if not pieces:
    return None
  try:
    values = np.concatenate(pieces)
  except (ValueError, TypeError):
    return None
  if (
    values.ndim != 1
    or values.dtype.kind not in "iu"
    or len(values) != sum(int(s[-1]) for s in splits)
  ):
    return None
  return values, splits


def gather_ids(
  features: Sequence[FeaturePlan], leaves: list[Any]
) -> tuple[np.ndarray, list[Ragged]]:
  """All features' ids in one flat int32/int64 array, range checked.

  Args:
    features: The features, in the order of `leaves`.
    leaves: Their id batches.

  Returns:
    The flat ids and, per feature, a `Ragged` whose `values` is its slice of
    them.

  Raises:
    ValueError: On a malformed batch or an id out of range.
  """
  concatenated = _concat_all(features, leaves)
  if concatenated is None:
    # Slow path: convert feature by feature (raises naming the feature).
    ragged = [
      to_ragged(f.name, x, "ids") for f, x in zip(features, leaves, strict=True)
    ]
    for feature, ids in zip(features, ragged, strict=True):
      check_ids(feature.name, ids, feature.vocabulary_size)
    parts = [r.values.astype(np.int64, copy=False) for r in ragged]
    values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    splits = [r.splits for r in ragged]
  else:
    values, splits = concatenated
  ragged = []
  start = 0
  for split in splits:
    end = start + int(split[-1])
    ragged.append(Ragged(values[start:end], split))
    start = end
  for feature, ids in zip(features, ragged, strict=True):
    check_ids(feature.name, ids, feature.vocabulary_size)
  if values.dtype not in (np.int32, np.int64):
    values = values.astype(np.int64)
  return values, ragged


def _flatten(
  values: np.ndarray, ragged: list[Ragged], weights: list[np.ndarray | None]
) -> FlatBatch:
  """Lays the features' rows and weights end to end."""
  weighted = np.array([w is not None for w in weights], np.bool_)
  flat_weights = np.empty(len(values) if weighted.any() else 0, np.float32)
  row_splits = np.empty(sum(r.num_rows for r in ragged) + 1, np.int64)
  first_row = np.zeros(len(ragged), np.int64)
  value_pos = row_pos = 0
  for i, r in enumerate(ragged):
    size = len(r.values)
    if weights[i] is not None:
      flat_weights[value_pos : value_pos + size] = weights[i]
    row_splits[row_pos : row_pos + r.num_rows] = r.splits[:-1] + value_pos
    first_row[i] = row_pos
    value_pos += size
    row_pos += r.num_rows
  row_splits[row_pos] = value_pos
  return FlatBatch(
    values=values,
    weights=flat_weights,
    row_splits=row_splits,
    first_row=first_row,
    num_rows=np.array([r.num_rows for r in ragged], np.int64),
    weighted=weighted,
  )


def read_batch(
  features: Sequence[FeaturePlan],
  id_leaves: list[Any],
  weight_leaves: list[Any],
) -> FlatBatch:
  """Converts and checks the ids and weights of `features`.

  Args:
    features: The features, in the order of the leaves.
    id_leaves: Their id batches.
    weight_leaves: Their weights, None for an unweighted feature.

  Returns:
    Every feature's rows end to end.

  Raises:
    ValueError: On a malformed batch, an id out of range or bad weights.
  """
  values, ragged = gather_ids(features, id_leaves)
  weights = [
    None
    if leaf is None
    else check_weights(f.name, to_ragged(f.name, leaf, "weights"), ids)
    for f, ids, leaf in zip(features, ragged, weight_leaves, strict=True)
  ]
  return _flatten(values, ragged, weights)
