"""Next-word prediction on the complete works of Shakespeare.

Design:

* **Corpus.** The Globe edition of the 42 works (public domain; provenance in
  ``shakespeare/SOURCE.md`` next to this module) ships gzip-compressed as
  package data, so nothing is downloaded at run time. :func:`load_corpus`
  reads it once through :mod:`importlib.resources` and caches the string.
* **Tokens.** :func:`tokenize` lowercases the text and extracts words and
  sentence punctuation with :data:`TOKEN_PATTERN`:

  - words are runs of ASCII letters with at most one inner apostrophe
    (``"o'er"``, ``"father's"``); a leading or trailing apostrophe is dropped
    (``"'tis"`` -> ``"tis"``), and the apostrophe of a rare second
    contraction splits it (``"o'er't"`` -> ``"o'er"``, ``"t"``);
  - the six punctuation marks ``. , ! ? ; :`` are tokens of their own. They
    are about a fifth of the stream and are what a word-level language
    model learns first, so they make the task less sparse;
  - everything else (digits, brackets around stage directions, quotes,
    dashes, ``&``) is dropped.

  The corpus gives about 1.13 M tokens over 26 k distinct types.
* **Vocabulary.** Id ``0`` (:data:`OOV_ID`, token :data:`OOV_TOKEN`) stands
  for every out-of-vocabulary token; ids ``1 .. vocab_size - 1`` are the most
  frequent *training* tokens ordered by count (descending), ties broken by the
  token string (ascending), so the vocabulary is fully deterministic. It is
  built from the training part only, so held-out words never seen in training
  are OOV, as they would be for new text.
* **Split.** The token stream is split by position: the last
  ``holdout_fraction`` of the tokens are held out. Examples are drawn inside
  one part only, so a context never straddles the boundary and the two sets
  of examples are disjoint.
* **Examples.** An example is ``(stream[p - seq_len : p], stream[p])`` for a
  position ``p`` in ``[seq_len, len(stream))``: a context of ``seq_len`` ids
  and the id of the next token. Labels may be :data:`OOV_ID`.
  :meth:`ShakespeareData.batches` samples positions uniformly at random
  (infinite, deterministic per seed); :meth:`ShakespeareData.eval_batches`
  enumerates them (finite, deterministic).
* **Speed.** Tokenising is one regex pass (~0.2 s); encoding maps tokens to
  integers with one dict pass, then remaps those with a numpy lookup table per
  vocabulary size. Corpus, token stream and encoded splits are cached in
  memory (:func:`functools.lru_cache`), and the cached arrays are read-only.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.resources
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal, NamedTuple

import numpy as np

TOKEN_PATTERN = re.compile(r"[a-z]+(?:'[a-z]+)?|[.,!?;:]")
"""Regex of one token, applied to lowercased text (see module docstring)."""

OOV_ID = 0
"""Id of the out-of-vocabulary token."""

OOV_TOKEN = "<unk>"
"""String of the out-of-vocabulary token (``Vocabulary.tokens[0]``)."""

Split = Literal["train", "heldout"]

_PACKAGE = "pz_sparsecore.data"
_RESOURCE_DIR = "shakespeare"
_CORPUS_FILE = "complete_works.txt.gz"


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
  """Returns the complete works of Shakespeare as one string (cached).

  Returns:
    The decoded UTF-8 text of the bundled ``complete_works.txt.gz``
    (about 5.06 M characters).
  """
  resource = importlib.resources.files(_PACKAGE) / _RESOURCE_DIR / _CORPUS_FILE
  with resource.open("rb") as raw:
    with gzip.open(raw, "rt", encoding="utf-8") as f:
      return f.read()


def tokenize(text: str) -> list[str]:
  """Splits text into lowercase word and punctuation tokens.

  Args:
    text: Any text.

  Returns:
    The matches of :data:`TOKEN_PATTERN` in ``text.lower()``, in order. For
    example ``tokenize("O Romeo, Romeo! 'Tis o'er.")`` is
    ``["o", "romeo", ",", "romeo", "!", "tis", "o'er", "."]``.
  """
  return TOKEN_PATTERN.findall(text.lower())


@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """A token <-> id mapping with id 0 reserved for out-of-vocabulary tokens.

  Attributes:
    tokens: The token of each id; ``tokens[0]`` is :data:`OOV_TOKEN`.
  """

  tokens: tuple[str, ...]
  _index: dict[str, int] = dataclasses.field(
    init=False, repr=False, compare=False
  )

  def __post_init__(self) -> None:
    tokens = tuple(self.tokens)
    if not tokens or tokens[0] != OOV_TOKEN:
      raise ValueError(f"tokens[0] must be {OOV_TOKEN!r}, got {tokens[:1]}")
    index = {token: i for i, token in enumerate(tokens)}
    if len(index) != len(tokens):
      raise ValueError("tokens must be distinct")
    object.__setattr__(self, "tokens", tokens)
    object.__setattr__(self, "_index", index)

  def __repr__(self) -> str:
    head = ", ".join(repr(t) for t in self.tokens[:6])
    return f"Vocabulary(size={self.size}, tokens=({head}, ...))"

  @classmethod
  def from_counts(
    cls, counts: Mapping[str, int], vocab_size: int
  ) -> Vocabulary:
    """Builds the vocabulary of the most frequent tokens.

    Args:
      counts: Occurrence count of each token.
      vocab_size: Number of ids including the OOV id, at least 2. The result
        is smaller when fewer than ``vocab_size - 1`` tokens have a positive
        count.

    Returns:
      A vocabulary whose ids ``1, 2, ...`` are the tokens with positive count
      ordered by count descending, then by token ascending.

    Raises:
      ValueError: If ``vocab_size < 2``.
    """
    _check_vocab_size(vocab_size)
    ranked = sorted(
      (item for item in counts.items() if item[1] > 0),
      key=lambda item: (-item[1], item[0]),
    )
    kept = [token for token, _ in ranked[: vocab_size - 1]]
    return cls((OOV_TOKEN, *kept))

  @property
  def size(self) -> int:
    """Number of ids, including the OOV id."""
    return len(self.tokens)

  @property
  def oov_id(self) -> int:
    """Id of out-of-vocabulary tokens (always :data:`OOV_ID`)."""
    return OOV_ID

  def encode(self, tokens: Iterable[str]) -> np.ndarray:
    """Maps tokens to ids, unknown tokens to :attr:`oov_id`.

    Args:
      tokens: Token strings.

    Returns:
      An int32 array ``[len(tokens)]``.
    """
    get = self._index.get
    return np.fromiter((get(t, OOV_ID) for t in tokens), dtype=np.int32)

  def decode(self, ids: Iterable[int] | np.ndarray) -> list[str]:
    """Maps ids (any shape, flattened) back to token strings.

    Args:
      ids: Integer ids in ``[0, size)``.

    Returns:
      The token of each id, in row-major order.

    Raises:
      ValueError: If an id is out of range.
    """
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= self.size):
      raise ValueError(f"ids must be in [0, {self.size})")
    return [self.tokens[i] for i in flat.tolist()]


class UnigramBaseline(NamedTuple):
  """Held-out scores of the training unigram distribution.

  Attributes:
    loss: Mean cross-entropy of the held-out labels, in nats.
    accuracy: Fraction of held-out labels equal to the most frequent
      training token.
  """

  loss: float
  accuracy: float

  @property
  def perplexity(self) -> float:
    """``exp(loss)``."""
    return math.exp(self.loss)


@dataclasses.dataclass(frozen=True, eq=False)
class ShakespeareData:
  """The encoded corpus split into training and held-out token streams.

  Build it with :meth:`load`. The arrays are shared with an in-memory cache
  and read-only.

  Attributes:
    vocab: The vocabulary (built from the training stream).
    train_ids: int32 ids of the first ``1 - holdout_fraction`` of the tokens.
    heldout_ids: int32 ids of the remaining tokens.
    seq_len: Context length of the examples.
  """

  vocab: Vocabulary
  train_ids: np.ndarray = dataclasses.field(repr=False)
  heldout_ids: np.ndarray = dataclasses.field(repr=False)
  seq_len: int

  @classmethod
  def load(
    cls,
    vocab_size: int = 4096,
    seq_len: int = 32,
    holdout_fraction: float = 0.1,
  ) -> ShakespeareData:
    """Loads, tokenises, encodes and splits the corpus (cached per args).

    Args:
      vocab_size: Number of ids including the OOV id 0, at least 2.
      seq_len: Context length, at least 1.
      holdout_fraction: Fraction of the token stream, at its end, held out;
        in ``(0, 1)``.

    Returns:
      The dataset.

    Raises:
      ValueError: On an argument out of range, or when a split is not longer
        than ``seq_len``.
    """
    _check_vocab_size(vocab_size)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
      raise ValueError(f"seq_len must be an int, got {seq_len!r}")
    if seq_len < 1:
      raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    holdout_fraction = float(holdout_fraction)
    if not 0.0 < holdout_fraction < 1.0:
      raise ValueError(
        f"holdout_fraction must be in (0, 1), got {holdout_fraction}"
      )
    vocab, train_ids, heldout_ids = _encoded_splits(
      vocab_size, holdout_fraction
    )
    for name, ids in (("train", train_ids), ("heldout", heldout_ids)):
      if len(ids) <= seq_len:
        raise ValueError(
          f"the {name} split has {len(ids)} tokens, need more than "
          f"seq_len={seq_len}"
        )
    return cls(vocab, train_ids, heldout_ids, seq_len)

  def ids(self, split: Split) -> np.ndarray:
    """Returns the token id stream of ``split`` ("train" or "heldout")."""
    if split == "train":
      return self.train_ids
    if split == "heldout":
      return self.heldout_ids
    raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")

  def num_examples(self, split: Split = "heldout") -> int:
    """Number of distinct examples (label positions) in ``split``."""
    return len(self.ids(split)) - self.seq_len

  def unigram_counts(self, split: Split = "train") -> np.ndarray:
    """Occurrences of each id in the stream of ``split``.

    Args:
      split: "train" or "heldout".

    Returns:
      An int64 array ``[vocab.size]``.
    """
    return np.bincount(self.ids(split), minlength=self.vocab.size).astype(
      np.int64
    )

  def batches(
    self, batch_size: int, *, seed: int, split: Split = "train"
  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Samples random examples forever.

    Each batch draws ``batch_size`` label positions uniformly (with
    replacement) from the split. The sequence of batches depends only on
    ``seed``, ``split`` and the dataset arguments.

    Args:
      batch_size: Examples per batch, at least 1.
      seed: Seed of the :func:`numpy.random.default_rng` generator.
      split: "train" or "heldout".

    Returns:
      An infinite iterator of ``(contexts, labels)``: int32 arrays
      ``[batch_size, seq_len]`` and ``[batch_size]``.

    Raises:
      ValueError: If ``batch_size < 1`` or ``split`` is unknown.
    """
    _check_batch_size(batch_size)
    stream = self.ids(split)
    rng = np.random.default_rng(seed)

    def generate() -> Iterator[tuple[np.ndarray, np.ndarray]]:
      while True:
        positions = rng.integers(self.seq_len, len(stream), size=batch_size)
        yield self._gather(stream, positions)

    return generate()

  def eval_batches(
    self,
    batch_size: int,
    max_batches: int | None = None,
    *,
    split: Split = "heldout",
  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Enumerates examples deterministically, for evaluation.

    Without ``max_batches`` every label position of the split is visited
    once, in stream order; the last batch may be smaller than
    ``batch_size`` (weight batch means by batch length). With
    ``max_batches`` only ``max_batches * batch_size`` positions are used,
    spaced evenly over the whole split so that the subset is representative.

    Args:
      batch_size: Examples per batch, at least 1.
      max_batches: Optional cap on the number of batches, at least 1.
      split: "train" or "heldout".

    Returns:
      A finite iterator of ``(contexts, labels)``: int32 arrays
      ``[b, seq_len]`` and ``[b]`` with ``b <= batch_size``.

    Raises:
      ValueError: On a bad ``batch_size``, ``max_batches`` or ``split``.
    """
    _check_batch_size(batch_size)
    if max_batches is not None and max_batches < 1:
      raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    stream = self.ids(split)
    positions = np.arange(self.seq_len, len(stream))
    if max_batches is not None and max_batches * batch_size < len(positions):
      picks = np.linspace(0, len(positions) - 1, max_batches * batch_size)
      positions = positions[np.round(picks).astype(np.int64)]

    def generate() -> Iterator[tuple[np.ndarray, np.ndarray]]:
      for start in range(0, len(positions), batch_size):
        yield self._gather(stream, positions[start : start + batch_size])

    return generate()

  def _gather(
    self, stream: np.ndarray, positions: np.ndarray
  ) -> tuple[np.ndarray, np.ndarray]:
    """Returns the contexts and labels of the given label positions."""
    offsets = np.arange(-self.seq_len, 0)
    contexts = stream[positions[:, None] + offsets[None, :]]
    return contexts, stream[positions]


def unigram_baseline(data: ShakespeareData) -> UnigramBaseline:
  """Scores the add-one smoothed training unigram model on held-out data.

  The model predicts every held-out label, context ignored, with
  ``p(i) = (count_train(i) + 1) / (num_train_tokens + vocab.size)``. The
  labels are those of :meth:`ShakespeareData.eval_batches` (held-out
  positions ``seq_len ..``), OOV included, so the numbers are directly
  comparable to a model's evaluation loss and accuracy.

  Args:
    data: The dataset.

  Returns:
    The held-out cross-entropy (nats) and accuracy.
  """
  counts = data.unigram_counts("train")
  log_probs = np.log(counts + 1.0) - np.log(counts.sum() + data.vocab.size)
  labels = data.heldout_ids[data.seq_len :]
  loss = float(-log_probs[labels].mean())
  accuracy = float((labels == int(np.argmax(counts))).mean())
  return UnigramBaseline(loss=loss, accuracy=accuracy)


def _check_vocab_size(vocab_size: int) -> None:
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
    raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
  if vocab_size < 2:
    raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")


def _check_batch_size(batch_size: int) -> None:
  if isinstance(batch_size, bool) or not isinstance(batch_size, int):
    raise ValueError(f"batch_size must be an int, got {batch_size!r}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")


@functools.lru_cache(maxsize=1)
def _token_stream() -> tuple[tuple[str, ...], np.ndarray]:
  """Returns the distinct tokens and the corpus as indices into them.

  Indices are assigned in order of first occurrence (one dict pass, much
  faster than ``np.unique`` on a string array).
  """
  index: dict[str, int] = {}
  setdefault = index.setdefault
  tokens = tokenize(load_corpus())
  codes = np.fromiter(
    (setdefault(t, len(index)) for t in tokens),
    dtype=np.int32,
    count=len(tokens),
  )
  codes.flags.writeable = False
  return tuple(index), codes


@functools.lru_cache(maxsize=8)
def _encoded_splits(
  vocab_size: int, holdout_fraction: float
) -> tuple[Vocabulary, np.ndarray, np.ndarray]:
  """Builds the vocabulary and the encoded, split id streams (cached)."""
  table, codes = _token_stream()
  num_train = int(round(len(codes) * (1.0 - holdout_fraction)))
  counts = np.bincount(codes[:num_train], minlength=len(table))
  vocab = Vocabulary.from_counts(
    dict(zip(table, counts.tolist(), strict=True)), vocab_size
  )
  code_of = {token: code for code, token in enumerate(table)}
  code_to_id = np.full(len(table), OOV_ID, dtype=np.int32)
  kept_codes = [code_of[token] for token in vocab.tokens[1:]]
  code_to_id[kept_codes] = np.arange(1, vocab.size, dtype=np.int32)
  ids = code_to_id[codes]
  ids.flags.writeable = False
  train_ids, heldout_ids = ids[:num_train], ids[num_train:]
  return vocab, train_ids, heldout_ids
