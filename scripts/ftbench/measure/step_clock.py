"""Timing the measured window's steps without waiting for the device.

Why: a loop that synchronises with the GPU at the end of every step to read a host clock leaves the GPU idle
while the host launches the next step's first kernels. Where the host is the bottleneck (a small model or batch:
the GPU runs each kernel faster than Python launches the next), the last kernels of a step (the optimizer's
update, pure memory traffic: for a 1.1B model's fp32 AdamW about 30 GB a step, some 10 ms at an H100's 3.35 TB/s,
an estimate) would otherwise overlap the host's launching of the next step; a per-step sync serialises them. A
plain PyTorch loop does not wait, so neither may the loop being measured. (Issue 30 measured ftbench at 0.87-0.90
of an independent loop's tokens/s on that model at batch 2 x 1024 on an H100, when it synchronised every step.)

How: every step boundary is a marker on the device's own timeline (a CUDA event: recording one does not wait),
read only once the window is over; on a CPU (which runs each operation as it is called) the host clock is the
device's timeline. Consecutive markers form a chain; an evaluation between steps (its own synchronisation)
breaks the chain, so its time belongs to no step. The loss of each step is copied to pinned host memory as soon
as the step's backward pass is queued and read a step later, when the copy has long finished (``LaggedLosses``):
where the optimizer skips a non-finite loss's update on the device, the host checks it for NaN one step late,
before that next step's update (trainer.py).

Where the loop must wait anyway, it still does, and gains nothing here: an optimizer that cannot skip a NaN's update
on the device (not fused AdamW, or fp16's GradScaler) has the loss read before each update; DDP and FSDP ranks agree
every step on whether to stop (an all-reduce read on the host).

The window's span (tokens per second) is on the host's clock: from its synchronised start to when the device
finished its last step (``host_time_of``); ``StepClock.step_seconds`` sums to it, less what lies between chains.
"""

from __future__ import annotations

import time

import torch

# Steps whose markers a clock holds before it reads those the device has finished (a CUDA event each, until read).
HARVEST_EVERY = 512


class StepClock:
    """Step boundaries on the device's timeline: ``start`` begins a chain (the window's first step, the first step
    after an evaluation), ``boundary(step)`` ends that step (and starts the next, in the same chain)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = None  # the latest marker: where the next step begins
        self.ends: dict[int, tuple] = {}  # step -> (the marker it began at, the marker it ended at)
        self.seconds: dict[int, float] = {}  # the steps already read (harvested), oldest first

    def _marker(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, host_time: float) -> None:
        """A new chain, from ``host_time`` (time.perf_counter(), taken with the device idle: after a sync). On a CPU
        that time is the marker itself, so the steps' times and the window's span are read off one clock."""
        self.last = self._marker() if self.cuda else host_time

    def boundary(self, step: int) -> None:
        ended = self._marker()
        self.ends[step] = (self.last, ended)
        self.last = ended
        if len(self.ends) > HARVEST_EVERY:
            self._harvest()

    def _harvest(self) -> None:
        """Read the steps the device has already finished, oldest first and without waiting, so that a long run keeps
        a bounded number of CUDA events; the newest two stay (the window's end reads the last kept step's marker)."""
        for step in list(self.ends)[:-2]:
            began, ended = self.ends[step]
            if self.cuda and not ended.query():
                return  # the device has not got this far: nor any further
            self.seconds[step] = self._elapsed(began, ended)
            del self.ends[step]

    def _elapsed(self, began, ended) -> float:
        return began.elapsed_time(ended) / 1000 if self.cuda else ended - began

    def host_time_of(self, step: int | None = None) -> float:
        """When the device finished ``step`` (by default, whatever was last marked), on the host's clock
        (time.perf_counter()): on a CPU the marker itself; on a GPU the host's time once the device has caught up
        (a synchronisation), less the device's seconds since that marker."""
        marker = self.last if step is None else self.ends[step][1]
        if not self.cuda:
            return marker
        now_marker = self._marker()
        now_marker.synchronize()
        now = time.perf_counter()
        return now - marker.elapsed_time(now_marker) / 1000

    def step_seconds(self) -> dict[int, float]:
        """Each step's seconds (waits for the device to reach the last marker)."""
        if self.cuda:
            self.last.synchronize()
        return {**self.seconds, **{step: self._elapsed(began, ended) for step, (began, ended) in self.ends.items()}}


class LaggedLosses:
    """Each step's loss, copied to the host as soon as it is queued, read when asked (a step later: by then the
    copy is done, and reading it waits for nothing else the device has queued). On a CPU, the value itself."""

    def __init__(self, device: torch.device, steps: int):
        self.cuda = device.type == "cuda"
        # One pinned slot per step: allocating pinned memory per step would cost more than the sync it saves.
        self.host = torch.empty(steps, dtype=torch.float32, pin_memory=self.cuda)
        self.copied: dict[int, object] = {}  # step -> the event after its copy, until it is read (CUDA)

    def put(self, step: int, loss: torch.Tensor) -> None:
        if self.cuda:
            self.host[step].copy_(loss.detach().float(), non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.copied[step] = event
        else:
            self.host[step] = loss.detach().float()

    def get(self, step: int) -> float:
        event = self.copied.pop(step, None)  # once read, the slot holds the value: the event is not kept
        if event is not None:
            event.synchronize()  # that copy only: the work queued after it goes on
        return float(self.host[step])
