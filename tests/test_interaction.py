"""`pzsc.dot_interaction` against NumPy and PyTorch references, values and
gradients, on random inputs of several shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import assert_close
from penzai import pz

import pz_sparsecore as pzsc


def _numpy_pairs(v, self_interaction):
  """float64: every sample's `v_i . v_j` for `i < j` (or `i <= j`)."""
  n = v.shape[-2]
  iu, ju = np.triu_indices(n, 0 if self_interaction else 1)
  v = np.asarray(v, np.float64)
  return np.einsum("...d,...d->...", v[..., iu, :], v[..., ju, :])


def _numpy_grad(v, g, self_interaction):
  """float64: the gradient of `sum(pairs * g)`: each pair adds `g v_j` to
  `v_i` and `g v_i` to `v_j`."""
  n = v.shape[-2]
  iu, ju = np.triu_indices(n, 0 if self_interaction else 1)
  v, g = np.asarray(v, np.float64), np.asarray(g, np.float64)
  out = np.zeros_like(v)
  for k, (i, j) in enumerate(zip(iu, ju, strict=True)):
    out[..., i, :] += g[..., k, None] * v[..., j, :]
    out[..., j, :] += g[..., k, None] * v[..., i, :]
  return out


@pytest.mark.parametrize("self_interaction", [False, True])
@pytest.mark.parametrize(
  "shape", [(64, 27, 16), (3, 5, 4, 8), (7, 1, 4), (2, 2, 1), (6, 9, 3)]
)
def test_values_and_gradient_equal_numpy(shape, self_interaction):
  rng = np.random.default_rng(sum(shape) + self_interaction)
  v = rng.normal(size=shape).astype(np.float32)
  v[0, 0] = v[0, -1]  # Equal vectors in one sample.
  want = _numpy_pairs(v, self_interaction)
  n = shape[-2]
  pairs = n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2
  g = rng.normal(size=(*shape[:-2], pairs)).astype(np.float32)

  def loss(x):
    return jnp.sum(
      pzsc.dot_interaction(x, self_interaction=self_interaction) * g
    )

  got = jax.jit(
    lambda x: pzsc.dot_interaction(x, self_interaction=self_interaction)
  )(v)
  assert got.shape == (*shape[:-2], pairs) and got.dtype == jnp.float32
  assert_close(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  grad = jax.jit(jax.grad(loss))(v)
  assert_close(
    np.asarray(grad), _numpy_grad(v, g, self_interaction), rtol=1e-5, atol=1e-5
  )


def test_equals_torchrec_order_of_bmm_and_triu():
  """The pairs in the order of `torch.bmm(v, v^T)[:, iu, ju]` (TorchRec's
  `InteractionArch`), and the same gradient as torch's autograd."""
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(3)
  v = rng.normal(size=(32, 27, 16)).astype(np.float32)
  g = rng.normal(size=(32, 351)).astype(np.float32)
  tv = torch.tensor(v, requires_grad=True)
  iu = torch.triu_indices(27, 27, 1)
  tz = torch.bmm(tv, tv.transpose(1, 2))[:, iu[0], iu[1]]
  (tz * torch.tensor(g)).sum().backward()
  got, vjp = jax.vjp(pzsc.dot_interaction, v)
  assert_close(np.asarray(got), tz.detach().numpy(), rtol=1e-5, atol=1e-4)
  assert_close(np.asarray(vjp(g)[0]), tv.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_gradient_is_one_batched_product_and_no_scatter():
  """Values and gradient compile to two dots (the forward's and one for the
  gradient), no gather or scatter; autodiff of the einsum and gather gives
  three dots, a gather and a scatter."""
  v = jnp.ones((16, 27, 16))
  g = jnp.ones((16, 351))
  iu, ju = np.triu_indices(27, 1)

  def hlo(fn):
    def both(x):
      out, vjp = jax.vjp(fn, x)
      return out, vjp(g)[0]

    text = jax.jit(both).lower(v).as_text()
    return text.count("stablehlo.dot_general"), (
      "gather" in text or "scatter" in text
    )

  assert hlo(pzsc.dot_interaction) == (2, False)
  assert hlo(lambda x: jnp.einsum("bid,bjd->bij", x, x)[:, iu, ju]) == (3, True)


def test_bfloat16_and_vmap_and_named_arrays():
  rng = np.random.default_rng(5)
  v = rng.normal(size=(4, 6, 5, 8)).astype(np.float32)
  want = _numpy_pairs(v, False)
  half = pzsc.dot_interaction(jnp.asarray(v, jnp.bfloat16))
  assert half.dtype == jnp.bfloat16
  assert_close(np.asarray(half, np.float32), want, rtol=0.05, atol=0.1)
  mapped = jax.vmap(pzsc.dot_interaction)(v)
  assert_close(np.asarray(mapped), want, rtol=1e-5, atol=1e-5)
  named = pz.nx.wrap(v).tag("batch", "time", "feature", "embedding")
  out = pzsc.dot_interaction(named.untag("feature", "embedding"))
  out = out.tag("pair")
  assert dict(out.named_shape) == {"batch": 4, "time": 6, "pair": 10}
  assert_close(
    np.asarray(out.unwrap("batch", "time", "pair")), want, rtol=1e-5, atol=1e-5
  )
  grad = jax.grad(
    lambda x: (
      pzsc.dot_interaction(x.untag("feature", "embedding"))
      .tag("pair")
      .unwrap("batch", "time", "pair")
      .sum()
    )
  )(named)
  ones = np.ones(want.shape, np.float32)
  assert_close(
    np.asarray(grad.unwrap("batch", "time", "feature", "embedding")),
    _numpy_grad(v, ones, False),
    rtol=1e-5,
    atol=1e-4,
  )


def test_bad_shapes_are_value_errors_and_the_next_call_works():
  with pytest.raises(ValueError, match=r"\[\.\.\., n, d\].*shape \(5,\)"):
    pzsc.dot_interaction(np.ones(5, np.float32))
  with pytest.raises(ValueError, match=r"positional shape \(2, 3, 4\)"):
    pzsc.dot_interaction(pz.nx.wrap(np.ones((2, 3, 4), np.float32)))
  with pytest.raises(ValueError, match=r"positional shape \(\)"):
    pzsc.dot_interaction(pz.nx.wrap(np.ones((3, 4), np.float32)).tag("n", "d"))
  out = pzsc.dot_interaction(np.ones((2, 3, 4), np.float32))
  np.testing.assert_array_equal(np.asarray(out), np.full((2, 3), 4.0))
