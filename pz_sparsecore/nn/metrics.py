"""Streaming metrics for recommendation training and evaluation.

Each metric is a small object with `update(...)` (one batch), `compute()`
(a Python float), `reset()` and `merge(other)` (add another metric's state,
e.g. one built on another process or over another part of the data).
`MetricSet` updates and computes several at once, and `fit_callback` feeds
one from `SparseCoreTrainer.fit`'s `callback(i, aux)`.

Definitions (`w` the weights, 1 when none are given; sums run over every
example seen; the pointwise metrics follow TorchRec's RecMetrics):

* `NE`, normalized entropy: the weighted cross entropy of the predictions
  divided by the entropy of the base rate `p = sum(w y) / sum(w)`:
  `NE = sum(w ce) / -(sum(w y) log p + sum(w (1 - y)) log(1 - p))` with
  `ce = -(y log q + (1 - y) log(1 - q))`. Probabilities `q` are clipped to
  `[NE_ETA, 1 - NE_ETA]` (TorchRec's `eta`); with `from_logits=True` the
  logs are the exact log-sigmoids of the logits, without clipping. Labels
  may be soft (in `[0, 1]`). Unlike TorchRec, which clips the base rate
  too, a base rate of 0 or 1 (entropy 0) gives NaN, not a huge number.
* `Calibration`: `sum(w q) / sum(w y)`.
* `MSE`, `RMSE`, `MAE`: `sum(w (q - y)^2) / sum(w)`, its square root, and
  `sum(w |q - y|) / sum(w)`; labels are any real numbers (ratings).
* `AUC`: the area under the ROC curve, computed exactly as the weighted
  Mann-Whitney statistic with ties counted one half (average ranks):
  `sum over (i, j) of w_i y_i w_j (1 - y_j) [s_i > s_j or 1/2 if s_i = s_j]`
  divided by `sum(w y) sum(w (1 - y))`. For binary labels this is
  scikit-learn's `roc_auc_score(y, s, sample_weight=w)`; a soft label
  counts as a positive of weight `w y` and a negative of weight
  `w (1 - y)`. It depends on the order of the scores only, so logits and
  probabilities give the same value (logits keep ties that a float64
  sigmoid would create: prefer them).
* `RecallAtK`: per query, the relevant items among the first `k` retrieved
  divided by the number of relevant items (the standard definition), or,
  with `capped=True`, by `min(#relevant, k)` (so that a perfect top-k
  scores 1 however many items are relevant); averaged over queries.
* `NDCGAtK`: per query, `DCG / IDCG` with binary relevance and log2
  discounts, `DCG = sum over hits at 0-based rank r < k of 1 / log2(r + 2)`,
  `IDCG` the same sum over the first `min(#relevant, k)` ranks; averaged
  over queries.

Retrieval inputs: `retrieved` is an integer `[Q, K]` array of item ids,
best first, `K >= k` (only the first `k` columns count), padded with
`RETRIEVAL_PADDING` (-1), such as the ids `pzsc.top_k` returns;
`relevant` is either a `[Q, R]` integer array padded with -1 or a sequence
of `Q` 1-D integer arrays. Relevance is binary and a set: duplicate
relevant ids count once, and a retrieved id counts at its first rank only.
Queries without relevant items are skipped and counted
(`skipped_queries`); optional per-query `weights` weight the average.

Worked numbers. AUC of scores `[0.1, 0.4, 0.4, 0.8]`, labels
`[0, 0, 1, 1]`: of the four (positive, negative) pairs, 0.8 beats both
negatives, 0.4 beats 0.1 and ties 0.4, so `AUC = (2 + 1 + 0.5) / 4 =
0.875`. One query retrieving `[3, 7, 1]` with relevant `{7, 9}`, `k = 3`:
one hit at rank 1, so recall = 1/2, `DCG = 1 / log2(3) = 0.6309`,
`IDCG = 1 + 1 / log2(3) = 1.6309`, NDCG = 0.3869.

Precision and memory. State lives on the host in float64: `update` copies
its batch to host memory (a `jax.Array`, sharded or not, is gathered; its
copy starts before any waiting) and folds it into float64 sums, so
`update` waits for that batch's arrays only, not for later work queued on
the devices. The sums (NE, calibration, MSE, RMSE, MAE, recall, NDCG) are
O(1) memory and agree with a float64 one-shot computation to float64
rounding (float32 inputs are widened exactly; NE over 10^6 examples in
1,000 batches: 3e-15 relative). `AUC` keeps every example: float64 score,
label and weight, 24 bytes each, O(examples), concatenated lazily at
`compute`, which sorts them (O(n log n), about twice that memory again
while it runs); `max_examples` keeps only the latest examples (TorchRec's
windowed AUC).

Undefined values (no examples; AUC with no positive or no negative weight;
NE with a base rate of 0 or 1; calibration with a zero label sum; a
retrieval metric with no query that has relevant items) are NaN, with an
`UndefinedMetricWarning`. Bad input (shapes that differ, NaN predictions,
labels outside `[0, 1]` for NE/AUC/calibration, probabilities outside
`[0, 1]`, negative or non-finite weights, fewer than `k` retrieved columns)
raises a `ValueError` naming the metric, and the metric is left as it was.

Several processes: an array sharded over processes is gathered onto every
process (a collective: all processes call `update`), so each process's
metric holds the global value. To evaluate disjoint data per process
instead, update with process-local arrays and `merge` the metrics (they
pickle) on one process.

Example, evaluation::

  from pz_sparsecore.nn import metrics

  ms = metrics.MetricSet({
    "auc": metrics.AUC(),
    "ne": metrics.NE(from_logits=True),
    "calibration": metrics.Calibration(from_logits=True),
  })
  for batch in held_out:
    logits = forward(model, batch)          # a (sharded) jax.Array
    ms.update(predictions=logits, labels=batch["labels"])
  print(ms.compute())                       # {"auc": 0.71, "ne": 0.93, ...}

Example, training (the loss function returns the logits and labels in its
aux dict, e.g. `{"loss": loss, "predictions": logits, "labels": labels}`,
unwrapped from NamedArrays)::

  callback = metrics.fit_callback(ms, every=100, report=print)
  trainer.fit(batches, preprocess, callback=callback)
  history = callback.finish()               # [(step, {"auc": ...}), ...]

Example, retrieval::

  recall = metrics.RecallAtK(10)
  recall.update(retrieved=top_ids, relevant=[np.array([4, 17]), ...])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import numpy as np
from penzai import pz

from pz_sparsecore.nn.host import to_host

NE_ETA = 1e-12
"""Probabilities are clipped to `[NE_ETA, 1 - NE_ETA]` in NE (TorchRec's)."""

RETRIEVAL_PADDING = -1
"""The id that pads `retrieved` and `relevant` rows."""


class UndefinedMetricWarning(RuntimeWarning):
  """A metric's value is undefined for the data seen; it is NaN."""


def _undefined(name: str, why: str) -> float:
  warnings.warn(
    f"{name} is undefined: {why}; returning NaN",
    UndefinedMetricWarning,
    stacklevel=3,
  )
  return float("nan")


def _start_copies(values: Any) -> None:
  """Starts the device-to-host copies of the jax arrays among `values`."""
  for value in values:
    if isinstance(value, jax.Array) and value.is_fully_addressable:
      value.copy_to_host_async()


def _host(name: str, *values: Any) -> list[np.ndarray | None]:
  """The values as numpy arrays (None stays None), their device-to-host
  copies started together before waiting for any."""
  for value in values:
    if isinstance(value, pz.nx.NamedArrayBase):
      raise ValueError(
        f"{name}: got a pz.nx.NamedArray; pass its positional array, e.g. "
        "`array.unwrap('batch')`"
      )
  _start_copies(values)
  return [None if v is None else to_host(v) for v in values]


class Metric:
  """The interface of every metric: `update`, `compute`, `reset`, `merge`.

  Subclasses check and convert a batch in `_prepare` (which raises and
  changes nothing) and add it to their state in `_fold` (which cannot
  fail), so that a refused batch leaves the state as it was.
  """

  input_names: ClassVar[tuple[str, ...]] = ()
  """Keyword arguments of `update` (what `MetricSet` hands over)."""
  optional_names: ClassVar[tuple[str, ...]] = ("weights",)
  """Those of `input_names` that may be left out."""

  def __init__(self):
    self.reset()

  @property
  def name(self) -> str:
    """The metric as errors and warnings name it."""
    return type(self).__name__

  def _config(self) -> tuple[Any, ...]:
    """What two metrics must share to be merged."""
    return ()

  def update(self, **inputs: Any) -> None:
    """Adds one batch (see the subclass for the arguments)."""
    self._fold(self._prepare(**inputs))

  def _prepare(self, **inputs: Any) -> Any:
    raise NotImplementedError

  def _fold(self, batch: Any) -> None:
    raise NotImplementedError

  def compute(self) -> float:
    """The metric over every batch since the last `reset`."""
    raise NotImplementedError

  def reset(self) -> None:
    """Forgets every batch."""
    raise NotImplementedError

  def merge(self, other: Metric) -> None:
    """Adds `other`'s state to this one (as if its batches came after).

    Raises:
      ValueError: If `other` is another kind of metric or is configured
        differently (e.g. another `k`).
    """
    if type(other) is not type(self) or other._config() != self._config():
      raise ValueError(
        f"{self.name}: cannot merge {other!r} into {self!r}: the metrics "
        "must be of one type and configuration"
      )
    self._merge(other)

  def _merge(self, other: Metric) -> None:
    raise NotImplementedError

  def __repr__(self) -> str:
    args = ", ".join(repr(c) for c in self._config())
    return f"{type(self).__name__}({args})"


def _check_shape(name: str, what: str, value: np.ndarray, shape) -> None:
  if value.shape != shape:
    raise ValueError(
      f"{name}: {what} shape {value.shape} does not match predictions "
      f"shape {shape}"
    )


def _check_weights(name: str, weights: np.ndarray) -> None:
  if not np.isfinite(weights).all() or (weights < 0).any():
    bad = weights[~(np.isfinite(weights) & (weights >= 0))][0]
    raise ValueError(f"{name}: weights must be finite and >= 0, got {bad!r}")


class _PointwiseMetric(Metric):
  """A metric of per-example predictions, labels and weights."""

  input_names = ("predictions", "labels", "weights")
  binary_labels: ClassVar[bool] = True
  """Whether labels must lie in `[0, 1]` (else: finite)."""

  def update(
    self,
    predictions: Any,
    labels: Any,
    weights: Any | None = None,
  ) -> None:
    """Adds one batch.

    Args:
      predictions: Any shape, any float dtype: numpy or (sharded) jax.
      labels: The same shape.
      weights: None (all 1) or the same shape, finite and >= 0.

    Raises:
      ValueError: On bad input (naming the metric); nothing is added.
    """
    self._fold(self._prepare(predictions, labels, weights))

  def _prepare(self, predictions, labels, weights=None):
    p, y, w = _host(self.name, predictions, labels, weights)
    p, y = p.astype(np.float64), y.astype(np.float64)
    _check_shape(self.name, "labels", y, p.shape)
    if np.isnan(p).any():
      raise ValueError(f"{self.name}: predictions contain NaN")
    if self.binary_labels:
      if not ((y >= 0) & (y <= 1)).all():
        bad = y[~((y >= 0) & (y <= 1))][0]
        raise ValueError(f"{self.name}: labels must lie in [0, 1], got {bad}")
    elif not np.isfinite(y).all() or not np.isfinite(p).all():
      raise ValueError(f"{self.name}: predictions and labels must be finite")
    if w is None:
      w = np.ones_like(p)
    else:
      w = w.astype(np.float64)
      _check_shape(self.name, "weights", w, p.shape)
      _check_weights(self.name, w)
    return self._batch(p.ravel(), y.ravel(), w.ravel())

  def _batch(self, p: np.ndarray, y: np.ndarray, w: np.ndarray) -> Any:
    raise NotImplementedError


class _SumMetric(_PointwiseMetric):
  """A pointwise metric that is a function of a few float64 sums."""

  fields: ClassVar[tuple[str, ...]] = ()

  def reset(self) -> None:
    self.sums = np.zeros(len(self.fields), np.float64)

  def _fold(self, batch: np.ndarray) -> None:
    self.sums = self.sums + batch

  def _merge(self, other: Metric) -> None:
    self.sums = self.sums + other.sums

  def _sum(self, field: str) -> float:
    return float(self.sums[self.fields.index(field)])


class _ProbabilityMetric(_SumMetric):
  """NE and calibration: probabilities, or logits with `from_logits`."""

  def __init__(self, from_logits: bool = False):
    self.from_logits = bool(from_logits)
    super().__init__()

  def _config(self) -> tuple[Any, ...]:
    return (self.from_logits,)

  def __repr__(self) -> str:
    return f"{type(self).__name__}(from_logits={self.from_logits})"

  def _check_predictions(self, p: np.ndarray) -> None:
    if self.from_logits:
      if not np.isfinite(p).all():
        raise ValueError(f"{self.name}: logits must be finite")
    elif not ((p >= 0) & (p <= 1)).all():
      bad = p[~((p >= 0) & (p <= 1))][0]
      raise ValueError(
        f"{self.name}: predictions must be probabilities in [0, 1], got "
        f"{bad}; pass logits with {type(self).__name__}(from_logits=True)"
      )


class NE(_ProbabilityMetric):
  """Normalized entropy (TorchRec's NE); see the module docstring.

  Args:
    from_logits: Predictions are logits (else probabilities in `[0, 1]`).
  """

  fields = ("cross_entropy", "weight", "positive", "negative")

  def _batch(self, p, y, w):
    self._check_predictions(p)
    if self.from_logits:
      log_q, log_not_q = -np.logaddexp(0.0, -p), -np.logaddexp(0.0, p)
    else:
      q = np.clip(p, NE_ETA, 1.0 - NE_ETA)
      log_q, log_not_q = np.log(q), np.log1p(-q)
    ce = -(y * log_q + (1.0 - y) * log_not_q)
    return np.array(
      [np.sum(w * ce), np.sum(w), np.sum(w * y), np.sum(w * (1.0 - y))]
    )

  def compute(self) -> float:
    """The NE of every example seen (NaN when undefined, with a warning)."""
    weight, positive = self._sum("weight"), self._sum("positive")
    negative = self._sum("negative")
    if weight == 0:
      return _undefined(self.name, "no examples (or zero weight)")
    base = positive / weight
    if positive == 0 or negative == 0:
      return _undefined(self.name, f"the base rate is {base}, entropy 0")
    norm = -(positive * np.log(base) + negative * np.log1p(-base))
    return float(self._sum("cross_entropy") / norm)


class Calibration(_ProbabilityMetric):
  """`sum(w q) / sum(w y)` (TorchRec's calibration).

  Args:
    from_logits: Predictions are logits (else probabilities in `[0, 1]`).
  """

  fields = ("predicted", "observed")

  def _batch(self, p, y, w):
    self._check_predictions(p)
    q = np.exp(-np.logaddexp(0.0, -p)) if self.from_logits else p
    return np.array([np.sum(w * q), np.sum(w * y)])

  def compute(self) -> float:
    """The calibration (NaN when the label sum is 0, with a warning)."""
    observed = self._sum("observed")
    if observed == 0:
      return _undefined(self.name, "the weighted label sum is 0")
    return float(self._sum("predicted") / observed)


class MSE(_SumMetric):
  """Mean squared error, `sum(w (q - y)^2) / sum(w)`."""

  binary_labels = False
  fields = ("error", "weight")

  def _batch(self, p, y, w):
    return np.array([np.sum(w * np.square(p - y)), np.sum(w)])

  def _mean(self) -> float:
    weight = self._sum("weight")
    if weight == 0:
      return _undefined(self.name, "no examples (or zero weight)")
    return self._sum("error") / weight

  def compute(self) -> float:
    """The mean squared error (NaN with no examples, with a warning)."""
    return float(self._mean())


class RMSE(MSE):
  """Root mean squared error, `sqrt(MSE)`."""

  def compute(self) -> float:
    """The root mean squared error (NaN with no examples)."""
    return float(np.sqrt(self._mean()))


class MAE(MSE):
  """Mean absolute error, `sum(w |q - y|) / sum(w)`."""

  def _batch(self, p, y, w):
    return np.array([np.sum(w * np.abs(p - y)), np.sum(w)])


class AUC(_PointwiseMetric):
  """Exact ROC AUC over every example seen (or the latest ones).

  Keeps each example's score, label and weight (24 bytes, host memory);
  see the module docstring for the definition and the ties.

  Args:
    max_examples: None (every example), or how many of the latest examples
      to keep (a window, as TorchRec's windowed AUC).
  """

  def __init__(self, max_examples: int | None = None):
    if max_examples is not None and (
      not isinstance(max_examples, int) or max_examples < 1
    ):
      raise ValueError(
        f"AUC: max_examples must be None or an int >= 1, got {max_examples!r}"
      )
    self.max_examples = max_examples
    super().__init__()

  def _config(self) -> tuple[Any, ...]:
    return (self.max_examples,)

  def __repr__(self) -> str:
    return f"AUC(max_examples={self.max_examples})"

  @property
  def num_examples(self) -> int:
    """How many examples the metric holds."""
    return sum(len(chunk[0]) for chunk in self.chunks)

  def reset(self) -> None:
    self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

  def _batch(self, p, y, w):
    return (p, y, w)

  def _fold(self, batch) -> None:
    if len(batch[0]):
      self.chunks = self._window([*self.chunks, batch])

  def _merge(self, other: Metric) -> None:
    self.chunks = self._window([*self.chunks, *other.chunks])

  def _window(self, chunks: list) -> list:
    """The chunks less the examples beyond `max_examples`, oldest first."""
    excess = sum(len(c[0]) for c in chunks) - (self.max_examples or 0)
    if self.max_examples is None or excess <= 0:
      return chunks
    while len(chunks[0][0]) <= excess:
      excess -= len(chunks[0][0])
      chunks = chunks[1:]
    return [tuple(a[excess:] for a in chunks[0]), *chunks[1:]]

  def compute(self) -> float:
    """The AUC (NaN without both positive and negative weight, warning)."""
    if len(self.chunks) > 1:
      self.chunks = [
        tuple(np.concatenate(a) for a in zip(*self.chunks, strict=True))
      ]
    if not self.chunks:
      return _undefined(self.name, "no examples")
    scores, labels, weights = self.chunks[0]
    _, group = np.unique(scores, return_inverse=True)
    positive = np.bincount(group, weights * labels)
    negative = np.bincount(group, weights * (1.0 - labels))
    total_pos, total_neg = positive.sum(), negative.sum()
    if total_pos == 0 or total_neg == 0:
      return _undefined(
        self.name, "it needs positive and negative labels (weighted)"
      )
    below = np.cumsum(negative) - negative
    pairs = np.sum(positive * (below + 0.5 * negative))
    return float(pairs / (total_pos * total_neg))


class _RankingMetric(Metric):
  """A retrieval metric of ranked ids against relevant ids, per query."""

  input_names = ("retrieved", "relevant", "weights")

  def __init__(self, k: int):
    if not isinstance(k, int) or k < 1:
      raise ValueError(f"{type(self).__name__}: k must be an int >= 1, got {k}")
    self.k = k
    super().__init__()

  @property
  def name(self) -> str:
    return f"{type(self).__name__}(k={self.k})"

  def _config(self) -> tuple[Any, ...]:
    return (self.k,)

  def reset(self) -> None:
    self.value_sum = 0.0
    self.weight_sum = 0.0
    self.queries = 0
    self.skipped_queries = 0

  def update(
    self,
    retrieved: Any,
    relevant: Any,
    weights: Any | None = None,
  ) -> None:
    """Adds one batch of queries.

    Args:
      retrieved: `[Q, K]` integer ids, best first, `K >= k`, padded with -1.
      relevant: `[Q, R]` integer ids padded with -1, or `Q` 1-D arrays.
      weights: None (all 1) or `[Q]`, finite and >= 0.

    Raises:
      ValueError: On bad input (naming the metric); nothing is added.
    """
    self._fold(self._prepare(retrieved, relevant, weights))

  def _prepare(self, retrieved, relevant, weights=None):
    ret, w = _host(self.name, retrieved, weights)
    if ret.ndim != 2 or not np.issubdtype(ret.dtype, np.integer):
      raise ValueError(
        f"{self.name}: retrieved must be a [queries, k] integer array, got "
        f"shape {ret.shape} and dtype {ret.dtype}"
      )
    if ret.shape[1] < self.k:
      raise ValueError(
        f"{self.name}: retrieved has {ret.shape[1]} columns, fewer than "
        f"k={self.k}; pad the rows with {RETRIEVAL_PADDING}"
      )
    ret = ret[:, : self.k].astype(np.int64)
    rel_query, rel_ids = self._relevant(relevant, len(ret))
    self._check_ids("retrieved", ret)
    self._check_ids("relevant", rel_ids)
    if w is None:
      w = np.ones(len(ret))
    else:
      w = w.astype(np.float64)
      if w.shape != (len(ret),):
        raise ValueError(
          f"{self.name}: weights shape {w.shape} does not match the "
          f"{len(ret)} queries"
        )
      _check_weights(self.name, w)
    hits, num_relevant = _hits(ret, rel_query, rel_ids)
    counted = num_relevant > 0
    values = self._values(hits[counted], num_relevant[counted])
    w = w[counted]
    return (
      float(np.sum(w * values)),
      float(np.sum(w)),
      int(counted.sum()),
      int((~counted).sum()),
    )

  def _relevant(self, relevant, queries: int):
    """(query index, id) of every relevant entry, padding included."""
    if isinstance(relevant, (np.ndarray, jax.Array)) and relevant.ndim != 1:
      if relevant.ndim != 2:
        raise ValueError(
          f"{self.name}: relevant must be a [queries, R] array or a "
          f"sequence of 1-D arrays, got shape {relevant.shape}"
        )
      rel = _host(self.name, relevant)[0]
      if not np.issubdtype(rel.dtype, np.integer):
        raise ValueError(
          f"{self.name}: relevant must hold integer ids, got {rel.dtype}"
        )
      if len(rel) != queries:
        raise ValueError(
          f"{self.name}: relevant has {len(rel)} rows for {queries} queries"
        )
      query = np.repeat(np.arange(queries), rel.shape[1])
      return query, rel.ravel().astype(np.int64)
    if not isinstance(relevant, (Sequence, np.ndarray)):
      raise ValueError(
        f"{self.name}: relevant must be a [queries, R] array or a sequence "
        f"of 1-D arrays, got {type(relevant).__name__}"
      )
    if len(relevant) != queries:
      raise ValueError(
        f"{self.name}: relevant has {len(relevant)} rows for {queries} queries"
      )
    rows = [np.asarray(r) for r in _host(self.name, *relevant)]
    for row in rows:
      if row.ndim > 1:
        raise ValueError(
          f"{self.name}: relevant rows must be 1-D, got shape {row.shape}"
        )
      if row.size and not np.issubdtype(row.dtype, np.integer):
        raise ValueError(
          f"{self.name}: relevant must hold integer ids, got {row.dtype}"
        )
    rows = [row.ravel() for row in rows]
    query = np.repeat(np.arange(queries), [len(r) for r in rows])
    ids = np.concatenate([r.astype(np.int64) for r in rows] or [[]])
    return query, ids.astype(np.int64)

  def _check_ids(self, what: str, ids: np.ndarray) -> None:
    if (ids < RETRIEVAL_PADDING).any():
      raise ValueError(
        f"{self.name}: {what} ids must be >= 0 or the padding "
        f"{RETRIEVAL_PADDING}, got {ids.min()}"
      )

  def _values(self, hits: np.ndarray, num_relevant: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def _fold(self, batch) -> None:
    self.value_sum += batch[0]
    self.weight_sum += batch[1]
    self.queries += batch[2]
    self.skipped_queries += batch[3]

  def _merge(self, other: Metric) -> None:
    self._fold(
      (other.value_sum, other.weight_sum, other.queries, other.skipped_queries)
    )

  def compute(self) -> float:
    """The weighted mean over the queries with relevant items (NaN when
    there are none, with a warning)."""
    if self.weight_sum == 0:
      return _undefined(self.name, "no query with relevant items (or weight)")
    return self.value_sum / self.weight_sum


def _hits(
  retrieved: np.ndarray, rel_query: np.ndarray, rel_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """`[Q, k]` booleans (a relevant id at its first rank) and the number of
  distinct relevant ids per query.

  A (query, id) pair is the int64 key `query * span + id`, `span` one more
  than the largest id: one sort of the relevant keys, then a binary search
  for each retrieved key. Ids too large for that (`Q * span >= 2**62`, e.g.
  hashed 64-bit ids) are first renumbered densely (a sort of every id).
  """
  queries, k = retrieved.shape
  keep = rel_ids != RETRIEVAL_PADDING
  rel_query, rel_ids = rel_query[keep], rel_ids[keep]
  ret = retrieved.ravel()
  valid = ret != RETRIEVAL_PADDING
  span = 1 + max(int(rel_ids.max(initial=0)), int(ret.max(initial=0)))
  if queries * span >= 2**62:
    _, codes = np.unique(np.concatenate([rel_ids, ret]), return_inverse=True)
    rel_ids, ret = codes[: len(rel_ids)], codes[len(rel_ids) :]
    span = len(codes)
  rel_keys = np.unique(rel_query * span + rel_ids)
  num_relevant = np.bincount(rel_keys // span, minlength=queries)
  if not len(rel_keys):
    return np.zeros((queries, k), bool), num_relevant
  ret_keys = np.repeat(np.arange(queries), k) * span + ret
  found = np.searchsorted(rel_keys, ret_keys)
  member = rel_keys[np.minimum(found, len(rel_keys) - 1)] == ret_keys
  # A repeat of an id earlier in its row: equal neighbours after a stable
  # sort of each row, the later one marked.
  order = np.argsort(retrieved, axis=1, kind="stable")
  ranked = np.take_along_axis(retrieved, order, axis=1)
  repeat = np.zeros((queries, k), bool)
  np.put_along_axis(
    repeat, order[:, 1:], ranked[:, 1:] == ranked[:, :-1], axis=1
  )
  hits = valid & member & ~repeat.ravel()
  return hits.reshape(queries, k), num_relevant


class RecallAtK(_RankingMetric):
  """Recall at `k`, averaged over queries; see the module docstring.

  Args:
    k: The cut-off.
    capped: Divide by `min(#relevant, k)` instead of `#relevant`.

  Attributes:
    queries: Queries counted (those with at least one relevant item).
    skipped_queries: Queries skipped for having no relevant item.
  """

  def __init__(self, k: int, capped: bool = False):
    self.capped = bool(capped)
    super().__init__(k)

  def _config(self) -> tuple[Any, ...]:
    return (self.k, self.capped)

  def __repr__(self) -> str:
    return f"RecallAtK(k={self.k}, capped={self.capped})"

  def _values(self, hits, num_relevant):
    if self.capped:
      num_relevant = np.minimum(num_relevant, self.k)
    return hits.sum(axis=1) / num_relevant


class NDCGAtK(_RankingMetric):
  """NDCG at `k` with binary relevance, averaged over queries.

  Args:
    k: The cut-off.

  Attributes:
    queries: Queries counted (those with at least one relevant item).
    skipped_queries: Queries skipped for having no relevant item.
  """

  def __repr__(self) -> str:
    return f"NDCGAtK(k={self.k})"

  def _values(self, hits, num_relevant):
    discounts = 1.0 / np.log2(np.arange(self.k) + 2.0)
    ideal = np.concatenate([[0.0], np.cumsum(discounts)])
    dcg = hits @ discounts
    return dcg / ideal[np.minimum(num_relevant, self.k)]


class MetricSet:
  """Several metrics updated with one call.

  `update(**inputs)` gives each metric the inputs its `update` names
  (`predictions`, `labels`, `weights`; `retrieved`, `relevant`,
  `weights`), and a metric's own inputs when a keyword is the metric's key
  and holds a dict: `ms.update(predictions=p, labels=y, recall={
  "retrieved": r, "relevant": rel})`. A jax array shared by several
  metrics is copied to the host once. Every metric's batch is checked
  before any is added, so a refused update changes none.

  Args:
    metrics: Key (the name in `compute`'s result) → metric.
  """

  def __init__(self, metrics: Mapping[str, Metric]):
    names = set(_PointwiseMetric.input_names + _RankingMetric.input_names)
    for key, metric in metrics.items():
      if not isinstance(metric, Metric):
        raise ValueError(f"MetricSet: {key!r} is not a metric: {metric!r}")
      if key in names:
        raise ValueError(f"MetricSet: {key!r} is an input name, not a key")
    self.metrics = dict(metrics)

  def __getitem__(self, key: str) -> Metric:
    return self.metrics[key]

  def __repr__(self) -> str:
    return f"MetricSet({self.metrics!r})"

  def input_names(self) -> tuple[str, ...]:
    """The shared inputs the metrics take, in a fixed order."""
    names = [n for m in self.metrics.values() for n in m.input_names]
    return tuple(dict.fromkeys(names))

  def update(self, **inputs: Any) -> None:
    """Adds one batch to every metric (see the class docstring).

    Raises:
      ValueError: For an input no metric takes, a metric without its
        inputs, or a batch a metric refuses (naming its key); no metric
        changes then.
    """
    unused = set(inputs) - set(self.input_names()) - set(self.metrics)
    if unused:
      raise ValueError(
        f"MetricSet: no metric takes {sorted(unused)}; the inputs are "
        f"{list(self.input_names())} or a metric's key with a dict"
      )
    for key in set(inputs) & set(self.metrics):
      if not isinstance(inputs[key], Mapping):
        raise ValueError(
          f"MetricSet: {key!r} is a metric's key: its inputs go in a dict, "
          f"got {type(inputs[key]).__name__}"
        )
    shared = {k: v for k, v in inputs.items() if k not in self.metrics}
    arrays = [k for k, v in shared.items() if isinstance(v, jax.Array)]
    copies = _host("MetricSet", *(shared[k] for k in arrays))
    shared.update(zip(arrays, copies, strict=True))
    batches = {}
    for key, metric in self.metrics.items():
      own = inputs.get(key)
      kwargs = (
        dict(own)
        if isinstance(own, Mapping)
        else {n: shared[n] for n in metric.input_names if n in shared}
      )
      needed = set(metric.input_names) - set(metric.optional_names)
      if needed - set(kwargs) or set(kwargs) - set(metric.input_names):
        raise ValueError(
          f"MetricSet: metric {key!r} takes {list(metric.input_names)} "
          f"({', '.join(metric.optional_names)} optional), got {sorted(kwargs)}"
        )
      try:
        batches[key] = metric._prepare(**kwargs)
      except ValueError as e:
        raise ValueError(f"MetricSet: metric {key!r}: {e}") from e
    for key, batch in batches.items():
      self.metrics[key]._fold(batch)

  def compute(self) -> dict[str, float]:
    """Every metric's value, by key."""
    return {key: metric.compute() for key, metric in self.metrics.items()}

  def reset(self) -> None:
    """Resets every metric."""
    for metric in self.metrics.values():
      metric.reset()

  def merge(self, other: MetricSet) -> None:
    """Merges `other`'s metrics into these, key by key.

    Raises:
      ValueError: If the keys differ or a pair of metrics cannot merge.
    """
    if set(other.metrics) != set(self.metrics):
      raise ValueError(
        f"MetricSet: cannot merge keys {sorted(other.metrics)} into "
        f"{sorted(self.metrics)}"
      )
    for key, metric in self.metrics.items():
      metric.merge(other.metrics[key])


class FitCallback:
  """`SparseCoreTrainer.fit`'s callback feeding a `MetricSet`; made by
  `fit_callback`.

  Step `i`'s arrays are read one call late, at step `i + 1`'s callback,
  when step `i + 1` is already queued on the devices, so reading them
  does not leave the devices idle; at a reporting step the step's own
  arrays are read too (waiting for it). Call `finish()` after `fit` to add
  the last step and report the steps since the last report.

  Attributes:
    metric_set: The metrics.
    history: `(step, values)` of every report, in order.
  """

  def __init__(
    self,
    metric_set: MetricSet,
    every: int | None,
    keys: Mapping[str, str],
    report: Callable[[int, dict[str, float]], None] | None,
    reset: bool,
    optional_keys: Mapping[str, str] | None = None,
  ):
    self.metric_set = metric_set
    self.every = every
    self.keys = dict(keys)
    self.optional_keys = dict(optional_keys or {})
    self.report = report
    self.reset = reset
    self.history: list[tuple[int, dict[str, float]]] = []
    self._pending: tuple[int, dict[str, Any]] | None = None
    self._unreported: int | None = None

  def __call__(self, step: int, aux: Any) -> None:
    """Takes step `step`'s aux output (`fit` calls this)."""
    inputs = self._inputs(step, aux)
    previous, self._pending = self._pending, (step, inputs)
    self._add(previous)
    if self.every is not None and (step + 1) % self.every == 0:
      self._flush()
      self._report(step)

  def finish(self) -> list[tuple[int, dict[str, float]]]:
    """Adds the last step, reports the steps since the last report (if
    any), and returns `history`."""
    self._flush()
    if self._unreported is not None:
      self._report(self._unreported)
    return self.history

  def _inputs(self, step: int, aux: Any) -> dict[str, Any]:
    if not isinstance(aux, Mapping):
      raise ValueError(
        f"step {step}: the metrics read the loss function's aux output as "
        f"a dict, got {type(aux).__name__}"
      )
    missing = [k for n, k in self.keys.items() if k not in aux]
    if missing:
      raise ValueError(
        f"step {step}: the aux output has no {missing} for the metrics; "
        f"it has {sorted(aux)}"
      )
    inputs = {name: aux[key] for name, key in self.keys.items()}
    for name, key in self.optional_keys.items():
      if key in aux:
        inputs[name] = aux[key]
    _start_copies(inputs.values())
    return inputs

  def _flush(self) -> None:
    pending, self._pending = self._pending, None
    self._add(pending)

  def _add(self, pending: tuple[int, dict[str, Any]] | None) -> None:
    if pending is None:
      return
    step, inputs = pending
    try:
      self.metric_set.update(**inputs)
    except ValueError as e:
      raise ValueError(f"step {step}: {e}") from e
    self._unreported = step

  def _report(self, step: int) -> None:
    values = self.metric_set.compute()
    self.history.append((step, values))
    self._unreported = None
    if self.reset:
      self.metric_set.reset()
    if self.report is not None:
      self.report(step, values)


def fit_callback(
  metric_set: MetricSet,
  *,
  every: int | None = None,
  keys: Mapping[str, str] | None = None,
  report: Callable[[int, dict[str, float]], None] | None = None,
  reset: bool = True,
) -> FitCallback:
  """A callback for `SparseCoreTrainer.fit` that updates `metric_set`.

  Args:
    metric_set: The metrics (pointwise ones: the aux output holds arrays).
    every: Report after every `every` steps (steps `every - 1`,
      `2 every - 1`, ...), or None: only at `finish()`.
    keys: Input name → aux key, e.g. `{"predictions": "logits", "labels":
      "labels"}`. Default: `predictions` and `labels` under their own
      names, and `weights` too where the metrics take it and an aux output
      has it.
    report: Called as `report(step, values)` at each report.
    reset: Reset the metrics after each report (each report covers the
      steps since the previous one); False: cumulative since the start.

  Returns:
    A `FitCallback`: pass it as `fit(..., callback=...)`, then call its
    `finish()`.

  Raises:
    ValueError: If `every` is not None or an int >= 1, or `keys` names an
      input no metric takes.
  """
  if every is not None and (not isinstance(every, int) or every < 1):
    raise ValueError(f"fit_callback: every must be None or >= 1, got {every}")
  names = metric_set.input_names()
  if keys is None:
    keys = {n: n for n in ("predictions", "labels") if n in names}
    optional = {"weights": "weights"} if "weights" in names else {}
    return FitCallback(metric_set, every, keys, report, reset, optional)
  unknown = set(keys) - set(names)
  if unknown:
    raise ValueError(
      f"fit_callback: no metric takes {sorted(unknown)}; they take "
      f"{list(names)}"
    )
  return FitCallback(metric_set, every, keys, report, reset)
