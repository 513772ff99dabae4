"""Limits as FDO would set them, for the benchmarks' models."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from typing import Any

import jax

import pz_sparsecore as pzsc


def tuned(
  embed: pzsc.SparseCoreEmbed,
  feature_batches: Iterable[dict[str, Any]],
  headroom: float = 1.25,
) -> pzsc.SparseCoreEmbed:
  """`embed` with limits from the batches' observed maxima plus headroom.

  Specs that start from the worst case would size every buffer and exchange
  for many times the ids a device actually sees.
  """
  fdo = pzsc.NPZFileFDOClient(tempfile.mkdtemp())
  for features in feature_batches:
    fdo.record(embed.preprocess(features)[1])
  fdo.publish()
  specs = pzsc.update_preprocessing_parameters(
    embed.config.plan.specs_tree,
    pzsc.scale_stats(fdo.load(), headroom),
    1,
    global_device_count=len(jax.devices()),
  )
  return pzsc.with_feature_specs(embed, specs)
