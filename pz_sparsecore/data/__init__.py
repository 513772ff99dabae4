"""Datasets bundled with pz_sparsecore.

The package ships its data as package resources (no downloads at run time).
Currently it holds one corpus: the complete works of Shakespeare, exposed as a
next-word prediction task by :mod:`pz_sparsecore.data.shakespeare`. The raw
file and its provenance live in the ``shakespeare/`` resource directory
(``complete_works.txt.gz`` and ``SOURCE.md``).
"""

from __future__ import annotations

from pz_sparsecore.data.shakespeare import (
  OOV_ID,
  OOV_TOKEN,
  ShakespeareData,
  UnigramBaseline,
  Vocabulary,
  load_corpus,
  tokenize,
  unigram_baseline,
)

__all__ = [
  "OOV_ID",
  "OOV_TOKEN",
  "ShakespeareData",
  "UnigramBaseline",
  "Vocabulary",
  "load_corpus",
  "tokenize",
  "unigram_baseline",
]
