"""A table's optimizer in jax-tpu-embedding's `OptimizerSpecProto`.

Upstream's schema records a table's optimizer next to its layout (field 13
of `TableSpecProto`) so that a layout read back from a proto can be stacked
and converted again. The message holds:

- `type`: one of `OPTIMIZER_TYPE_UNSPECIFIED, SGD, ADAGRAD, ADAM, FTRL, F2A,
  ADAGRAD_MOMENTUM, CUSTOM` (numbered from 0). The optimizers upstream's
  enum does not name (LaProp, row-wise Adagrad, custom ones) are `CUSTOM`
  and, as upstream writes them, carry no hyper-parameters;
- the learning rate, a float32 constant, or for a callable (a schedule) a
  `learning_rate_tag` naming it;
- `float_params` and `bool_params`: every hyper-parameter but the learning
  rate, by field name (the spec's float fields and bool fields).

Read back, a tag becomes a `CallablePlaceholder` learning rate: the spec
compares, hashes and stacks as the original did (two schedules of different
names stay apart), and evaluating it raises, because the schedule itself is
not in the proto. `CUSTOM` and unknown types read back as SGD with the
learning rate, as upstream's reader does.

Example: `AdagradOptimizerSpec(learning_rate=0.05,
initial_accumulator_value=0.2)` is written as::

  optimizer {
    type: ADAGRAD
    learning_rate: 0.05
    float_params { key: "initial_accumulator_value" value: 0.2 }
  }

and reads back with both values rounded to float32 (0.05 ->
0.05000000074505806).

The functions here work on any message with upstream's fields (the class
is passed in), so they serve the frozen specs (`core.spec_proto`) and the
compat namespace's classes alike (`spec_class` picks the class by name).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

from pz_sparsecore.core import specs

OPTIMIZER_TYPES: dict[str, str] = {
  "sgd": "SGD",
  "adagrad": "ADAGRAD",
  "adam": "ADAM",
  "ftrl": "FTRL",
  "f2a": "F2A",
  "adagrad_momentum": "ADAGRAD_MOMENTUM",
}
"""Kernel name -> upstream's `OptimizerType` value name; others are CUSTOM."""

CUSTOM = "CUSTOM"
"""The `OptimizerType` of every optimizer upstream's enum does not name."""


class CallablePlaceholder:
  """A callable learning rate read back from a proto: only its tag.

  It compares and hashes by tag, so specs read back from one proto stack as
  the originals did; calling it raises, since the schedule is not in the
  proto (rebuild the spec with the schedule to train).
  """

  def __init__(self, tag: str):
    self.tag = tag

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(
      f"learning rate {self.tag!r} was read from a proto, which records only "
      "its tag; give the optimizer spec the schedule itself to train"
    )

  def __eq__(self, other: object) -> bool:
    return isinstance(other, CallablePlaceholder) and self.tag == other.tag

  def __hash__(self) -> int:
    return hash((CallablePlaceholder, self.tag))

  def __repr__(self) -> str:
    return f"CallablePlaceholder({self.tag!r})"


def learning_rate_tag(learning_rate: Any) -> str | None:
  """The tag that names a callable learning rate; None for a constant.

  A placeholder (or any object with a non-empty `tag`) keeps its tag; a
  named function is `module.qualified_name`, the same in every process; a
  lambda or other callable is named by its type and id, unique in this
  process only.
  """
  if not callable(learning_rate):
    return None
  tag = getattr(learning_rate, "tag", None)
  if tag:
    return str(tag)
  name = getattr(learning_rate, "__qualname__", None) or getattr(
    learning_rate, "__name__", None
  )
  if name and "<lambda>" not in name:
    module = getattr(learning_rate, "__module__", None)
    return f"{module}.{name}" if module else name
  return f"{type(learning_rate).__name__}_{id(learning_rate):x}"


def _kinds(spec_class: type) -> dict[str, str]:
  """Hyper-parameter name -> "float" or "bool", from a frozen spec's fields
  (the learning rate excluded)."""
  kinds = {}
  for field in dataclasses.fields(spec_class):
    declared = str(field.type).replace(" ", "")
    if field.name == "learning_rate":
      continue
    if declared in ("float", "float|None", str(float)):
      kinds[field.name] = "float"
    elif declared in ("bool", str(bool)):
      kinds[field.name] = "bool"
  return kinds


def hyperparameters(
  spec: specs.OptimizerSpec,
) -> tuple[dict[str, float], dict[str, bool]]:
  """`(float_params, bool_params)` of a frozen spec: its float and bool
  fields but the learning rate (a float field set to None is left out)."""
  floats: dict[str, float] = {}
  bools: dict[str, bool] = {}
  for name, kind in _kinds(type(spec)).items():
    value = getattr(spec, name)
    if kind == "bool":
      bools[name] = bool(value)
    elif value is not None:
      floats[name] = float(value)
  return floats, bools


def from_hyperparameters(
  spec_class: type[specs.OptimizerSpec],
  float_params: Mapping[str, float],
  bool_params: Mapping[str, bool],
  learning_rate: Any,
) -> dict[str, Any]:
  """The constructor arguments of `spec_class` from a proto's parameters;
  names the class does not have are ignored (as upstream)."""
  kwargs: dict[str, Any] = {"learning_rate": learning_rate}
  for name, kind in _kinds(spec_class).items():
    params = float_params if kind == "float" else bool_params
    if name in params:
      kwargs[name] = (
        float(params[name]) if kind == "float" else bool(params[name])
      )
  return kwargs


def type_name(spec_class: type) -> str:
  """Upstream's `OptimizerType` name of a frozen spec class."""
  kernel = getattr(spec_class, "kernel_name", None)
  return OPTIMIZER_TYPES.get(kernel, CUSTOM)


def spec_class(name: str) -> type[specs.OptimizerSpec] | None:
  """The frozen spec class of an `OptimizerType` name (None for CUSTOM,
  OPTIMIZER_TYPE_UNSPECIFIED or a name this schema does not know)."""
  for cls in _frozen_classes():
    if OPTIMIZER_TYPES.get(cls.kernel_name) == name:
      return cls
  return None


def _frozen_classes() -> list[type[specs.OptimizerSpec]]:
  return [
    cls
    for cls in vars(specs).values()
    if inspect.isclass(cls)
    and issubclass(cls, specs.OptimizerSpec)
    and "kernel_name" in vars(cls)
  ]


def write(spec: specs.OptimizerSpec, message_class: type) -> Any:
  """`spec` as a new `message_class` (upstream's `OptimizerSpecProto`)."""
  name = type_name(type(spec))
  message = message_class(type=message_class.OptimizerType.Value(name))
  tag = learning_rate_tag(spec.learning_rate)
  if tag is not None:
    message.learning_rate_tag = tag
  else:
    message.learning_rate = float(spec.learning_rate)
  if name != CUSTOM:
    floats, bools = hyperparameters(spec)
    message.float_params.update(floats)
    message.bool_params.update(bools)
  return message


def read(message: Any) -> specs.OptimizerSpec:
  """The frozen spec an `OptimizerSpecProto` describes (SGD with its
  learning rate for CUSTOM or an unknown type)."""
  if message.WhichOneof("learning_rate_spec") == "learning_rate_tag":
    learning_rate: Any = CallablePlaceholder(message.learning_rate_tag)
  else:
    learning_rate = float(message.learning_rate)
  names = type(message).OptimizerType
  name = names.Name(message.type) if message.type in names.values() else ""
  cls = spec_class(name) or specs.SGDOptimizerSpec
  return cls(
    **from_hyperparameters(
      cls, message.float_params, message.bool_params, learning_rate
    )
  )
