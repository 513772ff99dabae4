"""jax-tpu-embedding's adagrad_momentum update primitive."""

from pz_sparsecore.compat.lib.core.primitives import optimizer_primitives

tpu_sparse_dense_matmul_grad_with_adagrad_momentum_primitive = (
  optimizer_primitives.of_module(__name__)
)
