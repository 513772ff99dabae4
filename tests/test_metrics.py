"""Streaming metrics against plain NumPy restatements of their definitions.

AUC is checked by counting every (positive, negative) pair, O(n^2), with
ties worth one half; NE, calibration, MSE, RMSE and MAE by their formulas
on all the data at once in float64; recall@k and NDCG@k by loops over
queries and ranks. The metrics see the same data in uneven batches
(including a batch of one example and empty batches), as sharded jax
arrays, split over two metrics that are merged, and from a trainer's
`fit` callback.
"""

from __future__ import annotations

import math
import pickle
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.nn import metrics

RTOL = 1e-9
N = 300  # Examples of pointwise data.
QUERIES = 60  # Queries of retrieval data.
K = 5
WINDOW = 150  # The windowed AUC's max_examples.


# Plain NumPy references.


def ref_auc(s, y, w):
  pos, neg = w * y, w * (1.0 - y)
  above = (s[:, None] > s[None, :]) + 0.5 * (s[:, None] == s[None, :])
  return np.sum(pos[:, None] * neg[None, :] * above) / (pos.sum() * neg.sum())


def _probabilities(p, logits):
  if logits:
    return 1.0 / (1.0 + np.exp(-p))
  return np.clip(p, 1e-12, 1.0 - 1e-12)


def ref_ne(p, y, w, logits):
  q = _probabilities(p, logits)
  ce = -(y * np.log(q) + (1.0 - y) * np.log(1.0 - q))
  base = np.sum(w * y) / np.sum(w)
  entropy = -(
    np.sum(w * y) * np.log(base) + np.sum(w * (1.0 - y)) * np.log(1.0 - base)
  )
  return np.sum(w * ce) / entropy


def ref_calibration(p, y, w, logits):
  q = 1.0 / (1.0 + np.exp(-p)) if logits else p
  return np.sum(w * q) / np.sum(w * y)


def ref_ranking(retrieved, relevant, weights, k, kind):
  values, used = [], []
  for q, row in enumerate(retrieved):
    rel = {int(x) for x in relevant[q] if x != -1}
    if not rel:
      continue
    seen, hits = set(), []
    for x in row[:k]:
      x = int(x)
      hits.append(x != -1 and x in rel and x not in seen)
      seen.add(x)
    if kind == "recall":
      values.append(sum(hits) / len(rel))
    elif kind == "recall_capped":
      values.append(sum(hits) / min(len(rel), k))
    else:
      dcg = sum(1.0 / math.log2(r + 2) for r, h in enumerate(hits) if h)
      idcg = sum(1.0 / math.log2(r + 2) for r in range(min(len(rel), k)))
      values.append(dcg / idcg)
    used.append(weights[q])
  return np.sum(np.array(values) * used) / np.sum(used)


# The metrics under test, their data and their expected values.

POINTWISE = {
  "auc": metrics.AUC,
  "auc_window": lambda: metrics.AUC(max_examples=WINDOW),
  "ne": metrics.NE,
  "ne_logits": lambda: metrics.NE(from_logits=True),
  "calibration": metrics.Calibration,
  "calibration_logits": lambda: metrics.Calibration(from_logits=True),
  "mse": metrics.MSE,
  "rmse": metrics.RMSE,
  "mae": metrics.MAE,
}
RANKING = {
  "recall": lambda: metrics.RecallAtK(K),
  "recall_capped": lambda: metrics.RecallAtK(K, capped=True),
  "ndcg": lambda: metrics.NDCGAtK(K),
}
MAKERS = {**POINTWISE, **RANKING}


def make_data(kind, seed, n=None, weighted=True):
  """Inputs for metric `kind`: a dict of `update`'s keyword arguments."""
  rng = np.random.default_rng(seed)
  if kind in RANKING:
    return _ranking_data(rng, n or QUERIES, weighted)
  n = n or N
  if kind in ("mse", "rmse", "mae"):
    labels = rng.integers(1, 6, n).astype(np.float64)  # Ratings.
    predictions = labels + rng.normal(0, 1, n)
  else:
    labels = (rng.random(n) < 0.3).astype(np.float64)
    if kind.endswith("logits"):
      predictions = rng.normal(labels - 1.0, 1.5)
    else:
      # Two decimals: many ties, and some exact 0 and 1 (NE's clipping).
      predictions = np.round(
        np.clip(rng.normal(0.3 + 0.3 * labels, 0.3), 0, 1), 2
      )
  weights = rng.uniform(0, 3, n) if weighted else np.ones(n)
  return {"predictions": predictions, "labels": labels, "weights": weights}


def _ranking_data(rng, queries, weighted):
  retrieved = rng.integers(0, 30, (queries, K + 2))  # Duplicates too.
  for row in retrieved:
    row[rng.integers(2, K + 3) :] = -1  # Padding at the end.
  relevant = [rng.integers(0, 30, rng.integers(0, 8)) for _ in range(queries)]
  weights = rng.uniform(0, 2, queries) if weighted else np.ones(queries)
  return {"retrieved": retrieved, "relevant": relevant, "weights": weights}


def expected(kind, data):
  """The reference value of `kind` over `data` (all of it at once)."""
  if kind in RANKING:
    return ref_ranking(
      data["retrieved"], data["relevant"], data["weights"], K, kind
    )
  p, y, w = data["predictions"], data["labels"], data["weights"]
  if kind == "auc_window":
    p, y, w = p[-WINDOW:], y[-WINDOW:], w[-WINDOW:]
  logits = kind.endswith("logits")
  if kind.startswith("auc"):
    return ref_auc(p, y, w)
  if kind.startswith("ne"):
    return ref_ne(p, y, w, logits)
  if kind.startswith("calibration"):
    return ref_calibration(p, y, w, logits)
  mse = np.sum(w * (p - y) ** 2) / np.sum(w)
  return {
    "mse": mse,
    "rmse": np.sqrt(mse),
    "mae": np.sum(w * np.abs(p - y)) / np.sum(w),
  }[kind]


def split(data, sizes):
  """`data` cut into batches of `sizes` (the last takes the rest)."""
  n = len(next(iter(data.values())))
  bounds = np.cumsum([0, *sizes, n - sum(sizes)])
  return [
    {key: value[a:b] for key, value in data.items()}
    for a, b in zip(bounds[:-1], bounds[1:], strict=True)
  ]


def join(*datas):
  out = {}
  for key in datas[0]:
    parts = [d[key] for d in datas]
    if isinstance(parts[0], list):
      out[key] = [row for part in parts for row in part]
    else:
      out[key] = np.concatenate(parts)
  return out


UNEVEN = [0, 1, 37, 5, 0, 12, 1]  # Then the rest: 300 - 56 or 60 - 56.


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", list(MAKERS))
def test_streaming_equals_one_shot_reference(kind, weighted):
  data = make_data(kind, seed=1, weighted=weighted)
  metric = MAKERS[kind]()
  for batch in split(data, UNEVEN):
    if not weighted:
      batch.pop("weights")
    metric.update(**batch)
  np.testing.assert_allclose(metric.compute(), expected(kind, data), RTOL)
  # compute() twice (AUC's chunks joined the first time): the same value.
  np.testing.assert_allclose(metric.compute(), expected(kind, data), RTOL)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_merge_of_two_states_equals_one_stream(kind):
  first, second = make_data(kind, seed=2), make_data(kind, seed=3)
  a, b = MAKERS[kind](), MAKERS[kind]()
  for batch in split(first, [20, 1]):
    a.update(**batch)
  for batch in split(second, [0, 7]):
    b.update(**batch)
  # As from another process: pickled and read back.
  a.merge(pickle.loads(pickle.dumps(b)))
  np.testing.assert_allclose(
    a.compute(), expected(kind, join(first, second)), RTOL
  )


@pytest.mark.parametrize("kind", list(MAKERS))
def test_reset_forgets_every_batch(kind):
  metric = MAKERS[kind]()
  metric.update(**make_data(kind, seed=4))
  metric.reset()
  data = make_data(kind, seed=5)
  metric.update(**data)
  np.testing.assert_allclose(metric.compute(), expected(kind, data), RTOL)


def test_merge_refuses_other_metrics():
  with pytest.raises(ValueError, match="NE: cannot merge"):
    metrics.NE().merge(metrics.NE(from_logits=True))
  with pytest.raises(ValueError, match="cannot merge"):
    metrics.MSE().merge(metrics.RMSE())
  with pytest.raises(ValueError, match=r"RecallAtK\(k=5\): cannot merge"):
    metrics.RecallAtK(5).merge(metrics.RecallAtK(10))
  with pytest.raises(ValueError, match="cannot merge"):
    metrics.AUC().merge(metrics.AUC(max_examples=10))


def test_worked_examples_of_the_docstring():
  auc = metrics.AUC()
  auc.update(np.array([0.1, 0.4, 0.4, 0.8]), np.array([0, 0, 1, 1]))
  assert auc.compute() == 0.875
  recall, ndcg = metrics.RecallAtK(3), metrics.NDCGAtK(3)
  recall.update(np.array([[3, 7, 1]]), [np.array([7, 9])])
  ndcg.update(np.array([[3, 7, 1]]), np.array([[7, 9]]))
  assert recall.compute() == 0.5
  np.testing.assert_allclose(ndcg.compute(), 0.3869, atol=1e-4)


def test_auc_soft_labels_count_as_weighted_positives_and_negatives():
  rng = np.random.default_rng(6)
  s = np.round(rng.random(200), 1)
  y, w = rng.random(200), rng.uniform(0, 2, 200)
  auc = metrics.AUC()
  for batch in split({"predictions": s, "labels": y, "weights": w}, UNEVEN):
    auc.update(**batch)
  np.testing.assert_allclose(auc.compute(), ref_auc(s, y, w), RTOL)


def test_auc_of_logits_keeps_ties_that_a_sigmoid_would_make():
  logits = np.array([-3.0, 38.0, 39.0, 40.0])
  labels = np.array([0.0, 0.0, 1.0, 1.0])
  auc = metrics.AUC()
  auc.update(logits, labels)
  assert auc.compute() == 1.0
  np.testing.assert_allclose(ref_auc(logits, labels, np.ones(4)), 1.0)


def test_auc_window_keeps_the_latest_examples():
  data = make_data("auc", seed=7)
  auc = metrics.AUC(max_examples=WINDOW)
  for batch in split(data, [100, 1, 0, 60]):
    auc.update(**batch)
    assert auc.num_examples <= WINDOW
  assert auc.num_examples == WINDOW
  np.testing.assert_allclose(auc.compute(), expected("auc_window", data), RTOL)


def test_auc_equals_sklearn():
  from sklearn import metrics as sklearn_metrics

  data = make_data("auc", seed=8)
  auc = metrics.AUC()
  for batch in split(data, UNEVEN):
    auc.update(**batch)
  want = sklearn_metrics.roc_auc_score(
    data["labels"], data["predictions"], sample_weight=data["weights"]
  )
  np.testing.assert_allclose(auc.compute(), want, RTOL)


def test_sharded_jax_arrays_equal_numpy():
  mesh = Mesh(np.array(jax.devices()), ("device",))
  sharding = NamedSharding(mesh, P("device"))
  data = make_data("ne_logits", seed=9, n=64 * len(jax.devices()))
  on_mesh = {
    k: jax.device_put(v.astype(np.float32), sharding) for k, v in data.items()
  }
  host = {k: v.astype(np.float32) for k, v in data.items()}
  for make in (metrics.AUC, lambda: metrics.NE(from_logits=True)):
    a, b = make(), make()
    a.update(**on_mesh)
    b.update(**host)
    assert a.compute() == b.compute()
  # float32 inputs are summed in float64: equal to the float64 reference.
  ne = metrics.NE(from_logits=True)
  ne.update(**on_mesh)
  want = ref_ne(*(v.astype(np.float64) for v in host.values()), logits=True)
  np.testing.assert_allclose(ne.compute(), want, RTOL)


def test_ranking_inputs_as_padded_arrays_and_jax_arrays():
  data = make_data("ndcg", seed=10)
  width = max(len(r) for r in data["relevant"])
  padded = np.full((QUERIES, width), -1)
  for q, row in enumerate(data["relevant"]):
    padded[q, : len(row)] = row
  for kind in RANKING:
    metric = RANKING[kind]()
    metric.update(
      retrieved=jnp.asarray(data["retrieved"]),
      relevant=jnp.asarray(padded),
      weights=data["weights"],
    )
    np.testing.assert_allclose(metric.compute(), expected(kind, data), RTOL)
    skipped = sum(1 for r in data["relevant"] if len(r) == 0)
    assert skipped > 0
    assert metric.skipped_queries == skipped
    assert metric.queries == QUERIES - skipped


@pytest.mark.parametrize("kind", list(RANKING))
def test_ranking_with_ids_near_the_int64_limit(kind):
  # Keys `query * (max id + 1) + id` would overflow: the ids are renumbered.
  data = make_data(kind, seed=20)

  def big(ids):
    ids = np.asarray(ids, np.int64)
    return np.where(ids == -1, -1, ids * 2**58 + 12345)

  metric = RANKING[kind]()
  for batch in split(data, [7, 1, 0]):
    metric.update(
      retrieved=big(batch["retrieved"]),
      relevant=[big(row) for row in batch["relevant"]],
      weights=batch["weights"],
    )
  np.testing.assert_allclose(metric.compute(), expected(kind, data), RTOL)


def test_recall_counts_a_retrieved_id_once():
  recall = metrics.RecallAtK(4)
  recall.update(np.array([[5, 5, 5, -1, 6]]), [np.array([5, 5, 6])])
  assert recall.compute() == 0.5  # 6 is past k = 4; 5 counts once.


def _warns_nan(metric):
  with pytest.warns(metrics.UndefinedMetricWarning, match="undefined"):
    value = metric.compute()
  assert math.isnan(value)


@pytest.mark.parametrize("kind", list(MAKERS))
def test_no_examples_is_nan_with_a_warning(kind):
  _warns_nan(MAKERS[kind]())
  metric = MAKERS[kind]()
  empty = split(make_data(kind, seed=11), [0])[0]
  metric.update(**empty)
  _warns_nan(metric)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_one_class_only_is_nan_with_a_warning(label):
  p = np.linspace(0.05, 0.95, 10)
  y = np.full(10, label)
  for make in (metrics.AUC, metrics.NE):
    metric = make()
    metric.update(p, y)
    _warns_nan(metric)
  # Weights can remove a class as well.
  auc = metrics.AUC()
  auc.update(p, np.arange(10) % 2, weights=(np.arange(10) % 2) * 1.0)
  _warns_nan(auc)


def test_calibration_without_positive_labels_is_nan():
  calibration = metrics.Calibration()
  calibration.update(np.array([0.2, 0.3]), np.zeros(2))
  _warns_nan(calibration)


def test_queries_without_relevant_items_are_skipped():
  ndcg = metrics.NDCGAtK(2)
  ndcg.update(np.array([[1, 2], [3, -1]]), [np.array([], np.int64), [-1]])
  assert ndcg.skipped_queries == 2
  _warns_nan(ndcg)


P4 = np.array([0.1, 0.7, 0.4, 0.9])
Y4 = np.array([0.0, 1.0, 0.0, 1.0])
RET = np.array([[1, 2, 3], [4, 5, -1]])
REL = [np.array([2]), np.array([5, 7])]

# (metric, bad update, message)
BAD_INPUTS = [
  ("auc", dict(predictions=P4[:, None], labels=Y4), r"AUC: labels shape"),
  ("auc", dict(predictions=P4, labels=Y4 * 2), r"AUC: labels must lie in"),
  (
    "auc",
    dict(predictions=P4, labels=Y4, weights=-Y4),
    r"AUC: weights must be finite and >= 0",
  ),
  (
    "ne",
    dict(predictions=np.array([0.1, np.nan, 0.2, 0.3]), labels=Y4),
    r"NE: predictions contain NaN",
  ),
  (
    "ne",
    dict(predictions=P4 * 2, labels=Y4),
    r"NE: predictions must be probabilities .*NE\(from_logits=True\)",
  ),
  (
    "ne_logits",
    dict(predictions=np.array([0.0, np.inf, 1, 2]), labels=Y4),
    r"NE: logits must be finite",
  ),
  (
    "calibration",
    dict(predictions=P4, labels=Y4, weights=np.array([1, 1, np.inf, 1])),
    r"Calibration: weights must be finite",
  ),
  (
    "mse",
    dict(predictions=P4, labels=Y4, weights=np.ones(3)),
    r"MSE: weights shape \(3,\) does not match",
  ),
  (
    "mae",
    dict(predictions=P4, labels=np.array([1.0, np.inf, 2, 3])),
    r"MAE: predictions and labels must be finite",
  ),
  (
    "recall",
    dict(retrieved=RET, relevant=REL),
    r"RecallAtK\(k=5\): retrieved has 3 columns, fewer than k=5",
  ),
  (
    "ndcg",
    dict(retrieved=np.zeros((2, 6), np.int64), relevant=REL[:1]),
    r"NDCGAtK\(k=5\): relevant has 1 rows for 2 queries",
  ),
  (
    "recall",
    dict(retrieved=np.zeros((2, 6)), relevant=REL),
    r"RecallAtK\(k=5\): retrieved must be a \[queries, k\] integer array",
  ),
  (
    "recall",
    dict(retrieved=np.full((2, 6), -3), relevant=REL),
    r"retrieved ids must be >= 0 or the padding -1, got -3",
  ),
  (
    "ndcg",
    dict(
      retrieved=np.zeros((2, 6), np.int64),
      relevant=np.zeros((2, 2), np.float32),
    ),
    r"NDCGAtK\(k=5\): relevant must hold integer ids",
  ),
  (
    "auc",
    dict(predictions=pz.nx.wrap(P4).tag("batch"), labels=Y4),
    r"AUC: got a pz.nx.NamedArray; pass its positional array",
  ),
  (
    "recall",
    dict(retrieved=np.zeros((2, 6), np.int64), relevant=np.zeros((2, 1, 1))),
    r"RecallAtK\(k=5\): relevant must be a \[queries, R\] array",
  ),
  (
    "recall",
    dict(retrieved=np.zeros((2, 6), np.int64), relevant=[[1], [[2]]]),
    r"RecallAtK\(k=5\): relevant rows must be 1-D",
  ),
  (
    "ndcg",
    dict(retrieved=np.zeros((2, 6), np.int64), relevant=REL, weights=[1.0]),
    r"NDCGAtK\(k=5\): weights shape \(1,\) does not match the 2 queries",
  ),
]


@pytest.mark.parametrize(
  ("kind", "bad", "message"), BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS]
)
def test_refused_update_leaves_the_metric_unchanged(kind, bad, message):
  metric = MAKERS[kind]()
  first, second = make_data(kind, seed=12), make_data(kind, seed=13)
  metric.update(**first)
  before = pickle.dumps(metric)
  with pytest.raises(ValueError, match=message):
    metric.update(**bad)
  assert pickle.dumps(metric) == before
  metric.update(**second)
  np.testing.assert_allclose(
    metric.compute(), expected(kind, join(first, second)), RTOL
  )


def test_bad_constructor_arguments():
  with pytest.raises(ValueError, match="max_examples"):
    metrics.AUC(max_examples=0)
  with pytest.raises(ValueError, match="k must be an int >= 1"):
    metrics.NDCGAtK(0)


# MetricSet and the fit callback.


def _classification_set():
  return metrics.MetricSet(
    {
      "auc": metrics.AUC(),
      "ne": metrics.NE(from_logits=True),
      "calibration": metrics.Calibration(from_logits=True),
    }
  )


def test_metric_set_shares_inputs_and_takes_a_metric_s_own():
  data = make_data("ne_logits", seed=14)
  ranking = make_data("recall", seed=15)
  ms = metrics.MetricSet(
    {
      "auc": metrics.AUC(),
      "ne": metrics.NE(True),
      "recall": RANKING["recall"](),
    }
  )
  assert ms.input_names() == (
    "predictions",
    "labels",
    "weights",
    "retrieved",
    "relevant",
  )
  for batch, rank_batch in zip(
    split(data, [10, 1, 0]), split(ranking, [10, 1, 0]), strict=True
  ):
    ms.update(
      predictions=jnp.asarray(batch["predictions"]),
      labels=batch["labels"],
      weights=batch["weights"],
      recall=rank_batch,
    )
  got = ms.compute()
  assert list(got) == ["auc", "ne", "recall"]
  np.testing.assert_allclose(got["auc"], expected("auc", data), RTOL)
  np.testing.assert_allclose(got["ne"], expected("ne_logits", data), RTOL)
  np.testing.assert_allclose(got["recall"], expected("recall", ranking), RTOL)


def test_metric_set_refuses_without_changing_any_metric():
  ms = _classification_set()
  data = make_data("ne_logits", seed=16)
  ms.update(**data)
  before = pickle.dumps(ms)
  with pytest.raises(ValueError, match="no metric takes \\['logits'\\]"):
    ms.update(logits=data["predictions"], labels=data["labels"])
  with pytest.raises(ValueError, match="metric 'auc' takes"):
    ms.update(predictions=data["predictions"])
  bad = dict(data, predictions=np.where(data["labels"] > 0, np.inf, 0.0))
  # AUC takes infinite scores, NE does not: neither changes.
  with pytest.raises(
    ValueError, match="metric 'ne': NE: logits must be finite"
  ):
    ms.update(**bad)
  assert pickle.dumps(ms) == before
  with pytest.raises(ValueError, match="'auc' is a metric's key"):
    ms.update(auc=data["predictions"], labels=data["labels"])
  assert pickle.dumps(ms) == before
  with pytest.raises(ValueError, match="input name"):
    metrics.MetricSet({"labels": metrics.AUC()})


def test_metric_set_merge_and_reset():
  a, b = _classification_set(), _classification_set()
  first, second = (
    make_data("ne_logits", seed=17),
    make_data("ne_logits", seed=18),
  )
  a.update(**first)
  b.update(**second)
  a.merge(b)
  both = join(first, second)
  got = a.compute()
  np.testing.assert_allclose(got["auc"], expected("auc", both), RTOL)
  np.testing.assert_allclose(got["ne"], expected("ne_logits", both), RTOL)
  a.reset()
  with warnings.catch_warnings(record=True):
    warnings.simplefilter("always")
    assert all(math.isnan(v) for v in a.compute().values())
  with pytest.raises(ValueError, match="cannot merge keys"):
    a.merge(metrics.MetricSet({"auc": metrics.AUC()}))


def _check_history(history, auxes, windows):
  assert [step for step, _ in history] == [w[-1] for w in windows]
  for (_, values), window in zip(history, windows, strict=True):
    data = join(
      *(
        {
          k: np.asarray(auxes[i][k], np.float64)
          for k in ("predictions", "labels")
        }
        for i in window
      )
    )
    data["weights"] = np.ones(len(data["labels"]))
    np.testing.assert_allclose(values["auc"], expected("auc", data), 1e-9)
    np.testing.assert_allclose(values["ne"], expected("ne_logits", data), 1e-6)
    np.testing.assert_allclose(
      values["calibration"], expected("calibration_logits", data), 1e-6
    )


def test_fit_callback_reads_each_step_one_call_late():
  auxes = []
  for step in range(7):
    data = make_data("ne_logits", seed=100 + step, n=20)
    auxes.append(
      {"loss": 0.0, "logits": data["predictions"], "y": data["labels"]}
    )
  reports = []
  callback = metrics.fit_callback(
    _classification_set(),
    every=3,
    keys={"predictions": "logits", "labels": "y"},
    report=lambda step, values: reports.append(step),
  )
  auc = callback.metric_set["auc"]
  callback(0, auxes[0])
  assert auc.num_examples == 0  # Step 0 waits for step 1's call.
  callback(1, auxes[1])
  assert auc.num_examples == 20
  for step in range(2, 7):
    callback(step, auxes[step])
  history = callback.finish()
  assert reports == [2, 5, 6]
  renamed = [{"predictions": a["logits"], "labels": a["y"]} for a in auxes]
  _check_history(history, renamed, [[0, 1, 2], [3, 4, 5], [6]])
  assert callback.finish() == history  # Nothing new to report.
  with pytest.raises(ValueError, match="step 7: the aux output has no"):
    callback(7, {"loss": 0.0})
  # A step's bad arrays are refused at the next call, naming the step.
  callback(7, dict(auxes[0], logits=np.full(20, np.nan)))
  with pytest.raises(ValueError, match="step 7: MetricSet: metric 'auc'"):
    callback(8, auxes[1])
  with pytest.raises(ValueError, match="every"):
    metrics.fit_callback(_classification_set(), every=0)
  with pytest.raises(ValueError, match="no metric takes"):
    metrics.fit_callback(_classification_set(), keys={"retrieved": "ids"})


BATCH = 16
VOCAB = 64
DIM = 4


@pz.pytree_dataclass
class _Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Linear

  def __call__(self, inputs, /, **side_inputs):
    return self.head(self.embed(inputs)["f"])


def _trainer():
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(0.5),
    optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.5),
    combiner="mean",
  )
  specs = {
    "f": pzsc.FeatureSpec(
      name="f",
      table_spec=table,
      input_shape=(BATCH, 4),
      output_shape=(BATCH, DIM),
    )
  }
  mesh = Mesh(np.array(jax.devices()), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), specs, mesh
  )
  head = pz.nn.Linear.from_config(
    "head", jax.random.key(1), input_axes={"embedding": DIM}, output_axes={}
  )

  def loss_fn(*, model, state, rng, inputs, labels):
    del rng
    logits = model(inputs).unwrap("batch")
    loss = optax.sigmoid_binary_cross_entropy(logits, labels).mean()
    return loss, state, {"loss": loss, "predictions": logits, "labels": labels}

  return pzsc.SparseCoreTrainer.build(
    jax.random.key(2), _Model(embed=embed, head=head), optax.adam(0.05), loss_fn
  )


def test_metric_set_from_a_trainer_fit_callback():
  rng = np.random.default_rng(19)
  data = []
  for _ in range(5):
    ids = [rng.integers(0, VOCAB, rng.integers(1, 5)) for _ in range(BATCH)]
    labels = np.array([float((row < 20).any()) for row in ids], np.float32)
    data.append((ids, labels))
  trainer = _trainer()

  def preprocess(batch):
    inputs, _ = trainer.model.embed.preprocess({"f": batch[0]})
    return {"inputs": inputs, "labels": batch[1]}

  cumulative = metrics.fit_callback(_classification_set(), every=2, reset=False)
  per_window = metrics.fit_callback(_classification_set(), every=2)

  def both(step, aux):
    cumulative(step, aux)
    per_window(step, aux)

  auxes = trainer.fit(data, preprocess, callback=both)
  np.testing.assert_array_equal(
    np.concatenate([np.asarray(a["labels"]) for a in auxes]),
    np.concatenate([labels for _, labels in data]),
  )
  _check_history(
    cumulative.finish(), auxes, [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
  )
  _check_history(per_window.finish(), auxes, [[0, 1], [2, 3], [4]])


def test_the_module_is_pzsc_metrics():
  import pz_sparsecore as pzsc

  assert pzsc.metrics is metrics
