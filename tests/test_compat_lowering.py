"""compat's custom optimizer lowering: StableHLO text of a row update.

The modules are run (through the module-call primitive, which executes
any StableHLO text) and compared with the update computed in numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pz_sparsecore.compat.lib.nn import custom_optimizer_lowering as lowering

_ROW = np.array([[-2.0, 0.5, 3.0, 7.0]], np.float32)
_GRAD = np.array([[1.0, -4.0, 2.0, -1.0]], np.float32)
_LR = np.full((1, 4), 0.5, np.float32)


def _run(text: str, *args: np.ndarray, results: int) -> list[np.ndarray]:
  """Executes a module of `[1, 4]` float32 operands and results."""
  row = jax.ShapeDtypeStruct((1, 4), jnp.float32)
  out = jax.jit(
    lambda *a: lowering._call_module_p.bind(
      *a, module=text, results=(row,) * results
    )
  )(*args)
  return [np.asarray(x) for x in out]


def _sgd(grad, row, lr):
  return row - lr * grad


def _adagrad(grad, row, accumulator, lr):
  accumulator = accumulator + grad * grad
  return row - lr * grad / jnp.sqrt(accumulator), accumulator


def test_apply_clipping():
  values = jnp.array([-2.0, 0.0, 2.0, 5.0])
  np.testing.assert_array_equal(lowering.apply_clipping(values), values)
  np.testing.assert_array_equal(
    lowering.apply_clipping(values, min_value=0.0), [0, 0, 2, 5]
  )
  np.testing.assert_array_equal(
    lowering.apply_clipping(values, max_value=3.0), [-2, 0, 2, 3]
  )
  np.testing.assert_array_equal(
    lowering.apply_clipping(values, 0.0, 3.0), [0, 0, 2, 3]
  )


@pytest.mark.parametrize("limits", [(None, None), (0.0, 3.0), (None, 1.0)])
def test_lowered_sgd_runs(limits):
  text = lowering.lower_to_stablehlo(_sgd, 4, 0, 1, *limits)
  assert "func.func public @main" in text and "stablehlo" in text
  (row,) = _run(text, _GRAD, _ROW, _LR, results=1)
  expected = _ROW - 0.5 * _GRAD  # [-2.5, 2.5, 2, 7.5]
  lo, hi = limits
  expected = np.clip(expected, -np.inf if lo is None else lo, hi or np.inf)
  np.testing.assert_allclose(row, expected)


def test_lowered_adagrad_clips_the_row_only():
  text = lowering.lower_to_stablehlo(_adagrad, 4, 1, 1, -1.0, 1.0)
  accumulator = np.ones((1, 4), np.float32)
  row, new_accumulator = _run(text, _GRAD, _ROW, accumulator, _LR, results=2)
  expected_acc = accumulator + _GRAD**2  # [2, 17, 5, 2]
  np.testing.assert_allclose(new_accumulator, expected_acc)
  expected = _ROW - 0.5 * _GRAD / np.sqrt(expected_acc)
  np.testing.assert_allclose(row, np.clip(expected, -1, 1), rtol=1e-6)


def test_wrap_with_limits():
  raw = lowering.lower_to_stablehlo(_sgd, 4, 0, 1)
  assert lowering.wrap_stablehlo_with_limits(raw, 4, 0, 1) == raw
  assert lowering.wrap_stablehlo_with_limits(raw.encode(), 4, 0, 1) == raw
  wrapped = lowering.wrap_stablehlo_with_limits(raw, 4, 0, 1, 0.0, 2.0)
  (row,) = _run(wrapped, _GRAD, _ROW, _LR, results=1)
  np.testing.assert_allclose(row, [[0.0, 2.0, 2.0, 2.0]])
  adagrad = lowering.lower_to_stablehlo(_adagrad, 4, 1, 1)
  wrapped = lowering.wrap_stablehlo_with_limits(adagrad, 4, 1, 1, None, 0.0)
  accumulator = np.ones((1, 4), np.float32)
  row, new_accumulator = _run(wrapped, _GRAD, _ROW, accumulator, _LR, results=2)
  np.testing.assert_allclose(new_accumulator, accumulator + _GRAD**2)
  assert (row <= 0).all()


def test_bad_counts():
  with pytest.raises(ValueError, match="embedding_dim must be an integer"):
    lowering.lower_to_stablehlo(_sgd, 0)
  with pytest.raises(ValueError, match="num_slot_variables"):
    lowering.wrap_stablehlo_with_limits("", 4, -1, 1, 0.0)
