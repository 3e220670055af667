"""A local training job ends when the Snakemake that started it dies (issue 18).

Snakemake killed with SIGKILL (kill -9, a closed session, the OOM killer) cannot stop its jobs: they
would keep the CPU or GPU for their whole run and write a result that the next invocation throws away
(it reruns incomplete jobs). The train rule passes the pid of Snakemake (``--watch-pid $PPID``: the rule
runs in a shell whose parent is Snakemake, so the job's own parent, that shell, is not the one to
watch), and a thread here polls it; when it is gone the job ends at once, with its DDP ranks, writing
nothing.

Under SLURM (SLURM_JOB_ID set) nothing is watched: the job belongs to the scheduler, which ends it.
Processes are read from /proc where there is one (Linux), else through psutil (macOS): without /proc every
watched process once looked gone, and every local job ended as it started.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from ftbench.measure import environment

POLL_S = 0.5

# What to end before the job exits (a DDP launch's torchrun and ranks): registered by whoever starts them.
_on_parent_death: list = []


# Where Linux shows its processes; elsewhere psutil is asked (tests point this at a missing folder).
PROC = Path("/proc")


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    if not PROC.is_dir():
        return _psutil_process(pid) is not None
    try:
        state = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def started(pid: int) -> float | int | None:
    """When the process started, which tells it from a later one given the same pid; None once it is gone."""
    if PROC.is_dir():
        return environment.process_start_ticks(pid)
    process = _psutil_process(pid)
    return None if process is None else process.create_time()


def _psutil_process(pid: int):
    """psutil's view of a running process (None when gone or a zombie), where there is no /proc."""
    import psutil  # only off Linux: a job's lifeline on Linux needs no more than /proc

    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process
    except psutil.Error:
        return None


def watch(pid: int | None, what: str = "snakemake") -> threading.Thread | None:
    """End this process when ``pid`` (``what`` it is, for the message) ends (not under SLURM, not without
    a pid). Returns the watching thread."""
    if not pid or os.environ.get("SLURM_JOB_ID"):
        return None
    start = started(pid)
    if start is None:
        _end(pid, what)  # already gone before the job started
    thread = threading.Thread(target=_watch, args=(pid, start, what), name="ftbench-lifeline", daemon=True)
    thread.start()
    return thread


def on_parent_death(callback) -> None:
    _on_parent_death.append(callback)


def forget(callback) -> None:
    if callback in _on_parent_death:
        _on_parent_death.remove(callback)


def _watch(pid: int, start: float | int, what: str) -> None:
    event = threading.Event()
    while not event.wait(POLL_S):
        if not alive(pid) or started(pid) != start:
            _end(pid, what)


def _end(pid: int, what: str) -> None:
    print(f"ftbench: {what} (pid {pid}) is gone: this training job ends with it, writing no result; "
          "the next invocation trains the run again", file=sys.stderr, flush=True)
    for callback in list(_on_parent_death):
        try:
            callback()
        except Exception as exc:  # noqa: BLE001 - ending the job matters more than a clean shutdown
            print(f"ftbench: while ending the job: {exc}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
