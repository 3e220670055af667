"""ftbench.measure.metrics: the window summary, energy per token, MFU of a collected row, merging DDP ranks and
the statuses, on hand-made numbers (no training)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest

from conftest import ROOT
from ftbench.measure import gpu_table
from ftbench.measure.metrics import STATUSES, energy_per_token, merge_ranks, mfu, summarise, worst_status

PEAKS = gpu_table.load_peaks(ROOT / "config" / "gpus.yaml")


def step(measured: bool, tokens: int, padded: int, samples: int, seconds: float, flops_: int = 0,
         loader: float = 0.0) -> dict:
    return {"measured": measured, "tokens": tokens, "padded_tokens": padded, "samples": samples,
            "step_time_s": seconds, "flops": flops_, "loader_s": loader}


# ---------------------------------------------------------------------------------------------------
# Traps: per-device vs global; warmup excluded; the measured window only (summarise)


def test_summarise_global_and_per_device_are_apart():
    steps = [step(True, 100, 120, 8, 1.0), step(True, 300, 320, 8, 1.0)]  # counts of both devices together
    summary = summarise(steps, window_s=2.0, devices=2)
    assert summary["tokens_per_s"] == 200.0  # global: all devices' tokens / window (not x2, not /2)
    assert summary["tokens_per_s_per_device"] == 100.0
    assert summary["samples_per_s"] == 8.0
    single = summarise(steps, window_s=2.0, devices=1)
    assert single["tokens_per_s"] == single["tokens_per_s_per_device"] == 200.0


def test_summarise_excludes_warmup_steps():
    steps = [step(False, 10**6, 10**6, 1000, 50.0, 10**12, 40.0), step(False, 10**6, 2 * 10**6, 1000, 30.0),
             step(True, 100, 200, 4, 1.0, 1000, 0.25), step(True, 300, 400, 4, 3.0, 3000, 0.75)]
    summary = summarise(steps, window_s=4.0, devices=1)
    assert summary["measured_steps"] == 2 == len(steps) - 2
    assert summary["measured_tokens"] == 400
    assert summary["tokens_per_s"] == 100.0
    assert summary["samples_per_s"] == 2.0
    assert summary["padding_fraction"] == pytest.approx(1 - 400 / 600)
    assert summary["step_time_median_s"] == 2.0
    assert summary["flops_per_step_analytic"] == 2000
    assert summary["tflops_per_s"] == pytest.approx(4000 / 4.0 / 1e12)
    assert summary["loader_wait_fraction"] == pytest.approx(1.0 / 4.0)


def test_summarise_uses_the_window_not_the_sum_of_step_times():
    # The window runs from the clock read that opens the first measured step to the one that closes the last:
    # time between steps (a stop check, the next batch) belongs to it.
    steps = [step(True, 100, 100, 4, 1.0), step(True, 100, 100, 4, 1.0)]
    summary = summarise(steps, window_s=2.5, devices=1)
    assert summary["tokens_per_s"] == pytest.approx(200 / 2.5)
    assert summary["measured_time_s"] == 2.5


def test_summarise_without_a_measured_step_gives_no_throughput():
    summary = summarise([step(False, 100, 100, 4, 1.0)], window_s=None, devices=1)
    assert summary == {"measured_steps": 0}  # no tokens_per_s at all, rather than 0


# ---------------------------------------------------------------------------------------------------
# Efficiency: energy per token (train time), MFU (collect time, from the peak table)


def test_energy_per_token():
    assert energy_per_token({"energy_j": 50.0, "measured_tokens": 1000}) == 0.05
    assert energy_per_token({"energy_j": None, "measured_tokens": 1000}) is None  # no NVML: null, never 0
    assert energy_per_token({"energy_j": 50.0, "measured_tokens": 0}) is None


H200_ROW = {"run_id": "r", "device": "cuda", "device_name": "NVIDIA H200", "precision": "bf16", "world_size": 1,
            "tflops_per_s": 494.7}


def test_mfu_divides_by_the_peak_of_the_precision_times_the_devices():
    assert mfu(H200_ROW, PEAKS) == {"mfu": pytest.approx(0.5), "mfu_peak_tflops": 989.4, "mfu_peak_source": "H200 bf16"}
    assert mfu({**H200_ROW, "world_size": 2}, PEAKS)["mfu"] == pytest.approx(0.25)


def test_mfu_follows_the_peak_table_it_is_given():
    doubled = [{**entry, "dense_tflops": {"bf16": 2 * 989.4}} if entry["name"] == "H200" else entry for entry in PEAKS]
    assert mfu(H200_ROW, doubled)["mfu"] == pytest.approx(0.25)


def test_mfu_on_cpu_is_null_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = mfu({"device": "cpu", "device_name": "Intel Xeon", "precision": "fp32", "world_size": 1,
                      "tflops_per_s": 0.01}, PEAKS)
    assert result == {"mfu": None, "mfu_peak_tflops": None, "mfu_peak_source": None}


def test_mfu_of_an_unknown_gpu_warns():
    with pytest.warns(UserWarning):
        result = mfu({**H200_ROW, "device_name": "Mystery GPU"}, PEAKS)
    assert result["mfu"] is None


# ---------------------------------------------------------------------------------------------------
# Statuses


def test_statuses_worst_first():
    assert list(STATUSES) == ["failed", "oom", "diverged", "timeout", "unsupported", "ok"]
    assert worst_status(["ok", "unsupported", "oom"]) == "oom"
    assert all(STATUSES.values())  # each says what it means


# ---------------------------------------------------------------------------------------------------
# merge_ranks on hand-made rank results


def rank_result(rank: int, status: str = "ok", reason: str | None = None, *, window: float, rss: float, wall: float,
                energy: float | None, util: float | None, steps: list[tuple]) -> dict:
    """steps: (step, measured, tokens, padded, samples, flops, step_time_s, loader_s) per optimizer step."""
    records = [
        {"step": s, "measured": m, "tokens": t, "padded_tokens": p, "samples": n, "flops": f, "step_time_s": dt,
         "loader_s": ls, "loss": 1.0, "lr": 0.1}
        for s, m, t, p, n, f, dt, ls in steps
    ]
    metrics = {"run_id": "x", "status": status, "status_reason": reason, "device": "cpu", "device_name": "cpu",
               "world_size": 2, "window_s": window, "peak_rss_mb": rss, "wall_time_s": wall, "train_time_s": wall - 1,
               "energy_j": energy, "gpu_power_mean_w": None, "gpu_util_mean": util, "tokens_per_s": 1.0,
               "eval_accuracy": 0.75 if rank == 0 else None}
    return {"rank": rank, "metrics": metrics, "steps": records}



def test_merge_ranks_sums_counts_maxes_times_and_takes_the_worst_status():
    rank0 = rank_result(0, window=2.0, rss=100.0, wall=10.0, energy=5.0, util=50.0, steps=[
        (0, False, 1000, 1200, 4, 10, 9.0, 0.5), (1, True, 100, 120, 4, 20, 1.0, 0.1), (2, True, 110, 130, 4, 20, 1.0, 0.3)])
    rank1 = rank_result(1, "oom", "CUDA out of memory", window=2.5, rss=300.0, wall=12.0, energy=7.0, util=70.0, steps=[
        (0, False, 2000, 2100, 4, 10, 8.0, 0.2), (1, True, 200, 240, 4, 20, 1.5, 0.05),
        (2, True, 210, 250, 4, 20, 0.5, 0.4)])
    metrics, steps = merge_ranks([rank1, rank0], devices=2)  # order of files does not matter

    assert metrics["status"] == "oom"
    assert metrics["status_reason"] == "rank 1: CUDA out of memory"
    assert metrics["eval_accuracy"] == 0.75  # rank 0 is the base
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["tokens"] for s in steps] == [3000, 300, 320]
    assert [s["padded_tokens"] for s in steps] == [3300, 360, 380]
    assert [s["samples"] for s in steps] == [8, 8, 8]
    assert [s["flops"] for s in steps] == [20, 40, 40]
    assert [s["step_time_s"] for s in steps] == [9.0, 1.5, 1.0]  # a step lasts as long as its slowest rank
    assert [s["loader_s"] for s in steps] == [0.5, 0.1, 0.4]
    assert metrics["peak_rss_mb"] == 300.0 and metrics["wall_time_s"] == 12.0 and metrics["train_time_s"] == 11.0
    assert metrics["window_s"] == 2.5
    # Throughput: measured steps only, summed over ranks, over the longest window; per device = global / 2.
    assert metrics["measured_steps"] == 2
    assert metrics["measured_tokens"] == 620
    assert metrics["tokens_per_s"] == pytest.approx(620 / 2.5)
    assert metrics["tokens_per_s_per_device"] == pytest.approx(620 / 2.5 / 2)
    assert metrics["samples_per_s"] == pytest.approx(16 / 2.5)
    assert metrics["padding_fraction"] == pytest.approx(1 - 620 / 740)
    # Energy adds up over the ranks' GPUs; utilisation averages.
    assert metrics["energy_j"] == 12.0
    assert metrics["gpu_util_mean"] == 60.0
    assert metrics["energy_j_per_token"] == pytest.approx(12.0 / 620)
    assert [entry["status"] for entry in metrics["per_rank"]] == ["ok", "oom"]


def test_merge_ranks_missing_energy_on_one_rank_is_null_not_partial():
    rank0 = rank_result(0, window=1.0, rss=1.0, wall=2.0, energy=5.0, util=None, steps=[(0, True, 10, 10, 1, 1, 1.0, 0.0)])
    rank1 = rank_result(1, window=1.0, rss=1.0, wall=2.0, energy=None, util=None, steps=[(0, True, 10, 10, 1, 1, 1.0, 0.0)])
    metrics, _ = merge_ranks([rank0, rank1], devices=2)
    assert metrics["status"] == "ok" and metrics["status_reason"] is None
    assert metrics["energy_j"] is None and metrics["energy_j_per_token"] is None
    assert metrics["gpu_util_mean"] is None


@pytest.mark.parametrize("statuses, worst", [
    (["ok", "timeout"], "timeout"),
    (["unsupported", "timeout"], "timeout"),
    (["diverged", "oom"], "oom"),
    (["oom", "failed"], "failed"),
    (["ok", "unsupported"], "unsupported"),
    (["diverged", "ok"], "diverged"),
])
def test_merge_ranks_worst_status_wins(statuses, worst):
    ranks = [rank_result(i, status, None if status == "ok" else f"reason {i}", window=1.0, rss=1.0, wall=2.0, energy=None,
                         util=None, steps=[(0, True, 10, 10, 1, 1, 1.0, 0.0)]) for i, status in enumerate(statuses)]
    metrics, _ = merge_ranks(ranks, devices=2)
    assert metrics["status"] == worst
    culprit = statuses.index(worst)
    if culprit != 0:
        assert metrics["status_reason"] == f"rank {culprit}: reason {culprit}"


def test_wall_time_is_the_whole_job_from_its_process_start(monkeypatch):
    """Issue 28 item 3: wall_time_s began when train_run was entered (after imports and the model build),
    so 6 rows had overhead_s > wall_time_s. It is the job's process age (environment.process_age_s: imports
    included; a warm-started job's client start) when its figures are final."""
    from ftbench.errors import UnsupportedConfiguration
    from ftbench.measure import environment
    from ftbench.runspec import RunSpec
    from ftbench.train import trainer  # torch: imported here, the rest of this file is torch-free

    def unsupported(*_):
        raise UnsupportedConfiguration("not on this machine")

    monkeypatch.setattr(environment, "process_age_s", lambda: 123.0)
    monkeypatch.setattr(trainer, "_prepare", unsupported)
    metrics, steps = trainer.train_run(RunSpec(model="m", dataset="d", run_id="r"), "no-data")
    assert (metrics["status"], metrics["wall_time_s"], steps) == ("unsupported", 123.0, [])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process start times from /proc (psutil's elsewhere)")
@pytest.mark.parametrize("warm_job", [False, True])
def test_a_process_age_is_no_older_than_the_process(warm_job):
    """A job's startup_s, overhead_s and wall_time_s are its process's age. That age was read against the wall
    clock from a start time built on /proc/stat's boot time, which is rounded to the second: every age on a host
    was off by the same fraction of a second (a process 0.05 s old read as 0.47 s). Timed from outside, a
    process that reports its age and exits must be no older than the time it took. A warm-started job reads its
    age from its client's start, passed over the socket (warmstart._process_start_time)."""
    import subprocess
    import time

    report = ("from ftbench.measure import environment; from ftbench.cluster import warmstart; "
              + ("environment.job_started_at = warmstart._process_start_time(); " if warm_job else "")
              + "print(environment.process_age_s())")
    for _ in range(3):
        started = time.monotonic()
        age = float(subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True,
                                   env={**os.environ, "PYTHONPATH": str(ROOT / "scripts")}).stdout)
        lived = time.monotonic() - started
        tick = 1 / os.sysconf("SC_CLK_TCK")  # the start time's resolution
        assert 0 < age <= lived + tick, (age, lived)
