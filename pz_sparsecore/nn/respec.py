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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pz_sparsecore import layout
from pz_sparsecore import plan as plan_lib
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
