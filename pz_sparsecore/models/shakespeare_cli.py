"""The `shakespeare` command: `python -m pz_sparsecore shakespeare [options]`.

Trains the Shakespeare next-word model on a mesh of devices (every GPU JAX
sees, else 8 virtual CPU devices) and optionally writes an HTML report
(`shakespeare_report`). JAX is imported only after `--devices` is read, so
that it can set the number of virtual CPU devices.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from pz_sparsecore.models.shakespeare_config import (
  OPTIMIZER_NAMES,
  TABLE_DTYPE_NAMES,
  RunConfig,
)


def add_parser(commands: Any) -> argparse.ArgumentParser:
  """Adds the `shakespeare` command to a parser's subcommands.

  Args:
    commands: What `ArgumentParser.add_subparsers` returned.

  Returns:
    The command's parser; parsed arguments carry `main` as `run_command`.
  """
  shakespeare = commands.add_parser(
    "shakespeare",
    help="train a next-word model on Shakespeare with a sharded embedding",
  )
  defaults = RunConfig()
  shakespeare.add_argument(
    "--devices",
    type=int,
    default=None,
    help="devices of the mesh (default: every GPU JAX sees, else "
    f"{defaults.devices} virtual CPU devices)",
  )
  shakespeare.add_argument(
    "--sc-per-device", type=int, default=defaults.sc_per_device
  )
  shakespeare.add_argument("--steps", type=int, default=defaults.steps)
  shakespeare.add_argument("--vocab", type=int, default=defaults.vocab)
  shakespeare.add_argument("--seq-len", type=int, default=defaults.seq_len)
  shakespeare.add_argument(
    "--batch-size", type=int, default=defaults.batch_size
  )
  shakespeare.add_argument(
    "--optimizer", choices=OPTIMIZER_NAMES, default=defaults.optimizer
  )
  shakespeare.add_argument(
    "--table-dtype",
    choices=TABLE_DTYPE_NAMES,
    default=defaults.table_dtype,
    help="how the table's rows are stored (16-bit: stochastic rounding on "
    "update)",
  )
  shakespeare.add_argument(
    "--fdo-every",
    type=int,
    default=defaults.fdo_every,
    help="refresh the preprocessing limits from FDO stats every K steps "
    "(0: never)",
  )
  shakespeare.add_argument("--seed", type=int, default=defaults.seed)
  shakespeare.add_argument("--report", metavar="DIR", default=None)
  shakespeare.add_argument(
    "--no-progress", action="store_true", help="hide the progress bar"
  )
  shakespeare.set_defaults(run_command=main)
  return shakespeare


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  positive = ("devices", "sc_per_device", "steps", "seq_len", "batch_size")
  for name in positive:
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1")
  if args.vocab < 2:
    parser.error("--vocab must be at least 2")
  if args.fdo_every < 0:
    parser.error("--fdo-every must be 0 (off) or positive")
  shards = args.devices * args.sc_per_device
  if shards & (shards - 1):
    parser.error(
      f"--devices x --sc-per-device must be a power of two, got {shards}"
    )
  if (args.batch_size * args.seq_len) % shards:
    parser.error(
      f"--batch-size x --seq-len ({args.batch_size * args.seq_len}) must "
      f"divide over {shards} shards"
    )
  if args.batch_size % args.devices:
    parser.error(
      f"--batch-size {args.batch_size} must divide over {args.devices} devices"
    )


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
  """Runs the command on parsed arguments.

  Args:
    parser: The parser that read `args` (argument errors go through it and
      exit with status 2).
    args: The parsed arguments.

  Returns:
    The process exit code: 0, or 1 if the run failed (the reason is printed
    to stderr).
  """
  cpu_devices = args.devices or RunConfig().devices
  flag = f"--xla_force_host_platform_device_count={cpu_devices}"
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
  import jax

  if args.devices is None:
    gpu = jax.default_backend() != "cpu"
    args.devices = jax.device_count() if gpu else cpu_devices
  _check(parser, args)

  from pz_sparsecore.models import shakespeare

  config = RunConfig(
    devices=args.devices,
    sc_per_device=args.sc_per_device,
    steps=args.steps,
    vocab=args.vocab,
    seq_len=args.seq_len,
    batch_size=args.batch_size,
    optimizer=args.optimizer,
    table_dtype=args.table_dtype,
    fdo_every=args.fdo_every,
    seed=args.seed,
  )
  with tempfile.TemporaryDirectory() as scratch:
    fdo_dir = os.path.join(args.report, "fdo") if args.report else scratch
    try:
      result = shakespeare.run(
        config, fdo_dir=fdo_dir, progress=not args.no_progress
      )
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 1
  print(shakespeare.summary(result))
  if args.report:
    from pz_sparsecore.models import shakespeare_report

    path = shakespeare_report.write_report(args.report, result)
    print(f"report: {path}")
  return 0
