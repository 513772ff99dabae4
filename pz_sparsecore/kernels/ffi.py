"""Registration of the C++ XLA FFI handlers and their ``ffi_call`` wrappers.

The compiled extension ``pz_sparsecore._pzsc_ffi`` exposes one PyCapsule per
handler and platform; importing this module registers them all with
``jax.ffi.register_ffi_target`` (CPU always, CUDA only for a build configured
with ``-DPZSC_CUDA=ON``, which has the forward and the SGD backward). If the
extension is missing, :func:`available` is ``False`` and the public functions
fall back to the pure-JAX reference.

The backward targets update the table and slots in place: they are aliased
to the results (``input_output_aliases``), so a caller that donates them
(``jax.jit(..., donate_argnums=...)``) gets an O(batch) step. Without
donation XLA copies them first, which is correct but O(table).

Every backward handler binds the same attributes
(``csrc/sparse_dense_matmul_grad.cc``): the buffer shape, the clip range and
the static attributes of every optimizer in the registry. A call passes its
optimizer's static attributes and the others' defaults, e.g. an SGD call
passes ``multiply_linear_by_learning_rate=False`` (FTRL's switch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore import optimizers
from pz_sparsecore.kernels import contract

try:
  from pz_sparsecore import _pzsc_ffi as _ext
except ImportError:  # Built without the extension: reference only.
  _ext = None

FORWARD_TARGET = "pzsc_sparse_dense_matmul"


def grad_target(optimizer: str) -> str:
  """The FFI target name of the fused backward for ``optimizer``."""
  return f"pzsc_sparse_dense_matmul_grad_{optimizer}"


def _register() -> dict[str, frozenset[str]]:
  if _ext is None:
    return {}
  platforms = {}
  for name, capsules in _ext.registrations().items():
    for platform, capsule in capsules.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    platforms[name] = frozenset(p.lower() for p in capsules)
  return platforms


_PLATFORMS: dict[str, frozenset[str]] = _register()


def available(target: str = FORWARD_TARGET, platform: str = "cpu") -> bool:
  """Whether a compiled handler for ``target`` exists on ``platform``."""
  return platform.lower() in _PLATFORMS.get(target, frozenset())


def _shape_attrs(shape: contract.BufferShape) -> dict[str, np.int64]:
  return {
    "num_segments": np.int64(shape.num_segments),
    "samples_per_segment": np.int64(shape.samples_per_segment),
    "num_partitions": np.int64(shape.num_partitions),
    "rows_per_partition": np.int64(shape.rows_per_partition),
    "partition_begin": np.int64(shape.partition_begin),
  }


#: The backward handlers' static attributes with their defaults: the union of
#: the registry's (the handlers bind them all, whatever the optimizer).
_STATIC_DEFAULTS: dict[str, Any] = {
  name: value
  for info in optimizers.REGISTRY.values()
  for name, value in contract.static_attribute_defaults(info).items()
}


def _static_attrs(static_attributes: Mapping[str, Any]) -> dict[str, Any]:
  """Every handler's static attribute, the call's value or its default.

  Static attributes are switches: the handlers bind them as ``bool``.

  Raises:
    TypeError: If a value is not a bool.
  """
  attrs = {}
  for name, value in {**_STATIC_DEFAULTS, **static_attributes}.items():
    if not isinstance(value, (bool, np.bool_)):
      raise TypeError(
        f"static attribute {name!r} must be a bool, got {value!r}."
      )
    attrs[name] = np.bool_(value)
  return attrs


def _varying_axes(x: jax.Array) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def _unify_vma(operands: Sequence[jax.Array]) -> tuple[list, tuple[str, ...]]:
  """Inside ``shard_map``, makes all operands vary over the same mesh axes.

  ``ffi_call`` needs operands with equal varying-manual-axes sets and types
  its results as invariant; the wrappers cast the results back to varying
  over the returned axes (the handlers compute per-shard values).
  """
  vma = frozenset().union(*(_varying_axes(x) for x in operands))
  axes = tuple(sorted(vma))
  if not axes:
    return list(operands), axes
  out = []
  for x in operands:
    missing = tuple(a for a in axes if a not in _varying_axes(x))
    out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
  return out, axes


def _to_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  missing = tuple(a for a in axes if a not in _varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def sparse_dense_matmul(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  shape: contract.BufferShape,
) -> jax.Array:
  """Calls the forward handler (validated operands; see ``ops``)."""
  out_type = jax.ShapeDtypeStruct((shape.num_outputs, shape.dim), jnp.float32)
  call = jax.ffi.ffi_call(FORWARD_TARGET, out_type, vmap_method="sequential")
  operands, axes = _unify_vma(
    (row_pointers, embedding_ids, sample_ids, gains, table)
  )
  return _to_varying(call(*operands, **_shape_attrs(shape)), axes)


def sparse_dense_matmul_grad(
  activation_grad: jax.Array,
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  slots: Sequence[jax.Array],
  shape: contract.BufferShape,
  *,
  optimizer: str,
  hyperparameters: jax.Array,
  clip: tuple[float, float] | None = None,
  static_attributes: Mapping[str, Any] | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Calls the fused backward handler (validated operands; see ``ops``)."""
  slots = tuple(slots)
  state_type = jax.ShapeDtypeStruct(table.shape, jnp.float32)
  first_state = 5  # Operand index of the table.
  call = jax.ffi.ffi_call(
    grad_target(optimizer),
    (state_type,) * (1 + len(slots)),
    input_output_aliases={first_state + i: i for i in range(1 + len(slots))},
    vmap_method="sequential",
  )
  lo, hi = clip if clip is not None else (-np.inf, np.inf)
  operands, axes = _unify_vma(
    (
      activation_grad,
      row_pointers,
      embedding_ids,
      sample_ids,
      gains,
      table,
      *slots,
      hyperparameters,
    )
  )
  new_table, *new_slots = call(
    *operands,
    **_shape_attrs(shape),
    clip=np.bool_(clip is not None),
    clip_min=np.float32(lo),
    clip_max=np.float32(hi),
    **_static_attrs(static_attributes or {}),
  )
  return _to_varying(new_table, axes), tuple(
    _to_varying(s, axes) for s in new_slots
  )
