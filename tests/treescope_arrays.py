"""The arrays a Treescope HTML fragment draws, read back from it.

Treescope's `render_array` writes each array's drawing as JSON in the HTML
(Treescope 0.1, uncompressed): its values, valid mask, axes, colormap and
hover-label instructions. `drawn_arrays(html)` returns them in document
order; `values(array)` the values as `[*y axes, *x axes]` (each list
outermost first); `lookup_tables(array, kind)` the hover labels by value
(`"value_lookup"`) or by axis index (`"axis_lookup"`); `axis_labels(array)`
the hover labels of each labelled axis, by axis label.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np


def drawn_arrays(html: str) -> list[dict]:
  """The JSON of each array Treescope draws in `html`."""
  found = re.findall(
    r'<script type="application/json">(\{"info".*?)</script>', html, re.S
  )
  return [json.loads(text) for text in found]


def values(array: dict) -> np.ndarray:
  """An array's values, `[*y axes, *x axes]` (each list outermost first)."""
  flat = np.frombuffer(
    base64.b64decode(array["arrayBase64"]), array["arrayDtype"]
  )
  axes = [*array["yAxisSpecs"][::-1], *array["xAxisSpecs"][::-1]]
  shape = [a["end"] - a["start"] for a in axes]
  strides = [array["dataStrides"][a["name"]] * flat.itemsize for a in axes]
  return np.lib.stride_tricks.as_strided(flat, shape, strides)


def lookup_tables(array: dict, kind: str) -> list:
  """The lookup tables of the hover instructions of one kind."""
  return [
    step["lookup_table"]
    for step in array["valueFormattingInstructions"]
    if step["type"] == kind
  ]


def axis_item_labels(array: dict) -> dict[str, list[str]]:
  """Axis label -> the hover label of each index along that axis."""
  labels = {
    spec["name"]: spec["label"]
    for spec in [*array["xAxisSpecs"], *array["yAxisSpecs"]]
  }
  out = {}
  for step in array["valueFormattingInstructions"]:
    if step["type"] == "axis_lookup":
      table = step["lookup_table"]
      items = table if isinstance(table, list) else list(table.values())
      out[labels[step["axis"]]] = items
  return out
