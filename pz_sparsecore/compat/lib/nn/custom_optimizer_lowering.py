"""jax-tpu-embedding's `lib/nn/custom_optimizer_lowering`: a custom
optimizer's row update as StableHLO text.

Upstream's SparseCore compiler takes a custom optimizer as a StableHLO
module of one row: `(gradient, row, *slots, *hyper_parameters) -> (row,
*slots)` (or the row alone without slots), every operand a float32 `[1, D]`
array. pz_sparsecore runs a `CustomOptimizerSpec`'s JAX function itself
(`core.optimizers`), so it needs no module; these helpers produce and wrap
upstream's for programs that hand it one.

- `lower_to_stablehlo(fn, D, slots, hyper_parameters, min_value,
  max_value)` traces `fn` on `[1, D]` operands and returns the module's
  text, the updated row clipped to `[min_value, max_value]` when given.
- `wrap_stablehlo_with_limits(text, ...)` adds the same clipping to a module
  given as text: the module is called from a new one (a primitive whose
  lowering merges it into the caller's module) whose first result is
  clipped. Without limits it returns the text unchanged.

Example: SGD, `lambda g, w, lr: w - lr * g` with `D = 4`, one
hyper-parameter, lowers to a module whose `main` takes three
`tensor<1x4xf32>` and returns one; with `max_value=1.0` its result goes
through `stablehlo.minimum` with 1.0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import func as func_dialect
from jax.interpreters import mlir

__all__ = [
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
