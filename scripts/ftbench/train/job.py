"""One training job (rule train): the one way in from the command line to the training loop.

``run_job`` is what ``python -m ftbench train`` calls, for the job Snakemake starts and for each rank that
job's torchrun starts. The job: GPUs assigned, the run trained (this process, or ddp.launch's torchrun for
ddp and fsdp), its result written: steps.parquet, evals.parquet, then metrics.json, each atomically. A rank (``rank_dir``):
ddp.run_rank trains this process's part and writes it for the launcher to merge.

    cli.train -> job.run_job -> trainer.train_run (this process)          -> trainer.train_steps | hf_engine.train_steps
                             -> ddp.launch -> torchrun -> cli.train -> job.run_job -> ddp.run_rank -> trainer.train_run
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from ftbench import atomic
from ftbench.cluster import lifeline
from ftbench.cluster.gpu_slots import GpuSlots, assign_gpus
from ftbench.errors import FtbenchError, ManifestError, TerminatedError
from ftbench.experiment import feasibility
from ftbench.measure import environment
from ftbench.measure.metrics import EVAL_FIELDS, STEP_FIELDS, failed_metrics, with_counts
from ftbench.runspec import RunSpec
from ftbench.train import ddp, trainer
from ftbench.train.run_state import StopSignal


def run_job(spec: RunSpec, data_dir: str, out: Path | None = None, rank_dir: Path | None = None,
            threads: int | None = None, time_limit_s: float | None = None, watch_pid: int | None = None) -> dict | None:
    """Train one run as a job (``out``: its metrics.json) or as one rank of it (``rank_dir``); the job's
    metrics, None for a rank."""
    lifeline.watch(watch_pid)
    stop = stop_signal(time_limit_s)
    if rank_dir is not None:
        ddp.run_rank(spec, data_dir, rank_dir, threads, stop)
        return None
    return train(spec, data_dir, out, threads, time_limit_s, stop)


def stop_signal(time_limit_s: float | None) -> StopSignal:
    """The job's StopSignal: its deadline from the time limit, and SIGTERM as a termination request."""
    stop = StopSignal()
    if time_limit_s:
        # Keep 10% (at least 60 s, at most half) for evaluation and writing, so a run near its
        # walltime still records what it measured instead of being killed with nothing.
        margin = min(max(60.0, 0.1 * time_limit_s), 0.5 * time_limit_s)
        stop.limit = time.monotonic() + time_limit_s
        stop.deadline = stop.limit - margin
        stop.margin = margin
    signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "terminate_requested", True))
    # `kill -USR1 <pid>` prints every thread's stack into the job log: where a stuck run is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


def train(spec: RunSpec, data_dir: str, out: Path, threads: int | None, time_limit_s: float | None,
          stop: StopSignal) -> dict:
    """Train and measure one run; write ``out`` (metrics.json) and steps.parquet beside it; return the
    metrics. A run terminated from outside writes nothing and raises TerminatedError; damaged data
    (ManifestError) fails the job, to be trained again once repaired (python -m ftbench repair-data).

    Any other error is the run's result, not the invocation's end: a ``failed`` row with the error's
    one-line reason (the traceback goes to the job log), so one broken configuration never hides the
    results of the others."""
    try:
        metrics, steps = _measure(spec, data_dir, out, threads, time_limit_s, stop)
    except (TerminatedError, ManifestError):
        raise
    except Exception as exc:  # noqa: BLE001 - any other error becomes the run's failed row
        if stop.terminate_requested:
            raise  # an error on the way out of a terminated run (a DDP rank ended): no result either
        if isinstance(exc, FtbenchError):
            print(f"ftbench: {exc}", file=sys.stderr, flush=True)  # a known error: its message says it all
        else:
            traceback.print_exc()
        metrics, steps = failed_metrics(spec.run_id, exc), []
    atomic.write_parquet(out.with_name("steps.parquet"), pd.DataFrame(steps, columns=STEP_FIELDS))
    # Every evaluation (during training with eval_every, and the final one), counted from the step records.
    evals = with_counts(metrics.pop("evals", None) or [], steps)
    atomic.write_parquet(out.with_name("evals.parquet"), pd.DataFrame(evals, columns=EVAL_FIELDS))
    # metrics.json is written last: its presence means the run's results are complete.
    atomic.write_json(out, {"spec": spec.to_dict(), "metrics": metrics, "environment": environment.capture()})
    return metrics


def terminated_where(metrics: dict) -> str:
    """How far a terminated run got, in the loop's own words and numbering ("terminated by the scheduler
    (SIGTERM) at step 3 of 20": three steps done), so the job's line and the run's reason agree."""
    reason = metrics.get("status_reason") or ""
    if "SIGTERM" in reason:
        return reason
    step = metrics.get("last_step")
    if step is None:
        return "terminated (SIGTERM) before its first training step"
    return f"terminated (SIGTERM) after its training steps ({step + 1} done), before its results were written"


def _measure(spec: RunSpec, data_dir: str, out: Path, threads: int | None, time_limit_s: float | None,
             stop: StopSignal) -> tuple[dict, list[dict]]:
    reason = feasibility.unsupported_reason(spec)
    if reason:  # known from the settings alone: no GPU held, no model built
        return {"run_id": spec.run_id, "status": "unsupported", "status_reason": reason}, []
    slots = GpuSlots()
    assigned = assign_gpus(spec.num_gpus if spec.device != "cpu" else 0, slots)
    if assigned is not None:
        print(f"using GPUs {assigned}")
    if threads:
        torch.set_num_threads(threads)
    if spec.distributed:  # ddp and fsdp: torchrun, one process per device
        metrics, steps = ddp.launch(spec, data_dir, out.parent / "ranks", threads, time_limit_s, stop)
    else:
        metrics, steps = trainer.train_run(spec, data_dir, stop)
    slots.release()
    if stop.terminate_requested:
        # Terminated from outside (scancel, preemption): SLURM and Snakemake count the job as failed, and
        # Snakemake may already have cleaned up its outputs, so a metrics.json written now would be taken
        # for a finished run and never trained again. Leave no output; keep what was measured in the log,
        # as "terminated" (never a row's status: the run has no result).
        measured = {**metrics, "status": "terminated"}
        print(f"{spec.run_id} measured before it was terminated: {json.dumps(measured, default=str)}", flush=True)
        raise TerminatedError(f"run {spec.run_id} was {terminated_where(metrics)}: no result written; Snakemake "
                              "submits it again if it has retries left (profiles/slurm: retries), else the next "
                              "invocation trains it again")
    return metrics, steps
