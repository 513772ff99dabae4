"""The prefetching input pipeline and the trainer's loop over it.

Outputs are compared with calling the same functions in the caller's thread;
lookahead is read from a source that counts its pulls; shutdown is read from
the threads alive afterwards.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs
from pz_sparsecore.host.pipeline import PrefetchError, prefetch

THREAD_NAME = "pzsc-prefetch"
TIMEOUT_S = 5.0


def _prefetch_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def _wait_until(condition, timeout=TIMEOUT_S) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return True
    time.sleep(0.01)
  return condition()


@pytest.fixture(autouse=True)
def no_thread_left():
  """Every test starts and must end without a pipeline thread."""
  assert _wait_until(lambda: not _prefetch_threads())
  yield
  gc.collect()
  assert _wait_until(lambda: not _prefetch_threads()), "thread leaked"


class CountingSource:
  """An iterator of random arrays that counts how many were pulled."""

  def __init__(self, n: int | None, seed: int = 0):
    self.n = n
    self.pulled = 0
    self._rng = np.random.RandomState(seed)

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    if self.n is not None and self.pulled >= self.n:
      raise StopIteration
    self.pulled += 1
    return self._rng.randint(0, 1000, size=self._rng.randint(1, 20))


def _transform(x: np.ndarray) -> tuple[int, np.ndarray]:
  return int(x.sum()), np.cumsum(x[::-1])


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_order_and_values_match_unpipelined(depth):
  expected = [_transform(x) for x in CountingSource(40, seed=depth)]
  got = list(prefetch(CountingSource(40, seed=depth), _transform, depth=depth))
  assert len(got) == len(expected)
  for (s, c), (es, ec) in zip(got, expected, strict=True):
    assert s == es
    np.testing.assert_array_equal(c, ec)


def test_no_preprocess_passes_batches_through():
  assert list(prefetch(range(7))) == list(range(7))
  assert list(prefetch([])) == []


@pytest.mark.parametrize("depth", [1, 2, 4])
def test_lookahead_is_bounded_by_depth_plus_one(depth):
  source = CountingSource(None)
  consumed = 0
  with prefetch(source, _transform, depth=depth) as pipeline:
    for _ in range(6):
      # The thread fills the queue and holds one more batch, then waits.
      bound = consumed + depth + 1
      assert _wait_until(lambda b=bound: source.pulled >= b)
      time.sleep(0.05)
      assert source.pulled == bound
      next(pipeline)
      consumed += 1
  assert not pipeline.running
  assert source.pulled <= consumed + depth + 1


def _fails_at(k: int):
  def preprocess(x):
    if x == k:
      raise ValueError(f"bad batch value {x}")
    return 10 * x

  return preprocess


@pytest.mark.parametrize("k", [0, 3])
def test_preprocess_error_names_batch_after_earlier_batches(k):
  source = iter(range(10))
  got = []
  with pytest.raises(ValueError) as info:
    for y in prefetch(source, _fails_at(k), depth=2):
      got.append(y)
  assert got == [10 * i for i in range(k)]
  err = info.value
  assert isinstance(err, PrefetchError)
  assert err.batch_number == k
  assert f"batch {k}: preprocess raised ValueError" in str(err)
  assert isinstance(err.__cause__, ValueError)
  assert str(err.__cause__) == f"bad batch value {k}"
  # The user's next action: a new pipeline over the same source continues
  # after the failed batch.
  assert list(prefetch(source, lambda x: 10 * x)) == [
    10 * i for i in range(k + 1, 10)
  ]


def test_source_error_names_batch():
  def source():
    yield from range(3)
    raise OSError("disk gone")

  got = []
  with pytest.raises(OSError) as info:
    for y in prefetch(source(), lambda x: -x):
      got.append(y)
  assert got == [0, -1, -2]
  assert "batch 3: the source raised OSError: disk gone" in str(info.value)
  assert info.value.batch_number == 3
  # Afterwards the pipeline is closed and ends.
  pipeline = prefetch(iter(range(3)))
  assert next(pipeline) == 0
  pipeline.close()
  with pytest.raises(StopIteration):
    next(pipeline)


def test_error_without_own_type_is_prefetch_error():
  def preprocess(x):
    raise StopIteration("not an end of iteration")

  with pytest.raises(PrefetchError) as info:
    list(prefetch(range(3), preprocess))
  assert not isinstance(info.value, StopIteration)
  assert info.value.batch_number == 0
  assert isinstance(info.value.__cause__, StopIteration)


def test_break_in_with_block_stops_thread():
  source = CountingSource(None)
  with prefetch(source, _transform) as pipeline:
    for i, _ in enumerate(pipeline):
      if i == 3:
        break
  assert not pipeline.running
  pulled = source.pulled
  time.sleep(0.1)
  assert source.pulled == pulled <= 4 + 2 + 1


def test_break_out_of_plain_for_loop_stops_thread():
  for i, _ in enumerate(prefetch(itertools.count(), depth=3)):
    if i == 2:
      break
  # The abandoned pipeline is collected, which stops its thread.
  assert _wait_until(lambda: not _prefetch_threads())


def test_abandoned_iterator_is_collected_and_stops():
  pipeline = prefetch(itertools.count())
  assert next(pipeline) == 0
  assert _wait_until(lambda: len(_prefetch_threads()) == 1)
  del pipeline
  gc.collect()
  assert _wait_until(lambda: not _prefetch_threads())


def test_close_with_infinite_source_and_full_queue_is_prompt():
  source = CountingSource(None)
  pipeline = prefetch(source, depth=2)
  # The thread is blocked on the full queue.
  assert _wait_until(lambda: source.pulled == 3)
  start = time.monotonic()
  pipeline.close()
  assert time.monotonic() - start < 1.0
  assert not pipeline.running
  pipeline.close()  # Again: nothing happens.
  assert list(pipeline) == []


def test_exception_in_loop_body_stops_thread():
  with pytest.raises(KeyError):
    with prefetch(itertools.count(), lambda x: x * x) as pipeline:
      for y in pipeline:
        if y > 10:
          raise KeyError("consumer failed")
  assert not pipeline.running
  # The next pipeline works.
  assert list(prefetch(range(4), lambda x: x * x)) == [0, 1, 4, 9]


@pytest.mark.parametrize("depth", [0, -1, 1.5, True])
def test_bad_depth(depth):
  with pytest.raises(ValueError, match="depth"):
    prefetch(range(3), depth=depth)


def test_preprocessing_overlaps_the_consumer():
  """With both sides sleeping 50 ms per batch, the loop takes about one
  side's time, not the sum."""

  def slow(x):
    time.sleep(0.05)
    return x

  n = 12
  start = time.monotonic()
  for _ in prefetch(range(n), slow):
    time.sleep(0.05)
  elapsed = time.monotonic() - start
  # Unpipelined: n * 0.1 s. Pipelined: (n + 1) * 0.05 s plus overheads.
  assert elapsed < n * 0.1 * 0.8, elapsed


# ---------------------------------------------------------------------------
# A real model: preprocessing in the thread, the trainer's loop.

BATCH, VOCAB, DIM, OUT = 32, 200, 8, 4


def _feature_specs() -> dict[str, specs.FeatureSpec]:
  out = {}
  for name, vocab, combiner in (("a", VOCAB, "sum"), ("b", 90, "mean")):
    table = specs.TableSpec(
      name=f"t_{name}",
      vocabulary_size=vocab,
      embedding_dim=DIM,
      initializer=jax.nn.initializers.normal(0.5),
      optimizer=specs.AdagradOptimizerSpec(learning_rate=0.1),
      combiner=combiner,
    )
    out[name] = specs.FeatureSpec(
      name=name,
      table_spec=table,
      input_shape=(BATCH, 5),
      output_shape=(BATCH, DIM),
    )
  return out


@pz.pytree_dataclass
class _Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Linear

  def __call__(self, inputs, /, **side_inputs):
    acts = self.embed(inputs)
    return self.head(acts["a"] + acts["b"])


def _model() -> _Model:
  mesh = Mesh(np.array(jax.devices()), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "embed", jax.random.key(0), _feature_specs(), mesh
  )
  head = pz.nn.Linear.from_config(
    "head",
    jax.random.key(1),
    input_axes={"embedding": DIM},
    output_axes={"out": OUT},
  )
  return _Model(embed=embed, head=head)


def _loss_fn(*, model, state, rng, inputs, targets):
  del rng
  pred = model(inputs).unwrap("batch", "out")
  loss = jnp.mean((pred - targets) ** 2)
  return loss, state, {"loss": loss}


def _raw_batches(n: int, seed: int = 0):
  rng = np.random.RandomState(seed)
  for _ in range(n):
    ids = {
      name: [
        rng.randint(0, vocab, rng.randint(0, 6)).astype(np.int32)
        for _ in range(BATCH)
      ]
      for name, vocab in (("a", VOCAB), ("b", 90))
    }
    yield ids, rng.normal(size=(BATCH, OUT)).astype(np.float32)


def _step_kwargs(embed):
  def preprocess(raw):
    ids, targets = raw
    inputs, _ = embed.preprocess(ids)
    return {"inputs": inputs, "targets": jnp.asarray(targets)}

  return preprocess


def test_embed_preprocess_in_thread_equals_caller_thread():
  embed = _model().embed
  expected = [embed.preprocess(ids) for ids, _ in _raw_batches(5)]
  got = list(
    prefetch(_raw_batches(5), lambda raw: embed.preprocess(raw[0]), depth=2)
  )
  for (inputs, stats), (e_inputs, e_stats) in zip(got, expected, strict=True):
    for x, y in zip(
      jax.tree.leaves((inputs, stats)),
      jax.tree.leaves((e_inputs, e_stats)),
      strict=True,
    ):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _trainer() -> pzsc.SparseCoreTrainer:
  return pzsc.SparseCoreTrainer.build(
    jax.random.key(2), _model(), optax.adam(0.01), _loss_fn
  )


def _snapshot(trainer) -> dict[str, np.ndarray]:
  model = trainer.model
  out = {f"table {k}": v for k, v in pzsc.logical_tables(model.embed).items()}
  for table, slots in pzsc.logical_slots(model.embed).items():
    for slot, value in slots.items():
      out[f"slot {table}/{slot}"] = np.asarray(value)
  for var in pz.unbind_params(model.head)[1]:
    out[var.label] = np.asarray(var.value.unwrap(*var.value.named_shape))
  return out


def test_fit_equals_steps_by_hand():
  by_hand = _trainer()
  hand_losses = []
  for kwargs in map(_step_kwargs(by_hand.model.embed), _raw_batches(6)):
    hand_losses.append(float(by_hand.step(**kwargs)["loss"]))

  fitted = _trainer()
  seen = []
  auxes = fitted.fit(
    _raw_batches(100),
    _step_kwargs(fitted.model.embed),
    steps=6,
    callback=lambda i, aux: seen.append(i),
  )
  assert seen == list(range(6))
  np.testing.assert_allclose(
    [float(a["loss"]) for a in auxes], hand_losses, rtol=1e-6
  )
  expected, got = _snapshot(by_hand), _snapshot(fitted)
  assert expected.keys() == got.keys()
  assert int(fitted.state.value.step) == 6
  for key in expected:
    np.testing.assert_allclose(
      got[key], expected[key], rtol=1e-6, atol=1e-7, err_msg=key
    )


def test_fit_error_keeps_earlier_steps_then_continues():
  trainer = _trainer()
  source = _raw_batches(5)
  preprocess = _step_kwargs(trainer.model.embed)
  calls = itertools.count()

  def failing(raw):
    if next(calls) == 2:
      raise ValueError("feature 'a': broken batch")
    return preprocess(raw)

  with pytest.raises(ValueError, match="batch 2: preprocess raised"):
    trainer.fit(source, failing)
  assert int(trainer.state.value.step) == 2
  # The user's next action: fit on the rest of the same source.
  auxes = trainer.fit(source, preprocess)
  assert len(auxes) == 2
  assert int(trainer.state.value.step) == 4
  assert all(np.isfinite(float(a["loss"])) for a in auxes)


def test_fit_rejects_bad_arguments():
  trainer = _trainer()
  with pytest.raises(ValueError, match="steps"):
    trainer.fit(_raw_batches(2), steps=-1)
  with pytest.raises(ValueError, match="mapping"):
    trainer.fit(_raw_batches(2), lambda raw: raw)
  assert int(trainer.state.value.step) == 0
