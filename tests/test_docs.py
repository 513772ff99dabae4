"""Builds the documentation as a reader gets it: Sphinx (warnings are
errors) executing every notebook, then each notebook page in headless
Chromium.

The build runs every notebook top to bottom (a cell error fails it) in a
kernel of this interpreter, and renders the outputs on the pages; so too
the code cells of `concepts.md` (a text notebook). Each such page must then
show every Treescope figure drawn, with no JavaScript error in the console,
and fit a 1280-px window without scrolling sideways; each must have run in
under 2 minutes (the execution table on the notebooks page). Each must
also show, without a click, at least one placement picture
(`viz.placement`): a table's ids in vocabulary order coloured by the
device holding each, whose colours are those the rule written above it
gives (id i on device `((i % N + rotation) % N) // S`, padding white) and
whose devices the legend beside it names.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import chromium
import numpy as np
import pytest

pytest.importorskip("sphinx")
pytest.importorskip("myst_nb")
pytest.importorskip("furo")

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
NOTEBOOKS = sorted(p.stem for p in (DOCS / "notebooks").glob("*.ipynb"))
# The pages whose code the build runs: the notebooks, and concepts.md.
EXECUTED = sorted([*(f"notebooks/{name}" for name in NOTEBOOKS), "concepts"])

# Every placement picture an output shows without a click: each visible
# array whose column axis reads "id % W", with the table heading and the
# id -> device rule shown between it and the picture before it in its
# output (null if none), its row axis label and the colour at the centre of
# each of its cells (a cell of `size` px at ((col + 1) * size, (row + 1) *
# size) of the canvas); and the visible text of each output holding one
# (its legend).
PLACEMENTS = r"""(() => {
  const shown = (node) => node.parentElement.checkVisibility();
  const pictures = [], texts = {};
  const hosts = [...document.querySelectorAll("treescope-container")];
  for (const [output, host] of hosts.entries()) {
    const walker = document.createTreeWalker(
      host.shadowRoot, NodeFilter.SHOW_ELEMENT | NodeFilter.SHOW_TEXT);
    let heading = null, rule = null;
    const text = [];
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (node.nodeType === Node.TEXT_NODE) {
        if (!shown(node)) continue;
        const line = node.textContent;
        text.push(line);
        if (line.includes("' in stack '")) heading = line;
        if (line.includes("id i -> shard (")) rule = line;
        continue;
      }
      if (!node.classList.contains("arrayviz_container")) continue;
      const labels = [...node.querySelectorAll("div")].map(
        (div) => div.textContent);
      const columns = labels.find((label) => /^id % \d+$/.test(label));
      if (!columns || !node.checkVisibility()) continue;
      const canvas = node.querySelector("canvas");
      const picture = {
        output, heading, rule, columns,
        colors: null,
      };
      pictures.push(picture);
      texts[output] = text;
      heading = rule = null;  // Each picture has its own.
      if (!canvas) continue;
      const width = Number(columns.split("% ")[1]);
      const size = canvas.width / (width + 2);
      const context = canvas.getContext("2d");
      picture.colors = [];
      for (let r = 0; r < canvas.height / size - 2; r++) {
        const line = [];
        for (let c = 0; c < width; c++) {
          const [red, green, blue] = context.getImageData(
            Math.floor((c + 1.5) * size), Math.floor((r + 1.5) * size), 1, 1
          ).data;
          line.push("#" + [red, green, blue].map(
            (x) => x.toString(16).padStart(2, "0")).join(""));
        }
        picture.colors.push(line);
      }
    }
  }
  for (const output in texts) texts[output] = texts[output].join("");
  return {pictures, texts};
})()"""

_HEADING = re.compile(
  r"table '(?P<table>[^']+)' in stack '[^']+': (?P<ids>\d+) ids"
  r"(?: and (?P<padding>\d+) padding)?"
)
_RULE = re.compile(
  r"id i -> shard \(i % (?P<n>\d+) \+ (?P<rotation>\d+)\) % \d+ -> "
  r"device shard // (?P<s>\d+)"
)


def _check_placement(page: str, picture: dict, text: str) -> None:
  """A placement picture as drawn says what its heading and rule say.

  The pages build their meshes from `jax.devices()` in order, so the
  device at position `shard // S` is CPU `shard // S`.
  """
  where = f"{page}, output {picture['output']}"
  assert picture["colors"], f"{where}: placement picture not drawn"
  heading = _HEADING.search(picture["heading"] or "")
  rule = _RULE.search(picture["rule"] or "")
  assert heading and rule, f"{where}: no heading or rule shown {picture}"
  ids = int(heading["ids"])
  padded = ids + int(heading["padding"] or 0)
  n, rotation, s = (int(rule[k]) for k in ("n", "rotation", "s"))
  width = int(picture["columns"].split("% ")[1])
  colors = np.array(picture["colors"])
  total = -(-padded // width)
  if len(colors) < total:  # The first and last rows, a row for the rest.
    shown = len(colors) - 1
    rows = [*range(shown // 2), -1, *range(total - shown + shown // 2, total)]
  else:
    rows = list(range(total))
  assert colors.shape == (len(rows), width), (where, colors.shape, rows)
  row_of = np.array(rows)[:, None]
  i = row_of * width + np.arange(width)
  device = ((i % n + rotation) % n) // s
  digits = chromium.digit_colors()  # Device d: the digit d + 1's colour.
  assert device.max() < len(digits) - 1, f"{where}: a two-digit device"
  expected = np.array(digits)[device + 1]
  expected[i >= ids] = digits[0]  # Padding: white.
  drawn = (row_of >= 0) & (i < padded)  # Cells holding an id.
  np.testing.assert_array_equal(
    colors[drawn], expected[drawn], err_msg=f"{where}: {picture['heading']}"
  )
  for d in np.unique(device[drawn & (i < ids)]):
    assert f"CPU {d}" in text, f"{where}: the legend lacks CPU {d}"


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
def test_every_executed_page_ran_in_under_two_minutes(built):
  text = (built / "notebooks.html").read_text()
  table = text[text.index("Run Time (s)") :]
  rows = {}
  for row in re.findall(r"<tr class.*?</tr>", table, re.S):
    name = re.search(r'href="([\w/]+)\.html"', row).group(1)
    rows[name] = re.findall(r"<td><p>(.*?)</p></td>", row)
  assert sorted(rows) == EXECUTED
  for name, cells in rows.items():
    assert cells[-1] == "✅", (name, cells)
    assert float(cells[-2]) < 120, (name, cells)


@pytest.mark.xdist_group("docs")
@pytest.mark.parametrize("name", EXECUTED)
def test_executed_page_shows_its_figures(built, name, tmp_path):
  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  page = built / f"{name}.html"
  html = page.read_text()
  assert "cell_output" in html, f"{name}: no outputs on the page"
  with chromium.devtools(browser, tmp_path / "profile", 1280, 900) as call:
    call("Runtime.enable")
    call("Page.enable")
    chromium.open_page(call, page.as_uri())
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
    # Which device holds an id, read off a picture without a click.
    shown = chromium.evaluate(call, PLACEMENTS)
    assert shown["pictures"], f"{name}: no placement picture shown"
    for picture in shown["pictures"]:
      _check_placement(name, picture, shown["texts"][str(picture["output"])])
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
    chromium.open_page(call, page.as_uri())
    seen = chromium.evaluate(call, "window.seen")
    left = chromium.evaluate(
      call, "document.querySelectorAll('treescope-run-here').length"
    )
  assert seen == ["a interactive", "b interactive"]
  assert left == 0
