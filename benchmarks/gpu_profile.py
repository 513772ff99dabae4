"""Per-kernel device time of the fused update on a GPU, under Nsight Compute.

Run: ``ncu --metrics gpu__time_duration.sum --kernel-name
regex:'Pzsc|Device' python benchmarks/gpu_profile.py [workload]
[optimizer ...]``: one update
(after one untimed warm-up call) of ``benchmarks/gpu.py``'s workload (default
0: 1M uniform), per optimizer (default sgd, rowwise_adagrad), so that the
report splits the update into its sort, run-length encoding, scan and update
kernels.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
  import gpu
  import jax
  import jax.numpy as jnp
  import numpy as np
  from kernels import preprocess_fn

  workload = int(sys.argv[1]) if len(sys.argv) > 1 else 0
  optimizers = sys.argv[2:] or ["sgd", "rowwise_adagrad"]
  vocab, dist = gpu.WORKLOADS[workload]
  ids = gpu.make_ids(vocab, dist)
  prep = preprocess_fn(vocab, gpu.BATCH, gpu.IDS, gpu.DIM)
  dev = jax.devices()[0]
  bufs = tuple(jax.device_put(b, dev) for b in prep(ids))
  act = jax.device_put(
    jnp.asarray(
      np.random.default_rng(1).normal(size=(gpu.BATCH, gpu.DIM)), jnp.float32
    ),
    dev,
  )

  update = gpu.jitted_update(gpu.one_shard_layout(vocab))

  for opt in optimizers:
    table = jnp.zeros((vocab, gpu.DIM), jnp.float32, device=dev)
    width = 1 if opt == "rowwise_adagrad" else gpu.DIM
    slots = (
      ()
      if opt == "sgd"
      else (jnp.full((vocab, width), gpu.ACC0, jnp.float32, device=dev),)
    )
    for i in range(2):
      table, slots = update(table, slots, opt, act, bufs)
      jax.block_until_ready(table)
      print(f"{opt} call {i} done", flush=True)


if __name__ == "__main__":
  main()
