"""One of two processes preprocessing one global batch with minibatching.

Usage: python minibatching_worker.py PROCESS_ID PORT OUT_DIR

Both processes (2 CPU devices each, `jax.distributed` with gloo) build the
same specs and batch; process `i` preprocesses samples `[16 i, 16 i + 16)`
with `enable_minibatching=True` and the default all-reduce, and writes its
buffers to `OUT_DIR/process{i}.npz`. Process 0's samples need no split on
their own; process 1's do.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
  process_id, port = map(int, sys.argv[1:3])
  out_dir = sys.argv[3]
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"localhost:{port}", num_processes=2, process_id=process_id
  )
  import numpy as np

  from pz_sparsecore.host import preprocess

  sys.path.insert(0, os.path.dirname(__file__))
  import test_minibatching as cases

  specs, ids = cases.two_host_batch()
  mine = {"f": ids["f"][16 * process_id : 16 * (process_id + 1)]}
  buffers, _ = preprocess.preprocess_sparse_dense_matmul_input(
    mine,
    None,
    specs,
    2,
    4,
    num_sc_per_device=1,
    has_leading_dimension=True,
    enable_minibatching=True,
  )
  np.savez(
    os.path.join(out_dir, f"process{process_id}.npz"),
    num_minibatches=buffers.num_minibatches,
    row_pointers=buffers.lhs_row_pointers["t"],
    embedding_ids=buffers.lhs_embedding_ids["t"],
    sample_ids=buffers.lhs_sample_ids["t"],
  )
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
