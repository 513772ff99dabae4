"""Exact top-k retrieval: `pzsc.top_k` against faiss and a dense jnp search.

Run: ``.venv/bin/python benchmarks/top_k.py`` (needs ``faiss-cpu``, the
``bench`` extra); ``--rows 100000 --repeats 2`` is a quick smoke test.

One `[rows, 64]` float32 table of normal values, searched for the 10 best
dot products of 1 and 1,024 normal queries by:

* ``ours 1 dev``: ``pzsc.top_k`` over a ``SparseCoreLookup`` table on one
  CPU device (one shard);
* ``ours 8 dev``: the same over a ``SparseCoreLookup`` on 8 virtual CPU
  devices (8 shards, the same 2 cores);
* ``jnp``: ``lax.top_k(queries @ table.T, k)`` jitted on one device, the
  table a device array (the dense search ``pzsc.top_k`` replaces); above
  ``JNP_SCORE_BYTES`` of scores it runs over chunks of the queries
  (``lax.map``; 1,024 x 8M float32 scores are 32 GiB);
* ``faiss``: faiss-cpu's exact ``IndexFlatIP`` (its threads: every core).

Every figure is a median in ms over ``--repeats`` calls after one warm-up
call each (compilation excluded), each call blocked on its result and
after an untimed ``SETTLE_S`` pause; the four are interleaved call by
call. Check: the ids of ``ours`` equal the
dense search's, and faiss's up to ties and float rounding (the share of
equal ids is printed). The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

JNP_SCORE_BYTES = 4 << 30
"""The most bytes of scores the dense search makes at once."""

SETTLE_S = 0.2
"""An untimed pause before each timed call: faiss's OpenMP threads (and
XLA's) keep spinning a while after a call, which would land in the next
peer's time."""


def _dense_search(jax, jnp, k: int, num_queries: int, rows: int):
  """The jitted dense search of `num_queries` queries over `rows` rows."""
  chunk = num_queries
  while chunk > 1 and chunk * rows * 4 > JNP_SCORE_BYTES:
    chunk //= 2

  def search(table, queries):
    return jax.lax.top_k(queries @ table.T, k)

  if chunk == num_queries:
    return jax.jit(search), chunk

  def chunked(table, queries):
    parts = queries.reshape(-1, chunk, queries.shape[1])
    scores, ids = jax.lax.map(lambda q: search(table, q), parts)
    return scores.reshape(num_queries, k), ids.reshape(num_queries, k)

  return jax.jit(chunked), chunk


def _timed(jax, fn) -> float:
  time.sleep(SETTLE_S)
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return (time.perf_counter() - start) * 1e3


def _measure(jax, peers: dict, repeats: int) -> tuple[dict, dict]:
  """Each peer's result (its warm-up call) and median ms, interleaved."""
  results = {name: jax.block_until_ready(fn()) for name, fn in peers.items()}
  times = {name: [] for name in peers}
  for _ in range(repeats):
    for name, fn in peers.items():
      times[name].append(_timed(jax, fn))
  return results, {name: statistics.median(t) for name, t in times.items()}


def _same_ids(np, results: dict) -> dict:
  """The share of `ours 1 dev`'s ids each other peer returns alike."""
  ids = np.asarray(results["ours 1 dev"][1])
  return {
    name: float(np.mean(ids == np.asarray(result[1])))
    for name, result in results.items()
    if name != "ours 1 dev"
  }


HEADER = (
  f"{'rows':>9} {'Q':>5} | {'ours 1 dev':>10} {'ours 8 dev':>10} "
  f"{'jnp':>10} {'faiss':>10} | {'1dev/jnp':>8} {'1dev/faiss':>10} "
  f"{'8dev/jnp':>8} | same ids as ours 1 dev"
)


def _line(rows: int, count: int, ms: dict, same: dict, chunk: int) -> str:
  note = "" if chunk == count else f" (jnp in chunks of {chunk} queries)"
  return (
    f"{rows:>9} {count:>5} | {ms['ours 1 dev']:>10.1f} "
    f"{ms['ours 8 dev']:>10.1f} {ms['jnp']:>10.1f} {ms['faiss']:>10.1f} | "
    f"{ms['ours 1 dev'] / ms['jnp']:>8.2f} "
    f"{ms['ours 1 dev'] / ms['faiss']:>10.2f} "
    f"{ms['ours 8 dev'] / ms['jnp']:>8.2f} | "
    + " ".join(f"{k} {v:.3f}" for k, v in same.items())
    + note
  )


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument(
    "--rows", type=int, nargs="+", default=[1_000_000, 8_000_000]
  )
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--queries", type=int, nargs="+", default=[1, 1024])
  parser.add_argument("--k", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

  import faiss
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  import pz_sparsecore as pzsc

  def lookup(rows, devices, values):
    layer = pzsc.SparseCoreLookup.from_config(
      "items",
      jax.random.key(0),
      vocab_size=rows,
      embedding_axes={"embedding": args.dim},
      mesh=Mesh(np.array(jax.devices()[:devices]), ("d",)),
      optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
      initializer=jax.nn.initializers.zeros,
    )
    pzsc.set_logical_tables(layer, {"items": values})
    return layer

  print(f"load average before: {os.getloadavg()}")
  print(
    f"jax {jax.__version__}, faiss {faiss.__version__}, {os.cpu_count()} "
    f"cores, faiss threads {faiss.omp_get_max_threads()}"
  )
  lines = []
  k = args.k
  rng = np.random.default_rng(0)
  for rows in args.rows:
    values = rng.standard_normal((rows, args.dim), np.float32)
    one, eight = lookup(rows, 1, values), lookup(rows, 8, values)
    dense = jax.device_put(values, jax.devices()[0])
    index = faiss.IndexFlatIP(args.dim)
    index.add(values)
    del values
    for count in args.queries:
      queries = rng.standard_normal((count, args.dim), np.float32)
      on_device = jax.device_put(queries, jax.devices()[0])
      search, chunk = _dense_search(jax, jnp, k, count, rows)
      peers = {
        "ours 1 dev": lambda q=queries, m=one: pzsc.top_k(q, m, k),
        "ours 8 dev": lambda q=queries, m=eight: pzsc.top_k(q, m, k),
        "jnp": lambda q=on_device, s=search, t=dense: s(t, q),
        "faiss": lambda q=queries, i=index: i.search(q, k),
      }
      results, ms = _measure(jax, peers, args.repeats)
      lines.append(_line(rows, count, ms, _same_ids(np, results), chunk))
      print(lines[-1], flush=True)
    del one, eight, dense, index, peers
  print(f"\nmedian ms of {args.repeats} calls, k = {args.k}, dim = {args.dim}")
  print(HEADER)
  for line in lines:
    print(line)
  print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
  main()
