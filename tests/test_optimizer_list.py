"""The optimizer lists agree: C++ list, extension and registry.

An optimizer is written down in a few places that cannot import each other:
the C++ list `csrc/optimizer_list.h` (read here as text, so this runs without
the extension), the extension's `optimizers()` generated from it (skipped
when the extension did not load) and the registry (`core/optimizers.py`).
"""

from __future__ import annotations

import pathlib
import re

import pytest

from pz_sparsecore.core import optimizers
from pz_sparsecore.device.kernels import ffi

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
COMPILED = [opt for opt in optimizers.REGISTRY.values() if opt.compiled]


def _cpp_list() -> list[tuple[str, str, int, int]]:
  """The lines `X(Name, name, num_slots, num_hyperparameters)` of
  `PZSC_OPTIMIZERS`, in order."""
  text = (CSRC / "optimizer_list.h").read_text()
  body = re.search(r"#define PZSC_OPTIMIZERS\(X\)((?:.*\\\n)*.*\n)", text)
  assert body is not None, "optimizer_list.h defines no PZSC_OPTIMIZERS(X)"
  lines = re.findall(r"X\((\w+), (\w+), (\d+), (\d+)\)", body.group(1))
  return [(cpp, name, int(s), int(h)) for cpp, name, s, h in lines]


def test_cpp_list_is_the_registry():
  rows = _cpp_list()
  assert [(name, s, h) for _, name, s, h in rows] == [
    (opt.name, len(opt.slots), len(opt.hyperparameter_names))
    for opt in COMPILED
  ]
  rules = (CSRC / "optimizers.h").read_text()
  for cpp, name, num_slots, _ in rows:
    # The element rule takes the table element, one element per slot and
    # the gradient.
    rule = re.search(rf"void {cpp}Element\(([^)]*)\)", rules)
    assert rule is not None, f"optimizers.h has no {cpp}Element ({name})"
    assert rule.group(1).count("float&") == 1 + num_slots, rule.group(0)


def test_extension_describes_the_registry():
  if ffi.EXTENSION.module is None:
    pytest.skip(f"the extension did not load: {ffi.EXTENSION.error}")
  module = ffi.EXTENSION.module
  described = [tuple(h) for h in module.optimizers()]
  assert described == list(ffi.expected_optimizers())
  for _, target, _, _ in described:
    assert ffi.available(target, "cpu"), target
  assert module.abi_version() == ffi.ABI_VERSION


def test_abi_version_is_written_once():
  header = pathlib.Path(ffi.__file__).with_name(ffi.ABI_HEADER)
  numbers = re.findall(r"kAbiVersion = (\d+);", header.read_text())
  assert numbers == [str(ffi.ABI_VERSION)]
  for path in CSRC.iterdir():
    assert "kAbiVersion =" not in path.read_text(), path


class _Extension:
  """A loaded extension that reports `version` and `handlers`."""

  def __init__(self, handlers, version=ffi.ABI_VERSION):
    self.handlers = handlers
    self.version = version

  def abi_version(self):
    return self.version

  def optimizers(self):
    return list(self.handlers)


class _NoDescription:
  """A loaded extension of this ABI version without `optimizers()`."""

  def abi_version(self):
    return ffi.ABI_VERSION


def test_other_optimizer_handlers_are_a_mismatch():
  want = list(ffi.expected_optimizers())
  assert ffi.check_extension(_Extension(want), "/x.so").module is not None
  name, target, num_slots, num_hyper = want[-1]
  cases = {
    "missing": (want[:-1], f"{name}: extension none, registry {target}"),
    "slots": (
      want[:-1] + [(name, target, num_slots + 1, num_hyper)],
      f"{name}: extension {target} with {num_slots + 1} slots",
    ),
    "unknown": (
      want + [("foo", "pzsc_sparse_dense_matmul_grad_foo", 1, 1)],
      "foo: extension pzsc_sparse_dense_matmul_grad_foo",
    ),
  }
  for handlers, message in cases.values():
    ext = ffi.check_extension(_Extension(handlers), "/x/_pzsc_ffi.so")
    assert ext.mismatch and ext.module is None
    assert message in ext.error and "/x/_pzsc_ffi.so" in ext.error
    assert "rebuild" in ext.error
  no_description = ffi.check_extension(_NoDescription(), "/x.so")
  assert no_description.mismatch
  assert "no optimizers()" in no_description.error
