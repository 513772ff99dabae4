"""Runs jax-tpu-embedding's own host-API tests against `pz_sparsecore.compat`.

The tests come from a checkout of jax-tpu-embedding (the commit the compat
namespace follows, 566086d): they are copied to a temporary folder, their
imports of `jax_tpu_embedding.sparsecore` rewritten to `pz_sparsecore.compat`
(their own test helpers keep pointing at the copies), and run by pytest on 8
virtual CPU devices, except the files of `DEVICE_COUNTS`, each run on the
device count its batches were written for. Nothing of upstream is imported.

  python benchmarks/upstream_tests.py --upstream ~/src/jax-tpu-embedding

prints, per test file, the items collected, passed and failed, then every
failing item with the last line of its error. `--list-failures` prints only
those names; `-k EXPR` narrows the run as pytest's `-k` does.

Needs the `upstream-tests` extras (`pip install -e .[dev,upstream-tests]`):
upstream's tests import absl-py, chex, einops and portpicker.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

# The host-API test files the compat namespace is measured on.
TEST_FILES = (
  "lib/nn/tests/embedding_spec_test.py",
  "lib/nn/tests/table_stacking_test.py",
  "lib/nn/tests/embedding_test.py",
  "lib/nn/tests/preprocess_sparse_dense_matmul_input_test.py",
  "lib/nn/tests/minibatching_test.py",
  "lib/nn/tests/custom_optimizer_lowering_test.py",
  "lib/nn/tests/embedding_pipelining_utils_test.py",
  "lib/nn/tests/test_utils_test.py",
  "lib/core/tests/input_preprocessing_test.py",
  "lib/core/tests/pybind_input_preprocessing_test.py",
  "lib/core/tests/sparse_coo_input_preprocessing_test.py",
  "lib/fdo/file_fdo_client_test.py",
  "lib/fdo/csv_file_fdo_client_test.py",
  "utils/utils_test.py",
)
HELPERS = ("lib/nn/tests/test_utils.py", "lib/core/tests/test_utils.py")

# Files run on another number of virtual devices. minibatching_test's
# 16-row batches split over at most 16 SparseCores (4 per device here, as
# on the TPU v5p its numbers are for): upstream's preprocessing refuses
# them on 8 devices too.
DEVICE_COUNTS = {"lib/nn/tests/minibatching_test.py": 4}
DEFAULT_DEVICE_COUNT = 8

CONFTEST = """\
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from absl import flags

flags.FLAGS.mark_as_parsed()
"""


def _rewrite(source: str) -> str:
  source = re.sub(
    r"jax_tpu_embedding\.sparsecore\.lib\.(core|nn)\.tests",
    r"upstream_tests.lib.\1.tests",
    source,
  )
  return source.replace("jax_tpu_embedding.sparsecore", "pz_sparsecore.compat")


def _copy_tests(upstream: pathlib.Path, dest: pathlib.Path) -> None:
  root = upstream / "jax_tpu_embedding" / "sparsecore"
  if not root.is_dir():
    raise SystemExit(
      f"{upstream} is not a jax-tpu-embedding checkout (no "
      "jax_tpu_embedding/sparsecore)"
    )
  package = dest / "upstream_tests"
  for rel in TEST_FILES + HELPERS:
    target = package / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(_rewrite((root / rel).read_text()))
  for folder in [package, *[p for p in package.rglob("*") if p.is_dir()]]:
    (folder / "__init__.py").touch()
  (dest / "conftest.py").write_text(CONFTEST)


def _last_error_line(case: ET.Element) -> str:
  for tag in ("failure", "error"):
    node = case.find(tag)
    if node is not None:
      text = (node.get("message") or node.text or "").strip()
      lines = [line for line in text.splitlines() if line.strip()]
      return lines[-1][:200] if lines else tag
  return ""


def _runs() -> dict[int, list[str]]:
  """Device count -> the copied test files pytest runs on it."""
  runs: dict[int, list[str]] = collections.defaultdict(list)
  for rel in TEST_FILES:
    devices = DEVICE_COUNTS.get(rel, DEFAULT_DEVICE_COUNT)
    runs[devices].append(f"upstream_tests/{rel}")
  return runs


def _read_report(
  report: pathlib.Path,
  per_file: dict[str, list[int]],
  failures: list[tuple[str, str]],
) -> None:
  """Adds a junit report's items to the per-file counts and failures."""
  for case in ET.parse(report).getroot().iter("testcase"):
    name = case.get("classname", "") or case.get("name", "")
    module = name if not case.get("classname") else name.rsplit(".", 1)[0]
    file = module.replace(".", "/").removeprefix("upstream_tests/") + ".py"
    counts = per_file[file]
    counts[0] += 1
    if case.find("skipped") is not None:
      continue
    error = _last_error_line(case)
    if error:
      counts[2] += 1
      failures.append((f"{file}::{case.get('name')}", error))
    else:
      counts[1] += 1


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--upstream",
    default=os.environ.get("PZSC_UPSTREAM"),
    help="a jax-tpu-embedding checkout (default: $PZSC_UPSTREAM)",
  )
  parser.add_argument("-k", default=None, help="pytest -k expression")
  parser.add_argument("--list-failures", action="store_true")
  parser.add_argument(
    "--workdir", help="copy the rewritten tests here (kept) instead of a temp"
  )
  args = parser.parse_args()
  if not args.upstream:
    parser.error("pass --upstream (or set PZSC_UPSTREAM)")
  with tempfile.TemporaryDirectory() as tmp:
    dest = pathlib.Path(args.workdir or tmp)
    dest.mkdir(parents=True, exist_ok=True)
    _copy_tests(pathlib.Path(args.upstream).expanduser(), dest)
    per_file: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    failures: list[tuple[str, str]] = []
    for devices, files in _runs().items():
      report = dest / f"report_{devices}.xml"
      command = [
        sys.executable, "-m", "pytest", *files, "-q",
        "-p", "no:cacheprovider", "--continue-on-collection-errors",
        f"--junitxml={report}", "-o", "junit_family=xunit2",
      ]  # fmt: skip
      if args.k:
        command += ["-k", args.k]
      flags = " ".join(
        [
          os.environ.get("XLA_FLAGS", ""),
          f"--xla_force_host_platform_device_count={devices}",
        ]
      )
      run = subprocess.run(
        command,
        cwd=dest,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "XLA_FLAGS": flags},
      )
      if not report.exists():
        print(run.stdout[-4000:], run.stderr[-4000:])
        return 2
      _read_report(report, per_file, failures)
  if args.list_failures:
    print("\n".join(name for name, _ in failures))
    return 0
  width = max(len(f) for f in per_file) if per_file else 10
  print(f"{'file':<{width}}  items  passed  failed")
  totals = [0, 0, 0]
  for file in sorted(per_file):
    counts = per_file[file]
    totals = [a + b for a, b in zip(totals, counts, strict=True)]
    print(f"{file:<{width}}  {counts[0]:5d}  {counts[1]:6d}  {counts[2]:6d}")
  print(f"{'total':<{width}}  {totals[0]:5d}  {totals[1]:6d}  {totals[2]:6d}")
  if failures:
    print("\nfailing:")
    for name, error in failures:
      print(f"  {name}\n      {error}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
