"""Two processes x 4 CPU devices train exactly like one process x 8."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import pz_sparsecore as pzsc

# One worker runs every test of this module, so the module fixture (three
# processes, about a minute) runs once per session, not once per worker.
pytestmark = pytest.mark.xdist_group("multiprocess")

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(
  out_dir,
  num_processes: int,
  devices: int,
  exchange: str = "activations",
  mesh: str = "8",
  minibatching: bool = False,
) -> None:
  port = _free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        WORKER,
        str(i),
        str(num_processes),
        str(port),
        str(out_dir),
        str(devices),
        exchange,
        mesh,
        "1" if minibatching else "0",
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=ENV,
    )
    for i in range(num_processes)
  ]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=240)[0])
  finally:
    for proc in procs:
      proc.kill()
  for proc, output in zip(procs, outputs, strict=True):
    assert proc.returncode == 0, output[-4000:]


# Two processes x 4 devices: the activation exchange on a one-axis mesh,
# the row exchange with the tables and batch over both axes of a 2 x 4
# ("data", "model") mesh, and minibatches (limits of 3 ids per partition,
# the split agreed through JAX's collectives) equal to the unsplit steps.
MULTI = {
  "activations": ("activations", "8", False),
  "rows, mesh 2x4": ("rows", "2x4", False),
  "minibatches": ("activations", "8", True),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  single = tmp_path_factory.mktemp("single")
  _launch(single, 1, 8)
  multi = {}
  for name, (exchange, mesh, minibatching) in MULTI.items():
    multi[name] = tmp_path_factory.mktemp("multi")
    _launch(multi[name], 2, 4, exchange, mesh, minibatching)
  return single, multi


@pytest.mark.parametrize("run", list(MULTI))
def test_losses_and_tables_match_one_process(runs, run):
  single, multi = runs
  a = np.load(single / "result.npz")
  b = np.load(multi[run] / "result.npz")
  np.testing.assert_allclose(a["losses"], b["losses"], rtol=1e-5)
  np.testing.assert_allclose(a["table"], b["table"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    a["accumulator"], b["accumulator"], rtol=1e-5, atol=1e-6
  )
  assert not np.allclose(a["losses"][0], a["losses"][-1])
  # Then a short batch of 22 samples, 11 from each process.
  np.testing.assert_allclose(a["short_loss"], b["short_loss"], rtol=1e-5)
  np.testing.assert_allclose(
    a["short_table"], b["short_table"], rtol=1e-5, atol=1e-6
  )
  assert not np.allclose(a["short_table"], a["table"])


def test_fdo_merges_both_processes(runs):
  multi = runs[1]["activations"]
  loaded = pzsc.NPZFileFDOClient(multi / "fdo", run_id="mp-test").load()
  local = [np.load(multi / f"stats_{i}.npz") for i in range(2)]
  for field in ("max_ids_per_partition", "max_unique_ids_per_partition"):
    expected = np.maximum(local[0][field], local[1][field])
    np.testing.assert_array_equal(getattr(loaded, field)["words"], expected)


def test_checkpoint_from_two_processes_restores_on_one(runs):
  import jax
  import optax
  from jax.sharding import Mesh

  from pz_sparsecore.models import shakespeare

  multi = runs[1]["activations"]
  (step,) = os.listdir(multi / "ckpt")
  # Each process wrote its own shards.
  arrays = sorted(os.listdir(multi / "ckpt" / step / "arrays"))
  assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(arrays), arrays
  expected = np.load(multi / "result.npz")
  np.testing.assert_array_equal(expected["restored_table"], expected["table"])
  mesh = Mesh(np.array(jax.devices()[:4]), ("device",))
  model = shakespeare.build_model(
    jax.random.key(7),
    mesh,
    vocab_size=512,
    seq_len=4,
    batch_size=64,
    embedding_dim=16,
    hidden=32,
    optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.3),
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(9), model, optax.adam(1e-2), shakespeare.loss_fn
  )
  trainer = pzsc.restore_checkpoint(multi / "ckpt", trainer)
  assert int(trainer.state.value.step) == 5
  np.testing.assert_array_equal(
    jax.random.key_data(trainer.root_rng),
    jax.random.key_data(jax.random.key(1)),
  )
  np.testing.assert_array_equal(
    pzsc.logical_tables(trainer.model.embed)["words"], expected["table"]
  )
  np.testing.assert_array_equal(
    pzsc.logical_slots(trainer.model.embed)["words"]["accumulator"],
    expected["accumulator"],
  )
