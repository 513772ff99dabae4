"""Headless Chromium for the tests that check pages as a reader sees them.

`find()` is the browser's path (or None); `devtools(...)` opens a page in a
headless browser and yields a function sending DevTools protocol commands;
`evaluate(call, expression)` returns a JavaScript expression's value;
`wait_for(call, expression)` polls one until it is true. `DRAWN` is true once
every Treescope output on a page has drawn; `DRAW_ALL` scrolls each output
and each of its visible arrays into view (Treescope draws only what is on
screen), waits for it, and says what did not draw. `digit_colors()` are
the colours Treescope draws digits (and so devices) in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import time

FLAGS = [
  "--headless",
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--allow-file-access-from-files",
]

# True once every Treescope output on the page has drawn: Treescope renders
# into shadow DOM from animation frames once an output is visible, and drops
# its loading markers when done.
DRAWN = """(() => {
  const hosts = document.querySelectorAll("treescope-container");
  if (hosts.length === 0) return false;
  for (const host of hosts) {
    const root = host.shadowRoot;
    if (!root || root.childElementCount === 0) return false;
    if (root.querySelector(".loading_message")) return false;
    if (root.textContent.includes("(Loading...)")) return false;
    if (root.textContent.includes("Rendering array")) return false;
  }
  return true;
})()"""


# Each output and array gets 60 s: on 2 busy cores (the suite runs beside
# the docs test) Treescope has taken over 10 s to draw an array. Treescope
# draws an element when an IntersectionObserver first sees it intersect the
# viewport with a nonzero area; one that was first seen touching the
# viewport's edge (zero area, yet "intersecting") is never reported again
# while it stays on screen, and the window is as tall as the page. So every
# 2 s the wait hides the element for two frames and shows it again, scrolled
# into view, as a reader scrolling away and back would: the observer then
# sees it leave and come back.
DRAW_ALL = """(async () => {
  const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  const frame = () => new Promise((resolve) => requestAnimationFrame(resolve));
  const until = async (element, test) => {
    for (let i = 0; i < 1200 && !test(); i++) {
      if (i % 40 === 39) {
        const display = element.style.display;
        element.style.display = "none";
        await frame();
        await frame();
        element.style.display = display;
      }
      if (i % 40 === 0 || i % 40 === 39) element.scrollIntoView();
      await sleep(50);
    }
    return test();
  };
  const undrawn = [];
  const hosts = [...document.querySelectorAll("treescope-container")];
  for (const [i, host] of hosts.entries()) {
    const drawn = await until(host, () => host.shadowRoot &&
      host.shadowRoot.childElementCount > 0 &&
      !host.shadowRoot.textContent.includes("(Loading...)"));
    if (!drawn) { undrawn.push(`output ${i}`); continue; }
    const arrays = [...host.shadowRoot.querySelectorAll(".arrayviz_container")]
      .filter((a) => a.checkVisibility());
    for (const a of arrays) {
      const ok = await until(a, () => a.querySelector("canvas") &&
        !a.textContent.includes("Rendering array"));
      if (!ok) undrawn.push(`array of output ${i}`);
    }
  }
  window.scrollTo(0, 0);
  return {outputs: hosts.length, undrawn};
})()"""


def digit_colors() -> tuple[str, ...]:
  """Treescope's colour of each decimal digit 0-9 as `#rrggbb`, read from
  its arrayviz.js (`digitColorPrimary`). The digitbox of a one-digit value
  is one square of its digit's colour: Treescope's sharding view draws
  device d (the value d + 1) as `digit_colors()[d + 1]`, 0 as white."""
  package = importlib.util.find_spec("treescope").origin
  script = pathlib.Path(package).parent / "_internal" / "js" / "arrayviz.js"
  body = re.search(
    r"const digitColorPrimary = \[(.*?)\];", script.read_text(), re.S
  ).group(1)
  return tuple(re.findall(r"'(#[0-9a-f]{6})'", body))


def find() -> str | None:
  """The path of a Chromium-like browser, or None."""
  for name in ("chromium", "chromium-browser", "google-chrome"):
    path = shutil.which(name)
    if path:
      return path
  return None


@contextlib.contextmanager
def devtools(chromium: str, profile, width: int, height: int):
  """Headless Chromium showing about:blank in a `width` x `height` window.

  Yields `call(method, **params)`, which sends one DevTools protocol command
  to the page and returns its result; events that arrive meanwhile are kept
  in `call.events` (a list of `(method, params)`).
  """
  import urllib.request

  import websocket

  proc = subprocess.Popen(
    [
      chromium,
      *FLAGS,
      f"--user-data-dir={profile}",
      "--remote-debugging-port=0",
      f"--window-size={width},{height}",
      "about:blank",
    ],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not port_file.exists() or not port_file.read_text().strip():
      assert time.monotonic() < deadline, "chromium did not start"
      time.sleep(0.1)
    port = port_file.read_text().split()[0]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as r:
      pages = [t for t in json.load(r) if t["type"] == "page"]
    # One DRAW_ALL evaluation may wait on several slow arrays.
    ws = websocket.create_connection(
      pages[0]["webSocketDebuggerUrl"], timeout=600
    )
    ids = iter(range(1, 10**6))

    def call(method, **params):
      message_id = next(ids)
      ws.send(
        json.dumps({"id": message_id, "method": method, "params": params})
      )
      while True:
        reply = json.loads(ws.recv())
        if reply.get("id") == message_id:
          return reply.get("result", {})
        if "method" in reply:
          call.events.append((reply["method"], reply.get("params", {})))

    call.events = []
    yield call
    ws.close()
  finally:
    proc.kill()
    proc.wait()


def evaluate(call, expression: str):
  """The value of a JavaScript expression on the page (promises awaited)."""
  result = call(
    "Runtime.evaluate",
    expression=expression,
    returnByValue=True,
    awaitPromise=True,
  )
  assert "exceptionDetails" not in result, result["exceptionDetails"]
  return result["result"].get("value")


def open_page(call, url: str, timeout: float = 60) -> None:
  """Navigates to `url` and waits until it has loaded.

  A navigation sent while Chromium is still starting (a loaded machine) can
  be dropped, leaving about:blank on screen: it is sent again after 10 s
  without the page, and a timeout names what the tab shows instead.
  """
  loaded = (
    f"location.href === {json.dumps(url)} && document.readyState === 'complete'"
  )
  deadline = time.monotonic() + timeout
  while True:
    call("Page.navigate", url=url)
    retry = min(deadline, time.monotonic() + 10)
    while time.monotonic() < retry:
      if evaluate(call, loaded):
        return
      time.sleep(0.25)
    shown = evaluate(call, "location.href + ' ' + document.readyState")
    assert time.monotonic() < deadline, f"{url} did not load; shown: {shown}"


def wait_for(call, expression: str, timeout: float = 60) -> None:
  """Polls `expression` on the page until it is true."""
  deadline = time.monotonic() + timeout
  while not evaluate(call, expression):
    assert time.monotonic() < deadline, f"timed out waiting for {expression}"
    time.sleep(0.25)


# Chromium reports a ResizeObserver callback that resizes what it observes
# as an uncaught error; it is a notice that layout took another frame (the
# window is resized while outputs draw), not a fault of the page.
BENIGN = ("ResizeObserver loop",)


def console_errors(call) -> list[str]:
  """The JavaScript errors the page reported so far (Runtime domain on),
  each with its message and source location."""
  errors = []
  for method, params in call.events:
    if method == "Runtime.exceptionThrown":
      details = params["exceptionDetails"]
      thrown = details.get("exception", {})
      message = str(thrown.get("description", thrown.get("value", "")))
      if message.startswith(BENIGN):
        continue
      errors.append(
        f"{details.get('text', 'exception')} {message} "
        f"({details.get('url', '')}:{details.get('lineNumber', '?')})"
      )
    elif method == "Runtime.consoleAPICalled" and params["type"] == "error":
      errors.append(" ".join(str(a.get("value")) for a in params["args"]))
  return errors
