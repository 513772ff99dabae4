"""jax-tpu-embedding's ftrl update primitive (see `optimizer_primitives`)."""

from pz_sparsecore.compat.lib.core.primitives import optimizer_primitives

tpu_sparse_dense_matmul_grad_with_ftrl_primitive = (
  optimizer_primitives.of_module(__name__)
)
