"""The run table's analysis (scripts/ftbench/report/analysis.py): configurations and their labels, medians over
repeats, the recommendation, the Pareto front, device memory (scaling: test_scaling.py)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from ftbench.report import analysis, uncertainty
from ftbench.measure import gpu_table
from ftbench.errors import FtbenchError
from test_report import GPU_TABLE, H100, fixture_runs, make_run

# ---------------------------------------------------------------------------------------------------
# Configurations, Pareto front, recommendation


def test_repeats_share_a_configuration_and_unstable_ones_are_flagged():
    runs = analysis.prepare(fixture_runs("repeats")[0])
    assert runs["config_key"].nunique() == 2
    configs = analysis.configurations(runs).set_index("method")
    assert configs.loc["lora", "runs"] == 3 and configs.loc["lora", "tokens_per_s"] == pytest.approx(20000)
    speeds = np.array([15000, 18500, 13000])
    assert configs.loc["full", "tokens_per_s_cv"] == pytest.approx(speeds.std(ddof=1) / speeds.mean())
    assert bool(configs.loc["full", "unstable"]) is True and bool(configs.loc["lora", "unstable"]) is False
    assert "rep" not in configs.loc["full", "configuration"]


def test_configurations_on_different_gpus_are_kept_apart():
    runs = analysis.prepare(fixture_runs("multi_gpu")[0])
    assert runs["config_key"].nunique() == len(runs)
    assert runs["config_label"].is_unique
    assert runs["config_label"].str.contains(" @ H100").sum() == 4


def test_pareto_front():
    points = pd.DataFrame({"cost": [1.0, 2.0, 3.0, 1.5, 4.0, 2.0], "quality": [0.70, 0.80, 0.90, 0.65, 0.85, 0.80]},
                          index=list("abcdef"))
    front = analysis.pareto_front(points)
    assert list(front.index) == ["a", "b", "c"]  # d and e are dominated; f ties b and adds nothing


def test_recommendation_cheapest_per_method_and_under_constraints():
    configs = analysis.configurations(analysis.prepare(fixture_runs("normal")[0]))
    result = analysis.recommend(configs)
    assert result["basis"] == "cost"
    per_method = result["per_method"].set_index("method")
    assert list(per_method.index) == ["full", "lora", "qlora"]
    assert "r8" in per_method.loc["lora", "configuration"]  # r8 is faster than r16, so cheaper
    assert result["best"]["configuration"] == per_method["cost_per_1m_tokens"].idxmin() or result["best"]["method"] == "lora"
    best = analysis.recommend(configs, min_accuracy=0.87)["best"]
    assert best["method"] in ("full", "lora") and best["accuracy"] >= 0.87
    assert "r16" in best["configuration"]  # lora r16 (0.88) is cheaper than full (0.90)
    best = analysis.recommend(configs, min_accuracy=0.87, max_memory_mb=15000)["best"]
    assert best is None
    best = analysis.recommend(configs, max_memory_mb=15000)["best"]
    assert best["method"] == "qlora"


def test_recommendation_without_prices_ranks_by_throughput():
    runs, _ = fixture_runs("normal")
    runs["cost_per_1m_tokens"] = pd.NA
    result = analysis.recommend(analysis.configurations(analysis.prepare(runs)))
    assert result["basis"] == "throughput"
    assert result["per_method"].set_index("method").loc["lora", "tokens_per_s"] == 22000


def test_language_model_runs_use_token_accuracy():
    runs = analysis.prepare(fixture_runs("lm")[0])
    quality, name = analysis.quality_column(runs)
    assert name == "eval token accuracy"
    assert quality.tolist() == pytest.approx([0.42, 0.40, 0.39])
    mixed = analysis.prepare(pd.concat([fixture_runs("lm")[0], fixture_runs("single")[0]], ignore_index=True))
    assert analysis.quality_column(mixed)[1] == "eval accuracy (classification) / token accuracy (causal_lm)"
    assert mixed.groupby("task")["quality_metric"].first().to_dict() == {"causal_lm": "token accuracy", "classification": "accuracy"}


def test_gpu_capacity_from_the_name_or_the_gpu_table(tmp_path):
    gpus = gpu_table.load_peaks(GPU_TABLE)
    assert gpu_table.capacity_mb(H100, gpus) == pytest.approx(80 * 1024)  # from its name
    assert gpu_table.capacity_mb("NVIDIA H200", gpus) == pytest.approx(141 * 1024)  # from the table
    assert gpu_table.capacity_mb("NVIDIA H200", []) is None
    assert gpu_table.capacity_mb("Some Future GPU", gpus) is None
    assert gpu_table.capacity_mb(None, gpus) is None
    runs = analysis.prepare(fixture_runs("multi_gpu")[0], gpu_table=gpus)
    assert set(runs["device_memory_mb"].dropna()) == {80 * 1024, 40 * 1024}  # the B200 is in neither
    (tmp_path / "gpus.yaml").write_text("models: []\n")
    with pytest.raises(FtbenchError, match="GPU table .*gpus.yaml: cannot read its `gpus` list"):
        gpu_table.load_peaks(tmp_path / "gpus.yaml")


@pytest.mark.parametrize(("value", "missing"), [
    (None, True), (pd.NA, True), (math.nan, True), (np.float32("nan"), True), (pd.NaT, True),
    (0, False), (0.0, False), ("", False), ("ok", False), ([1, 2], False), (False, False),
])
def test_is_missing(value, missing):
    assert analysis.is_missing(value) is missing


def test_labels_keep_what_tells_configurations_apart():
    runs = analysis.prepare(fixture_runs("normal")[0])
    assert list(runs["config_label"]) == ["full", "lora-r8", "lora-r16", "qlora-r8"]
    assert analysis.common_parts(runs) == "m d bf16 b16 s512"
    assert (runs["config_label"] == runs["config_name"]).all()  # one device model: no device in the label


def test_a_configuration_is_its_config_id_and_across_machines_its_settings():
    """Two runs whose settings columns match but whose config ids differ (a setting without a column, such
    as weight_decay, or a model at another local path): one report keeps them apart; compare, matching
    result sets from different machines, takes them for one configuration."""
    first = make_run(1, "lora")
    second = {**make_run(2, "lora"), "config_id": first["config_id"][:-8] + "0badcafe"}
    table = pd.DataFrame([first, second])
    apart = analysis.prepare(table)
    assert apart["config_key"].nunique() == 2
    assert apart["config_label"].is_unique  # the same readable name, told apart by the configuration's hash
    assert all(label.startswith("m-d-lora-r8-bf16-b16-s512 [") for label in apart["config_label"])
    assert analysis.prepare(table, across_machines=True)["config_key"].nunique() == 1
    assert analysis.prepare(table.assign(config_id=None))["config_key"].nunique() == 1  # older tables: settings


def test_run_labels_number_the_repeats():
    runs = analysis.prepare(fixture_runs("repeats")[0])
    labels = analysis.run_labels(runs)
    assert labels.is_unique and labels.index.tolist() == runs["run_id"].tolist()
    assert sorted(labels)[:3] == ["full #0", "full #1", "full #2"]


def test_accuracy_and_cost_marks_the_front_of_each_model():
    runs = analysis.prepare(pd.concat([fixture_runs("normal")[0], fixture_runs("normal")[0].assign(
        model="other", config_id=lambda t: t["config_id"].str.replace("m-d", "other-d"),
        run_id=lambda t: t["run_id"].str.replace("m-d", "other-d"))], ignore_index=True))
    points = analysis.accuracy_and_cost(analysis.configurations(runs))
    assert len(points) == 8
    for _, panel in points.groupby("model"):
        assert sorted(panel.loc[panel["on_front"], "method"]) == ["full", "lora", "lora"]  # qlora is dominated
        assert not panel["near_front"].any()  # no intervals (no steps, no eval rows): dominated is dominated


# ---------------------------------------------------------------------------------------------------
# Intervals, ties and unstable runs


def window(times: list[float], tokens: float = 1000.0, run_id: str = "r") -> pd.DataFrame:
    return pd.DataFrame({"run_id": run_id, "step": range(len(times)), "measured": True, "step_time_s": times, "tokens": tokens})


@pytest.mark.parametrize(("times", "unstable", "reason"), [
    ([1.0, 1.01, 0.99] * 10, False, None),
    # 9 consecutive slow steps of 30 pull the window mean 13% below the median-based figure (1 / 1.15)
    ([1.0] * 10 + [1.5] * 9 + [1.0] * 11, True, "window-mean tokens/s 13.0% below the median-based figure"),
    # a steady slowdown: the second half's median is 10% above the first's
    ([1.0] * 15 + [1.1] * 15, True, "step time rose 10.0% from the window's first half to its second"),
])
def test_window_figures_flag_unstable_runs(times, unstable, reason):
    figures = analysis.window_figures(window(times))
    assert figures["unstable"] is unstable
    assert figures["unstable_reason"] is None if reason is None else figures["unstable_reason"].startswith(reason)
    assert figures["low_ratio"] < 1 < figures["high_ratio"]


def test_step_figures_scale_the_table_throughput_and_skip_runs_without_a_window():
    runs = analysis.prepare(fixture_runs("mixed")[0])
    diverged = runs.loc[runs["status"] == "diverged", "run_id"].iloc[0]
    first = runs["run_id"].iloc[0]
    steps = pd.concat([window([0.9, 1.1] * 10, run_id=first), window([1.0] * 20, run_id=diverged)])
    figured = analysis.add_step_figures(runs, steps).set_index("run_id")
    ratio, low, high = uncertainty.ratio_interval([1000.0] * 20, [0.9, 1.1] * 10)
    assert figured.loc[first, ["tokens_per_s_low", "tokens_per_s_high"]].tolist() == pytest.approx(
        [15000 * low / ratio, 15000 * high / ratio])
    assert figured.loc[first, "unstable"] == False  # noqa: E712 - pandas' boolean
    # the median-based figure, 1,000 tokens / median 1.0 s against the window mean 20,000 / 20 s, scaled to the table's
    assert figured.loc[first, "tokens_per_s_median_based"] == pytest.approx(15000 * (1000 / 1.0) / (20000 / 20.0))
    assert pd.isna(figured.loc[diverged, "unstable"])  # a diverged run's steps are not a throughput
    assert figured["tokens_per_s_low"].notna().sum() == 1


def test_a_rate_from_one_measured_step_is_flagged_too_short_in_the_row_and_the_report():
    """A run stopped at its target after one measured step: its tokens/s and $ are one step's. The row says so
    (unstable, with the reason) and so does the report's note, never a bare figure."""
    from ftbench.report import report_page

    runs = analysis.prepare(fixture_runs("mixed")[0])
    first, second = runs["run_id"].iloc[0], runs["run_id"].iloc[1]
    steps = pd.concat([window([0.5], run_id=first), window([1.0, 1.01, 0.99] * 10, run_id=second)])
    figured = analysis.add_step_figures(runs, steps).set_index("run_id")
    assert figured.loc[first, "unstable"] == True and figured.loc[first, "window_steps"] == 1  # noqa: E712
    assert figured.loc[first, "unstable_reason"] == analysis.TOO_SHORT_REASON
    assert pd.isna(figured.loc[first, "tokens_per_s_low"])  # no interval from one step
    assert figured.loc[second, "unstable"] == False  # noqa: E712
    notes = report_page.unstable_notes(figured.reset_index())
    assert any(note.startswith(f"Run {first}: one measured step: too short to measure a rate") for note in notes), notes


def test_ties_are_configurations_whose_intervals_overlap_the_best():
    from test_report import fixture_runs as runs_and_steps

    runs, steps = runs_and_steps("tie")
    steps = pd.concat([frame.assign(run_id=run_id) for run_id, frame in steps.items()])
    configs = analysis.configurations(analysis.add_step_figures(analysis.prepare(runs), steps))
    speed = analysis.ranked(configs, "tokens_per_s", higher_is_better=True).set_index("configuration")
    assert speed["tied"].to_dict() == {"lora-r16": True, "lora-r8": True, "full": False, "qlora-r8": False}
    assert speed.loc["lora-r8", "interval_basis"] == "repeats: t-interval of the mean of 3"
    assert speed.loc["qlora-r8", "interval_basis"] == "within-run (1 run)"
    _, low, high = uncertainty.mean_interval([20000, 21500, 19000])
    assert (speed.loc["lora-r8", "tokens_per_s_low"], speed.loc["lora-r8", "tokens_per_s_high"]) == pytest.approx((low, high))
    accuracy = analysis.ranked(configs, "accuracy", higher_is_better=True)
    assert accuracy.loc[accuracy["tied"], "configuration"].tolist() == ["full"]  # 0.930 on 1,000 rows: beyond noise
    assert (accuracy.iloc[0]["accuracy_low"], accuracy.iloc[0]["accuracy_high"]) == pytest.approx(uncertainty.wilson(0.93, 1000))
    r16, r8 = speed.loc["lora-r16"], speed.loc["lora-r8"]
    repeats = analysis.to_separate(r16, r8, "tokens_per_s")["repeats"]
    assert 30 < repeats < 100  # 500 tokens/s apart, repeats spreading by ~1,000
    assert "eval_rows" in analysis.to_separate(configs.iloc[1], configs.iloc[0], "accuracy")
    assert "window" in analysis.to_separate(speed.loc["qlora-r8"], speed.loc["full"], "tokens_per_s")
    best = analysis.recommend(configs)
    assert best["best"]["configuration"] == "lora-r16" and best["tied"]["configuration"].tolist() == ["lora-r8"]


def test_repeat_scoring_trimmed_mean():
    rows = [make_run(200 + i, "lora", repeat=i, repeats=5, tokens_per_s=speed) for i, speed in enumerate([100, 200, 220, 400, 1000])]
    runs = analysis.prepare(pd.DataFrame(rows))
    assert analysis.configurations(runs)["tokens_per_s"].iloc[0] == 220
    trimmed = analysis.configurations(runs, "trimmed_mean")
    assert trimmed["tokens_per_s"].iloc[0] == pytest.approx((200 + 220 + 400) / 3)
    assert trimmed.attrs["scoring"] == "trimmed_mean"
    with pytest.raises(FtbenchError, match="repeat scoring 'mean'"):
        analysis.configurations(runs, "mean")


def test_timed_out_runs_count_for_throughput_not_for_quality():
    runs = analysis.prepare(fixture_runs("all_timeout")[0])
    configs = analysis.configurations(runs)
    assert configs["ok"].eq(0).all() and configs["measured"].eq(1).all()
    assert configs["tokens_per_s"].tolist() == [15000, 22000, 12000] and configs["accuracy"].isna().all()
    assert analysis.recommend(configs)["candidates"] == 0  # a recommendation needs a finished run
    assert analysis.unmeasured_counts(runs) == {}


def test_the_documented_run_figures_state_the_thresholds_the_analysis_applies():
    """columns.py cannot import analysis (analysis reads it): its text of unstable must follow the constants."""
    from ftbench.report.columns import COLUMNS

    meaning = COLUMNS["unstable"][1]
    assert f"more than {analysis.MEAN_MEDIAN_THRESHOLD:.0%} of the latter" in meaning
    assert f"first half's by more than {analysis.DRIFT_THRESHOLD:.0%}" in meaning
    assert set(analysis.RUN_FIGURES) <= set(COLUMNS)
