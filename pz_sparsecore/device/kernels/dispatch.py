"""Which implementation of a kernel runs: decided in one place, never silently.

A public kernel (``ops``) asks :func:`choose` for a function given the FFI
target and the caller's ``implementation``:

* ``"reference"``: the pure-JAX reference.
* ``"ffi"``: the compiled handler (an error if the extension has none).
* ``None``: per platform, at lowering time (``jax.lax.platform_dependent``,
  so one traced function serves every backend): the handler where one is
  compiled for that platform (:func:`default_implementation`), else the
  reference. Lowering the reference for a platform whose handler is missing
  (e.g. any kernel on CUDA in a build without the CUDA handlers) warns once
  per (target, platform) with
  :class:`~pz_sparsecore.device.kernels.ffi.KernelFallbackWarning`. Without any
  extension every call runs the reference; the import already warned.

An extension built for another ABI version or other optimizers (a stale
build) is an error for ``"ffi"`` and ``None`` alike
(``ffi.ExtensionMismatchError``), never a fallback.

A kernel with no compiled handler by design (target None: the fused update
of a custom optimizer, whose row update is the user's JAX function) has one
implementation, the pure-JAX one: ``None`` and ``"reference"`` run it,
without a warning (``backend_info`` lists it), and ``"ffi"`` is an error.

The lowering-time warning comes from a marker: the reference branch passes
one integer operand through an identity primitive whose lowering rule warns
for the platforms it is lowered for. Branches that ``platform_dependent``
prunes (all of them but the one chosen) are never lowered, so lowering for
CPU stays silent.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from pz_sparsecore.device.kernels import ffi

IMPLEMENTATIONS = (None, "ffi", "reference")

PLATFORMS = ("cpu", "cuda")
"""The platforms :func:`pz_sparsecore.backend_info` reports on."""

_fallback_p = jex_core.Primitive("pzsc_reference_fallback")
# (target, platform) pairs already warned about.
_warned: set[tuple[str, str]] = set()


def check_implementation(implementation: str | None) -> None:
  """Raises a ``ValueError`` unless ``implementation`` is a known choice."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation must be one of {IMPLEMENTATIONS}, got "
      f"{implementation!r}."
    )


def default_implementation(target: str, platform: str) -> str:
  """What ``implementation=None`` runs for ``target`` on ``platform``.

  Returns:
    ``"ffi"``, ``"reference"``, or ``"error"`` (an extension of another ABI
    version is loaded).
  """
  if ffi.EXTENSION.mismatch:
    return "error"
  return "ffi" if ffi.available(target, platform) else "reference"


def _warn_fallback(target: str, platforms: tuple[str, ...]) -> None:
  for platform in platforms:
    if (target, platform) in _warned or ffi.available(target, platform):
      continue
    _warned.add((target, platform))
    warnings.warn(
      f"pz_sparsecore: no compiled handler for {target!r} on platform "
      f"{platform!r}; this call runs the pure-JAX reference (see "
      "pz_sparsecore.backend_info()).",
      ffi.KernelFallbackWarning,
      stacklevel=2,
    )


def _fallback_lowering(ctx, x, *, target: str):
  _warn_fallback(target, tuple(ctx.module_context.platforms))
  return [x]


def _fallback_batching(args, dims, *, target: str):
  return _fallback_p.bind(*args, target=target), dims[0]


_fallback_p.def_abstract_eval(lambda x, *, target: x)
_fallback_p.def_impl(
  lambda x, *, target: jax.jit(lambda y: _fallback_p.bind(y, target=target))(x)
)
mlir.register_lowering(_fallback_p, _fallback_lowering)
batching.primitive_batchers[_fallback_p] = _fallback_batching


def _marked(target: str, reference_fn: Callable) -> Callable:
  """``reference_fn`` with its first integer operand through the marker."""

  def fn(*args):
    args = list(args)
    for i, x in enumerate(args):
      if jnp.issubdtype(x.dtype, jnp.integer):
        args[i] = _fallback_p.bind(x, target=target)
        break
    return reference_fn(*args)

  return fn


def choose(
  target: str | None,
  implementation: str | None,
  ffi_fn: Callable,
  reference_fn: Callable,
) -> Callable:
  """The function running ``implementation`` of ``target`` (see above).

  Args:
    target: The FFI target name; None for a kernel with no compiled
      handler (see above).
    implementation: ``None``, ``"ffi"`` or ``"reference"`` (checked by
      :func:`check_implementation`).
    ffi_fn: Runs the handler.
    reference_fn: Runs the reference, same arguments.

  Raises:
    ValueError: If ``implementation`` is ``"ffi"`` and the extension has no
      handler for ``target`` (or ``target`` is None).
    ffi.ExtensionMismatchError: If the extension has another ABI version or
      other optimizers and ``implementation`` is not ``"reference"``.
  """
  if implementation == "reference":
    return reference_fn
  if target is None:
    if implementation == "ffi":
      raise ValueError(
        "This kernel has no compiled handler: a custom optimizer's update "
        "runs its JAX function; pass implementation=None or 'reference'."
      )
    return reference_fn
  ffi.require_compatible()
  if implementation == "ffi":
    if not ffi.platforms(target):
      reason = ffi.EXTENSION.error or "the extension has no such target"
      raise ValueError(f"FFI target {target!r} is not available ({reason}).")
    return ffi_fn
  if ffi.EXTENSION.module is None:
    return reference_fn
  branches = {platform: ffi_fn for platform in ffi.platforms(target)}
  default = _marked(target, reference_fn)
  return lambda *args: jax.lax.platform_dependent(
    *args, default=default, **branches
  )
