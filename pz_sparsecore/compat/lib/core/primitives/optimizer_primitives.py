"""The optimizer primitives optimizer specs name.

Upstream binds these on TPU inside its backward pass. In pz_sparsecore the
fused update is `pz_sparsecore.sparse_dense_matmul_grad` (or the layer's
`apply_gradients` / `SparseCoreTrainer`), so these primitives identify an
optimizer (`OptimizerSpec.get_optimizer_primitive()`) and binding one raises
an error that says so.
"""

from __future__ import annotations

import functools
from typing import Any

from jax.extend import core as jex_core


@functools.cache
def primitive(short_name: str) -> Any:
  """The primitive of the optimizer called `short_name`."""
  name = (
    "sparse_dense_matmul_optimizer_grad"
    if short_name == "custom"
    else f"sparse_dense_matmul_grad_with_{short_name}"
  )
  prim = jex_core.Primitive(name)

  def refuse(*args: Any, **kwargs: Any) -> Any:
    del args, kwargs
    raise NotImplementedError(
      f"{name} is a TPU primitive; pz_sparsecore applies the {short_name} "
      "update with pz_sparsecore.sparse_dense_matmul_grad"
    )

  prim.def_impl(refuse)
  prim.def_abstract_eval(refuse)
  return prim
