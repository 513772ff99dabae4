"""Where tables live: a mesh, the axis they are sharded over, SparseCores.

Every stack is one physical array `[N, V_shard, D]` (N = G devices x S
SparseCores) sharded over one mesh axis, the *sharding axis* (or several
mesh axes together): device `d` holds shards (partitions) `d*S .. d*S+S-1`
and its own slice of the batch. `Topology` names the mesh, that axis and
S, and picks each stack's exchange (`exchange.choose`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import buffer_format
from pz_sparsecore.core.plan import Plan, StackPlan
from pz_sparsecore.device import exchange as exchange_lib


@dataclasses.dataclass(frozen=True)
class Topology:
  """A mesh, the mesh axes tables are sharded over, SparseCores per device.

  Attributes:
    mesh: The device mesh (Auto axes); inside a caller's `shard_map`, its
      abstract mesh (`shard_map_topology`), for the per-device functions.
    axis: The mesh axis, or axes, the tables' shard axis and the batches
      are sharded over: a name, or a tuple of names (put in the mesh's
      order; one name is kept as a plain string, as `PartitionSpec` and
      the collectives take it). Shards go to devices in the mesh's order
      over these axes; other mesh axes hold replicas.
    num_sc_per_device: S, (virtual) SparseCores per device.
    exchange: How lookups cross devices (`pz_sparsecore.device.exchange`):
      `"auto"` (per stack, the mode with fewer predicted bytes),
      `"activations"` or `"rows"`.
    replicated: Names of the stacks every device holds whole (the
      `replicated` placement: `[N, V_shard, D]` replicated over the shard
      axis, looked up locally); the others are sharded over it.
  """

  mesh: Mesh | AbstractMesh
  axis: str | tuple[str, ...]
  num_sc_per_device: int
  exchange: str = exchange_lib.AUTO
  replicated: frozenset[str] = frozenset()

  def __post_init__(self):
    exchange_lib.check_mode(self.exchange)
    if isinstance(self.mesh, Mesh):
      check_mesh(self.mesh)
    axes = mesh_axes(self.mesh, self.axis, "the tables' shard axis")
    if not axes:
      raise ValueError(
        "the tables' shard axis must map to at least one mesh axis, got ()"
      )
    object.__setattr__(self, "axis", axes[0] if len(axes) == 1 else axes)
    buffer_format.num_shards(self.num_devices, self.num_sc_per_device)

  @property
  def axes(self) -> tuple[str, ...]:
    """The mesh axes of the shard axis, in the mesh's order."""
    return (self.axis,) if isinstance(self.axis, str) else self.axis

  @property
  def num_devices(self) -> int:
    """G: devices over the shard axis's mesh axes."""
    return math.prod(int(self.mesh.shape[a]) for a in self.axes)

  @property
  def num_shards(self) -> int:
    """N = G x S."""
    return self.num_devices * self.num_sc_per_device

  def exchange_of(self, stack: StackPlan) -> exchange_lib.Exchange:
    """The exchange `stack` uses on this topology, and why."""
    spec = stack.spec
    chosen = exchange_lib.choose(
      self.exchange,
      num_devices=self.num_devices,
      num_sc_per_device=self.num_sc_per_device,
      samples_per_sc=stack.samples_per_sc,
      dim=stack.dim,
      max_ids_per_partition=spec.max_ids_per_partition,
      max_unique_ids_per_partition=spec.max_unique_ids_per_partition,
    )
    if not self.is_replicated(stack.name):
      return chosen
    by_mode = dict(chosen.by_mode)
    by_mode[exchange_lib.REPLICATED] = exchange_lib.predict_bytes(
      exchange_lib.REPLICATED,
      **exchange_lib.stack_sizes(
        stack, self.num_devices, self.num_sc_per_device
      ),
    )
    return exchange_lib.Exchange(
      exchange_lib.REPLICATED, exchange_lib.REPLICATED, by_mode
    )

  def is_replicated(self, stack_name: str) -> bool:
    """Whether every device holds `stack_name` whole (one device holds
    everything whole: it counts as sharded)."""
    return stack_name in self.replicated and self.num_devices > 1

  def table_spec(self, stack_name: str) -> P:
    """The `PartitionSpec` of a stack's leading axis (its tables and
    slots), for `shard_map`."""
    return P() if self.is_replicated(stack_name) else P(self.axis)

  def table_sharding(self, stack_name: str, ndim: int = 3) -> NamedSharding:
    """Where a stack's table and slots live: over the shard axis, or on
    every device for a replicated stack."""
    if self.is_replicated(stack_name):
      return NamedSharding(self.mesh, P(*([None] * ndim)))
    return self.sharding(ndim)

  def sharding(self, ndim: int) -> NamedSharding:
    """Leading axis over the shard axis's mesh axes, the rest replicated."""
    return NamedSharding(self.mesh, P(self.axis, *([None] * (ndim - 1))))


def check_mesh(mesh: Mesh) -> None:
  """Raises unless every axis of `mesh` is an Auto axis.

  Raises:
    ValueError: Naming the axes and how to build a mesh the layer can use.
  """
  types = getattr(mesh, "axis_types", None) or ()
  other = [
    f"{name!r} ({kind.name})"
    for name, kind in zip(mesh.axis_names, types, strict=True)
    if kind != AxisType.Auto
  ]
  if other:
    raise ValueError(
      f"mesh axes {', '.join(other)} are not Auto axes: the layer shards "
      "with shard_map and named shardings over Auto axes. Build the mesh "
      "with jax.sharding.Mesh(devices, names), or jax.make_mesh(shape, "
      "names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))"
    )


def mesh_axes(mesh: Mesh, value: Any, what: str) -> tuple[str, ...]:
  """`value` (None, a mesh axis name or a tuple of them) as a tuple of
  mesh axes in the mesh's order.

  Args:
    mesh: The mesh.
    value: What the user mapped a name to.
    what: What is mapped, for messages (e.g. "feature 'f' axis 'batch'").

  Raises:
    ValueError: If a name is not an axis of the mesh, or repeated.
  """
  if value is None:
    return ()
  names = (value,) if isinstance(value, str) else tuple(value)
  for name in names:
    if name not in mesh.axis_names:
      raise ValueError(
        f"{what} maps to mesh axis {name!r}, which the mesh "
        f"{tuple(mesh.axis_names)} lacks"
      )
  if len(set(names)) != len(names):
    raise ValueError(f"{what} maps to mesh axes {names} with a repeat")
  return tuple(sorted(names, key=list(mesh.axis_names).index))


def shard_map_topology(num_sc_per_device: int) -> Topology:
  """The topology of the `shard_map` the caller runs in.

  Its manual mesh axes are the tables' shard axis (upstream's per-device
  functions run inside the user's `shard_map`).

  Raises:
    ValueError: Outside `shard_map`.
  """
  mesh = jax.sharding.get_abstract_mesh()
  manual = tuple(getattr(mesh, "manual_axes", ()))
  if not manual:
    raise ValueError(
      "this function runs per device: call it inside jax.shard_map over the "
      "mesh axis the tables and batches are sharded over"
    )
  return Topology(mesh, manual, num_sc_per_device)


def check_plan(plan: Plan, topology: Topology) -> None:
  """Raises unless `plan` was built for `topology`'s device and SparseCore
  counts.

  Raises:
    ValueError: Naming both counts.
  """
  counts = (topology.num_devices, topology.num_sc_per_device)
  if (plan.num_devices, plan.num_sc_per_device) != counts:
    raise ValueError(
      f"the plan is for {plan.num_devices} devices x "
      f"{plan.num_sc_per_device} SparseCores, the topology has "
      f"{counts[0]} x {counts[1]}"
    )
