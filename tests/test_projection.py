"""Training-budget projections (scripts/ftbench/report/projection.py), applied at collect time."""

import math

import pandas as pd
import pytest

from ftbench.report import projection

RUN = {"tokens_per_s": 2000.0, "samples_per_s": 40.0, "tflops_per_s": 1.2}


def test_token_budget_uses_global_throughput_and_epochs():
    out = projection.project(RUN, {"tokens": 3.6e6, "epochs": 2})
    assert out["projected_tokens"] == 7.2e6
    assert out["projected_hours"] == pytest.approx(7.2e6 / 2000 / 3600)  # 1 hour


def test_sample_budget_converts_with_measured_tokens_per_sample():
    # 50 tokens per sample measured: 1000 samples x 3 epochs = 150k tokens
    out = projection.project(RUN, {"samples": 1000, "epochs": 3})
    assert out["projected_tokens"] == pytest.approx(150_000)
    assert out["projected_hours"] == pytest.approx(150_000 / 2000 / 3600)


def test_pflops_are_budget_tokens_times_flops_per_token():
    # 1.2e12 FLOP/s at 2000 tokens/s = 6e8 FLOP per token
    out = projection.project(RUN, {"tokens": 1e9})
    assert out["projected_pflops"] == pytest.approx(1e9 * 6e8 / 1e15)


@pytest.mark.parametrize("row", [
    {"tokens_per_s": None, "samples_per_s": None, "tflops_per_s": None},
    {"tokens_per_s": math.nan, "samples_per_s": math.nan, "tflops_per_s": math.nan},
    {"tokens_per_s": pd.NA, "samples_per_s": pd.NA, "tflops_per_s": pd.NA},
])
def test_runs_without_a_measurement_get_nulls_not_zeros(row):
    assert projection.project(row, {"tokens": 1e6}) == dict.fromkeys(projection.PROJECTION_COLUMNS)


def test_no_budget_means_no_projection():
    assert projection.project(RUN, None) == dict.fromkeys(projection.PROJECTION_COLUMNS)


def test_add_projections_fills_every_row():
    frame = pd.DataFrame([RUN, {"tokens_per_s": 1000.0, "samples_per_s": 10.0, "tflops_per_s": None}])
    out = projection.add_projections(frame, {"tokens": 3.6e6})
    assert list(out["projected_hours"]) == pytest.approx([0.5, 1.0])
    assert pd.isna(out["projected_pflops"].iloc[1])
