"""pz_sparsecore: SparseCore-style sharded embeddings for Penzai.

`import pz_sparsecore as pzsc` gives the public surface below. Submodules
load on first use, so importing the package is cheap and does not start JAX
(it loads Treescope's type registries only, see `_set_up_treescope`).

The package's folders are the pipeline's stages; data flows down, and no
stage imports one above it:

* `core`: specs (`TableSpec`, `FeatureSpec`, optimizer specs, whose
  equations live in the optimizer registry), layout
  (`prepare_feature_specs_for_training`, `stack_tables`, ...), the plan
  (`build_plan`: every static size of the specs on a topology, in the buffer
  format of `buffer_format`) and the types that cross stages
  (`PreprocessedInput`, `SparseDenseMatmulInputStats`);
* `host`: preprocessing of id batches on the host
  (`preprocess_sparse_dense_matmul_input`), FDO and the prefetching
  pipeline;
* `device`: the kernels, the topology and the routing of lookups and fused
  updates over the mesh, one exchange per stack;
* `nn`: the Penzai layer (`SparseCoreEmbed`), its training
  (`SparseCoreTrainer`), jitting, checkpoints and logical table views;
* `viz`: Treescope renderers and figures.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
  # specs
  "TableSpec": "core.specs",
  "Eviction": "core.hashed",
  "string_ids": "core.hashed",
  "FeatureSpec": "core.specs",
  "FeatureIdTransformation": "core.specs",
  "TableSettingInStack": "core.specs",
  "StackedTableSpec": "core.specs",
  "OptimizerSpec": "core.specs",
  "SGDOptimizerSpec": "core.specs",
  "AdagradOptimizerSpec": "core.specs",
  "AdagradMomentumOptimizerSpec": "core.specs",
  "RowwiseAdagradOptimizerSpec": "core.specs",
  "AdamOptimizerSpec": "core.specs",
  "FTRLOptimizerSpec": "core.specs",
  "QuantizationConfig": "core.specs",
  "LaPropOptimizerSpec": "core.specs",
  "F2AOptimizerSpec": "core.specs",
  "CustomOptimizerSpec": "core.specs",
  "SlotShape": "core.optimizers",
  # layout
  "prepare_feature_specs_for_training": "core.layout",
  "stack_tables": "core.layout",
  "auto_stack_tables": "core.layout",
  "stack_and_shard_tables": "core.layout",
  "unshard_and_unstack_tables": "core.layout",
  "physical_row_ids": "core.layout",
  "get_table_specs": "core.layout",
  "get_stacked_table_specs": "core.layout",
  # plan and buffer format
  "Plan": "core.plan",
  "build_plan": "core.plan",
  "PAD_ID": "core.buffer_format",
  # preprocessing
  "preprocess_sparse_dense_matmul_input": "host.preprocess",
  "PreprocessedInput": "core.preprocessed",
  "SparseDenseMatmulInputStats": "core.preprocessed",
  "compute_coo_buffer_size_per_device": "host.preprocess",
  "eval_preprocess_sparse_dense_matmul_input_shape": "host.preprocess",
  "preprocess_sparse_dense_matmul_input_from_sparse_tensor": "host.sparse_coo",
  "preprocess_sparse_dense_matmul_sparse_coo_input": "host.sparse_coo",
  # fdo
  "FDOClient": "host.fdo",
  "NPZFileFDOClient": "host.fdo",
  "CSVFileFDOClient": "host.fdo",
  "update_preprocessing_parameters": "host.fdo",
  "scale_stats": "host.fdo",
  "merge_stats": "host.fdo",
  "LimitsExceededError": "host.fill",
  "worst_case_limits": "core.layout",
  # device side
  "sparse_dense_matmul": "device.kernels",
  "sparse_dense_matmul_grad": "device.kernels",
  "backend_info": "device.kernels.backend",
  "Topology": "device.topology",
  "TableGradientError": "device.routing",
  "predict_exchange_bytes": "device.exchange",
  "ExchangeBytes": "device.exchange",
  # penzai side
  "SparseCoreEmbed": "nn.embed",
  "SparseCoreLookup": "nn.lookup",
  "split_tables": "nn.split",
  "value_and_grad": "nn.split",
  "convert_lookups": "nn.split",
  "check_untied": "nn.ties",
  "complete_mapping": "nn.placement",
  "place_tables": "nn.placement",
  "TablePlacementWarning": "nn.placement",
  "TiedTableError": "nn.ties",
  "SparseCoreTrainer": "nn.training",
  "variable_jit": "nn.jit",
  "NonFiniteUpdateError": "nn.training",
  "NonFiniteInputError": "nn.training",
  "LimitsRaisedWarning": "nn.training",
  "save_checkpoint": "nn.checkpoint",
  "restore_checkpoint": "nn.checkpoint",
  "list_checkpoints": "nn.checkpoint",
  "CheckpointInfo": "nn.checkpoint",
  "export": "nn.export",
  "load_for_serving": "nn.export",
  "ServingOptimizerSpec": "nn.export",
  "PeerError": "nn.checkpoint",
  "logical_tables": "nn.tables",
  "top_k": "nn.retrieval",
  "dot_interaction": "nn.interaction",
  "logical_slots": "nn.tables",
  "set_logical_tables": "nn.tables",
  "set_logical_slots": "nn.tables",
  "hashed_rows": "nn.tables",
  "HashedRows": "nn.tables",
  "with_feature_specs": "nn.respec",
  "update_limits": "nn.respec",
  # input pipeline
  "prefetch": "host.pipeline",
  "Prefetcher": "host.pipeline",
  "PrefetchError": "host.pipeline",
  # exchange of layouts with jax-tpu-embedding
  "EmbeddingSpecProto": "core.spec_proto",
  "create_proto_from_feature_specs": "core.spec_proto",
  "feature_specs_from_proto": "core.spec_proto",
}

_RENAMED = {"build_plan": "build", "predict_exchange_bytes": "predict_bytes"}

__all__ = sorted(_EXPORTS)


_SUBMODULES = {"viz": "viz", "metrics": "nn.metrics"}
"""Modules given as attributes: `pzsc.viz`, `pzsc.metrics`."""
_TREESCOPE_SETUP = ("pz_sparsecore.viz.treescope", "register_renderers")


def __getattr__(name: str):
  if name in _SUBMODULES:
    return importlib.import_module(f"pz_sparsecore.{_SUBMODULES[name]}")
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


def _set_up_treescope() -> None:
  """Has Treescope import `viz.treescope` before it next renders anything.

  The `core` types name no later stage, so their renderers live in `viz`,
  which registers them in Treescope's handler registry when imported. An
  entry in Treescope's table of set-up functions (keyed by a module already
  imported, run once at the start of the next rendering, as Treescope sets
  up JAX's and NumPy's types) makes every rendering after `import
  pz_sparsecore` use them, without loading `viz` (numba, Penzai) on import.
  The table is private to Treescope (`<0.2`): `test_viz` renders a spec in
  a fresh process, so a Treescope without it fails there.
  """
  from treescope import type_registries

  type_registries._LAZY_MODULE_SETUP_FUNCTIONS.setdefault(
    __name__, _TREESCOPE_SETUP
  )


_set_up_treescope()
