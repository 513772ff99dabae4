"""What the figures share: the plan a figure draws, the device legend.

A figure takes a `SparseCoreEmbed` (its `config.plan`), a `Plan`, or a
pytree of feature specs with `global_device_count` and `num_sc_per_device`
(`plan_of`); devices appear as Treescope's sharding view draws them, device
`d` as the digitbox of `d + 1` (`device_legend`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import treescope
from treescope import figures

from pz_sparsecore.core import layout
from pz_sparsecore.core import plan as plan_lib

Figure = Any  # treescope's `TreescopeFigure` (not exported publicly).

DEVICES_PER_LEGEND_LINE = 10
"""Swatches per line of a device legend: 8 devices and padding fit one."""


def embed_class() -> type:
  """`SparseCoreEmbed`, imported on use (the layer loads the kernels)."""
  from pz_sparsecore.nn.embed import SparseCoreEmbed

  return SparseCoreEmbed


def known_plan(obj: Any) -> plan_lib.Plan | None:
  """The plan of a `SparseCoreEmbed` or a `Plan`; None for anything else."""
  if isinstance(obj, embed_class()):
    return obj.config.plan
  if isinstance(obj, plan_lib.Plan):
    return obj
  return None


def plan_of(
  embed_or_specs: Any,
  global_device_count: int | None = None,
  num_sc_per_device: int | None = None,
) -> plan_lib.Plan:
  """The plan a figure draws: a layer's, a plan, or specs planned on G x S.

  Raises:
    ValueError: For feature specs without both topology counts.
  """
  plan = known_plan(embed_or_specs)
  if plan is not None:
    return plan
  if global_device_count is None or num_sc_per_device is None:
    raise ValueError(
      "pass a SparseCoreEmbed, a Plan, or feature specs together with "
      "global_device_count and num_sc_per_device"
    )
  prepared = layout.prepare_feature_specs_for_training(
    embed_or_specs, global_device_count, num_sc_per_device
  )
  return plan_lib.build(prepared, global_device_count, num_sc_per_device)


def device_legend(
  device_text: dict[int, str], cells: bool = False, padding: bool = False
) -> list[Figure]:
  """Lines of digitbox swatches, each with the devices it stands for (and,
  with `cells`, which colour a one-colour device cell takes; with
  `padding`, the white of padding ids, digitbox 0)."""
  items = [
    figures.inline(treescope.integer_digitbox(value), f" {text}  ")
    for value, text in sorted(device_text.items())
  ]
  if padding:
    items.append(
      figures.inline(treescope.integer_digitbox(0), " padding (white)")
    )
  per_line = DEVICES_PER_LEGEND_LINE
  heading = "devices, as Treescope draws them"
  if cells and any(value >= 10 for value in device_text):
    heading += " (a bar's device cell: the colour of the outer square)"
  return [
    heading + ":",
    *(
      figures.inline(*items[i : i + per_line])
      for i in range(0, len(items), per_line)
    ),
  ]


def is_concrete(x: Any) -> bool:
  """Whether `x` holds readable host or device data (not a tracer/shape)."""
  if isinstance(x, np.ndarray):
    return True
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return False
  return x.is_fully_addressable
