"""Issue 7: failures become results, nothing is lost or faked, bad input is refused before any job runs.

Out-of-memory errors, NaN losses and crashes are injected on the CPU with the test-only
``FTBENCH_INJECT_FAULT`` variable (scripts/ftbench/train/faults.py). Covered here:

- injected OOM -> status=oom row (single process, and on one of two gloo DDP ranks in bounded time,
  also when the other rank is stuck); the report renders it;
- injected NaN -> status=diverged, stopped before the optimizer step; non-ok runs are left out of the
  throughput figures (GradScaler skips are counted: tests/test_optimizers.py, as fp16 needs a GPU);
- an error in a training job (an unknown exception, a known one such as lora_targets the model lacks,
  a crashing DDP rank) is a failed row with its one-line reason, the traceback in the job log; the other
  runs are collected, the report is built, and the end of the invocation summarises the outcomes;
- SIGKILL of a training job under --keep-going, SIGKILL of Snakemake then --rerun-incomplete, two
  concurrent invocations (the lock), a full disk (RLIMIT_FSIZE) while writing results, a tampered shard
  through the train command, an experiment where every run fails;
- auto_batch_size: a run that finds its batch against an injected memory limit (the search itself:
  tests/test_batch_size_search.py);
- bad input: one line naming the key or file, from validation and from ``snakemake -n``.

Already covered elsewhere (not repeated): 50+ malformed configs, each checked for its message
(tests/test_config.py); bit-flipped, truncated, replaced and missing shards refused naming the shard
(tests/test_data.py, and tests/test_trainer.py before training); a GPU missing from the price table gives
a warning and null cost (tests/test_cost.py::test_gpu_missing_from_the_price_table_warns_and_gets_no_cost);
an experiment of unsupported runs (fp16 and 4 GPUs on a CPU) still gives its table
(tests/test_families.py::test_unsupported_rows_do_not_crash_the_dag).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from conftest import (
    SNAKEFILE, _snakemake_command, job_counts, snakemake_failure, train_run_ids, write_config,
)
from ftbench.tasks import registry
from ftbench.report import analysis, collect, report_page
from ftbench import atomic, cli, errors
from ftbench.data import prepared
from ftbench.train import faults, trainer
from ftbench.cluster import lifeline
from ftbench.experiment import matrix
from ftbench.measure.metrics import STEP_FIELDS
from ftbench.runspec import RunSpec
from ftbench.experiment import config as ftbench_config
from ftbench.report.columns import COLUMNS
from ftbench.errors import ConfigError

ENV = faults.ENV
TRAIN_COMMAND = [sys.executable, "-m", "ftbench", "train"]
MARKER = re.compile(rf"ftbench: {ENV} \(test-only\): (?P<what>[^(]+) \(pid (?P<pid>\d+), rank (?P<rank>\d+)\)")

# The tiny BERT on the CPU: 6 steps of 8 examples (2 warmup), about a second a run.
CPU_DEFAULTS = {
    "method": "lora", "precision": "fp32", "batch_size": 8, "seq_len": 32, "lora_rank": 4,
    "lora_targets": ["query", "value"], "learning_rate": 0.001, "max_steps": 6, "warmup_steps": 2,
    "eval_batch_size": 64, "device": "cpu", "num_gpus": 0, "seed": 0,
}
# Three runs for the workflow tests: full, lora-r4 and lora-r8, told apart by these run-id fragments.
THREE_RUNS = {"model": ["tiny"], "dataset": ["tiny"], "method": ["full", "lora"], "lora_rank": [4, 8]}
FULL, LORA4, LORA8 = "-full-", "-lora-r4-", "-lora-r8-"


@pytest.fixture(autouse=True)
def _no_inherited_fault(monkeypatch):
    """No test sees a fault another test (or the caller's shell) set."""
    monkeypatch.delenv(ENV, raising=False)
    torch.set_num_threads(2)


@pytest.fixture
def keep_sigterm():
    """cli.train installs a SIGTERM handler (the scheduler's stop request): restore pytest's afterwards."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def cpu_spec(tiny_config_factory):
    """``cpu_spec(**settings)``: the single run spec of the tiny BERT on the CPU with these settings."""

    def make(**settings) -> dict:
        config = tiny_config_factory(defaults={**CPU_DEFAULTS, **settings}, matrix={"model": ["tiny"], "dataset": ["tiny"]})
        runs = matrix.expand_runs(config)
        assert len(runs) == 1
        return runs[0]

    return make


def run_id_with(config: dict, fragment: str) -> str:
    (run_id,) = [run.run_id for run in matrix.expand_runs(config) if fragment in run.run_id]
    return run_id


def write_result(folder: Path, spec: dict, metrics: dict, steps: list[dict]) -> Path:
    """What the train command writes for a run: steps.parquet, then metrics.json."""
    out = folder / spec.run_id / "metrics.json"
    atomic.write_parquet(out.with_name("steps.parquet"), pd.DataFrame(steps, columns=STEP_FIELDS))
    atomic.write_json(out, {"spec": spec.to_dict(), "metrics": metrics, "environment": {}})
    return out


def train_command(spec: dict, data_dir: Path, out: Path, fault: str | None = None, timeout: float = 300, **popen):
    """`python -m ftbench train` as the train rule runs it, in a subprocess; (CompletedProcess, seconds)."""
    env = {key: value for key, value in os.environ.items() if key != ENV}
    if fault:
        env[ENV] = fault
    started = time.monotonic()
    process = subprocess.run(
        [*TRAIN_COMMAND, "--spec", spec.to_json(), "--data", str(data_dir), "--out", str(out),
         "--threads", "2"],
        capture_output=True, text=True, timeout=timeout, env=env, **popen,
    )
    return process, time.monotonic() - started


def output_of(process) -> str:
    return f"--- stdout\n{process.stdout[-4000:]}\n--- stderr\n{process.stderr[-6000:]}"


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if text in cmdline and state != "Z":
                found.append(int(entry.name))
    return found


# ---------------------------------------------------------------------------------------------------
# The fault-injection hook itself


def test_fault_grammar():
    assert faults.parse("") == []
    assert faults.parse("oom@3") == [faults.Fault("oom", step=3)]
    assert faults.parse("nan@2:run=lora-r4, oom@3:rank1") == [
        faults.Fault("nan", step=2, run="lora-r4"), faults.Fault("oom", step=3, rank=1)]
    assert faults.parse("sleep@2=30") == [faults.Fault("sleep", step=2, value=30.0)]
    assert faults.parse("oom_above_batch=8") == [faults.Fault("oom_above_batch", value=8)]
    for bad in ("oom", "oom@x", "boom@2", "sleep@2", "oom@2:gpu1", "oom_above_batch=x"):
        with pytest.raises(ValueError, match=ENV) as caught:
            faults.parse(bad)
        assert "\n" not in str(caught.value)


def test_faults_apply_to_their_rank_and_run_only():
    parsed = faults.parse("oom@3:rank1,nan@2:run=-lora-")
    assert [f.kind for f in faults.Injector(parsed, "x-lora-r4-abc", rank=1).faults] == ["oom", "nan"]
    assert [f.kind for f in faults.Injector(parsed, "x-full-abc", rank=0).faults] == []
    assert not faults.Injector([], "x")
    injector = faults.Injector(parsed, "x-full-abc", rank=1)
    injector.before_step(2)
    with pytest.raises(torch.OutOfMemoryError, match=ENV):
        injector.before_step(3)
    injector.before_step(3)  # a step fault fires once


# ---------------------------------------------------------------------------------------------------
# OOM and divergence in one process: status rows, never a crash


@pytest.mark.slow
def test_injected_oom_becomes_an_oom_row(cpu_spec, prepared_data, monkeypatch, capfd):
    monkeypatch.setenv(ENV, "oom@3")
    metrics, steps = trainer.train_run(cpu_spec(), prepared_data[0])
    assert metrics["status"] == "oom"
    assert metrics["last_step"] == 3  # the step it reached
    assert "out of memory" in metrics["status_reason"] and "\n" not in metrics["status_reason"]
    assert metrics.get("tokens_per_s") is None and metrics.get("eval_accuracy") is None  # nothing faked
    assert metrics["peak_rss_mb"] > 0 and metrics["wall_time_s"] > 0
    assert steps == []
    # The job log says a fault was injected: an injected OOM can never pass for a real one.
    assert f"{ENV} (test-only): out of memory at step 3" in capfd.readouterr().err


@pytest.mark.slow
def test_injected_nan_diverges_before_the_optimizer_step(cpu_spec, prepared_data, monkeypatch):
    optimizer_steps = []
    real_step = trainer.scaler_step

    def counting(scaler, optimizer):
        optimizer_steps.append(1)
        return real_step(scaler, optimizer)

    monkeypatch.setattr(trainer, "scaler_step", counting)
    monkeypatch.setenv(ENV, "nan@4")
    metrics, steps = trainer.train_run(cpu_spec(), prepared_data[0])
    assert metrics["status"] == "diverged"
    assert metrics["diverged_step"] == 4 and metrics["last_step"] == 4
    assert "nan" in metrics["status_reason"] and "step 4" in metrics["status_reason"]
    assert len(optimizer_steps) == 4  # steps 0-3 updated the weights; step 4 stopped before its update
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and all(math.isfinite(s["loss"]) for s in steps)
    assert metrics.get("eval_accuracy") is None
    # Steps 2 and 3 were measured: the row has a throughput, which the report must leave out (below).
    assert metrics["measured_steps"] == 2 and metrics["tokens_per_s"] > 0


@pytest.mark.slow
def test_a_fused_optimizer_skips_a_nan_steps_update_on_the_device(cpu_spec, prepared_data, monkeypatch):
    """Where the optimizer can skip a non-finite loss's update itself (fused AdamW, CUDA's default), the loop
    launches the update without waiting for the loss: step 4's update runs with found_inf set and leaves the
    weights, moments and step count as step 3 left them; the run still stops as diverged at step 4."""
    made = []

    def fused_adamw(spec, model, device):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.learning_rate, fused=True)
        after_each_step = []
        optimizer.register_step_post_hook(
            lambda opt, args, kwargs: after_each_step.append([p.detach().clone() for p in opt.param_groups[0]["params"]]))
        made.append((optimizer, after_each_step))
        return optimizer

    monkeypatch.setattr(trainer, "make_optimizer", fused_adamw)
    monkeypatch.setenv(ENV, "nan@4")
    metrics, steps = trainer.train_run(cpu_spec(), prepared_data[0])
    ((optimizer, after_each_step),) = made
    assert metrics["status"] == "diverged" and metrics["diverged_step"] == 4 and "nan" in metrics["status_reason"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and all(math.isfinite(s["loss"]) for s in steps)
    assert len(after_each_step) == 5  # step 4's update was launched...
    assert all(torch.equal(a, b) for a, b in zip(after_each_step[3], after_each_step[4]))  # ...and changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(after_each_step[2], after_each_step[3]))  # as a finite step does
    assert {state["step"].item() for state in optimizer.state.values()} == {4.0}


def plain_fused_adamw(spec, model, device):
    """What CUDA runs get by default, on the CPU: an optimizer that skips a non-finite loss's update on the device,
    which is what lets the measured window read each loss a step late."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.learning_rate, fused=True)


@pytest.mark.slow
def test_a_nan_read_a_step_late_ends_the_run_before_an_evaluation_is_due(cpu_spec, prepared_data, monkeypatch):
    """The window reads step 3's loss at step 4; an evaluation due before step 4 must not score (nor stop at
    target) a run that has already diverged."""
    monkeypatch.setattr(trainer, "make_optimizer", plain_fused_adamw)
    monkeypatch.setenv(ENV, "nan@3")
    metrics, steps = trainer.train_run(cpu_spec(eval_every=2, max_steps=8), prepared_data[0])
    assert metrics["status"] == "diverged" and metrics["diverged_step"] == 3 and metrics["last_step"] == 3
    assert [s["step"] for s in steps] == [0, 1, 2]
    # The base evaluation (step 0) and the one due before step 2; none at step 4, after the NaN.
    assert {row["step"] for row in metrics["evals"]} == {0, 2} and metrics["evaluations_during_training"] == 2


@pytest.mark.slow
def test_a_nan_on_the_last_step_is_read_when_the_window_closes(cpu_spec, prepared_data, monkeypatch):
    monkeypatch.setattr(trainer, "make_optimizer", plain_fused_adamw)
    monkeypatch.setenv(ENV, "nan@5")
    metrics, steps = trainer.train_run(cpu_spec(), prepared_data[0])
    assert metrics["status"] == "diverged" and metrics["diverged_step"] == 5 and metrics["last_step"] == 5
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4] and metrics["measured_steps"] == 3


@pytest.mark.slow
def test_an_oom_inside_the_window_leaves_its_measured_steps_out_of_overhead(cpu_spec, prepared_data, monkeypatch):
    """The window's steps are timed on the device's clock when it closes; an OOM ends the loop before that, and
    overhead_s (the job outside its steps) must still end at the last step, not at the last warmup step."""
    monkeypatch.setenv(ENV, "sleep@3=1,sleep@4=1,oom@5")
    metrics, _ = trainer.train_run(cpu_spec(), prepared_data[0])
    assert metrics["status"] == "oom" and metrics["last_step"] == 5
    assert metrics["overhead_s"] < metrics["wall_time_s"] - 2.0  # the two slept seconds are steps, not overhead


def test_the_deadline_estimate_never_takes_a_launch_time_for_a_step_time():
    """In the window a step's time is the host's until the window closes: right after the window begins, a GPU-bound
    step's host time is its launch time alone; the deadline reads the last warmup step's (synced) time then."""
    warmup = [{"measured": False, "step_time_s": 0.5}, {"measured": False, "step_time_s": 0.4}]
    assert trainer._recent_step_s([], None) == 0.0
    assert trainer._recent_step_s(warmup, None) == 0.4  # before the window: the last step's, synced
    assert trainer._recent_step_s(warmup + [{"measured": True, "step_time_s": 0.03}], 2) == 0.4
    assert trainer._recent_step_s(warmup + [{"measured": True, "step_time_s": 0.6}], 2) == 0.6
    assert trainer._recent_step_s([{"measured": True, "step_time_s": 0.03}], 0) == 0.03  # no warmup to fall back on


@pytest.mark.slow
def test_sigterm_leaves_no_result_and_keeps_the_measurements_in_the_log(cpu_spec, prepared_data, tmp_path,
                                                                          monkeypatch, keep_sigterm, capfd):
    """scancel (SIGTERM) mid-run: the job fails with one line and writes neither metrics.json nor
    steps.parquet, so that a file finished after Snakemake has given the job up can never pass for a
    result (the next invocation must train the run again); what it measured goes to the log."""
    real_step = trainer.scaler_step
    steps_done = []

    def signalled_after_the_third_step(scaler, optimizer):
        steps_done.append(1)
        if len(steps_done) == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through cli.train's real handler
        return real_step(scaler, optimizer)

    monkeypatch.setattr(trainer, "scaler_step", signalled_after_the_third_step)
    out = tmp_path / "run" / "metrics.json"
    spec = cpu_spec(max_steps=50, warmup_steps=1)
    with pytest.raises(errors.TerminatedError, match=r"terminated \(SIGTERM\) at step 3 of 50 \(cancelled or preempted: nothing to fix\): no result written; Snakemake submits it again if it has retries left"):
        cli.train(["--spec", spec.to_json(), "--data", str(prepared_data[0]), "--out", str(out)])
    assert len(steps_done) == 3  # it stopped before step 3, not at the end of the run
    assert not out.exists() and not out.with_name("steps.parquet").exists()
    logged = capfd.readouterr().out
    assert "measured before it was terminated" in logged and '"status": "terminated"' in logged
    assert '"measured_steps": 2' in logged


@pytest.mark.slow
def test_deadline_stop_is_a_result(cpu_spec, prepared_data, tmp_path, keep_sigterm, capfd):
    """The job's own deadline (--time-limit-s) is not a termination: status=timeout is written as a result. Its log
    shows its progress (train/progress.py): a line after the first step, naming the time limit that will stop it."""
    out = tmp_path / "run" / "metrics.json"
    spec = cpu_spec(max_steps=100_000, warmup_steps=1)
    cli.train(["--spec", spec.to_json(), "--data", str(prepared_data[0]), "--out", str(out), "--time-limit-s", "8"])
    assert re.search(r"^progress: step 1 of 100000 \(0%\), [0-9,]+ tokens/s, \d+s elapsed, about .* left at this pace; "
                     r"its time limit stops it in \ds, loss \d", capfd.readouterr().out, re.M)
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["status"] == "timeout" and "time limit" in metrics["status_reason"]
    # Evaluated in the job's margin: the accuracy of the model it trained, with the steps it did.
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["eval_samples"] > 0 and metrics["eval_time_s"] < 1
    assert metrics["last_step"] >= 0 and metrics["total_steps"] == 100_000
    # the job's own time stayed within its limit (wall_time_s counts from the process start: here pytest's)
    assert metrics["load_time_s"] + metrics["train_time_s"] + metrics["eval_time_s"] < 8


@pytest.mark.slow
def test_unknown_exception_propagates_out_of_the_trainer(cpu_spec, prepared_data, monkeypatch):
    """The trainer fakes no status for an unknown error: the job turns it into a failed row (below)."""
    monkeypatch.setenv(ENV, "error@1")
    with pytest.raises(RuntimeError, match="injected failure at step 1"):
        trainer.train_run(cpu_spec(), prepared_data[0])


@pytest.mark.slow
def test_runs_without_a_grad_scaler_have_no_skip_count(cpu_spec, prepared_data):
    metrics, _ = trainer.train_run(cpu_spec(), prepared_data[0])
    assert metrics["status"] == "ok"
    assert metrics["grad_scaler_skipped_steps"] is None  # null (no fp16), never 0


@pytest.mark.slow
def test_failed_runs_are_rows_of_the_table_and_left_out_of_throughput(cpu_spec, prepared_data, monkeypatch, tmp_path):
    """oom, diverged and ok runs collected into the documented table; the report renders, and only the
    ok run counts in the throughput figures and the configuration summary."""
    results = []
    for fault, settings in (("oom@3", {"method": "full", "learning_rate": 0.0001}), ("nan@3", {"lora_rank": 4}),
                            (None, {"lora_rank": 8})):
        if fault:
            monkeypatch.setenv(ENV, fault)
        else:
            monkeypatch.delenv(ENV)
        spec = cpu_spec(**settings)
        results.append(write_result(tmp_path / "runs", spec, *trainer.train_run(spec, prepared_data[0])))
    table = collect.collect(results, tmp_path / "metrics.parquet", tmp_path / "metrics.csv")
    assert list(table.columns) == list(COLUMNS)
    assert table["status"].tolist() == ["oom", "diverged", "ok"]
    assert table["last_step"].tolist() == [3, 3, 5]
    diverged = table.iloc[1]
    assert diverged["tokens_per_s"] > 0  # it measured one step before diverging...

    runs = analysis.prepare(table)
    configs = analysis.configurations(runs).set_index("configuration")
    throughput = configs["tokens_per_s"].dropna()
    assert len(throughput) == 1  # ...but the throughput figure shows the ok run alone
    assert throughput.iloc[0] == pytest.approx(table.iloc[2]["tokens_per_s"])
    assert configs["ok"].tolist() == [0, 0, 1]
    assert configs["tokens_per_s"].notna().sum() == 1

    written = report_page.build_report(tmp_path / "metrics.parquet", [p.with_name("steps.parquet") for p in results],
                                  tmp_path / "figures", tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert 'class="status-oom"' in html and 'class="status-diverged"' in html
    assert "out of memory at step 3" in html and "loss became nan at step 3" in html
    assert isinstance(written["throughput"], Path)


# ---------------------------------------------------------------------------------------------------
# auto_batch_size


@pytest.mark.slow
def test_auto_batch_size_finds_the_injected_limit_and_measures_at_it(cpu_spec, prepared_data, monkeypatch):
    monkeypatch.setenv(ENV, "oom_above_batch=16")
    spec = cpu_spec(auto_batch_size=True, batch_size=4)
    assert spec.auto_batch_size is True and "-autobs-" in spec.run_id
    metrics, steps = trainer.train_run(spec, prepared_data[0])
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert (metrics["auto_batch_size_found"], metrics["auto_batch_size_oom_at"]) == (16, 32)
    assert metrics["auto_batch_size_trials"] == [[4, True], [8, True], [16, True], [32, False]]
    assert metrics["batch_size"] == 16
    assert [s["samples"] for s in steps] == [16] * 6  # measured at the batch found
    assert metrics["tokens_per_s"] > 0 and 0 <= metrics["eval_accuracy"] <= 1


@pytest.mark.slow
def test_auto_batch_size_trials_leave_training_unchanged(cpu_spec, prepared_data, monkeypatch):
    """The trials (learning rate 0, random state given back) do not change what is then measured: the
    same losses as a plain run at the batch found."""
    plain_metrics, plain = trainer.train_run(cpu_spec(method="full", learning_rate=0.0001), prepared_data[0])
    monkeypatch.setenv(ENV, "oom_above_batch=8")
    metrics, steps = trainer.train_run(cpu_spec(method="full", learning_rate=0.0001, auto_batch_size=True), prepared_data[0])
    assert metrics["auto_batch_size_trials"] == [[8, True], [16, False]]
    assert [s["loss"] for s in steps] == [s["loss"] for s in plain]
    assert metrics["eval_accuracy"] == plain_metrics["eval_accuracy"]


@pytest.mark.slow
def test_auto_batch_size_capped_by_the_setting_and_the_data(cpu_spec, prepared_data):
    metrics, _ = trainer.train_run(cpu_spec(auto_batch_size=True, auto_batch_size_max=12), prepared_data[0])
    assert (metrics["auto_batch_size_found"], metrics["auto_batch_size_oom_at"]) == (12, None)
    metrics, _ = trainer.train_run(cpu_spec(auto_batch_size=True, batch_size=64), prepared_data[0])
    assert metrics["auto_batch_size_found"] == 100  # the 100 training examples


@pytest.mark.slow
def test_auto_batch_size_when_nothing_fits_is_an_oom_row(cpu_spec, prepared_data, monkeypatch):
    monkeypatch.setenv(ENV, "oom_above_batch=0")
    metrics, steps = trainer.train_run(cpu_spec(auto_batch_size=True, batch_size=4), prepared_data[0])
    assert metrics["status"] == "oom" and "not even a batch of 1" in metrics["status_reason"]
    assert (metrics["auto_batch_size_found"], metrics["auto_batch_size_oom_at"]) == (None, 1)
    assert steps == []


@pytest.mark.slow
def test_auto_batch_size_columns_in_the_table(cpu_spec, prepared_data, monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "oom_above_batch=16")
    auto = cpu_spec(auto_batch_size=True)
    plain = cpu_spec()
    files = [write_result(tmp_path, spec, *trainer.train_run(spec, prepared_data[0])) for spec in (auto, plain)]
    table = collect.collect(files, tmp_path / "metrics.parquet", tmp_path / "metrics.csv").set_index("run_id")
    row, other = table.loc[auto.run_id], table.loc[plain.run_id]
    assert (row["auto_batch_size"], row["auto_batch_size_max"], row["batch_size"]) == (True, 1024, 16)
    assert (row["auto_batch_size_found"], row["auto_batch_size_oom_at"]) == (16, 32)
    assert other["auto_batch_size"] == False  # noqa: E712 - a pandas boolean
    assert pd.isna(other["auto_batch_size_max"]) and pd.isna(other["auto_batch_size_found"])
    assert other["batch_size"] == 8


def test_auto_batch_size_settings_are_validated(tiny_config_factory):
    config = tiny_config_factory(defaults={**CPU_DEFAULTS, "auto_batch_size": True, "auto_batch_size_max": 64})
    ftbench_config.validate_config(config)
    runs = matrix.expand_runs(tiny_config_factory(matrix={**THREE_RUNS, "auto_batch_size": [False, True]}))
    assert len(runs) == 6 and sum("-autobs-" in run.run_id for run in runs) == 3
    for key, value, expected in (("auto_batch_size", "yes", "expected boolean"), ("auto_batch_size_max", 0, ">= 1")):
        bad = copy.deepcopy(config)
        bad["defaults"][key] = value
        with pytest.raises(ConfigError, match=rf"^config key defaults\.{key}: .*{expected}"):
            ftbench_config.validate_config(bad)


# ---------------------------------------------------------------------------------------------------
# Bad input: one line naming the key or file, before any job runs


def test_missing_label_column_is_refused_when_the_config_is_read(tiny_config_factory, tiny_csv):
    config = tiny_config_factory()
    config["datasets"]["tiny"]["label_column"] = "sentiment"
    with pytest.raises(ConfigError) as caught:
        ftbench_config.validate_config(config)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("config key datasets.tiny.label_column: column 'sentiment' is not in ")
    assert str(tiny_csv) in message and "text, label" in message


def test_missing_text_column_is_refused_when_the_config_is_read(tiny_config_factory):
    config = tiny_config_factory()
    config["datasets"]["tiny"]["text_column"] = "review"
    with pytest.raises(ConfigError, match=r"^config key datasets\.tiny\.text_column: column 'review' is not in "):
        ftbench_config.validate_config(config)


def test_more_gpus_than_the_invocation_allows(tiny_config_factory):
    config = tiny_config_factory(include=[{"model": "tiny", "dataset": "tiny", "parallel": "ddp", "num_gpus": 4}])
    ftbench_config.check_gpu_limit(config, None)  # no limit given
    ftbench_config.check_gpu_limit(config, 4)
    with pytest.raises(ConfigError) as caught:
        ftbench_config.check_gpu_limit(config, 2)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("config key include[0].num_gpus: ")
    assert "asks for 4 GPUs" in message and "num_gpus <= 2" in message
    # CPU runs (device cpu) ask for no GPU, whatever num_gpus says (the matrix's runs ask for one each).
    cpu = tiny_config_factory(include=[{"model": "tiny", "dataset": "tiny", "parallel": "ddp", "num_gpus": 4, "device": "cpu"}])
    ftbench_config.check_gpu_limit(cpu, 1)


BAD_INPUTS = [
    # (case id, edit of the tiny config, extra snakemake arguments, the start of the one line)
    ("unknown-key", lambda c: c["defaults"].update(lora_rnk=4), [], "config key defaults.lora_rnk: unknown key"),
    ("wrong-type", lambda c: c["defaults"].update(batch_size="32"), [], "config key defaults.batch_size: expected integer"),
    ("empty-axis", lambda c: c["matrix"].update(method=[]), [], "config key matrix.method: must not be empty"),
    ("unknown-precision", lambda c: c["defaults"].update(precision="fp8"), [], "config key defaults.precision: 'fp8' is not allowed"),
    ("lora-rank-0", lambda c: c["matrix"].update(lora_rank=[4, 0]), [], "config key matrix.lora_rank[1]: 0 is out of range"),
    ("missing-dataset-file", lambda c: c["datasets"]["tiny"]["source"].update(path="/nonexistent/tiny.csv"), [],
     "config key datasets.tiny.source.path: /nonexistent/tiny.csv does not exist"),
    ("missing-label-column", lambda c: c["datasets"]["tiny"].update(label_column="sentiment"), [],
     "config key datasets.tiny.label_column: column 'sentiment' is not in "),
    ("seq-len-above-model-max", lambda c: c["defaults"].update(seq_len=256), [],
     "config key defaults.seq_len: 256 exceeds model 'tiny' maximum of 128"),
    ("more-gpus-than-allowed", lambda c: c.update(include=[{"model": "tiny", "dataset": "tiny", "parallel": "ddp", "num_gpus": 2}]),
     ["--resources", "gpu=1"], "config key include[0].num_gpus: run tiny-tiny-lora-r4-fp32-b8-s32-ddp2-"),
]


@pytest.mark.slow
@pytest.mark.parametrize("edit, extra, start", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS])
def test_snakemake_dry_run_refuses_bad_input_with_one_line(tmp_path, tiny_config_factory, snakemake_runner, edit, extra, start):
    config = tiny_config_factory()
    edit(config)
    write_config(tmp_path, config)
    process = snakemake_runner(tmp_path, "-n", *extra)
    assert process.returncode != 0, snakemake_failure(process)
    ours = [line for line in process.stderr.splitlines() if line.startswith("ftbench:")]
    assert len(ours) == 1 and ours[0].startswith(f"ftbench: {start}"), process.stderr
    assert "Traceback" not in process.stderr
    assert job_counts(process) == {}  # no job planned, none run
    assert not (tmp_path / "results").exists() and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------------------------------
# The train command: errors are failed rows, tampered data is refused, a full disk leaves no file


@pytest.mark.slow
def test_unknown_exception_is_a_failed_row_with_its_traceback_in_the_log(cpu_spec, prepared_data, tmp_path):
    out = tmp_path / "run" / "metrics.json"
    process, _ = train_command(cpu_spec(), prepared_data[0], out, fault="error@2")
    assert process.returncode == 0, output_of(process)  # the invocation goes on to the other runs
    assert "Traceback (most recent call last)" in process.stderr
    assert "RuntimeError: injected failure at step 2" in process.stderr
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["status"] == "failed"
    assert metrics["status_reason"].startswith("RuntimeError: injected failure at step 2")
    assert "\n" not in metrics["status_reason"] and metrics["status_reason"].endswith("(traceback in the job log)")
    assert pd.read_parquet(out.with_name("steps.parquet")).empty  # nothing measured is claimed


@pytest.mark.slow
def test_tampered_shard_is_refused_by_the_train_command_naming_it(cpu_spec, prepared_data, tmp_path):
    folder = tmp_path / "data"
    shutil.copytree(prepared_data[0], folder)
    shard = folder / prepared.read_manifest(folder)["splits"]["train"]["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-64])  # truncated
    out = tmp_path / "run" / "metrics.json"
    process, _ = train_command(cpu_spec(), folder, out)
    assert process.returncode == 1, output_of(process)
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("ftbench: ") and shard.name in last, process.stderr[-2000:]
    assert "Traceback" not in process.stderr
    assert not out.exists()


def _file_size_limit(limit_bytes: int):
    def apply():
        # Writes beyond the limit fail with EFBIG instead of the process being killed by SIGXFSZ.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


@pytest.mark.parametrize("writer", ["write_json", "write_parquet"])
def test_full_disk_gives_a_clear_error_and_leaves_no_partial_file(tmp_path, writer):
    target = tmp_path / ("metrics.json" if writer == "write_json" else "steps.parquet")
    target.write_text("previous result\n")
    code = (
        "import sys; import pandas as pd; from ftbench import atomic; "
        f"frame = pd.DataFrame({{'x': range(200000)}}); atomic.{writer}(sys.argv[1], "
        "frame.to_dict('list') if sys.argv[2] == 'write_json' else frame)"
    )
    process = subprocess.run([sys.executable, "-c", code, str(target), writer],
                             capture_output=True, text=True, timeout=120, preexec_fn=_file_size_limit(64 * 1024))
    assert process.returncode != 0
    last = process.stderr.strip().splitlines()[-1]
    assert last.startswith("OSError: [Errno 27]") and "File too large" in last, process.stderr[-2000:]
    assert f"could not write {target}" in last
    assert target.read_text() == "previous result\n"  # the old file is untouched...
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]  # ...and no temporary file is left


# ---------------------------------------------------------------------------------------------------
# DDP: an OOM on one of two gloo ranks ends the run in bounded time with an oom row


def ddp_spec(cpu_spec) -> RunSpec:
    return cpu_spec(method="full", learning_rate=0.0001, parallel="ddp", num_gpus=2, device="cpu")


def ddp_run_with_fault(cpu_spec, prepared_data, tmp_path, fault: str) -> tuple[dict, subprocess.CompletedProcess]:
    """A 2-rank gloo DDP run with a fault on one rank, through the train command: it must end in bounded time
    with a row, and no rank may outlive it. (metrics, process)"""
    out = tmp_path / "run" / "metrics.json"
    process, seconds = train_command(ddp_spec(cpu_spec), prepared_data[0], out, fault=fault, timeout=240)
    leftover = processes_mentioning(str(out.parent / "ranks"))
    for pid in leftover:
        os.kill(pid, signal.SIGKILL)
    assert process.returncode == 0, output_of(process)
    assert seconds < 90, f"took {seconds:.0f} s"
    assert leftover == [], "a rank outlived its run"
    return json.loads(out.read_text())["metrics"], process


@pytest.mark.slow
@pytest.mark.parametrize("fault, peer", [
    ("oom@3:rank1", "sees rank 1 leave"),
    # The NCCL case: the peer is stuck (here asleep) instead of failing fast. The launcher ends it
    # RANK_GRACE_S after rank 1's result appears.
    ("oom@3:rank1,sleep@3=600:rank0", "is stuck"),
], ids=["peer-fails-fast", "peer-stuck"])
def test_oom_on_one_ddp_rank_gives_an_oom_row_in_bounded_time(cpu_spec, prepared_data, tmp_path, fault, peer):
    metrics, process = ddp_run_with_fault(cpu_spec, prepared_data, tmp_path, fault)
    assert metrics["status"] == "oom"
    assert metrics["status_reason"].startswith("rank 1: CUDA out of memory at step 3")
    assert metrics["last_step"] == 3 and metrics["world_size"] == 2
    assert metrics.get("tokens_per_s") is None and metrics.get("eval_accuracy") is None
    assert "out of memory at step 3 (pid" in process.stderr


@pytest.mark.slow
def test_a_crashing_ddp_rank_gives_a_failed_row_in_bounded_time(cpu_spec, prepared_data, tmp_path):
    """An unknown exception on rank 1: its traceback in the log, a failed row naming the rank; rank 0,
    left waiting in a collective, is ended by the launcher."""
    metrics, process = ddp_run_with_fault(cpu_spec, prepared_data, tmp_path, "error@3:rank1")
    assert metrics["status"] == "failed"
    assert metrics["status_reason"].startswith("rank 1: RuntimeError: injected failure at step 3")
    assert "Traceback (most recent call last)" in process.stderr


@pytest.mark.slow
def test_ddp_auto_batch_size_ranks_agree_on_the_smallest_batch(cpu_spec, prepared_data, tmp_path):
    """Rank 1 runs out of memory above 8 samples, rank 0 only above 16: both train at 8."""
    spec = cpu_spec(method="full", learning_rate=0.0001, parallel="ddp", num_gpus=2, device="cpu", auto_batch_size=True,
                    batch_size=4)
    out = tmp_path / "run" / "metrics.json"
    process, _ = train_command(spec, prepared_data[0], out, fault="oom_above_batch=16:rank0,oom_above_batch=8:rank1")
    assert process.returncode == 0, output_of(process)
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["status"] == "ok", metrics["status_reason"]
    assert (metrics["batch_size"], metrics["auto_batch_size_found"], metrics["auto_batch_size_oom_at"]) == (8, 8, 16)
    steps = pd.read_parquet(out.with_name("steps.parquet"))
    assert steps["samples"].tolist() == [16] * 6  # 8 per rank, two ranks


# ---------------------------------------------------------------------------------------------------
# The workflow: failures through snakemake


def start_snakemake(workdir: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """Snakemake in the background, as conftest.run_snakemake runs it; its output goes to a file."""
    log = workdir / "snakemake-output.txt"
    command = [*_snakemake_command(), "--snakefile", str(SNAKEFILE), "--directory", str(workdir),
               "--configfile", str(workdir / "config.yaml"), "--cores", "2", *args]
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(log, "w") as handle:
        process = subprocess.Popen(command, cwd=workdir, env=env, stdout=handle, stderr=subprocess.STDOUT)
    return process, log


def wait_for(condition, timeout: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"snakemake exited ({process.returncode}) before {what}")
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def injected_pid(log: Path, what: str) -> int | None:
    """The pid a training job printed when its injected fault fired (see faults.Injector._announce)."""
    if not log.is_file():
        return None
    for match in MARKER.finditer(log.read_text(errors="replace")):
        if match["what"].startswith(what):
            return int(match["pid"])
    return None


def finished_jobs(log: Path) -> int:
    counts = [int(n) for n in re.findall(r"(\d+) of \d+ steps \(\d+%\) done", log.read_text(errors="replace"))]
    return max(counts, default=0)


def kill(pid: int | None) -> None:
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def metrics_file(workdir: Path, run_id: str) -> Path:
    return workdir / "results" / "runs" / run_id / "metrics.json"


@pytest.mark.slow
def test_failed_runs_become_rows_and_the_report_renders(tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    config = tiny_config_factory(matrix=THREE_RUNS)
    write_config(tmp_path, config)
    monkeypatch.setenv(ENV, f"oom@3:run={FULL},nan@3:run={LORA4}")
    process = snakemake_runner(tmp_path, timeout=600)
    assert process.returncode == 0, snakemake_failure(process)  # the jobs of failed runs exit 0: the DAG goes on
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet").set_index("run_id")
    status = {fragment: table.loc[run_id_with(config, fragment), "status"] for fragment in (FULL, LORA4, LORA8)}
    assert status == {FULL: "oom", LORA4: "diverged", LORA8: "ok"}
    assert table.loc[run_id_with(config, FULL), "last_step"] == 3
    html = (tmp_path / "results" / "report.html").read_text()
    assert 'class="status-oom"' in html and 'class="status-diverged"' in html
    assert (tmp_path / "results" / "figures" / "throughput.png").is_file()


@pytest.mark.slow
def test_every_run_failing_still_gives_the_table_and_the_report(tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    write_config(tmp_path, tiny_config_factory())
    monkeypatch.setenv(ENV, "oom@1")
    process = snakemake_runner(tmp_path, timeout=600)
    assert process.returncode == 0, snakemake_failure(process)
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 2 and (table["status"] == "oom").all()
    assert table["tokens_per_s"].isna().all()
    html = (tmp_path / "results" / "report.html").read_text()
    # each oom run shaded twice: its configuration's row of the headline table and its row of the runs table
    assert "No run finished" in html and html.count('class="status-oom"') == 4


@pytest.mark.slow
def test_failing_runs_are_failed_rows_and_the_invocation_ends_with_a_summary(
        tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    """The user's case: a LoRA run whose lora_targets the model lacks (a real error, raised while the
    model is built), and an unknown exception in another run. Both are failed rows with their one-line
    reason, the third run is collected, the report is built, Snakemake exits 0, and the last thing on
    the terminal is the summary of outcomes with the report's place."""
    config = tiny_config_factory(include=[{"model": "tiny", "dataset": "tiny", "method": "lora", "lora_rank": 16,
                                           "lora_targets": ["no_such_layer"]}])
    write_config(tmp_path, config)
    broken, crashing, fine = run_id_with(config, "-lora-r16-"), run_id_with(config, FULL), run_id_with(config, LORA4)
    monkeypatch.setenv(ENV, f"error@2:run={FULL}")
    process = snakemake_runner(tmp_path, timeout=600)
    assert process.returncode == 0, snakemake_failure(process)
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet").set_index("run_id")
    assert table.loc[fine, "status"] == "ok"
    assert table.loc[crashing, "status"] == "failed" and table.loc[broken, "status"] == "failed"
    assert table.loc[crashing, "status_reason"].startswith("RuntimeError: injected failure at step 2")
    assert table.loc[broken, "status_reason"].startswith("config key lora_targets: 'no_such_layer' name no layer")
    assert pd.isna(table.loc[crashing, "tokens_per_s"])
    log = (tmp_path / "logs" / "train" / f"{crashing}.log").read_text()
    assert "Traceback (most recent call last)" in log and "RuntimeError: injected failure at step 2" in log
    assert (tmp_path / "results" / "report.html").is_file()

    # The summary: after Snakemake's own last lines, one screen.
    output = process.stdout + process.stderr
    summary = output[output.rindex("ftbench: 3 runs:"):]
    assert summary.startswith("ftbench: 3 runs: 1 ok, 0 timeout, 0 oom, 0 diverged, 0 unsupported, 2 failed")
    assert f"failed      {broken}: config key lora_targets" in summary
    assert f"failed      {crashing}: RuntimeError: injected failure at step 2" in summary
    assert f"report: {tmp_path / 'results' / 'report.html'}" in summary
    assert len(summary.splitlines()) < 12
    assert "steps (100%) done" in output[:output.rindex("ftbench: 3 runs:")]  # it comes last


@pytest.mark.slow
def test_sigkilled_training_job_under_keep_going(tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    """The killed run fails; its siblings finish; the re-run trains exactly that run."""
    config = tiny_config_factory(matrix=THREE_RUNS)
    write_config(tmp_path, config)
    victim = run_id_with(config, FULL)
    siblings = [run_id_with(config, LORA4), run_id_with(config, LORA8)]
    monkeypatch.setenv(ENV, f"sleep@2=600:run={FULL}")
    # Two training jobs at a time, so the siblings need not wait for the sleeping one.
    process, output = start_snakemake(tmp_path, "--keep-going", "--set-threads", "train=1")
    pid = None
    try:
        pid = wait_for(lambda: injected_pid(tmp_path / "logs" / "train" / f"{victim}.log", "sleeping"), 240,
                       "the training job to reach step 2", process)
        os.kill(pid, signal.SIGKILL)
        process.wait(timeout=300)
    finally:
        kill(pid)
        kill(process.pid)
    text = output.read_text()
    assert process.returncode != 0, text[-4000:]
    # The error block names the job's spec file, not 1.5 KB of spec JSON (issue 19); the end says what happened.
    assert "--spec-file .snakemake/ftbench/specs/" in text and '"model_def"' not in text
    assert "ftbench: no table from this invocation: a job failed before collect" in text[-1500:]
    assert not metrics_file(tmp_path, victim).exists()
    for run_id in siblings:
        assert json.loads(metrics_file(tmp_path, run_id).read_text())["metrics"]["status"] == "ok"
    assert not (tmp_path / "results" / "metrics.parquet").exists()

    monkeypatch.delenv(ENV)
    before = {run_id: metrics_file(tmp_path, run_id).stat().st_mtime_ns for run_id in siblings}
    planned = snakemake_runner(tmp_path, "-n")
    assert train_run_ids(planned) == {victim}, planned.stdout[-4000:]
    rerun = snakemake_runner(tmp_path, timeout=600)
    assert rerun.returncode == 0, snakemake_failure(rerun)
    assert train_run_ids(rerun) == {victim}
    assert {run_id: metrics_file(tmp_path, run_id).stat().st_mtime_ns for run_id in siblings} == before
    assert (pd.read_parquet(tmp_path / "results" / "metrics.parquet")["status"] == "ok").all()


@pytest.mark.slow
def test_sigkilled_snakemake_then_rerun_incomplete_redoes_only_the_interrupted_run(
        tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    config = tiny_config_factory(matrix=THREE_RUNS)
    write_config(tmp_path, config)
    victim = run_id_with(config, FULL)
    siblings = [run_id_with(config, LORA4), run_id_with(config, LORA8)]
    monkeypatch.setenv(ENV, f"sleep@2=600:run={FULL}")
    process, output = start_snakemake(tmp_path, "--set-threads", "train=1")
    pid = None
    try:
        pid = wait_for(lambda: injected_pid(tmp_path / "logs" / "train" / f"{victim}.log", "sleeping"), 240,
                       "the training job to reach step 2", process)
        # Kill Snakemake once it has recorded the siblings as done (prepare_data + 2 train jobs), while
        # the victim is mid-run (asleep at step 2 for 600 s).
        wait_for(lambda: finished_jobs(output) >= 3, 240, "the sibling runs to finish", process)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        # Issue 18: its training job ends with it, within seconds, instead of running on as an orphan.
        killed_at = time.monotonic()
        wait_for(lambda: not lifeline.alive(pid), 15, "the orphaned training job to end")
        assert time.monotonic() - killed_at < 5
        log = (tmp_path / "logs" / "train" / f"{victim}.log").read_text()
        assert f"snakemake (pid {process.pid}) is gone" in log
    finally:
        kill(process.pid)
        kill(pid)
    assert not metrics_file(tmp_path, victim).exists()
    assert all(metrics_file(tmp_path, run_id).exists() for run_id in siblings)

    monkeypatch.delenv(ENV)
    before = {run_id: metrics_file(tmp_path, run_id).stat().st_mtime_ns for run_id in siblings}
    # The killed Snakemake left its lock behind: remove it, as its error message says.
    unlock = snakemake_runner(tmp_path, "--unlock")
    assert unlock.returncode == 0, snakemake_failure(unlock)
    planned = snakemake_runner(tmp_path, "-n", "--rerun-incomplete")
    assert train_run_ids(planned) == {victim}, planned.stdout[-4000:]
    rerun = snakemake_runner(tmp_path, "--rerun-incomplete", timeout=600)
    assert rerun.returncode == 0, snakemake_failure(rerun)
    assert train_run_ids(rerun) == {victim}
    assert {run_id: metrics_file(tmp_path, run_id).stat().st_mtime_ns for run_id in siblings} == before
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 3 and (table["status"] == "ok").all()


@pytest.mark.slow
def test_second_concurrent_invocation_is_refused_and_the_first_is_unaffected(
        tmp_path, tiny_config_factory, snakemake_runner, monkeypatch):
    config = tiny_config_factory()
    write_config(tmp_path, config)
    slow = run_id_with(config, FULL)
    monkeypatch.setenv(ENV, f"sleep@2=15:run={FULL}")
    process, output = start_snakemake(tmp_path)
    try:
        wait_for(lambda: injected_pid(tmp_path / "logs" / "train" / f"{slow}.log", "sleeping"), 240,
                 "the first invocation's training job", process)
        monkeypatch.delenv(ENV)
        second = snakemake_runner(tmp_path, timeout=120)
        assert process.poll() is None, "the first invocation should still be running"
        process.wait(timeout=300)
    finally:
        kill(process.pid)
    assert second.returncode != 0
    assert "Directory cannot be locked" in second.stdout + second.stderr, snakemake_failure(second)
    assert "rule train" not in second.stdout + second.stderr
    assert process.returncode == 0, output.read_text()[-4000:]
    table = pd.read_parquet(tmp_path / "results" / "metrics.parquet")
    assert len(table) == 2 and (table["status"] == "ok").all()
    assert (tmp_path / "results" / "report.html").is_file()


# ---------------------------------------------------------------------------------------------------
# On a real GPU (skipped without one): a real CUDA OOM, and auto_batch_size against the real limit


GPU_MODEL = {"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 16, "vocab_size": 32000, "max_position_embeddings": 1024}}}


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_gpu_oom_is_a_row_and_auto_batch_size_finds_the_real_limit(tmp_path):
    """A 134M-parameter Llama at seq_len 1024: batch 4096 needs over 500 GB for its fp32 logits alone, so it
    runs out of memory on any GPU; auto_batch_size from 8 finds the largest batch that fits and measures."""
    config = {
        "models": {"llama": GPU_MODEL},
        "datasets": {"tokens": {"source": {"kind": "synthetic"}, "train_size": 4096, "eval_size": 64}},
        "defaults": {"method": "full", "precision": "bf16", "seq_len": 1024, "max_steps": 5, "warmup_steps": 2,
                     "eval_batch_size": 16, "learning_rate": 0.0001, "num_gpus": 1, "device": "cuda"},
        "matrix": {"model": ["llama"], "dataset": ["tokens"], "batch_size": [4096]},
        "include": [{"model": "llama", "dataset": "tokens", "batch_size": 8, "auto_batch_size": True,
                     "auto_batch_size_max": 4096}],
    }
    ftbench_config.validate_config(config)
    oversized, auto = matrix.expand_runs(config)
    data_dir = tmp_path / "data"
    registry.prepare("tokens", oversized["dataset_def"], GPU_MODEL, 1024, data_dir)

    out = tmp_path / "oversized" / "metrics.json"
    process, _ = train_command(oversized, data_dir, out, timeout=600)
    assert process.returncode == 0, output_of(process)  # the DAG goes on
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["status"] == "oom" and "out of memory" in metrics["status_reason"].lower()
    assert metrics["last_step"] == 0 and metrics["peak_memory_allocated_mb"] > 0  # the high-water mark
    assert metrics.get("tokens_per_s") is None

    out = tmp_path / "auto" / "metrics.json"
    process, _ = train_command(auto, data_dir, out, timeout=600)
    assert process.returncode == 0, output_of(process)
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["status"] == "ok", metrics["status_reason"]
    found, oom_at = metrics["auto_batch_size_found"], metrics["auto_batch_size_oom_at"]
    assert 8 <= found < oom_at <= 4096 and metrics["batch_size"] == found
    assert metrics["tokens_per_s"] > 0
    print(json.dumps({key: metrics.get(key) for key in (
        "device_name", "auto_batch_size_trials", "auto_batch_size_time_s", "peak_memory_reserved_mb", "tokens_per_s")}))


@pytest.mark.slow
def test_an_oom_after_a_nan_read_a_step_late_is_the_divergence(cpu_spec, prepared_data, monkeypatch):
    """Step 4's NaN is read at step 5, before its update; an out-of-memory error in step 5's forward pass comes
    first. The run diverged at 4 (its update skipped on the device): a loop that read each loss before its update
    would have stopped there, so the row is diverged, not a configuration that does not fit."""
    monkeypatch.setattr(trainer, "make_optimizer", plain_fused_adamw)
    monkeypatch.setenv(ENV, "nan@4,oom@5")
    metrics, steps = trainer.train_run(cpu_spec(max_steps=8), prepared_data[0])
    assert metrics["status"] == "diverged" and metrics["diverged_step"] == 4 and metrics["last_step"] == 4
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    # Without the NaN the same OOM is what ends the run.
    monkeypatch.setenv(ENV, "oom@5")
    metrics, _ = trainer.train_run(cpu_spec(max_steps=8), prepared_data[0])
    assert metrics["status"] == "oom" and metrics["last_step"] == 5
