"""A training step updates the tables in place: nothing table-sized runs.

For every optimizer, with and without `check_finite`, on one device and on
a mesh: the table keeps its buffers across a step, and the compiled step
has no table-sized operation besides the parameters, the fused update's
custom call, the O(batch) in-place scatter that takes back a refused update,
and tuples or bitcasts of them; nor a table-sized temporary buffer.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import user_compile
from jax.sharding import Mesh
from penzai import pz

import pz_sparsecore as pzsc

VOCAB, DIM, BATCH = 2**18 + 8, 16, 64

OPTIMIZERS = {
  "sgd": pzsc.SGDOptimizerSpec(learning_rate=0.1),
  "adagrad": pzsc.AdagradOptimizerSpec(learning_rate=0.1),
  "adagrad_momentum": pzsc.AdagradMomentumOptimizerSpec(learning_rate=0.1),
  "adam": pzsc.AdamOptimizerSpec(learning_rate=0.1),
  "ftrl": pzsc.FTRLOptimizerSpec(learning_rate=0.1),
}

# Opcodes that may carry a table-sized array without touching every row:
# the buffers themselves, the fused update, and the O(batch) scatter that
# writes back the rows of a refused update (in place: a copy would show up).
_PASS_THROUGH = {
  "parameter",
  "custom-call",
  "get-tuple-element",
  "tuple",
  "bitcast",
  "opt-barrier",
  "scatter",
}
_INSTRUCTION = re.compile(r"(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\(")
_SHAPE = re.compile(r"\b(?:f32|f64|bf16|s32|u32|pred)\[([0-9,]*)\]")


@pz.pytree_dataclass
class _Model(pz.nn.Layer):
  embed: pzsc.SparseCoreEmbed
  head: pz.nn.Linear

  def __call__(self, inputs, **side):
    return self.head(self.embed(inputs)["f"])


def _loss_fn(*, model, state, rng, inputs, labels):
  del rng
  logits = model(inputs).unwrap("batch", "out")[:, 0]
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, labels))
  return loss, state, {"loss": loss}


def _trainer(devices, sc, optimizer, check_finite):
  table = pzsc.TableSpec(
    name="t",
    vocabulary_size=VOCAB,
    embedding_dim=DIM,
    initializer=jax.nn.initializers.normal(),
    optimizer=OPTIMIZERS[optimizer],
    combiner="sum",
  )
  features = {
    "f": pzsc.FeatureSpec(
      name="f",
      table_spec=table,
      input_shape=(BATCH, 4),
      output_shape=(BATCH, DIM),
    )
  }
  mesh = Mesh(np.array(jax.devices()[:devices]), ("device",))
  embed = pzsc.SparseCoreEmbed.from_config(
    "emb", jax.random.key(0), features, mesh, num_sc_per_device=sc
  )
  head = pz.nn.Linear.from_config(
    "head", jax.random.key(1), {"embedding": DIM}, {"out": 1}
  )
  trainer = pzsc.SparseCoreTrainer.build(
    jax.random.key(2),
    _Model(embed=embed, head=head),
    optax.sgd(0.1),
    _loss_fn,
    check_finite=check_finite,
  )
  ids = np.random.default_rng(0).integers(0, VOCAB, (BATCH, 4))
  inputs, _ = embed.preprocess({"f": ids})
  return trainer, {"inputs": inputs, "labels": jnp.zeros(BATCH)}


def _buffers(trainer):
  arrays = [trainer.model.embed.tables["t"].value.data_array]
  arrays += [
    v.value.data_array for v in trainer.model.embed.slots["t"].values()
  ]
  return [
    [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]
    for a in arrays
  ]


def _fused_roots(hlo: str) -> dict[str, str]:
  """Fused computation name → opcode of its root."""
  roots, current = {}, None
  for line in hlo.splitlines():
    header = re.match(r"\s*%?([\w.\-]+) .*\{\s*$", line)
    if header and "=" not in line.split("{")[0]:
      current = header.group(1)
    match = _INSTRUCTION.match(line.strip())
    if current and match and line.strip().startswith("ROOT"):
      roots[current] = match.group(3)
  return roots


def _table_sized(hlo: str, elements: int) -> list[str]:
  """Entry instructions with a table-sized array that may touch every row."""
  roots = _fused_roots(hlo)
  entry = hlo[hlo.index("ENTRY") :]
  offenders = []
  for line in entry.splitlines():
    match = _INSTRUCTION.match(line.strip())
    if not match:
      continue
    _, shapes, opcode = match.groups()
    sizes = [
      int(np.prod([int(d) for d in dims.split(",") if d]))
      for dims in _SHAPE.findall(shapes)
    ]
    if not any(size >= elements for size in sizes):
      continue
    if opcode in _PASS_THROUGH:
      continue
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if (
      opcode == "fusion"
      and called
      and roots.get(called.group(1))
      in (
        "scatter",
        "dynamic-update-slice",
      )
    ):
      continue
    offenders.append(line.strip()[:240])
  return offenders


@functools.cache
def _stepped(devices, sc, optimizer, check_finite):
  """One step (donating); buffer pointers before/after; the compiled step."""
  trainer, kwargs = _trainer(devices, sc, optimizer, check_finite)
  captured = {}
  step_fn = trainer.step_fn

  def capture(*args, **kw):
    captured["args"], captured["kwargs"] = args, kw
    return step_fn(*args, **kw)

  object.__setattr__(trainer, "step_fn", capture)
  before = _buffers(trainer)
  trainer.step(**kwargs)
  after = _buffers(trainer)
  compiled = step_fn.lower(*captured["args"], **captured["kwargs"]).compile(
    user_compile.OPTIONS
  )
  value = trainer.model.embed.tables["t"].value.data_array
  shard_elements = value.size // devices
  return before, after, compiled, shard_elements


CASES = [
  *((4, 2, name, check) for name in OPTIMIZERS for check in (False, True)),
  (1, 4, "sgd", False),
  (1, 4, "adam", True),
]


@pytest.mark.parametrize("devices, sc, optimizer, check_finite", CASES)
def test_train_step_touches_no_table_sized_data(
  devices, sc, optimizer, check_finite
):
  before, after, compiled, elements = _stepped(
    devices, sc, optimizer, check_finite
  )
  assert before == after, "the table or a slot moved to a new buffer"
  hlo = compiled.as_text()
  offenders = _table_sized(hlo, elements)
  assert not offenders, "table-sized operations:\n" + "\n".join(offenders)
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < elements * 4, f"{temp} bytes of temporaries per device"


def test_the_check_sees_a_table_sized_operation():
  """The detector itself: a step that reads the whole table is caught."""

  def scaled(table):
    return table * 2.0

  table = jnp.zeros((VOCAB, DIM))
  hlo = jax.jit(scaled).lower(table).compile(user_compile.OPTIONS).as_text()
  assert _table_sized(hlo, VOCAB * DIM)


def test_the_steps_finite_flags_ride_the_gradients_all_reduce():
  """The labels' finite flag (a sharded input), the loss and the dense
  gradients cross the devices in one all-reduce: a flag of its own would
  be another collective every step."""
  _, _, compiled, _ = _stepped(4, 2, "sgd", False)
  reduces = [
    line.strip()[:200]
    for line in compiled.as_text().splitlines()
    if re.search(r" all-reduce(-start)?\(", line)
  ]
  assert len(reduces) == 1, "\n".join(reduces)
