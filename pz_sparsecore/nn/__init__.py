"""Penzai layers, training and checkpoints for SparseCore embeddings."""

from __future__ import annotations

from pz_sparsecore.nn.checkpoint import restore_checkpoint, save_checkpoint
from pz_sparsecore.nn.embed import EmbedConfig, SparseCoreEmbed
from pz_sparsecore.nn.training import (
  NonFiniteUpdateError,
  SparseCoreTrainer,
  SparseCoreTrainerState,
)

__all__ = [
  "EmbedConfig",
  "NonFiniteUpdateError",
  "SparseCoreEmbed",
  "SparseCoreTrainer",
  "SparseCoreTrainerState",
  "restore_checkpoint",
  "save_checkpoint",
]
