"""Saves checkpoints in a loop until killed (used by the fault tests).

Usage: python checkpoint_writer.py DIRECTORY
Version k of the model has every table value equal to k; after each save
the writer prints `saved k`.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh

import pz_sparsecore as pzsc


def build(rng):
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=20_000,
    embedding_dim=16,
    initializer=jax.nn.initializers.zeros,
    optimizer=pzsc.AdagradOptimizerSpec(),
    combiner="sum",
  )
  features = {
    "f": pzsc.FeatureSpec(
      name="f", table_spec=table, input_shape=(8, 1), output_shape=(8, 16)
    )
  }
  mesh = Mesh(np.array(jax.devices()[:1]), ("device",))
  return pzsc.SparseCoreEmbed.from_config("emb", rng, features, mesh)


def main() -> None:
  directory = sys.argv[1]
  embed = build(jax.random.key(0))
  for k in range(10_000):
    pzsc.set_logical_tables(embed, {"t": np.full((20_000, 16), float(k))})
    pzsc.save_checkpoint(directory, embed)
    print(f"saved {k}", flush=True)


if __name__ == "__main__":
  main()
