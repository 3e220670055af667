"""The report in a real browser: headless Chromium (Debian's ``chromium``) opens report.html from disk.

Checks that every image decoded (naturalWidth > 0), that the runs table has one row per run, that
sorting works, and that the page logged no console error, threw no exception and asked for no network
resource. A screenshot is saved under the test's temporary folder (the path is printed).

The browser is driven through the Chrome DevTools Protocol over a pipe (``--remote-debugging-pipe``:
JSON messages on file descriptors 3 and 4), so nothing beyond the standard library is needed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from test_report import CAPTIONS, DEFAULT_RECOMMEND, GPU_TABLE, build, fixture_runs, write_fixture

CHROMIUM = "/usr/bin/chromium"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} not installed (bash .ci/install-system.sh installs Debian's chromium)"),
]

FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe",
]


class Browser:
    """A headless Chromium and one page, driven over the DevTools pipe."""

    def __init__(self, profile_dir: Path, timeout: float = 60):
        self.timeout = timeout
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():
            # In the child, before exec: fd 3 reads our commands, fd 4 writes the replies. Copies first,
            # in case a pipe end already sits on 3 or 4; dup2 makes the targets inheritable, and with
            # close_fds=False they survive the exec (every other descriptor Python opened is close-on-exec).
            high_r, high_w = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        profile_dir.mkdir(parents=True, exist_ok=True)
        self.log = profile_dir / "chromium.log"
        self._log_handle = open(self.log, "wb")
        self.process = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile_dir / 'profile'}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=self._log_handle, stderr=subprocess.STDOUT,
            close_fds=False, preexec_fn=wire_fds,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session = None
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no answer from chromium; its log: {self.log.read_text(errors='replace')[-2000:]}")
            ready, _, _ = select.select([self._from_child], [], [], remaining)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"chromium exited; its log: {self.log.read_text(errors='replace')[-2000:]}")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, **params):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, event: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        for seen in self.events:
            if seen.get("method") == event:
                return seen
        while True:
            message = self._read_message(deadline)
            self.events.append(message)
            if message.get("method") == event:
                return message

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def problems(self) -> list[str]:
        """Console errors, uncaught exceptions and failed requests the page produced."""
        found = []
        for event in self.events:
            method, params = event.get("method"), event.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append("console." + params["type"] + ": " + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                details = params.get("exceptionDetails", {})
                found.append("exception: " + str(details.get("exception", {}).get("description", details.get("text"))))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                found.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}".strip())
            elif method == "Network.requestWillBeSent":
                url = params.get("request", {}).get("url", "")
                if not url.startswith(("file:", "data:", "about:")):
                    found.append(f"network request: {url}")
        return found

    def open(self, path: Path, width: int = 1400, height: int = 1000) -> None:
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=path.resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def screenshot(self, target: Path, full_page: bool = False) -> Path:
        params = {"format": "png"}
        if full_page:
            size = self.call("Page.getLayoutMetrics")["cssContentSize"]
            params.update(captureBeyondViewport=True, clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        data = self.call("Page.captureScreenshot", **params)["data"]
        target.write_bytes(base64.b64decode(data))
        return target

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except Exception:  # noqa: BLE001 - closing is best effort; the process is killed below
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        self._log_handle.close()


@pytest.fixture
def browser(tmp_path):
    instance = Browser(tmp_path / "chromium")
    yield instance
    instance.close()


PAGE_FACTS = """(() => {
  const images = Array.from(document.images);
  return {
    images: images.length,
    broken: images.filter(img => !(img.complete && img.naturalWidth > 0)).map(img => img.alt),
    runRows: document.querySelectorAll('#runs tbody tr').length,
    runIds: Array.from(document.querySelectorAll('#runs tbody tr')).map(r => r.cells[0].textContent),
    statuses: Array.from(document.querySelectorAll('#runs tbody tr')).map(r => r.cells[1].textContent),
    external: Array.from(document.querySelectorAll('[src],[href]')).map(e => e.getAttribute('src') || e.getAttribute('href'))
      .filter(u => !u.startsWith('data:') && !u.startsWith('#')),
    headers: Array.from(document.querySelectorAll('#runs thead th')).map(th => th.textContent),
  };
})()"""


def test_report_in_chromium(tmp_path, browser):
    """The fixture experiment (normal runs, repeats, OOM / diverged / unsupported rows, two GPU types)."""
    from ftbench.report import report_page

    runs, steps = fixture_runs("mixed")
    metrics, step_files = write_fixture(tmp_path / "results", runs, steps)
    html = tmp_path / "results" / "report.html"
    written = report_page.build_report(metrics, step_files, tmp_path / "results" / "figures", html,
                                  recommend_settings={"min_accuracy": 0.8, "max_memory_mb": 30000},
                                  captions=CAPTIONS, gpu_table=GPU_TABLE)
    drawn = [name for name, result in written.items() if not isinstance(result, str)]

    browser.open(html)
    facts = browser.evaluate(PAGE_FACTS)
    shot = browser.screenshot(tmp_path / "report.png")
    browser.screenshot(tmp_path / "report-full.png", full_page=True)
    print(f"screenshots: {shot} and {tmp_path / 'report-full.png'}")

    assert facts["images"] == len(drawn) >= 6, facts
    assert facts["broken"] == [], f"images that did not load: {facts['broken']}"
    assert facts["runRows"] == len(runs)
    assert sorted(facts["runIds"]) == sorted(runs["run_id"])
    assert {"oom", "diverged", "unsupported"} <= set(facts["statuses"])
    assert facts["external"] == []
    assert browser.problems() == []
    assert shot.read_bytes().startswith(b"\x89PNG") and shot.stat().st_size > 10_000


FIRST_SCREEN = """(() => {
  const box = selector => { const r = document.querySelector(selector).getBoundingClientRect(); return {top: r.top, bottom: r.bottom, right: r.right}; };
  const table = document.querySelector('#headline');
  return {
    firstTable: document.querySelector('table').id,
    headline: box('#headline'), verdict: box('#verdict'), summary: box('#summary'),
    overflows: table.scrollWidth > table.parentElement.clientWidth,
    viewport: {width: window.innerWidth, height: window.innerHeight},
    headers: Array.from(table.querySelectorAll('th')).map(th => th.textContent),
    rows: table.querySelectorAll('tbody tr').length,
  };
})()"""


def test_the_answer_is_on_the_first_screen_of_a_laptop(tmp_path, browser):
    """At a laptop's 1366 x 900: the headline table (the page's first) and the recommendation sentence are on the
    first screen, whole, with no sideways scrolling; the detailed summary starts below them."""
    runs, _, _ = build(tmp_path, "cpu_default", **DEFAULT_RECOMMEND)
    browser.open(tmp_path / "cpu_default" / "report.html", width=1366, height=900)
    facts = browser.evaluate(FIRST_SCREEN)
    shot = browser.screenshot(tmp_path / "laptop.png")
    print(f"screenshot: {shot}")
    assert facts["firstTable"] == "headline" and facts["rows"] == len(runs)
    assert facts["headers"] == ["configuration", "status", "quality (95% interval)", "tokens/s", "$ per 1M tokens",
                                "cost to target", "fits on"]
    assert facts["headline"]["bottom"] < facts["verdict"]["top"] < facts["verdict"]["bottom"] <= facts["viewport"]["height"]
    assert facts["headline"]["right"] <= facts["viewport"]["width"] and not facts["overflows"]
    assert facts["summary"]["top"] > facts["verdict"]["bottom"]
    assert browser.problems() == []


def test_sorting_a_column_reorders_rows(tmp_path, browser):
    from ftbench.report import report_page

    runs, steps = fixture_runs("normal")
    metrics, step_files = write_fixture(tmp_path / "results", runs, steps)
    html = tmp_path / "report.html"
    report_page.build_report(metrics, step_files, tmp_path / "figures", html)
    browser.open(html)
    column = browser.evaluate("Array.from(document.querySelectorAll('#runs thead th')).findIndex(th => th.textContent === 'tokens_per_s')")
    assert column >= 0
    values = browser.evaluate(
        f"(() => {{ document.querySelectorAll('#runs thead th')[{column}].click();"
        f" return Array.from(document.querySelectorAll('#runs tbody tr')).map(r => r.cells[{column}].dataset.value); }})()"
    )
    numbers = [float(v) for v in values if v]
    assert numbers == sorted(numbers) and len(numbers) == len(runs)
    assert browser.problems() == []


def test_all_oom_report_in_chromium(tmp_path, browser):
    """No figure can be drawn: the page has no image at all, every run is listed, and nothing errors."""
    from ftbench.report import report_page

    runs, steps = fixture_runs("all_oom")
    metrics, step_files = write_fixture(tmp_path / "results", runs, steps)
    html = tmp_path / "report.html"
    report_page.build_report(metrics, step_files, tmp_path / "figures", html)
    browser.open(html)
    facts = browser.evaluate(PAGE_FACTS)
    assert facts["runRows"] == len(runs)
    assert facts["broken"] == []
    assert browser.problems() == []


def test_harness_catches_console_errors_and_broken_images(tmp_path, browser):
    """The checks above can fail: a page with a console error, a thrown exception and a broken image."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
        '<img alt="broken" src="data:image/png;base64,AAAA">'
        "<script>console.error('deliberate'); setTimeout(() => { throw new Error('thrown on purpose'); }, 0);</script>"
        "</body></html>",
        encoding="utf-8",
    )
    browser.open(page)
    time.sleep(0.3)
    browser.evaluate("1")  # drain the events that arrived meanwhile
    facts = browser.evaluate(PAGE_FACTS)
    assert facts["broken"] == ["broken"]
    problems = browser.problems()
    assert any("deliberate" in p for p in problems), problems
    assert any("thrown on purpose" in p for p in problems), problems


def test_chromium_leaves_no_process(tmp_path):
    instance = Browser(tmp_path / "chromium")
    instance.close()
    assert instance.process.poll() is not None
    shutil.rmtree(tmp_path / "chromium", ignore_errors=True)


TABLE_WIDTH = """(id => {
  const table = document.getElementById(id);
  const cells = Array.from(table.querySelectorAll('thead th')).map(th => [th.textContent, Math.round(th.getBoundingClientRect().width)]);
  return {right: table.getBoundingClientRect().right, width: table.scrollWidth, page: document.documentElement.clientWidth,
          scrolls: document.documentElement.scrollWidth > document.documentElement.clientWidth, cells};
})"""


def test_the_per_method_table_fits_a_laptop_window(tmp_path, browser, fixture="mixed"):
    """The cheapest configuration per method, at a laptop's 1366 px: no wider than the window (its long headers wrap;
    the mixed fixture's long configuration names and ties made it 1,463 px wide)."""
    build(tmp_path, fixture, **DEFAULT_RECOMMEND)
    browser.open(tmp_path / fixture / "report.html", width=1366, height=900)
    facts = browser.evaluate(f"{TABLE_WIDTH}('recommend-per-method')")
    print(f"screenshot: {browser.screenshot(tmp_path / 'per-method.png', full_page=True)}; columns: {facts['cells']}")
    assert facts["right"] <= facts["page"] and facts["width"] <= facts["page"], facts
    assert browser.problems() == []
