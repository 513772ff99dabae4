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

from pz_sparsecore.core import optimizers, specs

_CUSTOM = specs.CustomOptimizerSpec.kernel_name
"""The kernel name of every custom optimizer."""
_CUSTOM_NAME = "sparse_dense_matmul_optimizer_grad"
_PREFIX = "sparse_dense_matmul_grad_with_"


def _primitive_name(short_name: str) -> str:
  """Upstream's name of the primitive (and of its module)."""
  return _CUSTOM_NAME if short_name == _CUSTOM else _PREFIX + short_name


@functools.cache
def primitive(short_name: str) -> Any:
  """The primitive of the optimizer called `short_name`."""
  name = _primitive_name(short_name)
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


def of_module(module_name: str) -> Any:
  """The primitive of the module `module_name`, named as upstream's module
  of it (`...primitives.sparse_dense_matmul_grad_with_<optimizer>`, or
  `sparse_dense_matmul_optimizer_grad` for custom optimizers).

  Raises:
    ValueError: If the module names no optimizer of the registry.
  """
  base = module_name.rpartition(".")[2]
  short_name = _CUSTOM if base == _CUSTOM_NAME else base.removeprefix(_PREFIX)
  known = short_name == _CUSTOM or short_name in optimizers.REGISTRY
  if not known or _primitive_name(short_name) != base:
    raise ValueError(f"{module_name} names no optimizer of the registry")
  return primitive(short_name)
