"""The workflow on a real SLURM cluster, run as the README tells a new user: the profile linked to
~/.config/snakemake/slurm, account/partitions in environment variables, `snakemake --profile slurm`
with a per-invocation --set-resources, against Debian's slurmctld with no accounting database.

One single-node cluster (tests/slurm_cluster.py) serves the module; its daemons are stopped at the end
whatever happens. The experiment is the conftest's tiny BERT on the tiny CSV, a few steps per run. No
test-only plugin settings: the profile's own polling, and ftbench's own switch to squeue (no sacct here).

The tests share one workdir and build on each other: the matrix with one run that fails inside its job,
then a run that is cancelled while it trains and is submitted again, after which collect and report run.
The last two tests stop that cluster and start their own: one of two nodes, for multi-node DDP and FSDP
runs, and one whose node is smaller than a GPU job's usual CPU request.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import slurm_cluster
from conftest import ROOT, SNAKEFILE, snakemake_failure, tiny_config, write_config
from ftbench.experiment import matrix

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PROFILE = ROOT / "profiles" / "slurm"
SNAKEMAKE_LIMIT_S = 240
# The README's per-invocation override: it replaces the estimate of these two (a retry scales them as it scales the
# estimate: twice the walltime), and must keep the rules' other resources (the GPU partition).
SET_TRAIN_RESOURCES = ["--set-resources", "train:mem_mb=9000", "train:runtime=10"]
SWITCH_LINE = "ftbench: sacct does not work on this cluster"


@pytest.fixture(scope="module")
def config_home(tmp_path_factory):
    """The README's install step: `ln -s "$PWD/profiles/slurm" ~/.config/snakemake/slurm` (in a test home)."""
    home = tmp_path_factory.mktemp("config-home")
    (home / "snakemake").mkdir()
    (home / "snakemake" / "slurm").symlink_to(PROFILE)
    return home


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
    return tmp_path_factory.mktemp("slurm-workflow")


@pytest.fixture(scope="module")
def base_config(tiny_model_dir, tiny_csv):
    """Two runs, one asking for a GPU (the fake ones) and one for the CPU only."""
    return tiny_config(
        tiny_model_dir,
        tiny_csv,
        matrix={"model": ["tiny"], "dataset": ["tiny"], "method": ["lora"], "num_gpus": [0, 1]},
    )


def snakemake_command(workdir: Path, configfile: Path, *extra: str) -> list[str]:
    beside = Path(sys.executable).with_name("snakemake")
    snakemake = [str(beside)] if beside.is_file() else [sys.executable, "-m", "snakemake"]
    return [
        # snakemake waits for its running jobs on SIGTERM: -k kills it if that takes longer than 15 s.
        "timeout", "-k", "15", str(SNAKEMAKE_LIMIT_S),
        *snakemake,
        "--snakefile", str(SNAKEFILE),
        "--directory", str(workdir),
        "--configfile", str(configfile),
        "--profile", "slurm",
        *extra,  # --set-resources last: it takes every argument after it
    ]


def snakemake_env(config_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The rules call `python`: the jobs (sbatch --export=ALL) must find this venv's.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["XDG_CONFIG_HOME"] = str(config_home)  # where `--profile slurm` is found
    # The README's environment variables. No accounting database here, so an account could not be
    # validated: leave it unset. Training jobs go to the `gpu` partition, the others to `debug`.
    env.pop("SBATCH_ACCOUNT", None)
    env["SBATCH_PARTITION"] = slurm_cluster.PARTITION
    env["FTBENCH_GPU_PARTITION"] = slurm_cluster.GPU_PARTITION
    return env


def _umask_022():
    os.umask(0o022)  # a common login umask: results must come out readable by teammates (0644)


def run(workdir: Path, configfile: Path, config_home: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        snakemake_command(workdir, configfile, *extra), cwd=workdir, env={**snakemake_env(config_home), **(env or {})},
        capture_output=True, text=True, timeout=SNAKEMAKE_LIMIT_S + 30, preexec_fn=_umask_022,
    )


def submitted(process) -> dict[int, str]:
    """SLURM job id -> rule name of every job this snakemake run submitted (from its log)."""
    text = process.stdout + process.stderr
    jobs = {}
    for snakemake_id, slurm_id in re.findall(r"Job (\d+) has been submitted with SLURM jobid (\d+)", text):
        match = re.search(rf"rule (\w+):\n(?:    .*\n)*?    jobid: {snakemake_id}\n", text)
        jobs[int(slurm_id)] = match.group(1) if match else "?"
    return jobs


def run_id_of(cluster, job_id: int) -> str | None:
    """The run a train job trained: the plugin puts rule and wildcards in the job's comment."""
    match = re.fullmatch(r"rule_train_wildcards_(\S+)", cluster.job_info(job_id).get("Comment", ""))
    return match.group(1) if match else None


FAULT_ENV = "FTBENCH_INJECT_FAULT"
KILLED = "-r2-"  # the run id part of the run killed in first_run


def broken_model(tiny_model_dir: Path) -> dict:
    """A model that passes validation but cannot be built inside the job (30 hidden units, 4 heads).
    It tokenises like the tiny model, so it shares the prepared data and only its train job fails."""
    return {
        "source": {
            "kind": "config", "architecture": "BertConfig",
            "overrides": {"hidden_size": 30, "num_attention_heads": 4, "num_hidden_layers": 1},
            "tokenizer": {"kind": "path", "path": str(tiny_model_dir)},
        },
        "task": "classification",
    }


@pytest.fixture(scope="module")
def first_run(cluster, workdir, base_config, tiny_model_dir, config_home):
    """The two-run matrix, one run whose model cannot be built (its job ends in a `failed` row) and one
    run whose process is killed (SIGKILL at step 1, as the kernel's OOM killer does: the job fails with no
    row), trained through SLURM (targets: every run's metrics.json, since the killed run keeps collect and
    report from running)."""
    config = {
        **base_config,
        "models": {**base_config["models"], "broken": broken_model(tiny_model_dir)},
        "include": [{"model": "broken", "dataset": "tiny", "num_gpus": 0},
                    {"model": "tiny", "dataset": "tiny", "lora_rank": 2, "num_gpus": 0}],
    }
    configfile = write_config(workdir, config, name="config-first.yaml")
    run_ids = [spec.run_id for spec in matrix.expand_runs(config)]
    before = set(cluster.submitted_job_ids())
    started = time.monotonic()
    targets = [f"results/runs/{run_id}/metrics.json" for run_id in run_ids]
    process = run(workdir, configfile, config_home, *targets, *SET_TRAIN_RESOURCES, env={FAULT_ENV: f"kill@1:run={KILLED}"})
    print(f"\nfirst run through SLURM: {time.monotonic() - started:.0f} s")
    jobs = submitted(process)
    trains: dict[str, list[int]] = {}  # run id -> its train jobs, in submission order
    for job_id in sorted(job_id for job_id, rule in jobs.items() if rule == "train"):
        trains.setdefault(run_id_of(cluster, job_id), []).append(job_id)
    return process, jobs, trains, set(cluster.submitted_job_ids()) - before


def test_matrix_jobs_go_through_sbatch_with_their_resources(cluster, workdir, first_run):
    process, jobs, trains, new_ids = first_run
    # Every job went through sbatch: slurmctld accepted exactly the job ids Snakemake reports
    # (the killed run twice: the profile retries a failed job once).
    assert sorted(jobs.values()) == ["prepare_data"] + ["train"] * 5, snakemake_failure(process)
    assert set(jobs) == new_ids
    good = {run_id: job_ids for run_id, job_ids in trains.items() if not run_id.startswith("broken-") and KILLED not in run_id}
    assert sorted(map(len, good.values())) == [1, 1], trains
    infos = {}
    for run_id, (job_id,) in good.items():
        info = cluster.job_info(job_id)
        assert info["JobState"] == "COMPLETED", (run_id, info)
        result = json.loads((workdir / "results" / "runs" / run_id / "metrics.json").read_text())
        assert result["metrics"]["status"] == "ok", result["metrics"]
        infos[result["spec"]["num_gpus"]] = info
    # runtime (minutes) is the walltime: the 10 minutes given with --set-resources (the estimate's floor too).
    assert {info["TimeLimit"] for info in infos.values()} == {"00:10:00"}
    prepare = cluster.job_info(next(j for j, r in jobs.items() if r == "prepare_data"))
    # The README's table, read back from slurmctld. prepare_data: 1 CPU, 4 GB, 30 min, SBATCH_PARTITION.
    assert (prepare["TimeLimit"], prepare["NumCPUs"], prepare["MinMemoryNode"]) == ("00:30:00", "1", "4000M"), prepare
    assert prepare["Partition"] == slurm_cluster.PARTITION
    # Training: FTBENCH_GPU_PARTITION (for CPU runs of the matrix too) survives the command line's
    # --set-resources, whose memory applies; the rule's CPUs are not capped at the login node's cores.
    for info in infos.values():
        assert info["Partition"] == slurm_cluster.GPU_PARTITION, info
        assert info["MinMemoryNode"] == "9000M", info
    # num_gpus 1: one (fake) GPU and 4 CPUs per GPU.
    assert infos[1].get("TresPerJob") == "gres:gpu:1", infos[1]
    assert infos[1].get("CpusPerTres") == "gres:gpu:4", infos[1]
    assert infos[1]["NumCPUs"] == "4", infos[1]
    # num_gpus 0: no GPU asked for, 8 CPUs.
    assert "gpu" not in infos[0].get("TresPerJob", ""), infos[0]
    assert infos[0]["NumCPUs"] == "8", infos[0]
    # No silent wait: sacct fails here, and the switch to squeue is said before the first submission.
    output = process.stdout + process.stderr
    assert SWITCH_LINE in output and output.index(SWITCH_LINE) < output.index("submitted with SLURM jobid"), output[-3000:]


def test_failing_job_is_reported_as_failed(cluster, workdir, first_run):
    process, jobs, trains, _ = first_run
    output = process.stdout + process.stderr
    assert process.returncode != 0, snakemake_failure(process)
    # A job killed from inside (the OOM killer) fails, and the profile's one retry asks for twice the time.
    (killed,) = (run_id for run_id in trains if KILLED in run_id)
    first, retry = trains[killed]
    assert [cluster.job_info(job_id)["JobState"] for job_id in (first, retry)] == ["FAILED", "FAILED"]
    # A retry gets twice the walltime and memory (README), given with --set-resources as they were here.
    assert [cluster.job_info(job_id)["TimeLimit"] for job_id in (first, retry)] == ["00:10:00", "00:20:00"]
    assert [cluster.job_info(job_id)["MinMemoryNode"] for job_id in (first, retry)] == ["9000M", "18000M"]
    assert "Error in rule train" in output and f"SLURM-job '{retry}' failed" in output, output[-5000:]
    assert not (workdir / "results" / "runs" / killed / "metrics.json").exists()
    # The end of the invocation: the killed job with its last line, and nothing named as an error to fix (the
    # broken run's error is its row).
    closing = output[output.rindex("=" * 100, 0, output.rindex("=" * 100)):]
    assert f"  no line logs/train/{killed}.log: ftbench: FTBENCH_INJECT_FAULT (test-only): SIGKILL at step 1" in closing, closing
    assert "error to fix" not in closing and "ftbench: some jobs failed, nothing to fix (listed above)" in closing, closing
    # A run whose model cannot be built ends in a `failed` row with the error's line, its job completed
    # once (nothing to retry), and the traceback in its log.
    (broken,) = (run_id for run_id in trains if run_id.startswith("broken-"))
    (job_id,) = trains[broken]
    assert cluster.job_info(job_id)["JobState"] == "COMPLETED"
    result = json.loads((workdir / "results" / "runs" / broken / "metrics.json").read_text())["metrics"]
    assert result["status"] == "failed" and "ValueError" in result["status_reason"], result
    assert "Traceback" in (workdir / "logs" / "train" / f"{broken}.log").read_text()


def test_cancelled_job_is_submitted_again_alone(cluster, workdir, base_config, first_run, config_home):
    """scancel a training job while it runs; the re-run submits that run again and no other training,
    then collect and report, so metrics.parquet and the report appear.

    The run is long (max_steps 10^6), so it is still running when cancelled. The re-run ends it at step 2 with an
    injected NaN (a diverged row) rather than waiting out its 2-minute walltime: stopping before the walltime is
    test_slurm_timelimit.py's. A 1-minute walltime, too short for a job to start and write its row, is refused by
    `snakemake -n` with one line naming the minimum.
    """
    config = {**base_config, "include": [{"model": "tiny", "dataset": "tiny", "num_gpus": 0, "max_steps": 1_000_000}]}
    configfile = write_config(workdir, config, name="config-long.yaml")
    refused = run(workdir, configfile, config_home, "-n", "--set-resources", "train:runtime=1")
    assert refused.returncode != 0
    assert ("ftbench: --set-resources train:runtime=1: a train job needs a walltime of at least 2 minutes"
            in refused.stdout + refused.stderr), snakemake_failure(refused)
    # --retries 0: the profile's one retry would otherwise resubmit the cancelled job at once, in the
    # same invocation; this test is about the next invocation.
    extra = ["--retries", "0", "--set-resources", "train:runtime=2"]
    command = snakemake_command(workdir, configfile, *extra)

    started = time.monotonic()
    first = subprocess.Popen(command, cwd=workdir, env=snakemake_env(config_home), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=_umask_022)
    try:
        job_id, run_id = _wait_for_running_train(cluster, workdir, timeout_s=120)
        subprocess.run(["scancel", str(job_id)], check=True)
        output, _ = first.communicate(timeout=SNAKEMAKE_LIMIT_S)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    print(f"\nsubmit + cancel: {time.monotonic() - started:.0f} s")
    assert first.returncode != 0, output[-4000:]
    # The finished runs of the matrix were not trained again: this was the only job submitted.
    assert re.findall(r"submitted with SLURM jobid (\d+)", output) == [str(job_id)], output[-4000:]
    assert cluster.job_info(job_id)["JobState"] == "CANCELLED"
    assert f"SLURM-job '{job_id}' failed" in output and "CANCELLED" in output, output[-4000:]
    # The end of the invocation: the cancelled run's own line, after whatever Snakemake printed, and nothing to fix.
    closing = output[output.rindex("=" * 100, 0, output.rindex("=" * 100)):]
    assert f"  cancelled logs/train/{run_id}.log: ftbench: run {run_id} was terminated (SIGTERM)" in closing, closing
    assert "(cancelled or preempted: nothing to fix)" in closing and "error to fix" not in closing, closing

    started = time.monotonic()
    rerun = run(workdir, configfile, config_home, *extra, env={FAULT_ENV: "nan@2"})
    print(f"re-run: {time.monotonic() - started:.0f} s")
    assert rerun.returncode == 0, snakemake_failure(rerun)
    jobs = submitted(rerun)
    assert sorted(jobs.values()) == ["collect", "report", "train"], jobs
    (train_job,) = (j for j, rule in jobs.items() if rule == "train")
    assert run_id_of(cluster, train_job) == run_id
    assert cluster.job_info(train_job)["TimeLimit"] == "00:02:00"
    result = json.loads((workdir / "results" / "runs" / run_id / "metrics.json").read_text())["metrics"]
    assert result["status"] == "diverged" and result["diverged_step"] == 2, result

    metrics = pd.read_parquet(workdir / "results" / "metrics.parquet")
    assert sorted(metrics["status"]) == ["diverged", "ok", "ok"], metrics[["run_id", "status"]]
    assert (workdir / "results" / "report.html").stat().st_size > 1000
    # Written by SLURM jobs under a 022 umask: readable by teammates.
    for path in ("results/metrics.parquet", "results/report.html", f"results/runs/{run_id}/metrics.json"):
        assert oct((workdir / path).stat().st_mode & 0o777) == oct(0o644), path


def _wait_for_running_train(cluster, workdir: Path, timeout_s: float) -> tuple[int, str]:
    """(SLURM job id, run id) of a RUNNING train job that is training (its log shows its first progress line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i %k"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            job_id, _, comment = line.partition(" ")
            match = re.fullmatch(r"rule_train_wildcards_(\S+)", comment.strip())
            log = workdir / "logs" / "train" / f"{match.group(1)}.log" if match else None
            if log is not None and log.exists() and "progress: step 1 of " in log.read_text(errors="replace"):
                return int(job_id), match.group(1)
        time.sleep(0.5)
    raise AssertionError(f"no train job started running within {timeout_s} s:\n{cluster.tail_logs()}")


@pytest.fixture
def two_nodes(cluster, tmp_path_factory):
    """A cluster of two nodes (two slurmd on this machine: tests/slurm_cluster.py), in place of the module's
    one-node cluster, which is stopped first (one cluster at a time on a machine)."""
    cluster.stop()
    two = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm-two"), nodes=2)
    two.start()
    try:
        yield two
    finally:
        two.stop()


def test_a_two_node_run_trains_one_process_group_across_both_nodes(two_nodes, tmp_path, tiny_model_dir, tiny_csv,
                                                                     config_home):
    """num_nodes 2, DDP and FSDP: each run is one job of 2 nodes with gres gpu:1 on each; its launcher starts one
    torchrun per node with srun (ftbench/train/ddp.py), the two meet at a c10d rendezvous on the first node and
    train one gloo process group (the GPUs are fake: torch uses the CPU). One merged row per run names both nodes."""
    config = tiny_config(tiny_model_dir, tiny_csv, matrix={
        "model": ["tiny"], "dataset": ["tiny"], "method": ["lora"], "parallel": ["ddp", "fsdp"],
        "num_gpus": [1], "num_nodes": [2]}, defaults={**tiny_config(tiny_model_dir, tiny_csv)["defaults"], "max_steps": 4})
    configfile = write_config(tmp_path, config, name="config-nodes.yaml")
    started = time.monotonic()
    process = run(tmp_path, configfile, config_home, "results/metrics.parquet", "--retries", "0")
    print(f"\ntwo-node runs through SLURM: {time.monotonic() - started:.0f} s")
    assert process.returncode == 0, snakemake_failure(process) + "\n" + _train_logs(tmp_path) + two_nodes.tail_logs()
    jobs = submitted(process)
    assert sorted(jobs.values()) == ["collect", "prepare_data", "train", "train"], jobs
    for job_id in (job_id for job_id, rule in jobs.items() if rule == "train"):
        info = two_nodes.job_info(job_id)
        assert (info["JobState"], info["NumNodes"], info["NodeList"]) == ("COMPLETED", "2", "ftnode[1-2]"), info
        assert info["TresPerNode"] == "gres:gpu:1", info  # per node, not a job total SLURM could spread
    rows = pd.read_parquet(tmp_path / "results" / "metrics.parquet").set_index("parallel")
    print(rows[["run_id", "status", "world_size", "hosts", "num_nodes"]].to_string())
    assert sorted(rows.index) == ["ddp", "fsdp"]
    for parallel, row in rows.iterrows():
        assert row["status"] == "ok", (parallel, row.get("status_reason"))
        assert row["world_size"] == 2 * 1  # num_nodes x processes per node (num_gpus 1)
        assert row["hosts"] == "ftnode1,ftnode2", (parallel, row["hosts"])  # SLURM's node names, one per rank
        assert row["num_nodes"] == 2


def _train_logs(workdir: Path) -> str:
    return "\n".join(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}"
                      for log in sorted((workdir / "logs" / "train").glob("*.log")))


def test_small_node_gets_a_fitted_request(cluster, tmp_path_factory, base_config, config_home):
    """A node with 2 CPUs: a GPU run's 4 CPUs per GPU would be refused by sbatch ("Requested node
    configuration is not available") on every attempt; the request is fitted to the node instead
    (2 per GPU, said in one line), submitted once, and the job completes. (A CPU run's 8 CPUs are
    fitted the same way: tests/test_slurm_fit.py.)"""
    cluster.stop()
    small = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm-small"), cpus=2)
    try:
        small.start()
        workdir = tmp_path_factory.mktemp("slurm-small-workflow")
        configfile = write_config(workdir, base_config)
        started = time.monotonic()
        (gpu_run,) = (spec for spec in matrix.expand_runs(base_config) if spec.num_gpus == 1)
        process = run(workdir, configfile, config_home, f"results/runs/{gpu_run.run_id}/metrics.json")
        print(f"\nsmall node: {time.monotonic() - started:.0f} s")
        assert process.returncode == 0, snakemake_failure(process)
        jobs = submitted(process)
        assert sorted(jobs.values()) == ["prepare_data", "train"], jobs  # submitted once
        (train_job,) = (job_id for job_id, rule in jobs.items() if rule == "train")
        info = small.job_info(train_job)
        assert (info["TresPerJob"], info["CpusPerTres"], info["NumCPUs"]) == ("gres:gpu:1", "gres:gpu:2", "2"), info
        assert info["JobState"] == "COMPLETED", info
        assert "have 2 CPUs per GPU for 1-GPU runs: asking for --cpus-per-gpu=2, not 4" in process.stderr
    finally:
        small.stop()
