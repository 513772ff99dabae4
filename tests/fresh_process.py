"""Runs test code in a fresh Python process (state that starts once per
process: numba's threads, the allocator's first tables)."""

from __future__ import annotations

import subprocess
import sys


def run(code: str, env: dict[str, str], timeout: float = 300) -> str:
  """Runs `code` with `python -c` under `env`; returns its stdout, or fails
  the test with the end of its stderr."""
  done = subprocess.run(
    [sys.executable, "-c", code],
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout
