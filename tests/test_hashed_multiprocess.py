"""Hashed tables: two processes x 4 CPU devices train exactly like one x 8.

`hashed_multiprocess_worker.py` trains two hashed tables (one evicting by
`lru`, one refusing with `none`) on the same global batches, each process
preprocessing its half of every batch; each process writes the whole of
every map (counters included), table and optimizer slot, and the
activations of every step, which must equal those of the one-process run
bit for bit. The loss, a sum over all devices, is the one value whose
order of summation differs (the collective's across processes).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import hashed_multiprocess_worker as worker
import numpy as np
import pytest

from pz_sparsecore.core.hashed import COUNTERS

# One worker runs every test of this module, so the module fixture (three
# processes) runs once per session, not once per worker.
pytestmark = pytest.mark.xdist_group("multiprocess")

ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(out_dir, num_processes: int, devices: int) -> list[dict]:
  """Runs the worker in `num_processes` processes of `devices` devices;
  returns each process's result."""
  port = _free_port()
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        worker.__file__,
        str(i),
        str(num_processes),
        str(port),
        str(out_dir),
        str(devices),
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
  results = []
  for i in range(num_processes):
    with np.load(out_dir / f"result_{i}.npz") as f:
      results.append(dict(f))
  return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  (single,) = _launch(tmp_path_factory.mktemp("single"), 1, 8)
  multi = _launch(tmp_path_factory.mktemp("multi"), 2, 4)
  return single, multi


def test_the_run_evicts_and_refuses(runs):
  single, _ = runs
  users = dict(zip(COUNTERS, single["users/counters"].sum(0), strict=True))
  items = dict(zip(COUNTERS, single["items/counters"].sum(0), strict=True))
  assert users["evicted"] > 0, users
  assert items["evicted"] == 0 and items["refused"] > 0, items
  # Every shard holds ids, so every process owns some of the map.
  for name in worker.TABLES:
    assert np.all(single[f"{name}/counters"][:, 0] > 0)
  assert not np.allclose(single["losses"][0], single["losses"][1:])


@pytest.mark.parametrize("process", [0, 1])
def test_two_processes_train_like_one_bit_for_bit(runs, process):
  single, multi = runs
  got = multi[process]
  assert sorted(got) == sorted(single)
  for key, want in single.items():
    if key == "losses":
      continue
    assert got[key].dtype == want.dtype, key
    np.testing.assert_array_equal(got[key], want, err_msg=key)


def test_losses_are_the_activations_times_their_gradients(runs):
  single, multi = runs
  want = [
    sum(
      np.sum(single[f"acts/{f}"][step].astype(np.float64) * g)
      for f, g in grads.items()
    )
    for step, (_, grads) in enumerate(worker.batches())
  ]
  for result in (single, *multi):
    np.testing.assert_allclose(result["losses"], want, rtol=1e-6, atol=1e-5)
