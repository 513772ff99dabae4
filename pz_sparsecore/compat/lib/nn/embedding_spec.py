"""Specs as jax-tpu-embedding has them: mutable, filled in place.

`TableSpec` and `FeatureSpec` are mutable dataclasses that compare (and hash)
on the fields a user writes, not on what stacking fills in; optimizer specs
are plain objects whose hyper-parameters can be assigned; a table refuses
changes once stacked, except through `update_preprocessing_parameters`. Every
layout function of the compat namespace converts these to pz_sparsecore's
frozen specs (`to_pz`), calls the frozen API and writes the result back
(`write_back`), so both APIs compute the same layouts.

`TableSettingInStack`, `StackedTableSpec` and `FeatureIdTransformation` are
pz_sparsecore's own (frozen in both libraries); a stacked spec filled in here
holds the table's compat optimizer, so it compares equal to one written with
these classes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pz_sparsecore.compat.lib.core.primitives import optimizer_primitives
from pz_sparsecore.compat.lib.nn import custom_optimizer_lowering
from pz_sparsecore.core import optimizer_proto, optimizers
from pz_sparsecore.core import specs as frozen_specs
from pz_sparsecore.core.optimizer_proto import CallablePlaceholder
from pz_sparsecore.core.specs import (
  DEFAULT_ACTIVATION_MEM_BYTES_LIMIT,
  FeatureIdTransformation,
  QuantizationConfig,
  StackedTableSpec,
  TableSettingInStack,
)

__all__ = [
  "AdagradMomentumOptimizerSpec",
  "AdagradMomentumSlotVariables",
  "AdagradOptimizerSpec",
  "AdagradSlotVariables",
  "AdamOptimizerSpec",
  "AdamSlotVariables",
  "CallablePlaceholder",
  "CustomOptimizerSpec",
  "DEFAULT_ACTIVATION_MEM_BYTES_LIMIT",
  "F2AOptimizerSpec",
  "F2ASlotVariables",
  "FTRLOptimizerSpec",
  "FTRLSlotVariables",
  "FeatureIdTransformation",
  "FeatureSpec",
  "LaPropOptimizerSpec",
  "LaPropSlotVariables",
  "LearningRate",
  "NumericParameter",
  "OptimizerSpec",
  "QuantizationConfig",
  "SGDOptimizerSpec",
  "SGDSlotVariables",
  "StackedTableSpec",
  "TableSettingInStack",
  "TableSpec",
  "optimizer_from_pz",
  "optimizer_to_pz",
  "to_pz",
  "write_back",
]


NumericParameter = jax.typing.ArrayLike
"""A hyper-parameter's value: a number or a scalar array."""
LearningRate = NumericParameter | Callable[..., NumericParameter]
"""A learning rate: a value, or a callable of no argument or of the step."""


def _slot_variables(prefix: str, type_name: str | None = None) -> type:
  """Upstream's namedtuple of the slots of `<prefix>OptimizerSpec`: the
  registry's slot names, in kernel order."""
  frozen = getattr(frozen_specs, f"{prefix}OptimizerSpec")
  return collections.namedtuple(
    type_name or f"{prefix}SlotVariables",
    optimizers.get(frozen.kernel_name).slot_names,
  )


SGDSlotVariables = _slot_variables("SGD")
AdagradSlotVariables = _slot_variables("Adagrad")
AdamSlotVariables = _slot_variables("Adam")
AdagradMomentumSlotVariables = _slot_variables("AdagradMomentum")
FTRLSlotVariables = _slot_variables("FTRL", "FtrlSlotVariables")  # Upstream's.
LaPropSlotVariables = _slot_variables("LaProp")
F2ASlotVariables = _slot_variables("F2A")


# ---------------------------------------------------------------------------
# Optimizer specs: mutable, each a view of the frozen spec of the same name.


_UNSET: Any = object()


def _fields(
  frozen: type[frozen_specs.OptimizerSpec],
) -> tuple[tuple[str, Any], ...]:
  """`(name, default)` of every field of a frozen optimizer spec, in order
  (`learning_rate` first)."""
  return tuple(
    (
      field.name,
      field.default
      if field.default is not dataclasses.MISSING
      else field.default_factory(),
    )
    for field in dataclasses.fields(frozen)
  )


class OptimizerSpec:
  """A table optimizer whose hyper-parameters can be assigned.

  A subclass is named as the frozen pz_sparsecore spec it stands for and
  takes from it its fields (upstream's names, defaults and order,
  `learning_rate` first, the only one that may be passed positionally),
  and after them the `_UPSTREAM_FIELDS` it declares (upstream's fields that
  the frozen spec holds another way), and its kernel name; every
  computation goes through that frozen spec, built from the current values
  (`to_pz`).
  """

  _FIELDS: tuple[tuple[str, Any], ...] = _fields(frozen_specs.OptimizerSpec)
  _UPSTREAM_FIELDS: tuple[tuple[str, Any], ...] = ()
  _KERNEL_NAME = ""

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    frozen = getattr(frozen_specs, cls.__name__)
    cls._FIELDS = _fields(frozen) + cls._UPSTREAM_FIELDS
    cls._KERNEL_NAME = frozen.kernel_name

  def __init__(self, learning_rate: Any = _UNSET, **hyper: Any):
    if learning_rate is not _UNSET:
      hyper["learning_rate"] = learning_rate
    for name, default in self._FIELDS:
      setattr(self, name, hyper.pop(name, default))
    if hyper:
      raise TypeError(
        f"{type(self).__name__}: unexpected arguments {sorted(hyper)}"
      )

  def _values(self) -> dict[str, Any]:
    return {name: getattr(self, name) for name, _ in self._FIELDS}

  def to_pz(self) -> frozen_specs.OptimizerSpec:
    """The frozen pz_sparsecore spec with the current values."""
    return getattr(frozen_specs, type(self).__name__)(**self._values())

  def get_learning_rate(self, step: jax.Array | int | None = None) -> jax.Array:
    """The learning rate at `step`, a float32 scalar."""
    return self.to_pz().get_learning_rate(step)

  def get_hyperparameters(
    self,
    step: jax.Array | int | None = None,
    *,
    embedding_dim: int | None = None,
  ) -> tuple[jax.Array, ...]:
    """The float32 hyper-parameters of the fused update at `step`."""
    return self.to_pz().get_hyperparameters(step, embedding_dim=embedding_dim)

  def slot_variables_initializers(self) -> tuple[Callable[..., Any], ...]:
    """One initialiser per slot, as a namedtuple with upstream's names."""
    return self._slot_type()(*self.to_pz().slot_variables_initializers())

  def _slot_type(self) -> type:
    return globals()[f"{type(self).__name__[:-13]}SlotVariables"]

  def slot_variables_count(self) -> int:
    """The number of slots."""
    return len(self.slot_variables_initializers())

  def short_name(self) -> str:
    """The optimizer's short name (used in variable names)."""
    return self._KERNEL_NAME

  def get_optimizer_primitive(self) -> Any:
    """The optimizer's update primitive (see `optimizer_primitives`)."""
    return optimizer_primitives.primitive(self._KERNEL_NAME)

  def get_float_params(self) -> dict[str, float]:
    """The float hyper-parameters but the learning rate, by name, as an
    `OptimizerSpecProto` records them."""
    return optimizer_proto.hyperparameters(self.to_pz())[0]

  def get_bool_params(self) -> dict[str, bool]:
    """The bool hyper-parameters, by name, as an `OptimizerSpecProto`
    records them."""
    return optimizer_proto.hyperparameters(self.to_pz())[1]

  @classmethod
  def from_float_and_bool_params(
    cls,
    float_params: dict[str, float],
    bool_params: dict[str, bool],
    learning_rate: LearningRate,
  ) -> OptimizerSpec:
    """A spec of this class from an `OptimizerSpecProto`'s parameters (names
    the class does not have are ignored)."""
    frozen = getattr(frozen_specs, cls.__name__)
    return cls(
      **optimizer_proto.from_hyperparameters(
        frozen, float_params, bool_params, learning_rate
      )
    )

  def __hash__(self) -> int:
    return hash(tuple(self._values().items()))

  def __eq__(self, other: object) -> bool:
    return isinstance(other, OptimizerSpec) and hash(self) == hash(other)

  def __repr__(self) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in self._values().items())
    return f"{type(self).__name__}({args})"


class SGDOptimizerSpec(OptimizerSpec):
  """SGD: `w <- w - lr * g`."""


class AdagradOptimizerSpec(OptimizerSpec):
  """Adagrad: `a <- a + g**2; w <- w - lr * g / sqrt(a)`."""


class AdagradMomentumOptimizerSpec(OptimizerSpec):
  """Adagrad with momentum (and optional Nesterov)."""


class AdamOptimizerSpec(OptimizerSpec):
  """Adam with bias correction from the step."""


class FTRLOptimizerSpec(OptimizerSpec):
  """Follow-the-regularized-leader."""


class LaPropOptimizerSpec(OptimizerSpec):
  """LaProp (Adam with the update normalised before momentum)."""

  def get_decay_rate(self, step: jax.Array | int | None = None) -> jax.Array:
    """The second-moment decay at `step`."""
    return self.to_pz().get_decay_rate(step)


class F2AOptimizerSpec(OptimizerSpec):
  """F2A (FTRL-style adaptive with a per-row local step)."""


class CustomOptimizerSpec(OptimizerSpec):
  """An optimizer given as a JAX function of the touched rows, or as the
  StableHLO module of that function.

  `custom_computation_fn(grad, row, *slots, learning_rate)` is the frozen
  spec's (`core.specs.CustomOptimizerSpec`). `stablehlo`, upstream's
  alternative, is the module's text (or its UTF-8 bytes, or an MLIR
  module) with the same operands, each `[1, D]` for a stack `D` wide, e.g.
  from `lower_to_stablehlo(fn, D, num_slots)`; when given it is what runs,
  as upstream, the fused update calling it once per touched row
  (`custom_optimizer_lowering.StableHLOUpdate`).
  """

  _UPSTREAM_FIELDS = (("stablehlo", None),)

  def to_pz(self) -> frozen_specs.CustomOptimizerSpec:
    """The frozen spec; its function runs `stablehlo` when that is given.

    Raises:
      ValueError: If neither `custom_computation_fn` nor `stablehlo` is
        given, or `stablehlo` is not a module.
    """
    values = self._values()
    stablehlo = values.pop("stablehlo")
    if stablehlo is not None:
      if not isinstance(stablehlo, (str, bytes)):
        stablehlo = str(stablehlo)  # An MLIR module prints as its text.
      values["custom_computation_fn"] = (
        custom_optimizer_lowering.StableHLOUpdate(stablehlo)
      )
    elif values["custom_computation_fn"] is None:
      raise ValueError(
        "Either stablehlo or custom_computation_fn must be provided for "
        f"CustomOptimizerSpec {self.short_name_str!r}: pass the row update "
        "as custom_computation_fn=fn(grad, row, *slots, learning_rate), or "
        "its module as stablehlo= (CustomOptimizerSpec.lower_to_stablehlo)"
      )
    return frozen_specs.CustomOptimizerSpec(**values)

  def short_name(self) -> str:
    return self.short_name_str

  def slot_variables_initializers(self) -> tuple[Callable[..., Any], ...]:
    """The initializers as given (a namedtuple stays one; a list becomes
    a tuple)."""
    inits = self.slot_variable_initializers_tuple
    return inits if isinstance(inits, tuple) else tuple(inits)

  # Upstream's classmethods, which only delegate: the functions themselves.
  lower_to_stablehlo = staticmethod(
    custom_optimizer_lowering.lower_to_stablehlo
  )
  wrap_stablehlo_with_limits = staticmethod(
    custom_optimizer_lowering.wrap_stablehlo_with_limits
  )


def optimizer_to_pz(optimizer: Any) -> frozen_specs.OptimizerSpec:
  """The frozen spec of a compat optimizer spec (a frozen one is returned).

  Raises:
    ValueError: If `optimizer` is not an optimizer spec.
  """
  if isinstance(optimizer, OptimizerSpec):
    return optimizer.to_pz()
  if isinstance(optimizer, frozen_specs.OptimizerSpec):
    return optimizer
  raise ValueError(f"optimizer must be an OptimizerSpec, got {optimizer!r}")


def optimizer_from_pz(optimizer: frozen_specs.OptimizerSpec) -> OptimizerSpec:
  """The compat spec of the class named as a frozen spec, with its values
  (a custom optimizer running a module gets it back as `stablehlo`)."""
  cls = globals()[type(optimizer).__name__]
  values = {
    field.name: getattr(optimizer, field.name)
    for field in dataclasses.fields(optimizer)
  }
  fn = values.get("custom_computation_fn")
  if isinstance(fn, custom_optimizer_lowering.StableHLOUpdate):
    values.update(custom_computation_fn=None, stablehlo=fn.stablehlo)
  return cls(**values)


# ---------------------------------------------------------------------------
# Table and feature specs.

_AFTER_STACKING = (
  "_stacked_table_spec",
  "_setting_in_stack",
  "stacked_table_spec",
  "setting_in_stack",
)
_FDO_FIELDS = (
  "max_ids_per_partition",
  "max_unique_ids_per_partition",
  "suggested_coo_buffer_size_per_device",
)


@dataclasses.dataclass(eq=True, unsafe_hash=True, kw_only=True)
class TableSpec:
  """One embedding table, filled in place by stacking.

  Compares on the fields a user writes; `setting_in_stack` and
  `stacked_table_spec` are filled by stacking and not compared.
  """

  name: str
  vocabulary_size: int
  embedding_dim: int
  initializer: Callable[..., Any]
  optimizer: OptimizerSpec
  combiner: str
  max_ids_per_partition: int = frozen_specs.DEFAULT_MAX_IDS_PER_PARTITION
  max_unique_ids_per_partition: int = (
    frozen_specs.DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION
  )
  suggested_coo_buffer_size_per_device: int | None = None
  quantization_config: QuantizationConfig | None = None
  # pz_sparsecore's: how the rows are stored (`frozen_specs.TABLE_DTYPES`).
  dtype: Any = "float32"
  # pz_sparsecore's: the activations' dtype (`frozen_specs.TableSpec`).
  activation_dtype: Any = "float32"
  _initialized: bool = dataclasses.field(
    init=False, default=False, compare=False
  )
  _stacked_table_spec: StackedTableSpec | None = dataclasses.field(
    default=None, compare=False
  )
  _setting_in_stack: TableSettingInStack | None = dataclasses.field(
    default=None, compare=False
  )

  def __post_init__(self):
    if self._setting_in_stack is None:
      self._setting_in_stack = TableSettingInStack(
        stack_name=self.name,
        padded_vocab_size=self.vocabulary_size,
        padded_embedding_dim=self.embedding_dim,
      )
    object.__setattr__(self, "_initialized", True)

  def __setattr__(self, name: str, value: Any):
    if (
      name not in _AFTER_STACKING
      and getattr(self, "_initialized", False)
      and self.is_stacked()
    ):
      if name in _FDO_FIELDS:
        raise AttributeError(
          f"Cannot update parameter '{name}' on TableSpec '{self.name}' "
          "after it has been stacked; use "
          "embedding.update_preprocessing_parameters() to update its "
          "StackedTableSpec"
        )
      raise AttributeError(
        f"Cannot update parameter '{name}' on TableSpec '{self.name}' after "
        "it has been stacked; build a new spec with dataclasses.replace and "
        "prepare the feature specs again"
      )
    super().__setattr__(name, value)

  @property
  def setting_in_stack(self) -> TableSettingInStack:
    """Where the table sits in its stack."""
    return self._setting_in_stack

  @setting_in_stack.setter
  def setting_in_stack(self, value: TableSettingInStack) -> None:
    self._setting_in_stack = value

  @property
  def stacked_table_spec(self) -> StackedTableSpec:
    """The stack the table belongs to."""
    if self._stacked_table_spec is None:
      raise ValueError(
        f"table {self.name!r} is not stacked; call "
        "prepare_feature_specs_for_training first"
      )
    return self._stacked_table_spec

  @stacked_table_spec.setter
  def stacked_table_spec(self, value: StackedTableSpec) -> None:
    self._stacked_table_spec = value

  def is_stacked(self) -> bool:
    """Whether stacking (or preparation) has filled in the stack."""
    return self._stacked_table_spec is not None


@dataclasses.dataclass(eq=True, unsafe_hash=True, kw_only=True)
class FeatureSpec:
  """One input feature, filled in place by stacking.

  Compares on the fields a user writes; `id_transformation` is filled by
  stacking and not compared.
  """

  name: str
  table_spec: TableSpec
  input_shape: Sequence[int | None]
  output_shape: Sequence[int]
  _id_transformation: FeatureIdTransformation | None = dataclasses.field(
    default=None, compare=False
  )

  @property
  def id_transformation(self) -> FeatureIdTransformation | None:
    """How the feature's samples and ids map into its stack."""
    return self._id_transformation

  @id_transformation.setter
  def id_transformation(self, value: FeatureIdTransformation) -> None:
    self._id_transformation = value


# ---------------------------------------------------------------------------
# Conversion to the frozen specs and back.


def is_feature(x: Any) -> bool:
  """Whether `x` is a (compat or frozen) `FeatureSpec`: a spec tree leaf."""
  return isinstance(x, FeatureSpec | frozen_specs.FeatureSpec)


def _stacked_to_pz(stacked: StackedTableSpec | None) -> StackedTableSpec | None:
  if stacked is None or isinstance(
    stacked.optimizer, frozen_specs.OptimizerSpec
  ):
    return stacked
  return stacked.replace(optimizer=optimizer_to_pz(stacked.optimizer))


def table_to_pz(
  table: TableSpec | frozen_specs.TableSpec,
) -> frozen_specs.TableSpec:
  """The frozen spec of a compat `TableSpec` (a frozen one is returned)."""
  if isinstance(table, frozen_specs.TableSpec):
    return table
  if not isinstance(table, TableSpec):
    raise ValueError(f"expected a TableSpec, got {type(table).__name__}")
  return frozen_specs.TableSpec(
    name=table.name,
    vocabulary_size=table.vocabulary_size,
    embedding_dim=table.embedding_dim,
    initializer=table.initializer,
    optimizer=optimizer_to_pz(table.optimizer),
    combiner=table.combiner,
    max_ids_per_partition=table.max_ids_per_partition,
    max_unique_ids_per_partition=table.max_unique_ids_per_partition,
    suggested_coo_buffer_size_per_device=(
      table.suggested_coo_buffer_size_per_device
    ),
    quantization_config=table.quantization_config,
    dtype=table.dtype,
    activation_dtype=table.activation_dtype,
    setting_in_stack=table.setting_in_stack,
    stacked_table_spec=_stacked_to_pz(table._stacked_table_spec),
  )


def to_pz(feature_specs: Any, *, last_table_per_name: bool = False) -> Any:
  """The same tree with frozen pz_sparsecore specs in place of compat ones.

  Tables shared by several features stay shared (one frozen spec per
  compat table object). Frozen leaves pass through unchanged. With
  `last_table_per_name`, different table objects of one name all become the
  last one (upstream's preparation keys tables by name).
  """
  tables: dict[Any, frozen_specs.TableSpec] = {}
  last: dict[str, Any] = {}
  if last_table_per_name:
    for feature in jax.tree.leaves(feature_specs, is_leaf=is_feature):
      if isinstance(feature, FeatureSpec):
        last[feature.table_spec.name] = feature.table_spec

  def convert(feature: Any) -> Any:
    if isinstance(feature, frozen_specs.FeatureSpec):
      return feature
    if not isinstance(feature, FeatureSpec):
      raise ValueError(
        f"expected FeatureSpec leaves, got {type(feature).__name__}"
      )
    table = last.get(feature.table_spec.name, feature.table_spec)
    key = id(table)
    if key not in tables:
      tables[key] = table_to_pz(table)
    return frozen_specs.FeatureSpec(
      name=feature.name,
      table_spec=tables[key],
      input_shape=feature.input_shape,
      output_shape=feature.output_shape,
      id_transformation=feature.id_transformation,
    )

  return jax.tree.map(convert, feature_specs, is_leaf=is_feature)


def _compat_optimizer(
  table: TableSpec, frozen: frozen_specs.OptimizerSpec
) -> Any:
  optimizer = table.optimizer
  if isinstance(optimizer, OptimizerSpec) and optimizer.to_pz() == frozen:
    return optimizer
  return frozen


def write_back(feature_specs: Any, frozen_specs: Any) -> None:
  """Fills the compat specs in place from frozen specs of the same tree."""
  compat = jax.tree.leaves(feature_specs, is_leaf=is_feature)
  frozen = jax.tree.leaves(frozen_specs, is_leaf=is_feature)
  for feature, new in zip(compat, frozen, strict=True):
    if not isinstance(feature, FeatureSpec):
      continue
    feature.id_transformation = new.id_transformation
    write_back_table(feature.table_spec, new.table_spec)


def write_back_table(table: TableSpec, new: frozen_specs.TableSpec) -> None:
  """Fills one compat table in place from its frozen counterpart."""
  table.setting_in_stack = new.setting_in_stack
  stacked = new.stacked_table_spec
  if stacked is not None:
    stacked = stacked.replace(
      optimizer=_compat_optimizer(table, stacked.optimizer)
    )
  table.stacked_table_spec = stacked
