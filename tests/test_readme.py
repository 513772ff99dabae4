"""The README's minimal example and the getting-started guide run as shown
and give what they say."""

from __future__ import annotations

import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GETTING_STARTED = ROOT / "docs" / "getting_started.md"


def _example() -> str:
  text = README.read_text()
  section = text[text.index("## A minimal example") :]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_getting_started_runs_top_to_bottom():
  """Every Python block of the guide, in order, in one namespace."""
  blocks = re.findall(r"```python\n(.*?)```", GETTING_STARTED.read_text(), re.S)
  assert len(blocks) == 3
  namespace: dict = {}
  for block in blocks:
    exec(compile(block, str(GETTING_STARTED), "exec"), namespace)
  trainer, auxes = namespace["trainer"], namespace["auxes"]
  assert len(auxes) == len(namespace["data"]) == 60
  assert int(trainer.state.value.step) == 120
  losses = [float(a["loss"]) for a in auxes]
  # The second pass over the data (fit) learns the clicked rows.
  assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.1, losses


def test_minimal_example_runs_without_copying_the_table():
  namespace: dict = {}
  exec(compile(_example(), str(README), "exec"), namespace)
  acts, embed = namespace["acts"], namespace["embed"]
  assert dict(acts["history"].named_shape) == {"batch": 1024, "embedding": 32}
  # Activations on "data"; every device holds an eighth of the table.
  assert acts["history"].data_array.sharding.spec[0] == "data"
  table_array = embed.tables["items"].value.data_array
  assert len({s.device for s in table_array.addressable_shards}) == 8
  assert table_array.addressable_shards[0].data.nbytes * 8 == table_array.nbytes
  # The forward wrote nothing, so the table kept its buffer object.
  table = embed.tables["items"].value
  again = namespace["pzsc"].variable_jit(lambda e, x: e(x))(
    embed, namespace["inputs"]
  )
  assert embed.tables["items"].value is table
  np.testing.assert_array_equal(
    again["history"].unwrap("batch", "embedding"),
    acts["history"].unwrap("batch", "embedding"),
  )
  # Each row is the mean of its 20 ids' rows of the logical table.
  logical = namespace["pzsc"].logical_tables(embed)["items"]
  ids = namespace["ids"]
  np.testing.assert_allclose(
    acts["history"].unwrap("batch", "embedding")[:4],
    logical[ids[:4]].mean(axis=1),
    rtol=1e-5,
    atol=1e-7,
  )
