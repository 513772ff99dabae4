"""Penzai layers, training and checkpoints for SparseCore embeddings."""

from __future__ import annotations

from pz_sparsecore.nn.embed import EmbedConfig, SparseCoreEmbed

__all__ = ["EmbedConfig", "SparseCoreEmbed"]
