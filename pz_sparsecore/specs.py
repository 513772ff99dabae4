"""Table, feature and optimizer specifications.

A model's embeddings are described by two kinds of frozen records:

* `TableSpec`: one logical embedding table (`vocabulary_size` x
  `embedding_dim`), its initializer, its optimizer and its combiner.
* `FeatureSpec`: one input feature, a batch of (possibly ragged) id lists
  looked up in a `TableSpec`.

Before preprocessing, `layout.prepare_feature_specs_for_training` (optionally
after `layout.stack_tables` or `layout.auto_stack_tables`) fills in how the
tables are stacked and sharded: every table gets a `TableSettingInStack` and a
`StackedTableSpec`, every feature a `FeatureIdTransformation`. Those functions
return new specs; nothing here is ever mutated in place.

The names, fields and defaults are those of jax-tpu-embedding, so specs
written for it port unchanged. Each optimizer spec names its entry in the
optimizer registry (`optimizers.py`), which holds its slots, the order of the
hyper-parameters its fused update receives, and its row update; for example
Adagrad has the slot `accumulator` (initial value 0.1) and reads `(lr,)`.
Adam's hyper-parameters carry the bias correction for `t = step + 1`, so the
kernel needs no step of its own.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from pz_sparsecore import optimizers

COMBINERS = ("sum", "mean", "sqrtn")
DEFAULT_MAX_IDS_PER_PARTITION = 256
DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION = 256

Initializer = Callable[..., jax.Array]
LearningRate = float | Callable[..., Any]


def _check_positive_int(owner: str, field: str, value: Any) -> None:
  if (
    isinstance(value, bool)
    or not isinstance(value, numbers.Integral)
    or value <= 0
  ):
    raise ValueError(
      f"{owner}: {field} must be a positive integer, got {value!r}"
    )


def _check_finite(owner: str, field: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{owner}: {field} must be a number, got {value!r}")
  if not math.isfinite(value):
    raise ValueError(f"{owner}: {field} must be finite, got {value!r}")


def _check_combiner(owner: str, combiner: Any) -> None:
  if combiner not in COMBINERS:
    raise ValueError(
      f"{owner}: unknown combiner {combiner!r}; expected one of {COMBINERS}"
    )


def _check_limits(owner: str, spec: Any) -> None:
  _check_positive_int(
    owner, "max_ids_per_partition", spec.max_ids_per_partition
  )
  _check_positive_int(
    owner, "max_unique_ids_per_partition", spec.max_unique_ids_per_partition
  )
  if spec.suggested_coo_buffer_size_per_device is not None:
    _check_positive_int(
      owner,
      "suggested_coo_buffer_size_per_device",
      spec.suggested_coo_buffer_size_per_device,
    )
  config = spec.quantization_config
  if config is not None and not isinstance(config, QuantizationConfig):
    raise ValueError(
      f"{owner}: quantization_config must be a QuantizationConfig or None, "
      f"got {config!r}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationConfig:
  """Lookups see table values quantized to `num_buckets` levels.

  Attributes:
    min_value: The lowest level.
    max_value: The highest level.
    num_buckets: Levels from `min_value` to `max_value` (at least 2).
  """

  min_value: float
  max_value: float
  num_buckets: int

  def __post_init__(self):
    owner = "QuantizationConfig"
    _check_finite(owner, "min_value", self.min_value)
    _check_finite(owner, "max_value", self.max_value)
    if isinstance(self.num_buckets, bool) or not isinstance(
      self.num_buckets, numbers.Integral
    ):
      raise ValueError(
        f"{owner}: num_buckets must be an integer, got {self.num_buckets!r}"
      )
    if self.num_buckets < 2:
      raise ValueError(
        f"{owner}: num_buckets must be >= 2, got {self.num_buckets}"
      )
    if not self.min_value < self.max_value:
      raise ValueError(
        f"{owner}: min_value must be < max_value, got {self.min_value} and "
        f"{self.max_value}"
      )

  def as_tuple(self) -> tuple[float, float, int]:
    """`(min_value, max_value, num_buckets)`."""
    return (self.min_value, self.max_value, self.num_buckets)


# ---------------------------------------------------------------------------
# Optimizers.


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """Base class of the per-table optimizers applied in the fused update.

  Attributes:
    learning_rate: A float, or a callable of no argument or of the step.
    kernel_name: The optimizer's entry in `optimizers.REGISTRY` (a class
      attribute of each subclass).
  """

  kernel_name: ClassVar[str]
  learning_rate: LearningRate = 0.001

  def __post_init__(self):
    lr = self.learning_rate
    if not callable(lr):
      if hasattr(lr, "shape") and getattr(lr, "shape", None) == ():
        lr = float(lr)
        object.__setattr__(self, "learning_rate", lr)
      _check_finite(type(self).__name__, "learning_rate", lr)
    for field in dataclasses.fields(self):
      if field.name == "learning_rate":
        continue
      value = getattr(self, field.name)
      if field.type in ("float", float):
        _check_finite(type(self).__name__, field.name, value)
    self._check_accumulator()

  def _check_accumulator(self) -> None:
    """Refuses values for which an update would divide zero by zero."""

  def _require_positive_accumulator(self, why: str) -> None:
    value = self.initial_accumulator_value
    if not value > 0:
      raise ValueError(
        f"{type(self).__name__}: initial_accumulator_value must be > 0, got "
        f"{value!r} ({why})"
      )

  @property
  def definition(self) -> optimizers.Optimizer:
    """The optimizer's registry entry (slots, hyper-parameters, update)."""
    return optimizers.get(self.kernel_name)

  def short_name(self) -> str:
    """The optimizer's name as the kernels know it."""
    return self.kernel_name

  def get_learning_rate(self, step: jax.Array | int | None = None) -> jax.Array:
    """The learning rate at `step` as a float32 scalar.

    Args:
      step: The training step; needed when `learning_rate` takes the step.

    Returns:
      A float32 scalar.

    Raises:
      ValueError: If the learning rate is a callable of the step and `step`
        is None.
    """
    lr = self.learning_rate
    if callable(lr):
      num_params = len(inspect.signature(lr).parameters)
      if num_params == 0:
        lr = lr()
      else:
        if step is None:
          raise ValueError(
            f"{type(self).__name__}: the learning rate is a function of the "
            "step; pass step"
          )
        lr = lr(step)
    return jnp.asarray(lr, dtype=jnp.float32)

  def get_hyperparameters(
    self, step: jax.Array | int | None = None
  ) -> tuple[jax.Array, ...]:
    """The float32 hyper-parameters of the update at `step`, in kernel order."""
    return self.definition.hyperparameters(
      self, self.get_learning_rate(step), step
    )

  def slot_variables_initializers(self) -> tuple[Initializer, ...]:
    """A NamedTuple of initialisers, one per slot (empty for SGD)."""
    return self.definition.slot_tuple_type(
      *(
        _constant(
          getattr(self, s.initial_value_field) if s.initial_value_field else 0.0
        )
        for s in self.definition.slots
      )
    )

  def slot_names(self) -> tuple[str, ...]:
    """The names of the slots, in kernel order."""
    return self.definition.slot_names

  def static_attributes(self) -> dict[str, Any]:
    """The compile-time switches of the update (e.g. FTRL's variant)."""
    return {
      name: getattr(self, name) for name in self.definition.static_attributes
    }


def _constant(value: float) -> Initializer:
  return jax.nn.initializers.constant(value, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class SGDOptimizerSpec(OptimizerSpec):
  """Plain SGD: `w <- w - lr * g`."""

  kernel_name: ClassVar[str] = "sgd"

  learning_rate: LearningRate = 0.001


@dataclasses.dataclass(frozen=True)
class AdagradOptimizerSpec(OptimizerSpec):
  """Adagrad: `a <- a + g**2; w <- w - lr * g / sqrt(a)`."""

  kernel_name: ClassVar[str] = "adagrad"

  learning_rate: LearningRate = 0.001
  initial_accumulator_value: float = 0.1

  def _check_accumulator(self) -> None:
    self._require_positive_accumulator(
      "a row component whose gradient has always been 0 would be updated by "
      "0 / sqrt(0)"
    )


@dataclasses.dataclass(frozen=True)
class AdagradMomentumOptimizerSpec(OptimizerSpec):
  """Adagrad with momentum (and optional Nesterov), as upstream."""

  kernel_name: ClassVar[str] = "adagrad_momentum"

  learning_rate: LearningRate = 0.001
  momentum: float = 0.9
  beta2: float = 1.0
  epsilon: float = 1e-10
  exponent: float = 2.0
  use_nesterov: bool = False
  initial_accumulator_value: float = 0.1
  initial_momentum_value: float = 0.0

  def _check_accumulator(self) -> None:
    if self.epsilon > 0:
      return
    if self.beta2 != 1.0:
      raise ValueError(
        f"{type(self).__name__}: epsilon must be > 0 when beta2 != 1, got "
        f"epsilon={self.epsilon!r} (the decaying accumulator can reach 0, "
        "and 0 ** (-1 / exponent) * 0 is NaN)"
      )
    self._require_positive_accumulator(
      "epsilon is 0, so a component whose gradient has always been 0 would "
      "be scaled by 0 ** (-1 / exponent)"
    )


@dataclasses.dataclass(frozen=True)
class AdamOptimizerSpec(OptimizerSpec):
  """Adam with bias correction from the true step (`t = step + 1`)."""

  kernel_name: ClassVar[str] = "adam"

  learning_rate: LearningRate = 0.001
  beta_1: float = 0.9
  beta_2: float = 0.999
  epsilon: float = 1e-08


@dataclasses.dataclass(frozen=True)
class FTRLOptimizerSpec(OptimizerSpec):
  """Follow-the-regularized-leader, as upstream."""

  kernel_name: ClassVar[str] = "ftrl"

  learning_rate: LearningRate = 0.01
  learning_rate_power: float = -0.5
  l1_regularization_strength: float = 0.0
  l2_regularization_strength: float = 0.0
  beta: float = 0.0
  initial_accumulator_value: float = 0.1
  initial_linear_value: float = 0.0
  multiply_linear_by_learning_rate: bool = False

  def _check_accumulator(self) -> None:
    if self.initial_accumulator_value > 0:
      return
    if self.learning_rate_power > 0:
      self._require_positive_accumulator(
        "0 ** -learning_rate_power is infinite for a positive "
        "learning_rate_power"
      )
    if self.beta > 0 or self.l2_regularization_strength > 0:
      return
    self._require_positive_accumulator(
      "with beta = l2 = 0 a component whose gradient has always been 0 "
      "would be divided by accumulator ** -learning_rate_power = 0"
    )


# ---------------------------------------------------------------------------
# Stacking records.


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSettingInStack:
  """Where one table sits inside its stack.

  Attributes:
    stack_name: The stack's name (the table's own name when not stacked).
    padded_vocab_size: `vocabulary_size` rounded up to a multiple of `8 * N`.
    padded_embedding_dim: The stack's row width (a multiple of 8).
    row_offset_in_shard: First row of this table inside every shard.
    shard_rotation: Logical id `i` lives on shard `(i % N + rotation) % N`.
  """

  stack_name: str
  padded_vocab_size: int
  padded_embedding_dim: int
  row_offset_in_shard: int = 0
  shard_rotation: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackedTableSpec:
  """A stack of tables sharing one physical array, optimizer and limits.

  The preprocessing limits and buffer size are always read from here.
  """

  stack_name: str
  stack_vocab_size: int
  stack_embedding_dim: int
  optimizer: OptimizerSpec
  combiner: str
  total_sample_count: int
  max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION
  max_unique_ids_per_partition: int = DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION
  suggested_coo_buffer_size_per_device: int | None = None
  quantization_config: Any = None

  def __post_init__(self):
    owner = f"stack {self.stack_name!r}"
    _check_positive_int(owner, "stack_vocab_size", self.stack_vocab_size)
    _check_positive_int(owner, "stack_embedding_dim", self.stack_embedding_dim)
    _check_positive_int(owner, "total_sample_count", self.total_sample_count)
    _check_combiner(owner, self.combiner)
    _check_limits(owner, self)

  def replace(self, **changes: Any) -> StackedTableSpec:
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_spec(self, path, subtree_renderer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableSpec:
  """One logical embedding table.

  Attributes:
    name: Unique table name.
    vocabulary_size: Number of logical rows.
    embedding_dim: Logical row width.
    initializer: `(key, shape[, dtype]) -> array`, called once per shard.
    optimizer: The table's optimizer (shared by every table of its stack).
    combiner: "sum", "mean" or "sqrtn".
    max_ids_per_partition: Limit on (sample, id) pairs one SparseCore sends
      to one partition.
    max_unique_ids_per_partition: Limit on distinct ids one SparseCore sends
      to one partition.
    suggested_coo_buffer_size_per_device: Desired COO buffer length.
    quantization_config: A `QuantizationConfig`, or None.
    setting_in_stack: Filled by stacking / preparation.
    stacked_table_spec: Filled by stacking / preparation.
  """

  name: str
  vocabulary_size: int
  embedding_dim: int
  initializer: Initializer
  optimizer: OptimizerSpec
  combiner: str
  max_ids_per_partition: int = DEFAULT_MAX_IDS_PER_PARTITION
  max_unique_ids_per_partition: int = DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION
  suggested_coo_buffer_size_per_device: int | None = None
  quantization_config: Any = None
  setting_in_stack: TableSettingInStack | None = None
  stacked_table_spec: StackedTableSpec | None = None

  def __post_init__(self):
    owner = f"table {self.name!r}"
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"table name must be a non-empty string: {self.name!r}")
    _check_positive_int(owner, "vocabulary_size", self.vocabulary_size)
    _check_positive_int(owner, "embedding_dim", self.embedding_dim)
    _check_combiner(owner, self.combiner)
    _check_limits(owner, self)
    if not callable(self.initializer):
      raise ValueError(f"{owner}: initializer must be callable")
    if not isinstance(self.optimizer, OptimizerSpec):
      raise ValueError(
        f"{owner}: optimizer must be an OptimizerSpec, got {self.optimizer!r}"
      )
    if self.setting_in_stack is None:
      object.__setattr__(
        self,
        "setting_in_stack",
        TableSettingInStack(
          stack_name=self.name,
          padded_vocab_size=self.vocabulary_size,
          padded_embedding_dim=self.embedding_dim,
        ),
      )

  def replace(self, **changes: Any) -> TableSpec:
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_spec(self, path, subtree_renderer)


@dataclasses.dataclass(frozen=True)
class FeatureIdTransformation:
  """How a feature's ids and samples map into its stack.

  Attributes:
    row_offset: Offset of the feature's samples in the stack's global batch.
    col_offset: `row_offset_in_shard * N` of the feature's table.
    col_shift: The table's shard rotation.
  """

  row_offset: int = 0
  col_offset: int = 0
  col_shift: int = 0


def _as_shape(
  owner: str, field: str, shape: Any, ragged: bool = False
) -> tuple[int | None, ...]:
  """The shape as ints; if `ragged`, dimensions after the first may be None."""
  try:
    dims = tuple(
      None if ragged and i and d is None else int(d)
      for i, d in enumerate(shape)
    )
  except TypeError as e:
    raise ValueError(f"{owner}: {field} must be a sequence of ints") from e
  if not dims or any(d is not None and d <= 0 for d in dims):
    raise ValueError(
      f"{owner}: {field} must be non-empty and positive: {shape}"
    )
  return dims


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureSpec:
  """One input feature looked up in a table.

  Attributes:
    name: Unique feature name.
    table_spec: The table it looks up.
    input_shape: `[global_batch, valency]` (informative only).
    output_shape: `[*sample_dims, embedding_dim]`; `prod(output_shape[:-1])`
      is the feature's global sample count.
    id_transformation: Filled by stacking / preparation.
  """

  name: str
  table_spec: TableSpec
  input_shape: Sequence[int]
  output_shape: Sequence[int]
  id_transformation: FeatureIdTransformation | None = None

  def __post_init__(self):
    owner = f"feature {self.name!r}"
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(
        f"feature name must be a non-empty string: {self.name!r}"
      )
    if not isinstance(self.table_spec, TableSpec):
      raise ValueError(f"{owner}: table_spec must be a TableSpec")
    object.__setattr__(
      self,
      "input_shape",
      _as_shape(owner, "input_shape", self.input_shape, ragged=True),
    )
    object.__setattr__(
      self, "output_shape", _as_shape(owner, "output_shape", self.output_shape)
    )

  @property
  def sample_count(self) -> int:
    """The number of samples in the global batch: `prod(output_shape[:-1])`."""
    return math.prod(self.output_shape[:-1])

  def replace(self, **changes: Any) -> FeatureSpec:
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_spec(self, path, subtree_renderer)
