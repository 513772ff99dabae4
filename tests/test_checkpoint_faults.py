"""A checkpoint writer killed at random points leaves a restorable state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pz_sparsecore as pzsc

sys.path.insert(0, os.path.dirname(__file__))
import checkpoint_writer  # noqa: E402

WRITER = os.path.join(os.path.dirname(__file__), "checkpoint_writer.py")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_killed_writer_leaves_a_restorable_checkpoint(tmp_path, seed):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(
    [sys.executable, WRITER, str(tmp_path)],
    stdout=subprocess.PIPE,
    text=True,
    env=env,
  )
  try:
    assert proc.stdout.readline().startswith("saved 0")
    time.sleep(np.random.default_rng(seed).uniform(0.05, 1.5))
    proc.send_signal(signal.SIGKILL)
    rest = proc.communicate(timeout=60)[0]
  finally:
    proc.kill()
  saved = [0] + [int(line.split()[1]) for line in rest.splitlines()]
  embed = checkpoint_writer.build(None)
  embed = pzsc.restore_checkpoint(tmp_path, embed)
  values = np.unique(pzsc.logical_tables(embed)["t"])
  assert len(values) == 1
  # The newest complete save, or the one in flight if its rename landed.
  assert saved[-1] <= values[0] <= saved[-1] + 1
  leftovers = [p for p in os.listdir(tmp_path) if p.startswith("ckpt_")]
  assert len(leftovers) <= 2
