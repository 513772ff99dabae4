"""Executes every notebook in `notebooks/` top to bottom.

Each notebook runs in its own kernel (one test per notebook, so
`pytest -n 2` runs them in parallel). The kernel is this interpreter
(`sys.executable`): a kernelspec written to a temporary directory and put
first on `JUPYTER_PATH` overrides any `python3` kernelspec of the user or
the system, so the notebooks always import the package from this venv.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
KERNEL_NAME = "pz-sparsecore-test"
CELL_TIMEOUT_S = 300


def _kernelspec_dir(root: pathlib.Path) -> pathlib.Path:
  spec_dir = root / "kernels" / KERNEL_NAME
  spec_dir.mkdir(parents=True)
  spec = {
    "argv": [
      sys.executable,
      "-m",
      "ipykernel_launcher",
      "-f",
      "{connection_file}",
    ],
    "display_name": "pz_sparsecore (test)",
    "language": "python",
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  return root


def test_notebooks_found():
  assert [p.name for p in NOTEBOOKS] == [
    "from_jax_tpu_embedding.ipynb",
    "shakespeare.ipynb",
    "sharding_and_visualising.ipynb",
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
  assert "--xla_force_host_platform_device_count=8" in first
  assert first.index("XLA_FLAGS") < first.index("import jax")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: pathlib.Path, tmp_path, monkeypatch):
  monkeypatch.setenv("JUPYTER_PATH", str(_kernelspec_dir(tmp_path)))
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(
    nb,
    kernel_name=KERNEL_NAME,
    timeout=CELL_TIMEOUT_S,
    resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
  )
  client.execute()
  errors = [
    output
    for cell in nb.cells
    if cell.cell_type == "code"
    for output in cell.get("outputs", [])
    if output.get("output_type") == "error"
  ]
  assert not errors
