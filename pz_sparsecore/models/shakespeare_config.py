"""Configuration of the Shakespeare example (importable without JAX)."""

from __future__ import annotations

import dataclasses

OPTIMIZER_NAMES = ("adagrad", "adam", "sgd", "ftrl", "rowwise_adagrad")
TABLE_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Configuration of a Shakespeare run (also written to the report)."""

  devices: int = 8
  sc_per_device: int = 1
  steps: int = 400
  vocab: int = 4096
  seq_len: int = 8
  batch_size: int = 256
  embedding_dim: int = 64
  hidden: int = 256
  optimizer: str = "adagrad"
  table_dtype: str = "float32"
  fdo_every: int = 100
  fdo_headroom: float = 1.25
  eval_batches: int = 16
  seed: int = 0
