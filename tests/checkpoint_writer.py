"""Saves checkpoints in a loop until killed (used by the fault tests).

Usage: python checkpoint_writer.py DIRECTORY
Version k of the layer has every table value and every slot value equal to
k; after each save the writer prints `saved k`.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
from jax.sharding import Mesh

import pz_sparsecore as pzsc

VOCAB, DIM = 20_000, 16


def build(
  rng, vocab: int = VOCAB, dim: int = DIM, devices: int = 1, dtype="float32"
):
  """The layer: one Adagrad table `t` of `vocab` x `dim` in `dtype`, on the
  first `devices` devices."""
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.zeros,
    optimizer=pzsc.AdagradOptimizerSpec(),
    combiner="sum",
    dtype=dtype,
  )
  features = {
    "f": pzsc.FeatureSpec(
      name="f", table_spec=table, input_shape=(8, 1), output_shape=(8, dim)
    )
  }
  mesh = Mesh(np.array(jax.devices()[:devices]), ("device",))
  return pzsc.SparseCoreEmbed.from_config("emb", rng, features, mesh)


def set_version(embed, k: int) -> None:
  """Every table and slot value of `embed` becomes `k`."""
  value = np.full((VOCAB, DIM), float(k))
  pzsc.set_logical_tables(embed, {"t": value})
  pzsc.set_logical_slots(embed, {"t": {"accumulator": value}})


def version(embed) -> int:
  """The version of a restored layer; raises if table and slot disagree."""
  values = np.unique(
    np.concatenate(
      [
        pzsc.logical_tables(embed)["t"].ravel(),
        pzsc.logical_slots(embed)["t"]["accumulator"].ravel(),
      ]
    )
  )
  if len(values) != 1:
    raise AssertionError(f"a mixed checkpoint: values {values[:5]}")
  return int(values[0])


def main() -> None:
  directory = sys.argv[1]
  embed = build(jax.random.key(0))
  for k in range(1, 10_000):
    set_version(embed, k)
    pzsc.save_checkpoint(directory, embed)
    print(f"saved {k}", flush=True)


if __name__ == "__main__":
  main()
