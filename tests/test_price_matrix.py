"""The price matrix (report/price_matrix.py) and prices without a budget: $ per 1M tokens and per 1k samples on
every GPU when the experiment sets no budget, the cheapest GPU that fits marked once per configuration, measured
cells told apart, host-bound said once per configuration, and `plan`'s default matrix within 120 columns."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from conftest import ROOT
from ftbench import cli
from ftbench.experiment import calibration as calibrations
from ftbench.report import cost, price_matrix
from ftbench.report import prediction as report_prediction
from test_prediction import GPUS, experiment, llama, runs_of

SHIPPED = ROOT / "config" / "calibration.yaml"


def priced(tmp_path, budget=None, methods=("full", "lora")) -> tuple[pd.DataFrame, list]:
    models = {"big": llama(2048, 16, 5632, 32, 4, 32000), "tiny": llama(128, 2, 256, 4, 2, 1000)}
    runs = runs_of(experiment(tmp_path, models, {"method": list(methods)}, budget=budget))
    table = report_prediction.priced_table(runs, GPUS, calibrations.load(SHIPPED), cost.resolve({}), budget)
    return table, runs


def test_without_a_budget_every_priced_gpu_has_dollars_per_1m_tokens_and_per_1k_samples(tmp_path):
    table, runs = priced(tmp_path)
    shown = table[table["gpu"].notna()]
    assert shown["budget_cost"].isna().all()
    priced_rows = shown[shown["price_per_device_hour"].notna()]
    assert len(priced_rows) >= len(runs) * 5
    assert priced_rows["cost_per_1m_tokens"].notna().all() and priced_rows["cost_per_1k_samples"].notna().all()
    row = priced_rows.iloc[0]
    # $ per 1M tokens: the GPUs' price per hour over the tokens an hour trains; per 1k samples: at 512 tokens each
    assert row["cost_per_1m_tokens"] == pytest.approx(row["price_per_device_hour"] * row["devices"]
                                                      / (row["tokens_per_s"] * 3600) * 1e6)
    assert row["tokens_per_sample"] == pytest.approx(512)
    assert row["cost_per_1k_samples"] == pytest.approx(row["cost_per_1m_tokens"] * 512 / 1000)
    assert row["cost_per_1m_tokens_low"] < row["cost_per_1m_tokens"] < row["cost_per_1m_tokens_high"]
    assert report_prediction.cost_column(table) == "cost_per_1m_tokens"


def test_the_matrix_marks_one_cheapest_gpu_that_fits_per_configuration(tmp_path):
    table, runs = priced(tmp_path)
    matrix = price_matrix.price_matrix(table)
    assert matrix.unit == "$ per 1M tokens" and len(matrix.rows) == len(runs)
    for row in matrix.rows:
        config = table[(table["config_id"] == row.label) & table["gpu"].notna()]
        fitting = config[(config["fits"] == "yes") & config["cost_per_1m_tokens"].notna()]
        cheapest = fitting.loc[fitting["cost_per_1m_tokens"].idxmin(), "gpu"]
        assert [gpu for gpu, cell in zip(matrix.gpus, row.cells) if cell.cheapest] == [cheapest]
        for gpu, cell in zip(matrix.gpus, row.cells):
            verdict = config.set_index("gpu").loc[gpu, "fits"]
            assert (cell.value == "no fit") == (verdict == "no")
            assert cell.measured is False and "tokens/s" in cell.detail
    tiny = next(row for row in matrix.rows if row.label.startswith("tiny"))
    assert tiny.host_bound and tiny.note() == "host-bound on every GPU"  # said once, for the configuration
    big = next(row for row in matrix.rows if row.label.startswith("big-tokens-full"))
    rows = table[(table["config_id"] == big.label) & table["gpu"].notna()]
    assert big.host_bound == list(rows.loc[rows["host_bound"] == True, "gpu"])  # noqa: E712 - a column of objects
    assert len(big.host_bound) < 9 and big.note() == f"host-bound on {', '.join(big.host_bound)}"


def test_with_a_budget_the_cells_are_the_budgets_dollars(tmp_path):
    table, _ = priced(tmp_path, budget={"tokens": 1_000_000_000}, methods=("full",))
    matrix = price_matrix.price_matrix(table)
    assert matrix.unit == "$ of the budget's training steps"
    row = table[(table["gpu"] == "H200") & table["config_id"].str.startswith("big")].iloc[0]
    cell = next(row_.cells[matrix.gpus.index("H200")] for row_ in matrix.rows if row_.label.startswith("big"))
    assert cell.value == report_prediction.pages_money(row["budget_cost"])
    assert cell.interval == (f"{report_prediction.pages_money(row['budget_cost_low'])[1:]}-"
                             f"{report_prediction.pages_money(row['budget_cost_high'])[1:]}")


def test_a_measured_cell_is_marked_and_the_text_fits_120_columns(tmp_path):
    table, _ = priced(tmp_path)
    h200 = table["gpu"] == "H200"
    table.loc[h200, "basis"] = "measured here"
    matrix = price_matrix.price_matrix(table)
    column = matrix.gpus.index("H200")
    assert all(row.cells[column].measured for row in matrix.rows)
    assert sum(row.cells[column].measured for row in matrix.rows for column in range(len(matrix.gpus))) == len(matrix.rows)
    lines = price_matrix.text_lines(matrix)
    assert max(map(len, lines)) <= 120
    assert any(price_matrix.MEASURED_MARK in line for line in lines)
    # every GPU appears as a column header, in blocks as wide as the terminal allows
    headers = [line for line in lines if line.startswith("configuration")]
    assert [gpu for line in headers for gpu in re.split(r"\s{2,}", line.strip())[1:]] == matrix.gpus
    assert len(headers) >= 2  # eleven GPUs do not fit one block of 120 columns


def test_plan_without_a_budget_prints_the_matrix_in_dollars_per_1m_tokens(tmp_path, capsys):
    path = experiment(tmp_path, {"big": llama(2048, 16, 5632, 32, 4, 32000)}, {"method": ["full", "lora"]})
    cli.plan([str(path), "--data-root", str(tmp_path / "data"), "--results", str(tmp_path / "none.parquet")])
    out = capsys.readouterr().out
    assert "no budget: $ per 1M tokens" in out and "Cells: $ per 1M tokens" in out
    assert max(map(len, out.splitlines())) <= 120
    rows = [line for line in out.splitlines() if line.startswith(("full ", "lora-r16 "))]  # the shared "big-tokens" left out
    # two configurations in two blocks of GPUs, each configuration's cheapest GPU marked once
    assert len(rows) == 4 and all("$" in line for line in rows) and sum(line.count("*") for line in rows) == 2
    assert "python -m ftbench plan --detail" in out
    cli.plan([str(path), "--data-root", str(tmp_path / "data"), "--results", str(tmp_path / "none.parquet"), "--detail"])
    detail = capsys.readouterr().out
    assert "$/1M tokens [95%]" in detail and "$/1k samples" in detail and "cheapest that fits: RTX 4090 (yes), $" in detail
    assert "per 1M tokens (datasheet only (uncalibrated))" in detail


def test_short_labels_drop_the_parts_every_configuration_shares():
    labels = price_matrix.short_labels({"a": "m1-tokens-full-bf16-b4", "b": "m1-tokens-lora-r16-bf16-b4",
                                        "c": "m2-tokens-full-bf16-b8"})
    assert labels == {"a": "m1-full-b4", "b": "m1-lora-r16-b4", "c": "m2-full-b8"}


def test_the_reports_section_without_a_budget_shows_dollars_per_1m_tokens(tmp_path):
    from ftbench.report import prediction_section
    from test_prediction import H200, write_results

    runs = runs_of(experiment(tmp_path, {"big": llama(2048, 16, 5632, 32, 4, 32000)}, {"method": ["full", "lora"]}))
    metrics = write_results(tmp_path / "results", runs, H200, calibrations.load(SHIPPED))
    frame = pd.read_parquet(metrics)
    frame["projected_tokens"] = None  # the experiment set no budget
    frame.to_parquet(metrics)
    html, _ = prediction_section.section(metrics, GPUS, tmp_path / "figures", config_dir=ROOT / "config")
    assert "<b>Cells: $ per 1M tokens</b>" in html and 'id="price-matrix"' in html
    assert html.count('class="measured') >= len(runs) and "per 1k samples" in html
    assert "cost_per_1m_tokens" not in html.split('id="prediction-table"')[0]  # no raw column name in the matrix
