"""pz_sparsecore: SparseCore-style sharded embeddings for Penzai.

`import pz_sparsecore as pzsc` gives the public surface below. Submodules
load on first use, so importing the package is cheap and does not start JAX.

Pipeline: specs (`TableSpec`, `FeatureSpec`, optimizer specs, whose
equations live in the optimizer registry) → layout
(`prepare_feature_specs_for_training`, `stack_tables`, ...) → the plan
(`build_plan`: every static size of the specs on a topology, in the buffer
format of `buffer_format`) → host preprocessing
(`preprocess_sparse_dense_matmul_input`) → kernels and their shard_map
routing → the Penzai layer (`SparseCoreEmbed`) and its training
(`SparseCoreTrainer`), with FDO, checkpoints, logical table views and
Treescope figures around it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
  # specs
  "TableSpec": "specs",
  "FeatureSpec": "specs",
  "FeatureIdTransformation": "specs",
  "TableSettingInStack": "specs",
  "StackedTableSpec": "specs",
  "OptimizerSpec": "specs",
  "SGDOptimizerSpec": "specs",
  "AdagradOptimizerSpec": "specs",
  "AdagradMomentumOptimizerSpec": "specs",
  "AdamOptimizerSpec": "specs",
  "FTRLOptimizerSpec": "specs",
  "QuantizationConfig": "specs",
  "LaPropOptimizerSpec": "specs",
  "F2AOptimizerSpec": "specs",
  "CustomOptimizerSpec": "specs",
  # layout
  "prepare_feature_specs_for_training": "layout",
  "stack_tables": "layout",
  "auto_stack_tables": "layout",
  "stack_and_shard_tables": "layout",
  "unshard_and_unstack_tables": "layout",
  "physical_row_ids": "layout",
  "get_table_specs": "layout",
  "get_stacked_table_specs": "layout",
  # plan and buffer format
  "Plan": "plan",
  "build_plan": "plan",
  "PAD_ID": "buffer_format",
  # preprocessing
  "preprocess_sparse_dense_matmul_input": "preprocess",
  "PreprocessedInput": "preprocess",
  "SparseDenseMatmulInputStats": "preprocess",
  "compute_coo_buffer_size_per_device": "preprocess",
  "eval_preprocess_sparse_dense_matmul_input_shape": "preprocess",
  "preprocess_sparse_dense_matmul_input_from_sparse_tensor": "sparse_coo",
  "preprocess_sparse_dense_matmul_sparse_coo_input": "sparse_coo",
  # fdo
  "FDOClient": "fdo",
  "NPZFileFDOClient": "fdo",
  "CSVFileFDOClient": "fdo",
  "update_preprocessing_parameters": "fdo",
  "scale_stats": "fdo",
  # device side
  "sparse_dense_matmul": "kernels",
  "sparse_dense_matmul_grad": "kernels",
  "backend_info": "kernels.backend",
  "Topology": "parallel",
  "TableGradientError": "parallel",
  "predict_exchange_bytes": "exchange",
  "ExchangeBytes": "exchange",
  # penzai side
  "SparseCoreEmbed": "nn.embed",
  "SparseCoreTrainer": "nn.training",
  "variable_jit": "nn.jit",
  "NonFiniteUpdateError": "nn.training",
  "save_checkpoint": "nn.checkpoint",
  "restore_checkpoint": "nn.checkpoint",
  "logical_tables": "nn.tables",
  "logical_slots": "nn.tables",
  "set_logical_tables": "nn.tables",
  "set_logical_slots": "nn.tables",
  "with_feature_specs": "nn.respec",
  "update_limits": "nn.respec",
  # input pipeline
  "prefetch": "pipeline",
  "Prefetcher": "pipeline",
  "PrefetchError": "pipeline",
  # exchange of layouts with jax-tpu-embedding
  "EmbeddingSpecProto": "spec_proto",
  "create_proto_from_feature_specs": "spec_proto",
  "feature_specs_from_proto": "spec_proto",
}

_RENAMED = {"build_plan": "build", "predict_exchange_bytes": "predict_bytes"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'pz_sparsecore' has no attribute {name!r}")
  value = getattr(
    importlib.import_module(f"pz_sparsecore.{module}"), _RENAMED.get(name, name)
  )
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(list(globals()) + __all__)
