"""Named axes to mesh axes: tables over every device of a two-axis mesh.

A Penzai model (a `SparseCoreEmbed` with a stack of two tables with
rotation, a sequence feature and Adagrad, and an MLP head placed with
`pz.toolshed.sharding_util`) trains on 2 x 4 and 4 x 2 `("data", "model")`
meshes exactly as on a 1 x 8 one, with each device holding an eighth of
every table; bad mappings and meshes are refused with the fix; checkpoints
move between the meshes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz
from penzai.toolshed import sharding_util
from test_parallel import BATCH, SEQ, _batch, _feature_specs, _tables

import pz_sparsecore as pzsc
from pz_sparsecore.viz import figures as viz

MAPPING = {"batch": "data", "hidden": "model"}
HIDDEN = 16


def _mesh(shape):
  devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
  return Mesh(devices, ("data", "model"))


@pz.pytree_dataclass
class Model(pz.nn.Layer):
  """Features summed into an MLP: embedding → hidden (ReLU) → one logit."""

  embed: pzsc.SparseCoreEmbed
  mlp: pz.nn.Sequential

  def __call__(self, inputs, /, **side_inputs):
    acts = self.embed(inputs, **side_inputs)
    seq = pz.nx.nmap(jnp.sum)(acts.pop("f_seq").untag("seq"))
    total = seq[{"embedding": pz.slice[:8]}]
    for name in ("f_sum", "f_sa", "f_sb", "f_sb2"):
      total = total + acts[name][{"embedding": pz.slice[:8]}]
    return self.mlp(total)


def _model(shape, mapping=MAPPING, rng=0):
  mesh = _mesh(shape)
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    None if rng is None else jax.random.key(rng),
    _feature_specs(8, 1),
    mesh,
    feature_axes={"f_seq": ("batch", "seq")},
    axis_name_to_mesh_name=mapping,
    stacking=None,  # One stack per table: the tests name them.
  )
  mlp = pz.nn.Sequential(
    [
      pz.nn.Linear.from_config(
        "up",
        jax.random.key(1),
        input_axes={"embedding": 8},
        output_axes={"hidden": HIDDEN},
      ),
      pz.nn.Elementwise(jax.nn.relu),
      pz.nn.Linear.from_config(
        "down",
        jax.random.key(2),
        input_axes={"hidden": HIDDEN},
        output_axes={},
      ),
    ]
  )
  # The dense part is placed the Penzai way, with the same mapping.
  for param in pz.unbind_params(mlp)[1]:
    param.value = sharding_util.name_to_name_device_put(
      param.value, mesh, {k: v for k, v in mapping.items() if k != "batch"}
    )
  return Model(embed=embed, mlp=mlp)


def _loss_fn(*, model, state, rng, inputs, targets):
  del rng
  logits = model(inputs).unwrap("batch")
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, targets))
  return loss, state, {"loss": loss}


def _train(shape, steps=4):
  model = _model(shape)
  pzsc.set_logical_tables(model.embed, _tables(1))
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(3), model, optax.adam(0.05), _loss_fn
  )
  rng = np.random.default_rng(0)
  losses = []
  for step in range(steps):
    inputs, _ = trainer.model.embed.preprocess(*_batch(10 + step))
    targets = jax.device_put(
      rng.integers(0, 2, BATCH).astype(np.float32),
      NamedSharding(_mesh(shape), P("data")),
    )
    aux = trainer.step(inputs=inputs, targets=targets)
    losses.append(float(aux["loss"]))
  return trainer, losses


@pytest.fixture(scope="module")
def runs():
  return {shape: _train(shape) for shape in ((1, 8), (2, 4), (4, 2))}


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=str)
def test_two_axis_meshes_train_like_one_axis(runs, shape):
  (base, base_losses), (trainer, losses) = runs[(1, 8)], runs[shape]
  np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
  assert base_losses[-1] < base_losses[0]
  tables = pzsc.logical_tables(trainer.model.embed)
  expected = pzsc.logical_tables(base.model.embed)
  for name in expected:
    np.testing.assert_allclose(tables[name], expected[name], atol=1e-6)
  # The trained layers look a new batch up alike.
  acts = [
    t.model.embed(t.model.embed.preprocess(*_batch(99))[0])
    for t in (trainer, base)
  ]
  for name in acts[1]:
    np.testing.assert_allclose(
      acts[0][name].data_array, acts[1][name].data_array, atol=1e-6
    )
  slots = pzsc.logical_slots(trainer.model.embed)
  expected_slots = pzsc.logical_slots(base.model.embed)
  for name in expected_slots:
    np.testing.assert_allclose(
      slots[name]["accumulator"],
      expected_slots[name]["accumulator"],
      rtol=1e-5,
    )


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (4, 2)], ids=str)
def test_each_device_holds_an_eighth_of_every_table(runs, shape):
  trainer, _ = runs[shape]
  embed = trainer.model.embed
  assert embed.config.topology.axes == ("data", "model")
  for param in embed.tables.values():
    table = param.value.data_array
    shards = table.addressable_shards
    assert len(shards) == 8
    assert {s.device for s in shards} == set(jax.devices())
    for shard in shards:
      assert shard.data.nbytes * 8 == table.nbytes


def test_activations_carry_the_mapped_shardings(runs):
  trainer, _ = runs[(2, 4)]
  embed = trainer.model.embed
  inputs, _ = embed.preprocess(*_batch(1))
  acts = embed(inputs)
  mesh = _mesh((2, 4))
  # What sharding_util gives the same names is what the layer returns.
  expected = sharding_util.name_to_name_sharding(acts, mesh, MAPPING)
  for name, act in acts.items():
    assert act.data_array.sharding.is_equivalent_to(
      expected[name].data_array, act.data_array.ndim
    ), name
  assert acts["f_seq"].named_shape == {
    "batch": BATCH,
    "seq": SEQ,
    "embedding": 8,
  }
  # The head's weights were placed by sharding_util over "model".
  weights = trainer.model.mlp.sublayers[0].weights.value.data_array
  assert weights.sharding.spec == P(None, "model")


def test_mapping_the_embedding_axis_shards_activation_columns():
  # The features whose widths divide over "model" (4 ways).
  names = ("f_sum", "f_sa", "f_sb", "f_sb2")
  specs = {k: v for k, v in _feature_specs(8, 1).items() if k in names}
  ids, weights = (
    {k: v for k, v in tree.items() if k in names} for tree in _batch(2)
  )
  out = {}
  for shape, mapping in (
    ((2, 4), {"batch": "data", "embedding": "model"}),
    ((1, 8), None),
  ):
    embed = pzsc.SparseCoreEmbed.from_config(
      "emb",
      jax.random.key(0),
      specs,
      _mesh(shape),
      axis_name_to_mesh_name=mapping,
      stacking=None,  # One stack per table: the tests name them.
    )
    pzsc.set_logical_tables(
      embed,
      {k: v for k, v in _tables(1).items() if k in ("t_sum", "s_a", "s_b")},
    )
    out[shape] = embed(embed.preprocess(ids, weights)[0])["f_sum"].data_array
  act = out[(2, 4)]
  assert act.sharding.spec == P("data", "model")
  assert act.addressable_shards[0].data.shape == (BATCH // 2, 8 // 4)
  np.testing.assert_allclose(act, out[(1, 8)], rtol=1e-6)


def test_a_mesh_axis_the_mesh_lacks_is_refused_then_a_good_mapping_builds():
  with pytest.raises(ValueError, match="'batch' maps to mesh axis 'dta'"):
    _model((2, 4), {"batch": "dta"})
  with pytest.raises(ValueError, match="mesh axis 'device', which the mesh"):
    _model((2, 4), {"sc_shard": "device"})
  with pytest.raises(
    ValueError,
    match="axes 'batch' and 'embedding' both map to mesh axis 'data'",
  ):
    _model((2, 4), {"batch": "data", "embedding": "data"})
  with pytest.raises(ValueError, match="'embedding' of size 5 does not"):
    _model((2, 4), {"embedding": "model"})  # f_mean is 5 wide.
  # The batch defaults to the mesh axes no other name took.
  mapping = _model((2, 4), {"seq": "model"}).embed.config.axis_mapping
  assert mapping["batch"] == ("data",)
  assert _model((2, 4), {"batch": ("data", "model")}).embed.config.plan


def test_tables_on_one_axis_of_two_are_replicated_on_the_other():
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _feature_specs(4, 1),
    _mesh((2, 4)),
    feature_axes={"f_seq": ("batch", "seq")},
    axis_name_to_mesh_name={"sc_shard": "model"},
    stacking=None,  # One stack per table: the tests name them.
  )
  table = embed.tables["t_sum"].value.data_array
  assert embed.config.topology.num_devices == 4
  assert table.addressable_shards[0].data.nbytes * 4 == table.nbytes


def test_explicit_axes_mesh_is_refused_with_the_fix():
  explicit = jax.make_mesh((2, 4), ("data", "model"))
  with pytest.raises(ValueError, match=r"'data' \(Explicit\).*AxisType.Auto"):
    pzsc.SparseCoreEmbed.from_config(
      "emb",
      jax.random.key(0),
      _feature_specs(8, 1),
      explicit,
      stacking=None,  # One stack per table: the tests name them.
    )
  auto = jax.make_mesh(
    (2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2
  )
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb",
    jax.random.key(0),
    _feature_specs(8, 1),
    auto,
    feature_axes={"f_seq": ("batch", "seq")},
    stacking=None,  # One stack per table: the tests name them.
  )
  assert embed.config.topology.num_devices == 8


@pytest.mark.parametrize("before,after", [((2, 4), (1, 8)), ((1, 8), (2, 4))])
def test_checkpoint_moves_between_meshes(runs, tmp_path, before, after):
  trainer, _ = runs[before]
  pzsc.save_checkpoint(tmp_path, trainer.model)
  restored = pzsc.restore_checkpoint(tmp_path, _model(after, rng=None))
  tables = pzsc.logical_tables(restored.embed)
  expected = pzsc.logical_tables(trainer.model.embed)
  for name in expected:
    np.testing.assert_array_equal(tables[name], expected[name])
  table = restored.embed.tables["t_sum"].value.data_array
  assert table.sharding.is_equivalent_to(
    NamedSharding(_mesh(after), P(("data", "model"))), 3
  )


def test_treescope_shows_the_mapping(runs):
  embed = runs[(2, 4)][0].model.embed
  text = viz.describe(embed)
  assert "on ('data', 'model')" in text.splitlines()[0]
  assert (
    "mesh axes: sc_shard -> ('data', 'model'); batch -> 'data'; "
    "seq, embedding -> replicated"
  ) in text
  # The shard map groups the shards by the mesh axes they live on.
  html = viz.to_html(viz.shard_map_figure(embed, stack="t_sum"))
  assert "data (2)" in html and "model (4)" in html
