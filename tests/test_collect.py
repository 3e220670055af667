"""collect: MFU computed from the GPU peak table when results are collected, so that editing a peak
re-runs collect and report, never training (costs are tested in tests/test_report.py)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from conftest import ROOT, snakemake_failure, write_config
from ftbench import cli
from ftbench.runspec import RunSpec

GPU_PEAKS = ROOT / "config" / "gpus.yaml"
H200_BF16 = 989.4


def write_run(folder, run_id: str, device: str, device_name: str, world_size: int = 1, tflops_per_s: float | None = None):
    spec = RunSpec(model="m", dataset="d", precision="bf16", parallel="ddp" if world_size > 1 else "single",
                   num_gpus=world_size, run_id=run_id, model_def={"task": "causal_lm"})
    metrics = {"run_id": run_id, "status": "ok", "status_reason": None, "device": device, "device_name": device_name,
               "world_size": world_size, "tflops_per_s": tflops_per_s}
    path = folder / run_id / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"spec": spec.to_dict(), "metrics": metrics, "environment": {}}))
    return path


@pytest.fixture
def results(tmp_path):
    runs = tmp_path / "runs"
    return [
        write_run(runs, "h200x2", "cuda", "NVIDIA H200", world_size=2, tflops_per_s=H200_BF16),  # half of 2 x peak
        write_run(runs, "cpu", "cpu", "Intel Xeon", tflops_per_s=0.01),
        write_run(runs, "mystery", "cuda", "Mystery GPU", tflops_per_s=1.0),
    ]


def collect_with(tmp_path, results, *peaks_args: str) -> pd.DataFrame:
    out = tmp_path / "metrics.parquet"
    cli.collect(["--parquet", str(out), "--csv", str(tmp_path / "metrics.csv"), *peaks_args, *map(str, results)])
    return pd.read_parquet(out).set_index("run_id")


def test_collect_computes_mfu_from_the_peak_table(tmp_path, results, capsys):
    table = collect_with(tmp_path, results, "--gpu-peaks", str(GPU_PEAKS))
    h200 = table.loc["h200x2"]
    assert h200["mfu"] == pytest.approx(0.5)
    assert (h200["mfu_peak_tflops"], h200["mfu_peak_source"]) == (H200_BF16, "H200 bf16")
    assert table.loc[["cpu", "mystery"], ["mfu", "mfu_peak_tflops", "mfu_peak_source"]].isna().all().all()
    assert "warning: run mystery: no bf16 peak for device 'Mystery GPU'" in capsys.readouterr().err


def test_an_edited_peak_changes_mfu(tmp_path, results):
    table = yaml.safe_load(GPU_PEAKS.read_text())
    for entry in table["gpus"]:
        if entry["name"] == "H200":
            entry["dense_tflops"]["bf16"] = H200_BF16 / 2
    edited = tmp_path / "gpus.yaml"
    edited.write_text(yaml.safe_dump(table))
    assert collect_with(tmp_path, results, "--gpu-peaks", str(edited)).loc["h200x2", "mfu"] == pytest.approx(1.0)


def test_without_a_peak_table_mfu_stays_null(tmp_path, results):
    assert collect_with(tmp_path, results)["mfu"].isna().all()


@pytest.mark.slow
def test_the_collect_rule_reads_the_peak_table(tmp_path, tiny_config_factory, snakemake_runner):
    write_config(tmp_path, tiny_config_factory())
    process = snakemake_runner(tmp_path, "-n", "-p")
    assert process.returncode == 0, snakemake_failure(process)
    assert f"--gpu-peaks {GPU_PEAKS}" in process.stdout + process.stderr


def test_collect_imports_no_torch():
    """collect runs in the analysis environment (envs/analysis.yaml), which has no torch."""
    import subprocess
    import sys

    code = "import sys; from ftbench.report import collect, report_page; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_the_summary_counts_outcomes_and_gives_each_reason(tmp_path):
    """summary.txt: runs per status in a fixed order, one line per run that is not ok, the table's place.
    Printed at the end of an invocation: tests/test_faults.py::test_failing_runs_are_failed_rows_and_the_invocation_ends_with_a_summary."""
    runs = tmp_path / "runs"
    paths = [write_run(runs, name, "cpu", "Intel Xeon") for name in ("a-ok", "b-failed", "c-timeout", "d-long")]
    for path, status, reason in ((paths[1], "failed", "ValueError: bad\nthing"), (paths[2], "timeout", "stopped at step 3"),
                                 (paths[3], "oom", "x" * 500)):
        result = json.loads(path.read_text())
        result["metrics"].update(status=status, status_reason=reason)
        path.write_text(json.dumps(result))
    summary = tmp_path / "summary.txt"
    cli.collect(["--parquet", str(tmp_path / "metrics.parquet"), "--csv", str(tmp_path / "metrics.csv"),
                 "--summary", str(summary), *map(str, paths)])
    lines = summary.read_text().splitlines()
    assert lines[0] == "ftbench: 4 runs: 1 ok, 1 timeout, 1 oom, 0 diverged, 0 unsupported, 1 failed"
    assert lines[1] == "  timeout     c-timeout: stopped at step 3"
    assert lines[2].startswith("  oom         d-long: xxx") and lines[2].endswith("...") and len(lines[2]) < 200
    assert lines[3] == "  failed      b-failed: ValueError: bad thing"  # one line each
    assert lines[-1] == f"table: {tmp_path / 'metrics.parquet'}"


def test_the_summary_lists_at_most_a_screen_of_runs():
    from ftbench.report import summary

    frame = pd.DataFrame({"run_id": [f"run{i:02d}" for i in range(40)], "status": ["failed"] * 40,
                          "status_reason": ["boom"] * 40})
    lines = summary.outcome_summary(frame, "t.parquet").splitlines()
    assert len(lines) == 1 + summary.MAX_LISTED + 3  # the rest counted, one line of advice, the table
    assert lines[-3] == f"  ... and {40 - summary.MAX_LISTED} more not ok: see the status column of the table"
    assert lines[-2].startswith("  -> failed (run00, run01, run02 and 37 more): fix")


def test_a_failed_row_names_the_root_cause_of_a_wrapped_error():
    """transformers' lazy import wraps what is missing ("Could not import module 'Trainer'"): the row must say what
    to install. Only explicit causes (raise ... from) count; a long wrapper is cut before the cause is."""
    from ftbench.measure.metrics import failed_metrics

    def wrapped(message: str, cause: BaseException | None) -> Exception:
        try:
            raise ModuleNotFoundError(message) from cause
        except ModuleNotFoundError as exc:
            return exc

    missing = ModuleNotFoundError("No module named 'multiprocess'")
    reason = failed_metrics("r", wrapped("Could not import module 'Trainer'.", missing))["status_reason"]
    assert reason == ("ModuleNotFoundError: Could not import module 'Trainer'. (caused by ModuleNotFoundError: "
                      "No module named 'multiprocess') (traceback in the job log)")
    long_reason = failed_metrics("r", wrapped("x" * 1000, missing))["status_reason"]
    assert "(caused by ModuleNotFoundError: No module named 'multiprocess') (traceback" in long_reason
    assert len(long_reason) < 400
    assert "caused by" not in failed_metrics("r", wrapped("plain", None))["status_reason"]
    try:
        try:
            raise KeyError("handled")
        except KeyError:
            raise RuntimeError("while cleaning up")  # noqa: B904 - an implicit context, not a cause
    except RuntimeError as exc:
        assert failed_metrics("r", exc)["status_reason"] == "RuntimeError: while cleaning up (traceback in the job log)"


def test_the_summary_advises_a_fix_for_what_would_fail_again_and_a_retry_only_where_it_can_help():
    """Issue 28 item 4: the advice depends on the failure. A named error (config, source, manifest), an
    oom, a divergence or an unsupported configuration would end the same way again: what to fix; only a
    timeout (with more time) and an error ftbench did not name (maybe a passing fault) get a retry."""
    from ftbench import errors
    from ftbench.measure.metrics import failed_metrics
    from ftbench.report import summary

    rows = [failed_metrics("bad-config", errors.ConfigError("config key lora_targets: 'x' name no layer of model m")),
            failed_metrics("bad-image", errors.SourceError("config key datasets.d.source: image 7 cannot be decoded")),
            failed_metrics("bad-shard", errors.ManifestError("data shard s.parquet: sha256 differs")),
            failed_metrics("crash", RuntimeError("CUDA error: unspecified launch failure")),
            {"run_id": "too-big", "status": "oom", "status_reason": "CUDA out of memory"},
            {"run_id": "no-bnb", "status": "unsupported", "status_reason": "QLoRA needs bitsandbytes with CUDA"},
            {"run_id": "slow", "status": "timeout", "status_reason": "stopped before the job's time limit"},
            {"run_id": "fine", "status": "ok", "status_reason": None}]
    lines = summary.outcome_summary(pd.DataFrame(rows), "t.parquet").splitlines()
    advice = {line.split(" (")[0].removeprefix("  -> "): line for line in lines if line.startswith("  -> ")}
    assert set(advice) == {"timeout", "oom", "unsupported", "failed", summary.UNEXPECTED}
    assert "(bad-config, bad-image, bad-shard)" in advice["failed"]
    for kind in ("failed", "oom", "unsupported"):
        assert ": fix, a retry would" in advice[kind] and "retry it" not in advice[kind], advice[kind]
    assert "(crash): retry if its cause has passed" in advice[summary.UNEXPECTED]
    assert "logs/train/<run_id>.log" in advice[summary.UNEXPECTED]
    assert "(slow): retry with more time" in advice["timeout"] and "train:runtime" in advice["timeout"]
    assert "fine" not in "\n".join(advice.values()) and lines[-1] == "table: t.parquet"


def test_failed_jobs_are_told_to_fix_a_named_error_and_to_rerun_only_otherwise(tmp_path, monkeypatch, capsys):
    """The end of an invocation with failed jobs (no row: Snakemake reports them): a job that ended on an
    error ftbench named (a bad data file, a damaged shard) is listed with its line, to fix; a terminated
    job, and a train job whose run wrote its (failed) row, are not; 'rerun to retry' only without the former."""
    import os
    import time

    from ftbench.report import summary

    monkeypatch.chdir(tmp_path)
    started = time.time() - 5

    def log(path: str, *lines: str, age: float = 0.0) -> None:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("\n".join(["working...", *lines]) + "\n")
        os.utime(tmp_path / path, (started - age, started - age))

    log("logs/train/terminated.log", "ftbench: run terminated was terminated (SIGTERM) after step 3: no result written, "
                                     "the next invocation trains it again", age=-1)
    log("logs/train/failed-row.log", "ftbench: config key lora_targets: 'x' name no layer of model m", age=-1)
    (tmp_path / "results" / "runs" / "failed-row").mkdir(parents=True)
    (tmp_path / "results" / "runs" / "failed-row" / "metrics.json").write_text("{}")
    log("logs/prepare_data/old.log", "ftbench: config key datasets.d.source: an earlier invocation's error", age=60)
    summary.print_outcome(started, failed_jobs=True)
    retry_only = capsys.readouterr().err
    assert "fix logs/" not in retry_only and "rerun snakemake to retry them" in retry_only

    log("logs/prepare_data/d1.log", "ftbench: config key datasets.d.source: image 7 of images/ cannot be decoded", age=-1)
    summary.print_outcome(started, failed_jobs=True)
    told = capsys.readouterr().err
    assert "  fix logs/prepare_data/d1.log: ftbench: config key datasets.d.source: image 7 of images/ cannot be decoded" in told
    assert "old.log" not in told and "failed-row.log" not in told
    # a cancelled run's own line is shown too, as nothing to fix
    assert "  cancelled logs/train/terminated.log: ftbench: run terminated was terminated (SIGTERM)" in told
    assert "some jobs failed on an error to fix" in told and "rerun snakemake to retry them" not in told
