"""warmstart.py: train jobs forked from a process that has imported the stack, with real processes.

The rest of the suite runs with FTBENCH_WARM_START=0 (conftest.py): here it is on, with each test's own
runtime folder (XDG_RUNTIME_DIR), so its warm processes are its own and are stopped at its end.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import e2e_config, run_snakemake, snakemake_failure, write_config
from ftbench.experiment import matrix
from ftbench.cluster import warmstart

CPU_RUN = {"method": "lora", "precision": "fp32", "batch_size": 8, "seq_len": 32, "lora_rank": 4,
           "lora_targets": ["query", "value"], "learning_rate": 0.001, "max_steps": 6, "warmup_steps": 2,
           "eval_batch_size": 64, "device": "cpu", "num_gpus": 0, "seed": 0}


@pytest.fixture
def warm_env(tmp_path):
    """The environment of a job with warm start on and a runtime folder of this test's own; afterwards,
    the warm processes started in it are stopped."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "FTBENCH_WARM_START": "1", "FTBENCH_WARM_IDLE_S": "60", "XDG_RUNTIME_DIR": str(runtime)}
    yield env
    for lock in (runtime / "ftbench").glob("*.lock"):
        warmstart.stop_server(lock.with_suffix(".sock"))


def wait_for_socket(env: dict, timeout: float = 120) -> Path:
    """The socket of a warm process started in ``env``'s runtime folder, once it listens."""
    folder = Path(env["XDG_RUNTIME_DIR"]) / "ftbench"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sockets = list(folder.glob("*.sock"))
        if sockets:
            return sockets[0]
        time.sleep(0.2)
    logs = "\n".join(path.read_text() for path in folder.glob("*.log"))
    raise AssertionError(f"no warm process listened within {timeout} s; its log:\n{logs}")


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return found


def server_pid(socket_path: Path) -> int:
    return int(socket_path.with_suffix(".lock").read_text())


@pytest.fixture(scope="module")
def cpu_spec(tiny_config_factory):
    def make(**settings):
        config = tiny_config_factory(defaults={**CPU_RUN, **settings}, matrix={"model": ["tiny"], "dataset": ["tiny"]})
        (spec,) = matrix.expand_runs(config)
        return spec

    return make


def train_command(spec, data_dir: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(data_dir), "--out", str(out),
            "--threads", "1"]


# ---------------------------------------------------------------------------------------------------
# Which jobs may share a warm process


def test_jobs_differing_only_in_per_job_variables_share_a_warm_process():
    base = {"PATH": "/usr/bin", "HF_HOME": "/data/hf"}
    key = warmstart.server_key(base)
    assert warmstart.server_key({**base, "CUDA_VISIBLE_DEVICES": "3", "FTBENCH_INJECT_FAULT": "x"}) == key
    # What Snakemake sets per job (its threads and tmpdir): the forked job applies them itself.
    assert warmstart.server_key({**base, "OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4", "TMPDIR": "/scratch"}) == key
    assert warmstart.server_key({**base, "HF_HOME": "/elsewhere"}) != key  # read when transformers is imported
    assert warmstart.server_key({**base, "PYTHONPATH": "/other"}) != key


def test_an_edited_ftbench_file_needs_a_new_warm_process(tmp_path, monkeypatch):
    """A warm process holds the code it imported: a job of edited code must not run in it."""
    package = Path(warmstart.__file__).parents[1]
    copy = tmp_path / "ftbench"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(warmstart, "__file__", str(copy / "cluster" / "warmstart.py"))
    before = warmstart.server_key({})
    loop = copy / "train" / "trainer.py"  # a file of another sub-package: the key covers the whole package
    loop.write_text(loop.read_text() + "\n# edited\n")
    assert warmstart.server_key({}) != before


def test_off_under_slurm_for_ddp_ranks_and_when_switched_off():
    assert warmstart.wanted(["train", "--spec", "{}"], {})
    assert warmstart.wanted(["base-eval", "--spec", "{}"], {})  # the shared evaluation before training too
    assert not warmstart.wanted(["train", "--spec", "{}"], {"SLURM_JOB_ID": "7"})
    assert not warmstart.wanted(["train", "--rank-dir", "r"], {})
    assert not warmstart.wanted(["train"], {"FTBENCH_WARM_START": "0"})
    assert not warmstart.wanted(["collect"], {})


def test_a_warm_jobs_own_process_imports_neither_the_commands_nor_their_libraries():
    """The client only hands its command over: importing the commands (the task families, pandas, pyarrow) was
    most of the 2 s a warm job spent before its run began on an H100 host."""
    probe = "import sys, ftbench.__main__; print(sorted(m for m in ('ftbench.cli', 'pandas', 'pyarrow', 'torch') if m in sys.modules))"
    process = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(Path(warmstart.__file__).resolve().parents[2])})
    assert process.returncode == 0, process.stderr
    assert process.stdout.strip() == "[]"


def test_a_process_that_initialised_cuda_does_not_serve(tmp_path, monkeypatch):
    """A CUDA context does not survive fork(): a warm process that has one must fork no job."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    path = tmp_path / "k.sock"
    assert warmstart.serve(path, idle_s=0) == 1
    assert not path.exists()
    assert "initialised CUDA" in path.with_suffix(".failed").read_text()
    warmstart.start_server(path)  # a later job does not try again for this key
    assert not path.with_suffix(".log").exists()


def test_a_process_whose_imports_broke_cuda_for_its_children_does_not_serve(tmp_path, monkeypatch):
    """Seen on the H100: an import initialised the CUDA driver but not torch's flag. The flag says all is
    well; only a child forked afterwards, failing to use the GPU it saw before, shows it."""
    monkeypatch.setattr(warmstart, "_sees_gpu", lambda: True)  # asked in a forked child, which inherits this
    monkeypatch.setattr(warmstart, "_forked_child_can_use_gpu", lambda: False)
    path = tmp_path / "k.sock"
    assert warmstart.serve(path, idle_s=0) == 1
    assert "a forked child cannot use the GPU" in path.with_suffix(".failed").read_text()
    # Without a GPU there is nothing to break: the checks pass.
    assert warmstart._why_not_fork_safe(False, gpu_visible=False, gpu_usable=False) is None
    assert warmstart._why_not_fork_safe(False, gpu_visible=True, gpu_usable=True) is None


def test_optional_imports_wait_for_their_probes_without_blocking_and_import_only_what_passed(capsys):
    """poll() never waits: False while a probe runs; then the passing module is imported, the failing one is
    not, and a probe past the deadline is stopped (its module left to the jobs)."""
    for name in ("colorsys", "wave"):
        sys.modules.pop(name, None)
    slow = warmstart._fork_check(lambda: time.sleep(1.0) or True)
    optional = warmstart.OptionalImports({"colorsys": slow, "wave": warmstart._fork_check(lambda: False)})
    assert optional.poll() is False  # the slow probe is still running
    deadline = time.monotonic() + 30
    while not optional.poll() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "colorsys" in sys.modules and "wave" not in sys.modules
    assert "wave not preloaded" in capsys.readouterr().out
    stuck = warmstart.OptionalImports({"wave": warmstart._fork_check(lambda: time.sleep(60) or True)})
    stuck.DEADLINE_S = 0.2
    time.sleep(0.3)
    assert stuck.poll() is True and "wave" not in sys.modules
    assert "its check took over" in capsys.readouterr().out


def test_a_client_that_left_is_seen_before_its_job_is_forked():
    """A client that gave up waiting (and runs its job itself) has closed its end: no second copy is started."""
    import socket

    server_end, client_end = socket.socketpair()
    assert not warmstart._hung_up(server_end)
    client_end.close()
    assert warmstart._hung_up(server_end)


def test_fork_checks_run_in_a_child_and_report_its_answer():
    import torch

    assert warmstart._in_forked_child(lambda: True) and not warmstart._in_forked_child(lambda: False)
    assert not warmstart._in_forked_child(lambda: 1 / 0)  # a check that fails says no
    assert warmstart._in_forked_child(warmstart._sees_gpu) == torch.cuda.is_available()
    assert warmstart._in_forked_child(warmstart._imports_leaving_cuda_alone("json", gpu_visible=False))
    assert not warmstart._in_forked_child(warmstart._imports_leaving_cuda_alone("no_such_module_here", gpu_visible=False))
    # Checks asked together run side by side; each answer comes back to its own question.
    yes, no = warmstart._fork_check(lambda: time.sleep(0.2) or True), warmstart._fork_check(lambda: False)
    assert not warmstart._check_result(no) and warmstart._check_result(yes)


def test_no_second_warm_process_while_one_holds_the_lock(tmp_path):
    """A job that finds the socket not yet listening (the warm process is still importing) starts none."""
    import fcntl

    path = tmp_path / "k.sock"
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        warmstart.start_server(path)
    assert not path.with_suffix(".log").exists()


def test_waiting_for_readiness_ends_with_the_ready_mark_of_the_process_holding_the_lock(tmp_path):
    """What the workflow waits for before its first train job: the .ready file naming the pid that holds the lock.
    A mark left by a killed predecessor is not it; a process that gave up, or none at all, ends the wait at once
    (after the grace a just-started one needs to take its lock)."""
    import fcntl

    path = tmp_path / "k.sock"
    started = time.monotonic()
    assert warmstart.wait_until_ready(path, timeout_s=5, start_grace_s=0.3) is False  # nobody holds the lock
    assert time.monotonic() - started < 2
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("4242")
        lock.flush()
        path.with_suffix(".ready").write_text("17")  # a killed predecessor's mark
        assert warmstart.wait_until_ready(path, timeout_s=0.5) is False
        path.with_suffix(".ready").write_text("4242")
        assert warmstart.wait_until_ready(path, timeout_s=0.5) is True
        path.with_suffix(".ready").unlink()
        path.with_suffix(".failed").write_text("importing the stack initialised CUDA\n")
        started = time.monotonic()
        assert warmstart.wait_until_ready(path, timeout_s=5) is False
        assert time.monotonic() - started < 1


# ---------------------------------------------------------------------------------------------------
# Jobs through a warm process, as the train rule starts them


@pytest.mark.slow
def test_a_warm_job_gives_the_result_of_a_cold_one(cpu_spec, prepared_data, tmp_path, warm_env):
    """The first job runs in its own process and starts the warm one; the next runs forked from it, with
    the same losses and scores, its output in the job's own streams, and its overhead counted from its
    own start. The shared evaluation before training (rule base_eval) forks from it too, with the figures the
    cold job's own evaluation before training had."""
    from ftbench.experiment import base_evaluation

    spec = cpu_spec(eval_before_training=True)
    results = []
    for name in ("cold", "warm"):
        out = tmp_path / name / "metrics.json"
        out.parent.mkdir()
        process = subprocess.run(train_command(spec, prepared_data[0], out), env=warm_env, cwd=tmp_path,
                                 capture_output=True, text=True, timeout=300)
        assert process.returncode == 0, process.stderr[-3000:]
        assert f"{spec.run_id}: {{'status': 'ok'" in process.stdout  # the child wrote into the job's stdout
        results.append((json.loads(out.read_text())["metrics"], pd.read_parquet(out.with_name("steps.parquet"))))
        if name == "cold":
            wait_for_socket(warm_env)
    (cold, cold_steps), (warm, warm_steps) = results
    assert (cold["warm_start"], warm["warm_start"]) == (False, True)
    assert warm_steps["loss"].tolist() == cold_steps["loss"].tolist()
    assert warm["eval_accuracy"] == cold["eval_accuracy"]
    assert warm["eval_loss"] == pytest.approx(cold["eval_loss"], rel=1e-6)
    assert warm["overhead_s"] > 0
    # what a job spends before its run begins: the cold one imports the stack, the warm one was forked with it
    assert 0 < warm["startup_s"] < cold["startup_s"] < cold["overhead_s"]
    assert warm["startup_s"] < warm["overhead_s"]
    # the warm process was listening when the warm job came: it waited for nothing
    assert cold["warm_start_wait_s"] is None and warm["warm_start_wait_s"] < 1.0
    assert warm["base_eval_accuracy"] == cold["base_eval_accuracy"]
    # the base_eval job, warm: the cold train job's base figures
    spec_file, out = tmp_path / "base_eval_spec.json", tmp_path / "base_eval" / "result.json"
    spec_file.write_text(spec.to_json(), encoding="utf-8")
    process = subprocess.run([sys.executable, "-m", "ftbench", "base-eval", "--spec-file", str(spec_file), "--data",
                              str(prepared_data[0]), "--out", str(out), "--threads", "1"],
                             env=warm_env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    assert f"{base_evaluation.base_eval_id(spec)}: ok" in process.stdout  # the child wrote into the job's stdout
    shared = json.loads(out.read_text())
    assert shared["warm_start"] is True and shared["status"] == "ok"
    assert shared["figures"]["eval_accuracy"] == cold["base_eval_accuracy"]
    assert shared["figures"]["eval_samples"] == cold["base_eval_samples"] > 0
    assert shared["figures"]["eval_loss"] == pytest.approx(cold["base_eval_loss"], rel=1e-6)


@pytest.mark.slow
def test_a_job_waits_for_a_warm_process_still_importing(cpu_spec, prepared_data, tmp_path, warm_env):
    """The workflow starts the warm process as it starts; the first train job may come before it listens,
    and then waits for it rather than import everything itself."""
    spec = cpu_spec()
    where = subprocess.run([sys.executable, "-m", "ftbench.cluster.warmstart", "where"], env=warm_env, cwd=tmp_path,
                           capture_output=True, text=True, check=True)
    path = Path(where.stdout.strip())
    subprocess.run([sys.executable, "-m", "ftbench.cluster.warmstart", "start"], env=warm_env, cwd=tmp_path, check=True)
    deadline = time.monotonic() + 30
    while not warmstart._serving(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert warmstart._serving(path) and not path.exists()  # holding its lock, importing, not listening yet
    out = tmp_path / "out" / "metrics.json"
    out.parent.mkdir()
    process = subprocess.run(train_command(spec, prepared_data[0], out), env=warm_env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["warm_start"] is True
    # the wait is recorded (part of overhead_s; the projection leaves it out)
    assert 0.0 < metrics["warm_start_wait_s"] < metrics["overhead_s"]


@pytest.mark.slow
def test_a_failing_warm_job_passes_on_its_message_and_exit_status(cpu_spec, prepared_data, tmp_path, warm_env):
    spec = cpu_spec()
    path = start_warm_process(warm_env, tmp_path)
    process = subprocess.run(train_command(spec, tmp_path / "no-such-data", tmp_path / "out" / "metrics.json"),
                             env=warm_env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert process.returncode == 1
    assert process.stderr.strip().splitlines()[-1].startswith("ftbench: ")
    assert "no-such-data" in process.stderr
    assert "exited with 1" in path.with_suffix(".log").read_text()  # it was the warm process's child
    # Once the first job is forked, the warm process imports the optional modules it may (all of them, where no
    # CUDA build of bitsandbytes initialises CUDA when imported), while no job is asking
    deadline = time.monotonic() + 60
    while "the optional imports took" not in path.with_suffix(".log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "the optional imports took" in path.with_suffix(".log").read_text()


def start_warm_process(env: dict, cwd: Path) -> Path:
    """A warm process for train jobs run in ``env`` from ``cwd``, listening: its socket."""
    where = subprocess.run([sys.executable, "-m", "ftbench.cluster.warmstart", "where"], env=env, cwd=cwd, capture_output=True,
                           text=True, check=True)
    path = Path(where.stdout.strip())
    with open(path.with_suffix(".log"), "ab") as log:
        subprocess.Popen([sys.executable, "-m", "ftbench.cluster.warmstart", "serve", str(path)], env=env, cwd=cwd, stdout=log,
                         stderr=subprocess.STDOUT)
    assert wait_for_socket(env) == path
    return path


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_stopping_the_jobs_process_stops_its_warm_child(how, cpu_spec, prepared_data, tmp_path, warm_env):
    """Snakemake stops a job by signalling the process it started: SIGTERM reaches the forked child (which
    ends as a terminated run: no result); after SIGKILL the child sees its client gone and ends."""
    spec = cpu_spec(max_steps=100000, warmup_steps=2)
    path = start_warm_process(warm_env, tmp_path)
    server = server_pid(path)
    probes = set(children_of(server))  # its optional-import checks, forked when it became ready
    out = tmp_path / "out" / "metrics.json"
    out.parent.mkdir()
    client = subprocess.Popen(train_command(spec, prepared_data[0], out), env=warm_env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not set(children_of(server)) - probes and time.monotonic() < deadline:
        time.sleep(0.1)
    (child,) = set(children_of(server)) - probes
    time.sleep(3)  # into training
    client.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
    client.wait(timeout=60)
    deadline = time.monotonic() + 30
    while child in children_of(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert child not in children_of(server)
    assert not out.exists()  # a stopped run writes no result: the next invocation trains it again
    if how == "sigterm":
        assert client.returncode != 0
        assert re.search(r"was terminated .*\(SIGTERM\).*: no result written", client.stderr.read())


# ---------------------------------------------------------------------------------------------------
# Through Snakemake


@pytest.mark.slow
def test_snakemake_jobs_run_warm_with_the_results_of_cold_ones(snakemake_run, tiny_model_dir, tiny_csv, tmp_path, warm_env,
                                                              monkeypatch):
    """The workflow starts the warm process when it starts, with the key its jobs compute (one warm process
    serves them all), and waits for it: every job forks from it, the first one too, and each warm run's losses equal the same run's
    in the (cold) shared workflow."""
    workdir = tmp_path / "workflow"
    config = e2e_config(tiny_model_dir, tiny_csv)
    write_config(workdir, config)
    first, *others = matrix.expand_runs(config)
    for name, value in warm_env.items():
        monkeypatch.setenv(name, value)
    process = run_snakemake(workdir, f"results/runs/{first.run_id}/metrics.json", timeout=600)
    assert process.returncode == 0, snakemake_failure(process)
    # The workflow waited for the warm process before its first train job: that job forked from it at once.
    assert "train jobs fork from a process that had the stack imported" in process.stderr
    first_metrics = json.loads((workdir / "results" / "runs" / first.run_id / "metrics.json").read_text())["metrics"]
    assert first_metrics["warm_start"] is True and first_metrics["warm_start_wait_s"] < 0.5
    path = wait_for_socket(warm_env)
    assert warmstart._ready_pid(path) == server_pid(path)
    assert "the optional imports took" in path.with_suffix(".log").read_text()  # settled before any job asked
    process = run_snakemake(workdir, timeout=600)
    assert process.returncode == 0, snakemake_failure(process)
    cold_workdir = snakemake_run[0]
    for run in others:
        warm = json.loads((workdir / "results" / "runs" / run.run_id / "metrics.json").read_text())["metrics"]
        cold = json.loads((cold_workdir / "results" / "runs" / run.run_id / "metrics.json").read_text())["metrics"]
        assert warm["warm_start"] is True, run.run_id
        assert warm["status"] == cold["status"], run.run_id
        if cold.get("eval_loss") is not None:
            assert warm["eval_loss"] == pytest.approx(cold["eval_loss"], rel=1e-5), run.run_id
        steps = [pd.read_parquet(folder / "results" / "runs" / run.run_id / "steps.parquet")["loss"].tolist()
                 for folder in (workdir, cold_workdir)]
        assert steps[0] == pytest.approx(steps[1], rel=1e-5), run.run_id
    logs = list((Path(warm_env["XDG_RUNTIME_DIR"]) / "ftbench").glob("*.log"))
    assert len(logs) == 1, [log.read_text() for log in logs]  # the workflow's and every job's key agree
    table = pd.read_parquet(workdir / "results" / "metrics.parquet")
    assert table.set_index("run_id").loc[[run.run_id for run in others], "warm_start"].all()
