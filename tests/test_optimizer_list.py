"""The optimizer lists agree: C++ list, extension, registry, specs, compat.

An optimizer is written down in a few places that cannot import each other:
the C++ list `csrc/optimizer_list.h` (read here as text, so this runs without
the extension), the extension's `optimizers()` generated from it (skipped
when the extension did not load), the registry (`core/optimizers.py`), the
frozen specs (`core/specs.py`) and the compat namespace's spec classes,
slot tuples and primitive modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re

import numpy as np
import pytest
from numerics import DOMAIN_TESTS

from pz_sparsecore.compat.lib.core.primitives import optimizer_primitives
from pz_sparsecore.compat.lib.nn import embedding_spec
from pz_sparsecore.core import optimizers, specs
from pz_sparsecore.device.kernels import ffi

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
PRIMITIVES = ROOT / "pz_sparsecore/compat/lib/core/primitives"
COMPILED = [opt for opt in optimizers.REGISTRY.values() if opt.compiled]


CPP_SHAPES = {"Table": "table", "Row": "rowwise_1d"}


def _cpp_list() -> list[tuple[str, str, int, int, str, tuple[str, ...]]]:
  """The lines `X(Name, name, num_slots, num_hyperparameters, rule, shape0,
  shape1)` of `PZSC_OPTIMIZERS`, in order, with the slot shapes in the
  registry's words (None columns dropped)."""
  text = (CSRC / "optimizer_list.h").read_text()
  body = re.search(r"#define PZSC_OPTIMIZERS\(X\)((?:.*\\\n)*.*\n)", text)
  assert body is not None, "optimizer_list.h defines no PZSC_OPTIMIZERS(X)"
  lines = re.findall(
    r"X\((\w+), (\w+), (\d+), (\d+), (\w+), (\w+), (\w+)\)", body.group(1)
  )
  return [
    (
      cpp,
      name,
      int(s),
      int(h),
      rule,
      tuple(CPP_SHAPES[x] for x in (s0, s1) if x != "None"),
    )
    for cpp, name, s, h, rule, s0, s1 in lines
  ]


def test_cpp_list_is_the_registry():
  # The same optimizers, in any order (each is found by its name).
  rows = _cpp_list()
  assert sorted((name, s, h, shapes) for _, name, s, h, _, shapes in rows) == (
    sorted(
      (
        opt.name,
        len(opt.slots),
        len(opt.hyperparameter_names),
        tuple(slot.shape_text for slot in opt.slots),
      )
      for opt in COMPILED
    )
  )
  rules = (CSRC / "optimizers.h").read_text()
  for cpp, name, num_slots, _, rule_kind, _ in rows:
    element = re.search(rf"void {cpp}Element\(([^)]*)\)", rules)
    assert element is not None, f"optimizers.h has no {cpp}Element ({name})"
    if rule_kind == "Element":
      # The table element, one element per slot, then the gradient.
      assert element.group(1).count("float&") == 1 + num_slots, element[0]
      continue
    assert rule_kind == "Row", (name, rule_kind)
    # A row rule: the term of one element, the row's slot values once, then
    # the table element alone.
    assert element.group(1).count("float&") == 1, element.group(0)
    assert f"{cpp}RowState&" in element.group(1), element.group(0)
    row = re.search(rf"{cpp}Row\(([^)]*)\)", rules)
    assert row is not None, f"optimizers.h has no {cpp}Row ({name})"
    assert row.group(1).count("float&") == num_slots, row.group(0)
    assert re.search(rf"float {cpp}RowTerm\(", rules), name


def test_extension_describes_the_registry():
  if ffi.EXTENSION.module is None:
    pytest.skip(f"the extension did not load: {ffi.EXTENSION.error}")
  module = ffi.EXTENSION.module
  described = [tuple(h) for h in module.optimizers()]
  assert sorted(described) == sorted(ffi.expected_optimizers())
  for _, target, *_ in described:
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
  # An optimizer with slots, wherever it is in the list; the extension
  # describes it with each slot's other shape.
  handler = next(h for h in want if h[2])
  name, target, num_slots, num_hyper, shapes = handler
  others = tuple("rowwise_1d" if s == "table" else "table" for s in shapes)
  rest = [h for h in want if h != handler]
  cases = {
    "missing": (rest, f"{name}: extension none, registry {target}"),
    "slots": (
      rest + [(name, target, num_slots + 1, num_hyper, shapes)],
      f"{name}: extension {target} with {num_slots + 1} slots",
    ),
    "shapes": (
      rest + [(name, target, num_slots, num_hyper, others)],
      f"{name}: extension {target} with {num_slots} slots "
      f"({', '.join(others)})",
    ),
    "unknown": (
      want + [("foo", "pzsc_sparse_dense_matmul_grad_foo", 1, 1, ("table",))],
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


def _frozen_specs() -> dict[str, type]:
  """Frozen optimizer spec classes by kernel name (custom aside)."""
  return {
    cls.kernel_name: cls
    for cls in vars(specs).values()
    if isinstance(cls, type)
    and issubclass(cls, specs.OptimizerSpec)
    and "kernel_name" in vars(cls)
    and cls is not specs.CustomOptimizerSpec
  }


def test_every_registry_entry_has_its_spec():
  frozen = _frozen_specs()
  assert sorted(frozen) == sorted(optimizers.REGISTRY)
  for name, cls in frozen.items():
    fields = {f.name: f for f in dataclasses.fields(cls)}
    opt = optimizers.REGISTRY[name]
    for slot in opt.slots:
      assert slot.initial_value_field in (None, *fields), (name, slot)
      # The spec's default initial value (0 without a field) lies in the
      # slot's domain, from which the kernel tests draw.
      field = slot.initial_value_field
      initial = getattr(cls(), field) if field else 0.0
      assert DOMAIN_TESTS[slot.domain](np.float32(initial)), (name, slot)
    for attribute in opt.static_attributes:
      assert fields[attribute].type in ("bool", bool), (name, attribute)
    defaults = cls()
    got = defaults.get_hyperparameters(3, embedding_dim=8)
    assert len(got) == len(opt.hyperparameter_names)
    if opt.needs_logical_dim:
      with pytest.raises(ValueError, match="embedding_dim"):
        defaults.get_hyperparameters(3)


def _compat_specs() -> list[type]:
  return [
    cls
    for cls in vars(embedding_spec).values()
    if isinstance(cls, type)
    and issubclass(cls, embedding_spec.OptimizerSpec)
    and cls is not embedding_spec.OptimizerSpec
  ]


def test_compat_specs_are_the_frozen_specs():
  classes = _compat_specs()
  assert {cls.__name__ for cls in classes} <= set(embedding_spec.__all__)
  for cls in classes:
    frozen = getattr(specs, cls.__name__)
    # The frozen spec's fields, then upstream's fields it lacks (a custom
    # optimizer's `stablehlo`, turned into its function by `to_pz`).
    assert cls._FIELDS == tuple(
      (f.name, f.default) for f in dataclasses.fields(frozen)
    ) + tuple(cls._UPSTREAM_FIELDS)
    assert not {name for name, _ in cls._UPSTREAM_FIELDS} & {
      f.name for f in dataclasses.fields(frozen)
    }
    if frozen is specs.CustomOptimizerSpec:
      continue
    assert cls().to_pz() == frozen()
    name = frozen.kernel_name
    assert cls().short_name() == name
    prefix = cls.__name__.removesuffix("OptimizerSpec")
    assert f"{prefix}SlotVariables" in embedding_spec.__all__
    slot_type = getattr(embedding_spec, f"{prefix}SlotVariables")
    assert slot_type._fields == optimizers.REGISTRY[name].slot_names


def test_primitive_modules_are_named_for_registry_optimizers():
  modules = sorted(PRIMITIVES.glob("sparse_dense_matmul_*.py"))
  assert modules
  for path in modules:
    module = importlib.import_module(
      f"pz_sparsecore.compat.lib.core.primitives.{path.stem}"
    )
    primitive = getattr(module, f"tpu_{path.stem}_primitive")
    assert primitive.name == path.stem
    assert primitive is optimizer_primitives.of_module(module.__name__)
  with pytest.raises(ValueError, match="no optimizer of the registry"):
    optimizer_primitives.of_module("x.sparse_dense_matmul_grad_with_foo")
