"""The command line and the report it writes, end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import chromium
import numpy as np
import pytest

ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "pz_sparsecore", *args],
    capture_output=True,
    text=True,
    timeout=timeout,
    env=ENV,
  )


@pytest.mark.parametrize(
  "args, message",
  [
    (["shakespeare", "--devices", "3"], "power of two"),
    (["shakespeare", "--steps", "0"], "--steps must be at least 1"),
    (["shakespeare", "--vocab", "1"], "--vocab must be at least 2"),
    (["shakespeare", "--optimizer", "lamb"], "invalid choice"),
    (["shakespeare", "--batch-size", "12"], "must divide"),
    (["shakespeare", "--fdo-every", "-1"], "--fdo-every"),
    (["shakespeare", "--devices", "abc"], "invalid int value"),
    ([], "required"),
  ],
)
def test_bad_arguments_exit_2_with_a_message(args, message):
  result = _cli(*args, timeout=60)
  assert result.returncode == 2
  assert message in result.stderr


def test_too_many_devices_is_a_clear_error():
  env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  result = subprocess.run(
    [sys.executable, "-m", "pz_sparsecore", "shakespeare", "--devices", "4"],
    capture_output=True,
    text=True,
    timeout=120,
    env=env,
  )
  assert result.returncode == 1
  assert "exceeds the 2 devices" in result.stderr


def _screenshot_when_drawn(browser: str, url: str, profile) -> bytes:
  """Loads `url` in headless Chromium, waits for Treescope, screenshots."""
  import base64

  with chromium.devtools(browser, profile, 1200, 1200) as call:
    chromium.open_page(call, url)
    chromium.wait_for(call, chromium.DRAWN)
    return base64.b64decode(
      call("Page.captureScreenshot", format="png")["data"]
    )


# One worker runs every test of the default run (`xdist_group`), and the
# run is session-scoped: built once even when other modules' tests run
# between them there.
@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
  report = tmp_path_factory.mktemp("report")
  result = _cli("shakespeare", "--report", str(report), "--no-progress")
  assert result.returncode == 0, result.stderr[-3000:]
  return report, result.stdout


@pytest.mark.xdist_group("cli_report")
def test_default_run_beats_the_unigram_baseline(default_run):
  _, stdout = default_run
  model = float(re.search(r"held-out loss ([\d.]+)", stdout).group(1))
  baseline = float(
    re.search(r"unigram baseline loss ([\d.]+)", stdout).group(1)
  )
  assert model < baseline - 0.2, stdout


@pytest.mark.xdist_group("cli_report")
def test_report_files(default_run):
  report, _ = default_run
  for name in ("index.html", "loss.png", "shards.html", "stats.html"):
    assert (report / name).stat().st_size > 0, name
  index = (report / "index.html").read_text()
  for element in ('id="loss-curve"', 'id="shards"', 'id="stats"', "verdict"):
    assert element in index
  assert "beats" in index


@pytest.mark.xdist_group("cli_report")
def test_report_renders_in_chromium(default_run, tmp_path):
  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  report, _ = default_run
  shot = tmp_path / "index.png"
  subprocess.run(
    [
      browser,
      *chromium.FLAGS,
      f"--user-data-dir={tmp_path / 'profile'}",
      "--window-size=1200,3000",
      "--virtual-time-budget=10000",
      f"--screenshot={shot}",
      (report / "index.html").as_uri(),
    ],
    capture_output=True,
    timeout=120,
    check=True,
  )
  from PIL import Image

  pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
  assert pixels.std() > 10, "screenshot is blank"
  # The Treescope figures draw into shadow DOM from their scripts: wait until
  # they finished, then check the pixels (the table bands and the heat map
  # are saturated colours that only appear once drawn).
  for figure in ("shards.html", "stats.html"):
    shot = tmp_path / (figure + ".png")
    shot.write_bytes(
      _screenshot_when_drawn(
        browser, (report / figure).as_uri(), tmp_path / ("p-" + figure)
      )
    )
    rgb = np.asarray(Image.open(shot).convert("RGB"), dtype=np.int32)
    saturated = (rgb.max(-1) - rgb.min(-1)) > 60
    assert saturated.sum() > 2000, f"{figure} did not draw"


# Measures the page once `chromium.DRAW_ALL` has drawn every Treescope figure
# and each of its visible arrays. A drawn array is a canvas with coloured
# pixels; an undrawn one still says "Rendering array...". Arrays inside
# collapsed nodes of the model are not shown and not drawn.
_LAYOUT = """(() => {
  const coloured = (canvas) => {
    const {data} = canvas.getContext("2d").getImageData(
      0, 0, canvas.width, canvas.height);
    let count = 0;
    for (let i = 0; i < data.length; i += 4) {
      const rgb = [data[i], data[i + 1], data[i + 2]];
      count += Math.max(...rgb) - Math.min(...rgb) > 60;
    }
    return count;
  };
  const figures = {};
  for (const host of document.querySelectorAll("treescope-container")) {
    const root = host.shadowRoot;
    const loaded = root.childElementCount > 0 &&
      !root.textContent.includes("(Loading...)");
    const arrays = [...root.querySelectorAll(".arrayviz_container")]
      .filter((a) => a.checkVisibility());
    // Treescope's root is as wide as its widest line or image.
    const box = root.querySelector(".treescope_root").getBoundingClientRect();
    figures[host.closest(".figure")?.id] = {
      loaded,
      width: box.width,
      height: box.height,
      arrays: arrays.map((a) => {
        const canvas = a.querySelector("canvas");
        const box = canvas ? canvas.getBoundingClientRect() : {};
        return {
          coloured: canvas ? coloured(canvas) : 0,
          width: box.width,
          height: box.height,
        };
      }),
      rendering: [...root.querySelectorAll(".loading_message")]
        .filter((m) => m.checkVisibility()).length,
    };
  }
  // Elements and frames (in the page or in shadow DOM) that scroll inside
  // the page: their content is larger than their box.
  const scrolls = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll("*")) {
      const style = getComputedStyle(el);
      const x = /auto|scroll/.test(style.overflowX) &&
        el.scrollWidth > el.clientWidth;
      const y = /auto|scroll/.test(style.overflowY) &&
        el.scrollHeight > el.clientHeight;
      if (x || y) scrolls.push(el.tagName + "." + el.className);
      if (el.tagName === "IFRAME") {
        const doc = el.contentDocument?.documentElement;
        if (!doc || doc.scrollWidth > el.clientWidth ||
            doc.scrollHeight > el.clientHeight) {
          scrolls.push("IFRAME#" + el.id);
        }
      }
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  window.scrollTo(0, 0);
  const page = document.documentElement;
  return {
    scrollWidth: page.scrollWidth,
    innerWidth: window.innerWidth,
    scrollHeight: page.scrollHeight,
    images: [...document.images].map((img) => ({
      src: img.getAttribute("src"),
      loaded: img.complete && img.naturalWidth > 0,
      width: img.width,
      height: img.height,
    })),
    figures,
    scrolls,
  };
})()"""


@pytest.mark.xdist_group("cli_report")
def test_report_reads_well_at_1280_px(default_run, tmp_path):
  browser = chromium.find()
  if browser is None:
    pytest.skip("chromium is not installed")
  report, _ = default_run
  url = (report / "index.html").as_uri()
  with chromium.devtools(browser, tmp_path / "profile", 1280, 900) as call:
    chromium.open_page(call, url)
    chromium.evaluate(call, chromium.DRAW_ALL)
    page = chromium.evaluate(call, _LAYOUT)
  assert page["scrollWidth"] <= page["innerWidth"], page
  assert page["images"] and all(i["loaded"] for i in page["images"]), page
  figures = page["figures"]
  assert set(figures) == {"shards", "stats", "model"}, page
  for name, figure in figures.items():
    assert figure["loaded"] and figure["rendering"] == 0, (name, figure)
    assert figure["width"] <= page["innerWidth"], (name, figure)
    for array in figure["arrays"]:
      assert array["coloured"] > 500, (name, figure)
  # The shard map is one image, then (its stack holds one table) the
  # table's placement picture; the stats two heat maps (ids, unique ids).
  assert len(figures["shards"]["arrays"]) == 2, figures["shards"]
  assert len(figures["stats"]["arrays"]) == 2, figures["stats"]
  assert page["scrolls"] == [], page
