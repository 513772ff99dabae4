"""Forward lookup over a device mesh against a dense numpy reference.

Every case builds one `SparseCoreEmbed` holding features of every combiner,
ragged weighted inputs with empty rows and duplicates, a stack of two tables
with rotation, a feature narrower than its table and a ("batch", "seq")
feature, writes known tables with `set_logical_tables`, and compares each
activation with `act[b] = sum_j gain_bj * T[id_bj]` computed in numpy.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import layout, specs
from pz_sparsecore.device import routing
from pz_sparsecore.device import topology as topology_lib
from pz_sparsecore.nn.embed import SparseCoreEmbed
from pz_sparsecore.nn.tables import table_arrays

BATCH = 16
SEQ = 4


def _table(name, vocab, dim, combiner):
  return specs.TableSpec(
    name=name,
    vocabulary_size=vocab,
    embedding_dim=dim,
    initializer=jax.nn.initializers.normal(1.0),
    optimizer=specs.SGDOptimizerSpec(learning_rate=0.1),
    combiner=combiner,
  )


def _feature(name, table, out_dim=None, sample_shape=(BATCH,), k=1):
  out_dim = out_dim or table.embedding_dim
  count = int(np.prod(sample_shape))
  return specs.FeatureSpec(
    name=name,
    table_spec=table,
    input_shape=(count, k),
    output_shape=(*sample_shape, out_dim),
  )


def _feature_specs(g: int, s: int) -> dict[str, specs.FeatureSpec]:
  t_sum = _table("t_sum", 100, 8, "sum")
  t_mean = _table("t_mean", 77, 5, "mean")
  t_sqrtn = _table("t_sqrtn", 64, 16, "sqrtn")
  s_a = _table("s_a", 40, 8, "sum")
  s_b = _table("s_b", 72, 8, "sum")
  t_seq = _table("t_seq", 50, 8, "sum")
  features = {
    "f_sum": _feature("f_sum", t_sum),
    "f_mean": _feature("f_mean", t_mean),
    "f_sqrtn": _feature("f_sqrtn", t_sqrtn, out_dim=12),
    "f_sa": _feature("f_sa", s_a, k=2),
    "f_sb": _feature("f_sb", s_b),
    "f_sb2": _feature("f_sb2", s_b),
    "f_seq": _feature("f_seq", t_seq, sample_shape=(BATCH, SEQ)),
  }
  return layout.stack_tables(
    features, ["s_b", "s_a"], g, s, rotation=1, stack_name="stk"
  )


def _boundary_ids(vocab: int, rng: np.random.RandomState) -> list[int]:
  special = [0, vocab - 1] + [m for m in range(0, vocab, 8)]
  return list(rng.permutation(special))


def _ragged(vocab, rng, weighted):
  """A ragged batch: empty rows, duplicates, boundary ids."""
  boundary = _boundary_ids(vocab, rng)
  rows, weights = [], []
  for b in range(BATCH):
    if b % 5 == 3:
      n = 0
    else:
      n = rng.randint(1, 7)
    row = list(rng.randint(0, vocab, n))
    if n and b % 4 == 0:
      row.append(row[0])  # A duplicate in the same sample.
    row += boundary[b::BATCH][:2]
    row = np.asarray(row, np.int64 if b % 2 else np.int32)
    rows.append(row)
    weights.append(rng.uniform(0.25, 2.0, len(row)).astype(np.float32))
  if weighted:
    return rows, weights
  return rows, None


def _batch(seed: int):
  rng = np.random.RandomState(seed)
  ids, weights = {}, {}
  ids["f_sum"], weights["f_sum"] = _ragged(100, rng, True)
  ids["f_mean"], weights["f_mean"] = _ragged(77, rng, False)
  ids["f_sqrtn"], weights["f_sqrtn"] = _ragged(64, rng, True)
  sa = rng.randint(0, 40, (BATCH, 2))
  sa[0] = [0, 39]
  sa[1] = [16, 16]
  ids["f_sa"], weights["f_sa"] = sa, None
  ids["f_sb"], weights["f_sb"] = _ragged(72, rng, False)
  ids["f_sb2"], weights["f_sb2"] = _ragged(72, rng, True)
  seq = rng.randint(0, 50, (BATCH, SEQ))
  seq[0, :] = [0, 49, 8, 16]
  ids["f_seq"], weights["f_seq"] = seq, None
  return ids, weights


def _tables(seed: int):
  rng = np.random.RandomState(seed)
  dims = {
    "t_sum": (100, 8),
    "t_mean": (77, 5),
    "t_sqrtn": (64, 16),
    "s_a": (40, 8),
    "s_b": (72, 8),
    "t_seq": (50, 8),
  }
  return {k: rng.normal(size=v).astype(np.float32) for k, v in dims.items()}


def dense_reference(rows, weights, table, combiner, out_dim):
  """`act[b] = sum_j gain_bj * T[id_bj]`, gains from the combiner."""
  rows = [np.asarray(r).reshape(-1) for r in rows]
  out = np.zeros((len(rows), out_dim), np.float64)
  for b, row in enumerate(rows):
    if weights is None:
      w = np.ones(len(row))
    else:
      w = np.asarray(weights[b], np.float64).reshape(-1)
    if not len(row):
      continue
    if combiner == "sum":
      div = 1.0
    elif combiner == "mean":
      div = w.sum()
    else:
      div = np.sqrt((w**2).sum())
    out[b] = ((w / div)[:, None] * table[row, :out_dim]).sum(0)
  return out


COMBINER = {
  "f_sum": ("t_sum", "sum"),
  "f_mean": ("t_mean", "mean"),
  "f_sqrtn": ("t_sqrtn", "sqrtn"),
  "f_sa": ("s_a", "sum"),
  "f_sb": ("s_b", "sum"),
  "f_sb2": ("s_b", "sum"),
  "f_seq": ("t_seq", "sum"),
}


def _mesh(shape: tuple[int, ...]) -> Mesh:
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  names = ("device", "model")[: len(shape)]
  return Mesh(devices, names)


TOPOLOGIES = [
  ((1,), 1),
  ((1,), 2),
  ((2,), 1),
  ((2,), 2),
  ((4,), 1),
  ((4,), 2),
  ((8,), 1),
  ((8,), 2),
  ((4, 2), 1),
  ((4, 2), 2),
]
# Every multi-device topology with both exchanges (one device: "local").
CASES = [
  (mesh, s, mode)
  for mesh, s in TOPOLOGIES
  for mode in (("auto",) if mesh[0] == 1 else ("activations", "rows"))
]


@pytest.mark.parametrize(
  "mesh_shape,num_sc,exchange",
  CASES,
  ids=[f"{m}x{s}-{e}" for m, s, e in CASES],
)
def test_forward_matches_dense_reference(mesh_shape, num_sc, exchange):
  mesh = _mesh(mesh_shape)
  g = mesh_shape[0]
  embed = SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _feature_specs(g, num_sc),
    mesh,
    sharding_axis="device",
    num_sc_per_device=num_sc,
    feature_axes={"f_seq": ("batch", "seq")},
    exchange=exchange,
  )
  topology = embed.config.topology
  for stack in embed.config.plan.stacks:
    expected = "local" if g == 1 else exchange
    assert topology.exchange_of(stack).mode == expected
  # The stacked pair really shares one stack, with rotation; by default the
  # two other compatible tables (8 wide, sum, one optimizer) share one too.
  assert set(embed.tables) == {"t_mean", "t_sqrtn", "stk", "t_seq_t_sum"}
  stack_specs = layout.get_table_specs(embed.config.plan.feature_specs)
  n = g * num_sc
  assert stack_specs["s_a"].setting_in_stack.shard_rotation == 1 % n
  assert stack_specs["s_a"].setting_in_stack.row_offset_in_shard > 0

  tables = _tables(1)
  pzsc.set_logical_tables(embed, tables)
  ids, weights = _batch(2)
  inputs, _ = embed.preprocess(ids, weights)
  out = embed(inputs)
  for name, (table, combiner) in COMBINER.items():
    act = out[name]
    assert isinstance(act, pz.nx.NamedArray)
    spec = embed.config.plan.feature_specs[
      [f.name for f in embed.config.plan.feature_specs].index(name)
    ]
    out_dim = spec.output_shape[-1]
    if name == "f_seq":
      assert dict(act.named_shape) == {
        "batch": BATCH,
        "seq": SEQ,
        "embedding": out_dim,
      }
      value = np.asarray(act.unwrap("batch", "seq", "embedding"))
      rows = list(ids[name].reshape(-1, 1))
      expected = dense_reference(
        rows, None, tables[table], combiner, out_dim
      ).reshape(BATCH, SEQ, out_dim)
    else:
      assert dict(act.named_shape) == {"batch": BATCH, "embedding": out_dim}
      value = np.asarray(act.unwrap("batch", "embedding"))
      expected = dense_reference(
        ids[name], weights[name], tables[table], combiner, out_dim
      )
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-5)
    # Sharded over the batch on the sharding axis.
    sharding = act.data_array.sharding
    assert isinstance(sharding, NamedSharding)
    assert sharding.is_equivalent_to(
      NamedSharding(mesh, P("device")), act.data_array.ndim
    )


def test_lookup_entry_point_on_two_axis_mesh():
  """`routing.lookup` on positional arrays, sharding axis "model"."""
  mesh = _mesh((2, 4))
  embed = SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(3),
    _feature_specs(4, 1),
    mesh,
    sharding_axis="model",
    feature_axes={"f_seq": ("batch", "seq")},
  )
  assert embed.config.topology.num_devices == 4
  tables = _tables(5)
  pzsc.set_logical_tables(embed, tables)
  ids, weights = _batch(6)
  inputs, _ = embed.preprocess(ids, weights)
  acts = routing.lookup(
    embed.config.plan, embed.config.topology, table_arrays(embed), inputs
  )
  expected = dense_reference(
    ids["f_sum"], weights["f_sum"], tables["t_sum"], "sum", 8
  )
  np.testing.assert_allclose(acts["f_sum"], expected, rtol=1e-5, atol=1e-5)
  assert acts["f_seq"].shape == (BATCH * SEQ, 8)
  # Table shards live on the "model" axis: 4 distinct shards.
  table = table_arrays(embed)["t_seq_t_sum"]
  assert table.sharding.spec[0] == "model"


def test_topology_rejects_unknown_axis():
  with pytest.raises(ValueError, match="mesh axis .model., which the mesh"):
    topology_lib.Topology(_mesh((2,)), "model", 1)
