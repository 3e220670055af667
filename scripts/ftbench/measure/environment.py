"""What machine and software a result came from, stored with every run so results stay comparable."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

from ftbench.measure import gpu_monitor

# Set in a job forked from the warm process (cluster/warmstart.py): when its client process started, the
# moment Snakemake started the job, so overhead_s counts from there.
job_started_at: float | None = None
# Seconds a warm-started job waited for the workflow's warm process to finish importing (the first jobs of a
# workflow can come before it is ready): part of the job's overhead that belongs to the workflow's start.
warm_start_wait_s: float | None = None

LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets", "snakemake", "pandas", "pyarrow")


def library_versions() -> dict[str, str | None]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_commit() -> str | None:
    """Commit of the checkout the job runs in (Snakemake runs each job in the workflow's working
    directory), so a result can be traced to the code that measured it; None outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", os.getcwd(), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None  # git writes nothing to stdout where it finds no repository


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def capture() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "gpu_driver": gpu_monitor.driver_version() if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "git_commit": git_commit(),
        "libraries": library_versions(),
    }


def process_age_s() -> float:
    """Seconds since this job's process started (the operating system's start time, so imports count
    too); for a job forked from a warm process, since its client process started (warmstart.py)."""
    started = job_started_at if job_started_at is not None else process_started_s()
    if started is not None:
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    import psutil  # off Linux, where psutil reads a start time that is not rounded to the second

    return time.time() - psutil.Process().create_time()


def process_started_s(pid: int | None = None) -> float | None:
    """When a process started, on the clock the kernel stamps it with (seconds since boot, CLOCK_BOOTTIME, to a
    clock tick), or None off Linux or once it is gone. Not the wall clock: a start time on the wall clock is built
    from /proc/stat's boot time (as psutil's create_time is on Linux), which is rounded to a whole second: every
    job's startup_s, overhead_s and wall_time_s were off by the same fraction of a second (0.42 s on one laptop: a
    process 0.05 s old read as 0.47 s)."""
    ticks = process_start_ticks(os.getpid() if pid is None else pid)
    return None if ticks is None else ticks / os.sysconf("SC_CLK_TCK")


def process_start_ticks(pid: int) -> int | None:
    """A process's start in clock ticks since boot (/proc/<pid>/stat field 22); None off Linux or once it is gone."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
