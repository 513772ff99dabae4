"""Every kind of program the layers build compiles and runs on this jax.

tests/programs_worker.py builds them one by one in a process of its own
(the lookup eagerly and jitted and its training, the many-table layer on one
device and over 8 with each exchange and 1 or 2 SparseCores, placed on a
2 x 4 mesh, a replicated table, minibatching, a checkpoint restored onto
another topology), so a crash inside XLA's compiler names the program that
caused it. `make test` runs it on the development environment's jax and
`make test-newest` on the newest one the ranges allow.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("programs_worker.py")


def test_every_program_compiles_and_runs():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    [sys.executable, str(WORKER)],
    capture_output=True,
    text=True,
    timeout=900,
    env=env,
  )
  lines = proc.stdout.splitlines()
  started = [ln[len("start ") :] for ln in lines if ln.startswith("start ")]
  done = [ln[len("done ") :] for ln in lines if ln.startswith("done ")]
  if proc.returncode != 0:
    crashed = started[len(done)] if len(started) > len(done) else None
    how = (
      f"killed by {signal.Signals(-proc.returncode).name}"
      if proc.returncode < 0
      else f"exit {proc.returncode}"
    )
    raise AssertionError(
      f"{how} while running {crashed!r} ({lines[0] if lines else ''}); "
      f"stderr tail:\n{proc.stderr[-3000:]}"
    )
  assert lines[-1] == "all programs ran"
  assert started == done
  assert len(done) == 12, done
