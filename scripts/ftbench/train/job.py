"""One training job (rule train): GPUs assigned, the run trained (one process, or DDP through torchrun),
its result written: steps.parquet, then metrics.json, each atomically."""

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
from ftbench.train import ddp, trainer
from ftbench.measure import environment
from ftbench.errors import FtbenchError, ManifestError, TerminatedError
from ftbench.cluster.gpu_slots import GpuSlots, assign_gpus
from ftbench.measure.metrics import STEP_FIELDS
from ftbench.runspec import RunSpec


def stop_signal(time_limit_s: float | None) -> trainer.StopSignal:
    """The job's StopSignal: its deadline from the time limit, and SIGTERM as a termination request."""
    stop = trainer.StopSignal()
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
          stop: trainer.StopSignal) -> dict:
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
        metrics, steps = failed_metrics(spec, exc), []
    atomic.write_parquet(out.with_name("steps.parquet"), pd.DataFrame(steps, columns=STEP_FIELDS))
    # metrics.json is written last: its presence means the run's results are complete.
    atomic.write_json(out, {"spec": spec.to_dict(), "metrics": metrics, "environment": environment.capture()})
    return metrics


def failed_metrics(spec: RunSpec, exc: BaseException) -> dict:
    """The figures of a run that ended in an error: its status and the error in one line (an unknown
    error's traceback is in the job log)."""
    message = " ".join(str(exc).split())
    if isinstance(exc, FtbenchError):
        reason = message[:400]
    else:
        reason = (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:300] + " (traceback in the job log)"
    return {"run_id": spec.run_id, "status": "failed", "status_reason": reason}


def _measure(spec: RunSpec, data_dir: str, out: Path, threads: int | None, time_limit_s: float | None,
             stop: trainer.StopSignal) -> tuple[dict, list[dict]]:
    slots = GpuSlots()
    assigned = assign_gpus(spec.num_gpus if spec.device != "cpu" else 0, slots)
    if assigned is not None:
        print(f"using GPUs {assigned}")
    if threads:
        torch.set_num_threads(threads)
    if spec.distributed:  # ddp and fsdp: torchrun, one process per device
        metrics, steps = ddp.train(spec, data_dir, out.parent / "ranks", threads, time_limit_s, stop)
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
        step = metrics.get("last_step")
        where = f"after step {step}" if step is not None else "before its first training step"
        raise TerminatedError(f"run {spec.run_id} was terminated (SIGTERM) {where}: "
                              "no result written, the next invocation trains it again")
    return metrics, steps
