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
kernel needs no step of its own; so do LaProp's (its decay rate at the step)
and F2A's (the step itself, as a float). A `CustomOptimizerSpec` carries its
own row update, a JAX function, instead of a registry name.
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

from pz_sparsecore.core import hashed, optimizers

COMBINERS = ("sum", "mean", "sqrtn")
ID_KINDS = ("range", "hashed")
DEFAULT_MAX_IDS_PER_PARTITION = 256
DEFAULT_MAX_UNIQUE_IDS_PER_PARTITION = 256
DEFAULT_ACTIVATION_MEM_BYTES_LIMIT = 2 * 1024 * 1024
"""The activation bytes per SparseCore up to which `auto_stack_tables` puts
tables in one stack (2 MiB), recorded in the `StackedTableSpec`."""

Initializer = Callable[..., jax.Array]
LearningRate = float | Callable[..., Any]


# jax.nn.initializers whose draw of shape (r, d) is the first r rows of
# their draw of shape (R, d) >= r with the same key (with partitionable
# threefry: each value's counter is its index in the flattened array).
_PREFIX_CONSISTENT = frozenset(
  f"{name}.<locals>.init"
  for name in ("normal", "uniform", "truncated_normal", "constant")
)


_INITIALIZERS_MODULE = jax.nn.initializers.normal(1.0).__module__


def initializer_draw_key(init: Any) -> Any:
  """A key shared by initializers that draw the same rows from one key
  whatever the row count (so one draw serves all of them), or None.

  Only `jax.nn.initializers`' normal, uniform, truncated normal, constant,
  zeros and ones qualify, and only with their settings equal; others (the
  variance-scaling family depends on the shape; user functions are not
  known) get a draw of their own shape, as every table did before.
  """
  if not jax.config.jax_threefry_partitionable:
    return None
  if init is jax.nn.initializers.zeros or init is jax.nn.initializers.ones:
    return (init.__name__,)
  if (
    getattr(init, "__module__", None) != _INITIALIZERS_MODULE
    or getattr(init, "__qualname__", None) not in _PREFIX_CONSISTENT
  ):
    return None
  try:
    key = (
      init.__qualname__,
      tuple(c.cell_contents for c in init.__closure__ or ()),
      init.__defaults__,
      tuple(sorted((init.__kwdefaults__ or {}).items())),
    )
    hash(key)
  except (TypeError, ValueError):  # e.g. an array setting
    return None
  return key


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


TABLE_DTYPES = ("float32", "bfloat16", "float16")
"""A table's storage dtypes: rows are read widened to float32 and the
fused update writes a 16-bit row back by stochastic rounding (seeded from
the step, so runs are reproducible); optimizer slots stay float32."""


def table_dtype(owner: str, dtype: Any, field: str = "dtype") -> Any:
  """``dtype`` as a ``jnp.dtype`` if it is one of ``TABLE_DTYPES``.

  Raises:
    ValueError: Naming ``owner``, ``field`` and the value otherwise.
  """
  try:
    value = jnp.dtype(dtype)
  except TypeError:
    value = None
  if value is None or value.name not in TABLE_DTYPES:
    raise ValueError(
      f"{owner}: {field} must be one of {TABLE_DTYPES}, got {dtype!r}"
    )
  return value


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


def not_a_feature_spec(leaf: Any) -> ValueError:
  """The error for a spec tree leaf that is not a `FeatureSpec`."""
  kind = type(leaf)
  hint = ""
  if kind.__module__.startswith("pz_sparsecore.compat"):
    hint = (
      " (a compat spec: pass pz_sparsecore.compat.lib.nn.embedding_spec."
      "to_pz(feature_specs))"
    )
  return ValueError(
    "expected pz_sparsecore.FeatureSpec leaves, got "
    f"{kind.__module__}.{kind.__qualname__}{hint}"
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
    self._check_hyperparameters()

  def _check_hyperparameters(self) -> None:
    """Refuses values for which an update is undefined (0 / 0, the root
    of a negative number) or that upstream does not support."""

  def _require(self, field: str, ok: bool, rule: str, why: str) -> None:
    """Raises a ValueError naming the optimizer and `field` unless `ok`."""
    if not ok:
      raise ValueError(
        f"{type(self).__name__}: {field} must be {rule}, got "
        f"{getattr(self, field)!r} ({why})"
      )

  def _require_positive_accumulator(self, why: str) -> None:
    self._require(
      "initial_accumulator_value",
      self.initial_accumulator_value > 0,
      "> 0",
      why,
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
    self,
    step: jax.Array | int | None = None,
    *,
    embedding_dim: int | None = None,
  ) -> tuple[jax.Array, ...]:
    """The float32 hyper-parameters of the update at `step`, in kernel order.

    `embedding_dim`: the table's own width, which a row-wise optimizer's
    mean over a row divides by (`definition.needs_logical_dim`; ignored by
    the others).

    Raises:
      ValueError: If the optimizer needs `embedding_dim` and it is missing.
    """
    context = {}
    if self.definition.needs_logical_dim:
      if embedding_dim is None:
        raise ValueError(
          f"{type(self).__name__}: the hyper-parameters need the table's "
          "embedding_dim (its row-wise mean divides by it); pass "
          "embedding_dim"
        )
      context["embedding_dim"] = embedding_dim
    return self.definition.hyperparameters(
      self, self.get_learning_rate(step), step, **context
    )

  def slot_shapes(self) -> tuple[optimizers.SlotShape | int, ...]:
    """Each slot's values per row, in kernel order (`SlotShape` or int)."""
    return tuple(s.shape for s in self.definition.slots)

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


_ZERO_OVER_ZERO = (
  "a row component whose gradient has always been 0 would be updated by "
  "0 / sqrt(0)"
)
"""Why an Adagrad-style accumulator must start above 0."""


def _constant(value: float) -> Initializer:
  return jax.nn.initializers.constant(value, dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class SGDOptimizerSpec(OptimizerSpec):
  """Plain SGD: `w <- w - lr * g`."""

  kernel_name: ClassVar[str] = "sgd"

  learning_rate: LearningRate = 0.001


@dataclasses.dataclass(frozen=True)
class AdagradOptimizerSpec(OptimizerSpec):
  """Adagrad: `a <- a + g**2; w <- w - lr * g / sqrt(a)`.

  With `initial_accumulator_value=0` (accepted, as upstream), a component
  whose accumulator is still 0 is not changed (upstream writes 0 / 0).
  """

  kernel_name: ClassVar[str] = "adagrad"

  learning_rate: LearningRate = 0.001
  initial_accumulator_value: float = 0.1

  def _check_hyperparameters(self) -> None:
    self._require(
      "initial_accumulator_value",
      self.initial_accumulator_value >= 0,
      ">= 0",
      "the square root of a negative accumulator",
    )


@dataclasses.dataclass(frozen=True)
class RowwiseAdagradOptimizerSpec(OptimizerSpec):
  """Exact row-wise Adagrad (FBGEMM's `EXACT_ROWWISE_ADAGRAD`): one
  accumulator per table row instead of one per element.

  For a row `w` (the table's `D = embedding_dim` values) and its summed
  gradient `g`, with `wd = weight_decay`::

    g' = g + wd * w                  (mode "l2"; else g' = g)
    a  <- a + sum(g'**2) / D         (the mean square over the row)
    m  =  learning_rate / (sqrt(a) + epsilon)
    w  <- c * w - m * g              (the raw g)

  with `c = 1 - m * wd` (mode "l2"), `1 - learning_rate * wd`
  ("decoupled") or `1` ("none"). The accumulator is a `"rowwise_1d"` slot:
  4 bytes per row where Adagrad keeps `4 * D`. Defaults are FBGEMM's (the
  accumulator starts at 0).

  `D` is the table's own width, also when the table is padded to a wider
  stack: the sum runs over the table's own `D` columns and divides by `D`,
  so tables of a stack with this optimizer must have the same
  `embedding_dim`. As for every optimizer, a
  row referenced in several minibatches of a step is updated once per
  minibatch.
  """

  kernel_name: ClassVar[str] = "rowwise_adagrad"

  learning_rate: LearningRate = 0.01
  epsilon: float = 1e-8
  initial_accumulator_value: float = 0.0
  weight_decay: float = 0.0
  weight_decay_mode: str = "none"

  def _check_hyperparameters(self) -> None:
    self._require(
      "epsilon", self.epsilon >= 0, ">= 0", "it is added to a square root"
    )
    self._require(
      "initial_accumulator_value",
      self.initial_accumulator_value >= 0,
      ">= 0",
      "the square root of a negative accumulator",
    )
    self._require(
      "weight_decay", self.weight_decay >= 0, ">= 0", "it shrinks the rows"
    )
    self._require(
      "weight_decay_mode",
      self.weight_decay_mode in ("none", "l2", "decoupled"),
      "'none', 'l2' or 'decoupled'",
      "FBGEMM's modes",
    )
    if self.epsilon == 0 and self.initial_accumulator_value == 0:
      raise ValueError(
        f"{type(self).__name__}: epsilon and initial_accumulator_value "
        "cannot both be 0: a row whose gradient has always been 0 would be "
        "updated by 0 * lr / sqrt(0)"
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

  def _check_hyperparameters(self) -> None:
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

  def _check_hyperparameters(self) -> None:
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


@dataclasses.dataclass(frozen=True)
class LaPropOptimizerSpec(OptimizerSpec):
  """LaProp (arXiv 2002.04839), as upstream: momentum on the normalised step.

  At step `t`, with `decay = get_decay_rate(t)` (a bias-corrected `b2`):
  `nu <- decay nu + (1 - decay)(g**2 + eps)`,
  `mu <- b1 mu + sqrt(1 - b1**2) g / sqrt(nu)`, `w <- w - lr mu`.
  Both slots start at `initial_slot_value`. Upstream does not implement
  `rms_clip_threshold`; it must be None.
  """

  kernel_name: ClassVar[str] = "laprop"

  learning_rate: LearningRate = 0.001
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-30
  rms_clip_threshold: float | None = None
  initial_slot_value: float = 0.0

  def _check_hyperparameters(self) -> None:
    self._require(
      "rms_clip_threshold",
      self.rms_clip_threshold is None,
      "None",
      "clipping by RMS is not supported, as upstream",
    )
    self._require(
      "b1", 0 <= self.b1 <= 1, "in [0, 1]", "the step scales by sqrt(1 - b1**2)"
    )
    self._require(
      "b2",
      0 <= self.b2 < 1,
      "in [0, 1)",
      "the decay rate b2 (1 - b2**t) / (1 - b2**(t + 1)) is 0 / 0 at b2 = 1",
    )
    self._require(
      "eps",
      self.eps > 0,
      "> 0",
      "a row whose gradient is 0 at step 0 would be updated by 0 / sqrt(0)",
    )
    self._require(
      "initial_slot_value",
      self.initial_slot_value >= 0,
      ">= 0",
      "it is nu's initial value, and a negative nu can make sqrt(nu) NaN",
    )

  def get_decay_rate(self, step: jax.Array | int | None = None) -> jax.Array:
    """The decay of `nu` at `step`: `b2 (1 - b2**t) / (1 - b2**(t + 1))`.

    It is 0 at step 0 and tends to `b2`; without a step it is `b2`.

    Returns:
      A float32 scalar.
    """
    b2 = jnp.float32(self.b2)
    if step is None:
      return b2
    t = jnp.asarray(step, jnp.float32)
    return b2 * (1.0 - b2**t) / (1.0 - b2 ** (t + 1.0))


@dataclasses.dataclass(frozen=True)
class F2AOptimizerSpec(OptimizerSpec):
  """Frequency-aware Adagrad (F2A), as upstream.

  At global step `t` (`get_hyperparameters(t)`; 0 without a step), for a
  row with slots accumulator `a` and local step `n` (how many steps have
  updated it): `n <- n + 1`,
  `f = min((max(t, 1) / n)**rho, max_lr_multiplier)`, `a <- a + g**2`,
  `w <- w - lr (f g / sqrt(a) + l1 sign(w) + l2 w)`: rarely seen rows take
  larger steps.
  """

  kernel_name: ClassVar[str] = "f2a"

  learning_rate: LearningRate = 0.01
  rho: float = 0.5
  initial_accumulator_value: float = 0.1
  initial_local_step_value: float = 0.0
  l1_regularization_strength: float = 0.0
  l2_regularization_strength: float = 0.0
  max_lr_multiplier: float = 1e6

  def _check_hyperparameters(self) -> None:
    self._require_positive_accumulator(_ZERO_OVER_ZERO)
    self._require(
      "initial_local_step_value",
      self.initial_local_step_value >= 0,
      ">= 0",
      "it counts the updates of a row",
    )
    for field in ("l1_regularization_strength", "l2_regularization_strength"):
      self._require(
        field, getattr(self, field) >= 0, ">= 0", "a regularisation strength"
      )
    self._require(
      "max_lr_multiplier",
      self.max_lr_multiplier > 0,
      "> 0",
      "it caps the learning-rate multiplier",
    )

  def get_hyperparameters(
    self,
    step: jax.Array | int | None = None,
    *,
    embedding_dim: int | None = None,
  ) -> tuple[jax.Array, ...]:
    """`(lr, rho, l1, l2, max_lr_multiplier, step)` at `step` (None: 0)."""
    return super().get_hyperparameters(
      0 if step is None else step, embedding_dim=embedding_dim
    )


def _accepts(fn: Callable[..., Any], num_args: int) -> bool:
  """Whether `fn` can be called with `num_args` positional arguments (True
  when its signature cannot be read)."""
  try:
    inspect.signature(fn).bind(*range(num_args))
  except TypeError:
    return False
  except ValueError:
    return True
  return True


@dataclasses.dataclass(frozen=True)
class CustomOptimizerSpec(OptimizerSpec):
  """An optimizer given as a JAX function of one row, as upstream.

  `custom_computation_fn(grad, table, *slots, learning_rate)` receives one
  table row, its summed gradient, its slots and the learning rate, and
  returns the new row, or the tuple `(new_row, *new_slots)`. The row, the
  gradient and the learning rate are float32 `[1, dim]` arrays; slot `i`'s
  row is shaped by `slot_shapes[i]`, as upstream: `[1, dim]` for "table"
  (the default, also for every slot when `slot_shapes` is None), `[1]` for
  "rowwise_1d" (one value per table row) and `[1, k]` for an int `k`; the
  function returns each slot in its shape. `dim` is the stack's width: a
  table narrower than its stack sees zero padding columns. Slot `i` starts
  from `slot_variable_initializers_tuple[i]` and is named by the tuple's
  field (a NamedTuple) or `slot_{i}`. Example, Adagrad::

    def adagrad(grad, table, accumulator, lr):
      accumulator = accumulator + grad * grad
      return table - lr * grad / jnp.sqrt(accumulator), accumulator

    CustomOptimizerSpec(0.1, adagrad, (jax.nn.initializers.constant(0.1),))

  and with one accumulator per row::

    def rowwise(grad, table, accumulator, lr):
      accumulator = accumulator + jnp.mean(grad * grad)
      return table - lr * grad / jnp.sqrt(accumulator), accumulator

    CustomOptimizerSpec(
      0.1, rowwise, (jax.nn.initializers.constant(0.1),),
      slot_shapes=("rowwise_1d",),
    )

  Implementation: pure JAX, with no compiled handler on any platform. The
  fused update (the reference backward, `kernels.reference`) sums the
  gradient of each row the batch references, gathers those rows and their
  slots, applies the function to them (vmapped over the rows: exactly
  upstream's per-row call) and scatters them back into the donated table
  and slots, in place: O(referenced rows x dim), never O(vocabulary), and
  deterministic. `implementation="ffi"` is an error.
  """

  kernel_name: ClassVar[str] = "custom"

  learning_rate: LearningRate = 0.001
  custom_computation_fn: Callable[..., Any] | None = None
  slot_variable_initializers_tuple: tuple[Initializer, ...] = ()
  short_name_str: str = "custom"
  slot_shapes: tuple[optimizers.SlotShapeLike, ...] | None = None

  def _check_hyperparameters(self) -> None:
    self._require(
      "custom_computation_fn",
      callable(self.custom_computation_fn),
      "a callable",
      "it is the optimizer's row update",
    )
    inits = self.slot_variable_initializers_tuple
    if isinstance(inits, list):
      object.__setattr__(self, "slot_variable_initializers_tuple", tuple(inits))
    self._require(
      "slot_variable_initializers_tuple",
      isinstance(inits, (tuple, list)) and all(map(callable, inits)),
      "a tuple of initializers",
      "one per slot",
    )
    self._require(
      "short_name_str",
      isinstance(self.short_name_str, str) and bool(self.short_name_str),
      "a non-empty string",
      "it names the optimizer",
    )
    num_slots = len(self.slot_variable_initializers_tuple)
    if self.slot_shapes is not None:
      shapes = self.slot_shapes
      if isinstance(shapes, list):
        shapes = tuple(shapes)
      self._require(
        "slot_shapes",
        isinstance(shapes, tuple) and len(shapes) == num_slots,
        f"a tuple of {num_slots} slot shapes",
        "one per slot initializer",
      )
      try:
        shapes = tuple(map(optimizers.slot_shape, shapes))
      except ValueError as e:
        raise ValueError(f"{type(self).__name__}: {e}") from None
      object.__setattr__(self, "slot_shapes", shapes)
    self._require(
      "custom_computation_fn",
      _accepts(self.custom_computation_fn, 2 + num_slots + 1),
      f"a function of {2 + num_slots + 1} arguments",
      f"it is called as fn(grad, table, *{num_slots} slots, learning_rate)",
    )

  @property
  def definition(self) -> optimizers.Optimizer:
    """The optimizer's entry, made from `custom_computation_fn`."""
    return optimizers.custom(
      self.short_name_str,
      self.custom_computation_fn,
      self.slot_names(),
      self.slot_shapes,
    )

  def short_name(self) -> str:
    return self.short_name_str

  def slot_variables_initializers(self) -> tuple[Initializer, ...]:
    return self.slot_variable_initializers_tuple

  def slot_names(self) -> tuple[str, ...]:
    inits = self.slot_variable_initializers_tuple
    return tuple(
      getattr(inits, "_fields", None)
      or (f"slot_{i}" for i in range(len(inits)))
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
  dtype: Any = jnp.float32
  activation_mem_bytes_limit: int = DEFAULT_ACTIVATION_MEM_BYTES_LIMIT

  def __post_init__(self):
    owner = f"stack {self.stack_name!r}"
    _check_positive_int(
      owner, "activation_mem_bytes_limit", self.activation_mem_bytes_limit
    )
    object.__setattr__(self, "dtype", table_dtype(owner, self.dtype))
    _check_positive_int(owner, "stack_vocab_size", self.stack_vocab_size)
    _check_positive_int(owner, "stack_embedding_dim", self.stack_embedding_dim)
    _check_positive_int(owner, "total_sample_count", self.total_sample_count)
    _check_combiner(owner, self.combiner)
    _check_limits(owner, self)

  def replace(self, **changes: Any) -> StackedTableSpec:
    """A copy with `changes` applied."""
    return dataclasses.replace(self, **changes)


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
    dtype: How the rows are stored: float32 (the default), bfloat16 or
      float16 (`TABLE_DTYPES`). A 16-bit table takes half the memory; its
      rows are read widened to float32 (activations are float32), updated
      in float32 and written back by stochastic rounding, seeded from the
      optimizer step so that a run is reproducible. Its slots stay float32
      (a row-wise optimizer's: 4 bytes per row). Tables of different dtypes
      never share a stack.
    activation_dtype: The dtype of the activations of the table's features:
      float32 (the default; the lookup sums in float32), or bfloat16 or
      float16, to which the float32 sums are rounded to nearest (a model
      that computes in 16 bits takes them as they are; set it to the
      table's `dtype` to get activations in the dtype the rows are stored
      in). Their gradients may come in that dtype or float32; the update
      reads them as float32. Tables of different activation dtypes may
      share a stack.
    ids: `"range"` (the default): ids lie in `[0, vocabulary_size)`.
      `"hashed"`: raw ids, any int64 or strings / bytes, each given a row of
      its own on its owner shard while room allows (`core.hashed`);
      `vocabulary_size` is then the rows the table can hold. A hashed table
      is always alone in its stack.
    eviction: For a hashed table, what happens when an id finds no free row:
      an `Eviction`, or a policy name (`"lru"`, `"lfu"`, `"ttl"`,
      `"none"`); None: `"lru"`. Must be None for a `"range"` table.
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
  dtype: Any = jnp.float32
  activation_dtype: Any = jnp.float32
  ids: str = "range"
  eviction: Any = None

  def __post_init__(self):
    owner = f"table {self.name!r}"
    if self.ids not in ID_KINDS:
      raise ValueError(
        f"{owner}: ids must be one of {ID_KINDS}, got {self.ids!r}"
      )
    if self.ids == "hashed":
      object.__setattr__(
        self, "eviction", hashed.as_eviction(self.name, self.eviction)
      )
    elif self.eviction is not None:
      raise ValueError(
        f"{owner}: eviction is for hashed tables (ids='hashed'), got "
        f"eviction={self.eviction!r} with ids={self.ids!r}"
      )
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"table name must be a non-empty string: {self.name!r}")
    object.__setattr__(self, "dtype", table_dtype(owner, self.dtype))
    object.__setattr__(
      self,
      "activation_dtype",
      table_dtype(owner, self.activation_dtype, "activation_dtype"),
    )
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

  @property
  def is_hashed(self) -> bool:
    """Whether the table takes raw ids (`ids="hashed"`)."""
    return self.ids == "hashed"


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
    output_shape: `[*sample_dims, width]`; `prod(output_shape[:-1])` is the
      feature's global sample count. `width` is at most the table's
      `embedding_dim`: a narrower feature gets the first `width` columns of
      each row, as in jax-tpu-embedding (its activations are sliced;
      gradients reach those columns only). A wider one is an error.
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
