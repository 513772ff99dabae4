"""Moving sharded arrays between the devices and the host.

Logical views work on whole arrays in host memory, while a
table lives in shards on the devices of one or several processes. Both
directions assume every process takes part:

* `to_host` gathers a (possibly multi-process) array into one numpy array on
  every process; an array that this process can address entirely is simply
  copied.
* `from_host` places a numpy array, equal on every process, with a sharding;
  each device receives only its own block, so no process needs the others'
  devices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def to_host(value: Any) -> np.ndarray:
  """A (possibly multi-process) array as one numpy array on every process.

  Args:
    value: A `jax.Array` (sharded over any processes) or anything numpy
      accepts.

  Returns:
    The whole array in host memory.
  """
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(jax.device_get(value))


def from_host(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A numpy array (equal on every process) placed with `sharding`.

  Args:
    value: The whole array, the same on every process.
    sharding: Where its blocks go.

  Returns:
    A global `jax.Array` with `sharding`.
  """
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])
