"""jax-tpu-embedding's sgd update primitive (see `optimizer_primitives`)."""

from pz_sparsecore.compat.lib.core.primitives import optimizer_primitives

tpu_sparse_dense_matmul_grad_with_sgd_primitive = (
  optimizer_primitives.of_module(__name__)
)
