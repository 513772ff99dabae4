"""`variable_jit`: Penzai's `pz.variable_jit`, returning only what changed.

`pz.variable_jit(fun)` binds every `pz.Variable` found in the arguments,
runs `fun` under `jax.jit`, and returns *every* variable's value as an
output. Under `jax.jit`, an output that is an unchanged input is a new
buffer: XLA copies it. For a model holding a 1M x 64 embedding table that
copy is 256 MB per call, so a forward that reads 80 rows costs as much as
copying the table (about 120 ms against 6 ms for the lookup itself), and it
grows with the vocabulary.

This `variable_jit` has the same signature and the same semantics, but finds
at trace time which variables the call assigned, and returns only those. A
forward pass assigns nothing and returns nothing; a training step returns
the tables, slots and parameters it updated. With `donate_variables=True`
only those written variables are donated (a donated variable that is not
returned would be left holding a deleted buffer), so the fused in-place
table updates stay in place and nothing else is copied: a call costs
O(batch), not O(vocabulary).

How the written set is found: a variable is written if, after `fun` ran, its
value's leaves are not the very tracers it was bound to (assigning the value
it already had counts as no write). The set is part of the compiled
function's static key, so each distinct set compiles once. Before a call the
set is guessed from earlier calls with the same argument structure and
shapes (the first call guesses "nothing"); if tracing finds a different set,
the trace is dropped before anything runs or is donated and the call is made
again with the set it found. A function that writes different variables for
the same shapes (for example under a static flag) is traced once per set.

Worked example, one `SparseCoreEmbed` with a table `t` and an Adagrad slot
`a`, plus a dense head with parameters `w`:

* `variable_jit(lambda m, x: m(x))(model, inputs)`: reads `t` and `w`,
  writes nothing; returns the activations only.
* A step that calls `embed.apply_gradients(...)` and assigns `w`: writes
  `t`, `a` and `w`; with `donate_variables=True` those three buffers are
  donated and updated in place, and every other variable is only read.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
from penzai import pz

from pz_sparsecore.nn.placement import place_tables
from pz_sparsecore.nn.ties import check_untied

_READ = "__pzsc_read_variables"
_WRITTEN = "__pzsc_written_variables"
_WRITES = "__pzsc_writes"


class _WrittenSetChanged(Exception):
  """Raised while tracing when `fun` writes another set than was assumed."""

  def __init__(self, written: tuple[int, ...]):
    super().__init__(written)
    self.written = written


def _signature_with_extras(fun: Callable[..., Any]) -> inspect.Signature:
  """`fun`'s signature plus the keyword-only arguments the wrapper passes."""
  sig = inspect.signature(fun)
  if any(
    p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
  ):
    return sig
  extras = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY)
    for name in (_READ, _WRITTEN, _WRITES)
  ]
  return sig.replace(parameters=[*sig.parameters.values(), *extras])


def _leaves_identical(old: Any, new: Any) -> bool:
  old_leaves, old_def = jax.tree.flatten(old)
  new_leaves, new_def = jax.tree.flatten(new)
  return old_def == new_def and all(
    a is b for a, b in zip(old_leaves, new_leaves, strict=True)
  )


def _merge(read: list[Any], written: list[Any], writes: tuple[int, ...]):
  """The frozen variables in their original order."""
  merged = []
  written_iter, read_iter = iter(written), iter(read)
  for i in range(len(read) + len(written)):
    merged.append(next(written_iter) if i in writes else next(read_iter))
  return merged


def _guess_key(args_slots: Any, kwargs_slots: Any, variables: Any) -> Any:
  """What the written set is remembered by: structure, shapes and dtypes."""
  leaves, treedef = jax.tree.flatten((args_slots, kwargs_slots, variables))
  return treedef, tuple(
    (leaf.shape, leaf.dtype)
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    else type(leaf)
    for leaf in leaves
  )


def _traced(fun: Callable[..., Any]) -> Callable[..., Any]:
  """What runs under `jax.jit`: `fun` with its variables bound.

  Returns the written variables' new values (in the order of the static
  `_WRITES` indices) and `fun`'s result; raises `_WrittenSetChanged` if
  `fun` wrote another set than `_WRITES`.
  """

  def inner(*args: Any, **kwargs: Any) -> Any:
    read = kwargs.pop(_READ)
    written = kwargs.pop(_WRITTEN)
    writes = kwargs.pop(_WRITES)
    frozen = _merge(read, written, writes)
    mutable = [var.unfreeze_as_copy() for var in frozen]
    bound_args, bound_kwargs = pz.bind_variables((args, kwargs), mutable)
    result = fun(*bound_args, **bound_kwargs)
    _, leaked = pz.unbind_variables(result)
    if leaked:
      raise ValueError(
        "Returning a variable from a function transformed by variable_jit "
        "is not allowed; return `pz.unbind_variables(..., frozen=True)` and "
        f"rebind the new variables after the call. Found variables: {leaked}"
      )
    found = tuple(
      i
      for i, (var, old) in enumerate(zip(mutable, frozen, strict=True))
      if not _leaves_identical(old.value, var.value)
    )
    if found != writes:
      raise _WrittenSetChanged(found)
    # The written values come first so that donated inputs and their
    # outputs pair up in the same order (XLA aliases each donated input to
    # the first unclaimed output of the same shape and dtype).
    return [mutable[i].freeze() for i in writes], result

  inner.__signature__ = _signature_with_extras(fun)
  return inner


def _jit_options(donate_variables: bool, jit_kwargs: dict[str, Any]):
  """`jax.jit`'s keyword arguments for `_traced(fun)`."""
  options = dict(jit_kwargs)
  options["static_argnames"] = (
    *_names(options.get("static_argnames")),
    _WRITES,
  )
  if donate_variables:
    options["donate_argnames"] = (
      *_names(options.get("donate_argnames")),
      _WRITTEN,
    )
  if "out_shardings" in options:
    options["out_shardings"] = (None, options["out_shardings"])
  return options


class _VariableJitted:
  """The function `variable_jit` returns (see there)."""

  def __init__(self, fun, donate_variables, jit_kwargs):
    self._fun = fun
    self._jitted = jax.jit(
      _traced(fun), **_jit_options(donate_variables, jit_kwargs)
    )
    # Argument structure and shapes → the written set last found for them.
    self._guesses: dict[Any, tuple[int, ...]] = {}
    functools.update_wrapper(self, fun)
    self.__doc__ = (
      "Variable-aware JIT-compiled version of "
      f"{getattr(fun, '__name__', fun)}:\n{fun.__doc__}"
    )

  def _run(self, method: Callable[..., Any], args: Any, kwargs: Any):
    """Calls `method` (the jitted function or its `lower`) with its set.

    Returns:
      The variables of the arguments, the written set and `method`'s output.
    """
    try:
      (args_slots, kwargs_slots), variables = pz.unbind_variables(
        (args, kwargs)
      )
    except Exception:  # Penzai's VariableConflictError, among others.
      check_untied((args, kwargs))  # A clearer error for a tied table.
      raise
    frozen = [var.freeze() for var in variables]
    key = _guess_key(args_slots, kwargs_slots, frozen)
    if key not in self._guesses and place_tables((args, kwargs)):
      frozen = [var.freeze() for var in variables]
    writes = self._guesses.get(key, ())
    for _ in range(2):
      extras = {
        _READ: [v for i, v in enumerate(frozen) if i not in writes],
        _WRITTEN: [frozen[i] for i in writes],
        _WRITES: writes,
      }
      try:
        out = method(*args_slots, **kwargs_slots, **extras)
      except _WrittenSetChanged as changed:
        writes = changed.written
        continue
      self._guesses[key] = writes
      return variables, writes, out
    raise RuntimeError(
      f"{getattr(self._fun, '__name__', self._fun)!r} writes a different "
      "set of variables every time it is traced"
    )

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    variables, writes, (new_values, result) = self._run(
      self._jitted, args, kwargs
    )
    for i, value in zip(writes, new_values, strict=True):
      variables[i].update(value)
    return result

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """`jax.jit(...).lower` of the call with these arguments."""
    return self._run(self._jitted.lower, args, kwargs)[2]


def variable_jit(
  fun: Callable[..., Any], *, donate_variables: bool = False, **jit_kwargs: Any
) -> Callable[..., Any]:
  """Variable-aware `jax.jit` that returns only the variables a call wrote.

  A drop-in for `pz.variable_jit` with the same arguments and limitations
  (every variable is passed as an argument, none is static, variables
  created inside must be returned unbound). Unlike it, variables that the
  call only reads are neither returned nor donated, so a forward pass does
  not copy the embedding tables; see the module docstring.

  Args:
    fun: The function to jit; it may read and assign variables found in its
      arguments.
    donate_variables: Donate the variables the call writes, so their updates
      (the fused table updates included) happen in place.
    **jit_kwargs: Passed to `jax.jit` (donated keyword arguments through
      `donate_argnames`).

  Returns:
    The jitted function (with a `lower` method like `jax.jit`'s); a call
    updates the written variables and returns `fun`'s result.
  """
  return _VariableJitted(fun, donate_variables, jit_kwargs)


def _names(names: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
  if names is None:
    return ()
  return (names,) if isinstance(names, str) else tuple(names)
