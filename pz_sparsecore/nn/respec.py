"""Re-specifying a layer's preprocessing limits (e.g. after FDO).

Feedback-directed optimisation measures how many ids each partition really
receives and proposes new `max_ids_per_partition`,
`max_unique_ids_per_partition` and `suggested_coo_buffer_size_per_device`
per stack. Those limits shape only the preprocessing buffers, never the
tables, so a layer can take them without touching its variables:
`with_feature_specs` returns a layer with a new plan that shares every
table and slot variable with the old one.

Example: a stack planned with `max_ids_per_partition = 64` on 2 devices has
a routing window of 64 entries per source SparseCore; given FDO's 16, the
re-specified layer's buffers and windows shrink to 16 entries, and a write
to its tables is seen through the old layer as well.
Anything that moves rows (a vocabulary, a dimension, an optimizer, the
stacking) is rejected.

`update_limits(target, stats)` is the one call after FDO: it re-specifies
every layer inside a layer, a model or a `SparseCoreTrainer` from observed
statistics, so the trainer's layer and the buffers its `preprocess` makes
change together (a layer re-specified on its own leaves the trainer holding
the old one, whose buffers no longer fit).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from penzai import pz

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.host import fdo
from pz_sparsecore.host.preprocess import SparseDenseMatmulInputStats
from pz_sparsecore.nn.embed import SparseCoreEmbed

# The fields FDO may change; set to one value each before comparing stacks.
_LIMITS = dict(
  max_ids_per_partition=1,
  max_unique_ids_per_partition=1,
  suggested_coo_buffer_size_per_device=None,
)


def with_feature_specs(
  embed: SparseCoreEmbed, feature_specs: Any
) -> SparseCoreEmbed:
  """A layer sharing `embed`'s variables with new limits (e.g. from FDO).

  Only the preprocessing limits and buffer sizes may change; the stacks'
  layout must stay the same.

  Args:
    embed: The layer.
    feature_specs: Feature specs like the layer's (prepared or not), with
      new limits.

  Returns:
    A `SparseCoreEmbed` with the new plan and the same variables.

  Raises:
    ValueError: If the new specs change the layout.
  """
  old = embed.config.plan
  topo = embed.config.topology
  prepared = layout.prepare_feature_specs_for_training(
    feature_specs, topo.num_devices, topo.num_sc_per_device
  )
  if jax.tree.structure(prepared) != old.treedef:
    raise ValueError("new feature specs have a different structure")
  new = plan_lib.build(prepared, topo.num_devices, topo.num_sc_per_device)
  for stack in old.stacks:
    match = new.stack_by_name.get(stack.name)
    if match is None or match.spec.replace(**_LIMITS) != stack.spec.replace(
      **_LIMITS
    ):
      raise ValueError(
        f"stack {stack.name!r}: new feature specs change more than the limits"
      )
  config = dataclasses.replace(embed.config, plan=new)
  return dataclasses.replace(embed, config=config)


def check_stats_topology(
  stats: SparseDenseMatmulInputStats, num_devices: int, num_sc_per_device: int
) -> None:
  """Raises unless `stats` were measured on `num_devices` devices x
  `num_sc_per_device` SparseCores.

  The statistics carry their topology in their sizes: per stack, one
  per-partition value for each of the `N` partitions from each local device
  (`max_ids_per_partition`: `L * N`) and one buffer size per local
  SparseCore (`required_buffer_size_per_sc`: `L * S`), so the first over
  the second is the global device count `N / S`, and each local device's
  row of the first holds `N` values. Limits measured on another topology
  describe other partitions: applying them could reject the next batch, or
  waste memory, without saying why.

  Raises:
    ValueError: Naming the stack, both topologies and the sizes seen.
  """
  shards = num_devices * num_sc_per_device
  for stack, per_partition in stats.max_ids_per_partition.items():
    per_sc = stats.required_buffer_size_per_sc.get(stack, ())
    n = int(np.shape(per_partition)[-1]) if np.ndim(per_partition) else 0
    m = int(np.shape(per_sc)[-1]) if np.ndim(per_sc) else 0
    if n == 0 or m == 0:
      continue
    if n % shards == 0 and m * num_devices == n:
      continue
    devices = n // m if n % m == 0 else None
    measured = (
      f"{devices} devices x {m // devices} SparseCores (if measured in one "
      "process)"
      if devices and m % devices == 0
      else "another topology"
    )
    raise ValueError(
      f"FDO statistics of stack {stack!r} were measured on {measured}: "
      f"{n} per-partition values and {m} per-SparseCore buffer sizes; this "
      f"layer runs on {num_devices} devices x {num_sc_per_device} "
      f"SparseCores ({shards} partitions, so {num_devices} x {shards} and "
      f"{num_devices} x {num_sc_per_device} values from one process). "
      "Measure statistics on this topology (preprocess a few batches with "
      "the layer and record their stats) instead of applying these."
    )


def update_limits(
  target: Any, stats: SparseDenseMatmulInputStats, *, headroom: float = 1.0
) -> Any:
  """`target` with every layer's limits set from observed statistics.

  For each `SparseCoreEmbed` in `target` (a layer, a Penzai model, or a
  `SparseCoreTrainer`), `fdo.update_preprocessing_parameters` sets the
  limits of the stacks `stats` covers (scaled by `headroom`), and
  `with_feature_specs` swaps the new plan in; the variables are shared, so
  training goes on where it was. Preprocess the next batches with the
  returned object's layer (e.g. `trainer.model.embed.preprocess`); the next
  step compiles once for the new buffer shapes.

  Args:
    target: A `SparseCoreEmbed`, a model holding some, or a trainer.
    stats: Observed statistics, e.g. `NPZFileFDOClient.load()`.
    headroom: Factor on the observed counts (`fdo.scale_stats`).

  Returns:
    The same kind of object with re-specified layers.

  Raises:
    ValueError: If `target` holds no `SparseCoreEmbed`, or `stats` were
      measured on another topology than a layer's
      (`check_stats_topology`); nothing is changed.
  """
  if headroom != 1.0:
    stats = fdo.scale_stats(stats, headroom)

  def refresh(embed: SparseCoreEmbed) -> SparseCoreEmbed:
    topo = embed.config.topology
    check_stats_topology(stats, topo.num_devices, topo.num_sc_per_device)
    specs = fdo.update_preprocessing_parameters(
      embed.config.plan.specs_tree,
      stats,
      topo.num_sc_per_device,
      global_device_count=topo.num_devices,
    )
    return with_feature_specs(embed, specs)

  if isinstance(target, SparseCoreEmbed):
    return refresh(target)
  selection = pz.select(target).at_instances_of(SparseCoreEmbed)
  if selection.count() == 0:
    raise ValueError(
      f"update_limits: {type(target).__name__} holds no SparseCoreEmbed"
    )
  return selection.apply(refresh)
