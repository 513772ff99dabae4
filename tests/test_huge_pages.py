"""Huge pages behind the tables the CPU kernels read (csrc/huge_pages.h).

A table freed and another allocated at the same address (a restore, a new
table of the same size) must get huge pages again: before, the handlers
remembered the address and left the new buffer on 4 KiB pages, which made
the forward about 40% slower on Zipf ids for the rest of the process.
Runs in its own process: it needs the allocator to reuse the address, and
this process's own allocations would make that unlikely.
"""

from __future__ import annotations

import os
import pathlib
import platform
import textwrap

import fresh_process
import pytest

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _kernel_at_least(major: int, minor: int) -> bool:
  try:
    release = tuple(int(x) for x in platform.release().split(".")[:2])
  except ValueError:
    return False
  return release >= (major, minor)


SCRIPT = textwrap.dedent(
  """
  import gc
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pz_sparsecore.core import buffer_format
  from pz_sparsecore.device import kernels

  ROWS, DIM, BATCH = 1 << 18, 64, 64  # 64 MiB tables
  n = BATCH
  ids = np.full(buffer_format.round_up(n), buffer_format.PAD_ID, np.int32)
  sids = ids.copy()
  gains = np.full(ids.shape, buffer_format.PAD_GAIN, np.float32)
  ids[:n] = np.sort(np.random.default_rng(0).integers(0, ROWS, n))
  sids[:n] = np.arange(n)
  gains[:n] = 1.0
  rp = np.full(buffer_format.row_pointers_per_sc(1), n, np.int32)
  bufs = [jnp.asarray(b) for b in (rp, ids, sids, gains)]
  layout = dict(num_segments=1, samples_per_segment=BATCH, num_partitions=1,
                rows_per_partition=ROWS)

  def huge_kib(table):
    # AnonHugePages of the mapping holding the table's middle byte.
    at = table.unsafe_buffer_pointer() + table.nbytes // 2
    inside = False
    for line in open("/proc/self/smaps"):
      head = line.split()[0]
      if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= at < hi
      elif inside and line.startswith("AnonHugePages:"):
        return int(line.split()[1])
    raise AssertionError("no mapping holds the table")

  def forward(table):
    out = kernels.sparse_dense_matmul(*bufs, table, **layout)
    np.testing.assert_array_equal(
      np.asarray(out)[:n], np.asarray(table)[ids[:n]]
    )

  first = jnp.full((ROWS, DIM), 1.0, jnp.float32)
  forward(first)
  address = first.unsafe_buffer_pointer()
  print("first", huge_kib(first))
  del first
  gc.collect()
  second = jnp.full((ROWS, DIM), 2.0, jnp.float32)
  print("reused", second.unsafe_buffer_pointer() == address)
  print("second before", huge_kib(second))
  forward(second)
  print("second after", huge_kib(second))
  """
)


@pytest.mark.skipif(
  not THP.exists() or "[never]" in THP.read_text(),
  reason="transparent huge pages are off",
)
@pytest.mark.skipif(
  not _kernel_at_least(6, 7), reason="PAGEMAP_SCAN needs Linux 6.7"
)
def test_a_new_table_at_a_freed_tables_address_gets_huge_pages():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  env.pop("PZSC_HUGE_PAGES", None)
  stdout = fresh_process.run(SCRIPT, env)
  lines = dict(line.rsplit(" ", 1) for line in stdout.splitlines() if line)
  if lines["reused"] != "True":
    pytest.skip("the allocator did not reuse the freed table's address")
  # The first table was collapsed by its forward (almost all of its 64 MiB;
  # the unaligned ends stay 4 KiB pages) ...
  assert int(lines["first"]) >= 60 * 1024, lines
  # ... the second starts on 4 KiB pages at the same address, and its
  # forward collapses it too.
  assert int(lines["second before"]) == 0, lines
  assert int(lines["second after"]) >= 60 * 1024, lines
