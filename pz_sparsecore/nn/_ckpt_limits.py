"""The limits in force, in a checkpoint: saved per stack, restored where
they hold.

A stack's `max_ids_per_partition`, `max_unique_ids_per_partition` and
`suggested_coo_buffer_size_per_device` (set by hand, or from FDO statistics
by `update_limits`) shape its preprocessing buffers and routing windows.
FDO measures them per partition: how many ids one SparseCore sends one
shard of the stack, for the batches of the stack's features. They hold only
for that: the same tables laid out the same way, the same features with the
same samples, on the same devices x SparseCores. The manifest stores them in
each stack's entry, beside its layout, with what they were set for::

  "limits": {"max_ids_per_partition": 12,
             "max_unique_ids_per_partition": 9,
             "suggested_coo_buffer_size_per_device": 96,
             "topology": {"num_devices": 8, "num_sc_per_device": 1},
             "features": [{"name": "f_words", "samples": 32}]}

Restoring (`restore_checkpoint(..., limits="checkpoint")`, the default), a
stack of the target takes the saved limits of the stored stack with the
same layout (`_ckpt_layout.StackLayout`: shards, rows, and each table's
rows, offset and rotation), the same features in the same sample order with
the same sample counts, and the same devices x SparseCores; the layer gets
a new plan with them (`with_feature_specs`, sharing its variables), so the
next batch is preprocessed into the buffers it had before the save.

Every other stack keeps the target's own limits. There is no conversion:
the per-partition counts of another topology or stacking were never
measured (a count per pair of SparseCore and shard does not split into
tables, nor scale with the shard count for skewed ids), and a guess could
reject the next batch or waste memory without saying why. Nor is there a
warning: the target's limits are the ones its builder chose for its own
topology (builders commonly derive them from it, e.g. the buffer size), so
a different value there is the normal case, not a fault; after such a
restore, FDO statistics measured with the restored layer set limits for it
(`update_limits`). `limits="target"` keeps every stack's own limits, and a
checkpoint written before the limits were stored (no `"limits"` entries)
restores with them too.

Example: stack `words` trained on 8 devices x 1 SparseCore, FDO set
`max_ids_per_partition` 12 (routing windows of `r8(12) = 16` entries instead
of the default 256's). Restored into a freshly built layer on 8 x 1 (limits
256), `words` gets 12 again. Restored onto 4 x 2 (also 8 shards, but each
device's two SparseCores now split its samples) it keeps 256.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from penzai import pz

from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.respec import with_feature_specs

LIMITS = (
  "max_ids_per_partition",
  "max_unique_ids_per_partition",
  "suggested_coo_buffer_size_per_device",
)
"""The `StackedTableSpec` fields a checkpoint saves and restores."""

MODES = ("checkpoint", "target")
"""The values of `restore_checkpoint`'s `limits`."""

_CONTEXT = ("topology", "features")
"""What the limits were set for, beside the stack's layout."""


def describe_limits(
  plan: plan_lib.Plan, stack: plan_lib.StackPlan
) -> dict[str, Any]:
  """The manifest entry of `stack`'s limits and what they were set for."""
  entry: dict[str, Any] = {f: getattr(stack.spec, f) for f in LIMITS}
  entry["topology"] = {
    "num_devices": plan.num_devices,
    "num_sc_per_device": plan.num_sc_per_device,
  }
  entry["features"] = [
    {"name": f.name, "samples": f.spec.sample_count} for f in stack.features
  ]
  return entry


def _values(limits: Mapping[str, Any]) -> dict[str, Any]:
  return {field: limits[field] for field in LIMITS}


def _set_for(entry: Mapping[str, Any]) -> tuple[Any, ...]:
  """What a stack entry's limits hold for: its layout, topology, features."""
  return (entry["layout"],) + tuple(entry["limits"][k] for k in _CONTEXT)


def _saved_limits(
  stored: Mapping[str, Any], target: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
  """Target stack → the saved limits it takes, where they differ from its
  own (stacks are a layer's manifest entries)."""
  found = {}
  for entry in stored.values():
    if "limits" not in entry:  # Written before limits were stored.
      continue
    saved = _values(entry["limits"])
    for name, mine in target.items():
      if _set_for(mine) == _set_for(entry):
        if saved != _values(mine["limits"]):
          found[name] = saved
        break
  return found


def _with_limits(
  embed: SparseCoreEmbed, limits: Mapping[str, Mapping[str, Any]]
) -> SparseCoreEmbed:
  """`embed` with the given stacks' limits, sharing its variables."""
  plan = embed.config.plan

  def update(feature):
    table = feature.table_spec
    stacked = table.stacked_table_spec
    if stacked.stack_name not in limits:
      return feature
    stacked = stacked.replace(**limits[stacked.stack_name])
    return feature.replace(table_spec=table.replace(stacked_table_spec=stacked))

  specs = [update(f) for f in plan.feature_specs]
  return with_feature_specs(embed, jax.tree.unflatten(plan.treedef, specs))


def check_mode(limits: str) -> None:
  """Raises unless `limits` is one of `MODES`."""
  if limits not in MODES:
    raise ValueError(
      f"limits must be one of {MODES} (the checkpoint's limits where they "
      f"hold, or the target's own), got {limits!r}"
    )


def restore_limits(
  model: Any,
  stored: Mapping[str, Any],
  target: Mapping[str, Any],
  limits: str,
) -> Any:
  """`model` with its layers' saved limits where they hold (see above).

  Args:
    model: The target model (not a trainer).
    stored: The checkpoint manifest's `"embeds"`, checked against the
      target's.
    target: The target manifest's `"embeds"`.
    limits: "checkpoint" or "target" (`check_mode`).

  Returns:
    `model`, or a copy with re-specified layers (sharing every variable).

  Raises:
    ValueError: If saved limits are not valid limits (a manifest edited by
      hand); nothing is changed.
  """
  if limits == "target":
    return model
  found = {
    layer: _saved_limits(stored[layer], stacks)
    for layer, stacks in target.items()
  }
  if not any(found.values()):
    return model

  def refresh(embed: SparseCoreEmbed) -> SparseCoreEmbed:
    changes = found[embed.config.name]
    return _with_limits(embed, changes) if changes else embed

  if isinstance(model, SparseCoreEmbed):
    return refresh(model)
  return pz.select(model).at_instances_of(SparseCoreEmbed).apply(refresh)
