"""Lookup and fused update of row-sharded stacks over a device mesh.

Every stack is one physical array `[N, V_shard, D]` (N = G devices x S
SparseCores) sharded over the topology's sharding axis (`topology`): device
`d` holds shards (partitions) `d*S .. d*S+S-1`. Each device also holds its
own slice of the batch, preprocessed into S segments of CSR-wrapped COO
buffers whose partitions `p` are in order, so the entries for the S
partitions owned by device `q` are contiguous in every segment.

Per device, under `shard_map`, every stack goes through its *exchange*
(`exchange`: `local` on one device, else `activations` or `rows`, priced
and picked per stack by `Topology.exchange_of`): the mode's `lookup` gives
the stack's `[S*B_sc, D]` activations, sliced here into each feature's (its
`n_f` samples at offset `row_offset / N` of every SparseCore block, its
first `dim_f` columns). `lookup` and `apply_gradients` move a stack's
features as *groups* (`feature_groups`: runs of features adjacent in the
buffers with the same samples and width) of one `[samples, k, dim_f]` array
each, split into features (and their gradients stacked back) outside
`shard_map`: XLA then compiles one slice per group instead of one per
feature, and a model that stacks the features along axis 1 again (a DLRM's
interaction) gets the group array back without a copy. For the fused
update the mode's `owner_operands` bring the gradient and buffers to the
owner, whose FFI backward sums every referenced row's gradient over all of
them and applies the optimizer once to the row and its slots, in place.
The full table never leaves its devices. A few ids of one table (a
decoding step's) may skip the buffers and the exchange: `gather_lookup`
sends the ids to every device and sums each owner's rows with one `psum`.
Minibatched buffers run the same
per-device functions once per minibatch (`minibatching`); `guard` reads
what undoing an update needs.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from pz_sparsecore.core import layout
from pz_sparsecore.core.plan import (
  FeaturePlan,
  Plan,
  StackPlan,
  single_minibatch,
)
from pz_sparsecore.core.preprocessed import PreprocessedInput
from pz_sparsecore.device import exchange as exchange_lib
from pz_sparsecore.device import guard as guard_lib
from pz_sparsecore.device import kernels, minibatching
from pz_sparsecore.device.exchange import local
from pz_sparsecore.device.topology import Topology, check_plan


class TableGradientError(ValueError):
  """A dense gradient was requested for a SparseCore table."""


# ---------------------------------------------------------------------------
# Per-device pieces (run inside shard_map).


def _local_buffers(stack: StackPlan, inputs: PreprocessedInput):
  """The stack's buffers of the local batch."""
  return (
    inputs.lhs_row_pointers[stack.name],
    inputs.lhs_embedding_ids[stack.name],
    inputs.lhs_sample_ids[stack.name],
    inputs.lhs_gains[stack.name],
  )


def feature_groups(stack: StackPlan) -> tuple[tuple[FeaturePlan, ...], ...]:
  """The stack's features in runs that share one `[samples, k, dim]` array:
  adjacent in the buffers (each one's samples right after the previous
  one's), with the same samples per SparseCore and the same width.

  Example: features a, b (2,048 samples, width 16) then c (2,048, width 8)
  make the groups `(a, b)` and `(c,)`.
  """
  groups: list[list[FeaturePlan]] = []
  for f in stack.features:
    last = groups[-1][-1] if groups else None
    if (
      last is not None
      and f.samples_per_sc == last.samples_per_sc
      and f.dim == last.dim
      and f.sample_offset == last.sample_offset + last.samples_per_sc
    ):
      groups[-1].append(f)
    else:
      groups.append([f])
  return tuple(tuple(g) for g in groups)


def _groups(plan: Plan):
  """`((stack name, index), features)` of every group of the plan."""
  for stack in plan.stacks:
    for i, group in enumerate(feature_groups(stack)):
      yield (stack.name, i), group


def _local_lookup(
  stack: StackPlan,
  topo: Topology,
  table,
  inputs,
  unstack: bool = True,
  grouped: bool = False,
):
  s, b = topo.num_sc_per_device, stack.samples_per_sc
  mode = topo.exchange_of(stack).module
  buffers = _local_buffers(stack, inputs)
  if inputs.sample_order is not None and mode is local:
    # One device: the forward reads the preprocessor's sample order.
    acts = local.lookup(
      stack, topo, table, buffers, sample_order=inputs.sample_order[stack.name]
    )
  else:
    acts = mode.lookup(stack, topo, table, buffers)
  if not unstack:
    return {stack.name: acts.reshape(s * b, stack.dim)}
  acts = acts.reshape(s, b, stack.dim)
  if grouped:
    out = {}
    for i, group in enumerate(feature_groups(stack)):
      f, k, n = group[0], len(group), group[0].samples_per_sc
      x = acts[:, f.sample_offset : f.sample_offset + k * n, : f.dim]
      x = x.reshape(s, k, n, f.dim).transpose(0, 2, 1, 3)
      out[stack.name, i] = x.reshape(s * n, k, f.dim)
    return out
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
  stacked = _stacked_grad(stack, topo, grads, options)
  stacked, buffers, shape = _owner_operands(stack, topo, inputs, stacked)
  slots = tuple(slots)
  seed = None
  if stack.dtype != jnp.float32:  # `hyperparameters` put the seed last.
    hyper, seed = hyper[:-1], hyper[-1].astype(jnp.int32)
  bounds = options.bounds.get(stack.name)
  rows = None
  if guard or bounds is not None:
    rows = guard_lib.referenced_rows(buffers, table, shape)
  if guard:
    old = (
      guard_lib.rows_of(table, rows),
      tuple(guard_lib.rows_of(x, rows) for x in slots),
    )
    hyper = hyper + guard_lib.zero_depending_on(old)
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
    rounding_seed=seed,
    **shape,
  )
  if bounds is not None:
    clipped = jnp.clip(guard_lib.rows_of(new_table, rows), *bounds)
    new_table = guard_lib.put_rows(new_table, rows, clipped)
  if not guard:
    return new_table, new_slots
  finite = jnp.all(
    jnp.stack(
      [
        jnp.all(jnp.isfinite(guard_lib.rows_of(x, rows)))
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
    grouped_grads: The gradients are per group of features (`(stack name,
      index)` -> `[S * n, k, dim]`, `feature_groups`) instead of per
      feature.
    bounds: Stack name -> `(min, max)` (either None for no bound): every
      row the batch updates is clipped to it after the optimizer.
  """

  stacked_grads: bool = False
  grouped_grads: bool = False
  bounds: Mapping[str, tuple[Any, Any]] = dataclasses.field(
    default_factory=dict
  )


def _stacked_grad(
  stack: StackPlan, topo: Topology, grads, options: UpdateOptions
):
  """The `[S * B_sc, D]` gradient of the stack's local activations."""
  if options.stacked_grads:
    return jnp.reshape(grads[stack.name], (-1, stack.dim))
  s = topo.num_sc_per_device
  if options.grouped_grads:
    pieces = []
    for i, group in enumerate(feature_groups(stack)):
      f, k, n = group[0], len(group), group[0].samples_per_sc
      grad = grads[stack.name, i].reshape(s, n, k, f.dim)
      pieces.append(grad.transpose(0, 2, 1, 3).reshape(s, k * n, f.dim))
  else:
    pieces = [
      grads[f.name].reshape(s, f.samples_per_sc, f.dim) for f in stack.features
    ]
  parts = [
    jnp.pad(x, ((0, 0), (0, 0), (0, stack.dim - x.shape[-1]))) for x in pieces
  ]
  return jnp.concatenate(parts, axis=1).reshape(-1, stack.dim)


def _owner_operands(stack: StackPlan, topo: Topology, inputs, grad):
  """The fused update's gradient, buffers and sizes on the owner.

  `grad` is the `[S * B_sc, D]` gradient of the local activations.
  """
  mode = topo.exchange_of(stack).module
  return mode.owner_operands(stack, topo, _local_buffers(stack, inputs), grad)


# ---------------------------------------------------------------------------
# Global entry points.


def local_lookup(
  plan: Plan,
  topo: Topology,
  tables: dict[str, jax.Array],
  inputs,
  *,
  unstack: bool = True,
  grouped: bool = False,
) -> dict[Any, jax.Array]:
  """Per device, inside `shard_map`: feature name -> local activations.

  `tables` hold the device's shards (`[S, V_shard, D]` or `[S * V_shard,
  D]`), `inputs` its buffers; activations are `[S * n_f, dim_f]`. Without
  `unstack`, stack name -> the stack's `[S * B_sc, D]` activations (its
  features' samples stacked as in the buffers, padded to the stack's dim).
  With `grouped`, `(stack name, index)` -> the group's `[S * n, k, dim]`
  activations (`feature_groups`).
  """
  if inputs.num_minibatches is not None:
    return _minibatched_lookup(plan, topo, tables, inputs, unstack, grouped)
  out = {}
  for stack in plan.stacks:
    out.update(
      _local_lookup(stack, topo, tables[stack.name], inputs, unstack, grouped)
    )
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
# `plan.single_minibatch(plan)`.


def _minibatched_lookup(
  plan: Plan, topo: Topology, tables, inputs, unstack, grouped
):
  """The minibatches' activations, summed (a sample's ids may lie in
  several)."""
  small = single_minibatch(plan)

  def lookup(m):
    part = minibatching.minibatch_inputs(plan, inputs, m)
    return local_lookup(
      small, topo, tables, part, unstack=unstack, grouped=grouped
    )

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
  With `guard`, the minibatches' guards are stacked (`guard.stacked_guards`)
  and flattened at the end."""
  small = single_minibatch(plan)

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
    return tables, slots, guard_lib.put_guard(guards, part, m)

  count = minibatching.num_minibatches(inputs, topo.axis)
  first = update(0, dict(tables), {k: tuple(v) for k, v in slots.items()})
  state = (first[0], first[1], guard_lib.stacked_guards(first[0], first[2]))
  tables, slots, guards = jax.lax.fori_loop(1, count, body, state)
  return {
    name: (tables[name], slots[name], *guard_lib.flat_guard(guards, name))
    for name in tables
  }


def _input_specs(topo: Topology, inputs: PreprocessedInput):
  return jax.tree.map(lambda _: P(topo.axis), inputs)


# Jitted so that an eager call (outside any jit) compiles once and is cached
# instead of running the shard_map body op by op (tens of seconds).
@functools.partial(jax.jit, static_argnums=0)
def _lookup_impl(static, tables, inputs):
  plan, topo = static

  def body(tables, inputs):
    return local_lookup(plan, topo, tables, inputs, grouped=True)

  groups = jax.shard_map(
    body,
    mesh=topo.mesh,
    in_specs=(
      {stack.name: topo.table_spec(stack.name) for stack in plan.stacks},
      _input_specs(topo, inputs),
    ),
    out_specs={key: P(topo.axis) for key, _ in _groups(plan)},
    check_vma=False,
  )(tables, inputs)
  out = {}
  for key, features in _groups(plan):
    for j, f in enumerate(features):
      out[f.name] = groups[key][:, j]
  return {name: out[name] for name in plan.features}


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _lookup(static, tables, inputs):
  return _lookup_impl(static, tables, inputs)


def _refuse_table_tangents(tangents: Any) -> None:
  """Raises `TableGradientError` if a table is differentiated."""
  for tangent in jax.tree.leaves(tangents):
    if not isinstance(tangent, jax.custom_derivatives.SymbolicZero):
      raise TableGradientError(
        "SparseCoreEmbed and SparseCoreLookup tables never take a dense "
        "gradient: differentiate with respect to the activations and apply "
        "the fused update. Train with pzsc.SparseCoreTrainer.build(root_rng,"
        " model, optimizer_def, loss_fn) (Penzai's StatefulTrainer.build "
        "arguments), or in a hand-written step split the model with "
        "`rest, dense = pzsc.split_tables(model)` and take "
        "`pzsc.value_and_grad(loss_fn, step=step)(rest, dense, ...)`, which "
        "differentiates the dense parameters and updates the tables in "
        "place; do not pass table parameters to jax.grad or an optax "
        "optimizer"
      )


@functools.partial(_lookup.defjvp, symbolic_zeros=True)
def _lookup_jvp(static, primals, tangents):
  tables, inputs = primals
  _refuse_table_tangents(tangents[0])
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
  check_plan(plan, topology)
  return _lookup((plan, topology), tables, inputs)


@functools.partial(jax.jit, static_argnums=0)
def _gather_impl(static, table, ids):
  plan, topo, vocab_size = static
  stack = plan.stacks[0]
  setting = stack.tables[0].setting_in_stack
  n, v = topo.num_shards, stack.rows_per_shard
  replicated = topo.is_replicated(stack.name)
  held = (n if replicated else topo.num_sc_per_device) * v

  def body(table, ids):
    rows = layout.compute_physical_row_ids(
      n, n * v, setting.shard_rotation, setting.row_offset_in_shard, ids
    )
    if not replicated:
      rows = rows - jax.lax.axis_index(topo.axis) * held
    mine = (ids >= 0) & (ids < vocab_size) & (rows >= 0) & (rows < held)
    out = table.reshape(held, stack.dim)[jnp.where(mine, rows, 0)]
    out = jnp.where(mine[:, None], out.astype(jnp.float32), 0.0)
    return out if replicated else jax.lax.psum(out, topo.axis)

  return jax.shard_map(
    body,
    mesh=topo.mesh,
    in_specs=(topo.table_spec(stack.name), P()),
    out_specs=P(),
    check_vma=False,
  )(table, ids)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _gather(static, table, ids):
  return _gather_impl(static, table, ids)


@functools.partial(_gather.defjvp, symbolic_zeros=True)
def _gather_jvp(static, primals, tangents):
  _refuse_table_tangents(tangents[0])
  out = _gather_impl(static, *primals)
  return out, jnp.zeros_like(out)


def gather_lookup(
  plan: Plan,
  topology: Topology,
  table: jax.Array,
  ids: jax.Array,
  vocab_size: int,
) -> jax.Array:
  """Rows of one table for a few ids, without the exchange.

  The ids go to every device (they are few); each device reads, from its
  own shards, the rows of the ids it holds (`layout.compute_physical_row_ids`)
  and zeros for the others, and one `psum` over the shard axis sums them:
  every row comes from its one owner, plus zeros, so the activations equal
  the exchange's (`lookup` with one id of gain 1 per sample). It moves the
  ids and `G x len(ids) x D` floats (the all-reduce), not a row of the
  table, and builds no buffers: for a decoding step's handful of ids it
  skips the exchange's sort, windows and `all_to_all`s; per device it costs
  O(all the ids), so large batches take `lookup`. Example: 8 shards of 4
  rows (rotation 0, offset 0), ids `[9, 2]`: id 9 is row 1 of shard 1 and
  id 2 row 0 of shard 2; each device reads the rows it holds for both
  ids, zeros for the others, and the psum returns `[row 9, row 2]`.

  Args:
    plan: A plan of one stack holding one table.
    topology: Mesh, sharding axis, SparseCores per device.
    table: The stack's `[N, V_shard, D]` array, laid out as `topology`
      places it (sharded, or replicated).
    ids: Integer ids, `[samples]`; ids outside `[0, vocab_size)` read
      zeros.
    vocab_size: The table's rows.

  Returns:
    float32 `[samples, D]`, replicated over the mesh.

  Raises:
    TableGradientError: If differentiated with respect to the table.
  """
  check_plan(plan, topology)
  if len(plan.stacks) != 1 or len(plan.stacks[0].tables) != 1:
    raise ValueError(
      "gather_lookup reads one table; the plan has stacks "
      f"{[[t.name for t in s.tables] for s in plan.stacks]}"
    )
  return _gather((plan, topology, vocab_size), table, ids.astype(jnp.int32))


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
  check_plan(plan, topology)
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
    guard_lib.UpdateGuard(
      *(dict(zip(names, field, strict=True)) for field in fields)
    ),
  )


@functools.partial(jax.jit, static_argnums=(0, 1))
def _apply_impl(static, guard, tables, slots, inputs, activation_grads, hyper):
  plan, topology = static
  # One array per group: a model that took the features apart from a stack
  # along axis 1 gets them back without copies.
  grads = {
    key: jnp.stack([activation_grads[f.name] for f in features], axis=1)
    for key, features in _groups(plan)
  }
  options = UpdateOptions(grouped_grads=True)

  def body(tables, slots, inputs, grads, hyper):
    outs = local_update(
      plan, topology, tables, slots, inputs, grads, hyper, guard, options
    )
    count = 3 if guard else 2
    return tuple({k: v[i] for k, v in outs.items()} for i in range(count))

  axis = P(topology.axis)
  table_specs = {s.name: topology.table_spec(s.name) for s in plan.stacks}
  slot_specs = {
    stack.name: tuple(table_specs[stack.name] for _ in slots[stack.name])
    for stack in plan.stacks
  }
  out = [table_specs, slot_specs]
  if guard:
    # What undoing needs is per device (a replicated stack's copies each
    # return their own, equal, rows).
    out.append(
      {
        k: (axis, axis, tuple(axis for _ in v), P())
        for k, v in slot_specs.items()
      }
    )
  return jax.shard_map(
    body,
    mesh=topology.mesh,
    in_specs=(
      table_specs,
      slot_specs,
      _input_specs(topology, inputs),
      {key: axis for key in grads},
      {stack.name: P() for stack in plan.stacks},
    ),
    out_specs=tuple(out),
    check_vma=False,
  )(tables, slots, inputs, grads, hyper)


def hyperparameters(plan: Plan, step: jax.Array | int):
  """Stack name -> its optimizer's hyper-parameters at `step`; a 16-bit
  stack's vector ends with its rounding seed (`rounding_seed`)."""
  out = {}
  for stack in plan.stacks:
    h = [
      jnp.asarray(h, jnp.float32)
      for h in stack.optimizer.get_hyperparameters(
        step, embedding_dim=stack.logical_dim
      )
    ]
    if stack.dtype != jnp.float32:
      h.append(rounding_seed(stack, step).astype(jnp.float32))
    out[stack.name] = jnp.stack(h)
  return out


def rounding_seed(stack: StackPlan, step: jax.Array | int) -> jax.Array:
  """The stochastic rounding's seed of a 16-bit stack's update at `step`:
  24 bits of the step mixed with the stack's name (exact as a float32, so
  that it travels at the end of the hyper-parameter vector)."""
  name = np.uint32(zlib.crc32(stack.name.encode()))
  mixed = jnp.asarray(step).astype(jnp.uint32) * jnp.uint32(0x9E3779B1) ^ name
  return (mixed & jnp.uint32(0xFFFFFF)).astype(jnp.int32)


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
