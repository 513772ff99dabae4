"""jax-tpu-embedding's custom-optimizer update primitive."""

from pz_sparsecore.compat.lib.core.primitives import optimizer_primitives

tpu_sparse_dense_matmul_optimizer_grad_primitive = (
  optimizer_primitives.of_module(__name__)
)
