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

Per-call cost: each argument is unbound on its own, and one that holds
variables (a model) is remembered by identity (weakly), so calling again
with the same model object does not walk it again; its variables' values
are read afresh. Each variable's frozen value goes to jit as its array
leaves, its structure a static argument: the leaves and structure are
remembered per value object (a table's leaves weakly, so a replaced table
is freed), so an unchanged weight costs no Penzai flattening, which a raw
`jax.jit` over the frozen variables pays every call (two struct flattens
per variable, about 80 us for a 2-block transformer's 22 variables). A call
then costs no more host time than that raw `jax.jit` call, which matters
for a decoding loop calling the model once per token.

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
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from penzai import pz

from pz_sparsecore.nn.placement import committed_to_mesh, place_tables
from pz_sparsecore.nn.ties import check_untied

_READ = "__pzsc_read_variables"
_WRITTEN = "__pzsc_written_variables"
_WRITES = "__pzsc_writes"
_VARIABLE_STRUCTURES = "__pzsc_variable_structures"


class _WrittenSetChanged(Exception):
  """Raised while tracing when `fun` writes another set than was assumed."""

  def __init__(self, written: tuple[int, ...]):
    super().__init__(written)
    self.written = written


def _signature_with_extras(
  fun: Callable[..., Any], names: tuple[str, ...] = (_READ, _WRITTEN, _WRITES)
) -> inspect.Signature:
  """`fun`'s signature plus the keyword-only arguments the wrapper passes."""
  sig = inspect.signature(fun)
  if any(
    p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
  ):
    return sig
  extras = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in names
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


_NAMING_OPTIONS = {
  "static_argnums",
  "static_argnames",
  "donate_argnums",
  "donate_argnames",
  "in_shardings",
}
"""`jax.jit` options that refer to the function's own arguments."""

_REMEMBERED = 8
"""How many arguments holding variables a jitted function remembers."""

_REMEMBERED_SIZE = 2**16
"""The leaves of frozen values of at most this many elements are held for
reuse (the model's weights); larger ones (tables) are held weakly, so that a
table replaced by an update is not kept alive by the cache."""


_REMEMBERED_VALUES = 4096
"""How many frozen variable values a jitted function keeps for reuse."""


class _FrozenLeaves(NamedTuple):
  """A variable's frozen value as leaves and structure, valid while the
  variable holds the value `value` refers to (weakly)."""

  var: Any
  value: weakref.ref
  leaves: list[Any] | None
  refs: list[weakref.ref] | None
  treedef: Any


def _flatten_frozen(var: Any) -> tuple[list[Any], Any, _FrozenLeaves | None]:
  """`jax.tree.flatten(var.freeze())`, and what remembers it (None for a
  value that cannot be referenced weakly, or a traced one)."""
  leaves, treedef = jax.tree.flatten(var.freeze())
  if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
    return leaves, treedef, None
  try:
    value = weakref.ref(var.value)
    if sum(int(np.size(leaf)) for leaf in leaves) <= _REMEMBERED_SIZE:
      return leaves, treedef, _FrozenLeaves(var, value, leaves, None, treedef)
    refs = [weakref.ref(leaf) for leaf in leaves]
  except TypeError:  # Python scalars, dicts and lists have no weak refs.
    return leaves, treedef, None
  return leaves, treedef, _FrozenLeaves(var, value, None, refs, treedef)


class _Hashed:
  """A value hashed once and compared by identity first: a model's pytree
  structure is large, and jit hashes its static arguments (and the written
  set's guesses their keys) on every call."""

  def __init__(self, value: Any):
    self.value = value
    self._hash = hash(value)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: Any) -> bool:
    return self is other or (
      isinstance(other, _Hashed) and self.value == other.value
    )


class _Unbound(NamedTuple):
  """One argument with its variables unbound, and its slots flattened."""

  slots: Any
  variables: tuple[Any, ...]
  key: _Hashed
  structure: _Hashed
  leaves: list[Any]


_NO_VARIABLES = (jax.Array, np.ndarray, np.generic, int, float, bool, str)


def _unbind_one(part: Any) -> _Unbound:
  if isinstance(part, _NO_VARIABLES) or (
    isinstance(part, pz.nx.NamedArray | pz.nx.NamedArrayView)
    and isinstance(part.data_array, jax.Array)
  ):
    # Arrays hold no variables: skip Penzai's walk (a token batch, per call).
    slots, variables = part, ()
  else:
    slots, variables = pz.unbind_variables(part)
  leaves, treedef = jax.tree.flatten(slots)
  return _Unbound(
    slots,
    tuple(variables),
    _Hashed(_structure_key(treedef, leaves)),
    _Hashed((treedef, ())),
    leaves,
  )


_BAKED_SIZE = 64
"""A remembered model's array leaves of at most this many elements are
compiled in as constants (as a raw `jax.jit` closing over the model does)."""


_CONSTANTS = (np.ndarray, np.generic, jax.Array, int, float, complex, bool)


class _Baked:
  """A small constant compiled into the function; static, by identity."""

  def __init__(self, value: Any):
    self.value = value

  def __hash__(self) -> int:
    return id(self)

  def __eq__(self, other: Any) -> bool:
    return self is other


def _placed_constants(part: Any, unbound: _Unbound) -> _Unbound:
  """A remembered model's constants: the small ones (Penzai's scales and
  epsilons) compiled in, the others put once on its mesh
  (`placement.committed_to_mesh`): passed as arguments, they would cost a
  transfer (uncommitted) or a buffer per device on every call."""
  baked, leaves = [], []
  for i, leaf in enumerate(unbound.leaves):
    if isinstance(leaf, _CONSTANTS) and np.size(leaf) <= _BAKED_SIZE:
      # Kept as it is (a Python scalar stays weakly typed).
      baked.append((i, _Baked(leaf)))
    else:
      leaves.append(leaf)
  return unbound._replace(
    structure=_Hashed((unbound.structure.value[0], tuple(baked))),
    leaves=committed_to_mesh(leaves, part),
  )


def _leaves_with(baked: tuple[tuple[int, _Baked], ...], leaves: Any) -> list:
  """The leaves with the compiled-in constants back at their positions."""
  out = list(leaves)
  for i, const in baked:
    out.insert(i, const.value)
  return out


def _structure_key(treedef: Any, leaves: list[Any]) -> Any:
  """What the written set is remembered by: the arguments' structure (with
  their variables' labels) and their array leaves' shapes and dtypes."""
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
    return _bound_call(fun, args, kwargs, read, written, writes)

  inner.__signature__ = _signature_with_extras(fun)
  return inner


def _traced_flat(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`_traced` for arguments and frozen variables given as static structures
  and array leaves (`_VariableJitted`'s fast path, for jit options that name
  no argument): jit then flattens lists of arrays, not Penzai structs."""

  def inner(structures, leaves, **extras):
    writes = extras[_WRITES]
    treedefs = extras[_VARIABLE_STRUCTURES].value
    read = [
      jax.tree.unflatten(treedefs[i], part)
      for i, part in zip(
        (i for i in range(len(treedefs)) if i not in writes),
        extras[_READ],
        strict=True,
      )
    ]
    written = [
      jax.tree.unflatten(treedefs[i], part)
      for i, part in zip(writes, extras[_WRITTEN], strict=True)
    ]
    arg_structures, kwarg_structures = structures
    trees = [
      jax.tree.unflatten(st.value[0], _leaves_with(st.value[1], part))
      for st, part in zip(
        (*arg_structures, *(st for _, st in kwarg_structures)),
        leaves,
        strict=True,
      )
    ]
    n = len(arg_structures)
    kwargs = {
      name: tree
      for (name, _), tree in zip(kwarg_structures, trees[n:], strict=True)
    }
    return _bound_call(fun, trees[:n], kwargs, read, written, writes)

  inner.__signature__ = _signature_with_extras(
    lambda structures, leaves: 0,
    (_READ, _WRITTEN, _WRITES, _VARIABLE_STRUCTURES),
  )
  return inner


def _bound_call(fun, args, kwargs, read, written, writes):
  """`fun` on its arguments with their variables bound (see `_traced`)."""
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
    # The fast path passes each argument as a static structure and its
    # array leaves; only when no jit option names the function's arguments.
    self._flat = None
    if not _NAMING_OPTIONS & set(jit_kwargs):
      options = _jit_options(donate_variables, jit_kwargs)
      options["static_argnames"] = (
        *options["static_argnames"],
        "structures",
        _VARIABLE_STRUCTURES,
      )
      self._flat = jax.jit(_traced_flat(fun), **options)
    # Argument structure and shapes → the written set last found for them.
    self._guesses: dict[Any, tuple[int, ...]] = {}
    # id → (weak reference, unbinding) of the last arguments with variables.
    self._parts: dict[int, tuple[Any, _Unbound]] = {}
    # id → the leaves of the last frozen value of each variable.
    self._frozen: dict[int, _FrozenLeaves] = {}
    # The last variables' structures, and their static argument.
    self._structures: tuple[tuple[Any, ...], _Hashed] = ((), _Hashed(()))
    functools.update_wrapper(self, fun)
    self.__doc__ = (
      "Variable-aware JIT-compiled version of "
      f"{getattr(fun, '__name__', fun)}:\n{fun.__doc__}"
    )

  def _frozen_leaves(self, var: Any) -> tuple[list[Any], Any]:
    """The leaves and structure of `var.freeze()`, the same objects again
    while its value is (no Penzai struct is flattened for them)."""
    hit = self._frozen.get(id(var))
    if hit is not None and hit.var is var and hit.value() is var.value:
      if hit.leaves is not None:
        return hit.leaves, hit.treedef
      leaves = [ref() for ref in hit.refs]
      if not any(leaf is None for leaf in leaves):
        return leaves, hit.treedef
    leaves, treedef, entry = _flatten_frozen(var)
    if entry is not None:
      if len(self._frozen) >= _REMEMBERED_VALUES:
        self._frozen.clear()
      self._frozen[id(var)] = entry
    return leaves, treedef

  def _variable_structures(self, treedefs: tuple[Any, ...]) -> _Hashed:
    """The frozen variables' structures as one static argument, the same
    object again while they are equal (jit compares it by identity)."""
    last, hashed = self._structures
    if len(last) != len(treedefs) or not all(
      a is b or a == b for a, b in zip(last, treedefs, strict=True)
    ):
      hashed = _Hashed(treedefs)
    self._structures = (treedefs, hashed)
    return hashed

  def _unbind_part(self, part: Any) -> _Unbound:
    """One argument unbound; arguments holding variables are remembered."""
    hit = self._parts.get(id(part))
    if hit is not None and hit[0]() is part:
      return hit[1]
    unbound = _unbind_one(part)
    if not unbound.variables or any(
      isinstance(leaf, jax.core.Tracer) for leaf in unbound.leaves
    ):
      return unbound
    try:
      # Weakly: a dropped model frees its entry (and its variables).
      ref = weakref.ref(part)
    except TypeError:
      return unbound
    if len(self._parts) >= _REMEMBERED:
      self._parts.pop(next(iter(self._parts)))
    unbound = _placed_constants(part, unbound)
    self._parts[id(part)] = (ref, unbound)
    weakref.finalize(part, self._parts.pop, id(part), None)
    return unbound

  def _unbind(self, args: Any, kwargs: Any):
    """`(args_slots, kwargs_slots, variables, guess key)` of a call.

    Each argument is unbound on its own, and an argument holding variables
    (a model) is remembered by identity: the next call with the same model
    object skips walking it (Penzai's pytrees are immutable; the variables'
    values are read afresh every call). Variables shared between arguments,
    or labels used twice, take the whole-tree path, which merges or refuses
    them as `pz.unbind_variables` does.
    """
    parts = [*args, *kwargs.values()]
    try:
      unbound = [self._unbind_part(p) for p in parts]
    except Exception:  # Penzai's VariableConflictError, among others.
      check_untied((args, kwargs))  # A clearer error for a tied table.
      raise
    variables = [v for u in unbound for v in u.variables]
    holders = sum(1 for u in unbound if u.variables)
    if holders <= 1 or (
      len({id(v) for v in variables}) == len(variables)
      and len({v.label for v in variables}) == len(variables)
    ):
      n = len(args)
      structures = (
        tuple(u.structure for u in unbound[:n]),
        tuple(zip(kwargs, (u.structure for u in unbound[n:]), strict=True)),
      )
      return (
        tuple(u.slots for u in unbound[:n]),
        dict(zip(kwargs, (u.slots for u in unbound[n:]), strict=True)),
        variables,
        (n, tuple(kwargs), tuple(u.key for u in unbound)),
        (structures, [u.leaves for u in unbound]),
      )
    try:
      (args_slots, kwargs_slots), variables = pz.unbind_variables(
        (args, kwargs)
      )
    except Exception:  # Penzai's VariableConflictError, among others.
      check_untied((args, kwargs))  # A clearer error for a tied table.
      raise
    return (
      args_slots,
      kwargs_slots,
      variables,
      _structure_key(*reversed(jax.tree.flatten((args_slots, kwargs_slots)))),
      None,
    )

  def _run(self, lower: bool, args: Any, kwargs: Any):
    """Calls the jitted function (or its `lower`) with its written set.

    Returns:
      The variables of the arguments, the written set and the output.
    """
    args_slots, kwargs_slots, variables, key, flat = self._unbind(args, kwargs)
    if key not in self._guesses:
      place_tables((args, kwargs))
    writes = self._guesses.get(key, ())
    if flat is not None and self._flat is not None:
      # The variables as leaves with static structures: jit flattens
      # lists of arrays, not one Penzai struct per variable.
      method = self._flat.lower if lower else self._flat
      frozen = [self._frozen_leaves(var) for var in variables]
      extras = {
        _VARIABLE_STRUCTURES: self._variable_structures(
          tuple(treedef for _, treedef in frozen)
        )
      }
      frozen = [leaves for leaves, _ in frozen]
      call_args, call_kwargs = flat, {}
    else:
      method = self._jitted.lower if lower else self._jitted
      frozen = [var.freeze() for var in variables]
      extras = {}
      call_args, call_kwargs = args_slots, kwargs_slots
    for _ in range(2):
      extras[_READ] = [v for i, v in enumerate(frozen) if i not in writes]
      extras[_WRITTEN] = [frozen[i] for i in writes]
      extras[_WRITES] = writes
      try:
        out = method(*call_args, **call_kwargs, **extras)
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
    variables, writes, (new_values, result) = self._run(False, args, kwargs)
    for i, value in zip(writes, new_values, strict=True):
      variables[i].update(value)
    return result

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """`jax.jit(...).lower` of the call with these arguments."""
    return self._run(True, args, kwargs)[2]


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
