"""Shared test setup: eight virtual CPU devices for the sharding tests."""

import os
import subprocess
import sys

import pytest
import user_compile

# Must run before jax is imported anywhere in the test session.
# Compiling is most of the suite's CPU time, and most of a CPU compile is
# LLVM optimising the machine code of XLA's kernels: the tests' programs
# are small and run a few steps, so they are compiled without it (level 0;
# measured: a transformer's trainer step compiles in 40% less CPU and
# gives bit-identical losses). The HLO passes (fusion, sharding, donation,
# the custom calls into the C++ kernels, built separately) are the same at
# every level. Processes the tests start without XLA_FLAGS (notebooks, the
# CLI, multi-process runs) compile with XLA's defaults, as users do.
# With XLA's classic CPU emitters (how fused kernels become machine code)
# the tests compile in about a third less time than with its fusion
# emitters (test_training and test_any_batch: 121 -> 77 s, same results):
# `user_compile.FLAG`, empty where jaxlib lacks them.
os.environ.setdefault(
  "XLA_FLAGS",
  "--xla_force_host_platform_device_count=8 "
  f"--xla_backend_optimization_level=0 {user_compile.FLAG}",
)

# No persistent JAX compilation cache: with one shared by the workers (a
# fresh folder per run), jaxlib 0.10.2 crashed an xdist worker with a
# segmentation fault inside `executable.serialize()` (writing an entry) in
# two of six full runs, never when the test it ran was rerun alone, and the
# kernels showed no AddressSanitizer finding on the same tests.

# numba's compiled preprocessing kernels (the fill, minibatching and its
# hash) of a tiny batch: the first run of a checkout compiles them (about a
# minute) and writes numba's cache beside the sources, later runs load it.
_WARM_NUMBA = """
import numpy as np, jax
import pz_sparsecore as pzsc
table = pzsc.TableSpec(name="t", vocabulary_size=100, embedding_dim=8,
  initializer=jax.nn.initializers.zeros,
  optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1), combiner="sum")
specs = pzsc.prepare_feature_specs_for_training(
  {"f": pzsc.FeatureSpec(name="f", table_spec=table, input_shape=(8, 2),
                         output_shape=(8, 8))},
  global_device_count=2, num_sc_per_device=1)
for minibatching in (False, True):
  pzsc.preprocess_sparse_dense_matmul_input(
    {"f": np.zeros((8, 2), np.int32)}, None, specs, 2, 2,
    num_sc_per_device=1, enable_minibatching=minibatching)
"""


def pytest_configure(config):
  """On the xdist controller, before the workers start: fills numba's cache
  once (`_WARM_NUMBA`, in a subprocess). Otherwise, on a fresh checkout,
  the two workers and every process the first tests start (notebook
  kernels, multi-process workers) each compiled the kernels at once, a
  minute of CPU apiece on two cores. A failure here is left to the tests
  to report."""
  if hasattr(config, "workerinput") or not getattr(
    config.option, "numprocesses", None
  ):
    return
  subprocess.run(
    [sys.executable, "-c", _WARM_NUMBA],
    env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
    capture_output=True,
    timeout=900,
    check=False,
  )


# Modules whose tests build the same layers and compile the same programs
# (module fixtures, JAX's in-process caches): each runs on one worker (an
# `xdist_group` of its own, added below), which builds and compiles them
# once, where its tests spread over both workers built and compiled them on
# each at the same time (test_axis_mapping's three trainings: 104 -> 66 s
# CPU). Measured with -n 2 on these modules, fresh compile cache: 1,221 ->
# 1,073 s CPU, 630 -> 559 s wall. xdist dispatches groups before the single
# tests (by test count), so the ungrouped modules still balance the end of
# the run; modules that gained nothing stay ungrouped.
_GROUPED_MODULES = frozenset(
  {
    "test_axis_mapping",
    "test_bad_input",
    "test_checkpoint",
    "test_checkpoint_limits",
    "test_compat_device",
    "test_embed",
    "test_exchange",
    "test_inplace",
    "test_input_check",
    "test_jit",
    "test_limits",
    "test_lookup",
    "test_minibatching_layer",
    "test_parallel",
    "test_quantization",
    "test_replication",
    "test_rowwise",
    "test_sample_order",
    "test_stacking",
    "test_table_dtypes_layer",
    "test_training",
    "test_viz",
    "test_viz_dlrm",
  }
)


def _group_modules(items) -> None:
  """Marks the tests of `_GROUPED_MODULES` with their module's group (a test
  already in a group keeps it)."""
  for item in items:
    module = getattr(item, "module", None)
    name = module.__name__.rpartition(".")[2] if module else None
    if name in _GROUPED_MODULES and not any(item.iter_markers("xdist_group")):
      item.add_marker(pytest.mark.xdist_group(name))


def pytest_collection_modifyitems(config, items):
  """Groups `_GROUPED_MODULES`, and keeps `--dist loadgroup`'s groups
  together on pytest 9.

  pytest-xdist (3.8) marks a test of an `xdist_group` by appending
  `@group` to its node id through `item._nodeid`, which pytest 9 no longer
  reads (the id lives in `item._id`), so grouped tests spread over the
  workers: the docs build and the CLI's run were built on both, and the
  multi-process tests ran beside each other. On the workers (where xdist
  sets `config.option.loadgroup`), the suffix is added here.
  """
  _group_modules(items)
  if not getattr(config.option, "loadgroup", False):
    return
  try:
    from _pytest.nodeid import coerce_node_id
  except ImportError:  # pytest 8: xdist's own renaming works.
    return
  for item in items:
    names = sorted(
      {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
      }
    )
    suffix = "@" + "_".join(names)
    if names and hasattr(item, "_id") and not item.nodeid.endswith(suffix):
      item._id = coerce_node_id(item.nodeid + suffix)
