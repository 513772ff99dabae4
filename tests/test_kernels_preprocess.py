"""Kernels on buffers from the real host preprocessor (1 device, 2 SCs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close

from pz_sparsecore.device import kernels

sp = pytest.importorskip("pz_sparsecore.core.specs")
layout = pytest.importorskip("pz_sparsecore.core.layout")
preprocess = pytest.importorskip("pz_sparsecore.host.preprocess")

VOCAB, DIM, BATCH, NUM_SC = 40, 4, 8, 2


def _problem(seed: int):
  table_spec = sp.TableSpec(
    name="t",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.zeros,
    optimizer=sp.SGDOptimizerSpec(),
    combiner="sum",
    max_ids_per_partition=64,
    max_unique_ids_per_partition=64,
  )
  feature = sp.FeatureSpec(
    name="f",
    table_spec=table_spec,
    input_shape=[BATCH, 1],
    output_shape=[BATCH, DIM],
  )
  specs = layout.prepare_feature_specs_for_training({"f": feature}, 1, NUM_SC)
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, VOCAB, (BATCH, 5))
  ids[0, :2] = [0, VOCAB - 1]
  weights = rng.uniform(0.5, 2.0, ids.shape).astype(np.float32)
  buffers, _ = preprocess.preprocess_sparse_dense_matmul_input(
    {"f": ids}, {"f": weights}, specs, 1, 1, num_sc_per_device=NUM_SC
  )
  logical = rng.normal(size=(VOCAB, DIM)).astype(np.float32)
  (stack,) = buffers.lhs_row_pointers
  physical = layout.stack_and_shard_tables(
    specs, {"t": logical}, num_shards=NUM_SC, pad_value=0.0
  )[stack]
  physical = np.asarray(physical, np.float32).reshape(-1, physical.shape[-1])
  args = tuple(
    jnp.asarray(getattr(buffers, f)[stack])
    for f in (
      "lhs_row_pointers",
      "lhs_embedding_ids",
      "lhs_sample_ids",
      "lhs_gains",
    )
  )
  lay = dict(
    num_segments=NUM_SC,
    samples_per_segment=BATCH // NUM_SC,
    num_partitions=NUM_SC,
    rows_per_partition=physical.shape[0] // NUM_SC,
  )
  return ids, weights, logical, np.asarray(physical, np.float32), args, lay


@pytest.mark.parametrize("impl", ["ffi", "reference"])
def test_forward_and_sgd_on_preprocessed_buffers(impl):
  ids, weights, logical, physical, args, lay = _problem(0)
  want = np.einsum("bk,bkd->bd", weights, logical[ids])
  out = jax.jit(
    lambda *a: kernels.sparse_dense_matmul(*a, **lay, implementation=impl)
  )(*args, jnp.asarray(physical))
  assert_close(np.asarray(out)[:, :DIM], want, rtol=1e-5)

  act_grad = np.zeros(out.shape, np.float32)
  act_grad[:, :DIM] = np.random.default_rng(1).normal(size=(BATCH, DIM))
  new, _ = jax.jit(
    lambda g, *a: kernels.sparse_dense_matmul_grad(
      g,
      *a,
      (),
      optimizer="sgd",
      hyperparameters=jnp.ones(1, jnp.float32),
      **lay,
      implementation=impl,
    )
  )(jnp.asarray(act_grad), *args, jnp.asarray(physical))
  # Dense truth on the logical table, then compare row by row.
  logical_grad = np.zeros_like(logical, np.float64)
  np.add.at(
    logical_grad,
    ids.reshape(-1),
    (weights[..., None] * act_grad[:, None, :DIM]).reshape(-1, DIM),
  )
  new = np.asarray(new)
  rpp = lay["rows_per_partition"]
  for v in range(VOCAB):
    # MOD sharding: logical row v lives in partition v % N, row v // N.
    row = (v % NUM_SC) * rpp + v // NUM_SC
    assert_close(
      new[row, :DIM], logical[v] - logical_grad[v], rtol=1e-5, atol=1e-6
    )
