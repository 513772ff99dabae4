"""pz_sparsecore: SparseCore-style sharded embeddings for Penzai."""

from __future__ import annotations

__version__ = "0.1.0"
