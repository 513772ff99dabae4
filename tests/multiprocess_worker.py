"""One process of a multi-process training run (launched by the tests).

Usage: python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR
  [DEVICES_PER_PROCESS [EXCHANGE [MESH [MINIBATCH]]]]

MESH is "8" (one axis "device", the default) or e.g. "2x4" (axes "data"
and "model"; the tables and the batch over both). MINIBATCH "1" lowers the
limits to 3 ids per partition and preprocesses with minibatching, the
processes agreeing on the split through JAX's collectives.

Every process builds the same model on a mesh over all global devices,
preprocesses only its own share of each global batch, trains a few steps and
records its FDO stats, saves the trainer and restores the checkpoint into a
fresh model; process 0 writes the losses, the final logical tables and the
restored one.
"""

from __future__ import annotations

import functools
import os
import sys


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  out_dir = sys.argv[4]
  per_process = int(sys.argv[5]) if len(sys.argv) > 5 else 4
  exchange = sys.argv[6] if len(sys.argv) > 6 else "auto"
  mesh_shape = sys.argv[7] if len(sys.argv) > 7 else None
  minibatching = len(sys.argv) > 8 and sys.argv[8] == "1"
  os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={per_process}"
  )
  import jax

  if num_processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      f"localhost:{port}",
      num_processes=num_processes,
      process_id=process_id,
    )
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  from penzai import pz

  import pz_sparsecore as pzsc
  from pz_sparsecore.models import shakespeare

  batch, seq, vocab = 64, 4, 512
  if mesh_shape and "x" in mesh_shape:
    shape = tuple(int(x) for x in mesh_shape.split("x"))
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
  else:
    mesh = Mesh(np.array(jax.devices()), ("device",))
  batch_axes = tuple(mesh.axis_names)
  build = functools.partial(
    shakespeare.build_model,
    mesh=mesh,
    vocab_size=vocab,
    seq_len=seq,
    batch_size=batch,
    embedding_dim=16,
    hidden=32,
    optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.3),
    exchange=exchange,
  )
  model = build(jax.random.key(0))
  stack = model.embed.config.plan.stacks[0]
  used = model.embed.config.topology.exchange_of(stack).mode
  if exchange != "auto" and used != exchange:
    raise SystemExit(f"asked for the {exchange} exchange, got {used}")
  replicated = NamedSharding(mesh, P())
  for param in pz.unbind_params(model.body)[1]:
    param.value = jax.tree.map(
      lambda x: jax.device_put(x, replicated), param.value
    )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.wrap_key_data(
      jax.device_put(
        np.asarray(jax.random.key_data(jax.random.key(1))), replicated
      )
    ),
    model,
    optax.adam(1e-2),
    shakespeare.loss_fn,
  )
  if minibatching:
    limits = {"words": np.full(8, 3, np.int32)}
    trainer = pzsc.update_limits(
      trainer,
      pzsc.SparseDenseMatmulInputStats(
        max_ids_per_partition=limits, max_unique_ids_per_partition=limits
      ),
    )
  fdo = pzsc.NPZFileFDOClient(os.path.join(out_dir, "fdo"), run_id="mp-test")
  rng = np.random.default_rng(0)
  local = batch // num_processes
  rows = slice(process_id * local, (process_id + 1) * local)
  losses = []
  seen: dict[str, list] = {}
  for step in range(5):
    context = rng.integers(0, vocab, (batch, seq))
    labels = rng.integers(0, vocab, (batch,)).astype(np.int32)
    inputs, stats = trainer.model.embed.preprocess(
      {shakespeare.FEATURE: context[rows]},
      batch_number=step,
      enable_minibatching=minibatching,
    )
    if minibatching and int(np.max(inputs.num_minibatches)) < 2:
      raise SystemExit(f"step {step}: the batch did not split")
    fdo.record(stats)
    for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
      seen.setdefault(field, []).append(getattr(stats, field)["words"])
    labels = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P(batch_axes)), labels[rows], (batch,)
    )
    aux = trainer.step(inputs=inputs, labels=labels)
    losses.append(float(jax.device_get(aux["loss"])))
  fdo.publish()
  local_max = {
    field: np.max(np.stack([np.asarray(r) for r in records]), axis=0)
    for field, records in seen.items()
  }
  np.savez(os.path.join(out_dir, f"stats_{process_id}.npz"), **local_max)
  # Every process writes its own shards; then all read them back into a
  # model built with variable slots.
  pzsc.save_checkpoint(os.path.join(out_dir, "ckpt"), trainer)
  restored = pzsc.restore_checkpoint(os.path.join(out_dir, "ckpt"), build(None))
  tables = pzsc.logical_tables(trainer.model.embed)
  slots = pzsc.logical_slots(trainer.model.embed)
  restored_tables = pzsc.logical_tables(restored.embed)
  # A short batch (22 of the specs' 64 samples, each process its share):
  # the layer pads it to its bucket and the loss sees the 22.
  short = 22
  context = rng.integers(0, vocab, (short, seq))
  labels = rng.integers(0, vocab, (short,)).astype(np.int32)
  mine = slice(
    process_id * short // num_processes,
    (process_id + 1) * short // num_processes,
  )
  inputs, _ = trainer.model.embed.preprocess(
    {shakespeare.FEATURE: context[mine]}, enable_minibatching=minibatching
  )
  short_loss = float(
    jax.device_get(trainer.step(inputs=inputs, labels=labels)["loss"])
  )
  short_table = pzsc.logical_tables(trainer.model.embed)[shakespeare.TABLE]
  if process_id == 0:
    np.savez(
      os.path.join(out_dir, "result.npz"),
      losses=np.asarray(losses),
      table=tables[shakespeare.TABLE],
      accumulator=slots[shakespeare.TABLE]["accumulator"],
      restored_table=restored_tables[shakespeare.TABLE],
      short_loss=short_loss,
      short_table=short_table,
    )
  del jnp


if __name__ == "__main__":
  main()
