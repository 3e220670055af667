"""The report's price matrix in a real browser (Debian's Chromium, driven as tests/test_browser.py drives it): at a
laptop's 1366 px window the matrix of configurations by GPUs fits without sideways scrolling, shows no raw column
name, marks one cheapest GPU per configuration, tells measured cells from predicted ones, and says host-bound
once per configuration. A screenshot is saved under the test's temporary folder (the path is printed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT
from ftbench.experiment import calibration as calibrations
from test_browser import CHROMIUM, Browser
from test_prediction import H200, experiment, llama, runs_of, write_results

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} not installed (bash .ci/install-system.sh installs Debian's chromium)"),
]

MATRIX_FACTS = """(() => {
  const table = document.querySelector('#price-matrix');
  const box = table.getBoundingClientRect();
  const rows = Array.from(table.querySelectorAll('tbody tr'));
  return {
    right: box.right, width: box.width, viewport: window.innerWidth,
    pageOverflows: document.documentElement.scrollWidth > window.innerWidth,
    headers: Array.from(table.querySelectorAll('thead th')).map(th => th.textContent),
    rows: rows.length,
    cheapestPerRow: rows.map(r => r.querySelectorAll('td.cheapest').length),
    measured: table.querySelectorAll('td.measured').length,
    predicted: table.querySelectorAll('td.predicted').length,
    hostBoundNotes: rows.map(r => r.querySelectorAll('.bound').length),
    firstCell: rows[0].querySelector('td').textContent,
    tooltip: rows[0].querySelector('td').getAttribute('title'),
    tables: Array.from(document.querySelectorAll('table')).filter(t => t.offsetParent !== null)
      .map(t => ({id: t.id, right: t.getBoundingClientRect().right})),
  };
})()"""


@pytest.mark.slow
def test_the_price_matrix_fits_a_laptop_window(tmp_path):
    from ftbench.report import report_page

    models = {"llama1b": llama(2048, 22, 5632, 32, 4, 32000), "smol": llama(576, 30, 1536, 9, 3, 49152),
              "qwen": llama(896, 24, 4864, 14, 2, 151936)}
    runs = runs_of(experiment(tmp_path, models, {"method": ["full", "lora", "qlora"]}))
    metrics = write_results(tmp_path / "results", runs, H200, calibrations.load(ROOT / "config" / "calibration.yaml"),
                            noise=0.03)
    html = tmp_path / "results" / "report.html"
    report_page.build_report(metrics, [], tmp_path / "results" / "figures", html, gpu_table=ROOT / "config" / "gpus.yaml")
    browser = Browser(tmp_path / "chromium")
    try:
        browser.open(html, width=1366, height=900)
        browser.evaluate("document.querySelector('#price-matrix').scrollIntoView()")
        facts = browser.evaluate(MATRIX_FACTS)
        shot = browser.screenshot(tmp_path / "price-matrix.png")
        print(f"screenshot: {shot}")
        problems = browser.problems()
    finally:
        browser.close()
    assert facts["rows"] == len(runs)
    assert facts["right"] <= facts["viewport"] == 1366 and not facts["pageOverflows"], facts
    assert facts["headers"][0] == "configuration" and "H200" in facts["headers"] and "A100" in facts["headers"]
    assert not any("_" in header for header in facts["headers"])  # words, no raw column names
    # every configuration ran on the H200 (measured); the other GPUs are predicted; one cheapest per configuration
    assert facts["measured"] == len(runs) and facts["predicted"] >= len(runs) * 5
    assert all(count <= 1 for count in facts["cheapestPerRow"]) and sum(facts["cheapestPerRow"]) >= len(runs) - 1
    assert all(count <= 1 for count in facts["hostBoundNotes"]) and any(facts["hostBoundNotes"])
    # the budget's dollars (collect's projected tokens), the interval under them, tokens/s on hover
    assert facts["firstCell"].startswith("$") and "tokens/s" in facts["tooltip"]
    assert all(table["right"] <= 1366 for table in facts["tables"] if table["id"] == "price-matrix")
    assert problems == []
