"""The checkpoint manifest: what a checkpoint holds, checked against a model.

A checkpoint holds a flat dict of arrays under generated keys (`"a0"`,
`"a1"`, ...) and this JSON manifest, which says what each array is::

  {"format": "pz_sparsecore.checkpoint", "version": 2,
   "embeds": {"emb": {"words": {                    # layer, then stack
       "layout": {"num_shards": 8, "rows_per_shard": 8, "dim": 8,
                  "tables": [{"name": "words", "vocab": 60, "dim": 8,
                              "padded_vocab": 64, "row_offset_in_shard": 0,
                              "shard_rotation": 0}]},
       "dtype": "float32", "optimizer": "adagrad",
       "arrays": {"embeddings": "a0", "accumulator": "a1"},
       "limits": {"max_ids_per_partition": 12, ...}}}},  # _ckpt_limits
   "variables": {"head.w": {"kind": "parameter", "array": "a2",
                            "leaf": {"shape": [16, 4], "dtype": "float32",
                                     "axes": ["hidden", "out"], "key": null}}},
   "trainer": [{"path": "['state'].step", "array": "a3", "leaf": {...}}, ...]}

A save adds `"tables"` (the keys of the stacks' arrays, stored in the
`tables` item, `_ckpt_tables.py`; a checkpoint without it holds every array
in `arrays`), `"digests"` and `"crc32"` (`_ckpt_integrity.py`) and when it
was saved (`_ckpt_steps.py`).

`describe(target)` builds the same manifest for a model (or a
`SparseCoreTrainer`) together with the arrays it would store; `check`
compares a stored manifest with a target's and raises a `ValueError` naming
the first difference, before anything is read or assigned. A model built
with variable slots (`init_base_rng=None`) has no values: its slots are
checked by kind only, its tables by layer, name, shape and optimizer.
A stack's `"limits"` (the limits in force and what they were set for,
`_ckpt_limits.py`) are not compared: they never stop a restore, and
checkpoints written before they were stored have none.

A *leaf* is one stored array: a plain array, a `NamedArray` (its named axes
in order; positional axes are refused) or a typed PRNG key (its key data and
implementation name). `build_leaf` turns a read array back into the value.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from pz_sparsecore.nn._ckpt_hashed import moved
from pz_sparsecore.nn._ckpt_layout import StackLayout, stack_layout
from pz_sparsecore.nn._ckpt_limits import describe_limits
from pz_sparsecore.nn.embed import SparseCoreEmbed, find_embeds, variable_labels
from pz_sparsecore.nn.tables import positional_table
from pz_sparsecore.nn.training import SparseCoreTrainer, fit_limits_from_json

FORMAT = "pz_sparsecore.checkpoint"
VERSION = 2
TABLE = "embeddings"
"""The key of a stack's table among its arrays (the others are slots)."""

SLOTS = (pz.ParameterSlot, pz.StateVariableSlot)
"""The types of variable slots (a model built with `init_base_rng=None`)."""


def _is_named(x: Any) -> bool:
  return isinstance(x, pz.nx.NamedArray | pz.nx.NamedArrayView)


def describe_leaf(what: str, value: Any) -> tuple[dict[str, Any], Any]:
  """The manifest entry of one value and the array to store for it.

  Args:
    what: The value's name in error messages.
    value: An array, a `NamedArray` or a typed PRNG key array.

  Returns:
    `(entry, data)`: shape, dtype, axis names and key implementation, and
    the array itself (not copied).

  Raises:
    ValueError: For positional axes or a value that is not an array.
  """
  axes = key = None
  if _is_named(value):
    if value.positional_shape:
      raise ValueError(f"{what}: positional axes are not supported")
    axes = list(value.named_shape)
    value = value.unwrap(*axes)
  if isinstance(value, bool | int | float | np.generic):
    value = np.asarray(value)
  if not isinstance(value, jax.Array | np.ndarray):
    raise ValueError(
      f"{what}: cannot checkpoint a value of type {type(value).__name__} "
      "(only arrays, NamedArrays and PRNG keys)"
    )
  if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
    key = str(jax.random.key_impl(value))
    value = jax.random.key_data(value)
  entry = {
    "shape": list(value.shape),
    "dtype": str(np.dtype(value.dtype)),
    "axes": axes,
    "key": key,
  }
  return entry, value


def build_leaf(entry: Mapping[str, Any], array: Any) -> Any:
  """The value of a leaf read back as `array`.

  A numpy array (what values that were not committed to devices are read
  as) becomes an uncommitted `jax.Array`, as a fresh Penzai parameter is.

  Args:
    entry: The leaf's manifest entry.
    array: The array read from the checkpoint.

  Returns:
    The array, `NamedArray` or PRNG key.
  """
  if isinstance(array, np.ndarray):
    array = jnp.asarray(array)
  if entry["key"] is not None:
    array = jax.random.wrap_key_data(array, impl=entry["key"])
  if entry["axes"] is not None:
    return pz.nx.wrap(array).tag(*entry["axes"])
  return array


@dataclasses.dataclass
class Description:
  """A target's manifest and the arrays behind it.

  Attributes:
    manifest: The manifest (JSON types only).
    values: Array key → the array as the target holds it (slots have none).
    names: Array key → the variable label or trainer state path it holds.
    trainer_treedef: The structure of the trainer's state and key, or None
      for a model.
  """

  manifest: dict[str, Any] = dataclasses.field(default_factory=dict)
  values: dict[str, Any] = dataclasses.field(default_factory=dict)
  names: dict[str, str] = dataclasses.field(default_factory=dict)
  trainer_treedef: Any = None

  def add(self, data: Any, name: str) -> str:
    """A new array key for `name`, holding `data` unless it is None."""
    key = f"a{len(self.names)}"
    self.names[key] = name
    if data is not None:
      self.values[key] = data
    return key


def _describe_embed(embed: SparseCoreEmbed, out: Description):
  config = embed.config
  stacks = {}
  for stack in config.plan.stacks:
    variables = {TABLE: embed.tables[stack.name]}
    variables.update(embed.slots[stack.name])
    arrays, dtype = {}, None
    for name, var in variables.items():
      value = None
      if not isinstance(var, SLOTS):
        value = positional_table(config, var.value)
        if name == TABLE:  # The table's (slots are float32).
          dtype = str(np.dtype(value.dtype))
      arrays[name] = out.add(value, var.label)
    stacks[stack.name] = {
      "layout": stack_layout(config.plan, stack).to_json(),
      "dtype": dtype,
      "optimizer": stack.optimizer.short_name(),
      "arrays": arrays,
      # Each slot's values per row ("table", "rowwise_1d" or a width);
      # absent in older checkpoints, whose slots are all "table".
      "slot_shapes": {
        slot.name: slot.shape_text for slot in stack.optimizer.definition.slots
      },
      "limits": describe_limits(config.plan, stack),
    }
  return stacks


def _all_variables(model: Any) -> list[Any]:
  """Bound variables and variable slots of `model`."""
  _, variables = pz.unbind_variables(model)
  slots = pz.select(model).at_instances_of(SLOTS).get_sequence()
  return list(variables) + list(slots)


def _describe_variables(model: Any, out: Description) -> dict[str, Any]:
  tables, slots = variable_labels(model)
  entries = {}
  for var in _all_variables(model):
    label = str(var.label)
    if label in tables or label in slots:
      continue
    kind = "parameter"
    if isinstance(var, pz.StateVariable | pz.StateVariableSlot):
      kind = "state"
    leaf, data = None, None
    if not isinstance(var, SLOTS):
      leaf, data = describe_leaf(f"variable {label!r}", var.value)
    entries[label] = {
      "kind": kind,
      "leaf": leaf,
      "array": out.add(data, label),
    }
  return entries


def _trainer_tree(trainer: SparseCoreTrainer) -> dict[str, Any]:
  return {"state": trainer.state.value, "root_rng": trainer.root_rng}


def restored_trainer(
  trainer: SparseCoreTrainer,
  treedef: Any,
  leaves: list[Any],
  model: Any,
  fit_stats: Mapping[str, Any] | None = None,
) -> SparseCoreTrainer:
  """`trainer` with restored leaves (as `describe` flattened them) and model.

  Its state variable is updated in place; the returned trainer also has the
  restored root key, and `fit`'s saved statistics (`fit_stats`, where they
  were counted on the restored layers' topology; else none).
  """
  tree = jax.tree.unflatten(treedef, leaves)
  trainer.state.value = tree["state"]
  stats = None
  if fit_stats is not None:
    stats = fit_limits_from_json(fit_stats, model)
  return dataclasses.replace(
    trainer, model=model, root_rng=tree["root_rng"], limit_stats=stats
  )


def _describe_trainer(trainer: SparseCoreTrainer, out: Description):
  leaves, out.trainer_treedef = jax.tree_util.tree_flatten_with_path(
    _trainer_tree(trainer), is_leaf=_is_named
  )
  entries = []
  for path, value in leaves:
    name = jax.tree_util.keystr(path)
    leaf, data = describe_leaf(f"trainer state {name}", value)
    entries.append(
      {"path": name, "leaf": leaf, "array": out.add(data, f"trainer {name}")}
    )
  return entries


def describe(target: Any) -> Description:
  """The manifest of a model or `SparseCoreTrainer`, and its arrays.

  Args:
    target: A Penzai model (bound variables or slots) or a trainer.

  Returns:
    The description; its manifest holds JSON types only.

  Raises:
    ValueError: If two layers share a name or a value cannot be stored.
  """
  trainer = target if isinstance(target, SparseCoreTrainer) else None
  model = target.model if trainer is not None else target
  out = Description()
  embeds = {}
  for embed in find_embeds(model):
    name = embed.config.name
    if name in embeds:
      raise ValueError(f"two SparseCoreEmbed layers are named {name!r}")
    embeds[name] = _describe_embed(embed, out)
  manifest = {
    "format": FORMAT,
    "version": VERSION,
    "embeds": embeds,
    "variables": _describe_variables(model, out),
    "trainer": None if trainer is None else _describe_trainer(trainer, out),
    # `fit`'s statistics of the batches it preprocessed, per layer (so the
    # limits it sets after a restore never fall below what they needed).
    "fit_stats": None
    if trainer is None or trainer.limit_stats is None
    else trainer.limit_stats.to_json(),
  }
  out.manifest = json.loads(json.dumps(manifest))
  return out


# ---------------------------------------------------------------------------
# Checking a stored manifest against a target's.


def _text(value: Any) -> str:
  return str(tuple(value)) if isinstance(value, list) else str(value)


def check_leaf(
  what: str, stored: Mapping[str, Any], target: Mapping[str, Any] | None
) -> None:
  """Raises unless a stored leaf matches the target's (None: a slot).

  Raises:
    ValueError: Naming `what`, the field and both values.
  """
  if target is None:
    return
  for field in ("shape", "dtype", "axes", "key"):
    if stored[field] != target[field]:
      name = "PRNG key" if field == "key" else field
      raise ValueError(
        f"{what}: checkpoint {name} {_text(stored[field])}, model "
        f"{_text(target[field])}"
      )


def _names_match(what: str, stored: Any, target: Any, owner: str) -> None:
  """Raises unless `stored` and `target` have the same names."""
  for name in target:
    if name not in stored:
      raise ValueError(
        f"{what} {name!r}{owner}: not in the checkpoint, which has "
        f"{sorted(stored)}"
      )
  for name in stored:
    if name not in target:
      raise ValueError(
        f"{what} {name!r}{owner} of the checkpoint is not in the model, "
        f"which has {sorted(target)}"
      )


def stored_tables(stacks: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
  """Table name → (its stack, the stack's manifest entry)."""
  return {
    table["name"]: (stack, entry)
    for stack, entry in stacks.items()
    for table in entry["layout"]["tables"]
  }


def _optimizer_text(entry: Mapping[str, Any]) -> str:
  shapes = entry.get("slot_shapes") or {}
  slots = [
    name if shapes.get(name, "table") == "table" else f"{name}[{shapes[name]}]"
    for name in entry["arrays"]
    if name != TABLE
  ]
  if not slots:
    return entry["optimizer"]
  return f"{entry['optimizer']} (slots {', '.join(slots)})"


def _check_table(
  name: str, stored: Any, target: Any, cast_tables: bool
) -> None:
  what = f"table {name!r}"
  layouts = [
    StackLayout.from_json(entry["layout"]) for entry in (stored, target)
  ]
  shapes = [
    next((t.vocab, t.dim) for t in layout.tables if t.name == name)
    for layout in layouts
  ]
  if shapes[0] != shapes[1]:
    raise ValueError(f"{what}: checkpoint shape {shapes[0]}, model {shapes[1]}")
  if (
    not cast_tables
    and target["dtype"] is not None
    and stored["dtype"] != target["dtype"]
  ):
    raise ValueError(
      f"{what}: checkpoint dtype {stored['dtype']}, model {target['dtype']} "
      "(restore_checkpoint(..., cast_tables=True) casts the stored rows to "
      "the model's dtype)"
    )
  texts = [_optimizer_text(entry) for entry in (stored, target)]
  if texts[0] != texts[1]:
    raise ValueError(
      f"{what}: checkpoint optimizer {texts[0]}, model {texts[1]}"
    )


def _check_embeds(
  stored: Mapping[str, Any], target: Mapping[str, Any], cast_tables: bool
):
  _names_match("SparseCoreEmbed", stored, target, "")
  for layer, stacks in target.items():
    have = stored_tables(stored[layer])
    want = stored_tables(stacks)
    _names_match("table", have, want, f" of SparseCoreEmbed {layer!r}")
    for name, (_, entry) in want.items():
      _check_table(name, have[name][1], entry, cast_tables)


def _check_variables(stored: Mapping[str, Any], target: Mapping[str, Any]):
  _names_match("variable", stored, target, "")
  # A hashed map saved for other shards is moved, not read as it is.
  elsewhere = moved(stored, target)
  for label, entry in target.items():
    kept = stored[label]
    if kept["kind"] != entry["kind"]:
      raise ValueError(
        f"variable {label!r}: checkpoint kind {kept['kind']}, model "
        f"{entry['kind']}"
      )
    if label not in elsewhere:
      check_leaf(f"variable {label!r}", kept["leaf"], entry["leaf"])


def _check_trainer(stored: Any, target: list[Any]) -> None:
  if stored is None:
    raise ValueError(
      "the checkpoint holds a model, not a trainer: restore it into "
      "trainer.model, or save the trainer with save_checkpoint(directory, "
      "trainer)"
    )
  have = [leaf["path"] for leaf in stored]
  want = [leaf["path"] for leaf in target]
  if have != want:
    missing = [p for p in want if p not in have]
    extra = [p for p in have if p not in want]
    what = "trainer state: its leaves are in another order"
    if missing:
      what = f"trainer state {missing[0]}: not in the checkpoint"
    elif extra:
      what = f"trainer state {extra[0]} of the checkpoint is not in the trainer"
    raise ValueError(
      f"{what} (the optax optimizer, the loss-function state or the model "
      "differ)"
    )
  for kept, entry in zip(stored, target, strict=True):
    check_leaf(f"trainer state {entry['path']}", kept["leaf"], entry["leaf"])


def check(
  stored: Mapping[str, Any],
  target: Mapping[str, Any],
  cast_tables: bool = False,
) -> None:
  """Raises unless a stored manifest can be restored into the target.

  Layer and table names, table shapes, dtypes, optimizers and slots,
  variable labels, kinds, shapes, dtypes and axis names, and (for a
  trainer) the state's structure, shapes and dtypes must all match; the
  stacking and the topology may differ.

  Args:
    stored: The checkpoint's manifest.
    target: `describe(target).manifest`.
    cast_tables: Whether tables may differ in dtype (they are then cast).

  Raises:
    ValueError: Naming the first difference.
  """
  if stored.get("format") != FORMAT or stored.get("version") != VERSION:
    raise ValueError(
      f"not a pz_sparsecore checkpoint of version {VERSION} (format "
      f"{stored.get('format')!r}, version {stored.get('version')!r})"
    )
  _check_embeds(stored["embeds"], target["embeds"], cast_tables)
  _check_variables(stored["variables"], target["variables"])
  if target["trainer"] is not None:
    _check_trainer(stored["trainer"], target["trainer"])
