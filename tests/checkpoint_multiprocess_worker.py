"""One of 2 processes meeting checkpoint faults (launched by the tests).

Usage: python checkpoint_multiprocess_worker.py MODE PROCESS_ID PORT OUT_DIR

MODE "faults": the processes save versions 1 and 2 of a layer (steps 0
and 1) into OUT_DIR/shared, then, each step recorded in
OUT_DIR/faults_<process>.json:

* views: each restores its own copy of the directory, process 1's without
  step 1 (a lagging view);
* damaged: each restores its own copy, process 1's with its shards' data
  files truncated;
* save: a save whose writes fail on process 1 only;
* after each, the user's next action (restore from OUT_DIR/shared, or
  save again and restore) on both;
* finally the damaged restore again, uncaught: the process exits with it.

MODE "deltas": a trainer that tracks its rows saves a full checkpoint
(version 1, step 0) and a delta (version 2, every row touched, step 1)
into OUT_DIR/deltas; OUT_DIR/deltas_<process>.json records the listing
and the version a layer restores.

MODE "train": trains in a loop (a step with a collective over both
processes), printing `step <n>`, with JAX's heartbeat timeout of
HEARTBEAT seconds (argument 5); the test kills one process.
"""

from __future__ import annotations

import faulthandler
import glob
import json
import os
import shutil
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import checkpoint_writer  # noqa: E402
from checkpoint_writer import set_version, version  # noqa: E402


def build(rng):
  """checkpoint_writer's layer over every process's devices."""
  return checkpoint_writer.build(rng, devices=len(jax.devices()))


def attempt(record: dict, name: str, fn) -> None:
  """Runs `fn`, recording its error (type and message) and time."""
  start = time.monotonic()
  try:
    result = fn()
    record[name] = {"ok": result}
  except Exception as e:
    record[name] = {"error": f"{type(e).__name__}: {e}"}
  record[name]["seconds"] = time.monotonic() - start


def damage(directory: str, embed) -> None:
  """Truncates the chunk files of the table and slot shards this process
  holds in checkpoint `directory`."""
  from pz_sparsecore.nn.tables import table_arrays

  held = set()
  for table in table_arrays(embed).values():
    for shard in table.addressable_shards:
      held.update(range(*shard.index[0].indices(table.shape[0])[:2]))
  for folder in glob.glob(os.path.join(directory, "tables", "*", "")):
    with open(os.path.join(folder, ".zarray")) as f:
      rows = json.load(f)["chunks"][0]
    for name in os.listdir(folder):
      if not name.startswith(".") and int(name.split(".")[0]) * rows in held:
        with open(os.path.join(folder, name), "r+b") as f:
          f.truncate(16)


def faults(process: int, out: str) -> None:
  import pz_sparsecore as pzsc
  from pz_sparsecore.nn import _ckpt_tables

  shared = os.path.join(out, "shared")
  embed = build(jax.random.key(0))
  for k in (1, 2):
    set_version(embed, k)
    pzsc.save_checkpoint(shared, embed, keep=None)
  record: dict = {}

  def restore(directory):
    return version(pzsc.restore_checkpoint(directory, build(None)))

  # A lagging view: process 1 does not see step 1 yet.
  view = os.path.join(out, f"view_{process}")
  shutil.copytree(shared, view)
  if process == 1:
    shutil.rmtree(os.path.join(view, "1"))
  attempt(record, "views", lambda: restore(view))
  attempt(record, "views_next", lambda: restore(shared))

  # Process 1's copy has damaged shards.
  damaged = os.path.join(out, f"damaged_{process}")
  shutil.copytree(shared, damaged)
  if process == 1:
    damage(os.path.join(damaged, "1"), embed)
  attempt(record, "damaged", lambda: restore(damaged))
  attempt(record, "damaged_next", lambda: restore(shared))

  # A save whose writes fail on process 1 only.
  original = _ckpt_tables._write_chunk

  def failing(job):
    if process == 1:
      raise OSError("disk full (injected)")
    return original(job)

  set_version(embed, 3)
  _ckpt_tables._write_chunk = failing
  attempt(record, "save", lambda: pzsc.save_checkpoint(shared, embed))
  _ckpt_tables._write_chunk = original
  record["save_left"] = sorted(os.listdir(shared))

  def save_and_restore():
    set_version(embed, 4)
    pzsc.save_checkpoint(shared, embed)
    return restore(shared)

  attempt(record, "save_next", save_and_restore)
  with open(os.path.join(out, f"faults_{process}.json"), "w") as f:
    json.dump(record, f)
  print(f"uncaught at {time.time()}", flush=True)
  restore(damaged)


def deltas(process: int, out: str) -> None:
  import optax

  import pz_sparsecore as pzsc

  def no_loss(**kwargs):
    raise NotImplementedError  # No steps: the bitmap is set directly.

  directory = os.path.join(out, "deltas")
  embed = build(jax.random.key(0))
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(1), embed, optax.sgd(0.0), no_loss, track_touched=True
  )
  set_version(embed, 1)
  pzsc.save_checkpoint(directory, trainer)
  set_version(embed, 2)
  (label,) = trainer.touched.bitmaps
  # Every row touched, as steps would mark them.
  touched = jax.jit(jax.numpy.logical_not)(trainer.touched.bitmaps[label])
  trainer.touched.bitmaps[label] = touched
  state = trainer.state.value
  trainer.state.value = type(state)(
    step=state.step + 1,
    opt_state=state.opt_state,
    loss_fn_state=state.loss_fn_state,
  )
  pzsc.save_checkpoint(directory, trainer, delta=True)
  record = {
    "listed": [[i.step, i.base] for i in pzsc.list_checkpoints(directory)],
    "restored": version(pzsc.restore_checkpoint(directory, build(None))),
  }
  with open(os.path.join(out, f"deltas_{process}.json"), "w") as f:
    json.dump(record, f)


def train(process: int) -> None:
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("device",))
  sharding = NamedSharding(mesh, P("device"))
  x = jax.make_array_from_process_local_data(
    sharding, np.ones((4, 16), np.float32), (8, 16)
  )

  @jax.jit
  def step(x):
    # Every process's rows meet in the sum: a collective each step.
    return x * 0.5 + jnp.sum(x) / x.size

  for n in range(1_000_000):
    x = step(x)
    float(jnp.sum(x))
    print(f"step {n}", flush=True)
    time.sleep(0.05)


def main() -> None:
  mode = sys.argv[1]
  process, port = int(sys.argv[2]), int(sys.argv[3])
  out = sys.argv[4]
  heartbeat = int(sys.argv[5]) if len(sys.argv) > 5 else 100
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"localhost:{port}",
    num_processes=2,
    process_id=process,
    heartbeat_timeout_seconds=heartbeat,
  )
  if mode == "faults":
    # A hang shows where each process waits (the run takes seconds).
    faulthandler.dump_traceback_later(90, exit=True)
    faults(process, out)
  elif mode == "deltas":
    faulthandler.dump_traceback_later(90, exit=True)
    deltas(process, out)
  else:
    train(process)


if __name__ == "__main__":
  main()
