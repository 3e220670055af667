"""A run as this process trains it, and what both engines (ftbench's loop in trainer.py, transformers'
Trainer in hf_engine.py) share: the stop signal, the seeded batch order, and what a run's steps report."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import torch

from ftbench.cluster import job_clock
from ftbench.cluster.job_clock import JobTimes
from ftbench.data import batch_order, prepared
from ftbench.runspec import RunSpec
from ftbench.tasks.base import TokenisedSplit
from ftbench.train import faults, batching
from ftbench.train.devices import Distributed


@dataclass
class StopSignal:
    """When the loop must stop early: a wall-clock deadline (the job's time limit, counted from the scheduler's
    start, less a margin for evaluation and writing results: cluster/job_clock.py) or a termination request
    (SIGTERM: scancel, preemption, or the scheduler's own limit)."""

    deadline: float | None = None  # time.monotonic() value
    terminate_requested: bool = False
    # When evaluation and writing must be done (time.monotonic()), and the seconds kept between the deadline and
    # then: evaluation and writing results happen there (evaluation.py).
    limit: float | None = None
    margin: float = 0.0
    walltime_s: float | None = None  # the job's time limit, as given (--time-limit-s)
    times: JobTimes | None = None  # the job's times on the wall clock (job_clock.job_times)
    terminated_at: float | None = None  # time.time() of the SIGTERM

    def reason(self, typical_step_s: float) -> str | None:
        if self.terminate_requested:
            return "terminated (SIGTERM)"
        # Stop if another step might not finish before the deadline.
        if self.deadline is not None and time.monotonic() + 2 * typical_step_s >= self.deadline:
            limit = f" ({job_clock.minutes_words(self.walltime_s)})" if self.walltime_s else ""
            return f"stopped before the job's time limit{limit}"
        return None

    def terminate(self) -> None:
        """A SIGTERM: stop at the next step (the job says why: job_clock.termination_cause)."""
        self.terminated_at = time.time()
        self.terminate_requested = True


@dataclass
class Run:
    """One run as this process trains it: its settings, where, on what data and model, and what may
    stop it early."""

    spec: RunSpec  # with auto_batch_size, its batch_size becomes the batch found
    device: torch.device
    dist: Distributed
    stop: StopSignal
    injector: faults.Injector
    task: str
    pad_id: int
    train_split: TokenisedSplit | prepared.DiskSplit
    eval_split: TokenisedSplit
    model: torch.nn.Module  # as built, before DataParallel / DDP / torch.compile wrap it
    last_step: int | None = None  # kept current so an OOM or a stop says how far the run got


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def training_order(spec: RunSpec, split: TokenisedSplit, total_steps: int):
    """The global batches of the run's micro-steps, as its ``batching`` draws them (both engines use it, and
    scripts/benchmark_overhead.py's bare loop)."""
    lengths = batching.lengths_of(split) if spec.batching == "group_by_length" else None
    return batch_order.run_order(spec, len(split), total_steps, lengths)


def steps_and_peaks(steps: list[dict], figures: dict, spec: RunSpec, local_gpus: list[int]) -> dict:
    """What either engine reports from its step records and its GPUs once training ends: final loss, the
    first step, the compilation estimate, packing efficiency and the CUDA peaks."""
    result = {"packing_efficiency": batching.packing_efficiency(steps)}
    if steps:
        result["final_train_loss"] = steps[-1]["loss"]
        result["first_step_s"] = steps[0]["step_time_s"]
        if spec.compile and figures.get("step_time_median_s"):
            # Compilation happens inside the first step; its excess over a normal step estimates it.
            result["compile_time_s"] = max(0.0, steps[0]["step_time_s"] - figures["step_time_median_s"])
    if local_gpus:
        result["peak_memory_allocated_mb"] = max(torch.cuda.max_memory_allocated(i) for i in local_gpus) / 2**20
        result["peak_memory_reserved_mb"] = max(torch.cuda.max_memory_reserved(i) for i in local_gpus) / 2**20
    return result
