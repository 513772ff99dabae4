"""Checkpoint save and restore time, with and without chunk checksums.

One table (default 8M x 64 bfloat16 with row-wise Adagrad, 1.0 GiB + 32
MiB of slots; `--rows 100000000` is the 12.8 GB table of
`benchmarks/large_table.py`, which needs a second process to restore on a
24 GiB machine: not done here) is saved and restored with
`pzsc.save_checkpoint` / `pzsc.restore_checkpoint` in three formats:

* `zarr2`: the format before checksums (orbax's default zarr v2 chunks);
* `zarr3`: zarr v3 chunks without a checksum;
* `zarr3+crc32c`: what `save_checkpoint` writes (a CRC-32C per chunk,
  checked by TensorStore on every read).

Rounds interleave the formats; the table prints the median seconds and the
bytes on disk. Restores read from the page cache (the save just wrote the
files), so they time the decode and the copy, where checksums would show.

Usage: python benchmarks/checkpoint.py [--rows 8000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from unittest import mock


def _bytes(path: str) -> int:
  return sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(path)
    for name in names
  )


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=8_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dir", default=None, help="where to write")
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from jax.sharding import Mesh

  import pz_sparsecore as pzsc
  from pz_sparsecore.nn import checkpoint
  from pz_sparsecore.nn.tables import table_arrays

  pytree_impl = ocp.BasePyTreeCheckpointHandler

  def zarr2_impl(**kwargs):
    return pytree_impl(**{**kwargs, "use_zarr3": False})

  def unchecked():
    return mock.patch.object(
      checkpoint, "checksummed_chunks", contextlib.nullcontext
    )

  @contextlib.contextmanager
  def zarr2():
    with mock.patch.object(ocp, "BasePyTreeCheckpointHandler", zarr2_impl):
      with unchecked():
        yield

  formats = {
    "zarr2": zarr2,
    "zarr3": unchecked,
    "zarr3+crc32c": contextlib.nullcontext,
  }

  table = pzsc.TableSpec(
    name="items",
    vocabulary_size=args.rows,
    embedding_dim=args.dim,
    initializer=jax.nn.initializers.normal(0.01),
    optimizer=pzsc.RowwiseAdagradOptimizerSpec(learning_rate=0.05),
    combiner="mean",
    dtype="bfloat16",
  )
  features = {
    "items": pzsc.FeatureSpec(
      name="items",
      table_spec=table,
      input_shape=(4096, 16),
      output_shape=(4096, args.dim),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))

  def build(rng):
    return pzsc.SparseCoreEmbed.from_config(
      "embed", rng, features, mesh, num_sc_per_device=8
    )

  embed = build(jax.random.key(0))
  jax.block_until_ready(table_arrays(embed))
  root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
  times = {name: {"save": [], "restore": []} for name in formats}
  sizes = {}
  try:
    for _ in range(args.rounds):
      for name, scope in formats.items():
        directory = os.path.join(root, name)
        shutil.rmtree(directory, ignore_errors=True)
        with scope():
          t0 = time.perf_counter()
          path = pzsc.save_checkpoint(directory, embed)
          times[name]["save"].append(time.perf_counter() - t0)
        sizes[name] = _bytes(path)
        target = build(None)
        t0 = time.perf_counter()
        restored = pzsc.restore_checkpoint(directory, target)
        jax.block_until_ready(table_arrays(restored))
        times[name]["restore"].append(time.perf_counter() - t0)
        del restored, target
  finally:
    shutil.rmtree(root, ignore_errors=True)

  gib = args.rows * args.dim * 2 / 1024**3
  print(
    f"table {args.rows:,} x {args.dim} bfloat16 ({gib:.2f} GiB) + "
    f"row-wise Adagrad; median of {args.rounds} rounds; {os.cpu_count()} "
    f"CPUs, load {os.getloadavg()[0]:.1f}"
  )
  print(f"{'format':<14}{'save s':>9}{'restore s':>11}{'bytes on disk':>16}")
  for name in formats:
    save = statistics.median(times[name]["save"])
    restore = statistics.median(times[name]["restore"])
    print(f"{name:<14}{save:>9.2f}{restore:>11.2f}{sizes[name]:>16,}")


if __name__ == "__main__":
  main()
