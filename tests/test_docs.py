"""Builds the documentation as a reader gets it: Sphinx (warnings are
errors) executing every notebook, then each notebook page in headless
Chromium.

The build runs every notebook top to bottom (a cell error fails it) in a
kernel of this interpreter, and renders the outputs on the pages. Each
notebook page must then show every Treescope figure drawn, with no
JavaScript error in the console, and fit a 1280-px window without
scrolling sideways; each notebook must have run in under 2 minutes (the
execution table on the notebooks page).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import chromium
import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("furo")

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
NOTEBOOKS = sorted(p.stem for p in (DOCS / "notebooks").glob("*.ipynb"))


def _kernelspec(root: pathlib.Path) -> pathlib.Path:
  """A `python3` kernelspec of this interpreter under `root` (put first on
  JUPYTER_PATH, it overrides the user's and the system's)."""
  spec_dir = root / "kernels" / "python3"
  spec_dir.mkdir(parents=True)
  spec = {
    "argv": [
      sys.executable,
      "-m",
      "ipykernel_launcher",
      "-f",
      "{connection_file}",
    ],
    "display_name": "Python 3",
    "language": "python",
  }
  (spec_dir / "kernel.json").write_text(json.dumps(spec))
  return root


# Session-scoped: the docs group's tests share one worker, but other
# modules' tests may run between them there, and a module-scoped fixture
# would be built again (minutes) after each such interleaving.
@pytest.fixture(scope="session")
def built(tmp_path_factory) -> pathlib.Path:
  tmp = tmp_path_factory.mktemp("docs")
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    PZSC_DOCS_EXECUTE="force",
    JUPYTER_PATH=str(_kernelspec(tmp / "jupyter")),
    PYDEVD_DISABLE_FILE_VALIDATION="1",
  )
  env.pop("XLA_FLAGS", None)  # each notebook sets its own
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
      str(tmp / "html"),
    ],
    capture_output=True,
    text=True,
    env=env,
    timeout=900,
  )
  assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
  return tmp / "html"


@pytest.mark.xdist_group("docs")
def test_docs_build(built):
  for page in ("index", "concepts", "gpu", "api/nn", "notebooks/shakespeare"):
    assert (built / f"{page}.html").exists(), page


@pytest.mark.xdist_group("docs")
def test_every_notebook_ran_in_under_two_minutes(built):
  text = (built / "notebooks.html").read_text()
  table = text[text.index("Run Time (s)") :]
  rows = re.findall(r'href="notebooks/([\w]+)\.html".*?</tr>', table, re.S)
  assert sorted(rows) == NOTEBOOKS
  for name, row in zip(
    rows, re.findall(r"<tr class.*?</tr>", table, re.S), strict=True
  ):
    cells = re.findall(r"<td><p>(.*?)</p></td>", row)
    assert cells[-1] == "✅", (name, cells)
    assert float(cells[-2]) < 120, (name, cells)


@pytest.mark.xdist_group("docs")
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_page_shows_its_figures(built, name, tmp_path):
  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  page = built / "notebooks" / f"{name}.html"
  html = page.read_text()
  assert "cell_output" in html, f"{name}: no outputs on the page"
  with chromium.devtools(browser, tmp_path / "profile", 1280, 900) as call:
    call("Runtime.enable")
    call("Page.enable")
    call("Page.navigate", url=page.as_uri())
    chromium.wait_for(call, "document.readyState === 'complete'")
    # A window as tall as the page (1280 px wide): every output is on
    # screen, so Treescope draws them all without waiting for scrolls.
    height = chromium.evaluate(call, "document.documentElement.scrollHeight")
    call(
      "Emulation.setDeviceMetricsOverride",
      width=1280,
      height=min(height, 16000),
      deviceScaleFactor=1,
      mobile=False,
    )
    # The docs' treescope-run-here, not Treescope's (see the next test).
    assert chromium.evaluate(
      call,
      "customElements.get('treescope-run-here').toString()"
      ".includes('DOMContentLoaded')",
    )
    drawn = chromium.evaluate(call, chromium.DRAW_ALL)
    assert drawn["undrawn"] == [], (name, drawn, chromium.console_errors(call))
    if "treescope" in html:
      assert drawn["outputs"] > 0, name
    width = chromium.evaluate(
      call, "[document.documentElement.scrollWidth, window.innerWidth]"
    )
    assert width[0] <= width[1], f"{name}: the page scrolls sideways {width}"
    text = chromium.evaluate(call, "document.body.innerText")
    assert "Rendering array" not in text
    assert "Traceback" not in text
    assert chromium.console_errors(call) == []


def test_treescope_scripts_run_once_the_page_is_parsed(tmp_path):
  """The docs' `treescope-run-here` (loaded in every page's head) runs an
  output's inline scripts at DOMContentLoaded, when each is whole, in
  document order; Treescope's own definition, which would run them while
  the parser may still be adding their text, is not installed over it."""
  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  script = (DOCS / "_static" / "treescope_run_here.js").resolve().as_uri()
  run = '<treescope-run-here><script type="application/octet-stream">{}'
  run += "</script></treescope-run-here>"
  page = tmp_path / "page.html"
  page.write_text(
    f'<html><head><script src="{script}"></script></head><body>'
    # What Treescope's outputs do first: define the element unless defined.
    "<script>window.seen = []; if (!customElements.get('treescope-run-here'))"
    " { window.seen.push('treescope defined it'); }</script>"
    + run.format("window.seen.push('a ' + document.readyState);")
    + run.format("window.seen.push('b ' + document.readyState);")
    + "</body></html>"
  )
  with chromium.devtools(browser, tmp_path / "profile", 800, 600) as call:
    call("Runtime.enable")
    call("Page.navigate", url=page.as_uri())
    chromium.wait_for(call, "document.readyState === 'complete'")
    seen = chromium.evaluate(call, "window.seen")
    left = chromium.evaluate(
      call, "document.querySelectorAll('treescope-run-here').length"
    )
  assert seen == ["a interactive", "b interactive"]
  assert left == 0
