"""The notebooks in `notebooks/` are stored clean and start by setting up
virtual CPU devices (8; 4 for Penzai's transformer, whose steps wait on
every device's thread and slow down most when the cores are shared). They
are executed top to bottom by the documentation build
(`tests/test_docs.py`), which renders their outputs on the pages.
"""

from __future__ import annotations

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_notebooks_found():
  assert [p.name for p in NOTEBOOKS] == [
    "any_penzai_model.ipynb",
    "from_jax_tpu_embedding.ipynb",
    "shakespeare.ipynb",
    "sharding_and_visualising.ipynb",
    "training_to_serving.ipynb",
    "your_own_model.ipynb",
  ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean(path: pathlib.Path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  for cell in code:
    assert not cell.get("outputs"), f"{path.name}: clear the outputs"
    assert cell.get("execution_count") is None, f"{path.name}: clear counts"
  first = code[0].source
  count = 4 if path.stem == "any_penzai_model" else 8
  assert f"--xla_force_host_platform_device_count={count}" in first
  assert first.index("XLA_FLAGS") < first.index("import jax")
