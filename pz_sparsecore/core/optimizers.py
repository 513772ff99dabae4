"""The optimizer registry: one entry per optimizer of the fused update.

An entry says everything the rest of the package needs to know about one
optimizer: the kernel name, its slot variables (names, in operand order, and
the spec field holding each one's initial value), its hyper-parameters (names
and order of the float32 vector the kernels read, and how a spec computes
them at a step), its static attributes (compile-time switches passed to the
kernels), and its per-row update as a JAX function. That function is the
reference the C++ and CUDA row updates (`csrc/optimizers.h`) are tested
against; the equations are upstream's (its primitives
`sparse_dense_matmul_grad_with_<name>.py`).

A custom optimizer (`specs.CustomOptimizerSpec`) is an entry too, made from
the user's function by `custom`: not in the registry, and with no compiled
handler (`compiled=False`), so its update always runs as JAX.

The optimizer specs (`specs.py`) read their slots and hyper-parameters from
here; the reference kernel, the FFI wrappers and the routing look entries up
by name instead of branching on strings. The compiled extension describes
its optimizer handlers (`optimizers()`, generated from
`csrc/optimizer_list.h`); loading it checks that description against the
compiled entries here (names, targets, slot and hyper-parameter counts;
`device/kernels/ffi.py`), and a difference is a stale build.

Example: Adagrad has one slot, `accumulator`, initialised from the spec's
`initial_accumulator_value`, and reads `(learning_rate,)`; for a row `w`
with gradient `g`: `a <- a + g**2; w <- w - lr * g / sqrt(a)`.

Adding an optimizer, say `foo` with slots `(a, b)` and hyper-parameters
`(learning_rate, x)`:

1. Its spec, in `core/specs.py`: a frozen dataclass
   `FooOptimizerSpec(OptimizerSpec)` with `kernel_name = "foo"`, the field
   `learning_rate` and one field per hyper-parameter and initial slot value
   (upstream's names and defaults, in upstream's order), and
   `_check_hyperparameters` refusing values where the update is undefined;
   export it in `pz_sparsecore/__init__.py` (`_EXPORTS`).
2. Its entry in `REGISTRY` below:
   `Optimizer("foo", (Slot("a", "initial_a_value",
   domain=SlotDomain.NONNEGATIVE), Slot("b", domain=SlotDomain.REAL)),
   ("learning_rate", "x"), _lr_and("x"), _foo)`, with `_foo(w, slots, g, h)`
   its row update in JAX (the reference). Each slot names its domain, the
   values it holds in training (`SlotDomain`; a sum of squares is
   `NONNEGATIVE`): the tests draw its values from there, and a slot left at
   the default `REAL` whose update needs `a >= 0` gets negative values and
   NaN updates, which fail the tests.
3. Its C++ and CUDA row update, in `csrc/optimizers.h` (host and device
   code: both handler families run it):
   `PZSC_HOST_DEVICE void FooElement(const Hyperparameters& h, float& w,
   float& a, float& b, float g)`, the slots in the entry's order; and one
   line in `csrc/optimizer_list.h`: `X(Foo, foo, 2, 2, Element, Table,
   Table)` (C++ name, registry name, slot count, hyper-parameter count, the
   rule's kind, each slot's shape or None). The enum, the CPU and CUDA
   handlers (FFI target `pzsc_sparse_dense_matmul_grad_foo`), their
   registration and the extension's `optimizers()` come from that line; the
   ABI version stays as it is. Rebuild the extension.
4. If upstream has it, its compat names in
   `compat/lib/nn/embedding_spec.py`: `class FooOptimizerSpec(OptimizerSpec)`
   (fields and defaults come from the frozen spec) and
   `FooSlotVariables = _slot_variables("Foo")`, both in `__all__`; and
   upstream's module
   `compat/lib/core/primitives/sparse_dense_matmul_grad_with_foo.py`, a copy
   of a sibling's three lines with the name changed.
5. Its test hyper-parameters in `tests/test_kernels.py` (`HYPERPARAMETERS`,
   `GRAD_CASES`: the compiled update against `_foo`), and nothing else
   there: the kernel, fuzz and optimizer tests draw every slot from its
   domain (`tests/numerics.py`, `draw_slot`; no test picks values by an
   optimizer's name), compare outputs with `numerics.assert_close`, which
   counts a NaN or an infinity as a mismatch even where both sides have it
   (only a case about NaN says `allow_nan=True`), and take no optimizer by
   its place in the registry. `tests/test_optimizer_list.py` checks that
   the lists above agree and that the spec's initial slot values lie in
   their domains.

An optimizer whose slots hold one value per row (`Slot(...,
shape=SlotShape.ROWWISE_1D)`, as row-wise Adagrad's) is a row rule in C++:
`FooRowTerm(h, col, w, g)` (one element's term of the row's sum),
`FooRow(h, float& slot..., float sum)` (updates the row's slot values
once, returns a `FooRowState`) and `FooElement(h, const FooRowState&,
float& w, float g)`; its list line says `Row` and `Row` for each slot. Its
update in JAX takes `[n, 1]` slot rows. Slots of an int width have no
compiled handler (custom optimizers only).

A new static attribute (a compile-time switch, as FTRL's
`multiply_linear_by_learning_rate`) is a spec field named in
`static_attributes`, a field of `Hyperparameters` in `csrc/optimizers.h`
and an attribute every backward handler binds (`PZSC_BIND_GRAD_OPERANDS` in
`csrc/coo_layout.h`, and a parameter of `SparseDenseMatmulGradImpl` and
`GradCudaImpl`): that changes the handlers' ABI, so bump `kAbiVersion`
(`device/kernels/abi_version.h`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp

Rows = jax.Array
RowUpdate = Callable[..., tuple[Rows, tuple[Rows, ...]]]


class SlotShape(enum.StrEnum):
  """How many values a slot variable holds per table row.

  `TABLE`: one per table element (the slot is shaped like the table,
  `(vocab, dim)`); `ROWWISE_1D`: one per row (`(vocab,)`). A slot may also
  declare an int `k`: `k` values per row (`(vocab, k)`; custom optimizers
  only). The string values are upstream's (`"table"`, `"rowwise_1d"`; its
  `"1d"` is accepted for the latter), so upstream's literals compare equal.
  """

  TABLE = "table"
  ROWWISE_1D = "rowwise_1d"


SlotShapeLike = SlotShape | Literal["table", "rowwise_1d", "1d"] | int | None
"""What a slot shape may be given as (upstream's `SlotShapeType`)."""


def slot_shape(value: SlotShapeLike) -> SlotShape | int:
  """`value` as a `SlotShape`, or an int width >= 1.

  Raises:
    ValueError: If `value` is none of `SlotShapeLike`.
  """
  if value is None:
    return SlotShape.TABLE
  if isinstance(value, SlotShape):
    return value
  if isinstance(value, str):
    if value == "1d":
      return SlotShape.ROWWISE_1D
    try:
      return SlotShape(value)
    except ValueError:
      pass
  elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
    return value
  raise ValueError(
    f"slot shape {value!r}: expected 'table', 'rowwise_1d' (or '1d'), None "
    "or an int width >= 1"
  )


class SlotDomain(enum.StrEnum):
  """The values a slot variable holds in training, where its update is
  defined.

  `REAL`: any real number (momenta, FTRL's linear term; the default).
  `NONNEGATIVE`: >= 0 (sums of squared gradients: Adagrad's accumulators,
  Adam's velocity). `POSITIVE`: > 0 (an accumulator that the update divides
  by with no guard for 0, F2A's). `COUNT`: a whole number >= 0 (F2A's count
  of a row's updates). A spec's initial value lies in its slot's domain, and
  the kernel tests draw slot values from it: a value outside it (a negative
  accumulator) makes the update NaN on every side, which the tests count as
  a failure.
  """

  REAL = "real"
  NONNEGATIVE = "nonnegative"
  POSITIVE = "positive"
  COUNT = "count"


@dataclasses.dataclass(frozen=True)
class Slot:
  """One slot variable of an optimizer.

  Attributes:
    name: The slot's name (variable labels end in it).
    initial_value_field: The spec field holding its initial value, or None
      for a slot that starts at 0.
    shape: Values per table row (`SlotShape` or an int width); physically
      every slot is `[shards, rows per shard, width(dim)]`.
    domain: The values it holds (`SlotDomain`).
  """

  name: str
  initial_value_field: str | None = None
  shape: SlotShape | int = SlotShape.TABLE
  domain: SlotDomain = SlotDomain.REAL

  def __post_init__(self):
    object.__setattr__(self, "shape", slot_shape(self.shape))
    object.__setattr__(self, "domain", SlotDomain(self.domain))

  def width(self, dim: int) -> int:
    """Values per row in a table (or stack) `dim` wide."""
    if self.shape is SlotShape.TABLE:
      return dim
    if self.shape is SlotShape.ROWWISE_1D:
      return 1
    return self.shape

  def logical_shape(self, vocab: int, dim: int) -> tuple[int, ...]:
    """The slot's shape for one table (upstream's): `(vocab, dim)`,
    `(vocab,)` or `(vocab, k)`."""
    if self.shape is SlotShape.ROWWISE_1D:
      return (vocab,)
    return (vocab, self.width(dim))

  @property
  def shape_text(self) -> str:
    """`"table"`, `"rowwise_1d"` or the width, as checkpoints record it."""
    return str(self.shape)


@dataclasses.dataclass(frozen=True)
class Optimizer:
  """One optimizer of the fused update.

  Attributes:
    name: The kernels' name (`"adagrad"`; FFI target suffix).
    slots: The slot variables, in operand order.
    hyperparameter_names: The entries of the hyper-parameter vector.
    hyperparameters: `(spec, learning_rate, step) -> tuple` of float32
      scalars in `hyperparameter_names` order.
    update: `(rows, slot_rows, grads, h, **static) -> (rows, slot_rows)`
      on `[n, dim]` rows and `[n, width]` slot rows (each slot's
      `Slot.width(dim)`); `h` is the hyper-parameter vector.
    static_attributes: Spec fields passed to the kernels as compile-time
      attributes (and to `update` as keywords).
    compiled: Whether the C++ handlers implement it (FFI target
      `pzsc_sparse_dense_matmul_grad_{name}`); False for a custom optimizer.
    needs_logical_dim: Whether the hyper-parameters include the table's own
      width (`hyperparameters(..., embedding_dim=d)`): a row-wise mean over a
      table padded to its stack's width divides by `d`, so every table of
      such a stack must have the same width.
  """

  name: str
  slots: tuple[Slot, ...]
  hyperparameter_names: tuple[str, ...]
  hyperparameters: Callable[..., tuple[jax.Array, ...]]
  update: RowUpdate
  static_attributes: tuple[str, ...] = ()
  compiled: bool = True
  needs_logical_dim: bool = False

  def __post_init__(self):
    if self.compiled and any(isinstance(s.shape, int) for s in self.slots):
      raise ValueError(
        f"optimizer {self.name!r}: slots of an int width have no compiled "
        "handler (only 'table' and 'rowwise_1d' slots do)"
      )

  @property
  def slot_names(self) -> tuple[str, ...]:
    return tuple(slot.name for slot in self.slots)

  def slot_widths(self, dim: int) -> tuple[int, ...]:
    """Each slot's values per row in a table (or stack) `dim` wide."""
    return tuple(slot.width(dim) for slot in self.slots)

  @functools.cached_property
  def slot_tuple_type(self) -> type:
    """The NamedTuple type of this optimizer's slot initialisers
    (`AdagradSlots(accumulator=...)`)."""
    type_name = "".join(part.title() for part in self.name.split("_"))
    return collections.namedtuple(type_name + "Slots", self.slot_names)


def _f32(x: Any) -> jax.Array:
  return jnp.asarray(x, dtype=jnp.float32)


# ---------------------------------------------------------------------------
# Row updates.


def _sgd(w, slots, g, h):
  del slots
  return w - h[0] * g, ()


def _adagrad(w, slots, g, h):
  (a,) = slots
  a = a + g * g
  # A component whose accumulator is still 0 (it started at 0 and its
  # gradient has always been 0) stays as it is.
  updated = w - h[0] * g / jnp.sqrt(jnp.where(a > 0, a, 1.0))
  return jnp.where(a > 0, updated, w), (a,)


def _adagrad_momentum(w, slots, g, h):
  a, m = slots
  lr, momentum, beta2, eps, exponent, nesterov = (h[i] for i in range(6))
  a = jnp.where(beta2 == 1.0, a + g * g, beta2 * a + (1.0 - beta2) * g * g)
  scaled = jnp.power(a + eps, -1.0 / exponent) * g
  m = momentum * m + scaled
  delta = jnp.where(nesterov != 0.0, momentum * m + scaled, m)
  return w - lr * delta, (a, m)


def _adam(w, slots, g, h):
  m, v = slots
  alpha, b1, b2, eps = (h[i] for i in range(4))
  m = m + (1.0 - b1) * (g - m)
  v = v + (1.0 - b2) * (g * g - v)
  return w - alpha * m / (jnp.sqrt(v) + eps), (m, v)


def _ftrl(w, slots, g, h, *, multiply_linear_by_learning_rate=False):
  a, lin = slots
  lr, k, l1, l2, beta = (h[i] for i in range(5))
  a_new = a + g * g
  p_new = jnp.power(a_new, -k)
  dp = p_new - jnp.power(a, -k)
  if multiply_linear_by_learning_rate:
    lin = lin + lr * g - dp * w
    l1s = l1 * lr
    den = p_new + 2.0 * lr * l2 + beta
  else:
    lin = lin + g - (dp / lr) * w
    l1s = l1
    den = (p_new + beta) / lr + 2.0 * l2
  num = jnp.where(l1 == 0.0, -lin, jnp.clip(lin, -l1s, l1s) - lin)
  return num / den, (a_new, lin)


def _laprop(w, slots, g, h):
  mu, nu = slots
  lr, b1, decay, eps = (h[i] for i in range(4))
  nu = decay * nu + (1.0 - decay) * (g * g + eps)
  mu = b1 * mu + jnp.sqrt(1.0 - b1 * b1) * (g / jnp.sqrt(nu))
  return w - lr * mu, (mu, nu)


def _f2a(w, slots, g, h):
  acc, local_step = slots
  lr, rho, l1, l2, max_multiplier, step = (h[i] for i in range(6))
  local_step = local_step + 1.0
  ratio = jnp.maximum(step, 1.0) / local_step
  multiplier = jnp.minimum(jnp.power(ratio, rho), max_multiplier)
  acc = acc + g * g
  update = multiplier * g / jnp.sqrt(acc) + (l1 * jnp.sign(w) + l2 * w)
  return w - lr * update, (acc, local_step)


def _rowwise_adagrad(w, slots, g, h):
  (a,) = slots  # [n, 1]
  lr, eps, dim, l2, decoupled = (h[i] for i in range(5))
  # The mean square over the table's own `dim` columns (a stack pads its
  # rows with columns that the initializer filled but no lookup reads).
  own = jnp.arange(w.shape[-1]) < dim
  gd = jnp.where(own, g + l2 * w, 0.0)
  a = a + jnp.sum(gd * gd, axis=-1, keepdims=True) / dim
  m = lr / (jnp.sqrt(a) + eps)
  return (1.0 - m * l2 - lr * decoupled) * w - m * g, (a,)


def _custom_update(
  name: str, fn: Callable, slots: tuple[Slot, ...]
) -> RowUpdate:
  """The row update of a custom optimizer: `fn` once per row, as upstream.

  Upstream calls `fn(grad, table, *slots, *hyperparameters)` on one row at
  a time, the table row, the gradient and the hyper-parameters (broadcast)
  float32 `[1, dim]` arrays, each slot row `[1, dim]` ("table" slots),
  `[1]` ("rowwise_1d") or `[1, k]` (width `k`), and reads back the new
  table row, or a tuple `(table, *slots)` in those shapes. Here `fn` is
  vmapped over the rows, so it sees exactly those shapes.
  """

  def view(slot, x):
    return x if slot.shape is SlotShape.ROWWISE_1D else x[None]

  def one_row(h, w, g, *slot_rows):
    dim = w.shape[-1]
    hyper = [jnp.broadcast_to(h[i], (1, dim)) for i in range(h.shape[0])]
    out = fn(
      g[None],
      w[None],
      *(view(s, x) for s, x in zip(slots, slot_rows, strict=True)),
      *hyper,
    )
    leaves = [jnp.asarray(x) for x in jax.tree.leaves(out)]
    want = [(1, dim)] + [
      (1,) if s.shape is SlotShape.ROWWISE_1D else (1, s.width(dim))
      for s in slots
    ]
    if len(leaves) != len(want) or any(
      x.shape != shape or x.dtype != jnp.float32
      for x, shape in zip(leaves, want, strict=True)
    ):
      raise ValueError(
        f"CustomOptimizerSpec {name!r}: custom_computation_fn must return "
        f"{len(want)} float32 arrays shaped {want} (the table row, then "
        f"each of its {len(slots)} slots), got "
        f"{[(x.dtype.name, x.shape) for x in leaves]}"
      )
    return tuple(x.reshape(-1) for x in leaves)

  def update(w, slots, g, h):
    new_w, *new_slots = jax.vmap(
      one_row, in_axes=(None, 0, 0) + (0,) * len(slots)
    )(h, w, g, *slots)
    return new_w, tuple(new_slots)

  return update


# ---------------------------------------------------------------------------
# Hyper-parameters at a step.


def _lr_and(*fields: str):
  """Hyper-parameters `(lr, *spec fields as float32)`."""

  def hyperparameters(spec, lr, step):
    del step
    return (lr, *(_f32(getattr(spec, field)) for field in fields))

  return hyperparameters


def _adam_hyper(spec, lr, step):
  """Bias correction for `t = step + 1`, folded into two scalars."""
  t = _f32(0 if step is None else step) + 1.0
  b1, b2 = jnp.float32(spec.beta_1), jnp.float32(spec.beta_2)
  c = jnp.sqrt(1.0 - b2**t)
  return (lr * c / (1.0 - b1**t), b1, b2, jnp.float32(spec.epsilon) * c)


def _laprop_hyper(spec, lr, step):
  """`(lr, b1, decay, eps)`, decay the spec's step-corrected b2."""
  return (lr, _f32(spec.b1), spec.get_decay_rate(step), _f32(spec.eps))


def _f2a_hyper(spec, lr, step):
  """`(lr, rho, l1, l2, max_lr_multiplier, step)`, the step as float32."""
  return (
    *_lr_and(
      "rho",
      "l1_regularization_strength",
      "l2_regularization_strength",
      "max_lr_multiplier",
    )(spec, lr, step),
    _f32(0 if step is None else step),
  )


def _rowwise_adagrad_hyper(spec, lr, step, *, embedding_dim):
  """`(lr, eps, embedding_dim, l2, decoupled)`: the weight decay in the
  entry of its mode, 0 in the other."""
  del step
  wd = _f32(spec.weight_decay)
  zero = jnp.float32(0.0)
  return (
    lr,
    _f32(spec.epsilon),
    _f32(embedding_dim),
    wd if spec.weight_decay_mode == "l2" else zero,
    wd if spec.weight_decay_mode == "decoupled" else zero,
  )


_ACCUMULATOR = Slot(
  "accumulator", "initial_accumulator_value", domain=SlotDomain.NONNEGATIVE
)

REGISTRY: dict[str, Optimizer] = {
  opt.name: opt
  for opt in (
    Optimizer("sgd", (), ("learning_rate",), _lr_and(), _sgd),
    Optimizer(
      "adagrad", (_ACCUMULATOR,), ("learning_rate",), _lr_and(), _adagrad
    ),
    Optimizer(
      "adagrad_momentum",
      (
        _ACCUMULATOR,
        Slot("momentum", "initial_momentum_value", domain=SlotDomain.REAL),
      ),
      (
        "learning_rate",
        "momentum",
        "beta2",
        "epsilon",
        "exponent",
        "use_nesterov",
      ),
      _lr_and("momentum", "beta2", "epsilon", "exponent", "use_nesterov"),
      _adagrad_momentum,
    ),
    Optimizer(
      "adam",
      (
        Slot("momentum", domain=SlotDomain.REAL),
        Slot("velocity", domain=SlotDomain.NONNEGATIVE),
      ),
      ("alpha_t", "beta_1", "beta_2", "epsilon_hat"),
      _adam_hyper,
      _adam,
    ),
    Optimizer(
      "ftrl",
      (
        _ACCUMULATOR,
        Slot("linear", "initial_linear_value", domain=SlotDomain.REAL),
      ),
      ("learning_rate", "learning_rate_power", "l1", "l2", "beta"),
      _lr_and(
        "learning_rate_power",
        "l1_regularization_strength",
        "l2_regularization_strength",
        "beta",
      ),
      _ftrl,
      static_attributes=("multiply_linear_by_learning_rate",),
    ),
    Optimizer(
      "laprop",
      (
        Slot("mu", "initial_slot_value", domain=SlotDomain.REAL),
        Slot("nu", "initial_slot_value", domain=SlotDomain.NONNEGATIVE),
      ),
      ("learning_rate", "b1", "decay_rate", "eps"),
      _laprop_hyper,
      _laprop,
    ),
    Optimizer(
      "f2a",
      (
        Slot(
          "accumulator",
          "initial_accumulator_value",
          domain=SlotDomain.POSITIVE,
        ),
        Slot("local_step", "initial_local_step_value", domain=SlotDomain.COUNT),
      ),
      ("learning_rate", "rho", "l1", "l2", "max_lr_multiplier", "step"),
      _f2a_hyper,
      _f2a,
    ),
    Optimizer(
      "rowwise_adagrad",
      (
        Slot(
          "accumulator",
          "initial_accumulator_value",
          SlotShape.ROWWISE_1D,
          SlotDomain.NONNEGATIVE,
        ),
      ),
      (
        "learning_rate",
        "epsilon",
        "embedding_dim",
        "l2_weight_decay",
        "decoupled_weight_decay",
      ),
      _rowwise_adagrad_hyper,
      _rowwise_adagrad,
      needs_logical_dim=True,
    ),
  )
}
"""Optimizers of the fused update, by kernel name."""


def custom(
  name: str,
  fn: Callable,
  slot_names: tuple[str, ...],
  slot_shapes: tuple[SlotShapeLike, ...] | None = None,
) -> Optimizer:
  """The entry of a custom optimizer: `fn` (upstream's calling convention,
  see `_custom_update`) with slots `slot_names` of `slot_shapes` (all
  "table" when None), reading `(learning_rate,)`.
  """
  shapes = slot_shapes or (None,) * len(slot_names)
  slots = tuple(
    Slot(slot, shape=shape)
    for slot, shape in zip(slot_names, shapes, strict=True)
  )
  return Optimizer(
    name,
    slots,
    ("learning_rate",),
    _lr_and(),
    _custom_update(name, fn, slots),
    compiled=False,
  )


def get(name: str | Optimizer) -> Optimizer:
  """The registry entry of optimizer `name` (an entry is returned as is).

  Raises:
    ValueError: If no optimizer has that name.
  """
  if isinstance(name, Optimizer):
    return name
  try:
    return REGISTRY[name]
  except KeyError:
    raise ValueError(
      f"Unknown optimizer {name!r}; expected one of {sorted(REGISTRY)}."
    ) from None
