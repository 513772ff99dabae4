"""Lookup and fused update of row-sharded stacks over a device mesh.

Every stack is one physical array `[N, V_shard, D]` (N = G devices x S
SparseCores) sharded over one mesh axis, the *sharding axis*: device `d`
holds shards (partitions) `d*S .. d*S+S-1`. Each device also holds its own
slice of the batch, preprocessed into S segments of CSR-wrapped COO buffers
whose partitions `p` are in order, so the entries for the S partitions owned
by device `q` are contiguous in every segment.

How ids and values cross devices is the stack's *exchange*
(`pz_sparsecore.exchange` prices both and picks one per stack;
`Topology.exchange` can force either). The *row exchange* sends the distinct
rows each device asks for (`pz_sparsecore.row_exchange`); the *activation
exchange*, described here, sends partial activations:

Forward, per device, under `shard_map`:

1. *Route.* In each of its S segments the device cuts, for every owner `q`,
   the window that starts at the (8-aligned) start of partition `q*S` and is
   `W = S * r8(max_ids_per_partition)` entries long, the most those S
   partitions can hold. The windows and their S row pointers (rebased to the
   window start) go to their owners in one `all_to_all` per buffer.
2. *Look up.* The owner runs the FFI kernel over the `G*S` received windows
   against its own S shards, producing partial activations for every source
   device's samples: `[G, S*B_sc, D]`.
3. *Return.* A second `all_to_all` sends each source its partials; the
   source sums the G contributions into its `[S*B_sc, D]` activations and
   slices out each feature (its `n_f` samples at offset `row_offset / N` of
   every SparseCore block, its first `dim_f` columns).

Backward (the fused update), per device: the activation gradients of every
device are gathered (`all_gather`, `[G*S*B_sc, D]`, the same order as the
received windows; every owner needs every source's gradients, so an
`all_to_all` would move the same bytes), the windows are routed again, and
the FFI backward sums every referenced row's gradient over all windows and
applies the optimizer once to the row and its slots, in place. The full
table never leaves its devices; a step moves O(ids + batch x dim x G)
values, which is why the row exchange exists.

With one device all of this collapses to one local kernel call.

Example: G = 2, S = 1, max_ids = 8 (W = 8). Device 0's segment holds
partition 0 in `[0, 3)` and partition 1 in `[8, 10)`: its window for device
0 is entries `[0, 8)` with row pointer `[3]`, for device 1 entries `[8, 16)`
with row pointer `[2]`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pz_sparsecore import buffer_format, kernels, minibatching, row_exchange
from pz_sparsecore import exchange as exchange_lib
from pz_sparsecore.kernels import contract, reference
from pz_sparsecore.plan import Plan, StackPlan
from pz_sparsecore.preprocess import PreprocessedInput


class TableGradientError(ValueError):
  """A dense gradient was requested for a SparseCore table."""


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
    exchange: How lookups cross devices (`pz_sparsecore.exchange`):
      `"auto"` (per stack, the mode with fewer predicted bytes),
      `"activations"` or `"rows"`.
  """

  mesh: Mesh | AbstractMesh
  axis: str | tuple[str, ...]
  num_sc_per_device: int
  exchange: str = exchange_lib.AUTO

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
    return exchange_lib.choose(
      self.exchange,
      num_devices=self.num_devices,
      num_sc_per_device=self.num_sc_per_device,
      samples_per_sc=stack.samples_per_sc,
      dim=stack.dim,
      max_ids_per_partition=spec.max_ids_per_partition,
      max_unique_ids_per_partition=spec.max_unique_ids_per_partition,
    )

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


# ---------------------------------------------------------------------------
# Per-device pieces (run inside shard_map).


def _route(stack: StackPlan, topo: Topology, rp, ids, sids, gains):
  """Sends every owner its windows; returns the received `G*S` windows."""
  g, s = topo.num_devices, topo.num_sc_per_device
  n, w, c = topo.num_shards, stack.window, stack.coo_per_sc
  ends = rp.reshape(s, stack.row_pointers_per_sc)[:, :n]
  window_start = buffer_format.partition_starts(ends, jnp)[:, ::s]  # [S, G]
  pointers = ends.reshape(s, g, s) - window_start[:, :, None]
  index = (
    jnp.arange(s, dtype=jnp.int32)[:, None, None] * (c + w)
    + window_start[:, :, None]
    + jnp.arange(w, dtype=jnp.int32)
  )

  def windows(buf, fill):
    padded = jnp.concatenate(
      [buf.reshape(s, c), jnp.full((s, w), fill, buf.dtype)], axis=1
    )
    return jnp.take(padded.reshape(-1), index).swapaxes(0, 1)  # [G, S, W]

  send = (
    pointers.swapaxes(0, 1),
    windows(ids, buffer_format.PAD_ID),
    windows(sids, buffer_format.PAD_ID),
    windows(gains, buffer_format.PAD_GAIN),
  )
  return tuple(
    jax.lax.all_to_all(x, topo.axis, 0, 0, tiled=True).reshape(-1) for x in send
  )


def _kernel_shape(stack: StackPlan, topo: Topology) -> dict[str, int]:
  g, s = topo.num_devices, topo.num_sc_per_device
  return dict(
    num_segments=s if g == 1 else g * s,
    samples_per_segment=stack.samples_per_sc,
    num_partitions=topo.num_shards if g == 1 else s,
    rows_per_partition=stack.rows_per_shard,
  )


def _local_buffers(stack: StackPlan, inputs: PreprocessedInput):
  """The stack's buffers of the local batch."""
  return (
    inputs.lhs_row_pointers[stack.name],
    inputs.lhs_embedding_ids[stack.name],
    inputs.lhs_sample_ids[stack.name],
    inputs.lhs_gains[stack.name],
  )


def _buffers(stack: StackPlan, topo: Topology, inputs: PreprocessedInput):
  """The stack's buffers as the local kernel reads them (routed if G > 1)."""
  buffers = _local_buffers(stack, inputs)
  if topo.num_devices == 1:
    return buffers
  return _route(stack, topo, *buffers)


def _local_lookup(
  stack: StackPlan, topo: Topology, table, inputs, unstack: bool = True
):
  g, s, b = topo.num_devices, topo.num_sc_per_device, stack.samples_per_sc
  mode = topo.exchange_of(stack).mode
  if mode == exchange_lib.ROWS:
    acts = row_exchange.lookup(
      stack, g, s, topo.axis, table, *_local_buffers(stack, inputs)
    )
  else:
    acts = kernels.sparse_dense_matmul(
      *_buffers(stack, topo, inputs),
      table,
      quantization=stack.quantization,
      **_kernel_shape(stack, topo),
    )
  if mode == exchange_lib.ACTIVATIONS:
    partial = acts.reshape(g, s * b, stack.dim)
    acts = jax.lax.all_to_all(partial, topo.axis, 0, 0, tiled=True).sum(0)
  if not unstack:
    return {stack.name: acts.reshape(s * b, stack.dim)}
  acts = acts.reshape(s, b, stack.dim)
  return {
    f.name: acts[
      :, f.sample_offset : f.sample_offset + f.samples_per_sc, : f.dim
    ].reshape(-1, f.dim)
    for f in stack.features
  }


def _local_update(
  stack: StackPlan,
  topo: Topology,
  table,
  slots,
  inputs,
  grads,
  hyper,
  guard,
  options: UpdateOptions,
):
  """The fused update of one stack's local shards.

  With `guard`, also returns what undoing it needs: the local rows the
  batch references (out of range for invalid entries), their values and
  their slots' values before the update, and whether every updated row and
  slot value is finite (all O(batch)). With bounds in `options`, the rows
  the batch updates are clipped to them (O(batch), in place).
  """
  stacked = _stacked_grad(stack, topo, grads, options.stacked_grads)
  stacked, buffers, shape = _owner_operands(stack, topo, inputs, stacked)
  slots = tuple(slots)
  bounds = options.bounds.get(stack.name)
  rows = None
  if guard or bounds is not None:
    rows = _referenced_rows(buffers, table, shape)
  if guard:
    old = (_rows_of(table, rows), tuple(_rows_of(x, rows) for x in slots))
    hyper = hyper + _zero_depending_on(old)
  # The [S, V_shard, D] table goes in without a reshape: a reshape around
  # the in-place update makes XLA copy the whole table.
  new_table, new_slots = kernels.sparse_dense_matmul_grad(
    stacked,
    *buffers,
    table,
    slots,
    optimizer=stack.optimizer.definition,
    hyperparameters=hyper,
    static_attributes=stack.optimizer.static_attributes(),
    **shape,
  )
  if bounds is not None:
    clipped = jnp.clip(_rows_of(new_table, rows), *bounds)
    new_table = _put_rows(new_table, rows, clipped)
  if not guard:
    return new_table, new_slots
  finite = jnp.all(
    jnp.stack(
      [
        jnp.all(jnp.isfinite(_rows_of(x, rows)))
        for x in (new_table, *new_slots)
      ]
    )
  )
  bad = jax.lax.psum(jnp.int32(~finite), topo.axis)
  return new_table, new_slots, (rows, *old, bad == 0)


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
  """How `local_update` takes its gradients and bounds its rows.

  Attributes:
    stacked_grads: The gradients are per stack (`[S * B_sc, D]`, the
      features' samples stacked as in the buffers) instead of per feature.
    bounds: Stack name -> `(min, max)` (either None for no bound): every
      row the batch updates is clipped to it after the optimizer.
  """

  stacked_grads: bool = False
  bounds: Mapping[str, tuple[Any, Any]] = dataclasses.field(
    default_factory=dict
  )


def _stacked_grad(stack: StackPlan, topo: Topology, grads, stacked: bool):
  """The `[S * B_sc, D]` gradient of the stack's local activations."""
  if stacked:
    return jnp.reshape(grads[stack.name], (-1, stack.dim))
  s = topo.num_sc_per_device
  parts = []
  for f in stack.features:
    grad = grads[f.name].reshape(s, f.samples_per_sc, f.dim)
    parts.append(jnp.pad(grad, ((0, 0), (0, 0), (0, stack.dim - f.dim))))
  return jnp.concatenate(parts, axis=1).reshape(-1, stack.dim)


def _owner_operands(stack: StackPlan, topo: Topology, inputs, grad):
  """The fused update's gradient, buffers and sizes on the owner.

  `grad` is the `[S * B_sc, D]` gradient of the local activations.
  """
  mode = topo.exchange_of(stack).mode
  if mode == exchange_lib.ROWS:
    return row_exchange.owner_operands(
      stack,
      topo.num_devices,
      topo.num_sc_per_device,
      topo.axis,
      *_local_buffers(stack, inputs),
      grad,
    )
  if mode == exchange_lib.ACTIVATIONS:
    grad = jax.lax.all_gather(grad, topo.axis, axis=0, tiled=True)
  return grad, _buffers(stack, topo, inputs), _kernel_shape(stack, topo)


def _zero_depending_on(values) -> jax.Array:
  """A float32 zero that XLA cannot compute before `values`.

  The rows read before the in-place update must be read before it
  overwrites them. A data dependency of the update's operands on the reads
  orders them (fusion does not keep an optimization barrier's order, and
  without an order XLA copies the whole table to keep the old rows alive).
  Non-finite values add 0 too.
  """
  total = sum(jnp.sum(x) for x in jax.tree.leaves(values))
  return jnp.where(jnp.abs(total) < 1.0, total, 0.0) * 0.0


def _referenced_rows(buffers, table, shape: dict[str, int]) -> jax.Array:
  """Per entry, its row of the local `[S * V_shard]` rows (or past them)."""
  buffer_shape = contract.check_buffers(
    *buffers, table, partition_begin=0, **shape
  )
  _, rows, _ = reference.decode_entries(*buffers[:3], buffer_shape)
  return rows


def _row_index(table: jax.Array, rows: jax.Array) -> Any:
  """Index of local rows in a `[S, V_shard, D]` or `[S * V_shard, D]`
  table."""
  if table.ndim == 2:
    return rows
  v = table.shape[1]
  return rows // v, rows % v


def _rows_of(table: jax.Array, rows: jax.Array) -> jax.Array:
  """`[E, D]` rows of the local table (zeros past its rows)."""
  return table.at[_row_index(table, rows)].get(mode="fill", fill_value=0.0)


def _put_rows(table: jax.Array, rows: jax.Array, values: jax.Array):
  """`table` with `values` written into `rows` (rows past it are skipped)."""
  return table.at[_row_index(table, rows)].set(values, mode="drop")


# ---------------------------------------------------------------------------
# Global entry points.


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


def local_lookup(
  plan: Plan,
  topo: Topology,
  tables: dict[str, jax.Array],
  inputs,
  *,
  unstack: bool = True,
) -> dict[str, jax.Array]:
  """Per device, inside `shard_map`: feature name -> local activations.

  `tables` hold the device's shards (`[S, V_shard, D]` or `[S * V_shard,
  D]`), `inputs` its buffers; activations are `[S * n_f, dim_f]`. Without
  `unstack`, stack name -> the stack's `[S * B_sc, D]` activations (its
  features' samples stacked as in the buffers, padded to the stack's dim).
  """
  if inputs.num_minibatches is not None:
    return _minibatched_lookup(plan, topo, tables, inputs, unstack)
  out = {}
  for stack in plan.stacks:
    out.update(_local_lookup(stack, topo, tables[stack.name], inputs, unstack))
  return out


def local_update(
  plan: Plan,
  topo: Topology,
  tables,
  slots,
  inputs,
  grads,
  hyper,
  guard=False,
  options: UpdateOptions = UpdateOptions(),
) -> dict[str, tuple[Any, ...]]:
  """Per device, inside `shard_map`: stack name -> the fused update's
  `(table, slots)`, and with `guard` what undoing it needs (`apply_gradients`
  describes the arguments; `hyper` from `hyperparameters`; `options` for
  stacked gradients and bounded rows)."""
  if inputs.num_minibatches is not None:

    def update(small, tables, slots, part):
      return local_update(
        small, topo, tables, slots, part, grads, hyper, guard, options
      )

    return _minibatched_update(plan, topo, tables, slots, inputs, update, guard)
  return {
    stack.name: _local_update(
      stack,
      topo,
      tables[stack.name],
      slots[stack.name],
      inputs,
      grads,
      hyper[stack.name],
      guard,
      options,
    )
    for stack in plan.stacks
  }


# Minibatched buffers (`minibatching`): the same per-device functions, once
# per minibatch, on the minibatch's segments in the buffer format of
# `minibatching.minibatch_plan(plan)`.


def _minibatched_lookup(plan: Plan, topo: Topology, tables, inputs, unstack):
  """The minibatches' activations, summed (a sample's ids may lie in
  several)."""
  small = minibatching.minibatch_plan(plan)

  def lookup(m):
    part = minibatching.minibatch_inputs(plan, inputs, m)
    return local_lookup(small, topo, tables, part, unstack=unstack)

  def body(m, acts):
    part = lookup(m)
    return {name: acts[name] + part[name] for name in acts}

  # There is always a minibatch 0; the rest add to it.
  count = minibatching.num_minibatches(inputs, topo.axis)
  return jax.lax.fori_loop(1, count, body, lookup(0))


def _minibatched_update(
  plan: Plan, topo: Topology, tables, slots, inputs, one, guard
):
  """The fused update, minibatch after minibatch: a row lies in one
  minibatch, so it is updated once, with all its gradient. `one(small_plan,
  tables, slots, minibatch_inputs)` is `local_update` of one minibatch.
  With `guard`, minibatch `m`'s guard fills row `m` of `[64, ...]` arrays
  (rows past the table where no minibatch ran), flattened at the end."""
  small = minibatching.minibatch_plan(plan)

  def update(m, tables, slots):
    part = minibatching.minibatch_inputs(plan, inputs, m)
    out = one(small, tables, slots, part)
    return (
      {k: v[0] for k, v in out.items()},
      {k: tuple(v[1]) for k, v in out.items()},
      {k: v[2] for k, v in out.items()} if guard else {},
    )

  def body(m, state):
    tables, slots, guards = state
    tables, slots, part = update(m, tables, slots)
    return tables, slots, _put_guard(guards, part, m)

  count = minibatching.num_minibatches(inputs, topo.axis)
  first = update(0, dict(tables), {k: tuple(v) for k, v in slots.items()})
  state = (first[0], first[1], _guard_slots(first[0], first[2]))
  tables, slots, guards = jax.lax.fori_loop(1, count, body, state)
  return {
    name: (tables[name], slots[name], *_flat_guard(guards, name))
    for name in tables
  }


def _guard_slots(tables, first):
  """`[64, ...]` guard arrays holding the first minibatch's guard: rows
  past the local table (undo skips them) and zeros elsewhere, `finite`
  kept as a scalar."""
  out = {}
  for name, (rows, table_rows, slot_rows, finite) in first.items():
    past = tables[name].shape[0] * tables[name].shape[1]
    stacked = (
      jnp.full((minibatching.NUM_BUCKETS, *rows.shape), past, rows.dtype),
      *(
        jnp.zeros((minibatching.NUM_BUCKETS, *x.shape), x.dtype)
        for x in (table_rows, *slot_rows)
      ),
    )
    out[name] = (stacked, finite)
  return _put_guard(out, first, 0)


def _put_guard(guards, part, m):
  """`guards` with minibatch `m`'s guard `part` written in."""
  out = {}
  for name, (stacked, finite) in guards.items():
    rows, table_rows, slot_rows, ok = part[name]
    values = (rows, table_rows, *slot_rows)
    stacked = tuple(
      jax.lax.dynamic_update_index_in_dim(x, v, m, 0)
      for x, v in zip(stacked, values, strict=True)
    )
    out[name] = (stacked, finite & ok)
  return out


def _flat_guard(guards, name) -> tuple[Any, ...]:
  """The stack's guard in `_local_update`'s form, minibatches flattened
  (empty without a guard)."""
  if name not in guards:
    return ()
  stacked, finite = guards[name]
  rows, table_rows, *slot_rows = (x.reshape(-1, *x.shape[2:]) for x in stacked)
  return ((rows, table_rows, tuple(slot_rows), finite),)


def _input_specs(topo: Topology, inputs: PreprocessedInput):
  return jax.tree.map(lambda _: P(topo.axis), inputs)


# Jitted so that an eager call (outside any jit) compiles once and is cached
# instead of running the shard_map body op by op (tens of seconds).
@functools.partial(jax.jit, static_argnums=0)
def _lookup_impl(static, tables, inputs):
  plan, topo = static

  def body(tables, inputs):
    return local_lookup(plan, topo, tables, inputs)

  return jax.shard_map(
    body,
    mesh=topo.mesh,
    in_specs=(
      {stack.name: P(topo.axis) for stack in plan.stacks},
      _input_specs(topo, inputs),
    ),
    out_specs={name: P(topo.axis) for name in plan.features},
    check_vma=False,
  )(tables, inputs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _lookup(static, tables, inputs):
  return _lookup_impl(static, tables, inputs)


@functools.partial(_lookup.defjvp, symbolic_zeros=True)
def _lookup_jvp(static, primals, tangents):
  tables, inputs = primals
  for tangent in jax.tree.leaves(tangents[0]):
    if not isinstance(tangent, jax.custom_derivatives.SymbolicZero):
      raise TableGradientError(
        "SparseCoreEmbed tables never take a dense gradient: differentiate "
        "with respect to the activations and apply the fused update "
        "(SparseCoreTrainer, or SparseCoreEmbed.apply_gradients); do not "
        "pass table parameters to jax.grad or an optax optimizer"
      )
  out = _lookup_impl(static, tables, inputs)
  return out, jax.tree.map(jnp.zeros_like, out)


def lookup(
  plan: Plan,
  topology: Topology,
  tables: dict[str, jax.Array],
  inputs: PreprocessedInput,
) -> dict[str, jax.Array]:
  """Activations of every feature, `[samples_f, dim_f]`, sharded on batch.

  Args:
    plan: The plan of the layer's specs on the topology.
    topology: Mesh, sharding axis, SparseCores per device.
    tables: Stack name → `[N, V_shard, D]` float32, sharded over the axis.
    inputs: Flat buffers (`has_leading_dimension=False`), `[G * size]`,
      sharded over the axis.

  Returns:
    Feature name → float32 `[global samples, dim]`, in global sample order.

  Raises:
    TableGradientError: If differentiated with respect to the tables.
  """
  _check_topology(plan, topology)
  return _lookup((plan, topology), tables, inputs)


def apply_gradients(
  plan: Plan,
  topology: Topology,
  tables: dict[str, jax.Array],
  slots: dict[str, tuple[jax.Array, ...]],
  inputs: PreprocessedInput,
  activation_grads: dict[str, jax.Array],
  step: jax.Array | int,
  *,
  guard: bool = False,
) -> tuple[Any, ...]:
  """Fused backward + optimizer update of every stack, on its own shards.

  Each referenced row's gradient is summed over every sample of every
  device before the stack's optimizer runs once on the row and its slots.
  The kernels update in place: donate `tables` and `slots` (e.g.
  `jax.jit(..., donate_argnums=...)`) or XLA copies them first.

  Args:
    plan: The plan of the layer's specs on the topology.
    topology: Mesh, sharding axis, SparseCores per device.
    tables: Stack name → `[N, V_shard, D]`.
    slots: Stack name → the optimizer's slots, each shaped like the table.
    inputs: The buffers the activations were looked up with.
    activation_grads: Feature name → `[samples_f, dim_f]` gradient of the
      loss with respect to the feature's activations.
    step: The training step (0-based), for step-dependent optimizers.
    guard: Also return what `undo_unless` needs to take the update back
      (the referenced rows are read first, O(batch); the update stays in
      place).

  Returns:
    `(new_tables, new_slots)`, and with `guard` an `UpdateGuard`.
  """
  _check_topology(plan, topology)
  new_tables, new_slots, *parts = _apply_impl(
    (plan, topology),
    guard,
    tables,
    slots,
    inputs,
    activation_grads,
    hyperparameters(plan, step),
  )
  if not guard:
    return new_tables, new_slots
  fields = zip(*(parts[0][stack.name] for stack in plan.stacks), strict=True)
  names = [stack.name for stack in plan.stacks]
  return (
    new_tables,
    new_slots,
    UpdateGuard(*(dict(zip(names, field, strict=True)) for field in fields)),
  )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply_impl(static, guard, tables, slots, inputs, activation_grads, hyper):
  plan, topology = static

  def body(tables, slots, inputs, grads, hyper):
    outs = local_update(
      plan, topology, tables, slots, inputs, grads, hyper, guard
    )
    count = 3 if guard else 2
    return tuple({k: v[i] for k, v in outs.items()} for i in range(count))

  axis = P(topology.axis)
  table_specs = {stack.name: axis for stack in plan.stacks}
  slot_specs = {
    stack.name: tuple(axis for _ in slots[stack.name]) for stack in plan.stacks
  }
  out = [table_specs, slot_specs]
  if guard:
    out.append({k: (axis, axis, v, P()) for k, v in slot_specs.items()})
  return jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(
      table_specs,
      slot_specs,
      _input_specs(topology, inputs),
      {name: axis for name in activation_grads},
      {stack.name: P() for stack in plan.stacks},
    ),
    out_specs=tuple(out),
    check_vma=False,
  )(tables, slots, inputs, activation_grads, hyper)


class UpdateGuard(NamedTuple):
  """What undoing one layer's fused update needs, per stack (O(batch)).

  Attributes:
    rows: Per device and entry, the entry's local table row (past the
      local rows for entries that update nothing).
    table_rows: Those rows' values before the update.
    slot_rows: The slots' values of those rows before the update.
    finite: Whether every updated row and slot value is finite.
  """

  rows: dict[str, jax.Array]
  table_rows: dict[str, jax.Array]
  slot_rows: dict[str, tuple[jax.Array, ...]]
  finite: dict[str, jax.Array]


def undo_unless(
  plan: Plan,
  topology: Topology,
  tables: dict[str, jax.Array],
  slots: dict[str, tuple[jax.Array, ...]],
  guard: UpdateGuard,
  keep: jax.Array,
) -> tuple[dict[str, jax.Array], dict[str, tuple[jax.Array, ...]]]:
  """Unless `keep`, writes the guarded rows' old values back, in place.

  Args:
    plan: The plan of the layer's specs on the topology.
    topology: Mesh, sharding axis, SparseCores per device.
    tables: The updated tables (donate them for an in-place write).
    slots: The updated slots.
    guard: From `apply_gradients(..., guard=True)`.
    keep: Scalar bool: keep the update.

  Returns:
    `(tables, slots)`, restored where `keep` is false.
  """
  _check_topology(plan, topology)
  return _undo_impl((plan, topology), tables, slots, guard, keep)


@functools.partial(jax.jit, static_argnums=0)
def _undo_impl(static, tables, slots, guard, keep):
  plan, topology = static

  def body(tables, slots, guard, keep):
    new_tables, new_slots = {}, {}
    for stack in plan.stacks:
      name = stack.name
      rows = guard.rows[name]

      def restored(x, old, rows=rows):
        return _put_rows(x, rows, jnp.where(keep, _rows_of(x, rows), old))

      new_tables[name] = restored(tables[name], guard.table_rows[name])
      new_slots[name] = tuple(
        restored(x, old)
        for x, old in zip(slots[name], guard.slot_rows[name], strict=True)
      )
    return new_tables, new_slots

  axis = P(topology.axis)
  table_specs = {stack.name: axis for stack in plan.stacks}
  slot_specs = {k: tuple(axis for _ in v) for k, v in slots.items()}
  guard_specs = UpdateGuard(
    table_specs, table_specs, slot_specs, {k: P() for k in table_specs}
  )
  return jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(table_specs, slot_specs, guard_specs, P()),
    out_specs=(table_specs, slot_specs),
    check_vma=False,
  )(tables, slots, guard, keep)


def hyperparameters(plan: Plan, step: jax.Array | int):
  """Stack name -> its optimizer's hyper-parameters at `step`."""
  return {
    stack.name: jnp.stack(
      [
        jnp.asarray(h, jnp.float32)
        for h in stack.optimizer.get_hyperparameters(step)
      ]
    )
    for stack in plan.stacks
  }


def _check_topology(plan: Plan, topology: Topology) -> None:
  counts = (topology.num_devices, topology.num_sc_per_device)
  if (plan.num_devices, plan.num_sc_per_device) != counts:
    raise ValueError(
      f"the plan is for {plan.num_devices} devices x "
      f"{plan.num_sc_per_device} SparseCores, the topology has "
      f"{counts[0]} x {counts[1]}"
    )


def compiled_exchange_bytes(
  plan: Plan,
  topology: Topology,
  tables: dict[str, jax.Array],
  inputs: PreprocessedInput,
  calls: tuple[str, ...] = ("lookup", "update", "step"),
) -> dict[str, int]:
  """Collective bytes per device of the compiled lookup, update and step.

  Compiles (without running) a lookup, an `apply_gradients` call with SGD
  slots left empty, and a train step doing both in one jit (gradients made
  from the activations, so XLA keeps every collective), and counts their
  collectives with `exchange.compiled_bytes`. Meant for checking
  `exchange.predict_bytes` on layers whose stacks all use SGD.

  Args:
    plan: The plan of the layer's specs on the topology.
    topology: Mesh, sharding axis, SparseCores per device, exchange.
    tables: Stack name → `[N, V_shard, D]`.
    inputs: Buffers for the tables.
    calls: Which of the three to compile.

  Returns:
    `{"lookup": ..., "update": ..., "step": ...}` in bytes per device (the
    `calls` asked for).
  """
  slots = {name: () for name in tables}

  def look(tables, inputs):
    return lookup(plan, topology, tables, inputs)

  def update(tables, inputs, grads):
    return apply_gradients(plan, topology, tables, slots, inputs, grads, 0)

  def step(tables, inputs):
    acts = look(tables, inputs)
    return update(tables, inputs, {k: 2.0 * v for k, v in acts.items()})

  grads = jax.eval_shape(look, tables, inputs)
  programs = {
    "lookup": (look, (tables, inputs)),
    "update": (update, (tables, inputs, grads)),
    "step": (step, (tables, inputs)),
  }
  return {
    name: sum(
      exchange_lib.compiled_bytes(
        jax.jit(fn).lower(*args).compile().as_text()
      ).values()
    )
    for name, (fn, args) in programs.items()
    if name in calls
  }
