"""numba's preprocessing threads sleep when idle, and leave the cores to XLA.

Each case starts a fresh process (numba's threading layer starts once per
process), preprocesses batches with `SparseCoreEmbed.preprocess` and then
measures the CPU time the process burns while its main thread sleeps: the
time numba's idle workers spend spinning, which the step after a preprocess
would have lost. A user's own `OMP_WAIT_POLICY` is kept.
"""

from __future__ import annotations

import json
import os

import fresh_process
import pytest

_WORKER = """
import json, os, resource, time
import jax, numpy as np
from jax.sharding import Mesh
import pz_sparsecore as pzsc
from pz_sparsecore.core import specs

table = specs.TableSpec(
  name="t", vocabulary_size=50_000, embedding_dim=8,
  initializer=jax.nn.initializers.normal(1.0),
  optimizer=specs.SGDOptimizerSpec(learning_rate=0.1), combiner="sum",
)
features = {
  f"f{i}": specs.FeatureSpec(
    name=f"f{i}", table_spec=table, input_shape=(4096, 8),
    output_shape=(4096, 8),
  )
  for i in range(4)
}
mesh = Mesh(np.array(jax.devices()), ("device",))
embed = pzsc.SparseCoreEmbed.from_config(
  "emb", jax.random.key(0), features, mesh
)
rng = np.random.default_rng(0)

def cpu():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime

burnt = []
for _ in range(3):
  batch = {n: rng.integers(0, 50_000, (4096, 8)) for n in features}
  inputs, _ = embed.preprocess(batch)
  jax.block_until_ready(inputs)
  start = cpu()
  time.sleep(0.3)
  burnt.append(1e3 * (cpu() - start))
import numba
print(json.dumps({
  "burnt_ms": burnt,
  "layer": numba.threading_layer(),
  "threads": numba.get_num_threads(),
  "policy": os.environ.get("OMP_WAIT_POLICY"),
}))
"""


def _run(policy: str | None) -> dict:
  env = dict(os.environ, NUMBA_NUM_THREADS="2", JAX_PLATFORMS="cpu")
  env.pop("OMP_WAIT_POLICY", None)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  if policy is not None:
    env["OMP_WAIT_POLICY"] = policy
  return json.loads(fresh_process.run(_WORKER, env).strip().splitlines()[-1])


def test_idle_workers_do_not_spin_and_the_environment_is_restored():
  out = _run(None)
  assert out["threads"] == 2
  # Spinning GNU OpenMP workers burnt about 8 ms of CPU after every
  # preprocess of this size; sleeping ones burn none.
  assert max(out["burnt_ms"]) < 3.0, out
  assert out["policy"] is None


def test_the_users_wait_policy_is_kept():
  out = _run("ACTIVE")
  if out["layer"] != "omp":
    pytest.skip(f"numba's threading layer is {out['layer']}, not OpenMP")
  assert out["policy"] == "ACTIVE"
  # ACTIVE workers spin through the whole sleep.
  assert min(out["burnt_ms"]) > 50.0, out


_CONCURRENT = """
import threading
import jax, numpy as np, numba
import pz_sparsecore as pzsc
from pz_sparsecore.core import specs

def prepared(limit):
  table = specs.TableSpec(
    name="t", vocabulary_size=5_000, embedding_dim=8,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=specs.SGDOptimizerSpec(learning_rate=0.1), combiner="sum",
    max_ids_per_partition=limit, max_unique_ids_per_partition=limit,
  )
  feature = specs.FeatureSpec(
    name="f", table_spec=table, input_shape=(512, 4), output_shape=(512, 8)
  )
  return pzsc.prepare_feature_specs_for_training(
    {"f": feature}, global_device_count=2, num_sc_per_device=2
  )

# Minibatching splits under limits of 64; the plain fill has room.
specs_of = {True: prepared(64), False: prepared(4096)}
rng = np.random.default_rng(0)
batches = [rng.integers(0, 5_000, (512, 4)) for i in range(8)]

def preprocess(ids, minibatching):
  inputs, _ = pzsc.preprocess_sparse_dense_matmul_input(
    {"f": ids}, None, specs_of[minibatching], 2, 2, num_sc_per_device=2,
    enable_minibatching=minibatching,
  )
  return inputs

want = {}
for i, b in enumerate(batches):
  for m in (False, True):
    want[i, m] = preprocess(b, m)
assert int(np.asarray(want[0, True].num_minibatches).max()) > 1
got, errors = {}, []

def worker(t):
  try:
    for rep in range(3):
      for i, b in enumerate(batches):
        m = (i + t + rep) % 2 == 1
        got[t, rep, i] = (m, preprocess(b, m))
  except Exception as e:  # A failure names itself below.
    errors.append(repr(e))

threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
for t in threads:
  t.start()
for t in threads:
  t.join()
assert not errors, errors
for (t, rep, i), (m, inputs) in got.items():
  leaves = zip(jax.tree.leaves(inputs), jax.tree.leaves(want[i, m]))
  for a, b in leaves:
    np.testing.assert_array_equal(a, b)
print(numba.threading_layer(), len(got))
"""


def test_concurrent_preprocessing_on_numbas_workqueue_layer():
  """Four threads preprocess at once, with and without minibatching, on
  numba's fallback layer (workqueue), which aborts the process on parallel
  regions launched concurrently: every kernel launch takes the kernel
  lock, and every result equals the one preprocessed alone."""
  env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", JAX_PLATFORMS="cpu")
  out = fresh_process.run(_CONCURRENT, env).split()
  assert out == ["workqueue", str(4 * 3 * 8)]
