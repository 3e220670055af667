"""One training job (rule train): the one way in from the command line to the training loop.

``run_job`` is what ``python -m ftbench train`` calls, for the job Snakemake starts and for each rank that
job's torchrun starts. The job: GPUs assigned, the run trained (this process, or ddp.launch's torchrun for
ddp and fsdp), its result written: steps.parquet, evals.parquet, then metrics.json, each atomically, first into
``kept/`` beside them (cluster/kept_rows.py: a row the scheduler's end cannot take away). Its time limit counts
from when the scheduler started the job (cluster/job_clock.py). A rank (``rank_dir``): ddp.run_rank trains this
process's part and writes it for the launcher to merge.

    cli.train -> job.run_job -> trainer.train_run (this process)          -> trainer.train_steps | hf_engine.train_steps
                             -> ddp.launch -> torchrun -> cli.train -> job.run_job -> ddp.run_rank -> trainer.train_run
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from ftbench import atomic
from ftbench.cluster import job_clock, kept_rows, lifeline
from ftbench.cluster.gpu_slots import GpuSlots, assign_gpus
from ftbench.errors import FtbenchError, ManifestError, TerminatedError
from ftbench.data import prepared
from ftbench.experiment import feasibility
from ftbench.measure import environment
from ftbench.measure.metrics import EVAL_FIELDS, STEP_FIELDS, failed_metrics, with_counts
from ftbench.runspec import RunSpec
from ftbench.train import ddp, trainer
from ftbench.train.run_state import StopSignal


def run_job(spec: RunSpec, data_dir: str, out: Path | None = None, rank_dir: Path | None = None,
            threads: int | None = None, time_limit_s: float | None = None, watch_pid: int | None = None) -> dict | None:
    """Train one run as a job (``out``: its metrics.json) or as one rank of it (``rank_dir``); the job's
    metrics, None for a rank. A job whose outputs a scheduler's end deleted after it wrote them keeps that row
    (cluster/kept_rows.py) instead of training again."""
    lifeline.watch(watch_pid)
    stop = stop_signal(time_limit_s)
    with _started_at_for_ranks(stop):
        if rank_dir is not None:
            ddp.run_rank(spec, data_dir, rank_dir, threads, stop)
            return None
        adopted = adopt_kept_row(spec, out, data_dir)
        if adopted is not None:
            return adopted
        return train(spec, data_dir, out, threads, time_limit_s, stop)


def stop_signal(time_limit_s: float | None, environ=os.environ) -> StopSignal:
    """The job's StopSignal: its deadline from the time limit counted from when the scheduler started the job
    (job_clock.job_times; where no scheduler started it, from now), and SIGTERM as a termination request."""
    stop = StopSignal()
    if time_limit_s:
        found = job_clock.scheduler_start(environ)
        scheduled = job_clock.scheduled(environ)
        times = job_clock.job_times(time_limit_s, found[0] if found else time.time(), scheduled)
        stop.times, stop.walltime_s, stop.margin = times, time_limit_s, times.margin
        stop.limit, stop.deadline = times.monotonic(times.ends_at), times.monotonic(times.deadline)
        if scheduled and found and found[1] != job_clock.STARTED_AT_ENV:
            print(f"time limit {job_clock.minutes_words(time_limit_s)}, counted from the scheduler's start "
                  f"({found[1]}, {time.time() - found[0]:.0f} s ago): training stops {times.deadline - time.time():.0f} s "
                  f"from now, its row is written by {times.ends_at - time.time():.0f} s from now", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: stop.terminate())
    # `kill -USR1 <pid>` prints every thread's stack into the job log: where a stuck run is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


@contextlib.contextmanager
def _started_at_for_ranks(stop: StopSignal):
    """The job's start in the environment its DDP ranks inherit (torchrun, srun): every rank counts the same
    limit from the same start. Put back afterwards (a process may run several jobs: tests)."""
    if stop.times is None:
        yield
        return
    before = os.environ.get(job_clock.STARTED_AT_ENV)
    os.environ[job_clock.STARTED_AT_ENV] = repr(stop.times.started_at)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(job_clock.STARTED_AT_ENV, None)
        else:
            os.environ[job_clock.STARTED_AT_ENV] = before


def adopt_kept_row(spec: RunSpec, out: Path, data_dir: str) -> dict | None:
    """The kept row of this run, published as its outputs (cluster/kept_rows.py), or None: train it (a kept row
    older than its data's manifest was trained on data prepared again since)."""
    result = kept_rows.adopt(out, spec.to_dict(), inputs=[Path(data_dir) / prepared.MANIFEST_NAME])
    if result is None:
        return None
    metrics = result.get("metrics") or {}
    ending = kept_rows.kept_ending(out)
    if ending:  # the earlier attempt's log was written anew by this one: its last word stays in the log
        print(f"ftbench: an earlier job of this run ended: {ending}", flush=True)
    print(f"ftbench: run {spec.run_id}: kept the row (status {metrics.get('status')}) that an earlier job wrote before "
          f"the scheduler ended it ({kept_rows.kept_dir(out)}); not trained again (delete {out.parent}/ to train it "
          "again)", flush=True)
    return metrics


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
    # Into kept/ first, then the outputs: a job ended by its scheduler between the two still has its row.
    write_row(kept_rows.kept_dir(out), spec, metrics, steps)
    kept_rows.publish(out)
    return metrics


def write_row(folder: Path, spec: RunSpec, metrics: dict, steps: list[dict]) -> None:
    """A run's row into ``folder``: steps.parquet, evals.parquet, then metrics.json, each atomically."""
    atomic.write_parquet(folder / "steps.parquet", pd.DataFrame(steps, columns=STEP_FIELDS))
    # Every evaluation (during training with eval_every, and the final one), counted from the step records.
    evals = with_counts(metrics.pop("evals", None) or [], steps)
    atomic.write_parquet(folder / "evals.parquet", pd.DataFrame(evals, columns=EVAL_FIELDS))
    # metrics.json is written last: its presence means the run's results are complete.
    atomic.write_json(folder / "metrics.json", {"spec": spec.to_dict(), "metrics": metrics, "environment": environment.capture()})


def terminated_where(metrics: dict) -> str:
    """How far a terminated run got, in the loop's own words and numbering ("terminated (SIGTERM) at step 3 of 20":
    three steps done), so the job's line and the run's reason agree."""
    reason = metrics.get("status_reason") or ""
    if "SIGTERM" in reason:
        return reason
    step = metrics.get("last_step")
    if step is None:
        return "terminated (SIGTERM) before its first training step"
    return f"terminated (SIGTERM) after its training steps ({step + 1} done), before its results were written"


def ended_at_time_limit(spec: RunSpec, out: Path, metrics: dict, steps: list[dict], limit_s: float) -> str:
    """A run the scheduler's time limit (``limit_s``) ended before it stopped itself: its steps kept as a `timeout`
    row (not evaluated: no time is left) where Snakemake does not delete it, for the next job of the run to keep;
    the job's line, naming the walltime to ask for."""
    limit = job_clock.minutes_words(limit_s)
    minutes = job_clock.more_time_minutes(limit_s / 60, len(steps), metrics.get("total_steps"), metrics.get("train_time_s"),
                                          metrics.get("wall_time_s"))
    more = f"give it more time: --set-resources train:runtime={minutes}"
    head = f"run {spec.run_id} {job_clock.TIME_LIMIT_WORDS} ({limit})"
    if not steps:
        return f"{head} before its first training step: no row; {more} (after the targets)"
    row = {**metrics, "status": "timeout",
           "status_reason": f"the scheduler's time limit ({limit}) ended its job after {len(steps)} of "
                            f"{metrics.get('total_steps', '?')} steps, before it stopped itself; not evaluated"}
    line = (f"{head} before it stopped itself: {more}; its timeout row ({len(steps)} steps, not evaluated) is kept in "
            f"{kept_rows.kept_dir(out)} and a rerun keeps it instead of training (delete {out.parent}/ to train the "
            "run again)")
    kept_rows.keep_ending(out, line)  # before the row: a kept row always has its line
    write_row(kept_rows.kept_dir(out), spec, row, steps)
    return line


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
        # Terminated from outside (scancel, preemption, the scheduler's limit): SLURM and Snakemake count the job as
        # failed, and Snakemake may already have cleaned up its outputs, so a metrics.json written now would be taken
        # for a finished run and never trained again. Write no output; keep what was measured in the log, as
        # "terminated" (never a row's status: the run has no result), and a time limit's steps in kept/.
        measured = {**metrics, "status": "terminated"}
        print(f"{spec.run_id} measured before it was terminated: {json.dumps(measured, default=str)}", flush=True)
        cause, scheduler_limit_s = job_clock.termination_cause(stop.times, stop.terminated_at)
        if cause == "time limit":
            raise TerminatedError(ended_at_time_limit(spec, out, metrics, steps, scheduler_limit_s or stop.walltime_s or 0))
        raise TerminatedError(f"run {spec.run_id} was {terminated_where(metrics)} ({job_clock.CANCELLED_WORDS}: nothing "
                              "to fix): no result written; Snakemake submits it again if it has retries left "
                              "(profiles/slurm: retries), else the next invocation trains it again")
    return metrics, steps
