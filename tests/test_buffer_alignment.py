"""The preprocessed buffers are aligned so that `device_put` copies nothing.

JAX's CPU client uses a NumPy array's memory as the device buffer when it
starts at a multiple of 64 bytes and copies it otherwise; every stack's
block of every buffer (the sample order, minibatched buffers, several local
devices) starts at such an address, and the values are those of unaligned
blocks (the other preprocessing tests compare them with references).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pz_sparsecore as pzsc
from pz_sparsecore.core import specs
from pz_sparsecore.host import blocks as blocks_lib

BATCH = 24


def _features():
  """Three stacks of sizes that are no multiple of 16 values: different
  widths keep the tables apart."""
  features = {}
  for i, (vocab, dim, hot) in enumerate(
    ((37, 8, 3), (1000, 16, 1), (5, 24, 2))
  ):
    table = specs.TableSpec(
      name=f"t{i}",
      vocabulary_size=vocab,
      embedding_dim=dim,
      initializer=jax.nn.initializers.normal(1.0),
      optimizer=specs.SGDOptimizerSpec(learning_rate=0.1),
      combiner="sum",
      max_ids_per_partition=BATCH * hot,
      max_unique_ids_per_partition=BATCH * hot,
    )
    features[f"f{i}"] = specs.FeatureSpec(
      name=f"f{i}",
      table_spec=table,
      input_shape=(BATCH, hot),
      output_shape=(BATCH, dim),
    )
  return features


def _batch(features, seed):
  rng = np.random.default_rng(seed)
  return {
    name: rng.integers(0, f.table_spec.vocabulary_size, f.input_shape)
    for name, f in features.items()
  }, {name: None for name in features}


def _preprocess(prepared, ids, weights, devices, num_sc, minibatching):
  inputs, _ = pzsc.preprocess_sparse_dense_matmul_input(
    ids,
    weights,
    prepared,
    devices,
    devices,
    num_sc_per_device=num_sc,
    enable_minibatching=minibatching,
  )
  return inputs


def _entries(inputs, name):
  """A stack's (row, sample, gain) entries, padding left out, sorted."""
  rows = np.asarray(inputs.lhs_embedding_ids[name]).reshape(-1)
  samples = np.asarray(inputs.lhs_sample_ids[name]).reshape(-1)
  gains = np.asarray(inputs.lhs_gains[name]).reshape(-1)
  real = rows != pzsc.PAD_ID
  return sorted(zip(rows[real], samples[real], gains[real], strict=True))


def _leaves(inputs):
  return [
    x for x in jax.tree.leaves(inputs) if isinstance(x, np.ndarray) and x.size
  ]


@pytest.mark.parametrize(
  "devices, num_sc, minibatching",
  [(1, 1, False), (1, 2, False), (4, 1, False), (1, 1, True), (2, 2, True)],
)
def test_every_block_is_aligned_and_device_put_shares_it(
  devices, num_sc, minibatching
):
  features = _features()
  prepared = pzsc.prepare_feature_specs_for_training(
    features, global_device_count=devices, num_sc_per_device=num_sc
  )
  ids, weights = _batch(features, devices + num_sc)
  inputs = _preprocess(prepared, ids, weights, devices, num_sc, minibatching)
  leaves = _leaves(inputs)
  assert (inputs.sample_order is not None) == (
    devices == 1 and not minibatching
  )
  assert len(leaves) >= 12  # Three stacks' four buffers (and the order).
  if devices == 1:  # Sizes that would leave contiguous blocks unaligned.
    assert {x.size % 16 for x in leaves} != {0}
  for x in leaves:
    assert x.ctypes.data % blocks_lib.ALIGN_BYTES == 0, x.shape
    placed = jax.device_put(x, jax.devices("cpu")[0])
    assert placed.unsafe_buffer_pointer() == x.ctypes.data, x.shape
    np.testing.assert_array_equal(np.asarray(placed), x)


@pytest.mark.parametrize("devices, num_sc", [(1, 1), (1, 2), (2, 2)])
def test_minibatched_stacks_hold_the_fills_entries(devices, num_sc):
  """Minibatching reads the fill's buffers of every stack where the fill
  wrote them (aligned blocks, row pointers included): within the limits,
  one minibatch of each stack holds the plain fill's entries."""
  features = _features()
  prepared = pzsc.prepare_feature_specs_for_training(
    features, global_device_count=devices, num_sc_per_device=num_sc
  )
  ids, weights = _batch(features, 7)
  plain = _preprocess(prepared, ids, weights, devices, num_sc, False)
  split = _preprocess(prepared, ids, weights, devices, num_sc, True)
  assert np.asarray(split.num_minibatches).max() == 1
  assert len(plain.lhs_embedding_ids) == 3
  for name in plain.lhs_embedding_ids:
    assert _entries(split, name) == _entries(plain, name), name


def test_blocks_start_aligned_and_hold_their_sizes():
  blocks = blocks_lib.Blocks.aligned(np.array([5, 16, 0, 17, 1]))
  np.testing.assert_array_equal(blocks.starts, [0, 16, 32, 32, 64])
  assert blocks.total == 80
  flat = blocks.empty(np.float32)
  assert flat.shape == (80,) and flat.ctypes.data % 64 == 0
  flat[:] = np.arange(80)
  for t, size in enumerate((5, 16, 0, 17, 1)):
    block = blocks.block(flat, t)
    assert block.shape == (size,)
    assert block.ctypes.data % 64 == 0 or size == 0
    np.testing.assert_array_equal(block, np.arange(size) + blocks.starts[t])
  np.testing.assert_array_equal(
    blocks.parts(np.array([2, 8, 0, 8, 1]), 2),
    [[0, 2], [16, 24], [32, 32], [32, 40], [64, 65]],
  )
  assert blocks_lib.Blocks.aligned(np.zeros(0, np.int64)).total == 0
  grid = blocks_lib.aligned_empty((3, 5), np.int32)
  assert grid.shape == (3, 5) and grid.ctypes.data % 64 == 0
