"""The benchmarks' embedding layers, with limits as FDO would set them."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

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


def one_feature(
  vocab: int,
  dim: int,
  input_shape: tuple[int, int],
  optimizer: pzsc.OptimizerSpec,
  id_batches: list[Any],
  exchange: str = "auto",
) -> pzsc.SparseCoreEmbed:
  """One feature "ids" (sum combiner) over a `[vocab, dim]` table on all
  devices, its limits `tuned` to `id_batches` (arrays of `input_shape`),
  crossing devices by `exchange`."""
  table = pzsc.TableSpec(
    name="table",
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.normal(0.1),
    optimizer=optimizer,
    combiner="sum",
    max_ids_per_partition=int(np.prod(input_shape)),
    max_unique_ids_per_partition=int(np.prod(input_shape)),
  )
  feature = pzsc.FeatureSpec(
    name="ids",
    table_spec=table,
    input_shape=input_shape,
    output_shape=(input_shape[0], dim),
  )
  mesh = Mesh(np.array(jax.devices()), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), {"ids": feature}, mesh, exchange=exchange
  )
  return tuned(embed, ({"ids": ids} for ids in id_batches))
