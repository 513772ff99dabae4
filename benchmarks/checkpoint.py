"""Checkpoint save and restore time, with and without chunk checksums.

One table (default 8M x 64 bfloat16 with row-wise Adagrad, 0.95 GiB + 31
MiB of slots; `--rows 100000000` is the 11.9 GiB table of
`benchmarks/large_table.py`) is saved and restored with
`pzsc.save_checkpoint` / `pzsc.restore_checkpoint` in these formats:

* `files+crc32`: what `save_checkpoint` writes now (the stack in zarr v2
  chunk files of its own, written and read a chunk at a time, the CRC-32
  of every chunk in the manifest, checked on every restore);
* `files`: the same without the CRC-32s (nothing checked);
* `orbax+crc32`: what 6cd1204 wrote (the stack among orbax's arrays, zarr
  v2 chunks in OCDBT files, the CRC-32s in the manifest). orbax holds a
  device's whole shard on the host beside the table at a save, and two
  copies at a restore: the 100M-row table runs out of memory on 24 GiB.

Each round saves the formats from one process that builds the table once,
then restores each checkpoint in a process of its own (a target without
values, so the table is in memory once), and deletes it. The order of the
formats rotates from round to round. The table prints the median seconds,
the bytes on disk, each process's peak resident memory beyond what it held
before the save or restore, and the load average seen during the runs.
`--cold` drops the page cache before every restore (needs root), so the
restores read from the disk.

`--deltas`: instead, delta checkpoints of a trainer built with
`track_touched=True`, in one process: per round a full save, then deltas
with 0.1%, 1% and 10% of the rows touched (drawn at random and set in the
trainer's touched-row bitmap, as its steps would set them); the median
seconds and bytes on disk of each against the full save's; then restores,
each in a process of its own, of the full checkpoint and of the chain of
the full checkpoint and its three deltas.

Usage: python benchmarks/checkpoint.py [--rows 8000000] [--rounds 3]
  [--formats files,files+crc32,orbax+crc32] [--dir DIR] [--cold]
  [--deltas]
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

FORMATS = ("files", "files+crc32", "orbax+crc32")


def _bytes(path: str) -> int:
  return sum(
    os.path.getsize(os.path.join(root, name))
    for root, _, names in os.walk(path)
    for name in names
  )


@contextlib.contextmanager
def _format(name: str):
  """Within it, `save_checkpoint` writes format `name`."""
  from pz_sparsecore.nn import checkpoint

  with contextlib.ExitStack() as stack:
    if name == "files":  # No digests in the manifest.
      stack.enter_context(
        mock.patch.object(checkpoint, "chunk_digests", lambda *_: {})
      )
      stack.enter_context(
        mock.patch.object(checkpoint, "merged", lambda _: None)
      )
    if name == "orbax+crc32":  # No table in the `tables` item.
      stack.enter_context(
        mock.patch.object(checkpoint, "stored_keys", lambda _: [])
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


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def _peak(out: dict, name: str):
  """Records in `out[name]` the peak resident bytes within it beyond the
  bytes resident at its start (sampled every 5 ms)."""
  import threading

  base, peak, done = _rss(), [0], threading.Event()

  def sample():
    while not done.wait(0.005):
      peak[0] = max(peak[0], _rss())

  thread = threading.Thread(target=sample, daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()
    out[name] = max(peak[0], _rss()) - base


def _drop_page_cache() -> None:
  os.sync()
  with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3\n")


def _child(args: argparse.Namespace) -> None:
  """Saves every format (`--save`) or restores one (`--restore`); prints
  the seconds and peak memory as JSON."""
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
      with _format(name), _peak(out, f"{name} peak"):
        t0 = time.perf_counter()
        pzsc.save_checkpoint(os.path.join(args.dir, name), embed)
        out[name] = time.perf_counter() - t0
      out[f"{name} load"] = os.getloadavg()[0]
  else:
    target = build(None)
    with _peak(out, "peak"):
      t0 = time.perf_counter()
      restored = pzsc.restore_checkpoint(args.dir, target, step=args.step)
      jax.block_until_ready(table_arrays(restored))
      out["restore"] = time.perf_counter() - t0
    out["load"] = os.getloadavg()[0]
  print(json.dumps(out))


def _run(*argv: str) -> dict:
  result = subprocess.run(
    [sys.executable, __file__, *argv], capture_output=True, text=True
  )
  if result.returncode:
    raise RuntimeError(
      f"{argv[0]} exited with {result.returncode}: {result.stderr[-4000:]}"
    )
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
  parser.add_argument("--cold", action="store_true")
  parser.add_argument("--step", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument(
    "--delta-saves", action="store_true", help=argparse.SUPPRESS
  )
  args = parser.parse_args()
  if args.save or args.restore:
    _child(args)
    return
  if args.delta_saves:
    os.environ.setdefault(
      "XLA_FLAGS", "--xla_force_host_platform_device_count=1"
    )
    _delta_saves(args)
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
  peaks = {name: {"save": [], "restore": []} for name in formats}
  sizes, loads = {}, []
  try:
    for round_ in range(args.rounds):
      order = (
        formats[round_ % len(formats) :] + formats[: round_ % len(formats)]
      )
      saved = _run("--save", "--dir", root, "--formats", ",".join(order), *size)
      for name in order:
        times[name]["save"].append(saved[name])
        peaks[name]["save"].append(saved[f"{name} peak"])
        loads.append(saved[f"{name} load"])
        directory = os.path.join(root, name)
        sizes[name] = _bytes(directory)
        if args.cold:
          _drop_page_cache()
        restored = _run("--restore", "--dir", directory, *size)
        times[name]["restore"].append(restored["restore"])
        peaks[name]["restore"].append(restored["peak"])
        loads.append(restored["load"])
        shutil.rmtree(directory)
        print(
          f"round {round_ + 1} {name}: save {saved[name]:.2f} s, restore "
          f"{restored['restore']:.2f} s, load {restored['load']:.1f}",
          flush=True,
        )
  finally:
    shutil.rmtree(root, ignore_errors=True)

  table = args.rows * args.dim * 2
  print(
    f"table {args.rows:,} x {args.dim} bfloat16 ({table / 2**30:.2f} GiB) + "
    f"row-wise Adagrad; median of {args.rounds} rounds; {os.cpu_count()} "
    f"CPUs, load {min(loads):.1f}-{max(loads):.1f}; restores "
    f"{'from the disk (page cache dropped)' if args.cold else 'as cached'}"
  )
  print(
    f"{'format':<13}{'save s':>8}{'restore s':>11}{'bytes on disk':>16}"
    f"{'save peak':>11}{'restore peak':>14}"
  )
  for name in formats:
    save = statistics.median(times[name]["save"])
    restore = statistics.median(times[name]["restore"])
    peak = {k: max(v) / table for k, v in peaks[name].items()}
    print(
      f"{name:<13}{save:>8.2f}{restore:>11.2f}{sizes[name]:>16,}"
      f"{peak['save']:>10.2f}x{peak['restore']:>13.2f}x"
    )
  print("peak: the most resident memory beyond the start's, in tables")


def _delta_saves(args) -> None:
  """In a process of its own: per round a full save into `--dir`, then
  deltas of 0.1%, 1% and 10% of the rows; prints the seconds and bytes
  on disk of each, and the step of the last round's full save, as JSON."""
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
  names = ["full", *(f"delta {f:.1%}" for f in _FRACTIONS)]
  out = {"seconds": {name: [] for name in names}, "bytes": {}}

  def save(name, **kwargs):
    # Each save starts with the disk's queue empty (not timed): else a
    # delta waits behind the previous full save's writes, which a training
    # loop's steps between saves would have outlasted.
    os.sync()
    time.sleep(1.0)
    t0 = time.perf_counter()
    path = pzsc.save_checkpoint(
      args.dir, trainer, keep=None, max_host_bytes=args.max_host_bytes, **kwargs
    )
    out["seconds"][name].append(time.perf_counter() - t0)
    out["bytes"][name] = _bytes(path)

  for _ in range(args.rounds):
    for entry in os.listdir(args.dir):
      shutil.rmtree(os.path.join(args.dir, entry))
    save("full")
    out["base"] = int(trainer.state.value.step)
    for name, fraction in zip(names[1:], _FRACTIONS, strict=True):
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
      save(name, delta=True)
  print(json.dumps(out))


_FRACTIONS = (0.001, 0.01, 0.1)


def _deltas(args) -> None:
  """Delta saves against a full save (`_delta_saves`, in a process of its
  own), then restores of the last round's full checkpoint and of its
  chain, each in a process of its own."""
  root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
  size = ["--rows", str(args.rows), "--dim", str(args.dim)]
  cap = []
  if args.max_host_bytes is not None:
    cap = ["--max-host-bytes", str(args.max_host_bytes)]
  rounds = ["--rounds", str(args.rounds)]
  restores = {"full": [], "full + 3 deltas": []}
  peaks = {name: [] for name in restores}
  try:
    saved = _run("--delta-saves", "--dir", root, *size, *rounds, *cap)
    for _ in range(args.rounds):
      for name, step in (
        ("full", ["--step", str(saved["base"])]),
        ("full + 3 deltas", []),
      ):
        if args.cold:
          _drop_page_cache()
        restored = _run("--restore", "--dir", root, *step, *size)
        restores[name].append(restored["restore"])
        peaks[name].append(restored["peak"])
  finally:
    shutil.rmtree(root, ignore_errors=True)

  gib = args.rows * args.dim * 2 / 1024**3
  print(
    f"table {args.rows:,} x {args.dim} bfloat16 ({gib:.2f} GiB) + "
    f"row-wise Adagrad; median of {args.rounds} rounds; {os.cpu_count()} "
    f"CPUs, load {os.getloadavg()[0]:.1f}; restores "
    f"{'from the disk (page cache dropped)' if args.cold else 'as cached'}"
  )
  seconds, sizes = saved["seconds"], saved["bytes"]
  full = statistics.median(seconds["full"])
  print(
    f"{'save':<12}{'seconds':>9}{'bytes on disk':>16}{'faster':>8}"
    f"{'smaller':>9}"
  )
  for name, values in seconds.items():
    median = statistics.median(values)
    print(
      f"{name:<12}{median:>9.2f}{sizes[name]:>16,}"
      f"{full / median:>7.0f}x{sizes['full'] / sizes[name]:>8.0f}x"
    )
  table = args.rows * args.dim * 2
  print(f"{'restore':<16}{'seconds':>9}{'peak':>7}")
  for name, values in restores.items():
    peak = max(peaks[name]) / table
    print(f"{name:<16}{statistics.median(values):>9.2f}{peak:>6.2f}x")


if __name__ == "__main__":
  main()
