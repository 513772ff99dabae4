"""`python -m pz_sparsecore`: the package's command line.

One command per example model; today `shakespeare` (see
`pz_sparsecore.models.shakespeare_cli`)::

  python -m pz_sparsecore shakespeare --report reports/shakespeare
"""

from __future__ import annotations

import argparse
import sys

from pz_sparsecore.models import shakespeare_cli


def main(argv: list[str] | None = None) -> int:
  """Parses the command line and runs its command.

  Args:
    argv: The arguments after the program name; `sys.argv[1:]` when None.

  Returns:
    The process exit code (argument errors exit with status 2 directly).
  """
  parser = argparse.ArgumentParser(
    prog="python -m pz_sparsecore",
    description="SparseCore-style embeddings for Penzai.",
  )
  commands = parser.add_subparsers(dest="command", required=True)
  shakespeare_cli.add_parser(commands)
  args = parser.parse_args(argv)
  return args.run_command(parser, args)


if __name__ == "__main__":
  sys.exit(main())
