"""The README's minimal example runs as shown and gives what it says."""

from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
  text = README.read_text()
  section = text[text.index("## A minimal example") :]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


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
