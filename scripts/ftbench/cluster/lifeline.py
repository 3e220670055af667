"""A local training job ends when the Snakemake that started it dies (issue 18).

Snakemake killed with SIGKILL (kill -9, a closed session, the OOM killer) cannot stop its jobs: they
would keep the CPU or GPU for their whole run and write a result that the next invocation throws away
(it reruns incomplete jobs). The train rule passes the pid of Snakemake (``--watch-pid $PPID``: the rule
runs in a shell whose parent is Snakemake, so the job's own parent, that shell, is not the one to
watch), and a thread here polls it; when it is gone the job ends at once, with its DDP ranks, writing
nothing.

Under SLURM (SLURM_JOB_ID set) nothing is watched: the job belongs to the scheduler, which ends it.
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


def alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def watch(pid: int | None, what: str = "snakemake") -> threading.Thread | None:
    """End this process when ``pid`` (``what`` it is, for the message) ends (not under SLURM, not without
    a pid). Returns the watching thread."""
    if not pid or os.environ.get("SLURM_JOB_ID"):
        return None
    started = environment.process_start_ticks(pid)
    if started is None:
        _end(pid, what)  # already gone before the job started
    thread = threading.Thread(target=_watch, args=(pid, started, what), name="ftbench-lifeline", daemon=True)
    thread.start()
    return thread


def on_parent_death(callback) -> None:
    _on_parent_death.append(callback)


def forget(callback) -> None:
    if callback in _on_parent_death:
        _on_parent_death.remove(callback)


def _watch(pid: int, started: int | None, what: str) -> None:
    event = threading.Event()
    while not event.wait(POLL_S):
        if not alive(pid) or environment.process_start_ticks(pid) != started:
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
