"""Which kernel implementation runs where: :func:`backend_info`.

Example (a CPU-only build)::

  >>> print(pz_sparsecore.backend_info())
  pz_sparsecore kernels: .../pz_sparsecore/_pzsc_ffi.cpython-311-...so
    ABI version 7 (expected 7), CUDA handlers: no
    ragged-id reader: .../pz_sparsecore/_pzsc_ragged.cpython-311-...so
    target                  cpu        cuda
    forward                 ffi        reference
    grad sgd                ffi        reference
    ...
    grad custom             reference  reference
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pz_sparsecore import _extension
from pz_sparsecore.core import optimizers
from pz_sparsecore.device.kernels import dispatch, ffi


@dataclasses.dataclass(frozen=True)
class BackendInfo:
  """A report on the compiled kernels (``print`` it for a table).

  Attributes:
    extension_path: The extension file loaded (or asked for), if known.
    load_error: Why no compiled handler runs, or None.
    abi_version: The ABI version the loaded file reports, if it loaded.
    expected_abi_version: The ABI version this package expects (its
      ``abi_version.h``).
    cuda_build: Whether the extension has CUDA handlers.
    reader_path: The compiled ragged-id reader of host preprocessing, or
      None if it did not load (ids are then converted in Python).
    implementations: Target label (``"forward"``, ``"grad adagrad"``, ...)
      → platform → what ``implementation=None`` runs there: ``"ffi"``,
      ``"reference"`` or ``"error"`` (ABI mismatch: calls raise). The last
      label, ``"grad custom"``, is every custom optimizer's update
      (``CustomOptimizerSpec``): always ``"reference"`` (its JAX function in
      the pure-JAX backward; there is no compiled handler to run).
  """

  extension_path: str | None
  load_error: str | None
  abi_version: int | None
  expected_abi_version: int
  cuda_build: bool
  reader_path: str | None
  implementations: Mapping[str, Mapping[str, str]]

  def __str__(self) -> str:
    source = self.extension_path or "no extension"
    lines = [f"pz_sparsecore kernels: {source}"]
    if self.load_error is not None:
      lines.append(f"  not used: {self.load_error}")
    lines.append(
      f"  ABI version {self.abi_version} (expected "
      f"{self.expected_abi_version}), CUDA handlers: "
      f"{'yes' if self.cuda_build else 'no'}"
    )
    lines.append(
      "  ragged-id reader: "
      + (self.reader_path or "not loaded (ids converted in Python)")
    )
    lines.append(
      f"  {'target':<24}" + "".join(f"{p:<11}" for p in dispatch.PLATFORMS)
    )
    for label, per_platform in self.implementations.items():
      lines.append(
        f"  {label:<24}"
        + "".join(f"{per_platform[p]:<11}" for p in dispatch.PLATFORMS)
      )
    return "\n".join(line.rstrip() for line in lines)


_CUSTOM_LABEL = "grad custom"
"""The label of custom optimizers' updates in ``implementations``."""


def _targets() -> dict[str, str]:
  """Target label → FFI target name, for every public kernel."""
  targets = {"forward": ffi.FORWARD_TARGET}
  for name in optimizers.REGISTRY:
    targets[f"grad {name}"] = ffi.grad_target(name)
  return targets


def backend_info() -> BackendInfo:
  """Reports the loaded extension and which implementation runs where.

  Returns:
    A :class:`BackendInfo`; ``print`` it for a table of targets by
    platform.
  """
  ext = ffi.EXTENSION
  return BackendInfo(
    extension_path=ext.path,
    load_error=ext.error,
    abi_version=ext.abi_version,
    expected_abi_version=ffi.ABI_VERSION,
    cuda_build=bool(ext.module is not None and ext.module.has_cuda()),
    reader_path=_extension.reader_path(),
    implementations={
      label: {
        p: dispatch.default_implementation(target, p)
        for p in dispatch.PLATFORMS
      }
      for label, target in _targets().items()
    }
    | {_CUSTOM_LABEL: {p: "reference" for p in dispatch.PLATFORMS}},
  )
