"""Host input conversion: id and weight batches to flat, checked arrays.

The preprocessor accepts, per feature, a batch in any of these forms:

* a dense `[batch, k]` integer array (`k` ids per sample), or a 2-D object
  array holding one number per element (read as dense, as upstream does);
* a list or a 1-D object array of 1-D integer arrays, one per sample, possibly
  empty (ragged rows);
* a `(values, row_splits)` tuple: sample `i` holds
  `values[row_splits[i]:row_splits[i + 1]]`;
* a 2-D `jax.experimental.sparse.BCOO` whose data are the ids (converted
  to `(values, row_splits)` by `coo_input.bcoo_rows`, with its weights).

Ids may have any integer dtype and must lie in `[0, vocabulary_size)`;
weights (optional, per feature) have the ids' shape and must be finite as
float32. A bad batch raises `ValueError` naming the feature, the value and the
sample. Inputs are never modified.

`read_batch` converts the features into one `FlatBatch`:
every feature's rows end to end over one flat id array. Example: feature `a`
with rows `[[3, 8], [5]]` and feature `b` with `(values=[1, 2, 2],
row_splits=[0, 0, 3])` give `values = [3, 8, 5, 1, 2, 2]`,
`row_splits = [0, 2, 3, 3, 6]` and `first_row = [0, 2]`.

Reading. The compiled reader (`_pzsc_ragged`, `csrc/ragged_reader.cc`)
walks the object arrays, lists and arrays of every feature with the C API
and writes every id, range checked, straight into the flat array: no
Python-level loop over rows. A feature it cannot read (another container,
rows that are not integer arrays, bad row splits, an id out of range) goes
through the Python conversion, which raises naming the feature and the value,
or reads an unusual but valid batch. Without the compiled reader (not built),
importing this module warns once (`ReaderFallbackWarning`) and every batch
goes through the Python conversion.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pz_sparsecore import _extension
from pz_sparsecore.host import coo_input

if TYPE_CHECKING:
  from pz_sparsecore.core.plan import FeaturePlan

# Ids of larger vocabularies do not fit int32.
_INT32_LIMIT = 2**31
_INT64_MAX = 2**63 - 1


READER_ENV = _extension.READER_ENV


class ReaderFallbackWarning(RuntimeWarning):
  """The Python conversion reads ids where the compiled reader was expected."""


def _load_reader() -> Any:
  """The compiled reader module, or None (with a warning) if it cannot load."""
  try:
    return _extension.load(_extension.READER_MODULE, READER_ENV)
  except ImportError as e:
    warnings.warn(
      f"the compiled ragged-id reader did not load ({e}); preprocessing "
      "converts ids in Python, several times slower (rebuild with "
      "`pip install -e .`)",
      ReaderFallbackWarning,
      stacklevel=2,
    )
    return None


READER = _load_reader()
"""The compiled reader module, or None (ids are then converted in Python)."""


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
  """The features, their rows end to end, converted and checked.

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
  splits = coo_input.splits_from_lengths(lengths)
  if len(lengths) == 0:
    return Ragged(np.zeros(0, np.int32), splits)
  try:
    values = np.concatenate(rows)
  except (ValueError, TypeError) as e:
    raise _bad_rows(name, what, e) from e
  if values.ndim != 1 or len(values) != splits[-1]:
    raise ValueError(f"feature {name!r}: rows of ragged {what} must be 1-D")
  if what != "ids":
    return Ragged(values, splits)
  for i, row in enumerate(rows):
    row = np.asarray(row)
    if not row.size:
      continue
    if row.dtype.kind not in "iu":
      raise ValueError(
        f"feature {name!r}: ids must be integers, got dtype {row.dtype} "
        f"at sample {i}"
      )
    if row.dtype == np.uint64 and row.max() > _INT64_MAX:
      raise ValueError(
        f"feature {name!r}: id {row.max()} at sample {i} is outside any "
        "vocabulary (over 2**63 - 1)"
      )
  if values.dtype.kind not in "iu":
    # Float64 from empty rows made with np.array([]), or from mixing int64
    # and uint64 rows: read the (integer) non-empty rows as int64.
    values = np.zeros(0, np.int64)
    nonempty = [np.asarray(r).astype(np.int64) for r in rows if len(r)]
    if nonempty:
      values = np.concatenate(nonempty)
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


def _dense_objects(name: str, leaf: np.ndarray, what: str) -> np.ndarray:
  """A 2-D object array of numbers (upstream reads it as dense) as numbers."""
  try:
    array = np.array(leaf.tolist())
  except ValueError:  # ragged elements
    array = None
  if array is None or (array.shape != leaf.shape and leaf.size):
    # Some element is not a number: name the first (the only per-element
    # pass, on the error path).
    index, item = next(
      (i, x) for i, x in enumerate(leaf.flat) if np.ndim(x) != 0
    )
    raise ValueError(
      f"feature {name!r}: a 2-D object array of {what} must hold one "
      f"number per element, got {_describe(item)} at sample "
      f"{index // max(leaf.shape[1], 1)}"
    )
  return array if array.size else np.zeros(leaf.shape, np.int64)


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
    if leaf.ndim == 2:
      leaf = _dense_objects(name, leaf, what)
    elif leaf.ndim != 1:
      raise ValueError(
        f"feature {name!r}: an object array of {what} must be 1-D (ragged "
        f"rows) or 2-D (one number per element), got shape {leaf.shape}"
      )
    else:
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


def count_rows(name: str, leaf: Any, what: str = "ids") -> int:
  """The rows (samples) of one feature's batch in any accepted form.

  Raises:
    ValueError: Naming the feature, for a leaf in no accepted form.
  """
  if isinstance(leaf, tuple):
    # The row splits' length; the reader checks them (every batch is
    # read), so they are not checked twice here.
    splits = leaf[1] if len(leaf) == 2 else None
    if getattr(splits, "ndim", None) == 1:
      return len(splits) - 1
    return _from_tuple(name, leaf, what).num_rows
  for reader in LEAF_FORMATS:
    if reader.is_leaf(leaf):
      return int(leaf.shape[0])
  if isinstance(leaf, list):
    return len(leaf)
  if isinstance(leaf, np.ndarray) and leaf.ndim >= 1:
    return int(leaf.shape[0])
  return to_ragged(name, leaf, what).num_rows


def _empty_row(rows: Any) -> np.ndarray:
  """An empty row like the first of `rows` (int64 if there is none)."""
  first = np.asarray(rows[0]) if len(rows) else np.zeros(0, np.int64)
  return first.reshape(-1)[:0]


def _padded_leaf(name: str, leaf: Any, extra: int, what: str) -> Any:
  """`leaf` with `extra` empty rows after its own, in a form it keeps
  (rows of any dtype stay rows: raw ids may be strings)."""
  if isinstance(leaf, tuple):
    ragged = _from_tuple(name, leaf, what)
    end = np.full(extra, ragged.splits[-1], np.int64)
    return (ragged.values, np.concatenate([ragged.splits, end]))
  if isinstance(leaf, list):
    return leaf + [_empty_row(leaf)] * extra
  if isinstance(leaf, np.ndarray) and leaf.dtype == object and leaf.ndim == 1:
    tail = np.empty(extra, object)
    tail[:] = [_empty_row(leaf)] * extra
    return np.concatenate([leaf, tail])
  if isinstance(leaf, np.ndarray) and leaf.ndim == 2:
    if leaf.dtype == object:
      leaf = _dense_objects(name, leaf, what)
    if leaf.dtype.kind not in "iuf":
      return _padded_leaf(name, list(leaf), extra, what)
    ragged = to_ragged(name, leaf, what)
  else:
    ragged = to_ragged(name, leaf, what)
  return _padded_leaf(name, (ragged.values, ragged.splits), extra, what)


def pad_rows(name: str, ids: Any, weights: Any, rows: int) -> tuple[Any, Any]:
  """One feature's ids and weights with empty rows appended up to `rows`
  (padding samples: they look up nothing).

  Example: dense ids `[[3, 4], [5, 6]]` padded to 4 rows become
  `(values=[3, 4, 5, 6], row_splits=[0, 2, 4, 4, 4])`.

  Args:
    name: The feature (for errors).
    ids: Its batch, in any accepted form.
    weights: Its weights, or None.
    rows: The rows wanted (at least the batch's).

  Returns:
    `(ids, weights)` holding `rows` rows.

  Raises:
    ValueError: As the conversion, naming the feature.
  """
  for reader in LEAF_FORMATS:
    if reader.is_leaf(ids):
      ids, weights = reader.to_rows(name, ids, weights)
  extra = rows - count_rows(name, ids)
  if extra <= 0:
    return ids, weights
  if weights is not None:
    weights = _padded_leaf(name, weights, extra, "weights")
  return _padded_leaf(name, ids, extra, "ids"), weights


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


def _gather_ids_python(
  features: Sequence[FeaturePlan], leaves: list[Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`read_ids` in Python, feature by feature (raises naming the feature)."""
  ragged = []
  for feature, leaf in zip(features, leaves, strict=True):
    ids = to_ragged(feature.name, leaf, "ids")
    check_ids(feature.name, ids, feature.vocabulary_size)
    ragged.append(ids)
  return join_rows(ragged)


def join_rows(
  ragged: Sequence[Ragged],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Features' ids end to end, as `read_ids` returns them (int64 values)."""
  parts = [r.values.astype(np.int64, copy=False) for r in ragged]
  values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
  num_rows = np.array([r.num_rows for r in ragged], np.int64)
  row_splits = np.empty(int(num_rows.sum()) + 1, np.int64)
  row_pos = value_pos = 0
  for r in ragged:
    row_splits[row_pos : row_pos + r.num_rows] = r.splits[:-1] + value_pos
    row_pos += r.num_rows
    value_pos += len(r.values)
  row_splits[row_pos] = value_pos
  return values, row_splits, num_rows


def read_ids(
  features: Sequence[FeaturePlan], leaves: list[Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Every feature's ids end to end, range checked.

  The compiled reader reads the usual forms; a feature it cannot read goes
  through the Python conversion, which raises naming the feature (or, for
  an unusual but valid batch, reads every feature).

  Args:
    features: The features, in the order of `leaves`.
    leaves: Their id batches.

  Returns:
    `(values, row_splits, num_rows)`: int32 (int64 for vocabularies over
    `2**31`) ids, int64 `[rows + 1]` row splits over them (every feature's
    rows end to end) and int64 rows per feature.

  Raises:
    ValueError: On a malformed batch or an id out of range.
  """
  if READER is not None:
    vocab = np.array([f.vocabulary_size for f in features], np.int64)
    wide = bool(vocab.max(initial=0) > _INT32_LIMIT)
    result = READER.read_ids(list(leaves), vocab, wide)
    if not isinstance(result, int):
      return result
    # Raises naming feature `result`, unless its batch is unusual but valid.
    feature = features[result]
    ids = to_ragged(feature.name, leaves[result], "ids")
    check_ids(feature.name, ids, feature.vocabulary_size)
  return _gather_ids_python(features, leaves)


def _flatten_weights(
  features: Sequence[FeaturePlan],
  weight_leaves: list[Any],
  values: np.ndarray,
  row_splits: np.ndarray,
  first_row: np.ndarray,
) -> np.ndarray:
  """The weighted features' weights aligned with `values`, validated."""
  flat_weights = np.empty(len(values), np.float32)
  for i, (feature, leaf) in enumerate(
    zip(features, weight_leaves, strict=True)
  ):
    if leaf is None:
      continue
    splits = row_splits[first_row[i] : first_row[i + 1] + 1]
    a, b = int(splits[0]), int(splits[-1])
    ids = Ragged(values[a:b], splits - a)
    weights = to_ragged(feature.name, leaf, "weights")
    flat_weights[a:b] = check_weights(feature.name, weights, ids)
  return flat_weights


LEAF_FORMATS = (coo_input,)
"""Readers of the batch forms converted to `(values, row_splits)` before
reading (today the BCOO reader). Each is a module with `FORMAT` (its name,
for messages), `is_leaf(leaf)` and `to_rows(name, ids, weights) -> (ids,
weights)`; a new input format is one such module, listed here."""


def convert_formats(
  features: Sequence[FeaturePlan],
  id_leaves: list[Any],
  weight_leaves: list[Any],
) -> tuple[list[Any], list[Any]]:
  """The leaves with every batch of a `LEAF_FORMATS` form as
  `(values, row_splits)` tuples."""
  id_leaves, weight_leaves = list(id_leaves), list(weight_leaves)
  for i, feature in enumerate(features):
    for reader in LEAF_FORMATS:
      if reader.is_leaf(id_leaves[i]):
        id_leaves[i], weight_leaves[i] = reader.to_rows(
          feature.name, id_leaves[i], weight_leaves[i]
        )
      elif reader.is_leaf(weight_leaves[i]):
        raise ValueError(
          f"feature {feature.name!r}: {reader.FORMAT} weights need "
          f"{reader.FORMAT} ids, got ids as {_describe(id_leaves[i])}"
        )
  return id_leaves, weight_leaves


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
  id_leaves, weight_leaves = convert_formats(features, id_leaves, weight_leaves)
  values, row_splits, num_rows = read_ids(features, id_leaves)
  rows = coo_input.splits_from_lengths(num_rows)
  weighted = np.array([w is not None for w in weight_leaves], np.bool_)
  if weighted.any():
    weights = _flatten_weights(
      features, weight_leaves, values, row_splits, rows
    )
  else:
    weights = np.empty(0, np.float32)
  return FlatBatch(
    values=values,
    weights=weights,
    row_splits=row_splits,
    first_row=rows[:-1],
    num_rows=num_rows,
    weighted=weighted,
  )
