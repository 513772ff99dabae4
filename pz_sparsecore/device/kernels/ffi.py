"""Loading and registration of the C++ XLA FFI handlers, and their wrappers.

The compiled extension ``pz_sparsecore._pzsc_ffi`` exposes one PyCapsule per
handler and platform; importing this module loads it, checks it (below) and
registers every handler with ``jax.ffi.register_ffi_target`` (CPU always;
CUDA, the forward and every fused optimizer, for a build with the CUDA
handlers: built by default where nvcc and a GPU are found, see
``docs/gpu.md``).

The check: the extension's ``abi_version()`` must be :data:`ABI_VERSION`,
which is read from ``abi_version.h`` beside this module, the header the
extension's build compiles in (the number is written there only); and its
``optimizers()``, one ``(name, target, num_slots, num_hyperparameters)`` per
optimizer handler, generated from ``csrc/optimizer_list.h``, must describe
exactly the registry's compiled optimizers (:func:`expected_optimizers`).
Either difference means a stale or foreign build.

Nothing about the choice is silent:

* The extension fails to load (not built, a broken file): importing this
  module warns once (:class:`KernelFallbackWarning`, naming the error) and
  every call runs the pure-JAX reference.
* The extension loads but was built for another ABI version, or its
  optimizer handlers differ from the registry (a stale or foreign build): no
  handler is registered and every call that would run one raises
  :class:`ExtensionMismatchError`; only ``implementation="reference"`` runs.
* :func:`pz_sparsecore.backend_info` reports which file was loaded (or why
  none was) and which implementation runs for every target and platform.

The environment variable ``PZSC_FFI_LIBRARY`` (a path to a built
``_pzsc_ffi*.so``) loads that file instead of the installed extension, under
the same module name: e.g. a sanitizer build (``make test-asan``).

The backward targets update the table and slots in place: they are aliased
to the results (``input_output_aliases``), so a caller that donates them
(``jax.jit(..., donate_argnums=...)``) gets an O(batch) step. Without
donation XLA copies them first, which is correct but O(table).

Every handler takes the buffer shape as one dictionary attribute, ``layout``
(``LayoutAttrs`` in ``csrc/coo_layout.h``). Every backward handler binds the
same attributes (``csrc/sparse_dense_matmul_grad.cc``): the layout, the clip
range and the static attributes of every optimizer in the registry. A call
passes its optimizer's static attributes and the others' defaults, e.g. an
SGD call passes ``multiply_linear_by_learning_rate=False`` (FTRL's switch).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import importlib.util
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore import _extension
from pz_sparsecore.core import hashed, optimizers
from pz_sparsecore.device.kernels import contract

ABI_HEADER = "abi_version.h"
"""The header beside this module that defines the ABI version
(``kAbiVersion``): compiled into the extension, read here."""


def _read_abi_version() -> int:
  """The ABI version :data:`ABI_HEADER` defines."""
  header = importlib.resources.files(__package__) / ABI_HEADER
  match = re.search(r"\bkAbiVersion = (\d+);", header.read_text())
  if match is None:
    raise ImportError(f"{header} defines no kAbiVersion")
  return int(match.group(1))


ABI_VERSION: int = _read_abi_version()
"""The handlers' ABI this package was written for (read from
:data:`ABI_HEADER`)."""

LIBRARY_ENV = "PZSC_FFI_LIBRARY"
"""Environment variable: a path to the extension to load instead of the
installed one."""

MODULE_NAME = "pz_sparsecore._pzsc_ffi"
FORWARD_TARGET = "pzsc_sparse_dense_matmul"
CHECK_TARGET = "pzsc_check_coo"
HASHED_MAP_TARGET = "pzsc_hashed_map_resolve"


class KernelFallbackWarning(RuntimeWarning):
  """The pure-JAX reference runs where a compiled handler was expected."""


class ExtensionMismatchError(ImportError):
  """The compiled extension was built for another ABI version, or for
  other optimizers than the registry's."""


def grad_target(optimizer: str) -> str:
  """The FFI target name of the fused backward for ``optimizer``."""
  return f"pzsc_sparse_dense_matmul_grad_{optimizer}"


OptimizerHandler = tuple[str, str, int, int, tuple[str, ...]]
"""One optimizer handler as the extension's ``optimizers()`` describes it:
``(name, target, num_slots, num_hyperparameters, slot_shapes)``, each slot
shape ``"table"`` or ``"rowwise_1d"``."""


def expected_optimizers() -> tuple[OptimizerHandler, ...]:
  """The optimizer handlers the extension must have: one per compiled entry
  of the registry, in registry order."""
  return tuple(
    (
      opt.name,
      grad_target(opt.name),
      len(opt.slots),
      len(opt.hyperparameter_names),
      tuple(slot.shape_text for slot in opt.slots),
    )
    for opt in optimizers.REGISTRY.values()
    if opt.compiled
  )


@dataclasses.dataclass(frozen=True)
class Extension:
  """The outcome of loading the compiled extension.

  Attributes:
    module: The loaded, ABI-compatible module, else None.
    path: The file it was loaded from (or asked for), if known.
    abi_version: The ABI version the file reports, if it loaded.
    error: Why no handler can run, or None.
    mismatch: Whether the file loaded but has another ABI version.
  """

  module: ModuleType | None
  path: str | None
  abi_version: int | None
  error: str | None
  mismatch: bool = False


def _load_file(path: str) -> ModuleType:
  """Loads the extension from ``path`` under :data:`MODULE_NAME`."""
  return _extension.load_file(path, MODULE_NAME)


def _describe(handler: OptimizerHandler | None) -> str:
  if handler is None:
    return "none"
  _, target, num_slots, num_hyper, *shapes = handler
  shaped = f" ({', '.join(shapes[0])})" if shapes and shapes[0] else ""
  return (
    f"{target} with {num_slots} slots{shaped}, {num_hyper} hyper-parameters"
  )


def _optimizer_mismatch(module: Any) -> str | None:
  """How the extension's optimizer handlers differ from
  :func:`expected_optimizers`, or None if they do not."""
  describe = getattr(module, "optimizers", None)
  if not callable(describe):
    return "describes no optimizer handlers (it has no optimizers())"
  got = {h[0]: tuple(h) for h in describe()}
  want = {h[0]: h for h in expected_optimizers()}
  diffs = [
    f"{name}: extension {_describe(got.get(name))}, registry "
    f"{_describe(want.get(name))}"
    for name in sorted(got.keys() | want.keys())
    if got.get(name) != want.get(name)
  ]
  if not diffs:
    return None
  return (
    "has other optimizer handlers than the registry (" + "; ".join(diffs) + ")"
  )


def check_extension(module: Any, path: str | None) -> Extension:
  """Checks a loaded extension's ABI version against :data:`ABI_VERSION`
  and its optimizer handlers against :func:`expected_optimizers`.

  Args:
    module: The loaded extension module.
    path: The file it was loaded from.

  Returns:
    The extension, usable if both match; else a mismatch (no module) whose
    error names the file, the difference and the fix.
  """
  version = getattr(module, "abi_version", None)
  abi = int(version()) if callable(version) else None
  if abi != ABI_VERSION:
    problem = (
      f"has ABI version {abi} but this pz_sparsecore expects {ABI_VERSION}"
    )
  else:
    problem = _optimizer_mismatch(module)
  if problem is not None:
    return Extension(
      None,
      path,
      abi,
      f"{path} {problem}: rebuild the extension (pip install -e .) or unset "
      f"{LIBRARY_ENV}.",
      mismatch=True,
    )
  return Extension(module, path, abi, None)


def _load() -> Extension:
  path = os.environ.get(LIBRARY_ENV) or None
  try:
    module = _load_file(path) if path else importlib.import_module(MODULE_NAME)
  except (ImportError, OSError) as e:
    source = path or MODULE_NAME
    return Extension(None, path, None, f"{source}: {type(e).__name__}: {e}")
  return check_extension(module, getattr(module, "__file__", path))


def _register(extension: Extension) -> dict[str, frozenset[str]]:
  if extension.module is None:
    return {}
  platforms = {}
  for name, capsules in extension.module.registrations().items():
    for platform, capsule in capsules.items():
      jax.ffi.register_ffi_target(name, capsule, platform=platform)
    platforms[name] = frozenset(p.lower() for p in capsules)
  return platforms


EXTENSION: Extension = _load()
_PLATFORMS: dict[str, frozenset[str]] = _register(EXTENSION)
if EXTENSION.error is not None and not EXTENSION.mismatch:
  warnings.warn(
    f"pz_sparsecore: the compiled kernels could not be loaded "
    f"({EXTENSION.error}); every kernel call runs the pure-JAX reference.",
    KernelFallbackWarning,
    stacklevel=2,
  )


def available(target: str = FORWARD_TARGET, platform: str = "cpu") -> bool:
  """Whether a compiled handler for ``target`` exists on ``platform``."""
  return platform.lower() in _PLATFORMS.get(target, frozenset())


def platforms(target: str) -> frozenset[str]:
  """The platforms (lower case) with a compiled handler for ``target``."""
  return _PLATFORMS.get(target, frozenset())


def require_compatible() -> None:
  """Raises if the extension loaded but was built for another ABI or other
  optimizers.

  Raises:
    ExtensionMismatchError: With the file, the difference and the fix.
  """
  if EXTENSION.mismatch:
    raise ExtensionMismatchError(EXTENSION.error)


#: ``take_cuda_status``'s error code for row pointers that decrease.
_STATUS_ROW_POINTERS = 1


def take_device_error() -> str | None:
  """The latest error the CUDA handlers recorded on the device, cleared.

  The CUDA handlers check the row pointers on the device, without a host
  synchronisation: a call whose partition starts decrease does nothing (its
  output is zero, the table and slots unchanged) and records the error in
  pinned host memory. This reads it as the calls that completed left it
  (wait for a call's results first to include it).

  Returns:
    The error, in the words of the CPU handlers' error, or None.
  """
  module = EXTENSION.module
  take = getattr(module, "take_cuda_status", None)
  status = take() if take is not None else None
  if status is None:
    return None
  code, segment, partition, start, pointer, begin = status
  if code != _STATUS_ROW_POINTERS:
    return f"CUDA handler error code {code}"
  return (
    f"row_pointers of segment {segment} decrease: partition "
    f"{partition + 1} would start at {start} (rp[{partition}] = {pointer}), "
    f"before partition {partition} (start {begin}); that call changed "
    "nothing"
  )


def raise_device_errors() -> None:
  """Raises the error the CUDA handlers recorded on the device, if any.

  Reads pinned host memory: no synchronisation. An error is recorded once a
  refused call has run on the GPU, so call this after the results of the
  calls to check are ready (``jax.block_until_ready``).
  ``SparseCoreTrainer.step`` calls it after every step, and the kernels'
  eager calls after their results are ready.

  Raises:
    ValueError: Naming the segment and partition whose start decreases.
  """
  error = take_device_error()
  if error is not None:
    raise ValueError(f"pz_sparsecore CUDA handler refused a call: {error}")


def _shape_attrs(
  shape: contract.BufferShape,
) -> dict[str, dict[str, np.int64]]:
  """The handlers' dictionary attribute ``layout`` (``LayoutAttrs``)."""
  return {
    "layout": {
      "num_segments": np.int64(shape.num_segments),
      "samples_per_segment": np.int64(shape.samples_per_segment),
      "num_partitions": np.int64(shape.num_partitions),
      "rows_per_partition": np.int64(shape.rows_per_partition),
      "partition_begin": np.int64(shape.partition_begin),
    }
  }


#: The backward handlers' static attributes with their defaults: the union of
#: the registry's (the handlers bind them all, whatever the optimizer).
_STATIC_DEFAULTS: dict[str, Any] = {
  name: value
  for info in optimizers.REGISTRY.values()
  for name, value in contract.static_attribute_defaults(info).items()
}


def check_coo(
  row_pointers: jax.Array,
  embedding_ids: jax.Array,
  sample_ids: jax.Array,
  gains: jax.Array,
  table: jax.Array,
  shape: contract.BufferShape,
) -> jax.Array:
  """Runs the backward's input pass alone (:data:`CHECK_TARGET`).

  The pass decodes the row pointers (an error if they decrease), checks
  every slice's ids are sorted and makes sorted copies of those that are
  not, exactly as the fused backward does before its first write. Used to
  measure its cost; the layer never calls it.

  Returns:
    An int32 scalar: the number of slices that needed a sorted copy.
  """
  call = jax.ffi.ffi_call(
    CHECK_TARGET, jax.ShapeDtypeStruct((), jnp.int32), vmap_method="sequential"
  )
  return call(
    row_pointers, embedding_ids, sample_ids, gains, table, **_shape_attrs(shape)
  )


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
  sample_order: jax.Array,
  shape: contract.BufferShape,
  quantization: tuple[float, float, int] | None = None,
) -> jax.Array:
  """Calls the forward handler (validated operands; see ``ops``)."""
  out_type = jax.ShapeDtypeStruct((shape.num_outputs, shape.dim), jnp.float32)
  call = jax.ffi.ffi_call(FORWARD_TARGET, out_type, vmap_method="sequential")
  operands, axes = _unify_vma(
    (row_pointers, embedding_ids, sample_ids, gains, table, sample_order)
  )
  lo, hi, buckets = quantization or (0.0, 0.0, 0)
  attrs = {
    "quantization": {
      "min_value": np.float32(lo),
      "max_value": np.float32(hi),
      "num_buckets": np.int64(buckets),
    }
  }
  return _to_varying(call(*operands, **_shape_attrs(shape), **attrs), axes)


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
  rounding_seed: jax.Array | None = None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
  """Calls the fused backward handler (validated operands; see ``ops``)."""
  slots = tuple(slots)
  # The table (in its dtype), then each slot in its own shape (a row-wise
  # slot is `[..., rows, 1]`).
  state_types = tuple(
    jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (table, *slots)
  )
  # A 16-bit table's update takes the rounding seed after the
  # hyperparameters (u32[1]).
  seed = ()
  if shape.table_dtype != "float32":
    seed = (jnp.reshape(rounding_seed, (1,)).astype(jnp.uint32),)
  first_state = 5  # Operand index of the table.
  call = jax.ffi.ffi_call(
    grad_target(optimizer),
    state_types,
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
      *seed,
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


def hashed_map_resolve(
  ids: jax.Array,
  map_ids: jax.Array,
  map_seen: jax.Array,
  step: jax.Array,
  *,
  policy: int,
  parameter: int,
  train: bool,
  regions: Sequence[tuple[int, int]] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Calls the hashed map handler (:data:`HASHED_MAP_TARGET`) on S shards.

  One call of each shard's map, as ``device.hashed.resolve_shard``. The map
  arrays are aliased to their results (updated in place when donated).

  Args:
    ids: int32 ``[S, n, 4]``: low word, high word, home (< 0: no id) and
      table of each id; ``[S, n, 3]``: all of table 0.
    map_ids: int32 ``[S, C, 2]``: each slot's id.
    map_seen: int32 ``[S, C, 2]``: each slot's last step and count.
    step: int32 scalar, the current step.
    policy: The policy's index in ``hashed.POLICIES``
      (``Eviction.code``).
    parameter: ``Eviction.parameter``.
    train: Insert and evict (training) or only look up (inference).
    regions: Per table of the stack, its ``(first row, rows)`` in every
      shard; None: one table of all ``C`` rows.

  Returns:
    ``(slots, reset, map_ids, map_seen, counts)``: int32 ``[S, n]``, bool
    ``[S, n]``, the new map arrays, and int32 ``[S, len(hashed.COUNTERS)]``
    (the call's changes of the counters).
  """
  num_shards, n = ids.shape[:2]
  regions = regions or ((0, map_ids.shape[1]),)
  per_id = jax.ShapeDtypeStruct((num_shards, n), jnp.int32)
  call = jax.ffi.ffi_call(
    HASHED_MAP_TARGET,
    (
      per_id,  # slots
      per_id,  # reset
      jax.ShapeDtypeStruct(map_ids.shape, jnp.int32),
      jax.ShapeDtypeStruct(map_seen.shape, jnp.int32),
      jax.ShapeDtypeStruct((num_shards, len(hashed.COUNTERS)), jnp.int32),
    ),
    input_output_aliases={1: 2, 2: 3},
    vmap_method="sequential",
  )
  operands, axes = _unify_vma(
    (ids, map_ids, map_seen, jnp.asarray(step, jnp.int32).reshape(()))
  )
  slots, reset, new_ids, new_seen, counts = call(
    *operands,
    policy=np.int32(policy),
    parameter=np.int32(parameter),
    train=np.int32(bool(train)),
    regions=np.asarray(regions, np.int64).reshape(-1),
  )
  return (
    _to_varying(slots, axes),
    _to_varying(reset != 0, axes),
    _to_varying(new_ids, axes),
    _to_varying(new_seen, axes),
    _to_varying(counts, axes),
  )
