"""GPU slots: distinct CUDA_VISIBLE_DEVICES for local jobs running at the same time."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path


def visible_gpu_count() -> int:
    """GPUs on this machine, read through NVML so CUDA is not initialised in this process."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: no GPUs to share  # noqa: BLE001
        return 0


class GpuSlots:
    """Holds exclusive locks on N of the machine's GPUs for the life of the job.

    Snakemake's ``resources: gpu=N`` (with ``--resources gpu=<total>``) bounds how many GPUs concurrent
    jobs use in total; these file locks decide *which* GPUs each job gets. Under SLURM (or when the user
    set CUDA_VISIBLE_DEVICES) the scheduler already chose, and nothing is locked.
    """

    def __init__(self, lock_dir: str | Path | None = None):
        self.lock_dir = Path(lock_dir or Path(tempfile.gettempdir()) / f"ftbench-gpu-locks-{os.getuid()}")
        self.handles = []

    def acquire(self, count: int, total: int, poll_s: float = 2.0, log=print) -> list[int]:
        if count > total:
            return []
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        waited = False
        while True:
            held = []
            for index in range(total):
                handle = open(self.lock_dir / f"gpu{index}.lock", "w")
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    handle.close()
                    continue
                held.append((index, handle))
                if len(held) == count:
                    self.handles = [h for _, h in held]
                    return [i for i, _ in held]
            for _, handle in held:
                handle.close()  # closing releases the lock
            if not waited:
                log(f"waiting for {count} free GPU(s); pass --resources gpu=<total> to snakemake to avoid waiting")
                waited = True
            time.sleep(poll_s)

    def release(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles = []


def assign_gpus(num_gpus: int, slots: GpuSlots) -> str | None:
    """Set CUDA_VISIBLE_DEVICES for this job when running locally; return what was set."""
    if num_gpus == 0 or "CUDA_VISIBLE_DEVICES" in os.environ or os.environ.get("SLURM_JOB_ID"):
        return None
    total = visible_gpu_count()
    chosen = slots.acquire(num_gpus, total) if total else []
    if not chosen:
        return None  # fewer GPUs than asked: the run reports itself unsupported
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, chosen))
    return os.environ["CUDA_VISIBLE_DEVICES"]
