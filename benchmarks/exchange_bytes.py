"""Collective bytes per device and step: both exchanges, measured and predicted.

Run: ``.venv/bin/python benchmarks/exchange_bytes.py`` (prints two tables).

1. *Measured against predicted*, G = 2, 4, 8 virtual CPU devices with 1 and
   2 SparseCores each: one feature, a local batch of 256 samples x 8
   uniform ids per device, dim 32, SGD, limits set to the batch by FDO. The
   train step (lookup and fused update in one jit) is compiled and its
   collectives are read from the HLO (``routing.compiled_exchange_bytes``)
   next to ``exchange.predict_bytes``.
2. *Predicted up to G = 1024*: a local batch of 4096 samples x 8 ids per
   device, dim 128, S = 1, ids uniform over 2**30 rows. The limits are what
   FDO would record for one such global batch: the most ids and distinct
   ids any device sends any partition, counted here in numpy (MOD
   sharding: id ``i`` goes to partition ``i % N``).
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh

import pz_sparsecore as pzsc
from pz_sparsecore.device import exchange, routing
from pz_sparsecore.nn.tables import table_arrays

# 8 virtual CPU devices (before any computation), as pipeline.py.
jax.config.update("jax_num_cpu_devices", 8)

MODES = ("activations", "rows")


def _tuned_layer(g: int, s: int, mode: str, batch: int, ids: int, dim: int):
  table = pzsc.TableSpec(
    name="table",
    vocabulary_size=1_000_000,
    embedding_dim=dim,
    initializer=jax.nn.initializers.normal(0.1),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    combiner="sum",
    max_ids_per_partition=batch * g * ids,
    max_unique_ids_per_partition=batch * g * ids,
  )
  feature = pzsc.FeatureSpec(
    name="ids",
    table_spec=table,
    input_shape=(batch * g, ids),
    output_shape=(batch * g, dim),
  )
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed",
    jax.random.key(0),
    {"ids": feature},
    Mesh(np.array(jax.devices()[:g]), ("device",)),
    num_sc_per_device=s,
    exchange=mode,
  )
  values = np.random.default_rng(g * 10 + s).integers(
    0, 1_000_000, (batch * g, ids)
  )
  _, stats = embed.preprocess({"ids": values})
  specs = pzsc.update_preprocessing_parameters(
    embed.config.plan.specs_tree, stats, s, global_device_count=g
  )
  embed = pzsc.with_feature_specs(embed, specs)
  return embed, embed.preprocess({"ids": values})[0]


def measured_table() -> list[str]:
  """Compiled step bytes against the prediction at small G."""
  header = f"{'G':>3} {'S':>2} {'limits':>9} " + " ".join(
    f"{m + ' KB':>16} {'predicted':>10}" for m in MODES
  )
  lines = [
    "measured (compiled train step) and predicted collective KB per device;"
    " local batch 256 x 8 ids, dim 32",
    header,
    "-" * len(header),
  ]
  for s in (1, 2):
    for g in (2, 4, 8):
      cells = []
      for mode in MODES:
        embed, inputs = _tuned_layer(g, s, mode, 256, 8, 32)
        plan, topo = embed.config.plan, embed.config.topology
        step = routing.compiled_exchange_bytes(
          plan, topo, table_arrays(embed), inputs
        )["step"]
        chosen = topo.exchange_of(plan.stacks[0])
        cells.append((step, chosen.by_mode[mode].step))
      spec = plan.stacks[0].spec
      limits = (
        f"{spec.max_ids_per_partition}/{spec.max_unique_ids_per_partition}"
      )
      lines.append(
        f"{g:>3} {s:>2} {limits:>9} "
        + " ".join(f"{m / 1e3:16,.1f} {p / 1e3:10,.1f}" for m, p in cells)
      )
  return lines


def _fdo_limits(g: int, batch: int, ids: int, seed: int) -> tuple[int, int]:
  """Most ids and distinct ids one device sends one partition (S = 1)."""
  rng = np.random.default_rng(seed)
  values = rng.integers(0, 2**30, (g, batch * ids), dtype=np.int64)
  source = np.repeat(np.arange(g, dtype=np.int64), batch * ids)
  partition = values.reshape(-1) % g
  counts = np.bincount(source * g + partition, minlength=g * g)
  distinct = np.unique(source * 2**30 + values.reshape(-1))
  unique_counts = np.bincount(
    (distinct // 2**30) * g + (distinct % 2**30) % g, minlength=g * g
  )
  return int(counts.max()), int(unique_counts.max())


def predicted_table(batch: int = 4096, ids: int = 8, dim: int = 128):
  """Both exchanges' step bytes per device for G up to 1024."""
  header = (
    f"{'G':>5} {'limits':>11} {'activations MB':>15} {'rows MB':>9} "
    f"{'rows/acts':>9}  auto"
  )
  lines = [
    f"predicted collective MB per device per train step; local batch "
    f"{batch} x {ids} uniform ids, dim {dim}, S = 1, FDO limits",
    header,
    "-" * len(header),
  ]
  for power in range(1, 11):
    g = 2**power
    max_ids, max_unique = _fdo_limits(g, batch, ids, seed=power)
    sizes = dict(
      num_devices=g,
      num_sc_per_device=1,
      samples_per_sc=batch,
      dim=dim,
      max_ids_per_partition=max_ids,
      max_unique_ids_per_partition=max_unique,
    )
    chosen = exchange.choose("auto", **sizes)
    acts, rows = (chosen.by_mode[m].step for m in ("activations", "rows"))
    lines.append(
      f"{g:>5} {f'{max_ids}/{max_unique}':>11} {acts / 1e6:15,.2f} "
      f"{rows / 1e6:9,.2f} {rows / acts:9.3f}  {chosen.mode}"
    )
  return lines


def main() -> None:
  print("\n".join(measured_table()))
  print()
  print("\n".join(predicted_table()))


if __name__ == "__main__":
  sys.exit(main())
