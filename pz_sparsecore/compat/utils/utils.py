"""jax-tpu-embedding's `utils/utils`: SparseCores per device.

On TPUs the count is the chip's. On CPU and GPU devices pz_sparsecore runs
"virtual" SparseCores: any count works, and this answers 4 (TPU v5p's), so a
program written for v5p computes the same layouts and buffers here.
"""

from __future__ import annotations

import jax

NUM_SC_PER_DEVICE_MAP = {
  "TPU v5": 4,
  "TPU v5p": 4,
  "TPU v6 lite": 2,
  "TPU7x": 2,
}
VIRTUAL_SC_PER_DEVICE = 4


def num_sparsecores_per_device(device: jax.Device | None = None) -> int:
  """SparseCores of `device` (default: the first device).

  Raises:
    ValueError: For a TPU without SparseCores, or an object with no
      `device_kind`.
  """
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", None)
  if kind is None:
    raise ValueError(f"Cannot determine device kind for device: {device}")
  if kind in NUM_SC_PER_DEVICE_MAP:
    return NUM_SC_PER_DEVICE_MAP[kind]
  if getattr(device, "platform", None) == "tpu":
    raise ValueError(f"Unknown sparsecore count for device kind: {kind}")
  return VIRTUAL_SC_PER_DEVICE
