"""Per-stack blocks of the flat host arrays, each aligned for `device_put`.

The preprocessors write every stack's buffers into one flat array per
buffer kind and hand JAX one slice per stack. JAX's CPU client uses a NumPy
array's memory in place as the device buffer when it starts at a multiple
of 64 bytes, and copies it otherwise (seen at offsets of 16, 32 and 48
bytes). So the flat arrays start at such an address and every stack's
block at such an offset: on the CPU, `device_put` of the buffers then
copies nothing, and a device's part of a block is in place too where its
length is a multiple of 16 values. A 26-table DLRM's preprocessing on 8
CPU devices took 2.1-2.6 ms instead of 3.0-4.3 ms (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import numpy as np

ALIGN_BYTES = 64
"""Where the flat arrays and the blocks start, in bytes."""

_VALUE_BYTES = 4  # Every buffer is int32 or float32.
_STEP = ALIGN_BYTES // _VALUE_BYTES


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Stack `t`'s block is `flat[starts[t] : starts[t] + sizes[t]]`.

  Attributes:
    starts: int64 `[T]`, each a multiple of 16 values (64 bytes).
    sizes: int64 `[T]`, values.
    total: The flat array's length (the last block's end, rounded up).
  """

  starts: np.ndarray
  sizes: np.ndarray
  total: int

  @classmethod
  def aligned(cls, sizes: np.ndarray) -> Blocks:
    """Blocks of `sizes` values, one after the other, each start aligned."""
    sizes = np.asarray(sizes, np.int64).reshape(-1)
    padded = -(-sizes // _STEP) * _STEP
    ends = np.cumsum(padded)
    return cls(
      starts=ends - padded, sizes=sizes, total=int(ends[-1]) if len(ends) else 0
    )

  def empty(self, dtype: np.dtype) -> np.ndarray:
    """An uninitialized flat `dtype` array of `total` values (4 bytes each)
    that starts at a multiple of 64 bytes."""
    return aligned_empty(self.total, dtype)

  def block(self, flat: np.ndarray, t: int) -> np.ndarray:
    """Stack `t`'s block of `flat`."""
    start = int(self.starts[t])
    return flat[start : start + int(self.sizes[t])]


def aligned_empty(n: int, dtype: np.dtype) -> np.ndarray:
  """An uninitialized 1-D array of `n` `dtype` values that starts at a
  multiple of `ALIGN_BYTES`."""
  dtype = np.dtype(dtype)
  raw = np.empty(n * dtype.itemsize + ALIGN_BYTES, np.uint8)
  skip = -raw.ctypes.data % ALIGN_BYTES
  return raw[skip : skip + n * dtype.itemsize].view(dtype)
