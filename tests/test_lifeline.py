"""lifeline.py: a job ends when the process it watches (its Snakemake) ends; tested with real processes.
Through Snakemake itself (SIGKILL mid-run): tests/test_faults.py::test_sigkilled_snakemake_then_rerun_incomplete_redoes_only_the_interrupted_run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftbench.cluster import lifeline

WATCHER = "import sys, time; from ftbench.cluster import lifeline; lifeline.watch(int(sys.argv[1])); time.sleep(60)"
# As on macOS: no /proc, so processes are read through psutil.
WITHOUT_PROC = "from pathlib import Path; from ftbench.cluster import lifeline; lifeline.PROC = Path('/no/proc'); "


def start_watcher(pid: int, prefix: str = "", **env) -> subprocess.Popen:
    environment = {**os.environ, **env}
    return subprocess.Popen([sys.executable, "-c", prefix + WATCHER, str(pid)], env=environment, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.parametrize("prefix", ["", WITHOUT_PROC], ids=["proc", "without-proc"])
def test_the_job_ends_within_a_second_of_the_process_it_watches(prefix):
    """Without /proc (macOS) every watched process looked gone, and every local job ended as it started."""
    parent = subprocess.Popen(["sleep", "60"])
    watcher = start_watcher(parent.pid, prefix)
    try:
        time.sleep(1.5)
        assert watcher.poll() is None  # alive while its parent is
        parent.kill()
        parent.wait()
        started = time.monotonic()
        watcher.wait(timeout=10)
        assert time.monotonic() - started < 2
        assert watcher.returncode == 1
        assert f"snakemake (pid {parent.pid}) is gone" in watcher.stderr.read()
    finally:
        parent.kill()
        watcher.kill()


@pytest.mark.parametrize("proc", [lifeline.PROC, Path("/no/proc")], ids=["proc", "without-proc"])
def test_a_zombie_counts_as_gone_and_a_reused_pid_is_another_process(proc, monkeypatch):
    """Snakemake killed with SIGKILL stays a zombie until its own parent reaps it."""
    monkeypatch.setattr(lifeline, "PROC", proc)
    parent = subprocess.Popen(["sleep", "60"])
    assert lifeline.alive(parent.pid) and lifeline.started(parent.pid) == lifeline.started(parent.pid) is not None
    assert lifeline.started(parent.pid) != lifeline.started(os.getpid())  # this one started earlier
    parent.kill()
    time.sleep(0.3)  # not reaped: a zombie
    assert not lifeline.alive(parent.pid)
    parent.wait()
    assert lifeline.started(parent.pid) is None


def test_under_slurm_nothing_is_watched():
    parent = subprocess.Popen(["sleep", "60"])
    watcher = start_watcher(parent.pid, SLURM_JOB_ID="123")
    try:
        parent.kill()
        parent.wait()
        time.sleep(2)
        assert watcher.poll() is None  # the scheduler's job: it decides
    finally:
        watcher.kill()
        watcher.wait()
