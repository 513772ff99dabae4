"""Tied tables: a SparseCore table shared with a `pz.nn.EmbeddingDecode`.

A model that ties its input embedding to its output logits (Penzai's
`tie_embedder_and_logits=True`) shares one `EmbeddingTable` between an
`EmbeddingLookup` and an `EmbeddingDecode`. Converting the lookup alone
would leave the decode holding the old dense table under the same label:
the model would be untied silently. `check_untied` refuses such a model,
naming the decode layer and the choice to make; `convert_lookups`, the
trainer, `split_tables` and `pzsc.variable_jit` run it.
"""

from __future__ import annotations

from typing import Any

import jax
from penzai import pz

from pz_sparsecore.nn.embed import variable_labels

__all__ = ["TiedTableError", "check_untied", "decode_tables", "tie_message"]


class TiedTableError(ValueError):
  """A SparseCore table is shared with a `pz.nn.EmbeddingDecode`."""


def tie_message(label: str, path: str) -> str:
  return (
    f"the table {label!r} is shared by the pz.nn.EmbeddingDecode at "
    f"{path}: a SparseCoreLookup cannot tie its table to a dense decode "
    "(the decode would need the whole table on every device, and its dense"
    " gradient). Choose: keep the tied dense embedding (do not convert this"
    " lookup), or untie it explicitly, giving the decode its own copy "
    "before converting, e.g. "
    "pz.select(model).at_instances_of(pz.nn.EmbeddingDecode).apply("
    "lambda d: pz.nn.EmbeddingDecode(pz.nn.EmbeddingTable(embeddings="
    "pz.Parameter(value=d.table.embeddings.value, "
    "label=d.table.embeddings.label + '.decode'), "
    "vocabulary_axis=d.table.vocabulary_axis)))"
  )


def decode_tables(model: Any) -> list[tuple[str, Any]]:
  """`(path, label)` of the table of every `EmbeddingDecode` in `model`."""
  found = []
  selection = pz.select(model).at_instances_of(pz.nn.EmbeddingDecode)
  for keypath, decode in selection.selected_by_path.items():
    var = decode.table.embeddings
    label = getattr(var, "label", None)
    found.append((jax.tree_util.keystr(keypath) or "the model's root", label))
  return found


def check_untied(model: Any) -> None:
  """Raises if a SparseCore table's label is an `EmbeddingDecode`'s table.

  Raises:
    TiedTableError: Naming the table, the decode layer's path and the
      choice to make.
  """
  tables, _ = variable_labels(model)
  for path, label in decode_tables(model):
    if label in tables:
      raise TiedTableError(tie_message(label, path))
