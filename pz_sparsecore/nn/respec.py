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
    ValueError: If `target` holds no `SparseCoreEmbed`.
  """
  if headroom != 1.0:
    stats = fdo.scale_stats(stats, headroom)

  def refresh(embed: SparseCoreEmbed) -> SparseCoreEmbed:
    topo = embed.config.topology
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
