"""`pzsc.variable_jit` against Penzai's `pz.variable_jit`.

Same results on a model with a `SparseCoreEmbed` and a dense head; a call
returns, donates and replaces only the variables it wrote: a forward keeps
every variable's value object, a donated training step keeps the table's
buffers (in place) and compiles with no table-sized operation.
"""

from __future__ import annotations

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz
from test_inplace import _table_sized

import pz_sparsecore as pzsc

VOCAB, DIM, BATCH, IDS = 2**16 + 8, 16, 64, 4


@pz.pytree_dataclass
class _Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Linear

  def __call__(self, inputs, **side):
    return self.head(self.embed(inputs)["f"])


def _model(devices: int = 4) -> _Model:
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(),
    optimizer=pzsc.AdagradOptimizerSpec(learning_rate=0.1),
    combiner="sum",
  )
  features = {
    "f": pzsc.FeatureSpec(
      name="f",
      table_spec=table,
      input_shape=(BATCH, IDS),
      output_shape=(BATCH, DIM),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:devices]), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh
  )
  head = pz.nn.Linear.from_config(
    "head", jax.random.key(1), {"embedding": DIM}, {"out": 1}
  )
  return _Model(embed=embed, head=head)


def _inputs(model: _Model, seed: int):
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, VOCAB, (BATCH, IDS))
  ids[:, 0] = ids[0, 0]  # duplicates across samples
  inputs, _ = model.embed.preprocess({"f": ids})
  return inputs, jnp.asarray(rng.normal(size=BATCH), jnp.float32)


def _values(model: _Model) -> dict[str, np.ndarray]:
  """Copies of every variable's value, by label.

  Copies, because a NumPy view of a CPU array is an external reference to
  its buffer, and XLA cannot donate a buffer that is still referenced: the
  next donated step would copy the table instead of updating it in place.
  """
  _, variables = pz.unbind_variables(model)
  return {
    str(v.label): np.array(jax.tree.leaves(v.value)[0], copy=True)
    for v in variables
  }


def _pointers(array: jax.Array) -> list[int]:
  return [s.data.unsafe_buffer_pointer() for s in array.addressable_shards]


def _step(model: _Model, inputs, labels, step):
  """A hand-written training step: head by SGD, the table by its spec."""
  acts = model.embed(inputs)
  head, params = pz.unbind_params(model.head, freeze=True)

  def loss_of(params, acts):
    logits = pz.bind_variables(head, params)(acts["f"])
    return jnp.mean((logits.unwrap("batch", "out")[:, 0] - labels) ** 2)

  loss, (g_params, g_acts) = jax.value_and_grad(loss_of, (0, 1))(params, acts)
  model.embed.apply_gradients(inputs, g_acts, step)
  for param, value, grad in zip(
    pz.unbind_params(model.head)[1], params, g_params, strict=True
  ):
    param.value = jax.tree.map(
      lambda v, g: v - 0.1 * g, value.value, grad.value
    )
  return loss


def test_forward_matches_and_replaces_no_variable():
  model = _model()
  inputs, _ = _inputs(model, 0)
  ours = pzsc.variable_jit(lambda m, x: m(x))
  theirs = pz.variable_jit(lambda m, x: m(x))
  _, variables = pz.unbind_variables(model)
  before = [v.value for v in variables]
  got = ours(model, inputs)
  assert all(v.value is b for v, b in zip(variables, before, strict=True))
  want = theirs(model, inputs)
  np.testing.assert_allclose(
    got.unwrap("batch", "out"), want.unwrap("batch", "out"), rtol=1e-6
  )


@pytest.mark.parametrize("devices", [1, 4])
def test_training_step_matches_penzai_in_place(devices):
  ours_model, theirs_model = _model(devices), _model(devices)
  ours = pzsc.variable_jit(_step, donate_variables=True)
  theirs = pz.variable_jit(_step, donate_variables=True)
  table = ours_model.embed.tables["t"]
  for step in range(3):
    inputs, labels = _inputs(ours_model, 10 + step)
    pointers = _pointers(table.value.data_array)
    loss = ours(ours_model, inputs, labels, jnp.asarray(step))
    assert _pointers(table.value.data_array) == pointers
    want = theirs(theirs_model, inputs, labels, jnp.asarray(step))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    got, expected = _values(ours_model), _values(theirs_model)
    assert got.keys() == expected.keys()
    for label in expected:
      np.testing.assert_allclose(
        got[label], expected[label], rtol=1e-5, atol=1e-7, err_msg=label
      )


def test_training_step_compiles_without_table_sized_operations():
  model = _model()
  inputs, labels = _inputs(model, 0)
  step = pzsc.variable_jit(_step, donate_variables=True)
  compiled = step.lower(model, inputs, labels, jnp.asarray(0)).compile()
  elements = model.embed.tables["t"].value.data_array.size // 4
  offenders = _table_sized(compiled.as_text(), elements)
  assert not offenders, "table-sized operations:\n" + "\n".join(offenders)
  forward = pzsc.variable_jit(lambda m, x: m(x)).lower(model, inputs)
  assert not _table_sized(forward.compile().as_text(), elements)


def test_written_set_follows_a_static_argument():
  model = _model()
  inputs, labels = _inputs(model, 1)

  def maybe_train(model, inputs, labels, train):
    if train:
      return _step(model, inputs, labels, jnp.asarray(0))
    return model(inputs).unwrap("batch", "out").sum()

  ours = pzsc.variable_jit(
    maybe_train, donate_variables=True, static_argnames="train"
  )
  reference = _model()
  for train in (False, True, False, True):
    before = _values(model)
    ours(model, inputs, labels, train=train)
    after = _values(model)
    if train:
      _step(reference, inputs, labels, jnp.asarray(0))
      assert any(not np.array_equal(before[k], after[k]) for k in after)
    else:
      for label in after:
        np.testing.assert_array_equal(after[label], before[label])
  expected = _values(reference)
  for label, value in _values(model).items():
    np.testing.assert_allclose(value, expected[label], rtol=1e-5, atol=1e-7)


def test_assigning_the_same_value_is_not_a_write():
  counter = pz.StateVariable(jnp.zeros((), jnp.int32), label="counter")
  scale = pz.StateVariable(jnp.ones(()), label="scale")

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def count(counter, scale, x):
    scale.value = scale.value
    counter.value = counter.value + 1
    return x * scale.value

  scale_value = scale.value
  for i in range(3):
    assert float(count(counter, scale, jnp.float32(2.0))) == 2.0
    assert int(counter.value) == i + 1
  assert scale.value is scale_value and not scale_value.is_deleted()


def test_returning_a_variable_is_refused_then_a_good_call_works():
  counter = pz.StateVariable(jnp.zeros(()), label="counter")
  leak = pzsc.variable_jit(lambda v: v)
  with pytest.raises(ValueError, match="Returning a variable"):
    leak(counter)

  @pzsc.variable_jit
  def bump(v):
    v.value = v.value + 1

  bump(counter)
  assert float(counter.value) == 1.0


def test_optax_state_in_a_variable_is_updated():
  w = pz.Parameter(value=jnp.ones(3), label="w")
  opt = optax.adam(0.1)
  state = pz.StateVariable(value=opt.init(w.value), label="opt")

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def fit(w, state):
    g = 2 * w.value
    updates, state.value = opt.update(g, state.value)
    w.value = optax.apply_updates(w.value, updates)

  w_ref, s_ref = jnp.ones(3), opt.init(jnp.ones(3))
  for _ in range(4):
    fit(w, state)
    u, s_ref = opt.update(2 * w_ref, s_ref)
    w_ref = optax.apply_updates(w_ref, u)
  np.testing.assert_allclose(w.value, w_ref, rtol=1e-6)


def test_values_replaced_between_calls_are_read_and_not_kept():
  """A forward reads each variable's current value (the fast path's leaves
  are remembered per value object): values assigned between calls are
  used, and a replaced table-sized value is not kept alive by the jitted
  function; a value of another structure retraces."""
  small = pz.Parameter(value=jnp.full((3,), 2.0), label="small")
  large = pz.Parameter(value=jnp.ones((2**16 + 1,)), label="large")
  fn = pzsc.variable_jit(lambda a, b, x: a.value.sum() * b.value[:4] + x)
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(fn(small, large, x), 6.0 + np.arange(4.0))
  np.testing.assert_array_equal(fn(small, large, x), 6.0 + np.arange(4.0))
  old_small, old_large = weakref.ref(small.value), weakref.ref(large.value)
  small.value = jnp.full((3,), 3.0)
  large.value = jnp.full((2**16 + 1,), 2.0)
  gc.collect()
  assert old_large() is None  # Held weakly: freed once replaced.
  np.testing.assert_array_equal(fn(small, large, x), 18.0 + np.arange(4.0))
  gc.collect()
  assert old_small() is None  # Replaced in the cache by the new value.
  # Another structure (a pair instead of an array): traced again.
  small.value = (jnp.ones(3), jnp.ones(3))
  pair = pzsc.variable_jit(lambda a, x: a.value[0].sum() + a.value[1].sum() + x)
  np.testing.assert_array_equal(pair(small, x), 6.0 + np.arange(4.0))
  small.value = jnp.full((3,), 1.0)
  np.testing.assert_array_equal(fn(small, large, x), 6.0 + np.arange(4.0))


def test_donated_variables_are_updated_in_place_every_call():
  """The fast path donates the written variables' leaves: a KV-cache-like
  update writes into the same buffer call after call, the read variable
  stays untouched, and the result follows a NumPy reference."""
  cache = pz.StateVariable(value=jnp.zeros((4, 8)), label="cache")
  index = pz.StateVariable(value=jnp.zeros((), jnp.int32), label="index")
  row = pz.Parameter(value=jnp.arange(8.0), label="row")

  @functools.partial(pzsc.variable_jit, donate_variables=True)
  def write(cache, index, row, scale):
    cache.value = cache.value.at[index.value].set(row.value * scale)
    index.value = index.value + 1
    return cache.value.sum()

  want = np.zeros((4, 8), np.float32)
  row_value = row.value
  buffers = set()
  for i in range(4):
    total = write(cache, index, row, jnp.float32(i + 1))
    buffers.add(cache.value.unsafe_buffer_pointer())
    want[i] = np.arange(8.0) * (i + 1)
    np.testing.assert_array_equal(np.array(cache.value, copy=True), want)
    assert float(total) == want.sum() and int(index.value) == i + 1
  assert row.value is row_value and not row_value.is_deleted()
  assert len(buffers) == 1  # Donated: the cache was updated in place.
