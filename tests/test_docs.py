"""Builds the documentation (Sphinx, warnings are errors) in a fresh tree."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("furo")

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def test_docs_build(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-W",
      "--keep-going",
      "-b",
      "html",
      "-q",
      str(DOCS),
      str(tmp_path / "html"),
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=300,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  for page in ("index", "concepts", "api/nn", "notebooks/shakespeare"):
    assert (tmp_path / "html" / f"{page}.html").exists(), page
