"""After training: evaluation that fits in the job's time, and memory peaks of training and evaluation
kept apart.

- A run stopped by the job's time limit (status timeout) is evaluated too: its row carries the accuracy
  of the model it trained, with the steps it did. The job keeps a margin for this (job.stop_signal);
  evaluation scores batches while another one fits in what is left of it, keeping WRITE_RESERVE for
  writing the results, and ``eval_samples`` says how many examples were scored.
- Evaluation has a memory peak of its own (its batch size, no optimizer), so it must not raise the
  training figure: peak_rss_mb / the CUDA peaks are read when training ends, then the peaks are reset
  and evaluation's is stored apart (eval_peak_memory_mb).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ftbench.train.devices import synchronize

# Statuses whose model is evaluated: trained to its end, or to the job's time limit.
EVALUATED = ("ok", "timeout")
# Share of the job's evaluation margin kept for writing the results after the last eval batch.
WRITE_RESERVE = 0.25


def peak_rss_mb() -> float | None:
    """The process's resident-memory high-water mark since start or the last reset_peak_rss (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Start a new resident-memory high-water mark (Linux >= 4.0: /proc/self/clear_refs, value 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class EvalBudget:
    """Whether another eval batch fits before ``limit`` (time.monotonic() at which the job ends), keeping
    ``reserve`` seconds for writing; each batch is expected to take as long as the slowest so far."""

    def __init__(self, limit: float | None, reserve: float, clock=time.monotonic):
        self.limit, self.reserve, self.clock = limit, reserve, clock
        self.slowest = 0.0
        self.last = None

    def another_batch_fits(self) -> bool:
        now = self.clock()
        if self.last is not None:
            self.slowest = max(self.slowest, now - self.last)
        self.last = now
        return self.limit is None or now + self.slowest + self.reserve < self.limit


def evaluate_run(run, evaluate, metrics: dict, may_stop_early: bool = True) -> None:
    """Evaluate ``run`` (a trainer.Run) with ``evaluate`` within the job's time, into ``metrics``: its
    figures, its time and its own memory peak; a note in status_reason when the time limit cut it short.
    Call after the training figures (and their peaks) were taken. ``may_stop_early`` False: score every
    batch (a sharded model evaluates on every rank, and ranks that stopped at different batches would
    wait for each other in the next all-gather)."""
    local_gpus = [run.device.index] if run.device.type == "cuda" else []
    for index in local_gpus:
        synchronize(run.device)
        torch.cuda.reset_peak_memory_stats(index)
    rss_reset = reset_peak_rss()
    stop = run.stop
    budget = EvalBudget(stop.limit, WRITE_RESERVE * stop.margin if stop.limit else 0.0)
    started = time.perf_counter()
    figures = evaluate(run.model, run.eval_split, run.spec, run.task, run.device, run.pad_id,
                       another_batch_fits=budget.another_batch_fits if may_stop_early else lambda: True)
    figures["eval_time_s"] = time.perf_counter() - started
    if local_gpus:
        figures["eval_peak_memory_mb"] = max(torch.cuda.max_memory_allocated(i) for i in local_gpus) / 2**20
    elif rss_reset:
        figures["eval_peak_memory_mb"] = peak_rss_mb()
    planned = figures.pop("eval_samples_planned")
    if figures["eval_samples"] < planned:
        note = f"evaluated on {figures['eval_samples']} of {planned} eval samples (the job's time limit)"
        metrics["status_reason"] = f"{metrics['status_reason']}; {note}" if metrics.get("status_reason") else note
    metrics.update(figures)
