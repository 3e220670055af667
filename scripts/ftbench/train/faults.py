"""TEST-ONLY fault injection: make a training run fail on purpose, on any machine.

An out-of-memory error, a NaN loss or a crash cannot be produced on demand on a CPU in CI, yet the
pipeline's handling of them (status rows, DDP ranks that must not hang, jobs that fail loudly) has to
be tested. The environment variable ``FTBENCH_INJECT_FAULT`` makes the trainer fake them. It is read
once at the start of each run (``trainer.train_run``); unset, nothing here runs. Never set it for a
real benchmark: every run it touches records the injected failure as if it had happened, and the job
log says so (a line starting ``ftbench: FTBENCH_INJECT_FAULT``).

Grammar: faults separated by ``,``; each ``KIND@STEP[=VALUE]`` or ``oom_above_batch=N``, optionally
followed by qualifiers ``:rankR`` (only DDP rank R) and ``:run=TEXT`` (only runs whose id contains TEXT).
Steps count optimizer steps from 0, as ``last_step`` does.

    oom@3                torch.OutOfMemoryError at the start of step 3 (status oom)
    nan@2                the loss of step 2 becomes NaN (status diverged; that step does not update the weights)
    error@1              RuntimeError at step 1: an unknown exception (the job fails with its traceback)
    sleep@2=30           sleep 30 s at the start of step 2 (a job to kill, or a slow job)
    kill@1               the process kills itself with SIGKILL at step 1, as the kernel's OOM killer does
                         (nothing can be written: the job fails with no row)
    oom@3:rank1          only on DDP rank 1
    nan@2:run=lora-r4    only in runs whose run_id contains "lora-r4"
    oom_above_batch=8    every forward pass with more than 8 samples per device runs out of memory
                         (what a GPU with room for batch 8 does; used to test auto_batch_size)
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass

import torch

ENV = "FTBENCH_INJECT_FAULT"
STEP_KINDS = ("oom", "nan", "error", "sleep", "kill")

_STEP_FAULT = re.compile(r"(?P<kind>[a-z]+)@(?P<step>\d+)(?:=(?P<value>[0-9.]+))?")
_BATCH_FAULT = re.compile(r"oom_above_batch=(?P<value>\d+)")


@dataclass(frozen=True)
class Fault:
    kind: str  # oom | nan | error | sleep | kill | oom_above_batch
    step: int | None = None
    value: float | None = None  # seconds for sleep; the largest batch that fits for oom_above_batch
    rank: int | None = None
    run: str | None = None


def parse(text: str) -> list[Fault]:
    """The faults of an ``FTBENCH_INJECT_FAULT`` value; ValueError (one line) on anything else."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        head, *qualifiers = entry.split(":")
        rank = run = None
        for qualifier in qualifiers:
            if re.fullmatch(r"rank\d+", qualifier):
                rank = int(qualifier[4:])
            elif qualifier.startswith("run=") and len(qualifier) > 4:
                run = qualifier[4:]
            else:
                raise ValueError(f"{ENV}: unknown qualifier {qualifier!r} in {entry!r}; expected rankR or run=TEXT")
        if match := _BATCH_FAULT.fullmatch(head):
            faults.append(Fault("oom_above_batch", value=int(match["value"]), rank=rank, run=run))
            continue
        match = _STEP_FAULT.fullmatch(head)
        if not match or match["kind"] not in STEP_KINDS:
            raise ValueError(
                f"{ENV}: cannot read {entry!r}; expected KIND@STEP (KIND one of {', '.join(STEP_KINDS)}), "
                "sleep@STEP=SECONDS or oom_above_batch=N, optionally :rankR and :run=TEXT"
            )
        if match["kind"] == "sleep" and match["value"] is None:
            raise ValueError(f"{ENV}: {entry!r} needs its seconds, e.g. sleep@2=30")
        value = float(match["value"]) if match["value"] is not None else None
        faults.append(Fault(match["kind"], step=int(match["step"]), value=value, rank=rank, run=run))
    return faults


class Injector:
    """The faults that apply to one run on one rank. Falsy (and free) when there are none."""

    def __init__(self, faults: list[Fault], run_id: str = "", rank: int = 0):
        self.faults = [f for f in faults if (f.rank is None or f.rank == rank) and (f.run is None or f.run in run_id)]
        self.rank = rank
        self._fired: set[Fault] = set()

    @classmethod
    def from_env(cls, run_id: str, rank: int = 0) -> "Injector":
        return cls(parse(os.environ.get(ENV, "")), run_id, rank)

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _announce(self, what: str) -> None:
        # The kill tests read the pid from this line of the job log.
        print(f"ftbench: {ENV} (test-only): {what} (pid {os.getpid()}, rank {self.rank})", file=sys.stderr, flush=True)

    def _due(self, kind: str, step: int) -> Fault | None:
        for fault in self.faults:
            if fault.kind == kind and fault.step == step and fault not in self._fired:
                self._fired.add(fault)
                return fault
        return None

    def before_step(self, step: int) -> None:
        """Called at the start of each optimizer step's first forward pass."""
        if not self.faults:
            return
        if fault := self._due("sleep", step):
            self._announce(f"sleeping {fault.value:g} s at step {step}")
            time.sleep(fault.value)
        if self._due("oom", step):
            self._announce(f"out of memory at step {step}")
            raise torch.OutOfMemoryError(f"CUDA out of memory at step {step} (injected by {ENV}, test-only)")
        if self._due("error", step):
            self._announce(f"RuntimeError at step {step}")
            raise RuntimeError(f"injected failure at step {step} ({ENV}, test-only): an unknown exception")
        if self._due("kill", step):
            self._announce(f"SIGKILL at step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def check_batch(self, per_device_batch: int) -> None:
        """Called before every forward pass (auto_batch_size trials included) with its samples per device."""
        for fault in self.faults:
            if fault.kind == "oom_above_batch" and per_device_batch > fault.value:
                self._announce(f"out of memory at batch {per_device_batch} (> {fault.value:g})")
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory at batch {per_device_batch} per device (injected by {ENV}: "
                    f"oom_above_batch={fault.value:g}, test-only)"
                )

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """The loss of a micro-batch, made NaN at the step of a ``nan`` fault."""
        if self.faults and self._due("nan", step):
            self._announce(f"NaN loss at step {step}")
            return loss * float("nan")
        return loss
