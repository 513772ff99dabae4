"""The host preprocessor's numba runtime warms up in the background.

`SparseCoreEmbed.from_config` starts numba's initialisation in a thread
(`host.fill.warm_up`), once per process. In a fresh process: the thread is
started by `from_config`, a process forked right after it (while the thread
may still run) preprocesses a batch exactly as the parent does, and the
parent's own first preprocess works; nothing hangs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
  """
  import multiprocessing as mp
  import os
  import threading

  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax
  import numpy as np
  from jax.sharding import Mesh

  import pz_sparsecore as pzsc
  from pz_sparsecore.host import fill
  from pz_sparsecore.host.preprocess import preprocess_for_plan

  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=1000,
    embedding_dim=8,
    initializer=jax.nn.initializers.normal(0.1),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    combiner="sum",
  )
  specs = {
    "f": pzsc.FeatureSpec(
      name="f", table_spec=table, input_shape=(32, 4), output_shape=(32, 8)
    )
  }
  assert fill._WARM_UP is None
  before = threading.active_count()
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), specs, Mesh(np.array(jax.devices()), ("d",))
  )
  assert fill._WARM_UP is not None
  assert fill._WARM_UP.name == "pz_sparsecore-numba-warm-up"
  batch = {"f": np.random.default_rng(0).integers(0, 1000, (32, 4))}

  def buffers():
    inputs, _ = preprocess_for_plan(embed.config.plan, batch, None, 2)
    return [np.asarray(x) for x in jax.tree.leaves(inputs)]

  def child(queue):
    queue.put(buffers())

  ctx = mp.get_context("fork")
  queue = ctx.Queue()
  proc = ctx.Process(target=child, args=(queue,))
  proc.start()
  got = queue.get(timeout=300)
  proc.join(60)
  assert proc.exitcode == 0, proc.exitcode
  want = buffers()
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)  # NaN gains pad the segments.
  fill.warm_up()  # Once per process.
  fill._WARM_UP.join()
  assert threading.active_count() == before
  print("ok")
  """
)


def test_from_config_warms_numba_up_and_a_fork_right_after_preprocesses():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(
    [sys.executable, "-W", "ignore", "-c", SCRIPT],
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip().endswith("ok")
