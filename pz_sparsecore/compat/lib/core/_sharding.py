"""Upstream's `ShardingStrategy` enum, shared by the compat modules that
name it (`pybind_input_preprocessing` re-exports it, as upstream has it)."""

from __future__ import annotations

import enum


class ShardingStrategy(enum.Enum):
  """How table rows are spread over SparseCores (MOD only)."""

  MOD = 1
