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
import math
from typing import Any

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

  def parts(self, size: Any, count: int) -> np.ndarray:
    """int64 `[T, count]`: where each of `count` consecutive parts of
    `size` values (one size, or one per block) starts in each block."""
    size = np.broadcast_to(np.asarray(size, np.int64), self.starts.shape)
    return self.starts[:, None] + size[:, None] * np.arange(count)

  def block(self, flat: np.ndarray, t: int) -> np.ndarray:
    """Stack `t`'s block of `flat`."""
    start = int(self.starts[t])
    return flat[start : start + int(self.sizes[t])]


def aligned_empty(shape: int | tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """An uninitialized C-ordered `dtype` array of `shape` that starts at a
  multiple of `ALIGN_BYTES`."""
  dtype = np.dtype(dtype)
  size = math.prod(np.atleast_1d(shape)) * dtype.itemsize
  raw = np.empty(size + ALIGN_BYTES, np.uint8)
  skip = -raw.ctypes.data % ALIGN_BYTES
  return raw[skip : skip + size].view(dtype).reshape(shape)
