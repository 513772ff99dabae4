"""Serving exports: what inference needs of a trained model, in any process.

`export(model, path, table_dtype=...)` writes a model with
`SparseCoreEmbed` / `SparseCoreLookup` layers (or a `SparseCoreTrainer`'s
model) for inference: every table's logical rows, the dense variables and
the layers' specs, without optimizer slots, optax state or the trainer.
`load_for_serving(path, model_like=None, mesh=...)` reads it, in a fresh
process if need be, onto any mesh (one device or many): the returned model
computes the trained model's forward and refuses to train.

Format. `path` is a folder::

  manifest.json   what every array is, the layers' specs, the CRC-32 of
                  every other file, and its own CRC-32 (`_ckpt_integrity.seal`)
  arrays/<k>.bin  one array each: its bytes in C order, little-endian
                  (dtype and shape in the manifest), nothing else
  structure.pkl   the model's structure, pickled (see Structure), if it
                  could be

The manifest holds, per layer (`"layers"`): its kind and name, the topology
it was trained on, its exchange, embedding axis, feature tree, feature
specs (table, input and output shapes, sample axes) and per table its
vocabulary, width, combiner, trained and activation dtypes, ids and
eviction, quantization config, preprocessing limits, placement and stack,
and the files of its rows; a lookup's own facts (label, embedding axes,
vocabulary axis, host input, window); per dense variable (`"variables"`,
by label): parameter or state, its axis names and its file.

Tables are stored by logical row (`pzsc.logical_tables`), so an export does
not depend on the topology or stacking it was trained with. A hashed
table stores the ids it holds (int64, ascending) and their rows
(`pzsc.hashed_rows`): all of its map a lookup needs. `table_dtype`:

* `"float32"`: the rows as the devices hold them, widened if 16-bit (exact).
* `"bfloat16"`: the rows rounded to the nearest bfloat16 (ties to even).
* `"int8"`: row-wise 8-bit quantisation, as FBGEMM's fused 8-bit rows: per
  row a float32 `scale = (max - min) / 255` and `bias = min`, and per
  element an unsigned byte `q = round((x - bias) / scale)` (to nearest,
  ties to even, in float64), read back as `q * scale + bias`. The error of
  an element is at most `scale / 2`, plus the rounding of the result to
  float32 (half an ulp of it); a constant row (`scale = 0`) is exact. A
  feature's activation is then off by at most the sum over its ids of
  `|gain| * scale / 2` of their rows. Example: the row `[-1.0, 0.003,
  0.5, 1.55]` has `scale = 0.01`, `bias = -1.0`, `q = [0, 100, 150, 255]`,
  and reads back as `[-1.0, 0.0, 0.5, 1.55]` (to within the float32
  rounding of the scale: `-2.2e-8` for 0.0): an error of 0.003 for
  0.003, under `scale / 2 = 0.005`.

Tables are looked up in float (`specs.TABLE_DTYPES` has no 8-bit storage,
and `QuantizationConfig` rounds values as they are read, it does not store
bytes): an int8 export is dequantised as it is loaded into float32 tables,
so it saves disk and transfer, not device memory. For a 1M x 64 table the
files hold 256,000,000 bytes of rows in float32, 128,000,000 in bfloat16
and 72,000,000 in int8 (64,000,000 of bytes, 8,000,000 of scales and
biases): 28% of float32 (measured, with the manifest: folders of
256,001,649, 128,001,650 and 72,002,038 bytes).

Structure. The model's layers are rebuilt from the manifest; the rest of
the model (its Penzai layers and how they call each other) comes from one
of two places:

* `model_like`: a model built like the exported one (e.g. by the same
  builder, with `init_base_rng=None`, on any mesh), or a trainer. Its
  SparseCore layers are replaced by the rebuilt ones and its variables
  (and frozen values) by the exported values, checked by label, kind and
  shape; its other constants are kept. Nothing is
  unpickled: the robust choice, and the only one for files one does not
  trust.
* `model_like=None`: the structure pickled at export time
  (`pz.unbind_variables` of the model with its SparseCore layers taken out:
  static configuration, variable slots and constants). Convenient, but
  pickle names the model's classes by module path (the code that defined
  them must import, in a compatible version) and runs code as it loads:
  load only exports you trust. Callables that are objects rather than
  functions (`jax.nn.relu` in a `pz.nn.Elementwise` is a `jax.custom_jvp`)
  are stored by their module and name. A model that does not pickle (e.g.
  a lambda in a layer) is exported without it, and needs `model_like`.

Serving model. Its layers are built on `mesh` (tables sharded over all its
axes, `num_sc_per_device` as trained unless given) with the trained
features, stacked as trained, and the trained limits where the devices x
SparseCores are the trained ones (then the stacks' rotations too, so a
lookup sums a sample's rows in the trained order), else limits no batch of
the declared shapes exceeds (`layout.worst_case_limits`). Their tables are
`pz.Parameter`s marked `trainable=False`, in float32 (bfloat16 for a
bfloat16 export); dense parameters are frozen constants
(`pz.ParameterValue`); state variables stay variables (a hashed table's map
counts unseen ids). Every table's optimizer is `ServingOptimizerSpec`, which
has no slots and refuses everything training asks of an optimizer with a
`ValueError` saying the model is a serving model: `SparseCoreTrainer.build`,
`split_tables` and `save_checkpoint` (which list the slots), the fused
update of `pzsc.value_and_grad`, `apply_gradients` or a trainer step (which
read the hyper-parameters), and inserting ids into a hashed table
(`resolve_ids(train=True)`, which resets slots). A lookup of a hashed table
never inserts: unseen ids read zeros and are counted.

A hashed table's ids are placed on the serving shards as a restore onto
another topology places them (`_ckpt_hashed.held_slots`): in ascending
(table, id) order, each in the first free slot of its window on its
owner; an id that finds none is refused with a `ValueError` (with windows
of 64 slots, only when a table is nearly full).

Integrity and atomicity. Every file's CRC-32 (`_ckpt_integrity.block_crc`)
and size are checked before anything is built: a damaged, truncated or
missing file is refused with an error naming it and what it holds. An
export is written into a temporary folder beside `path` (synced), renamed
to `path` when complete, replacing a previous export there; an export
killed before the rename leaves the previous export (or nothing) at
`path`, and its temporary folder, which `load_for_serving` names as
incomplete and the next export to `path` removes. A folder at `path`
without its manifest (written last) is refused as incomplete.

Exporting runs in one process (restore a multi-host model's checkpoint
onto one host to export it).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import importlib
import io
import json
import logging
import os
import pickle
import shutil
import types
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from penzai import pz

from pz_sparsecore.core import hashed, layout
from pz_sparsecore.core.specs import (
  FeatureSpec,
  OptimizerSpec,
  QuantizationConfig,
  TableSpec,
)
from pz_sparsecore.nn import embed as embed_lib
from pz_sparsecore.nn import lookup as lookup_lib
from pz_sparsecore.nn._ckpt_hashed import held_slots
from pz_sparsecore.nn._ckpt_integrity import CHECKSUM, block_crc, seal
from pz_sparsecore.nn.checkpoint import _sync, _sync_tree
from pz_sparsecore.nn.embed import MAP_PARTS, SparseCoreEmbed, find_embeds
from pz_sparsecore.nn.host import from_host
from pz_sparsecore.nn.lookup import SparseCoreLookup
from pz_sparsecore.nn.tables import HashedRows, logical_tables, named_table
from pz_sparsecore.nn.training import SparseCoreTrainer

__all__ = [
  "EXPORT_DTYPES",
  "ServingOptimizerSpec",
  "dequantize_rows",
  "export",
  "load_for_serving",
  "quantize_rows",
]

EXPORT_DTYPES = ("float32", "bfloat16", "int8")
"""How `export` stores table rows (`table_dtype`)."""

FORMAT = "pz_sparsecore.serving_export"
VERSION = 1
MANIFEST = "manifest.json"
STRUCTURE = "structure.pkl"
ARRAYS = "arrays"
_NAMES = frozenset({MANIFEST, STRUCTURE, ARRAYS})
"""Everything an export folder holds (another folder is never replaced)."""
_TEMPORARY = ".export-tmp-"
_REPLACED = ".export-old-"
_LEVELS = 255
"""The top of the 8-bit range: `q` in `[0, _LEVELS]`."""
_ROW_CHUNK = 1 << 16
"""Rows (de)quantised at a time (float64 temporaries of this many rows)."""
_LOG = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# The serving optimizer: none.


@dataclasses.dataclass(frozen=True)
class ServingOptimizerSpec(OptimizerSpec):
  """The optimizer of a serving model's tables: none.

  It has no slots (its registry entry is SGD's, which is never run), and
  each question training asks of an optimizer (its slots' names or
  initial values, its hyper-parameters) raises a `ValueError` saying the
  model is a serving model. Lookups never ask.

  Attributes:
    export: The export the model was loaded from (for the message).
  """

  kernel_name: ClassVar[str] = "sgd"
  learning_rate: float = 0.0
  export: str = ""

  def _refuse(self) -> None:
    raise ValueError(
      f"this is a serving model (loaded by pz_sparsecore.nn.export."
      f"load_for_serving from {self.export!r}): its tables have no "
      "optimizer, so it cannot be trained, updated, given new ids or "
      "checkpointed; train (or restore_checkpoint) the model it was "
      "exported from, and export it again"
    )

  def short_name(self) -> str:
    return "serving"

  def slot_names(self) -> tuple[str, ...]:
    self._refuse()

  def slot_variables_initializers(self) -> tuple[Any, ...]:
    self._refuse()

  def get_learning_rate(self, step: Any = None) -> jax.Array:
    del step
    self._refuse()

  def get_hyperparameters(
    self, step: Any = None, *, embedding_dim: int | None = None
  ) -> tuple[jax.Array, ...]:
    del step, embedding_dim
    self._refuse()


# ---------------------------------------------------------------------------
# Row-wise 8-bit quantisation.


def quantize_rows(
  rows: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Row-wise 8-bit quantisation of `[n, dim]` rows (module docstring).

  Args:
    rows: Finite values, `[n, dim]`.

  Returns:
    `(q, scale, bias)`: uint8 `[n, dim]`, float32 `[n]`, float32 `[n]`.

  Raises:
    ValueError: If a value is not finite.
  """
  rows = np.asarray(rows, np.float32)
  if not np.all(np.isfinite(rows)):
    raise ValueError("int8 rows must be finite")
  n = rows.shape[0]
  bias, top = rows.min(axis=1), rows.max(axis=1)
  scale = ((top.astype(np.float64) - bias) / _LEVELS).astype(np.float32)
  q = np.empty(rows.shape, np.uint8)
  for start in range(0, n, _ROW_CHUNK):
    part = slice(start, start + _ROW_CHUNK)
    step = scale[part, None].astype(np.float64)
    levels = (rows[part] - bias[part, None].astype(np.float64)) / np.where(
      step > 0, step, 1.0
    )
    q[part] = np.clip(np.rint(levels), 0, _LEVELS)
  return q, scale, bias


def dequantize_rows(
  q: np.ndarray, scale: np.ndarray, bias: np.ndarray
) -> np.ndarray:
  """`q * scale + bias` per row, computed in float64, as float32 `[n, dim]`.

  Args:
    q: uint8 `[n, dim]`.
    scale: float32 `[n]`.
    bias: float32 `[n]`.

  Returns:
    The rows.
  """
  out = np.empty(q.shape, np.float32)
  for start in range(0, q.shape[0], _ROW_CHUNK):
    part = slice(start, start + _ROW_CHUNK)
    out[part] = q[part] * scale[part, None].astype(np.float64) + bias[
      part, None
    ].astype(np.float64)
  return out


def _stored_rows(rows: np.ndarray, table_dtype: str) -> dict[str, np.ndarray]:
  """A table's rows as `table_dtype` stores them: name -> array."""
  rows = np.asarray(rows, np.float32)
  if table_dtype == "int8":
    q, scale, bias = quantize_rows(rows)
    return {"q": q, "scale": scale, "bias": bias}
  return {"rows": rows.astype(jnp.dtype(table_dtype))}


def _float_rows(parts: Mapping[str, np.ndarray]) -> np.ndarray:
  """The inverse of `_stored_rows`, in float32 (exact but for int8)."""
  if "q" in parts:
    return dequantize_rows(parts["q"], parts["scale"], parts["bias"])
  return np.asarray(parts["rows"], np.float32)


# ---------------------------------------------------------------------------
# Exporting: the manifest's entries.


class _Arrays:
  """The arrays an export writes: file name -> (array, what it holds)."""

  def __init__(self):
    self.items: dict[str, tuple[np.ndarray, str]] = {}

  def add(self, array: Any, what: str) -> str:
    name = f"{ARRAYS}/{len(self.items)}.bin"
    # `ascontiguousarray` makes a 0-d array 1-d: keep the shape.
    self.items[name] = (
      np.ascontiguousarray(array).reshape(np.shape(array)),
      what,
    )
    return name


def _tree_json(tree: Any) -> Any:
  """A feature tree of names as JSON (dicts, lists and tuples kept apart)."""
  if isinstance(tree, str):
    return tree
  if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
    return {"dict": {k: _tree_json(v) for k, v in tree.items()}}
  if isinstance(tree, (list, tuple)):
    kind = "list" if isinstance(tree, list) else "tuple"
    return {kind: [_tree_json(v) for v in tree]}
  raise ValueError(
    f"export: feature specs in a {type(tree).__name__} cannot be exported "
    "(use dicts with string keys, lists or tuples)"
  )


def _tree_of(data: Any) -> Any:
  """The inverse of `_tree_json`."""
  if isinstance(data, str):
    return data
  if "dict" in data:
    return {k: _tree_of(v) for k, v in data["dict"].items()}
  if "list" in data:
    return [_tree_of(v) for v in data["list"]]
  return tuple(_tree_of(v) for v in data["tuple"])


def _table_entry(config: Any, table: TableSpec) -> dict[str, Any]:
  """The facts of a prepared table a serving layer is rebuilt from."""
  stack = config.plan.stack_of_table[table.name].name
  quant = table.quantization_config
  return {
    "vocabulary_size": table.vocabulary_size,
    "embedding_dim": table.embedding_dim,
    "combiner": table.combiner,
    "dtype": jnp.dtype(table.dtype).name,
    "activation_dtype": jnp.dtype(table.activation_dtype).name,
    "ids": table.ids,
    "eviction": None
    if table.eviction is None
    else dataclasses.asdict(table.eviction),
    "quantization_config": None if quant is None else list(quant.as_tuple()),
    "limits": {
      "max_ids_per_partition": table.max_ids_per_partition,
      "max_unique_ids_per_partition": table.max_unique_ids_per_partition,
      "suggested_coo_buffer_size_per_device": (
        table.suggested_coo_buffer_size_per_device
      ),
    },
    "stack": stack,
    "placement": "replicated"
    if stack in config.topology.replicated
    else "sharded",
  }


def _table_files(
  embed: SparseCoreEmbed, arrays: _Arrays, table_dtype: str
) -> dict[str, dict[str, str]]:
  """Table name -> its stored arrays (name -> file), added to `arrays`."""
  out = {}
  layer = embed.config.name
  for name, value in logical_tables(embed).items():
    parts = {}
    rows = value
    if isinstance(value, HashedRows):
      parts["ids"] = np.asarray(value.ids, np.int64)
      rows = value.rows
    try:
      parts.update(_stored_rows(rows, table_dtype))
    except ValueError as e:
      raise ValueError(f"export: table {name!r} of {layer!r}: {e}") from None
    out[name] = {
      part: arrays.add(array, f"{part} of table {name!r} of layer {layer!r}")
      for part, array in parts.items()
    }
  return out


def _layer_entry(
  embed: SparseCoreEmbed, arrays: _Arrays, table_dtype: str
) -> dict[str, Any]:
  config = embed.config
  plan, topo = config.plan, config.topology
  files = _table_files(embed, arrays, table_dtype)
  entry = {
    "name": config.name,
    "kind": "lookup" if isinstance(embed, SparseCoreLookup) else "embed",
    "num_devices": topo.num_devices,
    "num_sc_per_device": topo.num_sc_per_device,
    "exchange": topo.exchange,
    "embedding_axis": config.embedding_axis,
    "tables": {
      name: {**_table_entry(config, table), "files": files[name]}
      for name, table in plan.tables.items()
    },
  }
  if isinstance(embed, SparseCoreLookup):
    entry["lookup"] = {
      "label": config.label,
      "vocab_size": config.vocab_size,
      "embedding_axes": [list(axis) for axis in config.embedding_axes],
      "vocabulary_axis": config.vocabulary_axis,
      "host_input": config.host_input,
      "max_ids_per_partition": config.max_ids_per_partition,
      "gather_max_samples": config.gather_max_samples,
    }
    return entry
  names = [spec.name for spec in plan.feature_specs]
  # Rotations (table k of a stack: k * rotation mod N) hold on this N only.
  entry["stacks"] = {
    stack.name: {
      "tables": [t.name for t in stack.tables],
      "rotation": stack.tables[1].setting_in_stack.shard_rotation
      if len(stack.tables) > 1
      else 0,
    }
    for stack in plan.stacks
  }
  entry["features"] = _tree_json(jax.tree.unflatten(plan.treedef, names))
  entry["feature_specs"] = [
    {
      "name": spec.name,
      "table": spec.table_spec.name,
      "input_shape": list(spec.input_shape),
      "output_shape": list(spec.output_shape),
      "axes": list(axes),
    }
    for spec, axes in zip(plan.feature_specs, config.feature_axes, strict=True)
  ]
  return entry


# ---------------------------------------------------------------------------
# Exporting: the dense variables and the structure.


@pz.pytree_dataclass
class _Exported(pz.Struct):
  """Where an exported SparseCore layer sits in the model's structure.

  Attributes:
    name: The layer's name.
  """

  name: str = dataclasses.field(metadata={"pytree_node": False})


def _value_entry(value: Any, arrays: _Arrays, what: str) -> dict[str, Any]:
  """A variable's value (an array or a `NamedArray`) as a manifest entry."""
  if isinstance(value, pz.nx.NamedArrayView):
    value = value.with_positional_prefix()
  if isinstance(value, pz.nx.NamedArray):
    return {
      "axes": [[k, int(v)] for k, v in value.named_axes.items()],
      "array": arrays.add(np.asarray(value.data_array), what),
    }
  if isinstance(value, (jax.Array, np.ndarray, float, int, np.generic)):
    return {"axes": None, "array": arrays.add(np.asarray(value), what)}
  raise ValueError(
    f"export: {what} holds a {type(value).__name__}; an export takes "
    "variables whose values are arrays or NamedArrays"
  )


def _json_metadata(metadata: Any) -> dict[str, Any]:
  """A variable's metadata, if JSON holds it (else none)."""
  try:
    return json.loads(json.dumps(metadata or {}))
  except (TypeError, ValueError):
    return {}


def _without_layers(model: Any) -> Any:
  """The model with its SparseCore layers as `_Exported` places and its
  frozen values (`pz.ParameterValue`, `pz.StateVariableValue`) as slots."""
  model = (
    pz.select(model)
    .at_instances_of(SparseCoreEmbed)
    .apply(lambda e: _Exported(name=e.config.name))
  )
  model = (
    pz.select(model)
    .at_instances_of(pz.ParameterValue)
    .apply(lambda v: pz.ParameterSlot(v.label))
  )
  return (
    pz.select(model)
    .at_instances_of(pz.StateVariableValue)
    .apply(lambda v: pz.StateVariableSlot(v.label))
  )


def _dense(model: Any, arrays: _Arrays) -> tuple[dict[str, Any], Any]:
  """Every variable and frozen value outside the SparseCore layers, as
  manifest entries by label, and the model's structure."""
  outside = (
    pz.select(model).at_instances_of(SparseCoreEmbed).set(_Exported(name=""))
  )
  found = (
    pz.select(outside)
    .at_instances_of(
      pz.Parameter
      | pz.StateVariable
      | pz.ParameterValue
      | pz.StateVariableValue
    )
    .get_sequence()
  )
  entries = {}
  for var in found:
    if var.label in entries:
      continue  # A variable shared by several layers.
    kind = (
      "parameter"
      if isinstance(var, pz.Parameter | pz.ParameterValue)
      else "state"
    )
    entries[var.label] = {
      "kind": kind,
      "value": _value_entry(var.value, arrays, f"variable {var.label!r}"),
      "metadata": _json_metadata(var.metadata),
    }
  structure, _ = pz.unbind_variables(_without_layers(model))
  return entries, structure


def _named_global(module: str, qualname: str) -> Any:
  """The object `module.qualname` (how `_Pickler` stores named callables)."""
  obj = importlib.import_module(module)
  for part in qualname.split("."):
    obj = getattr(obj, part)
  return obj


class _Pickler(pickle.Pickler):
  """A pickler that stores by name the callables that are objects rather
  than functions (`jax.custom_jvp` / `custom_vjp`: `jax.nn.relu`,
  `jax.nn.silu`, ... in `pz.nn.Elementwise`), when their module and
  qualified name give the same object back."""

  def reducer_override(self, obj: Any) -> Any:
    if isinstance(obj, type) or not callable(obj):
      return NotImplemented
    if isinstance(obj, types.FunctionType | types.BuiltinFunctionType):
      return NotImplemented
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
      return NotImplemented
    try:
      same = _named_global(module, qualname) is obj
    except (ImportError, AttributeError):
      return NotImplemented
    return (_named_global, (module, qualname)) if same else NotImplemented


def _pickled(structure: Any) -> tuple[bytes | None, str | None]:
  """The structure pickled (its arrays as numpy), or why it could not be."""
  host = jax.tree.map(
    lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, structure
  )
  out = io.BytesIO()
  try:
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(host)
  except (pickle.PicklingError, TypeError, AttributeError) as e:
    return None, f"{type(e).__name__}: {e}"
  return out.getvalue(), None


# ---------------------------------------------------------------------------
# Exporting: files.


def _write_file(path: str, data: Any) -> dict[str, Any]:
  """Writes bytes (an array's, in C order); returns its manifest entry."""
  array = np.ascontiguousarray(data)
  raw = array.reshape(-1).view(np.uint8)
  with open(path, "wb") as f:
    f.write(memoryview(raw))
  return {"bytes": int(raw.size), "crc32": block_crc(raw)}


def _check_target(path: str) -> None:
  """Raises unless `path` is absent, empty, or an export (or what is left
  of one): `export` never replaces another folder."""
  if not os.path.lexists(path):
    return
  if not os.path.isdir(path) or os.path.islink(path):
    raise FileExistsError(f"export: {path} exists and is not a folder")
  unknown = sorted(set(os.listdir(path)) - _NAMES)
  if unknown:
    raise FileExistsError(
      f"export: {path} exists and is not an export (it holds {unknown[:3]});"
      " export to a new folder"
    )


def _remove_interrupted(path: str) -> None:
  """Removes the temporary folders of exports to `path` that never
  finished, and a replaced export whose removal was interrupted."""
  for pattern in (_TEMPORARY, _REPLACED):
    for stale in glob.glob(glob.escape(path) + pattern + "*"):
      shutil.rmtree(stale, ignore_errors=True)


def _write(
  path: str,
  arrays: _Arrays,
  manifest: dict[str, Any],
  structure: bytes | None,
) -> None:
  """Writes the export into a temporary folder and renames it to `path`
  (one export to a path at a time: another's temporary folder is removed
  as an interrupted one)."""
  _check_target(path)
  parent = os.path.dirname(path)
  os.makedirs(parent, exist_ok=True)
  _remove_interrupted(path)
  temporary = path + _TEMPORARY + uuid.uuid4().hex[:12]
  try:
    _write_temporary(temporary, arrays, manifest, structure)
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise
  replaced = None
  if os.path.lexists(path):
    replaced = path + _REPLACED + uuid.uuid4().hex[:12]
    os.rename(path, replaced)
  os.rename(temporary, path)
  _sync(parent)
  if replaced is not None:
    shutil.rmtree(replaced, ignore_errors=True)


def _write_temporary(
  temporary: str,
  arrays: _Arrays,
  manifest: dict[str, Any],
  structure: bytes | None,
) -> None:
  """Writes a complete export into `temporary`, synced, manifest last."""
  os.makedirs(os.path.join(temporary, ARRAYS))
  files = {}
  for name, (array, what) in arrays.items.items():
    files[name] = {
      **_write_file(os.path.join(temporary, name), array),
      "dtype": array.dtype.name,
      "shape": list(array.shape),
      "what": what,
    }
  if structure is not None:
    files[STRUCTURE] = {
      **_write_file(
        os.path.join(temporary, STRUCTURE), np.frombuffer(structure, np.uint8)
      ),
      "dtype": "uint8",
      "shape": [len(structure)],
      "what": "the model's structure",
    }
  manifest = seal({**manifest, "files": files})
  # The manifest last: a folder without it is never a complete export.
  with open(os.path.join(temporary, MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)
  _sync_tree(temporary)


def export(
  model: Any, path: str | os.PathLike, *, table_dtype: str = "float32"
) -> str:
  """Writes what inference needs of `model` to the folder `path`.

  The export holds every table's logical rows (a hashed table's held ids
  and rows) in `table_dtype`, the dense variables (parameters, frozen
  values and state variables outside the SparseCore layers), the layers'
  specs and the model's structure; no optimizer slot, optax state or
  trainer state. The module docstring describes the format. An export
  already at `path` is replaced once the new one is complete.

  Args:
    model: A Penzai model with `SparseCoreEmbed` / `SparseCoreLookup`
      layers (variables bound), or a `SparseCoreTrainer` (its model).
    path: The export's folder: absent, empty, or an earlier export.
    table_dtype: `"float32"`, `"bfloat16"` or `"int8"` (`EXPORT_DTYPES`).

  Returns:
    The absolute path of the export.

  Raises:
    ValueError: On a bad `table_dtype`, several processes, a non-finite
      row of an int8 table, a variable whose value is not an array or a
      `NamedArray`, or feature specs not in dicts, lists or tuples.
    FileExistsError: If `path` exists and is not an export.
  """
  if table_dtype not in EXPORT_DTYPES:
    raise ValueError(
      f"export: table_dtype must be one of {EXPORT_DTYPES}, got {table_dtype!r}"
    )
  if jax.process_count() > 1:
    raise ValueError(
      "export runs in one process: restore the model's checkpoint onto one "
      "host and export it there"
    )
  if isinstance(model, SparseCoreTrainer):
    model = model.model
  path = os.path.abspath(os.fspath(path))
  arrays = _Arrays()
  layers = {}
  for embed in find_embeds(model):
    if embed.config.name not in layers:
      layers[embed.config.name] = _layer_entry(embed, arrays, table_dtype)
  variables, structure = _dense(model, arrays)
  pickled, reason = _pickled(structure)
  if pickled is None:
    _LOG.warning(
      "export %s: the model's structure does not pickle (%s); "
      "load_for_serving will need model_like",
      path,
      reason,
    )
  manifest = {
    "format": FORMAT,
    "version": VERSION,
    "table_dtype": table_dtype,
    "layers": list(layers.values()),
    "variables": variables,
    "structure": None if pickled is None else STRUCTURE,
    "structure_error": reason,
  }
  _write(path, arrays, manifest, pickled)
  return path


# ---------------------------------------------------------------------------
# Loading: the files.


def _read_manifest(path: str) -> dict[str, Any]:
  """The verified manifest of the export at `path`."""
  if not os.path.isdir(path):
    interrupted = sorted(glob.glob(glob.escape(path) + _TEMPORARY + "*"))
    hint = (
      f"; {interrupted[0]} is an incomplete export, interrupted before it "
      "was complete: export again"
      if interrupted
      else ""
    )
    raise FileNotFoundError(f"no export at {path}{hint}")
  file = os.path.join(path, MANIFEST)
  if not os.path.isfile(file):
    raise ValueError(
      f"{path}: incomplete export: its manifest {file} is missing (an "
      "export writes it last); export again"
    )
  try:
    with open(file) as f:
      stored = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(
      f"{path}: the manifest {file} is damaged (not JSON: {e})"
    ) from None
  if not isinstance(stored, dict) or CHECKSUM not in stored:
    raise ValueError(f"{path}: the manifest {file} is damaged (no checksum)")
  body = {k: v for k, v in stored.items() if k != CHECKSUM}
  if stored[CHECKSUM] != seal(body)[CHECKSUM]:
    raise ValueError(f"{path}: the manifest {file} is damaged (checksum)")
  if body.get("format") != FORMAT:
    raise ValueError(f"{path}: {file} is not the manifest of a serving export")
  if body["version"] != VERSION:
    raise ValueError(
      f"{path}: export format version {body['version']}, this library reads "
      f"version {VERSION}"
    )
  return body


def _read_files(path: str, manifest: Mapping[str, Any]) -> dict[str, Any]:
  """Every file of the export, checked (size and CRC-32): name -> array."""
  out = {}
  for name, entry in manifest["files"].items():
    file = os.path.join(path, name)
    what = entry["what"]
    if not os.path.isfile(file):
      raise FileNotFoundError(f"{path}: {what}: missing file {file}")
    raw = np.fromfile(file, np.uint8)
    if raw.size != entry["bytes"]:
      raise ValueError(
        f"{path}: {what}: truncated or extended file {file} ({raw.size} "
        f"bytes, {entry['bytes']} expected)"
      )
    if block_crc(raw) != entry["crc32"]:
      raise ValueError(
        f"{path}: {what}: damaged data (checksum mismatch) in {file}"
      )
    out[name] = raw.view(jnp.dtype(entry["dtype"])).reshape(entry["shape"])
  return out


# ---------------------------------------------------------------------------
# Loading: the SparseCore layers.


def _zeros(key, shape, dtype=jnp.float32):
  """The rebuilt specs' initializer (a serving table draws no row)."""
  del key
  return jnp.zeros(shape, dtype)


def _table_spec(
  name: str,
  entry: Mapping[str, Any],
  optimizer: OptimizerSpec,
  dtype: str,
  keep_limits: bool,
) -> TableSpec:
  """A table's unprepared spec for the serving layer."""
  quant = entry["quantization_config"]
  limits = {k: v for k, v in entry["limits"].items() if keep_limits}
  return TableSpec(
    name=name,
    vocabulary_size=entry["vocabulary_size"],
    embedding_dim=entry["embedding_dim"],
    initializer=_zeros,
    optimizer=optimizer,
    combiner=entry["combiner"],
    quantization_config=None
    if quant is None
    else QuantizationConfig(
      min_value=quant[0], max_value=quant[1], num_buckets=quant[2]
    ),
    dtype=dtype,
    activation_dtype=entry["activation_dtype"],
    ids=entry["ids"],
    eviction=None
    if entry["eviction"] is None
    else hashed.Eviction(**entry["eviction"]),
    **limits,
  )


def _embed_config(
  entry: Mapping[str, Any],
  topology: Any,
  optimizer: OptimizerSpec,
  dtype: str,
  same: bool,
) -> Any:
  """A `SparseCoreEmbed`'s config on the serving topology."""
  tables = {
    name: _table_spec(name, t, optimizer, dtype, same)
    for name, t in entry["tables"].items()
  }
  features = {
    f["name"]: FeatureSpec(
      name=f["name"],
      table_spec=tables[f["table"]],
      input_shape=f["input_shape"],
      output_shape=f["output_shape"],
    )
    for f in entry["feature_specs"]
  }
  tree = jax.tree.map(features.get, _tree_of(entry["features"]))
  g, s = topology.num_devices, topology.num_sc_per_device
  if not same:
    tree = layout.worst_case_limits(tree, g, s)
  # Stacked as trained (on the trained topology, rotated alike too): the
  # same lookups sum a sample's rows in the same order.
  for name, stack in entry["stacks"].items():
    if len(stack["tables"]) > 1:
      tree = layout.stack_tables(
        tree,
        stack["tables"],
        g,
        s,
        rotation=stack["rotation"] if same else None,
        stack_to_max_ids_per_partition=layout.keep_table_limits,
        stack_to_max_unique_ids_per_partition=layout.keep_table_limits,
        stack_name=name,
      )
  return embed_lib.make_config(
    entry["name"],
    tree,
    topology,
    {f["name"]: tuple(f["axes"]) for f in entry["feature_specs"]},
    entry["embedding_axis"],
    None,
    stacking=None,
    limits="specs",
    placement={name: t["placement"] for name, t in entry["tables"].items()},
  )


def _lookup_config(
  entry: Mapping[str, Any],
  mesh: Mesh,
  num_sc: int,
  optimizer: OptimizerSpec,
  dtype: str,
  same: bool,
) -> Any:
  """A `SparseCoreLookup`'s config on the serving topology."""
  facts = entry["lookup"]
  (table,) = entry["tables"].values()
  return lookup_lib._make_lookup_config(
    facts["label"],
    facts["vocab_size"],
    dict(facts["embedding_axes"]),
    mesh,
    optimizer,
    initializer=_zeros,
    vocabulary_axis=facts["vocabulary_axis"],
    num_sc_per_device=num_sc,
    sharding_axis=None,
    exchange=entry["exchange"],
    axis_name_to_mesh_name=None,
    host_input=facts["host_input"],
    max_ids_per_partition=facts["max_ids_per_partition"] if same else None,
    dtypes=(dtype, table["activation_dtype"]),
    ids=table["ids"],
    eviction=None
    if table["eviction"] is None
    else hashed.Eviction(**table["eviction"]),
    gather_max_samples=facts.get("gather_max_samples"),
  )


def _range_stacks(
  config: Any, rows: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
  """The stacks of tables of ids in a range, positional `[N, V_shard, D]`
  in the stack's dtype (padding rows zero)."""
  plan = config.plan
  specs = [s for s in plan.feature_specs if not s.table_spec.is_hashed]
  if not specs:
    return {}
  stacked = layout.stack_and_shard_tables(
    specs,
    {s.table_spec.name: rows[s.table_spec.name] for s in specs},
    plan.num_shards,
    pad_value=0.0,
  )
  return {
    name: value.astype(plan.stack(name).dtype)
    for name, value in stacked.items()
  }


def _hashed_stack(
  config: Any, stack: Any, held: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """A hashed stack's table and map (ids, seen, counters) with each held id
  in the first free slot of its window on its owner (module docstring)."""
  n = config.plan.num_shards
  ids = [np.asarray(held[t.name][0], np.int64) for t in stack.tables]
  rows = [held[t.name][1] for t in stack.tables]
  member = np.concatenate(
    [np.full(len(x), i, np.int64) for i, x in enumerate(ids)]
  )
  raw = np.concatenate(ids)
  values = np.concatenate([r.reshape(-1, r.shape[-1]) for r in rows])
  owner, slot = held_slots(stack, n, member, raw)
  if (slot < 0).any():
    table = stack.tables[int(member[slot < 0][0])].name
    raise ValueError(
      f"hashed table {table!r}: {int((slot < 0).sum())} held ids find no "
      f"free slot in their windows on {n} shards; load onto the shard "
      "count it was trained on"
    )
  table = np.zeros((n, stack.rows_per_shard, stack.dim), np.float32)
  table[owner, slot, : values.shape[1]] = values
  words = np.zeros((n, stack.rows_per_shard, 2), np.int32)
  words[owner, slot] = np.stack(hashed.key_words(raw), -1)
  seen = np.zeros((n, stack.rows_per_shard, 2), np.int32)
  seen[..., 0] = hashed.EMPTY
  seen[owner, slot] = (0, 1)  # Held, last seen at step 0, once.
  counters = np.zeros((n, len(hashed.COUNTERS)), np.int32)
  np.add.at(counters[:, hashed.COUNTERS.index("held")], owner, 1)
  parts = {"ids": words, "seen": seen, "counters": counters}
  return table.astype(stack.dtype), parts


def _layer(
  entry: Mapping[str, Any],
  files: Mapping[str, np.ndarray],
  mesh: Mesh,
  num_sc: int | None,
  dtype: str,
  export_path: str,
) -> SparseCoreEmbed:
  """A serving layer on `mesh` from its manifest entry and files."""
  num_sc = num_sc or entry["num_sc_per_device"]
  topology = embed_lib.make_topology(
    mesh, None, num_sc, entry["exchange"], None
  )
  same = (topology.num_devices, num_sc) == (
    entry["num_devices"],
    entry["num_sc_per_device"],
  )
  optimizer = ServingOptimizerSpec(export=export_path)
  if entry["kind"] == "lookup":
    config = _lookup_config(entry, mesh, num_sc, optimizer, dtype, same)
  else:
    config = _embed_config(entry, topology, optimizer, dtype, same)
  topo = config.topology
  rows, held = {}, {}
  for name, table in entry["tables"].items():
    parts = {part: files[file] for part, file in table["files"].items()}
    values = _float_rows(parts)
    if "ids" in parts:
      held[name] = (parts["ids"], values)
    else:
      rows[name] = values
  stacks = _range_stacks(config, rows)
  maps = {}
  for stack in config.plan.stacks:
    if not stack.is_hashed:
      continue
    stacks[stack.name], parts = _hashed_stack(config, stack, held)
    placed = {p: from_host(v, topo.sharding(v.ndim)) for p, v in parts.items()}
    # The key of new rows: training draws them, serving never does.
    placed["seed"] = jax.device_put(
      np.zeros(2, np.uint32), NamedSharding(topo.mesh, P())
    )
    maps[stack.name] = {
      p: pz.StateVariable(
        value=placed[p], label=config.map_label(stack.name, p)
      )
      for p in MAP_PARTS
    }
  tables = {
    stack.name: pz.Parameter(
      value=named_table(
        config,
        from_host(stacks[stack.name], topo.table_sharding(stack.name)),
      ),
      label=config.table_label(stack.name),
      metadata={"trainable": False},
    )
    for stack in config.plan.stacks
  }
  kind = SparseCoreLookup if entry["kind"] == "lookup" else SparseCoreEmbed
  return kind(
    tables=tables,
    slots={stack.name: {} for stack in config.plan.stacks},
    config=config,
    maps=maps,
  )


# ---------------------------------------------------------------------------
# Loading: the structure and the dense variables.


def _value(
  entry: Mapping[str, Any], files: Mapping[str, np.ndarray], mesh: Mesh
) -> Any:
  """A dense variable's value, replicated on `mesh`."""
  array = jax.device_put(files[entry["array"]], NamedSharding(mesh, P()))
  if entry["axes"] is None:
    return array
  return pz.nx.NamedArray(
    named_axes=collections.OrderedDict(
      (name, size) for name, size in entry["axes"]
    ),
    data_array=array,
  )


def _slots_of(structure: Any) -> dict[str, str]:
  """Label -> "parameter" or "state" for every variable slot."""
  slots = (
    pz.select(structure)
    .at_instances_of(pz.ParameterSlot | pz.StateVariableSlot)
    .get_sequence()
  )
  return {
    s.label: "parameter" if isinstance(s, pz.ParameterSlot) else "state"
    for s in slots
  }


def _check_structure(
  path: str, structure: Any, manifest: Mapping[str, Any]
) -> None:
  """Raises unless the structure's slots and layers are the export's."""
  slots = _slots_of(structure)
  stored = {k: v["kind"] for k, v in manifest["variables"].items()}
  if slots != stored:
    missing = sorted(set(stored) - set(slots))
    unknown = sorted(set(slots) - set(stored))
    other = sorted(k for k in set(slots) & set(stored) if slots[k] != stored[k])
    raise ValueError(
      f"{path}: the model's variables are not the export's: the model lacks "
      f"{missing}, has {unknown} the export lacks, and {other} differ in "
      "kind (parameter or state)"
    )
  places = {
    p.name
    for p in pz.select(structure).at_instances_of(_Exported).get_sequence()
  }
  exported = {entry["name"] for entry in manifest["layers"]}
  if places != exported:
    raise ValueError(
      f"{path}: the model's SparseCore layers {sorted(places)} are not the "
      f"export's {sorted(exported)}"
    )


def _check_bound(
  path: str,
  variables: list[Any],
  manifest: Mapping[str, Any],
  files: Mapping[str, np.ndarray],
) -> None:
  """Raises if a bound variable of `model_like` has another shape or other
  axes than the exported value."""
  for var in variables:
    entry = manifest["variables"][var.label]["value"]
    value = var.value
    if isinstance(value, pz.nx.NamedArrayView):
      value = value.with_positional_prefix()
    named = isinstance(value, pz.nx.NamedArray)
    got = (
      (dict(value.named_axes), value.positional_shape)
      if named
      else (None, tuple(np.shape(value)))
    )
    array = files[entry["array"]]
    if entry["axes"] is None:
      want = (None, tuple(array.shape))
    else:
      axes = dict((k, v) for k, v in entry["axes"])
      want = (axes, tuple(array.shape[: array.ndim - len(axes)]))
    if got != want:
      raise ValueError(
        f"{path}: variable {var.label!r}: the export holds axes {want[0]} "
        f"and positional shape {want[1]}, the model {got[0]} and {got[1]}"
      )


def _structure(
  path: str,
  manifest: Mapping[str, Any],
  files: Mapping[str, np.ndarray],
  model_like: Any,
) -> Any:
  """The model's structure: `model_like`'s, or the pickled one."""
  if model_like is None:
    if manifest["structure"] is None:
      raise ValueError(
        f"{path}: the model's structure was not exported (it did not "
        f"pickle: {manifest['structure_error']}); pass model_like, a model "
        "built like the exported one"
      )
    structure = pickle.loads(files[manifest["structure"]].tobytes())
    structure = jax.tree.map(
      lambda x: jnp.asarray(x) if isinstance(x, np.ndarray) else x, structure
    )
  else:
    if isinstance(model_like, SparseCoreTrainer):
      model_like = model_like.model
    structure, variables = pz.unbind_variables(_without_layers(model_like))
    _check_bound(path, variables, manifest, files)
  _check_structure(path, structure, manifest)
  return structure


def _filled(
  structure: Any,
  manifest: Mapping[str, Any],
  files: Mapping[str, np.ndarray],
  mesh: Mesh,
) -> Any:
  """The structure with its parameters as constants and its state
  variables bound, from the exported values."""

  def fill(slot):
    entry = manifest["variables"][slot.label]
    value = _value(entry["value"], files, mesh)
    if entry["kind"] == "parameter":
      return pz.ParameterValue(
        value=value, label=slot.label, metadata=entry["metadata"]
      )
    return pz.StateVariable(
      value=value, label=slot.label, metadata=entry["metadata"]
    )

  return (
    pz.select(structure)
    .at_instances_of(pz.ParameterSlot | pz.StateVariableSlot)
    .apply(fill)
  )


def load_for_serving(
  path: str | os.PathLike,
  model_like: Any = None,
  *,
  mesh: Mesh,
  num_sc_per_device: int | None = None,
) -> Any:
  """Loads an export onto `mesh` as a model for inference.

  Every file is checked before anything is built. The SparseCore layers
  are rebuilt on `mesh` (module docstring: limits, dtypes, hashed ids);
  the rest of the model comes from `model_like` or, without it, from the
  structure pickled at export time (only for exports you trust: pickle
  runs code). The model's forward is the trained model's: bit for bit from
  a float32 export on the trained topology (on another, lookups may sum a
  sample's rows in another order, and dense layers that run on another
  batch per device may round their last bits differently); from a
  bfloat16 export, that of the trained tables rounded to bfloat16; from an
  int8 export, within the bound of the module docstring.

  Args:
    path: A folder written by `export`.
    model_like: None, or a model (or trainer) built like the exported one,
      on any mesh, with variables bound or not: its structure is used and
      its variables' labels, kinds and (if bound) shapes are checked.
    mesh: The `jax.sharding.Mesh` (Auto axes) the model is served on; its
      tables are sharded over all its axes, dense values replicated.
    num_sc_per_device: Virtual SparseCores per device; None: as trained.

  Returns:
    The serving model. Its tables' optimizer is `ServingOptimizerSpec`:
    training it raises a `ValueError`.

  Raises:
    FileNotFoundError: If there is no export at `path` (naming an
      interrupted one found beside it), or a file is missing.
    ValueError: If the export is incomplete (no manifest) or damaged
      (naming the file and what it holds), `model_like` does not match
      it, or a hashed table's ids do not fit on `mesh`'s shards.
  """
  path = os.path.abspath(os.fspath(path))
  manifest = _read_manifest(path)
  files = _read_files(path, manifest)
  structure = _structure(path, manifest, files, model_like)
  dtype = "bfloat16" if manifest["table_dtype"] == "bfloat16" else "float32"
  layers = {
    entry["name"]: _layer(entry, files, mesh, num_sc_per_device, dtype, path)
    for entry in manifest["layers"]
  }
  model = _filled(structure, manifest, files, mesh)
  return (
    pz.select(model)
    .at_instances_of(_Exported)
    .apply(lambda place: layers[place.name])
  )
