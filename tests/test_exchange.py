"""The exchanges' collective bytes: predicted, compiled, flat in G.

One feature (a local batch of 256 samples x 8 ids per device, dim 32, SGD)
over 2, 4 and 8 devices with 1 and 2 SparseCores each, its limits set to
the load by FDO. The collectives of the compiled lookup, update and train
step are read from the HLO and compared with `exchange.predict_bytes`; the
row exchange's step must stay flat in G while the activation exchange's
grows with it.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import pz_sparsecore as pzsc
from pz_sparsecore.device import exchange, routing
from pz_sparsecore.nn.tables import table_arrays

LOCAL_BATCH, IDS, DIM, VOCAB = 256, 8, 32, 100_000


def _layer(g: int, s: int, mode: str, ids_per_sample: int = IDS):
  batch = LOCAL_BATCH * g
  table = pzsc.TableSpec(
    name="table",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(0.1),
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    combiner="sum",
    max_ids_per_partition=batch * ids_per_sample,
    max_unique_ids_per_partition=batch * ids_per_sample,
  )
  feature = pzsc.FeatureSpec(
    name="ids",
    table_spec=table,
    input_shape=(batch, ids_per_sample),
    output_shape=(batch, DIM),
  )
  mesh = Mesh(np.array(jax.devices()[:g]), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed",
    jax.random.key(0),
    {"ids": feature},
    mesh,
    num_sc_per_device=s,
    exchange=mode,
  )
  ids = np.random.default_rng(g * 10 + s).integers(
    0, VOCAB, (batch, ids_per_sample)
  )
  _, stats = embed.preprocess({"ids": ids})
  specs = pzsc.update_preprocessing_parameters(
    embed.config.plan.specs_tree, stats, s, global_device_count=g
  )
  embed = pzsc.with_feature_specs(embed, specs)
  return embed, embed.preprocess({"ids": ids})[0]


@functools.cache
def _compiled(g: int, s: int, mode: str, calls=("step",)):
  """(predicted `Exchange`, compiled bytes of the `calls`)."""
  embed, inputs = _layer(g, s, mode)
  plan, topo = embed.config.plan, embed.config.topology
  measured = routing.compiled_exchange_bytes(
    plan, topo, table_arrays(embed), inputs, calls
  )
  return topo.exchange_of(plan.stacks[0]), measured


TOPOLOGIES = [(g, s) for g in (2, 4, 8) for s in (1, 2)]


@pytest.mark.parametrize("mode", ["activations", "rows"])
@pytest.mark.parametrize("g,s", TOPOLOGIES)
def test_compiled_step_collectives_equal_prediction(g, s, mode):
  chosen, measured = _compiled(g, s, mode)
  assert chosen.mode == mode
  assert measured == {"step": chosen.by_mode[mode].step}


@pytest.mark.parametrize("mode", ["activations", "rows"])
def test_compiled_lookup_and_update_equal_prediction(mode):
  # A lookup and an update compiled apart each send the routing.
  chosen, measured = _compiled(4, 2, mode, ("lookup", "update"))
  predicted = chosen.by_mode[mode]
  assert measured == {"lookup": predicted.lookup, "update": predicted.update}
  assert predicted.lookup + predicted.update > predicted.step


@pytest.mark.parametrize("s", [1, 2])
def test_row_exchange_is_flat_in_device_count(s):
  rows = [_compiled(g, s, "rows")[1]["step"] for g in (2, 4, 8)]
  acts = [_compiled(g, s, "activations")[1]["step"] for g in (2, 4, 8)]
  # O(local ids x dim) both ways, whatever G: the rows exceed the local
  # ids only by the skew of the busiest partition, which the limits follow
  # (its share grows a little as partitions shrink).
  local_ids_both_ways = 2 * LOCAL_BATCH * IDS * DIM * 4
  assert max(rows) < 1.6 * local_ids_both_ways, rows
  assert max(rows) / min(rows) < 1.4, rows
  # The activation exchange moves G x the local batch each way.
  assert acts[2] / acts[0] > 3.0, acts


def test_auto_picks_the_cheaper_exchange_per_stack():
  # 8 distinct ids per sample on 8 devices: the rows cost more than the
  # activations; 1 id per sample: far less.
  for ids_per_sample, expected in ((8, "activations"), (1, "rows")):
    embed, _ = _layer(8, 1, "auto", ids_per_sample)
    chosen = embed.config.topology.exchange_of(embed.config.plan.stacks[0])
    assert chosen.mode == expected
    costs = {m: chosen.by_mode[m].step for m in ("activations", "rows")}
    assert costs[expected] == min(costs.values())
    assert chosen.reason.startswith(f"{expected} (chosen)")


def test_one_device_moves_nothing():
  embed, inputs = _layer(1, 2, "rows")
  chosen = embed.config.topology.exchange_of(embed.config.plan.stacks[0])
  assert chosen.mode == "local"
  plan, topo = embed.config.plan, embed.config.topology
  hlo = (
    jax.jit(lambda t, i: routing.lookup(plan, topo, t, i))
    .lower(table_arrays(embed), inputs)
    .compile()
    .as_text()
  )
  assert exchange.compiled_bytes(hlo) == {}
  assert all(b.step == 0 for b in chosen.by_mode.values())


def test_unknown_exchange_is_refused_then_a_good_one_builds():
  with pytest.raises(ValueError, match="exchange must be one of .* 'row'"):
    _layer(2, 1, "row")
  embed, _ = _layer(2, 1, "rows")
  assert embed.config.topology.exchange == "rows"


def test_predict_bytes_formula_and_errors():
  sizes = dict(
    num_devices=1024,
    num_sc_per_device=1,
    samples_per_device=4096,
    dim=128,
    max_ids_per_partition=40,
    max_unique_ids_per_partition=33,
  )
  acts = exchange.predict_bytes("activations", **sizes)
  rows = exchange.predict_bytes("rows", **sizes)
  assert acts.forward == acts.backward == 4 * 1024 * 4096 * 128
  assert acts.routing == 4 * 1024 * (1 + 3 * 40)
  assert rows.forward == rows.backward == 4 * 1024 * 40 * 128
  assert rows.routing == 4 * 1024 * (1 + 40)
  with pytest.raises(ValueError, match="exchange mode"):
    exchange.predict_bytes("partial", **sizes)
  with pytest.raises(ValueError, match="dim must be a positive integer"):
    exchange.predict_bytes("rows", **{**sizes, "dim": 0})
