"""Accuracy of 16-bit tables: the Shakespeare example in five settings.

Runs ``python -m pz_sparsecore shakespeare`` (400 steps, 8 virtual CPU
devices, the example's defaults) with float32 tables and Adagrad (the
reference), then row-wise Adagrad with float32, bfloat16 and float16
tables, and Adagrad with bfloat16 tables; prints each run's held-out loss
and its difference from the reference (goal: within 0.02 nats), the
median step and the table's bytes per row (64 wide).

Run: ``.venv/bin/python benchmarks/table_dtypes.py [--steps 400]``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

SETTINGS = (
  ("adagrad", "float32"),
  ("rowwise_adagrad", "float32"),
  ("rowwise_adagrad", "bfloat16"),
  ("rowwise_adagrad", "float16"),
  ("adagrad", "bfloat16"),
)
DIM = 64


def bytes_per_row(optimizer: str, dtype: str) -> int:
  """A 64-wide row and its slots."""
  table = DIM * (4 if dtype == "float32" else 2)
  return table + (4 * DIM if optimizer == "adagrad" else 4)


def run(optimizer: str, dtype: str, steps: int) -> dict[str, float]:
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "pz_sparsecore",
      "shakespeare",
      "--optimizer",
      optimizer,
      "--table-dtype",
      dtype,
      "--steps",
      str(steps),
      "--no-progress",
    ],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  loss = re.search(r"held-out loss ([0-9.]+) nats", out)
  step = re.search(r"median step ([0-9.]+) ms", out)
  if loss is None or step is None:
    raise RuntimeError(f"unexpected output of the example:\n{out}")
  return {"loss": float(loss.group(1)), "step_ms": float(step.group(1))}


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=400)
  args = parser.parse_args()
  results = {s: run(*s, args.steps) for s in SETTINGS}
  reference = results[SETTINGS[0]]["loss"]
  print(
    f"Shakespeare, {args.steps} steps; load average "
    f"{os.getloadavg()[0]:.1f} at the end"
  )
  print(
    "| optimizer | table | bytes/row | held-out loss | vs float32 Adagrad "
    "| step ms |"
  )
  print("|---|---|---|---|---|---|")
  for (optimizer, dtype), r in results.items():
    diff = r["loss"] - reference
    print(
      f"| {optimizer} | {dtype} | {bytes_per_row(optimizer, dtype)} | "
      f"{r['loss']:.3f} | {diff:+.3f} "
      f"({'within' if abs(diff) <= 0.02 else 'outside'} 0.02) | "
      f"{r['step_ms']:.1f} |"
    )


if __name__ == "__main__":
  main()
