"""Tests of the bundled Shakespeare next-word data (pz_sparsecore.data).

Most checks recompute what the fast, vectorised code produces with plain
Python (``collections.Counter`` over the raw token list) as an independent
reference.
"""

from __future__ import annotations

import collections
import importlib.resources
import math

import numpy as np
import pytest

from pz_sparsecore.data import (
  OOV_ID,
  OOV_TOKEN,
  ShakespeareData,
  Vocabulary,
  load_corpus,
  tokenize,
  unigram_baseline,
)

VOCAB_SIZE = 4096
SEQ_LEN = 8


@pytest.fixture(scope="module")
def raw_tokens() -> list[str]:
  return tokenize(load_corpus())


@pytest.fixture(scope="module")
def data() -> ShakespeareData:
  return ShakespeareData.load(vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN)


def test_corpus_is_package_data_and_loads():
  root = importlib.resources.files("pz_sparsecore.data") / "shakespeare"
  assert (root / "complete_works.txt.gz").is_file()
  assert (root / "SOURCE.md").is_file()
  text = load_corpus()
  assert load_corpus() is text  # Cached.
  assert 4_000_000 < len(text) < 6_000_000
  assert 800_000 < len(text.split()) < 1_000_000
  assert text.startswith("ALL'S WELL THAT ENDS WELL")
  assert "To be, or not to be" in text


def test_tokenize_examples():
  assert tokenize("O Romeo, Romeo! 'Tis o'er.") == [
    "o",
    "romeo",
    ",",
    "romeo",
    "!",
    "tis",
    "o'er",
    ".",
  ]
  assert tokenize("[Enter HAMLET.]  SCENE 2 -- a room; why?") == [
    "enter",
    "hamlet",
    ".",
    "scene",
    "a",
    "room",
    ";",
    "why",
    "?",
  ]
  assert tokenize('father\'s  news: "&c"') == ["father's", "news", ":", "c"]
  assert tokenize("") == []


def test_corpus_token_counts(raw_tokens):
  assert 1_000_000 < len(raw_tokens) < 1_300_000
  assert 20_000 < len(set(raw_tokens)) < 35_000
  top = [t for t, _ in collections.Counter(raw_tokens).most_common(3)]
  assert top == [",", ".", "the"]


def test_vocabulary_orders_by_count_then_token():
  counts = {"b": 2, "a": 2, "c": 3, "d": 1, "z": 0}
  vocab = Vocabulary.from_counts(counts, vocab_size=4)
  assert vocab.tokens == (OOV_TOKEN, "c", "a", "b")
  assert vocab.size == 4
  assert vocab.oov_id == OOV_ID == 0
  ids = vocab.encode(["c", "d", "a", "unseen", "b"])
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(ids, [1, 0, 2, 0, 3])
  assert vocab.decode(ids) == ["c", OOV_TOKEN, "a", OOV_TOKEN, "b"]
  assert vocab.decode(np.array([[1, 2], [3, 0]])) == ["c", "a", "b", OOV_TOKEN]
  # Tokens with zero count never enter; the vocabulary may come out smaller.
  assert Vocabulary.from_counts(counts, 100).tokens[1:] == ("c", "a", "b", "d")
  with pytest.raises(ValueError):
    vocab.decode([4])
  with pytest.raises(ValueError):
    Vocabulary(("c", "a"))


def test_vocabulary_and_streams_match_reference(data, raw_tokens):
  num_train = len(data.train_ids)
  assert num_train + len(data.heldout_ids) == len(raw_tokens)
  assert len(data.heldout_ids) == pytest.approx(0.1 * len(raw_tokens), abs=1)
  train_counts = collections.Counter(raw_tokens[:num_train])
  ranked = sorted(train_counts.items(), key=lambda kv: (-kv[1], kv[0]))
  expected = (OOV_TOKEN, *(t for t, _ in ranked[: VOCAB_SIZE - 1]))
  assert data.vocab.tokens == expected
  assert data.vocab.size == VOCAB_SIZE
  all_ids = data.vocab.encode(raw_tokens)
  np.testing.assert_array_equal(data.train_ids, all_ids[:num_train])
  np.testing.assert_array_equal(data.heldout_ids, all_ids[num_train:])
  assert data.train_ids.dtype == data.heldout_ids.dtype == np.int32
  assert not data.train_ids.flags.writeable
  rare = ranked[-1][0]
  assert data.vocab.encode([rare])[0] == OOV_ID
  assert (data.train_ids == OOV_ID).any()
  in_vocab = [train_counts[t] for t in expected[1:]]
  np.testing.assert_array_equal(
    data.unigram_counts("train"), [num_train - sum(in_vocab), *in_vocab]
  )
  assert data.unigram_counts("heldout").sum() == len(data.heldout_ids)


def test_load_is_cached_per_vocab_size(data):
  again = ShakespeareData.load(vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN + 1)
  assert again.train_ids is data.train_ids
  assert again.seq_len == SEQ_LEN + 1
  small = ShakespeareData.load(vocab_size=16, seq_len=SEQ_LEN)
  assert small.vocab.tokens == data.vocab.tokens[:16]
  assert small.train_ids.max() == 15


def test_batches_shapes_and_determinism(data):
  def take(seed, n=3, split="train"):
    it = data.batches(5, seed=seed, split=split)
    return [next(it) for _ in range(n)]

  first = take(0)
  for contexts, labels in first:
    assert contexts.shape == (5, SEQ_LEN) and labels.shape == (5,)
    assert contexts.dtype == labels.dtype == np.int32
  for (c0, l0), (c1, l1) in zip(first, take(0), strict=True):
    np.testing.assert_array_equal(c0, c1)
    np.testing.assert_array_equal(l0, l1)
  other = take(1)
  assert any(
    not np.array_equal(c0, c1)
    for (c0, _), (c1, _) in zip(first, other, strict=True)
  )
  # Batches keep coming: the training iterator is infinite.
  it = data.batches(1, seed=0)
  for _ in range(1000):
    next(it)


def _followers(stream: np.ndarray, context: np.ndarray) -> set[int]:
  """Ids that follow an occurrence of ``context`` in ``stream``."""
  windows = np.lib.stride_tricks.sliding_window_view(stream[:-1], len(context))
  starts = np.flatnonzero((windows == context).all(axis=1))
  return set(stream[starts + len(context)].tolist())


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_label_follows_context_in_its_own_split(data, split):
  stream = data.ids(split)
  other = data.ids("heldout" if split == "train" else "train")
  contexts, labels = next(data.batches(16, seed=3, split=split))
  for context, label in zip(contexts, labels, strict=True):
    assert int(label) in _followers(stream, context)
  # Contexts are 8-grams; most of them occur nowhere in the other split.
  found_elsewhere = sum(bool(_followers(other, c)) for c in contexts)
  assert found_elsewhere < len(contexts) // 2


def test_eval_batches_cover_heldout_in_order(data):
  batches = list(data.eval_batches(1000))
  num = data.num_examples("heldout")
  assert num == len(data.heldout_ids) - SEQ_LEN
  assert len(batches) == math.ceil(num / 1000)
  assert all(len(labels) == 1000 for _, labels in batches[:-1])
  labels = np.concatenate([labels for _, labels in batches])
  np.testing.assert_array_equal(labels, data.heldout_ids[SEQ_LEN:])
  contexts = np.concatenate([contexts for contexts, _ in batches])
  # The first context starts at the split boundary: nothing straddles it.
  np.testing.assert_array_equal(contexts[0], data.heldout_ids[:SEQ_LEN])
  np.testing.assert_array_equal(
    contexts[-1], data.heldout_ids[-SEQ_LEN - 1 : -1]
  )
  windows = np.lib.stride_tricks.sliding_window_view(data.heldout_ids, SEQ_LEN)
  np.testing.assert_array_equal(contexts, windows[:-1])
  # Deterministic.
  again = next(data.eval_batches(1000))
  np.testing.assert_array_equal(again[0], batches[0][0])


def test_eval_batches_max_batches_spreads_over_split(data):
  batches = list(data.eval_batches(64, max_batches=3))
  assert [len(labels) for _, labels in batches] == [64, 64, 64]
  labels = np.concatenate([labels for _, labels in batches])
  # Evenly spaced positions: first and last held-out examples included.
  assert labels[0] == data.heldout_ids[SEQ_LEN]
  assert labels[-1] == data.heldout_ids[-1]
  small = list(data.eval_batches(len(data.heldout_ids), max_batches=5))
  assert len(small) == 1


def test_unigram_baseline_matches_independent_computation(data, raw_tokens):
  baseline = unigram_baseline(data)
  assert math.isfinite(baseline.loss) and math.isfinite(baseline.accuracy)
  assert 0.0 < baseline.loss < math.log(VOCAB_SIZE)
  assert baseline.perplexity == pytest.approx(math.exp(baseline.loss))

  num_train = len(data.train_ids)
  train_tokens = raw_tokens[:num_train]
  heldout_labels = raw_tokens[num_train + SEQ_LEN :]
  most_common_train = collections.Counter(train_tokens).most_common(1)[0][0]
  label_counts = collections.Counter(heldout_labels)
  most_common_heldout, top_count = label_counts.most_common(1)[0]
  assert most_common_train == most_common_heldout == ","
  assert baseline.accuracy == pytest.approx(top_count / len(heldout_labels))

  in_vocab = set(data.vocab.tokens[1:])
  train_counts = collections.Counter(
    t if t in in_vocab else OOV_TOKEN for t in train_tokens
  )
  denom = num_train + VOCAB_SIZE
  expected_loss = -sum(
    math.log((train_counts[t if t in in_vocab else OOV_TOKEN] + 1) / denom)
    for t in heldout_labels
  ) / len(heldout_labels)
  assert baseline.loss == pytest.approx(expected_loss, rel=1e-9)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(vocab_size=1),
    dict(vocab_size=0),
    dict(vocab_size=2.5),
    dict(seq_len=0),
    dict(seq_len=-3),
    dict(holdout_fraction=0.0),
    dict(holdout_fraction=1.0),
    dict(holdout_fraction=-0.1),
    dict(holdout_fraction=1.5),
    dict(seq_len=10_000_000),
  ],
)
def test_load_rejects_bad_arguments(kwargs):
  with pytest.raises(ValueError):
    ShakespeareData.load(**kwargs)


def test_iterators_reject_bad_arguments(data):
  with pytest.raises(ValueError):
    data.batches(0, seed=0)
  with pytest.raises(ValueError):
    data.batches(4, seed=0, split="test")  # type: ignore[arg-type]
  with pytest.raises(ValueError):
    data.eval_batches(0)
  with pytest.raises(ValueError):
    data.eval_batches(4, max_batches=0)
  with pytest.raises(ValueError):
    data.unigram_counts("valid")  # type: ignore[arg-type]
  with pytest.raises(ValueError):
    Vocabulary.from_counts({"a": 1}, vocab_size=1)
