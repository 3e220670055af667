"""A train job's progress line in its log, at a steady cadence: a working job and a stuck one look different.

    progress: step 120 of 1000 (12%), 3,450 tokens/s, 4m10s elapsed, about 30m30s left, loss 0.693

Every EVERY_S seconds of training (and once after the first step): the step done of the run's steps, the real
tokens per second so far (all ranks), the time since training began and the time left at that pace (or when the
job's time limit stops it, if sooner), and the latest loss. Locally the workflow's Snakemake relays these lines to
the terminal once a minute (cluster/progress_relay.py); on a cluster, `tail -f logs/train/<run_id>.log`.

Nothing here waits for the device. Between lines a step costs one clock read. The loss is the newest one already
on the host: in the measured window a step's loss is copied to pinned memory as soon as it is queued
(measure/step_clock.LaggedLosses) and read here only once that copy has finished (its event queried, not waited
for); a line whose recent copies are all still in flight says "loss pending". scripts/benchmark_progress.py
measures what the lines cost.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from ftbench.cluster.progress_relay import PREFIX
from ftbench.measure.step_clock import LaggedLosses

EVERY_S = 30.0
# Steps back from the newest a line looks for a loss already on the host.
LOSS_LOOKBACK = 4


def duration(seconds: float) -> str:
    """4m10s, 2h05m, 12s."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def ready_loss(losses: LaggedLosses, step: int) -> float | None:
    """The newest loss of steps ``step`` and the few before it whose copy to the host has finished, without
    waiting for the device; None when every one is still in flight."""
    for candidate in range(step, max(-1, step - LOSS_LOOKBACK), -1):
        event = losses.copied.get(candidate)
        if event is None or event.query():  # read already (or a CPU run: the value itself), or the copy is done
            return float(losses.host[candidate])
    return None


class Progress:
    """The progress lines of one training loop (``enabled``: on the rank that speaks for the job)."""

    def __init__(self, total_steps: int, ranks: int = 1, deadline: float | None = None, enabled: bool = True,
                 every_s: float | None = None, out: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total_steps, self.ranks, self.deadline, self.enabled = total_steps, ranks, deadline, enabled
        self.every_s = EVERY_S if every_s is None else every_s
        self.out, self.clock = out, clock
        self.started = clock()
        self.next_at = self.started  # the first line after the first step: the job is training
        self.tokens = 0

    def step_done(self, step: int, tokens: int, losses: LaggedLosses | None = None, loss: float | None = None) -> None:
        """After optimizer step ``step`` (from 0) with this process's ``tokens``: a line when one is due, with the
        newest loss of ``losses`` already on the host, or ``loss`` (an engine that has read it anyway)."""
        self.tokens += tokens
        if not self.enabled:
            return
        now = self.clock()
        if now < self.next_at:
            return
        self.next_at = now + self.every_s
        loss = ready_loss(losses, step) if losses is not None else loss
        print(PREFIX + self.line(step + 1, now, loss), file=self.out or sys.stdout, flush=True)

    def line(self, done: int, now: float, loss: float | None) -> str:
        elapsed = now - self.started
        rate = self.tokens * self.ranks / elapsed if elapsed > 0 else 0.0
        left = elapsed / done * (self.total_steps - done) if done else 0.0
        ending = f"about {duration(left)} left"
        if self.deadline is not None and now + left > self.deadline:
            ending += f" at this pace; its time limit stops it in {duration(self.deadline - now)}"
        shown = "pending" if loss is None else f"{loss:.4g}"
        return (f"step {done} of {self.total_steps} ({100 * done / self.total_steps:.0f}%), {rate:,.0f} tokens/s, "
                f"{duration(elapsed)} elapsed, {ending}, loss {shown}")
