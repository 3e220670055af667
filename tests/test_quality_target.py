"""The cost of reaching a quality: evaluations during training (eval_every) kept off the clock, the quality
target read from them (report/quality_target.py), stop_at_target, and the quality-vs-cost figure.

The pure functions are tested on hand-made curves; the loop on the tiny BERT for 6 CPU steps (slow marker),
in both engines and under DDP over two gloo ranks.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from ftbench.errors import ConfigError
from ftbench.experiment import config as ftconfig
from ftbench.experiment import matrix
from ftbench.measure.metrics import EVAL_FIELDS, with_counts
from ftbench.report import figures, quality_target
from ftbench.train import ddp, evaluation, trainer

from test_families import BERT_DEFAULTS, only_spec

# ---------------------------------------------------------------------------------------------------
# Reading the target off a curve (pure functions)


def test_crossing_interpolates_between_the_two_evaluations_that_straddle_the_target():
    tokens, accuracy = [0, 1000, 2000, 3000], [0.55, 0.65, 0.75, 0.80]
    # 0.70 lies half way from 0.65 (1,000 tokens) to 0.75 (2,000 tokens).
    assert quality_target.crossing(tokens, accuracy, "eval_accuracy", 0.70) == pytest.approx(1500)
    # The first evaluation that reaches it counts, not a later dip and rise.
    assert quality_target.crossing([0, 10, 20, 30], [0.5, 0.8, 0.6, 0.9], "eval_accuracy", 0.7) == pytest.approx(20 / 3)
    # Exactly at an evaluation: that evaluation's tokens.
    assert quality_target.crossing(tokens, accuracy, "eval_accuracy", 0.75) == pytest.approx(2000)


def test_crossing_at_the_first_evaluation_and_never():
    assert quality_target.crossing([500, 1000], [0.9, 0.95], "eval_accuracy", 0.7) == 500  # no earlier point
    assert quality_target.crossing([0, 1000, 2000], [0.5, 0.6, 0.69], "eval_accuracy", 0.7) is None
    assert quality_target.crossing([], [], "eval_accuracy", 0.7) is None


def test_crossing_of_a_loss_goes_down_to_the_target():
    assert quality_target.crossing([0, 100, 200], [3.0, 2.0, 1.0], "eval_loss", 1.5) == pytest.approx(150)
    assert quality_target.crossing([0, 100], [3.0, 2.0], "eval_perplexity", 1.5) is None


def evals_frame(values, lows=None, highs=None, tokens=None, metric="eval_accuracy") -> pd.DataFrame:
    """One run's evaluations: subset ones every 1,000 tokens (100 s of steps each), the last one full."""
    n = len(values)
    tokens = tokens or [1000 * i for i in range(n)]
    lows = lows or [v - 0.05 for v in values]
    highs = highs or [v + 0.05 for v in values]
    return pd.DataFrame({"evaluation": range(n), "step": [10 * i for i in range(n)], "tokens": tokens,
                         "samples": [t // 10 for t in tokens], "train_s": [100.0 * i for i in range(n)],
                         "eval_s": 1.0, "scope": ["subset"] * (n - 1) + ["full"], "eval_samples": 256,
                         "metric": metric, "value": values, "low": lows, "high": highs})


def test_run_to_target_prices_the_tokens_at_the_run_s_own_rate():
    run = {"tokens_per_s": 10.0, "price_per_hour": 36.0, "billed_devices": 2}
    out = quality_target.run_to_target(evals_frame([0.55, 0.65, 0.75, 0.80]), {"metric": "eval_accuracy", "value": 0.70}, run)
    assert out["target_reached"] is True
    assert out["tokens_to_target"] == pytest.approx(1500)
    assert out["train_s_to_target"] == pytest.approx(150)
    assert out["hours_to_target"] == pytest.approx(1500 / 10 / 3600)
    assert out["gpu_hours_to_target"] == pytest.approx(2 * 1500 / 10 / 3600)
    assert out["cost_to_target"] == pytest.approx(1500 / 10 / 3600 * 36)
    # The band: the upper ends (0.60, 0.70, ...) reach 0.70 at 1,000 tokens; the lower ends (0.50, 0.60, 0.70) at 2,000.
    assert out["cost_to_target_low"] == pytest.approx(1000 / 10 / 3600 * 36)
    assert out["cost_to_target_high"] == pytest.approx(2000 / 10 / 3600 * 36)


def test_a_run_that_never_reaches_the_target_has_null_figures_and_reached_false():
    run = {"tokens_per_s": 10.0, "price_per_hour": 36.0, "billed_devices": 1}
    out = quality_target.run_to_target(evals_frame([0.55, 0.60, 0.62]), {"metric": "eval_accuracy", "value": 0.70}, run)
    assert out["target_reached"] is False
    assert all(out[c] is None for c in ("tokens_to_target", "hours_to_target", "cost_to_target", "gpu_hours_to_target"))
    # A run with no evaluation of the figure (it failed, or its task scores another) is not "not reached": null.
    none = quality_target.run_to_target(evals_frame([0.9], metric="eval_loss"), {"metric": "eval_accuracy", "value": 0.7}, run)
    assert none["target_reached"] is None and none["target_metric"] == "eval_accuracy"


def test_a_pessimistic_end_that_never_reaches_it_leaves_the_interval_unbounded():
    run = {"tokens_per_s": 10.0, "price_per_hour": 1.0, "billed_devices": 1}
    out = quality_target.run_to_target(evals_frame([0.60, 0.71], lows=[0.5, 0.65]), {"metric": "eval_accuracy", "value": 0.70}, run)
    assert out["target_reached"] and math.isinf(out["cost_to_target_high"])


def test_without_a_price_there_are_gpu_hours_but_no_dollars():
    run = {"tokens_per_s": 10.0, "price_per_hour": None, "billed_devices": 4}
    out = quality_target.run_to_target(evals_frame([0.5, 0.9]), {"metric": "eval_accuracy", "value": 0.7}, run)
    assert out["gpu_hours_to_target"] == pytest.approx(4 * 500 / 10 / 3600)
    assert out["cost_to_target"] is None


def test_evaluation_rows_take_their_counts_from_the_step_records():
    steps = [{"tokens": 100 + i, "samples": 8, "step_time_s": 0.5} for i in range(4)]
    rows = with_counts([{"step": 0}, {"step": 2}, {"step": 4}], steps)
    assert [r["tokens"] for r in rows] == [0, 100 + 101, sum(100 + i for i in range(4))]
    assert [r["samples"] for r in rows] == [0, 16, 32]
    assert [r["train_s"] for r in rows] == [0.0, 1.0, 2.0]


def test_evaluation_rows_have_wilson_intervals_for_proportions_only():
    rows = evaluation.eval_rows(("eval_loss", "eval_accuracy"), {"eval_samples": 200, "eval_loss": 0.6, "eval_accuracy": 0.7},
                                evaluation=3, step=30, scope="subset", eval_s=0.4)
    by_metric = {row["metric"]: row for row in rows}
    assert by_metric["eval_loss"]["low"] is None and by_metric["eval_loss"]["high"] is None
    low, high = by_metric["eval_accuracy"]["low"], by_metric["eval_accuracy"]["high"]
    assert low < 0.7 < high and high - low == pytest.approx(0.126, abs=0.005)  # +/- 6.3 points on 200 rows
    assert set(rows[0]) <= set(EVAL_FIELDS)


def test_the_eval_subset_is_fixed_seeded_and_the_same_for_every_run():
    first, again = evaluation.subset_indices(1000, 100), evaluation.subset_indices(1000, 100)
    assert len(first) == 100 and len(set(first)) == 100 and list(first) == sorted(first) and np.array_equal(first, again)
    np.random.seed(123)  # the global generator (training's) neither moves it nor is moved by it
    assert np.array_equal(evaluation.subset_indices(1000, 100), first)
    assert list(evaluation.subset_indices(50, 100)) == list(range(50))
    assert list(evaluation.subset_indices(50, None)) == list(range(50))


def during(every, target=None, total=6):
    spec = SimpleNamespace(eval_every=every, stop_at_target=target is not None, target=target, eval_subset=None,
                           eval_before_training=False)
    run = SimpleNamespace(spec=spec, eval_split=[0] * 10, task="classification")
    return evaluation.DuringTraining(run, evaluate=None)


def test_evaluations_are_due_every_n_steps_from_the_first_but_not_after_the_last():
    assert [s for s in range(7) if during(2).due(s, 6)] == [0, 2, 4]
    assert [s for s in range(7) if during(None).due(s, 6)] == []
    assert during(None).figures() == {}
    assert during(3).paused_within(None, 1.0) == 0.0


def test_an_evaluation_between_steps_pauses_the_gpu_sampler_between_the_synchronisations(monkeypatch, bert_spec):
    """The energy of the window must leave the evaluation out as its time does: the sampler is paused once the
    steps' kernels are done and resumed once the evaluation's are."""
    calls = []

    class Sampler:  # stands in for gpu_monitor.GpuSampler
        def pause(self):
            calls.append("pause sampler")

        def resume(self):
            calls.append("resume sampler")

    def evaluate(*args, **kwargs):
        calls.append("evaluate")
        return {"eval_samples": 10, "eval_accuracy": 0.5, "eval_loss": 0.7}

    monkeypatch.setattr(evaluation, "synchronize", lambda device: calls.append("synchronize"))
    run = SimpleNamespace(spec=bert_spec(eval_every=2), eval_split=[0] * 10, task="classification", model=torch.nn.Linear(1, 1),
                          device=torch.device("cpu"), pad_id=0, dist=SimpleNamespace(rank=0), stop=SimpleNamespace(deadline=None))
    evals = evaluation.DuringTraining(run, evaluate)
    evals.measure_with(Sampler())
    assert evals.pause(2, may_stop=True) is False
    assert calls == ["synchronize", "pause sampler", "evaluate", "synchronize", "resume sampler"]


# ---------------------------------------------------------------------------------------------------
# Configurations ranked by cost to target, and the figure


def configs_frame() -> pd.DataFrame:
    return pd.DataFrame({
        "configuration": ["a", "b", "c", "d"], "config_key": ["ka", "kb", "kc", "kd"], "ok": [1, 1, 1, 1],
        "reached": [1, 1, 1, 0], "cost_to_target": [1.0, 1.1, 3.0, math.nan],
        "cost_to_target_low": [0.8, 0.95, 2.5, math.nan], "cost_to_target_high": [1.2, 1.3, 3.5, math.nan],
        "gpu_hours_to_target": [1.0, 1.1, 3.0, math.nan]})


def test_the_ranking_by_cost_to_target_ties_within_noise_and_names_who_never_reached_it():
    result = quality_target.rank_to_target(configs_frame())
    assert result["basis"] == "cost"
    assert result["ranked"]["configuration"].tolist() == ["a", "b", "c"]
    assert result["ranked"]["tied"].tolist() == [True, True, False]  # b's interval overlaps a's; c's does not
    assert result["never"] == ["d"]


def curve_tables():
    runs = pd.DataFrame({
        "run_id": ["r1", "r2"], "status": ["ok", "ok"], "tokens_per_s": [100.0, 50.0], "config_key": ["k1", "k2"],
        "config_label": ["lora-r8", "full"], "method": ["lora", "full"], "model": ["m", "m"], "dataset": ["d", "d"],
        "price_per_hour": [0.05, 0.05], "billed_devices": [1, 1], "task": ["classification"] * 2,
        "target_metric": ["eval_accuracy"] * 2, "target_value": [0.7, 0.7]})
    evals = pd.concat([evals_frame([0.55, 0.65, 0.75, 0.80]).assign(run_id="r1"),
                       evals_frame([0.55, 0.60, 0.62]).assign(run_id="r2")], ignore_index=True)
    return runs, evals


def test_quality_curves_are_priced_at_each_run_s_rate():
    runs, evals = curve_tables()
    points, unit = quality_target.curves(runs, evals)
    assert unit == "$"
    r1 = points[points["config_key"] == "k1"]
    assert r1["x"].tolist() == pytest.approx([t / 100 / 3600 * 0.05 for t in (0, 1000, 2000, 3000)])
    assert r1["scope"].tolist()[-1] == "full"


def test_the_quality_vs_cost_figure_draws_a_curve_per_configuration_and_the_target(tmp_path):
    runs, evals = curve_tables()
    grid = figures.draw(figures.QUALITY_VS_COST, runs, evals)
    assert not isinstance(grid, str)
    ax = grid.axes.flat[0]
    assert any(line.get_linestyle() == "--" and list(line.get_ydata()) == [0.7, 0.7] for line in ax.get_lines())
    assert len([line for line in ax.get_lines() if len(line.get_xdata()) > 2]) == 2  # one curve each
    written = figures.save({"quality_vs_cost": grid}, tmp_path)
    assert written["quality_vs_cost"].is_file()
    assert figures.draw(figures.QUALITY_VS_COST, runs, evals.iloc[:0]).startswith("no run recorded evaluations")


# ---------------------------------------------------------------------------------------------------
# The target in the experiment: validated at parse time


def test_the_target_must_be_a_figure_some_run_produces(tiny_config_factory):
    config = tiny_config_factory(target={"metric": "eval_perplexity", "value": 10})
    with pytest.raises(ConfigError, match="target.metric.*eval_accuracy"):
        ftconfig.validate_config(config)  # the schema, then the references: the target's among them
    config = tiny_config_factory(target={"metric": "eval_accuracy", "value": 70})
    with pytest.raises(ConfigError, match=r"target.value.*\[0, 1\]"):
        ftconfig.check_target(config, matrix.expand_runs(config))
    with pytest.raises(Exception, match="metric"):
        ftconfig.validate_config(tiny_config_factory(target={"value": 0.7}))
    ftconfig.validate_config(tiny_config_factory(target={"metric": "eval_accuracy", "value": 0.7}))


def test_stop_at_target_needs_a_target_and_eval_every(tiny_config_factory):
    defaults = {**tiny_config_factory()["defaults"], "stop_at_target": True}
    config = tiny_config_factory(defaults=defaults)
    with pytest.raises(ConfigError, match="needs a target"):
        ftconfig.check_target(config, matrix.expand_runs(config))
    config = tiny_config_factory(defaults=defaults, target={"metric": "eval_accuracy", "value": 0.7})
    with pytest.raises(ConfigError, match="needs eval_every"):
        ftconfig.check_target(config, matrix.expand_runs(config))
    config = tiny_config_factory(defaults={**defaults, "eval_every": 2}, target={"metric": "eval_accuracy", "value": 0.7})
    runs = matrix.expand_runs(config)
    ftconfig.check_target(config, runs)
    assert all(run.target == {"metric": "eval_accuracy", "value": 0.7} for run in runs)
    # A run that does not stop at the target does not carry it: changing the target retrains nothing else.
    plain = tiny_config_factory(defaults={**defaults, "stop_at_target": False, "eval_every": 2},
                                target={"metric": "eval_accuracy", "value": 0.7})
    other = tiny_config_factory(defaults={**defaults, "stop_at_target": False, "eval_every": 2},
                                target={"metric": "eval_accuracy", "value": 0.8})
    assert [r.run_id for r in matrix.expand_runs(plain)] == [r.run_id for r in matrix.expand_runs(other)]


# ---------------------------------------------------------------------------------------------------
# The loop: evaluations between steps are off the clock (tiny BERT, 6 CPU steps)


@pytest.fixture(scope="module")
def bert_spec(tiny_config_factory):
    def make(target=None, **settings):
        sections = {"target": target} if target else {}
        config = tiny_config_factory(defaults={**BERT_DEFAULTS, **settings}, matrix={"model": ["tiny"], "dataset": ["tiny"]},
                                     **sections)
        return only_spec(config)

    return make


@pytest.fixture(autouse=True)
def _two_threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def with_and_without(bert_spec, prepared_data):
    """The same lora run trained without and with eval_every 2: {False: (metrics, steps), True: ...}. Every
    evaluation is made to last a further EVAL_PAUSE_S, far longer than a step, so a step that absorbed one
    would show it whatever the machine's load."""
    torch.set_num_threads(2)
    folder, _ = prepared_data
    evaluate = trainer.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(EVAL_PAUSE_S)
        return evaluate(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "evaluate", slow_evaluate)
        return {every is not None: trainer.train_run(bert_spec(eval_every=every, eval_subset=32), folder)
                for every in (None, 2)}


EVAL_PAUSE_S = 2.0


def measured_time(steps: list[dict]) -> float:
    return sum(step["step_time_s"] for step in steps if step["measured"])


@pytest.mark.slow
def test_evaluations_during_training_are_kept_out_of_the_measured_window(with_and_without):
    metrics, steps = with_and_without[True]
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["evaluations_during_training"] == 3 and metrics["eval_during_training_s"] > 0
    # The window is the measured steps' own time: the evaluation at step 4 (inside the window) is not in it.
    assert metrics["window_s"] == pytest.approx(measured_time(steps), rel=1e-6)
    assert metrics["tokens_per_s"] == pytest.approx(metrics["measured_tokens"] / measured_time(steps), rel=1e-6)
    # Without eval_every the same identity holds: the window was always the steps back to back.
    plain, plain_steps = with_and_without[False]
    assert plain["window_s"] == pytest.approx(measured_time(plain_steps), rel=1e-6)
    assert "evals" not in plain or all(row["scope"] == "full" for row in plain["evals"])


@pytest.mark.slow
def test_evaluations_during_training_change_neither_the_training_nor_its_step_times(with_and_without):
    (plain, plain_steps), (evaluated, steps) = with_and_without[False], with_and_without[True]
    # The same batches and the same updates: evaluation consumes no random numbers and changes no weights.
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in plain_steps], rel=1e-5)
    assert [s["tokens"] for s in steps] == [s["tokens"] for s in plain_steps]
    assert evaluated["eval_accuracy"] == pytest.approx(plain["eval_accuracy"])
    # No step absorbed an evaluation: each lasts EVAL_PAUSE_S more than it would, steps a small fraction of that.
    assert evaluated["eval_during_training_s"] >= 3 * EVAL_PAUSE_S
    assert max(s["step_time_s"] for s in steps if s["measured"]) < EVAL_PAUSE_S / 2
    # And step times alike with and without (within the noise of a shared CPU).
    ratio = np.median([s["step_time_s"] for s in steps]) / np.median([s["step_time_s"] for s in plain_steps])
    assert 1 / 3 < ratio < 3


@pytest.mark.slow
def test_a_qlora_run_trains_the_same_with_evaluations_between_its_steps(bert_spec, prepared_data):
    # On a CPU with AVX512-BF16, bitsandbytes would repack the 4-bit weights for inference at the first
    # evaluation and the next training step would fail (evaluation.training_layout_kept).
    folder = prepared_data[0]
    plain, plain_steps = trainer.train_run(bert_spec(method="qlora"), folder)
    metrics, steps = trainer.train_run(bert_spec(method="qlora", eval_every=2, eval_subset=16), folder)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["evaluations_during_training"] == 3
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in plain_steps], rel=1e-5)


@pytest.mark.slow
def test_each_evaluation_is_recorded_with_its_counts_and_interval(with_and_without):
    metrics, steps = with_and_without[True]
    rows = pd.DataFrame(with_counts(metrics["evals"], steps), columns=EVAL_FIELDS)
    accuracy = rows[rows["metric"] == "eval_accuracy"]
    assert accuracy["step"].tolist() == [0, 2, 4, 6]
    assert accuracy["scope"].tolist() == ["subset"] * 3 + ["full"]
    assert accuracy["eval_samples"].tolist() == [32, 32, 32, metrics["eval_samples"]]
    assert accuracy["tokens"].tolist() == [sum(s["tokens"] for s in steps[:k]) for k in (0, 2, 4, 6)]
    assert accuracy["train_s"].iloc[-1] == pytest.approx(sum(s["step_time_s"] for s in steps))
    assert accuracy["value"].iloc[-1] == pytest.approx(metrics["eval_accuracy"])
    assert (accuracy["low"] <= accuracy["value"]).all() and (accuracy["value"] <= accuracy["high"]).all()
    assert rows[rows["metric"] == "eval_loss"]["low"].isna().all()


@pytest.mark.slow
def test_stop_at_target_stops_once_reached_inside_the_window_with_status_ok(bert_spec, prepared_data):
    # Any accuracy reaches 0: the first evaluation inside the measured window (step 4; warmup is 2) stops it.
    spec = bert_spec(eval_every=2, eval_subset=16, stop_at_target=True, target={"metric": "eval_accuracy", "value": 0.0})
    metrics, steps = trainer.train_run(spec, prepared_data[0])
    assert metrics["status"] == "ok" and metrics["stopped_at_target"] is True
    assert len(steps) == 4 and metrics["measured_steps"] == 2 and metrics["total_steps"] == 6
    assert metrics["eval_accuracy"] is not None  # the final evaluation on the whole split still happens
    assert metrics["window_s"] == pytest.approx(measured_time(steps), rel=1e-6)


@pytest.mark.slow
def test_the_hf_trainer_engine_evaluates_off_the_clock_too(bert_spec, prepared_data):
    metrics, steps = trainer.train_run(bert_spec(engine="hf_trainer", eval_every=2, eval_subset=16), prepared_data[0])
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["evaluations_during_training"] == 3
    assert metrics["window_s"] == pytest.approx(measured_time(steps), rel=1e-6)
    assert sorted({row["step"] for row in metrics["evals"]}) == [0, 2, 4, 6]


# ---------------------------------------------------------------------------------------------------
# DDP: rank 0 evaluates, both ranks stop at the same step


@pytest.fixture(scope="module")
def ddp_stopped(bert_spec, prepared_data, tmp_path_factory):
    spec = bert_spec(method="full", learning_rate=0.0001, parallel="ddp", num_gpus=2, device="cpu", eval_every=2,
                     eval_subset=16, stop_at_target=True, target={"metric": "eval_accuracy", "value": 0.0})
    out = tmp_path_factory.mktemp("ddp-target") / "run" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run(
        [sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(prepared_data[0]),
         "--out", str(out), "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, f"--- stdout\n{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-4000:]}"
    return (json.loads(out.read_text())["metrics"], pd.read_parquet(out.with_name("evals.parquet")),
            ddp.read_rank_results(out.parent / "ranks"))


@pytest.mark.slow
def test_ddp_ranks_agree_on_rank_0_s_evaluation_and_stop_together(ddp_stopped):
    metrics, evals, ranks = ddp_stopped
    assert metrics["status"] == "ok" and metrics["stopped_at_target"] is True
    assert [len(rank["steps"]) for rank in ranks] == [4, 4]  # both stopped at step 4
    assert ranks[1]["metrics"].get("stopped_at_target") is True
    # Only rank 0 evaluated: its rows are the run's, rank 1 has none.
    assert not ranks[1]["metrics"].get("evals")
    accuracy = evals[evals["metric"] == "eval_accuracy"]
    assert accuracy["step"].tolist() == [0, 2, 4, 4] and accuracy["scope"].tolist()[-1] == "full"
    # Tokens are both ranks' (the merged steps): two slices of every global batch.
    assert accuracy["samples"].tolist() == [0, 2 * 2 * 8, 4 * 2 * 8, 4 * 2 * 8]
