"""The hashed map's own cost per id, on one core.

Run: ``python benchmarks/hashed_map.py`` (under a minute; ``--capacity``,
``--ids``, ``--rounds``). One CPU device, one shard of ``--capacity`` rows
(1,048,576), calls of ``--ids`` (65,536) distinct raw int64 ids, each call
timed after a warm-up, the median of ``--rounds`` (7) reported as ns per
id, for the compiled handler (`kernels.dispatch` picks it on CPU) and the
JAX map (`resolve_shard`, the reference), `lru`:

* ``insert``: every id new, into an empty map (the first steps of a
  training run);
* ``hit``: every id held (a steady state);
* ``evict``: every id new, into a full map (each takes a victim);
* ``inference``: every id held, looked up without inserting.

The map is the layer's state: each timed call starts from a copy made
before the timer starts (the call updates it in place).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
import jax.numpy as jnp
import numpy as np

from pz_sparsecore.core import hashed
from pz_sparsecore.device import hashed as device_hashed


def shard_ids(ids: np.ndarray, capacity: int) -> jax.Array:
  lo, hi = hashed.key_words(ids)
  home = hashed.homes(ids, capacity)
  words = np.stack([lo, hi, home, np.zeros_like(lo)], -1).astype(np.int32)
  return jnp.asarray(words[None])


def empty(capacity: int) -> device_hashed.ShardMap:
  seen = np.zeros((1, capacity, 2), np.int32)
  seen[..., 0] = hashed.EMPTY
  return device_hashed.ShardMap(
    jnp.zeros((1, capacity, 2), jnp.int32), jnp.asarray(seen)
  )


def timed(fn, ids, shard_map, step, rounds: int) -> float:
  """Median seconds of `fn` over `rounds`, each from a fresh copy."""
  jax.block_until_ready(fn(ids, jax.tree.map(jnp.copy, shard_map), step))
  times = []
  for _ in range(rounds):
    fresh = jax.block_until_ready(jax.tree.map(jnp.copy, shard_map))
    t = time.perf_counter()
    jax.block_until_ready(fn(ids, fresh, step))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--capacity", type=int, default=1 << 20)
  parser.add_argument("--ids", type=int, default=1 << 16)
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  c, n = args.capacity, args.ids
  rng = np.random.default_rng(0)
  eviction = hashed.Eviction("lru")

  def call(implementation, train):
    return jax.jit(
      lambda ids, m, step: device_hashed.resolve_shards(
        ids,
        m,
        step,
        eviction=eviction,
        train=train,
        implementation=implementation,
      ),
      donate_argnums=1,
    )

  first = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
  held = call("ffi", True)(shard_ids(first, c), empty(c), 0).map
  # A full map: fill every slot (one call per 65,536 new ids).
  full = empty(c)
  for start in range(0, 2 * c, n):
    more = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    full = call("ffi", True)(shard_ids(more, c), full, start // n).map
  new = shard_ids(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64), c)
  cases = {
    "insert": (new, empty(c), True, 10**6),
    "hit": (shard_ids(first, c), held, True, 10**6),
    "evict": (new, full, True, 10**6),
    "inference": (shard_ids(first, c), held, False, 10**6),
  }
  print(
    f"hashed map, one shard of {c:,} rows, calls of {n:,} distinct ids, "
    f"lru; median of {args.rounds}; load average {os.getloadavg()[0]:.1f}"
  )
  print(f"{'case':12} {'C++ ns/id':>10} {'JAX ns/id':>10} {'JAX/C++':>8}")
  for name, (ids, shard_map, train, step) in cases.items():
    per = {
      impl: 1e9
      * timed(call(impl, train), ids, shard_map, step, args.rounds)
      / n
      for impl in ("ffi", "reference")
    }
    print(
      f"{name:12} {per['ffi']:10.1f} {per['reference']:10.1f} "
      f"{per['reference'] / per['ffi']:8.1f}"
    )


if __name__ == "__main__":
  main()
