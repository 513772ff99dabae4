"""jax-tpu-embedding's `lib/nn/embedding` over pz_sparsecore.

Layout functions fill the given (compat) specs in place and return None;
preprocessing, stats and FDO are pz_sparsecore's. See docs/compat.md for the
mapping and every difference.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar, Union

import jax
import numpy as np

from pz_sparsecore.compat.lib.core._sharding import ShardingStrategy
from pz_sparsecore.compat.lib.nn import (
  embedding_proto_utils,
  embedding_spec,
  table_stacking,
)
from pz_sparsecore.compat.utils import utils
from pz_sparsecore.core import buffer_format, layout
from pz_sparsecore.core import plan as plan_lib
from pz_sparsecore.core.preprocessed import SparseDenseMatmulInput
from pz_sparsecore.device import routing
from pz_sparsecore.device import topology as topology_lib
from pz_sparsecore.host import fdo, minibatching, sparse_coo
from pz_sparsecore.host import preprocess as pz_preprocess
from pz_sparsecore.host.preprocess import PreprocessedInput

__all__ = [
  "ArrayLike",
  "EmbeddingVariables",
  "EmbeddingVariablesInitializer",
  "PreprocessedInput",
  "SparseDenseMatmulInput",
  "SparseDenseMatmulInputStats",
  "auto_stack_tables",
  "compute_coo_buffer_size_per_device",
  "compute_row_pointers_size_per_device",
  "compute_theoretical_max_coo_buffer_size",
  "create_proto_from_feature_specs",
  "eval_preprocess_sparse_dense_matmul_input_shape",
  "get_optimizer_class",
  "get_optimizer_type",
  "get_stacked_table_specs",
  "get_table_specs",
  "init_embedding_variables",
  "Nested",
  "optimizer_spec_to_proto",
  "prepare_feature_specs_for_training",
  "preprocess_sparse_dense_matmul_input",
  "preprocess_sparse_dense_matmul_input_from_sparse_tensor",
  "proto_to_optimizer_spec",
  "sharding_strategy_to_enum",
  "tpu_sparse_dense_matmul",
  "tpu_sparse_dense_matmul_grad",
  "update_preprocessing_parameters",
]


ArrayLike = jax.Array | np.ndarray
_T = TypeVar("_T")
# A value, or a (nested) sequence or mapping of values, as upstream's alias.
Nested = Union[_T, "list[Nested[_T]]", "Mapping[str, Nested[_T]]"]


class EmbeddingVariablesInitializer(NamedTuple):
  table: Any
  slot: Any


class EmbeddingVariables(NamedTuple):
  table: Any
  slot: Any


class SparseDenseMatmulInputStats(pz_preprocess.SparseDenseMatmulInputStats):
  """pz_sparsecore's stats, with upstream's `from_cc`."""

  @classmethod
  def from_cc(cls, stats: Any) -> pz_preprocess.SparseDenseMatmulInputStats:
    """The stats the compat preprocessing returned (already Python)."""
    return stats


def _features(feature_specs: Any) -> list[Any]:
  return jax.tree.leaves(feature_specs)


def _check_feature_names(feature_specs: Any) -> None:
  layout.check_feature_names(embedding_spec.to_pz(feature_specs))


def get_table_specs(feature_specs: Any) -> dict[str, Any]:
  """Table name -> the table spec its features point to.

  Raises:
    ValueError: If two features share a name ("Feature spec NAME is already
      defined.").
  """
  _check_feature_names(feature_specs)
  return {f.table_spec.name: f.table_spec for f in _features(feature_specs)}


def get_stacked_table_specs(feature_specs: Any) -> dict[str, Any]:
  """Stack name -> its `StackedTableSpec`.

  Raises:
    ValueError: If two features share a name, or a table is not stacked.
  """
  _check_feature_names(feature_specs)
  features = _features(feature_specs)
  if not all(f.table_spec.is_stacked() for f in features):
    raise ValueError(
      "embedding.prepare_feature_specs_for_training was not called"
    )
  stacks = [f.table_spec.stacked_table_spec for f in features]
  return {stack.stack_name: stack for stack in stacks}


def _num_sc(num_sc_per_device: int | None) -> int:
  if num_sc_per_device is None:
    return utils.num_sparsecores_per_device()
  return int(num_sc_per_device)


def prepare_feature_specs_for_training(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int | None = None,
) -> None:
  """Stacks every unstacked table on its own, in place.

  Different table objects of one name are prepared as the last of them (one
  frozen table per name), where upstream prepares each from its own fields.
  """
  frozen = layout.prepare_feature_specs_for_training(
    embedding_spec.to_pz(feature_specs, last_table_per_name=True),
    global_device_count,
    _num_sc(num_sc_per_device),
  )
  embedding_spec.write_back(feature_specs, frozen)


def auto_stack_tables(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int | None = None,
  **kwargs: Any,
) -> None:
  """Stacks every group of compatible tables, in place."""
  table_stacking.auto_stack_tables(
    feature_specs, global_device_count, _num_sc(num_sc_per_device), **kwargs
  )


def compute_row_pointers_size_per_device(
  *,
  global_device_count: int,
  num_sc_per_device: int | None = None,
  enable_minibatching: bool = False,
) -> int:
  """Row pointers per device: `max(N, 8)` per SparseCore (per minibatch)."""
  return _minibatches(
    enable_minibatching
  ) * buffer_format.compute_row_pointers_size_per_device(
    global_device_count, _num_sc(num_sc_per_device)
  )


def compute_theoretical_max_coo_buffer_size(
  max_ids_per_partition: int,
  global_device_count: int,
  num_sc_per_device: int | None = None,
  enable_minibatching: bool = False,
) -> int:
  """The largest COO buffer per device the limit can need."""
  return _minibatches(
    enable_minibatching
  ) * buffer_format.compute_theoretical_max_coo_buffer_size(
    max_ids_per_partition, global_device_count, _num_sc(num_sc_per_device)
  )


def _minibatches(enable_minibatching: bool) -> int:
  """How many minibatches upstream sizes buffers for."""
  return buffer_format.MAX_MINIBATCHES if enable_minibatching else 1


def compute_coo_buffer_size_per_device(
  feature_specs: Any,
  global_device_count: int,
  num_sc_per_device: int | None = None,
  enable_minibatching: bool = False,
) -> dict[str, int]:
  """Stack name -> COO buffer length per device."""
  return pz_preprocess.compute_coo_buffer_size_per_device(
    embedding_spec.to_pz(feature_specs),
    global_device_count,
    _num_sc(num_sc_per_device),
    minibatches=_minibatches(enable_minibatching),
  )


def sharding_strategy_to_enum(sharding_strategy: str) -> Any:
  """The `ShardingStrategy` of a name; only MOD exists."""
  if sharding_strategy.upper() != "MOD":
    raise ValueError(
      f"Unsupported sharding strategy: {sharding_strategy}. Only MOD is "
      "supported."
    )
  return ShardingStrategy.MOD


def preprocess_sparse_dense_matmul_input(
  features: Any,
  features_weights: Any,
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  *,
  num_sc_per_device: int | None = None,
  sharding_strategy: Any = "MOD",
  has_leading_dimension: bool = False,
  allow_id_dropping: bool = False,
  batch_number: int = 0,
  enable_minibatching: bool = False,
  all_reduce_interface: Any = None,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Preprocesses a batch: pz_sparsecore's preprocessing on these specs
  (minibatched with `enable_minibatching`, agreeing on the split through
  `all_reduce_interface`, e.g. `get_all_reduce_interface()`'s)."""
  strategy = sparse_coo.strategy_name(sharding_strategy)
  return pz_preprocess.preprocess_sparse_dense_matmul_input(
    features,
    features_weights,
    embedding_spec.to_pz(feature_specs),
    local_device_count,
    global_device_count,
    num_sc_per_device=_num_sc(num_sc_per_device),
    sharding_strategy=strategy,
    has_leading_dimension=has_leading_dimension,
    allow_id_dropping=allow_id_dropping,
    batch_number=batch_number,
    enable_minibatching=enable_minibatching,
    all_reduce=all_reduce_interface,
  )


def get_all_reduce_interface(
  peer_addresses: Any = (),
  minibatching_port: int = 0,
  host_id: int | None = None,
  host_count: int | None = None,
) -> minibatching.AllReduce:
  """How processes agree on the minibatching split: JAX's collectives over
  every process of `jax.distributed` (upstream's gRPC addresses and port
  are not needed and ignored)."""
  del peer_addresses, minibatching_port, host_id, host_count
  return minibatching.JaxAllReduce()


def preprocess_sparse_dense_matmul_input_from_sparse_tensor(
  indices: Any,
  values: Any,
  dense_shapes: Any,
  feature_specs: Any,
  local_device_count: int,
  global_device_count: int,
  *,
  num_sc_per_device: int | None = None,
  **kwargs: Any,
) -> tuple[PreprocessedInput, SparseDenseMatmulInputStats]:
  """Preprocesses COO input (indices, values, dense shapes per feature)."""
  return sparse_coo.preprocess_sparse_dense_matmul_input_from_sparse_tensor(
    indices,
    values,
    dense_shapes,
    embedding_spec.to_pz(feature_specs),
    local_device_count,
    global_device_count,
    num_sc_per_device=_num_sc(num_sc_per_device),
    **kwargs,
  )


def eval_preprocess_sparse_dense_matmul_input_shape(
  *args: Any, feature_specs: Any = None, **kwargs: Any
) -> Any:
  """The shapes `preprocess_sparse_dense_matmul_input` returns."""
  if feature_specs is not None:
    kwargs["feature_specs"] = embedding_spec.to_pz(feature_specs)
  else:
    args = (embedding_spec.to_pz(args[0]), *args[1:])
  return pz_preprocess.eval_preprocess_sparse_dense_matmul_input_shape(
    *args, **kwargs
  )


def update_preprocessing_parameters(
  feature_specs: Any,
  updated_params: SparseDenseMatmulInputStats | None = None,
  num_sc_per_device: int | None = None,
  *,
  stats: SparseDenseMatmulInputStats | None = None,
) -> None:
  """Sets the stacks' limits and buffer sizes from the stats, in place.

  Args:
    feature_specs: The prepared compat specs.
    updated_params: The stats (upstream's name for this argument).
    num_sc_per_device: SparseCores per device (default: the host's).
    stats: The same stats under pz_sparsecore's name; give one of the two.

  Raises:
    ValueError: If neither or both of `updated_params` and `stats` are given.
  """
  if (updated_params is None) == (stats is None):
    raise ValueError(
      "update_preprocessing_parameters: pass the stats once, as "
      "updated_params (upstream's name) or stats"
    )
  stats = updated_params if stats is None else stats
  frozen = fdo.update_preprocessing_parameters(
    embedding_spec.to_pz(feature_specs), stats, _num_sc(num_sc_per_device)
  )
  embedding_spec.write_back(feature_specs, frozen)


# Upstream's embedding re-exports its proto helpers.
create_proto_from_feature_specs = (
  embedding_proto_utils.create_proto_from_feature_specs
)
get_optimizer_class = embedding_proto_utils.get_optimizer_class
get_optimizer_type = embedding_proto_utils.get_optimizer_type
optimizer_spec_to_proto = embedding_proto_utils.optimizer_spec_to_proto
proto_to_optimizer_spec = embedding_proto_utils.proto_to_optimizer_spec


# ---------------------------------------------------------------------------
# Variables.


def _slot_tuple(like: tuple[Any, ...], values: Any) -> tuple[Any, ...]:
  """`values` as a tuple of `like`'s type: its namedtuple, or a plain
  tuple (a custom optimizer's initializers may be either)."""
  values = tuple(values)
  return type(like)(*values) if hasattr(like, "_fields") else values


def _shard_variables(
  rng: jax.Array, tables: list[Any], num_sc: int, num_shards: int
) -> EmbeddingVariables:
  """One device's rows of a stack: per SparseCore, each member's block."""
  blocks = []
  for i in range(num_sc):
    for table in tables:
      setting = table.setting_in_stack
      shape = (
        setting.padded_vocab_size // num_shards,
        setting.padded_embedding_dim,
      )
      slots = table.optimizer.slot_variables_initializers()
      # Each slot at its width (a row-wise slot: one value per row).
      optimizer = embedding_spec.optimizer_to_pz(table.optimizer)
      widths = optimizer.definition.slot_widths(shape[1])
      blocks.append(
        EmbeddingVariables(
          table=table.initializer(rng[i], shape),
          slot=_slot_tuple(
            slots,
            (
              init(rng[i], (shape[0], width))
              for init, width in zip(slots, widths, strict=True)
            ),
          ),
        )
      )
  return jax.tree.map(lambda *parts: jax.numpy.concatenate(parts), *blocks)


def init_embedding_variables(
  rng: jax.Array,
  table_specs: Any,
  global_sharding: jax.sharding.NamedSharding,
  num_sparsecore_per_device: int | None = None,
  bypass_mesh_check: bool = False,
) -> dict[str, EmbeddingVariables]:
  """Stack name -> its initial table and slots, sharded over the mesh.

  Each SparseCore's block of each member table is drawn by the table's
  initialiser with that SparseCore's key, at the padded shape. The sharding's
  spec is `P(axis, None)` (a `[N * V_shard, D]` array for jit) or
  `P(axis, None, None)` (`[devices, S * V_shard, D]`, for pmap).

  Raises:
    ValueError: On another partition spec, or a mesh whose devices are not
      in `jax.devices()` order (unless `bypass_mesh_check`).
  """
  num_sc = _num_sc(num_sparsecore_per_device)
  spec = global_sharding.spec
  axis = next((a for a in spec if a is not None), None)
  P = jax.sharding.PartitionSpec
  if axis is None or spec not in (P(axis, None), P(axis, None, None)):
    raise ValueError(
      "PartitionSpec of the global sharding either needs to be in the format "
      f"PartitionSpec('x', None, None) or PartitionSpec('x', None). Got {spec}"
    )
  mesh = global_sharding.mesh
  if not bypass_mesh_check and not np.array_equal(
    np.asarray(mesh.devices).flatten(), np.asarray(jax.devices())
  ):
    raise ValueError(
      "global_sharding needs to be created with default device order from "
      f"jax.devices(), but global_sharding.mesh.devices={mesh.devices!r} "
      f"and jax.devices()={jax.devices()!r}"
    )
  stacks = collections.defaultdict(list)
  for table in jax.tree.leaves(table_specs):
    stacks[table.setting_in_stack.stack_name].append(table)
  use_pmap = len(spec) == 3
  devices = jax.local_device_count() if use_pmap else mesh.size
  per_stack = devices * num_sc
  keys = jax.random.split(rng, per_stack * len(stacks))
  result = {}
  for k, (name, tables) in enumerate(stacks.items()):
    tables.sort(key=lambda t: t.setting_in_stack.row_offset_in_shard)
    stack_keys = keys[k * per_stack : (k + 1) * per_stack]
    num_shards = mesh.size * num_sc

    def init(key, tables=tables, num_shards=num_shards):
      return _shard_variables(key, tables, num_sc, num_shards)

    if use_pmap:
      result[name] = jax.pmap(init)(
        stack_keys.reshape((devices, num_sc, *stack_keys.shape[1:]))
      )
    else:
      result[name] = jax.jit(
        jax.shard_map(init, mesh=mesh, in_specs=P(axis), out_specs=spec),
        out_shardings=global_sharding,
      )(stack_keys)
  return result


# ---------------------------------------------------------------------------
# The device side: per device, inside the caller's shard_map.


def _device_call(
  preprocessed_inputs: Any,
  embedding_variables: Mapping[str, Any],
  feature_specs: Any,
  *,
  global_device_count: int | None,
  num_sc_per_device: int | None,
  sharding_strategy: Any,
  minibatched: bool,
) -> tuple[Any, Any, PreprocessedInput, dict[str, Any]]:
  """The plan, the `shard_map`'s topology, the buffers and the tables of a
  device call."""
  count = getattr(preprocessed_inputs, "num_minibatches", None)
  if minibatched and count is None:
    raise ValueError(
      "enable_minibatching=True, but the preprocessed inputs have no "
      "num_minibatches: preprocess them with enable_minibatching=True"
    )
  sharding_strategy_to_enum(sparse_coo.strategy_name(sharding_strategy))
  _check_feature_names(feature_specs)
  topo = topology_lib.shard_map_topology(_num_sc(num_sc_per_device))
  if global_device_count is not None and (
    global_device_count != topo.num_devices
  ):
    raise ValueError(
      f"global_device_count={global_device_count}, but the shard_map's axes "
      f"{topo.axes} hold {topo.num_devices} devices"
    )
  plan = plan_lib.build(
    embedding_spec.to_pz(feature_specs),
    topo.num_devices,
    topo.num_sc_per_device,
  )
  inputs = PreprocessedInput(
    lhs_row_pointers=dict(preprocessed_inputs.lhs_row_pointers),
    lhs_embedding_ids=dict(preprocessed_inputs.lhs_embedding_ids),
    lhs_sample_ids=dict(preprocessed_inputs.lhs_sample_ids),
    lhs_gains=dict(preprocessed_inputs.lhs_gains),
    num_minibatches=count if minibatched else None,
  )
  tables = {name: v[0] for name, v in embedding_variables.items()}
  return plan, topo, inputs, tables


def _by_feature(feature_specs: Any, values: Mapping[str, Any]) -> Any:
  return jax.tree.map(
    lambda f: values[f.name], feature_specs, is_leaf=embedding_spec.is_feature
  )


def tpu_sparse_dense_matmul(
  preprocessed_inputs: Any,
  embedding_variables: Mapping[str, Any],
  feature_specs: Any,
  *,
  global_device_count: int,
  sharding_strategy: str = "MOD",
  num_sc_per_device: int | None = None,
  enable_minibatching: bool = False,
  perform_unstacking: bool = True,
  use_activation_unstack_primitive: bool = False,
) -> Any:
  """One device's activations, inside `jax.shard_map` (upstream's pattern).

  Runs pz_sparsecore's lookup of every stack (`routing.local_lookup`: the
  FFI kernel and the exchange over the `shard_map`'s axis) on the device's
  buffers and table shards (`[S * V_shard, D]`, as `init_embedding_variables`
  lays them out). With `enable_minibatching`, the inputs are minibatched
  (`minibatching`) and the lookup runs once per minibatch.

  Returns:
    The activations, structured like `feature_specs`: `[S * n_f, dim_f]` per
    feature (its samples on this device). Without `perform_unstacking`,
    stack name -> the stack's `[S * B_sc, D]` activations (its features'
    samples stacked as in the buffers).

  Raises:
    ValueError: Outside `shard_map`, on a device count that is not the
      `shard_map`'s, or with `enable_minibatching` on inputs that are not
      minibatched.
  """
  del use_activation_unstack_primitive
  plan, topo, inputs, tables = _device_call(
    preprocessed_inputs,
    embedding_variables,
    feature_specs,
    global_device_count=global_device_count,
    num_sc_per_device=num_sc_per_device,
    sharding_strategy=sharding_strategy,
    minibatched=enable_minibatching,
  )
  acts = routing.local_lookup(
    plan, topo, tables, inputs, unstack=perform_unstacking
  )
  return _by_feature(feature_specs, acts) if perform_unstacking else acts


def _bounds(plan: Any, limits: Any) -> dict[str, tuple[Any, Any]]:
  """`embedding_var_limits` as `UpdateOptions.bounds`."""
  if limits is None:
    return {}
  names = [stack.name for stack in plan.stacks]
  unknown = sorted(set(limits) - set(names))
  if unknown:
    raise ValueError(
      f"embedding_var_limits names stacks {unknown} that are not among the "
      f"feature specs' stacks {names}"
    )
  return {name: tuple(bounds) for name, bounds in limits.items()}


def tpu_sparse_dense_matmul_grad(
  activation_gradients: Any,
  preprocessed_inputs: Any,
  embedding_variables: Mapping[str, Any],
  feature_specs: Any,
  *,
  global_device_count: int | None = None,
  sharding_strategy: str = "MOD",
  label: str = "",
  step: Any = None,
  num_sc_per_device: int | None = None,
  enable_minibatching: bool = False,
  perform_stacking: bool = True,
  use_gradient_stacking_primitive: bool = False,
  embedding_var_limits: Any = None,
) -> dict[str, EmbeddingVariables]:
  """One device's fused update, inside `jax.shard_map` (upstream's pattern).

  Every row the batch references gets its gradient summed over all devices'
  samples and the stack's optimizer once (`routing.local_update`), in place
  when the variables are donated.

  Without `perform_stacking`, `activation_gradients` are per stack (as
  `tpu_sparse_dense_matmul(..., perform_unstacking=False)` returns the
  activations). `embedding_var_limits` maps stack names to `(min, max)`
  (either None): every row the batch updates is clipped to it.

  Returns:
    Stack name -> the updated `EmbeddingVariables` (slots in the same
    namedtuple as given).

  Raises:
    ValueError: As `tpu_sparse_dense_matmul`, and for
      `embedding_var_limits` naming an unknown stack.
  """
  del label, use_gradient_stacking_primitive
  plan, topo, inputs, tables = _device_call(
    preprocessed_inputs,
    embedding_variables,
    feature_specs,
    global_device_count=global_device_count,
    num_sc_per_device=num_sc_per_device,
    sharding_strategy=sharding_strategy,
    minibatched=enable_minibatching,
  )
  if perform_stacking:
    grads = {
      f.name: g
      for f, g in zip(
        jax.tree.leaves(feature_specs, is_leaf=embedding_spec.is_feature),
        jax.tree.leaves(activation_gradients),
        strict=True,
      )
    }
  else:
    grads = dict(activation_gradients)
  slots = {name: tuple(v[1]) for name, v in embedding_variables.items()}
  hyper = routing.hyperparameters(plan, 0 if step is None else step)
  options = routing.UpdateOptions(
    stacked_grads=not perform_stacking,
    bounds=_bounds(plan, embedding_var_limits),
  )
  updated = routing.local_update(
    plan, topo, tables, slots, inputs, grads, hyper, options=options
  )
  return {
    name: EmbeddingVariables(
      table=table, slot=_slot_tuple(embedding_variables[name][1], new_slots)
    )
    for name, (table, new_slots) in updated.items()
  }
