"""jax-tpu-embedding's `lib/nn/custom_optimizer_lowering`: a custom
optimizer's row update as StableHLO text.

Upstream's SparseCore compiler takes a custom optimizer as a StableHLO
module of one row: `(gradient, row, *slots, *hyper_parameters) -> (row,
*slots)` (or the row alone without slots), every operand a float32 `[1, D]`
array, `D` the stack's width; the hyper-parameters (the learning rate, the
only one a custom optimizer has) come broadcast to `[1, D]`. pz_sparsecore
runs a `CustomOptimizerSpec`'s JAX function itself (`core.optimizers`, the
function vmapped over the rows a batch touches), so it needs no module;
these helpers produce and wrap upstream's for programs that hand it one,
and `StableHLOUpdate` runs a module given as text as that JAX function.

- `lower_to_stablehlo(fn, D, slots, hyper_parameters, min_value,
  max_value)` traces `fn` on `[1, D]` operands and returns the module's
  text, the updated row clipped to `[min_value, max_value]` when given.
- `wrap_stablehlo_with_limits(text, ...)` adds the same clipping to a module
  given as text: the module is called from a new one (a primitive whose
  lowering merges it into the caller's module) whose first result is
  clipped. Without limits it returns the text unchanged.
- `StableHLOUpdate(text)` is a function of the module's operands that
  calls it through the same primitive: compat's `CustomOptimizerSpec`
  given only `stablehlo=` trains with it. Under `vmap` (the fused update
  maps the row update over the touched rows) the module runs once per row,
  in a loop (`lax.map`), since a module of one row cannot take a batch.

Example: SGD, `lambda g, w, lr: w - lr * g` with `D = 4`, one
hyper-parameter, lowers to a module whose `main` takes three
`tensor<1x4xf32>` and returns one; with `max_value=1.0` its result goes
through `stablehlo.minimum` with 1.0.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func as func_dialect
from jax.interpreters import batching, mlir

__all__ = [
  "StableHLOUpdate",
  "apply_clipping",
  "lower_to_stablehlo",
  "wrap_stablehlo_with_limits",
]


def apply_clipping(
  val: jax.Array,
  min_value: float | None = None,
  max_value: float | None = None,
) -> jax.Array:
  """`val` clipped below at `min_value` and above at `max_value` (each
  bound only when given)."""
  if min_value is not None:
    val = jnp.maximum(val, min_value)
  if max_value is not None:
    val = jnp.minimum(val, max_value)
  return val


def _operands(
  embedding_dim: int, num_slot_variables: int, num_hyperparameters: int
) -> list[jax.ShapeDtypeStruct]:
  """The update's operands: gradient, row, slots, hyper-parameters, each a
  float32 `[1, embedding_dim]` row."""
  for name, value, low in (
    ("embedding_dim", embedding_dim, 1),
    ("num_slot_variables", num_slot_variables, 0),
    ("num_hyperparameters", num_hyperparameters, 0),
  ):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(
        f"custom optimizer lowering: {name} must be an integer >= {low}, "
        f"got {value!r}"
      )
  row = jax.ShapeDtypeStruct((1, embedding_dim), jnp.float32)
  return [row] * (2 + num_slot_variables + num_hyperparameters)


def _clip_first(out: Any, min_value: float | None, max_value: float | None):
  """Clips the updated row: the first result, or the only one."""
  if isinstance(out, (list, tuple)):
    return (apply_clipping(out[0], min_value, max_value), *out[1:])
  return apply_clipping(out, min_value, max_value)


def lower_to_stablehlo(
  custom_computation_fn: Callable[..., Any],
  embedding_dim: int = 1,
  num_slot_variables: int = 0,
  num_hyperparameters: int = 1,
  min_value: float | None = None,
  max_value: float | None = None,
) -> str:
  """The StableHLO text of a custom optimizer's row update.

  Args:
    custom_computation_fn: `(gradient, row, *slots, *hyper_parameters) ->
      row` or `-> (row, *slots)`, on float32 `[1, embedding_dim]` arrays.
    embedding_dim: The row's width.
    num_slot_variables: The optimizer's slots.
    num_hyperparameters: Its hyper-parameters (the learning rate first).
    min_value: Clip the updated row below at this value, if given.
    max_value: Clip the updated row above at this value, if given.

  Returns:
    The module's text (`jax.jit(...).lower(...).as_text()`).

  Raises:
    ValueError: If a count is not a valid integer.
  """
  operands = _operands(embedding_dim, num_slot_variables, num_hyperparameters)

  def update(*args: Any) -> Any:
    return _clip_first(custom_computation_fn(*args), min_value, max_value)

  return jax.jit(update).lower(*operands).as_text(dialect="stablehlo")


# A module given as text, called as one operation: its lowering merges the
# module into the caller's and calls its `main`.
_call_module_p = jex.core.Primitive("pz_sparsecore_call_stablehlo_module")
_call_module_p.multiple_results = True


@_call_module_p.def_abstract_eval
def _call_module_abstract_eval(*args: Any, module: str, results: Any):
  del args, module
  return [jax.core.ShapedArray(r.shape, r.dtype) for r in results]


def _call_module_lowering(ctx: Any, *args: Any, module: str, results: Any):
  context = ctx.module_context
  parsed = ir.Module.parse(module, context=context.context)
  callee = mlir.merge_mlir_modules(
    context.module,
    "pz_sparsecore_custom_optimizer",
    parsed,
    dst_symtab=context.symbol_table,
  )
  call = func_dialect.CallOp(
    [mlir.aval_to_ir_type(context, aval) for aval in ctx.avals_out],
    ir.FlatSymbolRefAttr.get(callee),
    list(args),
  )
  return list(call.results)


mlir.register_lowering(_call_module_p, _call_module_lowering)


# Outside a trace the module is compiled (once per module and shapes).
_call_module_p.def_impl(
  jax.jit(_call_module_p.bind, static_argnames=("module", "results"))
)


def _call_module_batched(args: Any, dims: Any, *, module: str, results: Any):
  """The module once per batch element, in a loop: it takes one row."""
  mapped = [
    jnp.moveaxis(a, d, 0)
    for a, d in zip(args, dims, strict=True)
    if d is not None
  ]

  def one(xs: Any) -> tuple[jax.Array, ...]:
    rows = iter(xs)
    operands = [
      a if d is None else next(rows) for a, d in zip(args, dims, strict=True)
    ]
    return tuple(_call_module_p.bind(*operands, module=module, results=results))

  out = jax.lax.map(one, mapped)
  return list(out), [0] * len(out)


batching.primitive_batchers[_call_module_p] = _call_module_batched


@functools.lru_cache(maxsize=64)
def _main_signature(
  module: str,
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
  """The shapes of the module's `main`'s operands and results.

  Raises:
    ValueError: If the text is not a module, has no `main`, or `main` has
      an operand or result that is not a float32 tensor of static shape.
  """
  with mlir.make_ir_context():
    try:
      parsed = ir.Module.parse(module)
    except ir.MLIRError as e:
      raise ValueError(
        f"custom optimizer: stablehlo is not a StableHLO module: {e}"
      ) from None
    mains = [
      op
      for op in parsed.body.operations
      if "sym_name" in op.attributes
      and ir.StringAttr(op.attributes["sym_name"]).value == "main"
    ]
    if not mains:
      raise ValueError(
        "custom optimizer: the stablehlo module has no `main` function; "
        "lower the row update with lower_to_stablehlo"
      )
    kind = ir.FunctionType(
      ir.TypeAttr(mains[0].attributes["function_type"]).value
    )

    def shapes(types: Any, what: str) -> tuple[tuple[int, ...], ...]:
      out = []
      for t in types:
        t = t.maybe_downcast()
        if not (
          isinstance(t, ir.RankedTensorType)
          and t.has_static_shape
          and str(t.element_type) == "f32"
        ):
          raise ValueError(
            f"custom optimizer: the stablehlo module's {what} must be "
            f"float32 tensors of static shape, got {t}"
          )
        out.append(tuple(t.shape))
      return tuple(out)

    return shapes(kind.inputs, "operands"), shapes(kind.results, "results")


def wrap_stablehlo_with_limits(
  stablehlo: str | bytes,
  embedding_dim: int,
  num_slot_variables: int,
  num_hyperparameters: int,
  min_value: float | None = None,
  max_value: float | None = None,
) -> str:
  """A custom optimizer's StableHLO with its updated row clipped.

  Args:
    stablehlo: The module (text, or its UTF-8 bytes) of `(gradient, row,
      *slots, *hyper_parameters) -> (row, *slots)`.
    embedding_dim: The row's width.
    num_slot_variables: The optimizer's slots.
    num_hyperparameters: Its hyper-parameters.
    min_value: Clip the updated row below at this value, if given.
    max_value: Clip the updated row above at this value, if given.

  Returns:
    The text unchanged without limits; else a module that calls it and
    clips its first result.

  Raises:
    ValueError: If a count is not a valid integer.
  """
  text = stablehlo.decode() if isinstance(stablehlo, bytes) else stablehlo
  if min_value is None and max_value is None:
    return text
  operands = _operands(embedding_dim, num_slot_variables, num_hyperparameters)
  results = tuple(operands[: 1 + num_slot_variables])

  def wrapped(*args: Any) -> Any:
    out = _call_module_p.bind(*args, module=text, results=results)
    return _clip_first(tuple(out), min_value, max_value)

  return jax.jit(wrapped).lower(*operands).as_text(dialect="stablehlo")


@dataclasses.dataclass(frozen=True, repr=False)
class StableHLOUpdate:
  """A custom optimizer's row update given as a StableHLO module, callable
  as its JAX function.

  Called with `(gradient, row, *slots, *hyper_parameters)`, float32 arrays
  shaped as the module's `main` takes them, it returns the module's
  results, `(row, *slots)`, as a tuple. Equal (and hashing equal) to
  another of the same text, so specs holding it compare as upstream's
  compare their `stablehlo`. Its signature has one parameter per operand
  of `main`, which lets `CustomOptimizerSpec` check the count.

  Attributes:
    stablehlo: The module's text.

  Raises:
    ValueError: When built, if the text is not a module of float32
      tensors with a `main`; when called, if the operands' shapes are not
      those of `main`.
  """

  stablehlo: str

  def __post_init__(self):
    if isinstance(self.stablehlo, bytes):
      object.__setattr__(self, "stablehlo", self.stablehlo.decode())
    if not isinstance(self.stablehlo, str):
      raise ValueError(
        "custom optimizer: stablehlo must be the module's text or its UTF-8 "
        f"bytes, got {type(self.stablehlo).__name__}"
      )
    _main_signature(self.stablehlo)

  @property
  def __signature__(self) -> inspect.Signature:
    operands, _ = _main_signature(self.stablehlo)
    return inspect.Signature(
      inspect.Parameter(f"operand_{i}", inspect.Parameter.POSITIONAL_ONLY)
      for i in range(len(operands))
    )

  def __call__(self, *operands: jax.Array) -> tuple[jax.Array, ...]:
    want, results = _main_signature(self.stablehlo)
    operands = tuple(jnp.asarray(x, jnp.float32) for x in operands)
    got = tuple(x.shape for x in operands)
    if got != want:
      raise ValueError(
        f"custom optimizer: the stablehlo module's main takes operands "
        f"shaped {list(want)}, the update passes {list(got)} (gradient, "
        "row, slots, hyper-parameters, each [1, width] with the stack's "
        "width); lower the row update for these shapes (lower_to_stablehlo "
        "with the stack's embedding_dim and the number of slots)"
      )
    out = _call_module_p.bind(
      *operands,
      module=self.stablehlo,
      results=tuple(jax.ShapeDtypeStruct(r, jnp.float32) for r in results),
    )
    return tuple(out)

  def __repr__(self) -> str:
    operands, results = _main_signature(self.stablehlo)
    return (
      f"StableHLOUpdate(<module: {len(operands)} operands, "
      f"{len(results)} results>)"
    )
