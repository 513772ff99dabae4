"""Upstream's `embedding_spec_pb2`: the embedding spec message classes.

The classes are those of `pz_sparsecore.core.spec_proto`, which builds them from
upstream's schema; bytes and text format are interchangeable with upstream's.
"""

from pz_sparsecore.core.spec_proto import (
  DESCRIPTOR,
  EmbeddingSpecProto,
  FeatureSpecProto,
  OptimizerSpecProto,
  StackedTableSpecProto,
  TableSpecProto,
)

__all__ = [
  "DESCRIPTOR",
  "EmbeddingSpecProto",
  "FeatureSpecProto",
  "OptimizerSpecProto",
  "StackedTableSpecProto",
  "TableSpecProto",
]
