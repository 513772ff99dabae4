"""Checkpoint save and restore time, with and without chunk checksums.

One table (default 8M x 64 bfloat16 with row-wise Adagrad, 0.95 GiB + 31
MiB of slots; `--rows 100000000` is the 11.9 GiB table of
`benchmarks/large_table.py`) is saved and restored with
`pzsc.save_checkpoint` / `pzsc.restore_checkpoint` in these formats:

* `zarr2`: the format before checksums (orbax's zarr v2 chunks, nothing
  checked);
* `zarr2+crc32`: what `save_checkpoint` writes now (zarr v2 chunks, the
  CRC-32 of every chunk in the manifest, checked on every restore);
* `zarr3+crc32c`: what f427531 wrote (zarr v3 with a crc32c codec per
  chunk, checked by TensorStore as it decodes).

Each round saves the formats from one process that builds the table once,
then restores each checkpoint in a process of its own (a target without
values, so the table is in memory once: 100M rows fit a 24 GiB machine),
and deletes it. The order of the formats rotates from round to round. The
table prints the median seconds, the bytes on disk and the load average
seen during the runs. Restores read what the save has just written, from
the page cache as far as memory allows.

`--deltas`: instead, delta checkpoints of a trainer built with
`track_touched=True`, in one process: per round a full save, then deltas
with 0.1%, 1% and 10% of the rows touched (drawn at random and set in the
trainer's touched-row bitmap, as its steps would set them); the median
seconds and bytes on disk of each against the full save's. A full save
of a trainer there needs about 1.6 times the table's bytes beside it (peak
RSS 16.2 GiB for 6.2 GiB of table and slots at 50M rows), so the 100M-row
table does not fit a 24 GiB machine.

Usage: python benchmarks/checkpoint.py [--rows 8000000] [--rounds 3]
  [--formats zarr2,zarr2+crc32,zarr3+crc32c] [--dir DIR] [--deltas]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

FORMATS = ("zarr2", "zarr2+crc32", "zarr3+crc32c")


def _bytes(path: str) -> int:
  return sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(path)
    for name in names
  )


@contextlib.contextmanager
def _format(name: str):
  """Within it, `save_checkpoint` writes format `name`."""
  import orbax.checkpoint as ocp
  from orbax.checkpoint._src.serialization import tensorstore_utils

  from pz_sparsecore.nn import checkpoint

  with contextlib.ExitStack() as stack:
    if name != "zarr2+crc32":  # No digests in the manifest.
      stack.enter_context(
        mock.patch.object(checkpoint, "chunk_digests", lambda *_: {})
      )
      stack.enter_context(
        mock.patch.object(checkpoint, "merged", lambda _: None)
      )
    if name == "zarr3+crc32c":
      handler = ocp.BasePyTreeCheckpointHandler
      build = tensorstore_utils._build_zarr3_metadata

      def zarr3(**kwargs):
        return handler(**{**kwargs, "use_zarr3": True})

      def checksummed(*args, **kwargs):
        metadata = build(*args, **kwargs)
        (sharding,) = metadata["codecs"]
        sharding["configuration"]["codecs"].append({"name": "crc32c"})
        return metadata

      stack.enter_context(
        mock.patch.object(ocp, "BasePyTreeCheckpointHandler", zarr3)
      )
      stack.enter_context(
        mock.patch.object(
          tensorstore_utils, "_build_zarr3_metadata", checksummed
        )
      )
    yield


def _features(rows: int, dim: int) -> dict:
  """The benchmark's one feature: a bfloat16 table with row-wise Adagrad."""
  import jax

  import pz_sparsecore as pzsc

  table = pzsc.TableSpec(
    name="items",
    vocabulary_size=rows,
    embedding_dim=dim,
    initializer=jax.nn.initializers.normal(0.01),
    optimizer=pzsc.RowwiseAdagradOptimizerSpec(learning_rate=0.05),
    combiner="mean",
    dtype="bfloat16",
  )
  feature = pzsc.FeatureSpec(
    name="items",
    table_spec=table,
    input_shape=(4096, 16),
    output_shape=(4096, dim),
  )
  return {"items": feature}


def _child(args: argparse.Namespace) -> None:
  """Saves every format (`--save`) or restores one (`--restore`); prints
  the seconds as JSON."""
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  import jax
  import numpy as np
  from jax.sharding import Mesh

  import pz_sparsecore as pzsc
  from pz_sparsecore.nn.tables import table_arrays

  def build(rng, rows=args.rows):
    return pzsc.SparseCoreEmbed.from_config(
      "embed", rng, _features(rows, args.dim), mesh, num_sc_per_device=8
    )

  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  out = {}
  if args.save:
    # The first save of a process sets orbax up: not timed.
    warm = os.path.join(args.dir, "warm-up")
    pzsc.save_checkpoint(warm, build(jax.random.key(0), rows=1024))
    shutil.rmtree(warm)
    embed = build(jax.random.key(0))
    jax.block_until_ready(table_arrays(embed))
    for name in args.formats.split(","):
      with _format(name):
        t0 = time.perf_counter()
        pzsc.save_checkpoint(os.path.join(args.dir, name), embed)
        out[name] = time.perf_counter() - t0
        out[f"{name} load"] = os.getloadavg()[0]
  else:
    target = build(None)
    t0 = time.perf_counter()
    restored = pzsc.restore_checkpoint(args.dir, target)
    jax.block_until_ready(table_arrays(restored))
    out["restore"] = time.perf_counter() - t0
    out["load"] = os.getloadavg()[0]
  print(json.dumps(out))


def _run(*argv: str) -> dict:
  result = subprocess.run(
    [sys.executable, __file__, *argv], capture_output=True, text=True
  )
  if result.returncode:
    raise RuntimeError(result.stderr[-4000:])
  return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=8_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--formats", default=",".join(FORMATS))
  parser.add_argument("--dir", default=None, help="where to write")
  parser.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--restore", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--deltas", action="store_true")
  parser.add_argument("--max-host-bytes", type=int, default=None)
  args = parser.parse_args()
  if args.save or args.restore:
    _child(args)
    return
  if args.deltas:
    os.environ.setdefault(
      "XLA_FLAGS", "--xla_force_host_platform_device_count=1"
    )
    _deltas(args)
    return

  formats = args.formats.split(",")
  size = ["--rows", str(args.rows), "--dim", str(args.dim)]
  root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
  times = {name: {"save": [], "restore": []} for name in formats}
  sizes, loads = {}, []
  try:
    for round_ in range(args.rounds):
      order = (
        formats[round_ % len(formats) :] + formats[: round_ % len(formats)]
      )
      saved = _run("--save", "--dir", root, "--formats", ",".join(order), *size)
      for name in order:
        times[name]["save"].append(saved[name])
        loads.append(saved[f"{name} load"])
        directory = os.path.join(root, name)
        sizes[name] = _bytes(directory)
        restored = _run("--restore", "--dir", directory, *size)
        times[name]["restore"].append(restored["restore"])
        loads.append(restored["load"])
        shutil.rmtree(directory)
        print(
          f"round {round_ + 1} {name}: save {saved[name]:.2f} s, restore "
          f"{restored['restore']:.2f} s, load {restored['load']:.1f}",
          flush=True,
        )
  finally:
    shutil.rmtree(root, ignore_errors=True)

  gib = args.rows * args.dim * 2 / 1024**3
  print(
    f"table {args.rows:,} x {args.dim} bfloat16 ({gib:.2f} GiB) + "
    f"row-wise Adagrad; median of {args.rounds} rounds; {os.cpu_count()} "
    f"CPUs, load {min(loads):.1f}-{max(loads):.1f}"
  )
  print(f"{'format':<14}{'save s':>9}{'restore s':>11}{'bytes on disk':>16}")
  for name in formats:
    save = statistics.median(times[name]["save"])
    restore = statistics.median(times[name]["restore"])
    print(f"{name:<14}{save:>9.2f}{restore:>11.2f}{sizes[name]:>16,}")


def _deltas(args) -> None:
  """Delta saves of 0.1%, 1% and 10% of the rows against a full save."""
  import jax
  import numpy as np
  import optax
  from jax.sharding import Mesh

  import pz_sparsecore as pzsc
  from pz_sparsecore.nn.tables import table_arrays

  def no_loss(**kwargs):
    raise NotImplementedError  # No steps: the bitmap is set directly.

  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed",
    jax.random.key(0),
    _features(args.rows, args.dim),
    mesh,
    num_sc_per_device=8,
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.0), no_loss, track_touched=True
  )
  jax.block_until_ready(table_arrays(embed))
  (label,) = trainer.touched.bitmaps
  bitmap = trainer.touched.bitmaps[label]
  rng = np.random.default_rng(0)
  fractions = (0.001, 0.01, 0.1)
  times = {name: [] for name in ("full", *fractions)}
  sizes = {}
  root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)

  def save(name, **kwargs):
    t0 = time.perf_counter()
    path = pzsc.save_checkpoint(
      root, trainer, keep=None, max_host_bytes=args.max_host_bytes, **kwargs
    )
    times[name].append(time.perf_counter() - t0)
    sizes[name] = _bytes(path)

  try:
    for _ in range(args.rounds):
      shutil.rmtree(root)
      save("full")
      for fraction in fractions:
        touched = np.zeros(bitmap.size, bool)
        touched[rng.choice(bitmap.size, int(fraction * bitmap.size))] = True
        trainer.touched.bitmaps[label] = jax.device_put(
          touched.reshape(bitmap.shape), bitmap.sharding
        )
        # A trainer's checkpoints are named by its step: one step a save.
        state = trainer.state.value
        trainer.state.value = type(state)(
          step=state.step + 1,
          opt_state=state.opt_state,
          loss_fn_state=state.loss_fn_state,
        )
        save(fraction, delta=True)
  finally:
    shutil.rmtree(root, ignore_errors=True)

  gib = args.rows * args.dim * 2 / 1024**3
  print(
    f"table {args.rows:,} x {args.dim} bfloat16 ({gib:.2f} GiB) + "
    f"row-wise Adagrad; median of {args.rounds} rounds; {os.cpu_count()} "
    f"CPUs, load {os.getloadavg()[0]:.1f}"
  )
  full = statistics.median(times["full"])
  print(
    f"{'save':<12}{'seconds':>9}{'bytes on disk':>16}{'faster':>8}"
    f"{'smaller':>9}"
  )
  for name, values in times.items():
    seconds = statistics.median(values)
    what = "full" if name == "full" else f"delta {name:.1%}"
    print(
      f"{what:<12}{seconds:>9.2f}{sizes[name]:>16,}"
      f"{full / seconds:>7.0f}x{sizes['full'] / sizes[name]:>8.0f}x"
    )


if __name__ == "__main__":
  main()
