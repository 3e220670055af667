"""eval_before_training: the model as built, scored before the first step on the final evaluation's examples, with
the clock paused (train/evaluation.py), in both engines and under DDP; base_eval_* figures and the step-0 row of
evals.parquet. FSDP's ranks are checked in test_fsdp.py, the report's base figure in test_report.py.

The fast tests train the tiny BERT (and a tiny Llama, a tiny CLIP) for a few CPU steps in this process; the DDP
test starts two gloo ranks (slow marker).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from ftbench.data import prepared
from ftbench.measure import gpu_monitor
from ftbench.experiment import matrix
from ftbench.tasks import registry
from ftbench.experiment import base_evaluation
from ftbench.train import base_eval_job, ddp, evaluation, modeling, trainer

from test_families import _two_threads, bert_spec, llama_spec, prepare_for  # noqa: F401 - fixtures
from test_quality_target import measured_time
from test_retrieval import caption_dataset, caption_folder, experiment, prepare  # noqa: F401 - caption_folder: a fixture

# Scored figures a run with eval_before_training has twice: as built (base_*) and as trained.
CLASSIFIER_FIGURES = ("eval_accuracy", "eval_loss", "eval_samples")




def during(before_training: bool, every=None):
    spec = SimpleNamespace(eval_every=every, stop_at_target=False, target=None, eval_subset=None,
                           eval_before_training=before_training)
    return evaluation.DuringTraining(SimpleNamespace(spec=spec, eval_split=[0] * 10, task="classification"), evaluate=None)


def test_the_base_evaluation_is_due_before_the_first_step_with_or_without_eval_every():
    assert [s for s in range(7) if during(True).due(s, 6)] == [0]
    assert [s for s in range(7) if during(True, every=2).due(s, 6)] == [0, 2, 4]
    assert [s for s in range(7) if during(False).due(s, 6)] == []
    assert during(True).figures() == {} and during(True).paused_s == 0.0


@pytest.mark.parametrize("steps, every", [(40, 10), (45, 10), (62, 10), (6, 5), (7, 2)])
@pytest.mark.parametrize("before_training", [False, True])
def test_the_walltime_counts_the_subset_evaluations_the_trainer_schedules(steps, every, before_training):
    """cluster.resources asks for time for each subset evaluation DuringTraining.due schedules: the steps before
    which it evaluates, less step 0's where that is the evaluation before training (counted apart)."""
    from ftbench.cluster import resources

    scheduled = [s for s in range(steps) if during(before_training, every=every).due(s, steps)]
    subsets = len(scheduled) - (1 if before_training else 0)
    run = SimpleNamespace(eval_every=every, eval_before_training=before_training, planned_steps=lambda examples: steps)
    assert resources.evaluations_between_steps(run, 10_000) == subsets


def test_the_base_evaluation_s_memory_peak_is_not_left_to_training():
    """The peaks are reset after it: a forward pass at eval_batch_size must not become training's peak_rss_mb."""
    import numpy as np

    with evaluation.peaks_reset_after(torch.device("cpu"), []) as before:
        held = np.ones(96 * 2**20 // 8)  # 96 MiB, touched: the evaluation's own peak
        during_it = evaluation.peak_rss_mb()
        del held
    assert before is not None and evaluation.peak_rss_mb() < during_it - 48


# ---------------------------------------------------------------------------------------------------
# The untouched model: with a learning rate of 0 the base and the final evaluation score the same model


@pytest.mark.parametrize("engine", ["loop", "hf_trainer"])
def test_with_nothing_learnt_the_base_scores_equal_the_final_ones_and_the_untouched_model_s(engine, bert_spec,
                                                                                           prepared_data):
    folder, manifest = prepared_data
    # learning_rate 0 (the schema wants it above 0): every step leaves the weights as built.
    spec = bert_spec(engine=engine, eval_before_training=True, max_steps=2, warmup_steps=1).replace(learning_rate=0.0)
    metrics, steps = trainer.train_run(spec, folder)
    assert metrics["status"] == "ok", metrics["status_reason"]
    for figure in CLASSIFIER_FIGURES:
        assert metrics[f"base_{figure}"] == pytest.approx(metrics[figure], rel=1e-6), figure
    assert metrics["base_eval_samples"] == len(registry.load_split(folder, "eval", manifest))  # the whole split
    # The model as built, scored here: the run's base figures are its own.
    torch.manual_seed(spec.seed)
    built = modeling.build_model(spec, num_labels=len(manifest["label_names"]), device=torch.device("cpu"),
                                 pad_token_id=manifest["pad_token_id"])
    untouched = trainer.evaluate(built.model, registry.load_split(folder, "eval", prepared.verify(folder)), spec,
                                 "classification", torch.device("cpu"), manifest["pad_token_id"])
    assert metrics["base_eval_accuracy"] == untouched["eval_accuracy"]
    assert metrics["base_eval_loss"] == pytest.approx(untouched["eval_loss"], rel=1e-6)
    assert "evals" not in metrics or {row["step"] for row in metrics["evals"]} == {2}  # no step-0 row without eval_every


def test_a_language_model_s_base_evaluation_has_its_loss_and_perplexity(llama_data):
    metrics, _ = trainer.train_run(llama_spec(eval_before_training=True), llama_data)
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["base_eval_perplexity"] == pytest.approx(math.exp(metrics["base_eval_loss"]), rel=1e-6)
    assert 0 <= metrics["base_eval_token_accuracy"] <= 1 and metrics["base_eval_samples"] == metrics["eval_samples"]


@pytest.fixture(scope="module")
def llama_data(tmp_path_factory):
    return prepare_for(llama_spec(), tmp_path_factory.mktemp("base-llama-tokens"))


def test_a_retrieval_model_s_base_recall_is_the_untouched_model_s(tmp_path, caption_folder):  # noqa: F811
    prepare(caption_dataset(caption_folder), tmp_path)
    spec = matrix.expand_runs(experiment(caption_dataset(caption_folder), eval_before_training=True))[0]
    metrics, _ = trainer.train_run(spec.replace(learning_rate=0.0), tmp_path)
    assert metrics["status"] == "ok", metrics["status_reason"]
    for figure in ("eval_recall_at_1", "eval_recall_at_1_i2t", "eval_recall_at_1_t2i", "eval_loss"):
        assert metrics[f"base_{figure}"] == pytest.approx(metrics[figure], rel=1e-6), figure


# ---------------------------------------------------------------------------------------------------
# Off the clock: a slow base evaluation changes neither the steps' times nor the measured window

EVAL_DELAY_S = 1.0


@pytest.fixture
def slow_evaluation(monkeypatch):
    """Every evaluation takes EVAL_DELAY_S longer, far more than a tiny step: any of it on the clock would show."""
    evaluate = trainer.evaluate

    def slowly(*args, **kwargs):
        time.sleep(EVAL_DELAY_S)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", slowly)


@pytest.fixture
def sampler_calls(monkeypatch):
    """What the engines ask of their GPU sampler, in order, with the evaluations (trainer.evaluate) among them."""
    calls = []

    class RecordingSampler(gpu_monitor.GpuSampler):
        def start(self):
            calls.append("start")
            super().start()

        def pause(self):
            calls.append("pause")
            super().pause()

        def resume(self):
            calls.append("resume")
            super().resume()

        def stop(self):
            calls.append("stop")
            return super().stop()

    evaluate = trainer.evaluate

    def recorded_evaluate(*args, **kwargs):
        calls.append("evaluate")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(gpu_monitor, "GpuSampler", RecordingSampler)
    monkeypatch.setattr(trainer, "evaluate", recorded_evaluate)
    return calls


@pytest.mark.parametrize("engine", ["loop", "hf_trainer"])
def test_the_base_evaluation_is_kept_out_of_the_steps_and_the_measured_window(engine, bert_spec, prepared_data,
                                                                              slow_evaluation, sampler_calls):
    # warmup_steps 0: the measured window begins at the first step, right after the base evaluation.
    spec = bert_spec(engine=engine, eval_before_training=True, eval_every=2, eval_subset=16, max_steps=4, warmup_steps=0)
    metrics, steps = trainer.train_run(spec, prepared_data[0])
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert steps[0]["measured"] and max(step["step_time_s"] for step in steps) < EVAL_DELAY_S
    assert metrics["window_s"] == pytest.approx(measured_time(steps), rel=1e-6)
    assert metrics["tokens_per_s"] == pytest.approx(metrics["measured_tokens"] / measured_time(steps), rel=1e-6)
    # Its time is its own figure: not training's, not the evaluations' between steps (one, at step 2).
    assert metrics["base_eval_time_s"] >= EVAL_DELAY_S
    assert EVAL_DELAY_S <= metrics["eval_during_training_s"] < 2 * EVAL_DELAY_S
    assert metrics["evaluations_during_training"] == 1
    assert metrics["train_time_s"] < sum(step["step_time_s"] for step in steps) + EVAL_DELAY_S / 2
    # The step-0 row of evals.parquet is the base evaluation, on the whole split like the final one.
    rows = pd.DataFrame(metrics["evals"])
    accuracy = rows[rows["metric"] == "eval_accuracy"]
    assert accuracy["step"].tolist() == [0, 2, 4] and accuracy["evaluation"].tolist() == [0, 1, 2]
    assert accuracy["scope"].tolist() == ["full", "subset", "full"]
    assert accuracy["eval_samples"].tolist() == [metrics["eval_samples"], 16, metrics["eval_samples"]]
    assert accuracy["value"].iloc[0] == pytest.approx(metrics["base_eval_accuracy"])
    # The GPU sampler is paused for both evaluations during training: the base one's comes before its start, which
    # the sampler ignores (tests/test_measurement.py), the one at step 2 is left out of the window's energy.
    assert sampler_calls == ["pause", "evaluate", "resume", "start", "pause", "evaluate", "resume", "stop", "evaluate"]


# ---------------------------------------------------------------------------------------------------
# DDP: rank 0 scores the model as built, every rank waits for it, and it is the one-process run's base


@pytest.mark.slow
def test_ddp_ranks_agree_on_rank_0_s_base_evaluation(bert_spec, prepared_data, tmp_path):
    folder = prepared_data[0]
    settings = {"method": "full", "learning_rate": 0.0001, "eval_before_training": True, "eval_every": 2, "eval_subset": 16}
    single, _ = trainer.train_run(bert_spec(**settings), folder)
    spec = bert_spec(parallel="ddp", num_gpus=2, device="cpu", **settings)
    out = tmp_path / "run" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(folder),
                              "--out", str(out), "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, f"--- stdout\n{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-4000:]}"
    metrics, evals = json.loads(out.read_text())["metrics"], pd.read_parquet(out.with_name("evals.parquet"))
    ranks = ddp.read_rank_results(out.parent / "ranks")
    assert metrics["status"] == "ok", metrics["status_reason"]
    # The same model as built (seeded) as the one-process run's: the same base scores.
    assert metrics["base_eval_accuracy"] == single["base_eval_accuracy"]
    assert metrics["base_eval_loss"] == pytest.approx(single["base_eval_loss"], rel=1e-5)
    # Rank 0 scored; rank 1 waited with its clock paused too, and both trained every step.
    assert "base_eval_accuracy" not in ranks[1]["metrics"]
    assert [len(rank["steps"]) for rank in ranks] == [6, 6]
    for rank in ranks:
        assert rank["metrics"]["window_s"] == pytest.approx(measured_time(rank["steps"]), rel=1e-6)
    accuracy = evals[evals["metric"] == "eval_accuracy"]
    assert accuracy["step"].tolist() == [0, 2, 4, 6] and accuracy["scope"].tolist() == ["full", "subset", "subset", "full"]
    assert_ranks_met_before_the_first_step(ranks)
    assert "rank_meeting_s" not in metrics  # a rank's own figure, not the run's


def assert_ranks_met_before_the_first_step(ranks: list[dict]) -> None:
    """Each DDP rank's span at the meeting before its first step (rank_meeting_s: arrived, left; one monotonic clock
    for the ranks of a host): no rank left before the last one had arrived."""
    spans = [rank["metrics"]["rank_meeting_s"] for rank in ranks]
    assert len(spans) == 2 and max(arrived for arrived, _ in spans) <= min(left for _, left in spans), spans


# ---------------------------------------------------------------------------------------------------
# One evaluation before training for every run that starts from the same weights (rule base_eval)


def shared_id(bert_spec, **settings) -> str:
    return base_evaluation.base_eval_id(bert_spec(eval_before_training=True, **settings))


def test_runs_that_start_from_the_same_weights_share_one_key_and_others_do_not(bert_spec):
    full = shared_id(bert_spec, method="full", learning_rate=0.0001)
    # LoRA's B matrices start at zero: any rank, any learning rate, the fp32 model as built is the base model.
    assert shared_id(bert_spec, method="lora", lora_rank=4) == shared_id(bert_spec, method="lora", lora_rank=8,
                                                                        learning_rate=0.01) == full
    assert shared_id(bert_spec, method="qlora") != full  # a 4-bit base
    assert shared_id(bert_spec, method="qlora", qlora_double_quant=False) != shared_id(bert_spec, method="qlora")
    # A LoRA run's frozen base in its 16-bit compute dtype is another model than the fp32 one, and than full
    # fine-tuning's fp32 masters under the same autocast; with lora_base_dtype fp32 it is full's.
    bf16_lora, bf16_full = shared_id(bert_spec, method="lora", precision="bf16"), shared_id(bert_spec, method="full",
                                                                                            precision="bf16")
    assert len({bf16_lora, bf16_full, full}) == 3
    assert shared_id(bert_spec, method="lora", precision="bf16", lora_base_dtype="fp32") == bf16_full
    # A new head's initialisation (the seed), the rows scored and the eval batches are part of it.
    assert full not in {shared_id(bert_spec, method="full", seed=1), shared_id(bert_spec, method="full", max_eval_samples=10),
                        shared_id(bert_spec, method="full", eval_batch_size=8)}
    assert not base_evaluation.shares_base_evaluation(bert_spec(eval_before_training=False))
    assert base_evaluation.shares_base_evaluation(bert_spec(eval_before_training=True))


BASE_SETTINGS = {"eval_before_training": True, "eval_every": 2, "eval_subset": 16, "max_steps": 4, "warmup_steps": 1}


@pytest.fixture(scope="module")
def shared_base(bert_spec, prepared_data, tmp_path_factory):
    """The shared evaluation of the fp32 weights, computed by the job from a LoRA run standing for them."""
    spec = base_evaluation.evaluation_spec(bert_spec(method="lora", lora_rank=8, **BASE_SETTINGS))
    path = tmp_path_factory.mktemp("base-eval") / "shared.json"
    result = base_eval_job.run_job(spec, prepared_data[0], path, threads=2)
    assert result["status"] == "ok", result["reason"]
    return path, result


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_shared_evaluation_equals_what_each_run_computed_alone(method, bert_spec, prepared_data, shared_base):
    _, result = shared_base
    settings = {"method": method, **BASE_SETTINGS, **({"learning_rate": 0.0001} if method == "full" else {"lora_rank": 4})}
    alone, _ = trainer.train_run(bert_spec(**settings), prepared_data[0])
    assert alone["status"] == "ok", alone["status_reason"]
    assert base_evaluation.base_eval_key(bert_spec(**settings)) == result["key"]
    assert alone["base_eval_accuracy"] == result["figures"]["eval_accuracy"]
    assert alone["base_eval_samples"] == result["figures"]["eval_samples"]
    assert alone["base_eval_loss"] == pytest.approx(result["figures"]["eval_loss"], rel=1e-6)


def test_a_run_given_the_shared_evaluation_takes_its_figures_and_scores_nothing_before_training(
        bert_spec, prepared_data, shared_base, monkeypatch, sampler_calls):
    path, result = shared_base
    monkeypatch.setenv(evaluation.SHARED_BASE_ENV, str(path))
    metrics, steps = trainer.train_run(bert_spec(method="lora", lora_rank=16, **BASE_SETTINGS), prepared_data[0])
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["base_eval_accuracy"] == result["figures"]["eval_accuracy"]
    assert metrics["base_eval_loss"] == result["figures"]["eval_loss"]
    assert metrics["base_eval_time_s"] == result["eval_time_s"]
    # The step-0 row of evals.parquet is the shared evaluation's; the model was scored during and after training only.
    rows = pd.DataFrame(metrics["evals"])
    accuracy = rows[rows["metric"] == "eval_accuracy"]
    assert accuracy["step"].tolist() == [0, 2, 4] and accuracy["scope"].tolist() == ["full", "subset", "full"]
    assert accuracy["value"].iloc[0] == result["figures"]["eval_accuracy"]
    assert sampler_calls.count("evaluate") == 2


def test_a_shared_evaluation_of_other_weights_or_one_that_failed_is_not_taken(bert_spec, prepared_data, shared_base,
                                                                              tmp_path, monkeypatch, capsys):
    path, result = shared_base
    spec = bert_spec(method="lora", seed=1, **BASE_SETTINGS)  # another seed: another head, another key
    monkeypatch.setenv(evaluation.SHARED_BASE_ENV, str(path))
    assert evaluation.read_shared_base(spec) is None
    assert "it scored other weights" in capsys.readouterr().out
    failed = tmp_path / "failed.json"
    failed.write_text(json.dumps({**result, "status": "not_evaluated", "reason": "OutOfMemoryError: no room"}))
    monkeypatch.setenv(evaluation.SHARED_BASE_ENV, str(failed))
    same_key = bert_spec(method="lora", **BASE_SETTINGS)
    assert evaluation.read_shared_base(same_key) is None and "no room" in capsys.readouterr().out
    monkeypatch.setenv(evaluation.SHARED_BASE_ENV, "")
    assert evaluation.read_shared_base(same_key) is None


def test_a_model_the_shared_job_cannot_build_leaves_a_result_saying_why(bert_spec, prepared_data, tmp_path):
    """fp16 on a CPU: the job's result says so; the train jobs then meet it themselves (an unsupported row each)."""
    spec = bert_spec(method="full", precision="fp16", eval_before_training=True)
    result = base_eval_job.run_job(spec, prepared_data[0], tmp_path / "fp16.json")
    assert result["status"] == "not_evaluated" and "fp16" in result["reason"]
    assert json.loads((tmp_path / "fp16.json").read_text())["status"] == "not_evaluated"


@pytest.mark.slow
def test_the_shared_evaluation_of_a_4_bit_base_equals_what_the_qlora_run_computed_alone(bert_spec, prepared_data, tmp_path):
    spec = bert_spec(method="qlora", **BASE_SETTINGS)
    result = base_eval_job.run_job(base_evaluation.evaluation_spec(spec), prepared_data[0], tmp_path / "q.json", threads=2)
    alone, _ = trainer.train_run(spec, prepared_data[0])
    assert result["status"] == "ok" and alone["status"] == "ok", (result["reason"], alone["status_reason"])
    assert alone["base_eval_accuracy"] == result["figures"]["eval_accuracy"]
    assert alone["base_eval_loss"] == pytest.approx(result["figures"]["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_ddp_ranks_take_the_shared_evaluation_together(bert_spec, prepared_data, shared_base, tmp_path):
    """A DDP run given the shared evaluation: rank 0's row carries its figures, and both ranks meet once before the
    first step as they do after an evaluation scored in the job (no rank waits in a collective the other skipped)."""
    path, result = shared_base
    spec = bert_spec(method="lora", parallel="ddp", num_gpus=2, device="cpu", **BASE_SETTINGS)
    out = tmp_path / "run" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data",
                              str(prepared_data[0]), "--out", str(out), "--threads", "2"], capture_output=True, text=True,
                             timeout=300, env={**os.environ, evaluation.SHARED_BASE_ENV: str(path)})
    assert process.returncode == 0, f"--- stdout\n{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-4000:]}"
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert metrics["base_eval_accuracy"] == result["figures"]["eval_accuracy"]
    assert metrics["base_eval_time_s"] == result["eval_time_s"]
    ranks = ddp.read_rank_results(out.parent / "ranks")
    assert [len(rank["steps"]) for rank in ranks] == [4, 4]
    assert_ranks_met_before_the_first_step(ranks)
    # the step-0 row is the shared evaluation's (its figures and time), written once (rank 0)
    evals = pd.read_parquet(out.with_name("evals.parquet"))
    first = evals[(evals["step"] == 0) & (evals["metric"] == "eval_accuracy")]
    assert first["scope"].tolist() == ["full"] and first["evaluation"].tolist() == [0]
    assert first["value"].tolist() == [result["figures"]["eval_accuracy"]]
    assert first["eval_s"].tolist() == [result["eval_time_s"]]
