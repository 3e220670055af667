"""One training job (rule train): GPUs assigned, the run trained (one process, or DDP through torchrun),
its result written: steps.parquet, then metrics.json, each atomically."""

from __future__ import annotations

import faulthandler
import json
import signal
import time
from pathlib import Path

import pandas as pd
import torch

from . import atomic, ddp, environment, trainer
from .errors import TerminatedError
from .gpu_slots import GpuSlots, assign_gpus
from .metrics import STEP_FIELDS
from .runspec import RunSpec


def stop_signal(time_limit_s: float | None) -> trainer.StopSignal:
    """The job's StopSignal: its deadline from the time limit, and SIGTERM as a termination request."""
    stop = trainer.StopSignal()
    if time_limit_s:
        # Keep 10% (at least 60 s, at most half) for evaluation and writing, so a run near its
        # walltime still records what it measured instead of being killed with nothing.
        margin = min(max(60.0, 0.1 * time_limit_s), 0.5 * time_limit_s)
        stop.deadline = time.monotonic() + time_limit_s - margin
    signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "terminate_requested", True))
    # `kill -USR1 <pid>` prints every thread's stack into the job log: where a stuck run is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


def train(spec: RunSpec, data_dir: str, out: Path, threads: int | None, time_limit_s: float | None,
          stop: trainer.StopSignal) -> dict:
    """Train and measure one run; write ``out`` (metrics.json) and steps.parquet beside it; return the
    metrics. A run terminated from outside writes nothing and raises TerminatedError."""
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
    if stop.terminate_requested:
        # Terminated from outside (scancel, preemption): SLURM and Snakemake count the job as failed, and
        # Snakemake may already have cleaned up its outputs, so a metrics.json written now would be taken
        # for a finished run and never trained again. Leave no output; keep what was measured in the log.
        print(f"{spec.run_id} measured before it was terminated: {json.dumps(metrics, default=str)}")
        raise TerminatedError(f"run {spec.run_id} was terminated (SIGTERM) after step {metrics.get('last_step')}: "
                              "no result written, the next invocation trains it again")
    atomic.write_parquet(out.with_name("steps.parquet"), pd.DataFrame(steps, columns=STEP_FIELDS))
    # metrics.json is written last: its presence means the run's results are complete.
    atomic.write_json(out, {"spec": spec.to_dict(), "metrics": metrics, "environment": environment.capture()})
    slots.release()
    return metrics
