"""Two processes agree on checkpoints, and a failure on one reaches both.

2 processes x 4 CPU devices (`checkpoint_multiprocess_worker.py`): a
lagging view of the directory is refused on both, naming both steps; a
damaged shard file seen by one process, and a save whose writes fail on
one, fail both within seconds, the peer with a `PeerError` naming the
failing process and its cause; after each, the next restore or save works
on both. A peer killed during training ends the survivor within the
heartbeat timeout (`docs/multihost.md`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.xdist_group("multiprocess")

WORKER = os.path.join(
  os.path.dirname(__file__), "checkpoint_multiprocess_worker.py"
)
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
PROPAGATION_S = 30
"""The most seconds a failure on one process may take to reach the other."""
HEARTBEAT_S = 5
"""JAX's heartbeat timeout in the kill test (its default is 100 s)."""
TERMINATING = (
  "Terminating process because the JAX distributed service detected fatal "
  "errors"
)


def _port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _start(mode: str, out, *extra: str) -> list[subprocess.Popen]:
  port = _port()
  return [
    subprocess.Popen(
      [sys.executable, WORKER, mode, str(i), str(port), str(out), *extra],
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=ENV,
    )
    for i in range(2)
  ]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
  """Each process's record, output, exit code and exit time."""
  out = tmp_path_factory.mktemp("faults")
  procs = _start("faults", out)
  results = []
  try:
    for proc in procs:
      output = proc.communicate(timeout=240)[0]
      results.append((output, proc.returncode, time.time()))
  finally:
    for proc in procs:
      proc.kill()
  records = []
  for i, (output, _, _) in enumerate(results):
    path = out / f"faults_{i}.json"
    assert path.exists(), output[-4000:]
    records.append(json.loads(path.read_text()))
  return records, results


def test_different_views_are_refused_on_both(faults):
  records, _ = faults
  for record in records:
    error = record["views"]["error"]
    assert error.startswith("ValueError"), error
    assert "process 0 sees step 1, process 1 sees step 0" in error, error
    # The next action: both restore the shared directory.
    assert record["views_next"]["ok"] == 2


def test_damaged_shard_on_one_process_fails_both(faults):
  records, _ = faults
  own = records[1]["damaged"]["error"]
  assert own.startswith("ValueError") and "truncated data" in own, own
  assert f"{os.sep}tables{os.sep}" in own, own
  peer = records[0]["damaged"]["error"]
  assert peer.startswith("PeerError") and "on process 1 of 2" in peer, peer
  assert own.split(": ", 1)[1] in peer, peer
  for record in records:
    assert record["damaged"]["seconds"] < PROPAGATION_S
    assert record["damaged_next"]["ok"] == 2


def test_failed_write_on_one_process_fails_the_save_on_both(faults):
  records, _ = faults
  assert records[1]["save"]["error"] == "OSError: disk full (injected)"
  peer = records[0]["save"]["error"]
  assert peer.startswith("PeerError") and "on process 1 of 2" in peer, peer
  assert "disk full (injected)" in peer, peer
  for record in records:
    assert record["save"]["seconds"] < PROPAGATION_S
    # Nothing committed; the next save and restore work.
    assert "2" not in record["save_left"], record["save_left"]
    assert record["save_next"]["ok"] == 4


def test_uncaught_failure_ends_both_processes(faults):
  _, results = faults
  for i, (output, returncode, ended) in enumerate(results):
    assert returncode == 1, output[-4000:]
    start, after = output.split("uncaught at ")[1].split(maxsplit=1)
    expected = "\nValueError: " if i == 1 else "PeerError: restore_checkpoint("
    assert expected in after, output[-4000:]
    start = float(start)
    assert ended - start < PROPAGATION_S, output[-4000:]


def test_a_delta_saves_and_restores_on_two_processes(tmp_path):
  procs = _start("deltas", tmp_path)
  try:
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
  for i, output in enumerate(outputs):
    path = tmp_path / f"deltas_{i}.json"
    assert path.exists(), output[-4000:]
    record = json.loads(path.read_text())
    assert record == {"listed": [[0, None], [1, 0]], "restored": 2}


def test_killed_peer_ends_the_survivor(tmp_path):
  survivor, victim = _start("train", tmp_path, str(HEARTBEAT_S))
  try:
    for line in victim.stdout:
      if line.startswith("step 5"):
        break
    victim.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    output = survivor.communicate(timeout=120)[0]
    elapsed = time.monotonic() - killed
  finally:
    survivor.kill()
    victim.kill()
  # JAX's coordination service finds the missed heartbeats and aborts the
  # survivor (no Python exception can be raised: it waits in a collective).
  assert survivor.returncode == -signal.SIGABRT, output[-4000:]
  assert TERMINATING in output and "stopped sending heartbeats" in output
  assert elapsed < HEARTBEAT_S + 10, elapsed
