"""One time limit per training job, on a real SLURM cluster (tests/slurm_cluster.py, used as it is).

The limit is decided where the invocation is planned and handed to the job: `snakemake --profile slurm -n`
shows it, sbatch -t submits it, and the Snakemake inside the job (on a node with fake GPUs, where torch
finds no CUDA device) gives the same number to the run as --time-limit-s; the run counts it from SLURM's start of
the job and keeps its own margin inside it, so a run given a short limit stops itself before SLURM's limit with a
`timeout` row that was evaluated, and logs its progress on the way. A run that SLURM's limit ends anyway (here an
administrator's `scontrol update` shortens it) keeps a `timeout` row of its steps, which the retry keeps instead of
training. The tests share one workdir: the first has SLURM end its long job at a shortened limit once the job is
training, the second runs that run again (its folder deleted) under a 2-minute limit.

Only one SLURM test cluster runs on a machine at a time: SlurmCluster.start() waits for another's to end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import slurm_cluster
from conftest import ROOT, SNAKEFILE, snakemake_failure, tiny_config, write_config
from ftbench.cluster import resources
from ftbench.experiment import matrix

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SNAKEMAKE_LIMIT_S = 300
SHORT_LIMIT_MIN = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except slurm_cluster.ClusterUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm-timelimit")


@pytest.fixture(scope="module")
def long_run(workdir, tiny_model_dir, tiny_csv):
    """One GPU-shaped run (a fake GPU: it trains on the CPU) far too long to finish: (config file, run)."""
    config = tiny_config(tiny_model_dir, tiny_csv, matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["lora"]})
    config["defaults"].update(num_gpus=1, max_steps=1_000_000)
    (run,) = matrix.expand_runs(config)
    return write_config(workdir, config), run


def command(workdir: Path, configfile: Path, *extra: str) -> list[str]:
    beside = Path(sys.executable).with_name("snakemake")
    snakemake = [str(beside)] if beside.is_file() else [sys.executable, "-m", "snakemake"]
    return ["timeout", "-k", "15", str(SNAKEMAKE_LIMIT_S), *snakemake, "--snakefile", str(SNAKEFILE),
            "--directory", str(workdir), "--configfile", str(configfile), "--profile", str(ROOT / "profiles" / "slurm"),
            "-p", *extra]  # -p: each job's own Snakemake prints the command it runs into the job's log


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the jobs' `python`
    env.pop("SBATCH_ACCOUNT", None)
    env.pop(resources.TRAIN_SPEED_ENV, None)  # decided by the planning Snakemake, as for a user
    env["SBATCH_PARTITION"] = slurm_cluster.PARTITION
    env["FTBENCH_GPU_PARTITION"] = slurm_cluster.GPU_PARTITION
    return env


def job_log(workdir: Path, job_id: int) -> str:
    logs = list((workdir / ".snakemake" / "slurm_logs").rglob(f"{job_id}.log"))
    return logs[0].read_text(errors="replace") if logs else ""


def limits_in(text: str) -> set[tuple[int, int]]:
    """(runtime printed, minutes of --time-limit-s) of each train command a Snakemake printed."""
    blocks = text.split("rule train:")[1:]
    return {(int(re.search(r"\bruntime=(\d+)", block).group(1)),
             int(re.search(r"--time-limit-s \$\(\( (\d+) \* 60 \)\)", block).group(1))) for block in blocks}


def minutes(time_limit: str) -> int:
    hours, mins, secs = (int(part) for part in time_limit.split("-")[-1].split(":"))
    return hours * 60 + mins + (secs > 0)


def test_the_job_runs_with_the_limit_it_was_submitted_with(cluster, workdir, long_run):
    """The issue: sbatch -t 10 min while the job, finding no CUDA device, estimated itself at CPU speed
    (21 min) and `-n` showed that too. Now -n, sbatch and the job's --time-limit-s are one number: the
    estimate at a GPU node's speed, decided where the invocation was planned."""
    configfile, run = long_run
    expected = resources.train_runtime_minutes(run, environ={resources.TRAIN_SPEED_ENV: "gpu"})
    assert expected < resources.train_runtime_minutes(run, environ={resources.TRAIN_SPEED_ENV: "cpu"})

    dry = subprocess.run(command(workdir, configfile, "-n"), cwd=workdir, env=environment(), capture_output=True,
                         text=True, timeout=SNAKEMAKE_LIMIT_S + 30)
    assert dry.returncode == 0, snakemake_failure(dry)
    assert limits_in(dry.stdout + dry.stderr) == {(expected, expected)}

    # Once it trains, its limit is cut to a minute: SLURM ends it there (TIMEOUT), before it would stop itself.
    # The profile's one retry asks for twice the walltime and keeps the row the first attempt kept.
    target = f"results/runs/{run.run_id}/metrics.json"
    process = subprocess.Popen(command(workdir, configfile, target), cwd=workdir, env=environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        job_id, inside = _wait_for_the_jobs_command(cluster, workdir, timeout_s=120)
        assert limits_in(inside) == {(expected, expected)}, inside[-3000:]
        _wait_for_progress(workdir / "logs" / "train" / f"{run.run_id}.log", timeout_s=120)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=1"], check=True)
        output, _ = process.communicate(timeout=SNAKEMAKE_LIMIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output[-3000:]
    assert cluster.job_info(job_id)["JobState"] == "TIMEOUT", cluster.job_info(job_id)
    (retry,) = (int(j) for j in re.findall(r"submitted with SLURM jobid (\d+)", output) if int(j) > job_id)
    assert minutes(cluster.job_info(retry)["TimeLimit"]) == 2 * expected, cluster.job_info(retry)  # the README's retry
    result = json.loads((workdir / target).read_text())["metrics"]
    assert result["status"] == "timeout", result
    assert result["status_reason"].startswith("the scheduler's time limit (1 min) ended its job after "), result
    assert result["last_step"] >= 0 and result.get("eval_accuracy") is None, result  # its steps; no time to evaluate
    kept_line = f"ftbench: run {run.run_id}: kept the row (status timeout)"
    retry_log = (workdir / "logs" / "train" / f"{run.run_id}.log").read_text()
    assert kept_line in retry_log  # the retry did not train
    # ...and its log, written anew, still says why the first job ended and the walltime to ask for
    assert f"ftbench: an earlier job of this run ended: run {run.run_id} reached its time limit (1 min)" in retry_log
    assert "--set-resources train:runtime=" in retry_log


def _wait_for_progress(log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.is_file() and "\nprogress: step 1 of " in log.read_text(errors="replace"):
            return
        time.sleep(1)
    raise AssertionError(f"{log} shows no progress line within {timeout_s} s")


def _wait_for_the_jobs_command(cluster, workdir: Path, timeout_s: float) -> tuple[int, str]:
    """(SLURM job id, its log) of the train job once its own Snakemake has printed the command it runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %k"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            job_id, _, comment = line.partition(" ")
            text = job_log(workdir, int(job_id))
            if comment.startswith("rule_train") and "--time-limit-s" in text:
                return int(job_id), text
        time.sleep(1)
    raise AssertionError(f"no train job printed its command within {timeout_s} s\n{cluster.tail_logs()}")


def test_a_short_limit_stops_the_job_itself_with_an_evaluated_timeout_row(cluster, workdir, long_run):
    configfile, run = long_run
    shutil.rmtree(workdir / "results" / "runs" / run.run_id)  # the README's way to train a run again
    process = subprocess.run(
        command(workdir, configfile, "--slurm-keep-successful-logs", "--set-resources", f"train:runtime={SHORT_LIMIT_MIN}"),
        cwd=workdir, env=environment(), capture_output=True, text=True, timeout=SNAKEMAKE_LIMIT_S + 30)
    assert process.returncode == 0, snakemake_failure(process)
    submitted = re.findall(r"submitted with SLURM jobid (\d+)", process.stdout + process.stderr)
    (job_id,) = (int(j) for j in submitted if cluster.job_info(int(j)).get("Comment", "").startswith("rule_train"))
    info = cluster.job_info(job_id)
    assert info["JobState"] == "COMPLETED" and minutes(info["TimeLimit"]) == SHORT_LIMIT_MIN, info  # not SLURM's TIMEOUT
    assert minutes(info["RunTime"]) <= SHORT_LIMIT_MIN, info
    assert limits_in(job_log(workdir, job_id)) == {(SHORT_LIMIT_MIN, SHORT_LIMIT_MIN)}

    result = json.loads((workdir / "results" / "runs" / run.run_id / "metrics.json").read_text())["metrics"]
    assert result["status"] == "timeout" and "before the job's time limit (2 min)" in result["status_reason"], result
    log = (workdir / "logs" / "train" / f"{run.run_id}.log").read_text()
    # Its limit counted from SLURM's start of the job (scontrol: this SLURM has no SLURM_JOB_START_TIME), and its
    # progress: the first line after step 1, then one every 30 s of training (tests/test_progress.py: the cadence).
    assert "time limit 2 min, counted from the scheduler's start (scontrol, " in log, log[-3000:]
    progress = re.findall(r"^progress: step (\d+) of 1000000 \(0%\), [0-9,]+ tokens/s, (\d+)s elapsed", log, re.M)
    assert progress and progress[0][0] == "1", log[-3000:]
    assert all(28 <= int(later[1]) - int(earlier[1]) <= 40 for earlier, later in zip(progress, progress[1:])), progress
    assert result.get("eval_accuracy") is not None and result.get("eval_samples"), result  # evaluated in its margin
    table = pd.read_parquet(workdir / "results" / "metrics.parquet")
    assert list(table["status"]) == ["timeout"]
