"""`SparseCoreLookup`, the drop-in for `pz.nn.EmbeddingLookup`, from the
public API: Penzai's own llamalike transformer converted with one line,
compared with the dense model it came from."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from penzai import pz
from penzai.models.transformer import sampling_mode, simple_decoding_loop
from penzai.models.transformer.variants import llamalike_common as ll
from penzai.toolshed import basic_training, jit_wrapper, sharding_util

import pz_sparsecore as pzsc
from pz_sparsecore.device import build, routing
from pz_sparsecore.device.routing import TableGradientError
from pz_sparsecore.nn.tables import table_arrays

VOCAB = 1000


@pytest.fixture(scope="module")
def mesh():
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  return jax.sharding.Mesh(devices, ("data", "model"))


def _config(vocab=VOCAB, tie=False):
  return ll.LlamalikeTransformerConfig(
    num_kv_heads=2,
    query_head_multiplier=1,
    embedding_dim=32,
    projection_dim=16,
    mlp_hidden_dim=64,
    num_decoder_blocks=2,
    vocab_size=vocab,
    mlp_variant="swiglu",
    tie_embedder_and_logits=tie,
  )


def _convert(model, mesh, optimizer=None):
  optimizer = optimizer or pzsc.AdagradOptimizerSpec(learning_rate=0.05)
  return (
    pz.select(model)
    .at_instances_of(pz.nn.EmbeddingLookup)
    .apply(
      lambda lk: pzsc.SparseCoreLookup.from_lookup(
        lk, mesh=mesh, optimizer=optimizer
      )
    )
  )


def _tokens(rng, shape, vocab=VOCAB):
  ids = rng.integers(0, vocab, size=shape)
  # Ids on shard boundaries (8 shards) and the last row.
  ids.flat[: min(4, ids.size)] = [0, 7, 8, vocab - 1][: min(4, ids.size)]
  return pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag("batch", "seq")


def _logits(x):
  return np.asarray(x.unwrap("batch", "seq", "vocabulary"))


# (batch, seq): a batch, a one-token decoding step, a batch of 15 samples
# that does not divide over the 8 shards.
SHAPES = [(4, 16), (1, 1), (3, 5)]


@pytest.fixture(scope="module")
def transformer(mesh):
  model = ll.build_llamalike_transformer(_config(), jax.random.key(0))
  return model, _convert(model, mesh)


@pytest.mark.parametrize("shape", SHAPES)
def test_converted_transformer_equals_dense(transformer, shape):
  model, sparse = transformer
  tokens = _tokens(np.random.default_rng(sum(shape)), shape)
  want = _logits(pz.variable_jit(lambda m, t: m(t))(model, tokens))
  got = pzsc.variable_jit(lambda m, t: m(t))(sparse, tokens)
  np.testing.assert_allclose(_logits(got), want, atol=2e-5)
  if shape == SHAPES[-1]:
    # Eagerly, under Penzai's variable_jit, and under a raw jax.jit of the
    # unbound model, at the shape that does not divide over the mesh.
    np.testing.assert_allclose(_logits(sparse(tokens)), want, atol=2e-5)
    got = pz.variable_jit(lambda m, t: m(t))(sparse, tokens)
    np.testing.assert_allclose(_logits(got), want, atol=2e-5)
    stateless, variables = pz.unbind_variables(sparse, freeze=True)
    raw = jax.jit(lambda v, t: pz.bind_variables(stateless, v)(t))
    np.testing.assert_allclose(_logits(raw(variables, tokens)), want, atol=2e-5)


def test_lookup_matches_embedding_lookup_on_any_axes(mesh):
  table = pz.nn.EmbeddingTable.from_config(
    "emb", jax.random.key(1), 77, {"heads": 2, "proj": 4}
  )
  dense = pz.nn.EmbeddingLookup(table)
  lookup = pzsc.SparseCoreLookup.from_lookup(
    dense, mesh=mesh, optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1)
  )
  rng = np.random.default_rng(2)
  ids = pz.nx.wrap(jnp.asarray(rng.integers(0, 77, (3, 2, 5)))).tag(
    "a", "b", "c"
  )
  got, want = lookup(ids), dense(ids)
  assert dict(got.named_shape) == dict(want.named_shape)
  order = ("a", "b", "c", "heads", "proj")
  np.testing.assert_array_equal(got.unwrap(*order), want.unwrap(*order))
  # Scalar ids (no axes) too.
  one = pz.nx.wrap(jnp.asarray(76))
  np.testing.assert_array_equal(
    lookup(one).unwrap("heads", "proj"), dense(one).unwrap("heads", "proj")
  )


def test_each_device_holds_an_eighth_of_the_table(mesh):
  model = ll.build_llamalike_transformer(_config(), jax.random.key(0))
  sparse = _convert(model, mesh)
  lookup = (
    pz.select(sparse)
    .at_instances_of(pzsc.SparseCoreLookup)
    .pick_nth_selected(0)
    .get()
  )
  stack = lookup.config.plan.stacks[0]
  variables = [*lookup.tables.values(), *lookup.slots[stack.name].values()]
  for var in variables:
    array = var.value.unwrap("sc_shard", "sc_row", "sc_embedding")
    assert len(array.addressable_shards) == 8
    for shard in array.addressable_shards:
      assert shard.data.shape == (1, stack.rows_per_shard, stack.dim)
    assert len({s.device for s in array.addressable_shards}) == 8


def test_device_buffers_equal_host_buffers(mesh):
  """The buffers built on the device are byte-identical to the host's."""
  table = pz.nn.EmbeddingTable.from_config(
    "emb", jax.random.key(1), VOCAB, {"embedding": 8}
  )
  lookup = pzsc.SparseCoreLookup.from_lookup(
    pz.nn.EmbeddingLookup(table),
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
  )
  rng = np.random.default_rng(3)
  for samples in (1, 13, 64, 200):
    ids = rng.integers(0, VOCAB, samples)
    ids[: samples // 3] = ids[0]  # duplicates
    ids[-1] = VOCAB - 1
    host, _ = lookup.preprocess(ids)
    config = lookup.config
    padded = np.full(config.padded_samples(samples), build.NO_ID, np.int32)
    padded[:samples] = ids
    device, dropped = build.build_inputs(
      config.plan_for(samples),
      config.topology,
      {config.feature: jnp.asarray(padded)},
    )
    assert int(dropped[config.feature]) == 0
    for field in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids"):
      np.testing.assert_array_equal(
        np.asarray(getattr(device, field)[config.feature]),
        np.asarray(getattr(host, field)[config.feature]),
        err_msg=f"{field}, {samples} samples",
      )
    np.testing.assert_array_equal(
      np.asarray(device.lhs_gains[config.feature]).view(np.int32),
      np.asarray(host.lhs_gains[config.feature]).view(np.int32),
    )


def test_host_buffers_from_a_side_input(mesh):
  model = ll.build_llamalike_transformer(_config(), jax.random.key(0))
  sparse = _convert(model, mesh)
  tokens = _tokens(np.random.default_rng(4), (4, 8))
  lookup = (
    pz.select(sparse)
    .at_instances_of(pzsc.SparseCoreLookup)
    .pick_nth_selected(0)
    .get()
  )
  inputs, stats = lookup.preprocess(tokens)
  got = pzsc.variable_jit(lambda m, t, i: m(t, sparsecore_inputs=i))(
    sparse, tokens, inputs
  )
  np.testing.assert_allclose(_logits(got), _logits(model(tokens)), atol=2e-5)
  with pytest.raises(ValueError, match="lhs_"):
    sparse(_tokens(np.random.default_rng(4), (4, 30)), sparsecore_inputs=inputs)


def test_bad_ids_are_refused_then_the_next_call_works(mesh):
  table = pz.nn.EmbeddingTable.from_config(
    "emb", jax.random.key(1), 50, {"embedding": 8}
  )
  dense = pz.nn.EmbeddingLookup(table)
  lookup = pzsc.SparseCoreLookup.from_lookup(
    dense, mesh=mesh, optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1)
  )
  bad = pz.nx.wrap(jnp.asarray([3, 50, 4])).tag("batch")
  with pytest.raises(ValueError, match=r"'emb.embeddings'.*token id 50"):
    lookup(bad)
  with pytest.raises(ValueError, match="integers"):
    lookup(pz.nx.wrap(jnp.asarray([1.0])).tag("batch"))
  with pytest.raises(ValueError, match="NamedArray"):
    lookup(jnp.asarray([1]))
  # Under jit, an id out of range looks up zeros; the others are right.
  got = pzsc.variable_jit(lambda m, t: m(t))(lookup, bad)
  values = np.asarray(got.unwrap("batch", "embedding"))
  np.testing.assert_array_equal(values[1], 0)
  good = pz.nx.wrap(jnp.asarray([3, 49, 4])).tag("batch")
  np.testing.assert_array_equal(
    np.asarray(lookup(good).unwrap("batch", "embedding"))[[0, 2]],
    values[[0, 2]],
  )


def _loss_fn(*, model, state, rng, tokens):
  del rng
  logits = model(tokens[{"seq": pz.slice[:-1]}])
  targets = tokens[{"seq": pz.slice[1:]}]
  log_probs = pz.nx.nmap(jax.nn.log_softmax)(logits.untag("vocabulary"))
  nll = -log_probs.tag("vocabulary")[{"vocabulary": targets}]
  return nll.untag("batch", "seq").unwrap().mean(), state, {}


def _corpus(rng, vocab, n, seq):
  """Sequences from a fixed random bigram model over the first 48 ids."""
  nxt = rng.integers(0, 48, size=(48, 2))
  out = np.zeros((n, seq), np.int32)
  out[:, 0] = rng.integers(0, 48, n)
  for t in range(1, seq):
    out[:, t] = nxt[out[:, t - 1], rng.integers(0, 2, n)]
  return out * (vocab // 48)


def test_trainer_learns_as_the_dense_model(mesh):
  rng = np.random.default_rng(5)
  data = _corpus(rng, VOCAB, 8 * 70, 17).reshape(70, 8, 17)
  model = ll.build_llamalike_transformer(_config(), jax.random.key(0))
  sparse = _convert(model, mesh)
  trainers = {
    "sparse": pzsc.SparseCoreTrainer.build(
      jax.random.key(1), sparse, optax.adam(3e-3), _loss_fn
    ),
    "dense": basic_training.StatefulTrainer.build(
      jax.random.key(1), model, optax.adam(3e-3), _loss_fn
    ),
  }
  tokens = lambda x: pz.nx.wrap(jnp.asarray(x)).tag("batch", "seq")
  for step in range(60):
    for trainer in trainers.values():
      jax.block_until_ready(trainer.step(tokens=tokens(data[step])))
  held_out = {}
  for name, trainer in trainers.items():
    # Compiled once per model (eagerly, each batch dispatched op by op).
    loss = pzsc.variable_jit(
      lambda m, t: _loss_fn(model=m, state=None, rng=None, tokens=t)[0]
    )
    losses = [loss(trainer.model, tokens(b)) for b in data[60:]]
    held_out[name] = float(np.mean(losses))
  assert held_out["sparse"] < np.log(VOCAB) - 1.0, held_out
  assert abs(held_out["sparse"] - held_out["dense"]) < 0.25, held_out


def test_hand_written_step_equals_the_trainer(mesh):
  rng = np.random.default_rng(6)
  data = _corpus(rng, VOCAB, 16, 9).reshape(2, 8, 9)
  # Two copies built alike: converted models share their dense variables
  # with the model they came from.
  a, b = (
    _convert(ll.build_llamalike_transformer(_config(), jax.random.key(0)), mesh)
    for _ in range(2)
  )
  sgd = optax.sgd(0.1)
  trainer = pzsc.SparseCoreTrainer.build(jax.random.key(1), a, sgd, _loss_fn)

  def loss_of(model, tokens):
    return _loss_fn(model=model, state=None, rng=None, tokens=tokens)[0]

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def step(model, tokens, step):
    rest, dense = pzsc.split_tables(model)
    loss, grads = pzsc.value_and_grad(loss_of, step=step)(rest, dense, tokens)
    by_label = {v.label: v for v in pz.unbind_params(model)[1]}
    for var, grad in zip(dense, grads, strict=True):
      by_label[var.label].value = jax.tree.map(
        lambda p, g: p - 0.1 * g, var.value, grad.value
      )
    return loss

  for i, batch in enumerate(data):
    tokens = pz.nx.wrap(jnp.asarray(batch)).tag("batch", "seq")
    trainer.step(tokens=tokens)
    step(b, tokens, i)
  got = {v.label: v.value for v in pz.unbind_variables(b)[1]}
  for var in pz.unbind_variables(trainer.model)[1]:
    np.testing.assert_allclose(
      np.asarray(got[var.label].unwrap(*var.value.named_shape)),
      np.asarray(var.value.unwrap(*var.value.named_shape)),
      atol=1e-5,
      err_msg=var.label,
    )


def test_table_gradient_error_names_the_ways_to_train(mesh):
  model = _convert(
    ll.build_llamalike_transformer(_config(), jax.random.key(0)), mesh
  )
  stateless, params = pz.unbind_params(model, freeze=True)
  tokens = _tokens(np.random.default_rng(7), (2, 5))

  def loss(params):
    out = pz.bind_variables(stateless, params)(tokens)
    return out.unwrap("batch", "seq", "vocabulary").sum()

  with pytest.raises(TableGradientError) as e:
    jax.grad(loss)(params)
  assert "SparseCoreTrainer.build" in str(e.value)
  assert "split_tables" in str(e.value)


def test_sampler_runs_on_the_converted_model(transformer):
  model, sparse = transformer
  prompt = _tokens(np.random.default_rng(8), (2, 4))
  outputs = {}
  for name, m in (("dense", model), ("sparse", sparse)):
    decoder = sampling_mode.KVCachingTransformerLM.from_uncached(
      m, cache_len=16, batch_axes={"batch": 2}
    )
    # As Penzai's docs sample: the body compiled (the prompt's shape, then
    # one token's), the caches and the loop in Python.
    decoder = pz.select(decoder).at(lambda d: d.body).apply(jit_wrapper.Jitted)
    outputs[name] = simple_decoding_loop.temperature_sample_pyloop(
      decoder, prompt, rng=jax.random.key(9), max_sampling_steps=6
    )
  assert outputs["sparse"].named_shape == {"batch": 2, "seq": 6}
  np.testing.assert_array_equal(
    outputs["sparse"].unwrap("batch", "seq"),
    outputs["dense"].unwrap("batch", "seq"),
  )


def test_tied_tables_are_refused(mesh):
  model = ll.build_llamalike_transformer(_config(tie=True), jax.random.key(0))
  opt = pzsc.SGDOptimizerSpec(learning_rate=0.1)
  with pytest.raises(pzsc.TiedTableError, match="EmbeddingDecode at"):
    pzsc.convert_lookups(model, mesh=mesh, optimizer=opt)
  # The pz.select line converts; every entry point then refuses.
  converted = _convert(model, mesh, opt)
  with pytest.raises(pzsc.TiedTableError, match="untie it explicitly"):
    pzsc.SparseCoreTrainer.build(
      jax.random.key(1), converted, optax.sgd(0.1), _loss_fn
    )
  with pytest.raises(pzsc.TiedTableError):
    pzsc.split_tables(converted)
  with pytest.raises(pzsc.TiedTableError):
    pzsc.variable_jit(lambda m, t: m(t))(
      converted, _tokens(np.random.default_rng(0), (1, 2))
    )
  # Untied as the message says, the model converts.
  untied = (
    pz.select(model)
    .at_instances_of(pz.nn.EmbeddingDecode)
    .apply(
      lambda d: pz.nn.EmbeddingDecode(
        pz.nn.EmbeddingTable(
          embeddings=pz.Parameter(
            value=d.table.embeddings.value,
            label=d.table.embeddings.label + ".decode",
          ),
          vocabulary_axis=d.table.vocabulary_axis,
        )
      )
    )
  )
  pzsc.convert_lookups(untied, mesh=mesh, optimizer=opt)


def test_penzai_placement_keeps_tables_sharded(mesh):
  model = _convert(
    ll.build_llamalike_transformer(_config(), jax.random.key(0)), mesh
  )
  mapping = {"batch": "data", "neurons": "model"}
  lookup_of = lambda m: (
    pz.select(m)
    .at_instances_of(pzsc.SparseCoreLookup)
    .pick_nth_selected(0)
    .get()
  )
  want = lookup_of(model).config.topology.sharding(3)

  def table(m):
    var = next(iter(lookup_of(m).tables.values()))
    return var.value.unwrap("sc_shard", "sc_row", "sc_embedding")

  def place(model, mapping):
    # Penzai's placement of a model's variables.
    stateless, values = pz.unbind_variables(model, freeze=True)
    values = sharding_util.name_to_name_device_put(values, mesh, mapping)
    return pz.bind_variables(stateless, [v.unfreeze_as_copy() for v in values])

  completed = pzsc.complete_mapping(model, mapping)
  assert completed["sc_shard"] == ("data", "model")
  assert table(place(model, completed)).sharding.is_equivalent_to(want, 3)
  # Without the completion Penzai replicates the table; the first use warns
  # and puts it back.
  replicated = place(model, mapping)
  assert not table(replicated).sharding.is_equivalent_to(want, 3)
  tokens = _tokens(np.random.default_rng(10), (2, 4))
  with pytest.warns(pzsc.TablePlacementWarning, match="complete_mapping"):
    pzsc.variable_jit(lambda m, t: m(t))(replicated, tokens)
  assert table(replicated).sharding.is_equivalent_to(want, 3)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    pzsc.variable_jit(lambda m, t: m(t))(replicated, tokens)


def test_from_config_mirrors_embedding_table(mesh):
  lookup = pzsc.SparseCoreLookup.from_config(
    "tokens",
    jax.random.key(0),
    vocab_size=300,
    embedding_axes={"embedding": 16},
    mesh=mesh,
    optimizer=pzsc.AdamOptimizerSpec(learning_rate=0.01),
  )
  labels = {v.label for v in pz.unbind_variables(lookup)[1]}
  assert "tokens.embeddings" in labels
  assert len(labels) == 3  # table + Adam's two slots
  values = (
    pzsc.viz.vocabulary_view(lookup)
    if hasattr(pzsc.viz, "vocabulary_view")
    else None
  )
  ids = pz.nx.wrap(jnp.arange(300)).tag("batch")
  out = np.asarray(lookup(ids).unwrap("batch", "embedding"))
  assert out.shape == (300, 16)
  # Penzai's initializer scale: about 1 / sqrt(16).
  assert 0.15 < out.std() < 0.35
  if values is not None:
    np.testing.assert_array_equal(
      np.asarray(values.unwrap("vocabulary", "embedding")), out
    )
  with pytest.raises(ValueError, match="embedding_axes"):
    pzsc.SparseCoreLookup.from_config(
      "t", None, 10, {}, mesh, pzsc.SGDOptimizerSpec(learning_rate=0.1)
    )


def test_a_16_bit_lookup_keeps_its_dtype(mesh):
  """A bfloat16 `EmbeddingLookup` converts to a bfloat16 table (its values
  exactly) with bfloat16 activations, as Penzai's lookup returns; dtypes
  given to `from_lookup` or `from_config` are used."""
  table = pz.nn.EmbeddingTable.from_config(
    "emb", jax.random.key(4), 77, {"embedding": 8}, dtype=jnp.bfloat16
  )
  dense = pz.nn.EmbeddingLookup(table)
  sgd = pzsc.SGDOptimizerSpec(learning_rate=0.1)
  lookup = pzsc.SparseCoreLookup.from_lookup(dense, mesh=mesh, optimizer=sgd)
  stack = lookup.config.plan.stacks[0].name
  assert lookup.tables[stack].value.dtype == jnp.bfloat16
  rng = np.random.default_rng(5)
  # Ids 0 and 76: the first and last rows (shard boundaries).
  raw = np.concatenate([[0, 76, 76], rng.integers(0, 77, 29)])
  ids = pz.nx.wrap(jnp.asarray(raw.reshape(4, 8))).tag("a", "b")
  got, want = lookup(ids), dense(ids)
  assert want.dtype == got.dtype == jnp.bfloat16
  order = ("a", "b", "embedding")
  np.testing.assert_array_equal(
    np.asarray(got.unwrap(*order), np.float32),
    np.asarray(want.unwrap(*order), np.float32),
  )
  wide = pzsc.SparseCoreLookup.from_lookup(
    dense, mesh=mesh, optimizer=sgd, activation_dtype=jnp.float32
  )
  assert wide.tables[stack].value.dtype == jnp.bfloat16
  assert wide(ids).dtype == jnp.float32
  np.testing.assert_array_equal(
    wide(ids).unwrap(*order), np.asarray(want.unwrap(*order), np.float32)
  )
  # A float32 table stored in float16 on request: rounded to nearest.
  f32 = pz.nn.EmbeddingLookup(
    pz.nn.EmbeddingTable.from_config("f", jax.random.key(6), 77, {"e": 8})
  )
  half = pzsc.SparseCoreLookup.from_lookup(
    f32, mesh=mesh, optimizer=sgd, dtype=jnp.float16
  )
  assert half(ids).dtype == jnp.float16
  np.testing.assert_array_equal(
    half(ids).unwrap("a", "b", "e"),
    f32(ids).unwrap("a", "b", "e").astype(jnp.float16),
  )
  built = pzsc.SparseCoreLookup.from_config(
    "c", jax.random.key(7), 77, {"e": 8}, mesh, sgd, dtype="bfloat16"
  )
  assert built(ids).dtype == jnp.float32
  with pytest.raises(ValueError, match=r"activation_dtype must be one of"):
    pzsc.SparseCoreLookup.from_config(
      "c", jax.random.key(7), 77, {"e": 8}, mesh, sgd, activation_dtype="int8"
    )


def _hlo(fn, *args) -> str:
  return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize(
  "devices, num_sc, dtype",
  [(8, 1, jnp.float32), (8, 2, jnp.bfloat16), (1, 4, jnp.float32)],
)
def test_a_few_ids_gather_without_the_exchange(devices, num_sc, dtype):
  """Inference calls of at most N ids read their rows with one psum, no
  exchange: the rows of a plain gather of the logical table (zeros for an
  id out of range under jit), bit for bit the exchange's."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()[:devices]).reshape(-1, 2 if devices > 1 else 1),
    ("data", "model"),
  )
  table = pz.nn.EmbeddingTable.from_config(
    "emb", jax.random.key(11), 77, {"heads": 2, "proj": 3}, dtype=dtype
  )
  sgd = pzsc.SGDOptimizerSpec(learning_rate=0.1)
  convert = functools.partial(
    pzsc.SparseCoreLookup.from_lookup,
    pz.nn.EmbeddingLookup(table),
    mesh=mesh,
    optimizer=sgd,
    num_sc_per_device=num_sc,
  )
  lookup, exchanging = convert(), convert(gather_max_samples=0)
  n = devices * num_sc
  logical = np.asarray(
    table.embeddings.value.unwrap("vocabulary", "heads", "proj"), np.float32
  )
  order = ("a", "b", "heads", "proj")
  rng = np.random.default_rng(12)
  # The first and last rows, a shard boundary, and N samples in all.
  raw = np.concatenate([[0, 76, 8], rng.integers(0, 77, n - 3)])[:n]
  ids = pz.nx.wrap(jnp.asarray(raw.reshape(-1, 1), jnp.int32)).tag("a", "b")
  assert lookup.config.gathers(n) and not exchanging.config.gathers(n)
  assert not lookup.config.gathers(n + 1)
  for fn in (lambda m, t: m(t), pzsc.variable_jit(lambda m, t: m(t))):
    got = np.asarray(fn(lookup, ids).unwrap(*order), np.float32)
    np.testing.assert_array_equal(got, logical[raw.reshape(-1, 1)])
    np.testing.assert_array_equal(
      got, np.asarray(fn(exchanging, ids).unwrap(*order), np.float32)
    )
  # Under jit an id out of range reads zeros, as through the exchange.
  bad = pz.nx.wrap(jnp.asarray([[5], [77], [-1]], jnp.int32)).tag("a", "b")
  want = np.zeros((3, 1, 2, 3), np.float32)
  want[0] = logical[5]
  for layer in (lookup, exchanging):
    got = pzsc.variable_jit(lambda m, t: m(t))(layer, bad)
    np.testing.assert_array_equal(
      np.asarray(got.unwrap(*order), np.float32), want
    )
  if devices > 1:
    # The compiled call: one all-reduce and no all-to-all; the exchange's
    # call has its all-to-alls.
    stateless, frozen = pz.unbind_variables(lookup, freeze=True)
    hlo = _hlo(lambda v, t: pz.bind_variables(stateless, v)(t), frozen, ids)
    assert "all-to-all" not in hlo and "all-reduce" in hlo
    stateless, frozen = pz.unbind_variables(exchanging, freeze=True)
    hlo = _hlo(lambda v, t: pz.bind_variables(stateless, v)(t), frozen, ids)
    assert "all-to-all" in hlo


def test_the_gather_rule_never_drops_ids(mesh):
  """With `max_ids_per_partition`, a call gathers only where the exchange
  could drop nothing (its samples per SparseCore within the limit); a bad
  option is refused with the fix."""
  dense = pz.nn.EmbeddingLookup(
    pz.nn.EmbeddingTable.from_config("emb", jax.random.key(3), 64, {"e": 4})
  )
  sgd = pzsc.SGDOptimizerSpec(learning_rate=0.1)
  limited = pzsc.SparseCoreLookup.from_lookup(
    dense,
    mesh=mesh,
    optimizer=sgd,
    max_ids_per_partition=1,
    gather_max_samples=64,
  )
  assert limited.config.gathers(8) and not limited.config.gathers(9)
  wide = pzsc.SparseCoreLookup.from_lookup(
    dense, mesh=mesh, optimizer=sgd, gather_max_samples=64
  )
  assert wide.config.gathers(64) and not wide.config.gathers(65)
  ids = pz.nx.wrap(jnp.arange(64, dtype=jnp.int32).reshape(8, 8)).tag("a", "b")
  np.testing.assert_array_equal(
    wide(ids).unwrap("a", "b", "e"), dense(ids).unwrap("a", "b", "e")
  )
  with pytest.raises(ValueError, match=r"gather_max_samples must be"):
    pzsc.SparseCoreLookup.from_lookup(
      dense, mesh=mesh, optimizer=sgd, gather_max_samples=-1
    )


def test_a_few_ids_still_train_and_refuse_a_table_gradient(mesh):
  """A training call of 2 ids takes the exchange (its buffers feed the
  fused update): one SGD step moves exactly the looked-up rows by
  `-lr * their gradient`; `jax.grad` through the table of a gathering
  call raises `TableGradientError`."""
  lookup = pzsc.SparseCoreLookup.from_config(
    "emb",
    jax.random.key(2),
    40,
    {"e": 4},
    mesh,
    pzsc.SGDOptimizerSpec(learning_rate=0.5),
  )
  (before,) = pzsc.logical_tables(lookup).values()
  weights = np.arange(1.0, 5.0, dtype=np.float32)
  ids = pz.nx.wrap(jnp.asarray([[9], [9]], jnp.int32)).tag("batch", "seq")

  def loss_fn(*, model, state, rng, tokens):
    del rng
    acts = model(tokens).unwrap("batch", "seq", "e")
    return (acts * weights).sum(), state, {}

  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(0), lookup, optax.sgd(0.1), loss_fn
  )
  trainer.step(tokens=ids)
  (after,) = pzsc.logical_tables(trainer.model).values()
  want = before.copy()
  want[9] -= 0.5 * 2 * weights  # two samples read row 9
  np.testing.assert_allclose(after, want, rtol=1e-6)

  stateless, params = pz.unbind_params(lookup, freeze=True)
  with pytest.raises(TableGradientError):
    jax.grad(
      lambda p: (
        pz.bind_variables(stateless, p)(ids).unwrap("batch", "seq", "e").sum()
      )
    )(params)


@pytest.mark.parametrize("sharding_axis", [None, "model"])
def test_gather_lookup_on_any_placement(mesh, sharding_axis):
  """`routing.gather_lookup` against a plain gather, for a table sharded
  over the whole mesh, over one of its axes (replicas over the other), and
  replicated on every device (the `replicated` placement)."""
  dense = pz.nn.EmbeddingLookup(
    pz.nn.EmbeddingTable.from_config("emb", jax.random.key(8), 50, {"e": 6})
  )
  lookup = pzsc.SparseCoreLookup.from_lookup(
    dense,
    mesh=mesh,
    optimizer=pzsc.SGDOptimizerSpec(learning_rate=0.1),
    sharding_axis=sharding_axis,
  )
  config = lookup.config
  logical = np.asarray(dense.table.embeddings.value.unwrap("vocabulary", "e"))
  ids = jnp.asarray([49, 0, 3, 17, 50, -2], jnp.int32)
  want = np.where((np.asarray(ids) >= 0)[:, None], logical[ids % 50], 0.0)
  want[4] = 0.0  # 50 is out of range
  (table,) = table_arrays(lookup).values()
  plan = config.plan_for(ids.size)
  got = routing.gather_lookup(plan, config.topology, table, ids, 50)
  np.testing.assert_array_equal(np.asarray(got)[:, :6], want)
  stack = plan.stacks[0].name
  replicated = dataclasses.replace(
    config.topology, replicated=frozenset({stack})
  )
  whole = jax.device_put(table, replicated.table_sharding(stack))
  got = routing.gather_lookup(plan, replicated, whole, ids, 50)
  np.testing.assert_array_equal(np.asarray(got)[:, :6], want)
