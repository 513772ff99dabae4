"""Penzai layers, training and checkpoints for SparseCore embeddings."""

from __future__ import annotations

import importlib

from pz_sparsecore.nn.embed import EmbedConfig, SparseCoreEmbed, find_embeds
from pz_sparsecore.nn.jit import variable_jit
from pz_sparsecore.nn.lookup import LookupConfig, SparseCoreLookup
from pz_sparsecore.nn.placement import (
  TablePlacementWarning,
  complete_mapping,
  place_tables,
)
from pz_sparsecore.nn.probe import ActivationProbe
from pz_sparsecore.nn.respec import update_limits, with_feature_specs
from pz_sparsecore.nn.split import convert_lookups, split_tables, value_and_grad
from pz_sparsecore.nn.tables import (
  HashedRows,
  hashed_rows,
  logical_slots,
  logical_tables,
  set_logical_slots,
  set_logical_tables,
)
from pz_sparsecore.nn.ties import TiedTableError, check_untied
from pz_sparsecore.nn.training import (
  NonFiniteInputError,
  NonFiniteUpdateError,
  SparseCoreTrainer,
  SparseCoreTrainerState,
)

__all__ = [
  "ActivationProbe",
  "EmbedConfig",
  "LookupConfig",
  "NonFiniteInputError",
  "NonFiniteUpdateError",
  "SparseCoreEmbed",
  "SparseCoreLookup",
  "TablePlacementWarning",
  "TiedTableError",
  "check_untied",
  "complete_mapping",
  "convert_lookups",
  "place_tables",
  "split_tables",
  "value_and_grad",
  "SparseCoreTrainer",
  "SparseCoreTrainerState",
  "find_embeds",
  "HashedRows",
  "hashed_rows",
  "logical_slots",
  "logical_tables",
  "restore_checkpoint",
  "save_checkpoint",
  "set_logical_slots",
  "set_logical_tables",
  "variable_jit",
  "update_limits",
  "with_feature_specs",
]


# Checkpoints need orbax, a heavy import that building and training a layer
# do not: loaded on first use.
_LAZY = {"restore_checkpoint": "checkpoint", "save_checkpoint": "checkpoint"}


def __getattr__(name: str):
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'pz_sparsecore.nn' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"pz_sparsecore.nn.{module}"), name)
  globals()[name] = value
  return value
