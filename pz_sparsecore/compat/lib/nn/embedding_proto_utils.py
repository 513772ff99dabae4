"""jax-tpu-embedding's `lib/nn/embedding_proto_utils`: specs <-> protos.

The message classes and the layout conversion are
`pz_sparsecore.core.spec_proto`'s; an optimizer's message is described in
`pz_sparsecore.core.optimizer_proto`. The functions here take and give the
compat namespace's (mutable) specs; `embedding` re-exports them, as
upstream's does.
"""

from __future__ import annotations

from typing import Any

from pz_sparsecore.compat.lib.nn import embedding_spec
from pz_sparsecore.compat.utils import utils
from pz_sparsecore.core import optimizer_proto, spec_proto
from pz_sparsecore.core import specs as frozen_specs

__all__ = [
  "create_proto_from_feature_specs",
  "get_optimizer_class",
  "get_optimizer_type",
  "optimizer_spec_to_proto",
  "proto_to_optimizer_spec",
]

_OptimizerType = spec_proto.OptimizerSpecProto.OptimizerType


def get_optimizer_class(optimizer_type: int) -> type | None:
  """The compat optimizer spec class of an `OptimizerType` value; None for
  CUSTOM, OPTIMIZER_TYPE_UNSPECIFIED or an unknown value."""
  if optimizer_type not in _OptimizerType.values():
    return None
  frozen = optimizer_proto.spec_class(_OptimizerType.Name(optimizer_type))
  return getattr(embedding_spec, frozen.__name__) if frozen else None


def get_optimizer_type(optimizer_class: type) -> int:
  """The `OptimizerType` value of an optimizer spec class (compat or
  frozen); CUSTOM for the optimizers upstream's enum does not name."""
  frozen = getattr(frozen_specs, optimizer_class.__name__, None)
  if frozen is None or not issubclass(optimizer_class, _SPEC_CLASSES):
    return _OptimizerType.Value(optimizer_proto.CUSTOM)
  return _OptimizerType.Value(optimizer_proto.type_name(frozen))


_SPEC_CLASSES = (embedding_spec.OptimizerSpec, frozen_specs.OptimizerSpec)


def optimizer_spec_to_proto(optimizer: Any) -> Any:
  """An optimizer spec (compat or frozen) as an `OptimizerSpecProto`; None
  for None."""
  if optimizer is None:
    return None
  return spec_proto.optimizer_spec_to_proto(
    embedding_spec.optimizer_to_pz(optimizer)
  )


def proto_to_optimizer_spec(proto: Any | None) -> embedding_spec.OptimizerSpec:
  """The compat optimizer spec of an `OptimizerSpecProto` (SGD with learning
  rate 0 for None; SGD with the learning rate for CUSTOM, as upstream)."""
  return embedding_spec.optimizer_from_pz(
    spec_proto.proto_to_optimizer_spec(proto)
  )


def create_proto_from_feature_specs(
  feature_specs: Any,
  global_device_count: int | None,
  num_sparsecore_per_device: int | None = None,
) -> Any:
  """The `EmbeddingSpecProto` of prepared specs (`core.spec_proto`), with
  each table's combiner and optimizer and each stack's activation limit."""
  if num_sparsecore_per_device is None:
    num_sparsecore_per_device = utils.num_sparsecores_per_device()
  return spec_proto.create_proto_from_feature_specs(
    embedding_spec.to_pz(feature_specs),
    global_device_count,
    num_sparsecore_per_device,
  )
