"""Train jobs' progress on the terminal of a local invocation, one line per running job per minute.

Each train job logs a progress line at a steady cadence (train/progress.py) into its log, logs/train/<run_id>.log:
on a cluster that log is where to follow a job (`tail -f logs/train/<run_id>.log`). Locally the terminal is
Snakemake's, which prints nothing while a job runs; a thread in the invocation's Snakemake (``start``, from the
workflow's start hook) reads the logs written since the invocation began and, once a minute, prints the latest
progress line of each job whose log moved since it last looked: running jobs speak, finished ones fall silent,
and a job stuck for minutes shows as the same step on its line (or no line).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Callable, TextIO

# How a progress line starts in a job's log (train/progress.py writes it, this module finds it).
PREFIX = "progress: "
EVERY_S = 60.0
TAIL_BYTES = 8192  # the end of a log read for its latest progress line

_stopped = threading.Event()


def latest_progress(log: Path) -> str | None:
    """The last progress line of ``log``, without its prefix, or None."""
    try:
        with open(log, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            handle.seek(max(0, size - TAIL_BYTES))
            tail = handle.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [line for line in tail.splitlines() if line.startswith(PREFIX)]
    return lines[-1][len(PREFIX):].strip() if lines else None


class Relay:
    """The progress lines to print for the logs under ``logs`` written since ``since`` (time.time())."""

    def __init__(self, logs: Path, since: float, out: TextIO | None = None, clock: Callable[[], float] = time.time):
        self.logs, self.since, self.clock = Path(logs), since, clock
        self.out = out
        self.told: dict[Path, str] = {}  # the line last printed for each log

    def tell(self) -> list[str]:
        """Print (and return) the latest progress line of each job whose log has one not printed yet."""
        lines = []
        for log in sorted(self.logs.glob("*.log")) if self.logs.is_dir() else []:
            try:
                if log.stat().st_mtime < self.since:
                    continue  # an earlier invocation's
            except OSError:
                continue
            line = latest_progress(log)
            if line and self.told.get(log) != line:
                self.told[log] = line
                lines.append(f"ftbench: {log.stem}: {line}")
        if lines:
            print("\n".join(lines), file=self.out or sys.stderr, flush=True)
        return lines


def start(logs: Path = Path("logs/train"), every_s: float = EVERY_S) -> threading.Thread:
    """Relay the progress of this invocation's train jobs every ``every_s`` seconds, in a daemon thread (it ends
    with the process)."""
    relay = Relay(logs, since=time.time())

    _stopped.clear()

    def loop() -> None:
        while not _stopped.wait(every_s):
            relay.tell()

    thread = threading.Thread(target=loop, name="ftbench-progress", daemon=True)
    thread.start()
    return thread


def stop() -> None:
    """No more lines: the invocation is ending (its closing summary is the last thing on the terminal)."""
    _stopped.set()
