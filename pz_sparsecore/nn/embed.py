"""`SparseCoreEmbed`: a Penzai layer over row-sharded, stacked tables.

The layer owns one `pz.Parameter` per stack, labelled
`f"{name}/{stack}.embeddings"`, whose value is a `NamedArray` with axes
`("sc_shard", "sc_row", embedding_axis)` and shape `[N, V_shard, D]`,
sharded over the mesh's sharding axis (device `d` holds shards
`d*S .. d*S+S-1`). The optimizer's slots sit beside it as `pz.StateVariable`s
labelled `f"{name}/{stack}.{slot}"`, shaped like the table.

Calling the layer on a `PreprocessedInput` (from `layer.preprocess`) returns
one `NamedArray` per feature, with the feature's sample axes (default
`("batch",)`) and the embedding axis, sharded over the batch.

Tables are never differentiated. Training takes the gradient of the loss
with respect to the activations and hands it to `apply_gradients` (or lets
`SparseCoreTrainer` do so), which runs each stack's optimizer in place on the
rows the batch referenced. Differentiating with respect to a table raises
`TableGradientError`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from penzai import pz

from pz_sparsecore import layout, parallel
from pz_sparsecore.preprocess import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
  eval_preprocess_sparse_dense_matmul_input_shape,
  preprocess_sparse_dense_matmul_input,
)
from pz_sparsecore.specs import FeatureSpec, StackedTableSpec

SHARD_AXIS = "sc_shard"
ROW_AXIS = "sc_row"


@dataclasses.dataclass(frozen=True)
class EmbedConfig:
  """Static description of a `SparseCoreEmbed` (hashable, jit-static).

  Attributes:
    name: The layer's name (prefix of its variable labels).
    feature_specs: The prepared feature specs, in pytree-leaf order.
    feature_treedef: The structure of the user's feature spec tree.
    topology: Mesh, sharding axis and SparseCores per device.
    feature_axes: Per feature (same order), the names of its sample axes.
    embedding_axis: Name of the embedding axis.
  """

  name: str
  feature_specs: tuple[FeatureSpec, ...]
  feature_treedef: Any
  topology: parallel.Topology
  feature_axes: tuple[tuple[str, ...], ...]
  embedding_axis: str

  @functools.cached_property
  def plans(self) -> tuple[parallel.StackPlan, ...]:
    return parallel.plan_stacks(self.feature_specs, self.topology)

  @functools.cached_property
  def stacks(self) -> dict[str, StackedTableSpec]:
    return layout.get_stacked_table_specs(self.feature_specs)

  @property
  def specs_tree(self) -> Any:
    """The prepared feature specs in the user's structure."""
    return jax.tree.unflatten(self.feature_treedef, self.feature_specs)

  def axes_of(self, feature: str) -> tuple[str, ...]:
    for spec, axes in zip(self.feature_specs, self.feature_axes, strict=True):
      if spec.name == feature:
        return axes
    raise KeyError(feature)

  def table_label(self, stack: str) -> str:
    return f"{self.name}/{stack}.embeddings"

  def slot_label(self, stack: str, slot: str) -> str:
    return f"{self.name}/{stack}.{slot}"


def _feature_axes(
  specs: tuple[FeatureSpec, ...], feature_axes: Any
) -> tuple[tuple[str, ...], ...]:
  out = []
  for spec in specs:
    if feature_axes is None:
      axes = ("batch",)
    elif isinstance(feature_axes, Mapping):
      axes = tuple(feature_axes.get(spec.name, ("batch",)))
    else:
      axes = tuple(feature_axes)
    if len(axes) != len(spec.output_shape) - 1:
      raise ValueError(
        f"feature {spec.name!r}: {len(axes)} sample axes {axes} for "
        f"output_shape {spec.output_shape} (expected "
        f"{len(spec.output_shape) - 1})"
      )
    out.append(axes)
  return tuple(out)


def _call_initializer(init, key, shape):
  try:
    return init(key, shape, jnp.float32)
  except TypeError:
    return jnp.asarray(init(key, shape), jnp.float32)


def _init_stack(config: EmbedConfig, stack: str, key: jax.Array) -> jax.Array:
  """One stack's `[N, V_shard, D]` table, initialised shard by shard in place.

  The table is allocated once, sharded, then each device fills its local
  shards one at a time into the donated buffer, so the initialisation needs
  one shard of scratch, not a second table. Every member table of shard `g`
  is drawn from key `g` of `split(key, N)` with shape `[V_member / N, D]`.
  """
  topo = config.topology
  n, s = topo.num_shards, topo.num_sc_per_device
  spec = config.stacks[stack]
  members = layout.get_table_stacks(config.feature_specs)[stack]
  keys = jax.random.split(key, n)
  rows = spec.stack_vocab_size // n
  axis = jax.sharding.PartitionSpec(topo.axis)

  def fill(local_table, local_keys, k):
    parts = [
      _call_initializer(
        t.initializer,
        local_keys[k],
        (t.setting_in_stack.padded_vocab_size // n, spec.stack_embedding_dim),
      )
      for t in members
    ]
    shard = jnp.concatenate(parts, axis=0)[None]
    return jax.lax.dynamic_update_slice_in_dim(local_table, shard, k, axis=0)

  fill_shard = jax.jit(
    jax.shard_map(
      fill,
      mesh=topo.mesh,
      in_specs=(axis, axis, jax.sharding.PartitionSpec()),
      out_specs=axis,
      check_vma=False,
    ),
    donate_argnums=0,
  )
  table = jax.jit(
    lambda: jnp.zeros((n, rows, spec.stack_embedding_dim), jnp.float32),
    out_shardings=topo.sharding(3),
  )()
  for k in range(s):
    table = fill_shard(table, keys, jnp.int32(k))
  return table


def _init_slot(config: EmbedConfig, stack: str, initializer) -> jax.Array:
  topo = config.topology
  spec = config.stacks[stack]
  shape = (
    topo.num_shards,
    spec.stack_vocab_size // topo.num_shards,
    spec.stack_embedding_dim,
  )
  fn = jax.jit(
    lambda: _call_initializer(initializer, jax.random.key(0), shape),
    out_shardings=topo.sharding(3),
  )
  return fn()


@pz.pytree_dataclass
class SparseCoreEmbed(pz.nn.Layer):
  """Looks up features in row-sharded, stacked tables.

  Attributes:
    tables: Stack name → the stack's table variable (`pz.Parameter`).
    slots: Stack name → slot name → optimizer slot (`pz.StateVariable`).
    config: Static description: specs, topology, axis names.
    activation_probes: Internal; set by the trainer to read the gradient
      with respect to the activations.
  """

  tables: dict[str, Any]
  slots: dict[str, dict[str, Any]]
  config: EmbedConfig = dataclasses.field(metadata={"pytree_node": False})
  activation_probes: dict[str, jax.Array] | None = None
  tap: Any = dataclasses.field(default=None, metadata={"pytree_node": False})

  @classmethod
  def from_config(
    cls,
    name: str,
    init_base_rng: jax.Array | None,
    feature_specs: Any,
    mesh: Mesh,
    sharding_axis: str = "device",
    num_sc_per_device: int = 1,
    feature_axes: Any = None,
    embedding_axis: str = "embedding",
  ) -> SparseCoreEmbed:
    """Builds the layer and its (sharded) variables.

    Args:
      name: Layer name; variable labels are `f"{name}/{stack}.embeddings"`
        and `f"{name}/{stack}.{slot}"`.
      init_base_rng: Key for the tables' initializers, or None for slots to
        be filled later (e.g. by `restore_checkpoint`).
      feature_specs: A pytree of `FeatureSpec`s (prepared or not; stacking
        from `stack_tables` / `auto_stack_tables` is kept).
      mesh: A `jax.sharding.Mesh` (Auto axes).
      sharding_axis: The mesh axis tables and batches are sharded over.
      num_sc_per_device: Virtual SparseCores per device.
      feature_axes: Sample axis names: None (`("batch",)` for every
        feature), one tuple for all features, or a dict feature → tuple.
      embedding_axis: Name of the embedding axis.

    Returns:
      A new `SparseCoreEmbed`.

    Raises:
      ValueError: On a bad topology, specs or axis names.
    """
    if not isinstance(mesh, Mesh):
      raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
    topology = parallel.Topology(mesh, sharding_axis, num_sc_per_device)
    prepared = layout.prepare_feature_specs_for_training(
      feature_specs, topology.num_devices, num_sc_per_device
    )
    leaves, treedef = jax.tree.flatten(prepared)
    for spec in leaves:
      if spec.sample_count % topology.num_shards:
        raise ValueError(
          f"feature {spec.name!r}: {spec.sample_count} samples do not divide "
          f"over {topology.num_shards} shards "
          f"({topology.num_devices} devices x {num_sc_per_device} SparseCores)"
        )
    config = EmbedConfig(
      name=name,
      feature_specs=tuple(leaves),
      feature_treedef=treedef,
      topology=topology,
      feature_axes=_feature_axes(tuple(leaves), feature_axes),
      embedding_axis=embedding_axis,
    )
    tables, slots = {}, {}
    for stack, spec in config.stacks.items():
      label = config.table_label(stack)
      initializers = spec.optimizer.slot_variables_initializers()
      names = spec.optimizer.slot_names()
      if init_base_rng is None:
        tables[stack] = pz.ParameterSlot(label)
        slots[stack] = {
          slot: pz.StateVariableSlot(config.slot_label(stack, slot))
          for slot in names
        }
        continue
      key = pz.nn.derive_param_key(init_base_rng, label)
      tables[stack] = pz.Parameter(
        value=_named(config, _init_stack(config, stack, key)), label=label
      )
      slots[stack] = {
        slot: pz.StateVariable(
          value=_named(config, _init_slot(config, stack, init)),
          label=config.slot_label(stack, slot),
        )
        for slot, init in zip(names, initializers, strict=True)
      }
    return cls(tables=tables, slots=slots, config=config)

  # -------------------------------------------------------------------------
  # Host side.

  def preprocess(
    self,
    features: Any,
    weights: Any = None,
    *,
    batch_number: int = 0,
    allow_id_dropping: bool = False,
  ) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
    """Preprocesses this process's local batch into device arrays.

    A feature with several sample axes (e.g. `("batch", "seq")`) takes a
    dense array of shape `[*sample_dims]` (one id per sample) or
    `[*sample_dims, k]`; it is flattened to `[prod(sample_dims), k]`.

    Args:
      features: Pytree of id arrays, structured like the feature specs.
      weights: None or a matching pytree of float weights.
      batch_number: Passed to the preprocessor.
      allow_id_dropping: Drop ids over the limits instead of raising.

    Returns:
      `(inputs, stats)`: buffers as global arrays laid out for the mesh, and
      the batch's statistics (for FDO).

    Raises:
      ValueError: On bad input (naming the feature and the value).
    """
    topo = self.config.topology
    features = self._flatten_samples(features, "features")
    if weights is not None:
      weights = self._flatten_samples(weights, "weights")
    local = _local_device_count(topo)
    inputs, stats = preprocess_sparse_dense_matmul_input(
      features,
      weights,
      self.config.specs_tree,
      local,
      topo.num_devices,
      num_sc_per_device=topo.num_sc_per_device,
      has_leading_dimension=False,
      allow_id_dropping=allow_id_dropping,
      batch_number=batch_number,
    )
    sharding = topo.sharding(1)

    def to_global(x):
      size = x.shape[0] // local * topo.num_devices
      return jax.make_array_from_process_local_data(sharding, x, (size,))

    return jax.tree.map(to_global, inputs), stats

  def _flatten_samples(self, tree: Any, what: str) -> Any:
    try:
      leaves = self.config.feature_treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
      raise ValueError(
        f"{what} do not match the feature specs' structure "
        f"{self.config.feature_treedef}: {e}"
      ) from e
    out = []
    for spec, axes, leaf in zip(
      self.config.feature_specs, self.config.feature_axes, leaves, strict=True
    ):
      if len(axes) > 1 and isinstance(leaf, (np.ndarray, jax.Array)):
        leaf = np.asarray(leaf)
        if leaf.ndim not in (len(axes), len(axes) + 1):
          raise ValueError(
            f"feature {spec.name!r}: {what} of shape {leaf.shape} for sample "
            f"axes {axes}"
          )
        lead = int(np.prod(leaf.shape[: len(axes)]))
        leaf = leaf.reshape(lead, -1)
      out.append(leaf)
    return jax.tree.unflatten(self.config.feature_treedef, out)

  def input_shapes(self) -> PreprocessedInput:
    """Global `jax.ShapeDtypeStruct`s of `preprocess`'s buffers."""
    topo = self.config.topology
    local = eval_preprocess_sparse_dense_matmul_input_shape(
      self.config.specs_tree,
      1,
      topo.num_devices,
      num_sc_per_device=topo.num_sc_per_device,
    )
    return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(
        (x.shape[0] * topo.num_devices,), x.dtype, sharding=topo.sharding(1)
      ),
      local,
    )

  # -------------------------------------------------------------------------
  # Device side.

  def _check_inputs(self, inputs: Any) -> None:
    if not isinstance(inputs, PreprocessedInput):
      raise ValueError(
        f"SparseCoreEmbed {self.config.name!r} takes the PreprocessedInput "
        f"from its preprocess(), got {type(inputs).__name__}"
      )
    expected = self.input_shapes()
    for field in dataclasses.fields(PreprocessedInput):
      want, got = getattr(expected, field.name), getattr(inputs, field.name)
      if set(got) != set(want):
        raise ValueError(
          f"{field.name}: stacks {sorted(got)} do not match the layer's "
          f"{sorted(want)}"
        )
      for stack, w in want.items():
        g = got[stack]
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype:
          raise ValueError(
            f"stack {stack!r}: {field.name} is {g.dtype}{list(g.shape)}, "
            f"expected {w.dtype}{list(w.shape)} (features "
            f"{[f.name for f in self._stack_features(stack)]}); preprocess "
            "with this layer's preprocess()"
          )

  def _stack_features(self, stack: str) -> list[FeatureSpec]:
    return [
      f
      for f in self.config.feature_specs
      if f.table_spec.stacked_table_spec.stack_name == stack
    ]

  def table_arrays(self) -> dict[str, jax.Array]:
    """Stack name → the table as a positional `[N, V_shard, D]` array."""
    return {
      stack: var.value.unwrap(SHARD_AXIS, ROW_AXIS, self.config.embedding_axis)
      for stack, var in self.tables.items()
    }

  def slot_arrays(self) -> dict[str, tuple[jax.Array, ...]]:
    """Stack name → the slots as positional arrays, in optimizer order."""
    axes = (SHARD_AXIS, ROW_AXIS, self.config.embedding_axis)
    return {
      stack: tuple(var.value.unwrap(*axes) for var in slots.values())
      for stack, slots in self.slots.items()
    }

  def activation_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    """Feature name → global `[samples, dim]` of its flat activations."""
    return {
      f.name: jax.ShapeDtypeStruct(
        (f.sample_count, f.output_shape[-1]), jnp.float32
      )
      for f in self.config.feature_specs
    }

  def __call__(
    self, inputs: PreprocessedInput, /, **side_inputs: Any
  ) -> dict[str, pz.nx.NamedArray]:
    """Feature name → activations `NamedArray` (sample axes + embedding)."""
    del side_inputs
    self._check_inputs(inputs)
    acts = parallel.lookup(
      self.config.plans, self.config.topology, self.table_arrays(), inputs
    )
    if self.activation_probes is not None:
      acts = {k: v + self.activation_probes[k] for k, v in acts.items()}
      self.tap.record(inputs)
    out = {}
    for spec, axes in zip(
      self.config.feature_specs, self.config.feature_axes, strict=True
    ):
      value = acts[spec.name].reshape(tuple(spec.output_shape))
      out[spec.name] = pz.nx.wrap(value).tag(*axes, self.config.embedding_axis)
    return out

  def _flat_grads(self, grads: Mapping[str, Any]) -> dict[str, jax.Array]:
    out = {}
    for spec, axes in zip(
      self.config.feature_specs, self.config.feature_axes, strict=True
    ):
      if spec.name not in grads:
        raise ValueError(f"no activation gradient for feature {spec.name!r}")
      g = grads[spec.name]
      if isinstance(g, pz.nx.NamedArray | pz.nx.NamedArrayView):
        g = g.unwrap(*axes, self.config.embedding_axis)
      out[spec.name] = jnp.asarray(g, jnp.float32).reshape(
        spec.sample_count, spec.output_shape[-1]
      )
    return out

  def updated_arrays(
    self,
    tables: dict[str, jax.Array],
    slots: dict[str, tuple[jax.Array, ...]],
    inputs: PreprocessedInput,
    activation_grads: Mapping[str, Any],
    step: jax.Array | int,
  ) -> tuple[dict[str, jax.Array], dict[str, tuple[jax.Array, ...]]]:
    """The fused update as a pure function of positional arrays.

    Donate `tables` and `slots` to keep the update in place.
    """
    self._check_inputs(inputs)
    return parallel.apply_gradients(
      self.config.plans,
      self.config.topology,
      tables,
      slots,
      inputs,
      self._flat_grads(activation_grads),
      step,
    )

  def apply_gradients(
    self,
    inputs: PreprocessedInput,
    activation_grads: Mapping[str, Any],
    step: jax.Array | int,
  ) -> None:
    """Runs each stack's optimizer on the referenced rows, in place.

    Writes the new values into the layer's variables; use it inside
    `pz.variable_jit(..., donate_variables=True)` so the update happens in
    the donated buffers.

    Args:
      inputs: The buffers the activations were computed from.
      activation_grads: Feature name → gradient with respect to its
        activations (`NamedArray` as returned by `__call__`, or an array).
      step: The training step, for step-dependent optimizers.
    """
    tables, slots = self.updated_arrays(
      self.table_arrays(), self.slot_arrays(), inputs, activation_grads, step
    )
    self.assign_arrays(tables, slots)

  def assign_arrays(
    self,
    tables: dict[str, jax.Array],
    slots: dict[str, tuple[jax.Array, ...]],
  ) -> None:
    """Writes positional arrays into the (mutable) variables."""
    for stack, value in tables.items():
      self.tables[stack].value = _named(self.config, value)
    for stack, values in slots.items():
      for var, value in zip(self.slots[stack].values(), values, strict=True):
        var.value = _named(self.config, value)

  # -------------------------------------------------------------------------
  # Logical views.

  def _stacked_host(self, arrays: Mapping[str, Any]) -> dict[str, np.ndarray]:
    return {stack: to_host(v) for stack, v in arrays.items()}

  def logical_tables(self) -> dict[str, np.ndarray]:
    """Table name → `[vocab, dim]` numpy array."""
    return layout.unshard_and_unstack_tables(
      self.config.feature_specs,
      self._stacked_host(self.table_arrays()),
      self.config.topology.num_shards,
    )

  def logical_slots(self) -> dict[str, dict[str, np.ndarray]]:
    """Table name → slot name → `[vocab, dim]` numpy array."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for stack, slots in self.slots.items():
      for slot, var in slots.items():
        values = var.value.unwrap(
          SHARD_AXIS, ROW_AXIS, self.config.embedding_axis
        )
        tables = layout.unshard_and_unstack_tables(
          [t for t in self._tables_of(stack)],
          {stack: to_host(values)},
          self.config.topology.num_shards,
        )
        for name, value in tables.items():
          out.setdefault(name, {})[slot] = value
    return out

  def _tables_of(self, stack: str):
    return layout.get_table_stacks(self.config.feature_specs)[stack]

  def _write_logical(
    self, variables: Mapping[str, Any], values: Mapping[str, Any], what: str
  ) -> dict[str, jax.Array]:
    """New stacked arrays with the given logical tables written in."""
    tables = layout.get_table_specs(self.config.feature_specs)
    unknown = sorted(set(values) - set(tables))
    if unknown:
      raise ValueError(
        f"unknown {what} {unknown}; the layer has {sorted(tables)}"
      )
    n = self.config.topology.num_shards
    changed: dict[str, np.ndarray] = {}
    for name, value in values.items():
      table = tables[name]
      value = np.asarray(value, dtype=np.float32)
      expected = (table.vocabulary_size, table.embedding_dim)
      if value.shape != expected:
        raise ValueError(
          f"{what} {name!r}: expected shape {expected}, got {value.shape}"
        )
      if not np.all(np.isfinite(value)):
        raise ValueError(f"{what} {name!r}: values must be finite")
    for name, value in values.items():
      table = tables[name]
      stack = table.stacked_table_spec.stack_name
      if stack not in changed:
        current = variables[stack]
        changed[stack] = np.array(to_host(current), dtype=np.float32)
      flat = changed[stack].reshape(-1, changed[stack].shape[-1])
      rows = layout.physical_row_ids(table, np.arange(table.vocabulary_size), n)
      flat[rows, : table.embedding_dim] = np.asarray(value, np.float32)
    sharding = self.config.topology.sharding(3)
    return {k: from_host(v, sharding) for k, v in changed.items()}

  def set_logical_tables(self, tables: Mapping[str, Any]) -> None:
    """Writes logical tables (any subset) into the sharded parameters.

    Raises:
      ValueError: On an unknown table name or a shape mismatch; nothing is
        written then.
    """
    new = self._write_logical(self.table_arrays(), tables, "table")
    for stack, value in new.items():
      self.tables[stack].value = _named(self.config, value)

  def set_logical_slots(self, slots: Mapping[str, Mapping[str, Any]]) -> None:
    """Writes logical slots (table name → slot name → array).

    Raises:
      ValueError: On unknown names or shape mismatches; nothing is written.
    """
    updates: list[tuple[str, str, jax.Array]] = []
    for stack, stack_slots in self.slots.items():
      for index, slot in enumerate(stack_slots):
        values = {
          t: s[slot]
          for t, s in slots.items()
          if isinstance(s, Mapping) and slot in s
        }
        values = {
          t: v
          for t, v in values.items()
          if t in {m.name for m in self._tables_of(stack)}
        }
        if not values:
          continue
        arrays = {stack: self.slot_arrays()[stack][index]}
        new = self._write_logical(arrays, values, "slot " + slot + " of table")
        updates.append((stack, slot, new[stack]))
    known = {
      (t.name, s)
      for stack, stack_slots in self.slots.items()
      for t in self._tables_of(stack)
      for s in stack_slots
    }
    for table, table_slots in slots.items():
      for slot in table_slots:
        if (table, slot) not in known:
          raise ValueError(f"unknown slot {slot!r} of table {table!r}")
    for stack, slot, value in updates:
      self.slots[stack][slot].value = _named(self.config, value)

  def with_feature_specs(self, feature_specs: Any) -> SparseCoreEmbed:
    """A layer sharing these variables with new limits (e.g. from FDO).

    Only the preprocessing limits and buffer sizes may change; the stacks'
    layout must stay the same.

    Raises:
      ValueError: If the new specs change the layout.
    """
    topo = self.config.topology
    prepared = layout.prepare_feature_specs_for_training(
      feature_specs, topo.num_devices, topo.num_sc_per_device
    )
    leaves, treedef = jax.tree.flatten(prepared)
    if treedef != self.config.feature_treedef:
      raise ValueError("new feature specs have a different structure")
    new_stacks = layout.get_stacked_table_specs(prepared)
    limits = dict(
      max_ids_per_partition=1,
      max_unique_ids_per_partition=1,
      suggested_coo_buffer_size_per_device=None,
    )
    for stack, spec in self.config.stacks.items():
      new = new_stacks.get(stack)
      if new is None or new.replace(**limits) != spec.replace(**limits):
        raise ValueError(
          f"stack {stack!r}: new feature specs change more than the limits"
        )
    config = dataclasses.replace(self.config, feature_specs=tuple(leaves))
    return dataclasses.replace(self, config=config)

  def __treescope_repr__(self, path: str | None, subtree_renderer: Any):
    from pz_sparsecore import _treescope

    return _treescope.render_embed(self, path, subtree_renderer)

  def treescope_summary(self) -> str:
    """The one-line summary Treescope shows for the collapsed layer."""
    from pz_sparsecore import _treescope

    return _treescope.embed_summary(self)


def _named(config: EmbedConfig, value: jax.Array) -> pz.nx.NamedArray:
  return pz.nx.wrap(value).tag(SHARD_AXIS, ROW_AXIS, config.embedding_axis)


def _local_device_count(topo: parallel.Topology) -> int:
  """Positions along the sharding axis whose devices this process owns."""
  devices = np.moveaxis(
    topo.mesh.devices, topo.mesh.axis_names.index(topo.axis), 0
  ).reshape(topo.num_devices, -1)
  me = jax.process_index()
  owned = [
    i for i in range(topo.num_devices) if devices[i, 0].process_index == me
  ]
  if not owned or owned != list(range(owned[0], owned[0] + len(owned))):
    raise ValueError(
      f"process {me} must own a contiguous block of the sharding axis "
      f"{topo.axis!r}; it owns positions {owned}"
    )
  return len(owned)


def to_host(value: Any) -> np.ndarray:
  """A (possibly multi-process) array as one numpy array on every process."""
  if isinstance(value, jax.Array) and not value.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
  return np.asarray(jax.device_get(value))


def from_host(value: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
  """A numpy array (equal on every process) placed with `sharding`."""
  value = np.asarray(value)
  return jax.make_array_from_callback(value.shape, sharding, lambda i: value[i])
