"""Treescope renderings of pz_sparsecore's objects (private; see `viz`).

Every object renders as `Type(summary)` when collapsed. Expanded, the
summary becomes a comment on the first line, a few comment lines give the
derived facts (per stack: member tables, limits, buffer fill) and the real
attributes follow, rendered by Treescope as usual, so arrays keep their array
view and every copy path stays a valid attribute path. In roundtrip mode the
comments disappear (they are `roundtrip_condition(not_roundtrip=...)` parts,
leading the first attribute's line so that no blank line is left) and the
node reads as a constructor call with its fields: plain for specs and
layers (`roundtrippable=True`: the fields are the constructor's arguments),
inside Treescope's `<...>` for plans, buffers and stats (not claimed to
evaluate back).

A layer's comments end with pictures of where its ids live
(`viz.placement`): for each of its first tables, the ids in vocabulary
order coloured by the device holding them, as Treescope's sharding view
colours devices, with the id -> device rule and a legend, so that the
default view (the root expanded once) answers which device holds an id.

A `SparseCoreLookup` (one table, Penzai's `EmbeddingLookup`) has its own
summary (`lookup_summary`: label, vocabulary and embedding axes, shards,
optimizer) and one more comment, just above its physical `[N, V_shard, D]`
table, naming the call that shows the table in vocabulary order
(`viz.vocabulary_view`).

Each attribute line is in the HTML once, whichever mode shows it, and a
spec appears in full once inside a rendered layer, plan or spec: a plan
holds every feature's spec three times (`feature_specs`, and its stack's
`features` and `tables`) and the stack's spec in every member table's, so a
spec met again is one line, `TableSpec('t03': ...)  # shown at
.config.plan.feature_specs[3].table_spec`. With both, the DLRM benchmark's
26-table layer renders to about 1 MB of HTML (33 MB without).

The `core` types (`TableSpec`, `FeatureSpec`, `StackedTableSpec`, `Plan`,
`PreprocessedInput`, `SparseDenseMatmulInputStats`) know nothing of their
rendering: importing this module registers `render_spec`, `render_plan`,
`render_inputs` and `render_stats` for them in Treescope's handler registry
(`register_renderers`), and `import pz_sparsecore` has Treescope import it
before its next rendering. A Penzai layer renders through its own
`__treescope_repr__` (Penzai's structs define one, which takes precedence
over the registry): `SparseCoreEmbed`'s imports this module lazily and
calls `render_embed`. The plain-text summaries and details (`*_summary`,
`*_details`) are the ones `viz.describe` prints.

Stack details come from the `plan.Plan` of the layer's specs; the number of
valid entries of concrete buffers is `buffer_format.count_valid_entries`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from treescope import (
  context,
  formatting_util,
  renderers,
  rendering_parts,
  type_registries,
)

from pz_sparsecore.core import buffer_format, hashed
from pz_sparsecore.core.optimizers import SlotShape
from pz_sparsecore.core.plan import Plan, StackPlan
from pz_sparsecore.core.preprocessed import (
  PreprocessedInput,
  SparseDenseMatmulInputStats,
)
from pz_sparsecore.core.specs import (
  FeatureSpec,
  OptimizerSpec,
  StackedTableSpec,
  TableSpec,
)
from pz_sparsecore.viz._common import is_concrete

Renderer = renderers.TreescopeSubtreeRenderer

_SpecRecord = dict[int, tuple[Any, str | None]]
_shown_specs: context.ContextualValue[_SpecRecord | None] = (
  context.ContextualValue(
    module=__name__, qualname="_shown_specs", initial_value=None
  )
)
"""The specs rendered in full so far under the outermost summarized node
being rendered, by `id`, with the spec (kept alive, so that ids stay unique)
and its path; None outside one (see `render_spec`). Scoped to one rendering,
like Treescope's own record of shared values."""


# ---------------------------------------------------------------------------
# Small text helpers.


def optimizer_summary(optimizer: OptimizerSpec) -> str:
  """`adagrad(lr=0.1)`: the optimizer's kernel name and learning rate, and
  the slots not shaped like the table (`rowwise_adagrad(lr=0.01;
  accumulator per row)`)."""
  lr = optimizer.learning_rate
  lr_text = "schedule" if callable(lr) else f"{lr:g}"
  shaped = [
    f"{slot.name} per row"
    if slot.shape is SlotShape.ROWWISE_1D
    else f"{slot.name} x{slot.shape}"
    for slot in optimizer.definition.slots
    if slot.shape is not SlotShape.TABLE
  ]
  extra = f"; {', '.join(shaped)}" if shaped else ""
  return f"{optimizer.short_name()}(lr={lr_text}{extra})"


def table_rows_per_shard(table: TableSpec, num_shards: int) -> int:
  """Rows of each shard that a member table of a stack occupies."""
  return table.setting_in_stack.padded_vocab_size // num_shards


def _shape_text(x: Any) -> str:
  dtype = np.dtype(x.dtype).name
  return f"{dtype}{list(x.shape)}"


# ---------------------------------------------------------------------------
# Summaries (plain text, shared with `viz.describe`).


def plan_summary(plan: Plan) -> str:
  """One line: features, stacks (rows/shard x dim), devices x SCs."""
  stacks = ", ".join(
    f"{stack.name}[{stack.rows_per_shard} rows/shard x {stack.dim}]"
    for stack in plan.stacks
  )
  return (
    f"{len(plan.feature_specs)} features, stacks {stacks}; "
    f"{plan.num_devices} devices x {plan.num_sc_per_device} SC"
  )


def _is_lookup(embed: Any) -> bool:
  """Whether `embed` is a `SparseCoreLookup` (one table in vocabulary
  order, Penzai's `EmbeddingLookup`), imported on use like the layer."""
  from pz_sparsecore.nn.lookup import LookupConfig

  return isinstance(embed.config, LookupConfig)


def lookup_summary(lookup: Any) -> str:
  """One line: label, vocabulary and embedding axes, shards, optimizer.

  For example `'emb.embeddings': vocabulary:1000 x embedding:16 over 8
  shards, sgd(lr=0.1)`, in the terms of Penzai's `EmbeddingTable`.
  """
  config = lookup.config
  axes = ((config.vocabulary_axis, config.vocab_size), *config.embedding_axes)
  shape = " x ".join(f"{name}:{size}" for name, size in axes)
  stack = config.plan.stacks[0]
  optimizer = stack.spec.optimizer
  return (
    f"{config.label!r}: {shape}{dtype_text(stack.dtype)} over "
    f"{config.topology.num_shards} shards, "
    f"{optimizer_summary(optimizer)}"
  )


def embed_summary(embed: Any) -> str:
  """One line: name, then the plan's summary on the sharding axis (for a
  `SparseCoreLookup`, `lookup_summary`)."""
  if _is_lookup(embed):
    return lookup_summary(embed)
  config = embed.config
  return (
    f"{config.name!r}: {plan_summary(config.plan)} on {config.topology.axis!r}"
  )


def vocabulary_view_line(path: str | None) -> str:
  """The comment pointing from a lookup's physical table to its view in
  vocabulary order; `path` is Treescope's path of the lookup (the root,
  `""`, reads `lookup`; a nested one `model.path`)."""
  where = f"model{path}" if path else "lookup"
  return f"vocabulary order: pzsc.viz.vocabulary_view({where})"


def dtype_text(dtype: Any) -> str:
  """`" bfloat16"` / `" float16"` after a width: a 16-bit table's storage
  (float32, the default, is not named)."""
  name = np.dtype(dtype).name
  return "" if name == "float32" else f" {name}"


def _unique_limit_text(stack: StackPlan) -> str:
  """The stack's distinct-id limit, and why when it is the rows of a shard
  below the id limit (`limits="auto"` bounds it so:
  `layout.worst_case_limits`)."""
  spec = stack.spec
  unique = spec.max_unique_ids_per_partition
  if unique == stack.rows_per_shard < spec.max_ids_per_partition:
    return (
      f"{unique} (= rows per shard: no partition receives more distinct ids)"
    )
  return str(unique)


def _stack_line(plan: Plan, stack: StackPlan, sizes: str) -> str:
  """`stack 'name': N shards x rows x dim, optimizer, combiner, ` + sizes."""
  spec = stack.spec
  return (
    f"stack {stack.name!r}: {plan.num_shards} shards x "
    f"{stack.rows_per_shard} rows x {stack.dim}{dtype_text(stack.dtype)}, "
    f"{optimizer_summary(spec.optimizer)}, {spec.combiner}, {sizes}"
  )


def stack_details(plan: Plan, stack: StackPlan) -> list[str]:
  """Lines describing one stack: its spec, then one line per member table."""
  spec, n = stack.spec, plan.num_shards
  lines = [
    _stack_line(
      plan,
      stack,
      f"{spec.total_sample_count} samples, limits ids "
      f"{spec.max_ids_per_partition} / unique {_unique_limit_text(stack)}",
    )
  ]
  for table in stack.tables:
    setting = table.setting_in_stack
    rows = table_rows_per_shard(table, n)
    start = setting.row_offset_in_shard
    features = ", ".join(
      f.name for f in plan.feature_specs if f.table_spec.name == table.name
    )
    if table.is_hashed:
      lines.append(
        f"  {table.name}: {hashed_text(table)}, {stack.rows_per_shard} "
        f"rows per shard, each id on shard mix64(id) % {n}; features "
        f"{features}"
      )
      continue
    lines.append(
      f"  {table.name}: vocab {table.vocabulary_size} x "
      f"{table.embedding_dim}, rows [{start}, {start + rows}) of each shard, "
      f"rotation {setting.shard_rotation}; features {features}"
    )
  return lines


def hashed_text(table: TableSpec) -> str:
  """`hashed ids, capacity C, eviction lru` (and the policy's setting)."""
  eviction = table.eviction
  policy = eviction.policy
  if eviction.ttl_steps is not None:
    policy += f" after {eviction.ttl_steps} steps unseen"
  if eviction.decay_steps is not None:
    policy += f", counts halving every {eviction.decay_steps} steps"
  return (
    f"hashed ids, capacity {table.vocabulary_size} x "
    f"{table.embedding_dim}, eviction {policy}"
  )


def map_lines(embed: Any, stack: str) -> list[str]:
  """A hashed stack's map: rows held per shard and its counters (nothing
  if the values are not concrete, e.g. slots or traced)."""
  counters = getattr(embed.maps[stack]["counters"], "value", None)
  if not is_concrete(counters):
    return []
  counters = np.asarray(counters, np.int64)
  capacity = embed.config.plan.stack(stack).rows_per_shard
  held = counters[:, 0]
  totals = dict(zip(hashed.COUNTERS, counters.sum(0), strict=True))
  return [
    f"  map: {totals['held']} ids held of {capacity * len(held)} rows "
    f"({totals['held'] / (capacity * len(held)):.1%}), per shard "
    f"{held.min()}..{held.max()} of {capacity}",
    f"  since built: {totals['inserted']} inserted, {totals['evicted']} "
    f"evicted, {totals['refused']} refused (training), {totals['unseen']} "
    "unseen (inference)",
  ]


def plan_details(plan: Plan) -> list[str]:
  """The stacks of a plan, as `stack_details` lines."""
  return [line for stack in plan.stacks for line in stack_details(plan, stack)]


def mapping_line(mapping: Any) -> str:
  """Which named axis of the layer lives on which mesh axes."""
  return _mapping_text(mapping.names)


def _mapping_text(names: Sequence[tuple[str, tuple[str, ...]]]) -> str:
  """`mesh axes: a -> 'x'; b -> ('x', 'y'); c, d -> replicated`."""
  placed, replicated = [], []
  for name, mesh_axes in names:
    if not mesh_axes:
      replicated.append(name)
    else:
      where = repr(mesh_axes[0]) if len(mesh_axes) == 1 else repr(mesh_axes)
      placed.append(f"{name} -> {where}")
  if replicated:
    placed.append(f"{', '.join(replicated)} -> replicated")
  return "mesh axes: " + "; ".join(placed)


def lookup_details(lookup: Any) -> list[str]:
  """A `SparseCoreLookup`'s table: where its axes live, its stack and table
  lines, placement and exchange, in the terms of its calls.

  Its plan is a placeholder of one id per shard, sized anew for each call
  (`LookupConfig.plan_for`); so the lines name the table's own axes (the
  shard axis and the embedding axes, not the internal sample and flattened
  axes) and give the limits and the exchange as each call sets them
  rather than the placeholder's.
  """
  from pz_sparsecore.device import exchange as exchange_lib
  from pz_sparsecore.nn.tables import SHARD_AXIS

  config = lookup.config
  plan, topology = config.plan, config.topology
  (stack,) = plan.stacks
  if config.max_ids_per_partition is None:
    limits = "every id a call sends a partition (max_ids_per_partition=None)"
  else:
    limits = (
      f"ids {config.max_ids_per_partition} per partition "
      "(max_ids_per_partition), fewer for a call with fewer ids"
    )
  exchange = topology.exchange_of(stack)
  if exchange.mode == exchange_lib.LOCAL:
    exchange_text = exchange.reason
  elif topology.exchange == exchange_lib.AUTO:
    exchange_text = "chosen per call: the mode with fewer predicted bytes"
  else:
    exchange_text = f"{topology.exchange} (forced)"
  axes = [
    (SHARD_AXIS, config.axis_mapping[SHARD_AXIS]),
    *((name, ()) for name, _ in config.embedding_axes),
  ]
  maps = getattr(lookup, "maps", {})
  return [
    _mapping_text(axes),
    _stack_line(plan, stack, f"samples per call, limits per call: {limits}"),
    *stack_details(plan, stack)[1:],
    f"  placement: {placement_of(topology, stack.name)}",
    f"  exchange: {exchange_text}",
    *(map_lines(lookup, stack.name) if stack.name in maps else []),
  ]


def embed_details(embed: Any) -> list[str]:
  """The stacks of a `SparseCoreEmbed`: `stack_details` lines, each stack
  followed by its placement and the exchange it uses on the layer's
  topology and why (for a `SparseCoreLookup`, `lookup_details`)."""
  if _is_lookup(embed):
    return lookup_details(embed)
  plan, topology = embed.config.plan, embed.config.topology
  lines = [mapping_line(embed.config.axis_mapping)]
  for stack in plan.stacks:
    lines += stack_details(plan, stack)
    lines.append(f"  placement: {placement_of(topology, stack.name)}")
    lines.append(f"  exchange: {topology.exchange_of(stack).reason}")
    if stack.name in getattr(embed, "maps", {}):
      lines += map_lines(embed, stack.name)
  return lines


def placement_of(topology: Any, stack: str) -> str:
  """`"replicated on every device"` or `"sharded over <axis>"`."""
  if topology.is_replicated(stack):
    return f"replicated on every device ({topology.num_devices} copies)"
  return f"sharded over {topology.axis!r}"


def spec_summary(spec: Any) -> str:
  """A short summary of a `TableSpec`, `FeatureSpec` or `StackedTableSpec`."""
  if isinstance(spec, TableSpec):
    text = (
      f"{spec.name!r}: {spec.vocabulary_size} x {spec.embedding_dim}"
      f"{dtype_text(spec.dtype)}, {optimizer_summary(spec.optimizer)}, "
      f"{spec.combiner}"
    )
    if activations := dtype_text(spec.activation_dtype):
      text += f", activations{activations}"
    if spec.is_hashed:
      text += f", {hashed_text(spec)}"
    if spec.stacked_table_spec is not None:
      setting = spec.setting_in_stack
      text += (
        f"; in {setting.stack_name!r} at row {setting.row_offset_in_shard}, "
        f"rotation {setting.shard_rotation}"
      )
    return text
  if isinstance(spec, FeatureSpec):
    text = (
      f"{spec.name!r} -> {spec.table_spec.name!r}: input "
      f"{list(spec.input_shape)}, output {list(spec.output_shape)}"
      f"{dtype_text(spec.table_spec.activation_dtype)}"
    )
    if spec.id_transformation is not None:
      start = spec.id_transformation.row_offset
      stack = spec.table_spec.setting_in_stack.stack_name
      text += f"; samples [{start}, {start + spec.sample_count}) of {stack!r}"
    return text
  if isinstance(spec, StackedTableSpec):
    return (
      f"{spec.stack_name!r}: {spec.stack_vocab_size} x "
      f"{spec.stack_embedding_dim}{dtype_text(spec.dtype)}, "
      f"{optimizer_summary(spec.optimizer)}, "
      f"{spec.combiner}, {spec.total_sample_count} samples, limits "
      f"{spec.max_ids_per_partition} / {spec.max_unique_ids_per_partition}"
    )
  raise TypeError(f"not a spec: {type(spec).__name__}")


def inputs_details(inputs: Any, num_shards: int | None = None) -> list[str]:
  """Per stack: buffer sizes and, for concrete arrays, the valid entries."""
  lines = []
  for stack, rp in inputs.lhs_row_pointers.items():
    ids = inputs.lhs_embedding_ids[stack]
    size = int(np.prod(ids.shape))
    line = (
      f"{stack}: row pointers {_shape_text(rp)}, COO buffers {_shape_text(ids)}"
    )
    if is_concrete(rp) and is_concrete(ids):
      valid = buffer_format.count_valid_entries(rp, ids, num_shards)
      line += f"; {valid} valid entries of {size} ({valid / size:.1%})"
    lines.append(line)
  return lines


def inputs_summary(inputs: Any) -> str:
  """One line: the stacks and the total valid entries (when concrete)."""
  stacks = list(inputs.lhs_row_pointers)
  text = f"{len(stacks)} stack{'s' if len(stacks) != 1 else ''}"
  arrays = [*inputs.lhs_row_pointers.values()]
  arrays += list(inputs.lhs_embedding_ids.values())
  if stacks and all(is_concrete(x) for x in arrays):
    valid = sum(
      buffer_format.count_valid_entries(
        inputs.lhs_row_pointers[s], inputs.lhs_embedding_ids[s], None
      )
      for s in stacks
    )
    size = sum(int(np.prod(x.shape)) for x in inputs.lhs_embedding_ids.values())
    text += f", {valid} valid entries of {size} ({valid / size:.1%})"
  count = inputs.num_minibatches
  if count is not None and is_concrete(count):
    n = int(np.max(np.asarray(count)))
    text += f", {n} minibatch{'es' if n != 1 else ''}"
  return text


def _max(x: Any) -> int | None:
  if not is_concrete(x):
    return None
  x = np.asarray(x)
  return int(x.max()) if x.size else 0


def _with_limit(value: int | None, limit: int | None) -> str:
  if value is None:
    return "?"
  if limit is None:
    return str(value)
  flag = " OVER" if value > limit else ""
  return f"{value}/{limit}{flag}"


def stats_line(
  stats: Any,
  stack: str,
  spec: StackedTableSpec | None = None,
  buffer_per_sc: int | None = None,
) -> str:
  """One stack's largest counts (against the limits when known) and drops.

  Args:
    stats: A `SparseDenseMatmulInputStats`.
    stack: The stack's name.
    spec: The stack's spec, for the limits; None for bare numbers.
    buffer_per_sc: The stack's COO entries per SparseCore, if known.

  Returns:
    `"{stack}: max ids ..., max unique ..., required buffer ... per SC,
    dropped ..."`.
  """
  ids = stats.max_ids_per_partition[stack]
  limit_ids = spec.max_ids_per_partition if spec else None
  limit_unique = spec.max_unique_ids_per_partition if spec else None
  unique = stats.max_unique_ids_per_partition.get(stack)
  required = stats.required_buffer_size_per_sc.get(stack)
  drops = stats.id_drop_counters.get(stack)
  drops_text = str(int(np.sum(drops))) if _is_concrete_scalar(drops) else "?"
  return (
    f"{stack}: max ids {_with_limit(_max(ids), limit_ids)}, max unique "
    f"{_with_limit(_max(unique), limit_unique)}, required buffer "
    f"{_with_limit(_max(required), buffer_per_sc)} per SC, dropped "
    f"{drops_text}"
  )


def stats_details(
  stats: Any,
  stacks: Mapping[str, StackedTableSpec] | None = None,
  buffer_per_sc: Mapping[str, int] | None = None,
) -> list[str]:
  """Per stack: largest counts (against the limits when known), drops.

  Args:
    stats: A `SparseDenseMatmulInputStats`.
    stacks: Stack name → spec, for the limits; None for bare numbers.
    buffer_per_sc: Stack name → COO entries per SparseCore.

  Returns:
    One `stats_line` per stack.
  """
  return [
    stats_line(
      stats, stack, (stacks or {}).get(stack), (buffer_per_sc or {}).get(stack)
    )
    for stack in stats.max_ids_per_partition
  ]


def _is_concrete_scalar(x: Any) -> bool:
  return isinstance(x, (int, np.integer)) or is_concrete(x)


def stats_summary(stats: Any) -> str:
  """One line: the number of stacks and the total dropped ids."""
  stacks = list(stats.max_ids_per_partition)
  text = f"{len(stacks)} stack{'s' if len(stacks) != 1 else ''}"
  drops = list(stats.id_drop_counters.values())
  if all(_is_concrete_scalar(d) for d in drops):
    text += f", {sum(int(np.sum(d)) for d in drops)} ids dropped"
  return text


# ---------------------------------------------------------------------------
# Rendering parts.


def _comment(text: str) -> rendering_parts.RenderableTreePart:
  return rendering_parts.comment_color(rendering_parts.text(text))


def _detail_comments(
  details: Sequence[str | rendering_parts.RenderableTreePart],
) -> rendering_parts.RenderableTreePart:
  """The detail lines, shown only outside roundtrip mode.

  They lead the first attribute's line rather than being children of their
  own: Treescope starts a new line for every child, so a child that renders
  empty in roundtrip mode would leave a blank line. The first detail takes
  the line the node opens for its first child; the others follow on lines of
  their own (`on_separate_lines` ends with a line break, where the first
  attribute then starts).
  """
  if not details:
    return rendering_parts.empty_part()
  parts = [
    _comment(f"# {line}") if isinstance(line, str) else line for line in details
  ]
  return rendering_parts.roundtrip_condition(
    not_roundtrip=rendering_parts.siblings(
      parts[0], rendering_parts.on_separate_lines(parts[1:])
    )
  )


def _attribute_line(
  name: str,
  value: Any,
  path: str | None,
  subtree_renderer: Renderer,
  last: bool,
) -> rendering_parts.RenderableTreePart:
  child_path = None if path is None else f"{path}.{name}"
  if last:  # A comma only when expanded, as in `repr_lib`.
    comma = rendering_parts.fold_condition(expanded=rendering_parts.text(","))
  else:
    comma = rendering_parts.siblings(
      ",", rendering_parts.fold_condition(collapsed=rendering_parts.text(" "))
    )
  return rendering_parts.build_full_line_with_annotations(
    rendering_parts.siblings_with_annotations(
      f"{name}=", subtree_renderer(value, path=child_path)
    ),
    comma,
  )


def summarized_node(
  obj: Any,
  summary: str,
  details: Sequence[str | rendering_parts.RenderableTreePart],
  attributes: Mapping[str, Any],
  path: str | None,
  subtree_renderer: Renderer,
  color: str | None = None,
  roundtrippable: bool = False,
) -> rendering_parts.RenderableAndLineAnnotations:
  """`Type(summary)` collapsed; comments plus real attributes expanded.

  Args:
    obj: The object (only its type is used).
    summary: One-line summary, shown collapsed and as first-line comment.
    details: Extra lines shown as comments (strings) or parts when expanded.
    attributes: Real attributes of `obj`, rendered normally when expanded.
    path: The object's path, for copy buttons.
    subtree_renderer: Treescope's renderer for the attributes.
    color: Optional background colour.
    roundtrippable: Whether `attributes` are the constructor's arguments
      (else roundtrip mode wraps the node in `<...>`).

  Returns:
    The rendering.
  """
  children = []
  comments = rendering_parts.fold_condition(expanded=_detail_comments(details))
  last = len(attributes) - 1
  with _tracking_specs():
    lines = [
      _attribute_line(name, value, path, subtree_renderer, i == last)
      for i, (name, value) in enumerate(attributes.items())
    ]
  for i, line in enumerate(lines):
    # Hidden only when collapsed outside roundtrip mode (the summary stands
    # in). One part for "expanded or roundtrip": two conditional copies, one
    # per case, would double the HTML at every summarized level (a stack's
    # spec in a table's, a feature's, a plan, a layer: 32 copies).
    line = rendering_parts.summarizable_condition(detail=line)
    children.append(line if i else rendering_parts.siblings(comments, line))
  if not attributes:
    children.append(comments)
  opening, closing = ("", "") if roundtrippable else ("<", ">")
  prefix = rendering_parts.siblings(
    rendering_parts.roundtrip_condition(
      roundtrip=rendering_parts.text(opening)
    ),
    rendering_parts.maybe_qualified_type_name(type(obj)),
    "(",
    rendering_parts.fold_condition(
      collapsed=rendering_parts.roundtrip_condition(
        not_roundtrip=rendering_parts.text(summary)
      )
    ),
  )
  suffix = rendering_parts.siblings(
    ")",
    rendering_parts.roundtrip_condition(
      roundtrip=rendering_parts.text(closing)
    ),
  )
  return rendering_parts.build_foldable_tree_node_from_children(
    prefix=prefix,
    children=children,
    suffix=suffix,
    path=path,
    background_color=color,
    first_line_annotation=rendering_parts.roundtrip_condition(
      not_roundtrip=_comment(f"  # {summary}")
    ),
  )


@contextlib.contextmanager
def _tracking_specs() -> Iterator[None]:
  """Within the outermost summarized node, one record of the specs shown."""
  if _shown_specs.get() is not None:
    yield
  else:
    with _shown_specs.set_scoped({}):
      yield


def _spec_reference(
  spec: Any, path: str | None, first_path: str | None
) -> rendering_parts.RenderableAndLineAnnotations:
  """One line standing for a spec already shown in full at `first_path`.

  `Type(summary)  # shown at .path` (`<Type 'name' shown at .path>` in
  roundtrip mode, where it does not evaluate back and has no comment).
  """
  where = f"shown at {first_path}" if first_path is not None else "shown above"
  name = getattr(spec, "name", None) or getattr(spec, "stack_name", "")
  type_name = rendering_parts.maybe_qualified_type_name(type(spec))
  line = rendering_parts.RenderableAndLineAnnotations(
    renderable=rendering_parts.roundtrip_condition(
      roundtrip=rendering_parts.siblings("<", type_name, f" {name!r} {where}>"),
      not_roundtrip=rendering_parts.siblings(
        type_name, f"({spec_summary(spec)})"
      ),
    ),
    annotations=rendering_parts.roundtrip_condition(
      not_roundtrip=_comment(f"  # {where}")
    ),
  )
  return rendering_parts.build_one_line_tree_node(line, path)


def _fields(obj: Any, skip_none: Sequence[str] = ()) -> dict[str, Any]:
  """The dataclass fields of `obj`, less those of `skip_none` that are
  None or empty (left at their defaults)."""
  return {
    f.name: getattr(obj, f.name)
    for f in dataclasses.fields(obj)
    if not (f.name in skip_none and getattr(obj, f.name) in (None, {}))
  }


def render_embed(
  embed: Any, path: str | None, subtree_renderer: Renderer
) -> rendering_parts.RenderableAndLineAnnotations:
  """Renders a `SparseCoreEmbed` (works with unbound variable slots too).

  After the stack details come the placement pictures of its first tables
  in vocabulary order, coloured by device (`placement.view_part`; they
  read the plan and the mesh, not the values).

  A `SparseCoreLookup` has its own summary, and a last detail line, just
  above its physical table, naming the call that shows the table in
  vocabulary order (`vocabulary_view_line`).
  """
  from pz_sparsecore.viz import placement

  color = embed.treescope_color()
  if isinstance(color, tuple):
    color = color[1]
  details: list[Any] = embed_details(embed)
  details.append(placement.view_part(embed, path))
  if _is_lookup(embed):
    details.append(vocabulary_view_line(path))
  return summarized_node(
    embed,
    embed_summary(embed),
    details,
    _fields(embed, skip_none=("activation_probe", "maps")),
    path,
    subtree_renderer,
    color=color,
    roundtrippable=True,
  )


def render_plan(
  plan: Plan, path: str | None, subtree_renderer: Renderer
) -> rendering_parts.RenderableAndLineAnnotations:
  """Renders a `plan.Plan` with its per-stack details (for its repr)."""
  return summarized_node(
    plan,
    plan_summary(plan),
    plan_details(plan),
    _fields(plan),
    path,
    subtree_renderer,
  )


def render_spec(
  spec: Any, path: str | None, subtree_renderer: Renderer
) -> rendering_parts.RenderableAndLineAnnotations:
  """Renders a `TableSpec`, `FeatureSpec` or `StackedTableSpec`.

  Inside another summarized node (a layer, a plan, a spec), a spec already
  rendered there in full is one line pointing to that path: a plan holds each
  feature's spec three times (`feature_specs`, its stack's `features` and
  `tables`) and the stack's spec once per member table, which would
  otherwise make a 26-table layer's HTML tens of MB.
  """
  shown = _shown_specs.get()
  if shown is not None:
    if id(spec) in shown:
      return _spec_reference(spec, path, shown[id(spec)][1])
    shown[id(spec)] = (spec, path)
  return summarized_node(
    spec,
    spec_summary(spec),
    (),
    _fields(spec),
    path,
    subtree_renderer,
    roundtrippable=True,
  )


def render_inputs(
  inputs: Any, path: str | None, subtree_renderer: Renderer
) -> rendering_parts.RenderableAndLineAnnotations:
  """Renders a `PreprocessedInput` with per-stack fill (when concrete)."""
  return summarized_node(
    inputs,
    inputs_summary(inputs),
    inputs_details(inputs),
    _fields(inputs),
    path,
    subtree_renderer,
    color=formatting_util.color_from_string("PreprocessedInput"),
  )


def render_stats(
  stats: Any, path: str | None, subtree_renderer: Renderer
) -> rendering_parts.RenderableAndLineAnnotations:
  """Renders a `SparseDenseMatmulInputStats` with per-stack maxima."""
  return summarized_node(
    stats,
    stats_summary(stats),
    stats_details(stats),
    _fields(stats),
    path,
    subtree_renderer,
  )


_RENDERERS: dict[type, renderers.TreescopeNodeHandler] = {
  TableSpec: render_spec,
  FeatureSpec: render_spec,
  StackedTableSpec: render_spec,
  Plan: render_plan,
  PreprocessedInput: render_inputs,
  SparseDenseMatmulInputStats: render_stats,
}
"""The renderer of each `core` type (and, by Treescope's lookup along the
method resolution order, of its subclasses)."""


def register_renderers() -> None:
  """Registers `_RENDERERS` in Treescope's handler registry (again: a
  no-op). Runs when this module is imported."""
  type_registries.TREESCOPE_HANDLER_REGISTRY.update(_RENDERERS)


register_renderers()
