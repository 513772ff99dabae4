"""Penzai layers, training and checkpoints for SparseCore embeddings."""

from __future__ import annotations

from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.embed import EmbedConfig, SparseCoreEmbed, find_embeds
from pz_sparsecore.nn.jit import variable_jit
from pz_sparsecore.nn.probe import ActivationProbe
from pz_sparsecore.nn.respec import update_limits, with_feature_specs
from pz_sparsecore.nn.tables import (
  logical_slots,
  logical_tables,
  set_logical_slots,
  set_logical_tables,
)
from pz_sparsecore.nn.training import (
  NonFiniteUpdateError,
  SparseCoreTrainer,
  SparseCoreTrainerState,
)

__all__ = [
  "ActivationProbe",
  "EmbedConfig",
  "NonFiniteUpdateError",
  "SparseCoreEmbed",
  "SparseCoreTrainer",
  "SparseCoreTrainerState",
  "find_embeds",
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
