"""Named axes to mesh axes: where a `SparseCoreEmbed`'s arrays live.

As in Penzai's `pz.toolshed.sharding_util`, placement is a mapping from the
layer's axis names to mesh axis names: each name maps to a mesh axis, a
tuple of mesh axes, or None (replicated). The layer's names are the tables'
shard axis (`SHARD_AXIS`, "sc_shard") and its activations' axes (each
feature's sample axes, e.g. "batch" and "seq", and the embedding axis).

Names left out keep their defaults, which place the layer like a
data-parallel model: the tables' shard axis over every mesh axis (so the
tables use every device), each feature's first sample axis over the same
mesh axes less those other names were mapped to, every other axis
replicated. Names the layer does not have are
ignored, so one mapping can place a whole model; every mesh axis named must
exist. Tables and buffers are sharded over the shard axis's mesh axes in the
mesh's order; activations leave the layer with the shardings their names
map to (resharded inside the layer if they differ from the shard axis's),
so a dense part placed with `sharding_util.name_to_name_sharding` and the
same mapping consumes them as they are.

Example: a `("data", "model")` mesh of 2 x 4 devices, mapping
`{"batch": "data", "embedding": "model"}`: the tables are split into 8
shards (device `(i, j)` holds shard `4 i + j`), a feature's activations
`[batch 64, embedding 32]` leave as `P("data", "model")`: 32 samples by 8
columns on each device.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pz_sparsecore.device import topology as topology_lib
from pz_sparsecore.nn.tables import SHARD_AXIS

MeshAxes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class AxisMapping:
  """The resolved mapping of a layer's axis names (hashable, jit-static).

  Attributes:
    names: `(name, mesh axes)` pairs for the shard axis and every
      activation axis name of the layer; `()` means replicated.
  """

  names: tuple[tuple[str, MeshAxes], ...]

  def __getitem__(self, name: str) -> MeshAxes:
    return dict(self.names)[name]

  def spec(self, axes: Sequence[str]) -> P:
    """The `PartitionSpec` of an array with these named axes, in order."""
    return P(*(_entry(self[a]) for a in axes))

  def sharding(self, mesh: Mesh, axes: Sequence[str]) -> NamedSharding:
    return NamedSharding(mesh, self.spec(axes))


def _entry(mesh_axes: MeshAxes) -> str | MeshAxes | None:
  if not mesh_axes:
    return None
  return mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def shard_axes(
  mesh: Mesh,
  axis_name_to_mesh_name: Mapping[str, Any] | None,
  sharding_axis: str | Sequence[str] | None,
) -> str | MeshAxes:
  """The mesh axes of the tables' shard axis (the `Topology`'s axis).

  Raises:
    ValueError: If `sharding_axis` and the mapping's `SHARD_AXIS` disagree.
  """
  mapping = dict(axis_name_to_mesh_name or {})
  if sharding_axis is not None and SHARD_AXIS in mapping:
    given = topology_lib.mesh_axes(mesh, sharding_axis, "sharding_axis")
    mapped = topology_lib.mesh_axes(mesh, mapping[SHARD_AXIS], SHARD_AXIS)
    if given != mapped:
      raise ValueError(
        f"sharding_axis {sharding_axis!r} and axis_name_to_mesh_name"
        f"[{SHARD_AXIS!r}] = {mapping[SHARD_AXIS]!r} disagree; give one"
      )
  if SHARD_AXIS in mapping:
    return mapping[SHARD_AXIS]
  if sharding_axis is not None:
    return sharding_axis
  return tuple(mesh.axis_names)


def resolve(
  topology: topology_lib.Topology,
  axis_name_to_mesh_name: Mapping[str, Any] | None,
  features: Sequence[tuple[str, tuple[str, ...], tuple[int, ...]]],
  embedding_axis: str,
) -> AxisMapping:
  """Resolves the user's mapping against the layer's axes and the mesh.

  Args:
    topology: The layer's topology (its axis: the shard axis's mesh axes).
    axis_name_to_mesh_name: The user's mapping, or None for the defaults.
    features: Per feature, `(name, sample axes, output shape)`.
    embedding_axis: The layer's embedding axis name.

  Returns:
    The mapping of `SHARD_AXIS` and of every activation axis name.

  Raises:
    ValueError: If a mapping names a mesh axis the mesh lacks, one array
      would use a mesh axis twice, or an activation axis does not divide
      over its mesh axes; each message names the axis and the feature.
  """
  mesh = topology.mesh
  given = dict(axis_name_to_mesh_name or {})
  resolved = {
    name: topology_lib.mesh_axes(mesh, value, f"axis name {name!r}")
    for name, value in given.items()
  }
  resolved[SHARD_AXIS] = topology.axes
  # The batch takes the shard axis's mesh axes that no named axis took.
  taken = {m for k, v in resolved.items() if k != SHARD_AXIS for m in v}
  batch = tuple(a for a in topology.axes if a not in taken)
  for _, axes, _ in features:
    resolved.setdefault(axes[0], batch)
    for name in (*axes[1:], embedding_axis):
      resolved.setdefault(name, ())
  # The shard axis, then the activation axes as the features name them.
  order = dict.fromkeys(
    [SHARD_AXIS, *(a for _, axes, _ in features for a in axes), embedding_axis]
  )
  mapping = AxisMapping(tuple((k, resolved[k]) for k in order))
  for name, axes, shape in features:
    _check_array(mesh, mapping, name, (*axes, embedding_axis), shape)
  return mapping


def _check_array(
  mesh: Mesh,
  mapping: AxisMapping,
  feature: str,
  axes: tuple[str, ...],
  shape: tuple[int, ...],
) -> None:
  seen: dict[str, str] = {}
  for axis, size in zip(axes, shape, strict=True):
    mesh_axes = mapping[axis]
    for m in mesh_axes:
      if m in seen:
        raise ValueError(
          f"feature {feature!r}: axes {seen[m]!r} and {axis!r} both map to "
          f"mesh axis {m!r}; an array can use a mesh axis once"
        )
      seen[m] = axis
    ways = math.prod(int(mesh.shape[m]) for m in mesh_axes)
    if size % ways:
      raise ValueError(
        f"feature {feature!r}: axis {axis!r} of size {size} does not "
        f"divide over mesh axes {mesh_axes} ({ways} ways)"
      )
