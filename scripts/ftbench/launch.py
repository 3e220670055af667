"""Starting a run's processes: GPU slots for local jobs, torchrun for DDP, and merging DDP ranks.

DDP runs are started by the training job itself (``torchrun --standalone``, one process per device), so
the same rule works locally and inside one SLURM allocation. Each rank writes its own result file; the
launcher merges them after torchrun returns. No collective runs after training, so a rank that failed
cannot leave the others waiting.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .runspec import RunSpec
from .trainer import STEP_FIELDS, derive_efficiency, summarise

# Worse statuses win when ranks disagree: the run is only as good as its worst rank.
STATUS_PRIORITY = ["failed", "oom", "diverged", "timeout", "unsupported", "ok"]


# ---------------------------------------------------------------------------------------------------
# GPU slots: distinct CUDA_VISIBLE_DEVICES for local jobs running at the same time


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


# ---------------------------------------------------------------------------------------------------
# DDP


def ddp_command(processes: int, worker_args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
        "-m", "ftbench", "train", *worker_args,
    ]


def run_ddp(spec: RunSpec, data_dir: str, rank_dir: Path, threads: int | None, time_limit_s: float | None) -> int:
    """Start one process per device with torchrun; each writes ``rank_dir/rank<R>.json``."""
    processes = max(1, spec.num_gpus)
    args = ["--spec", spec.to_json(), "--data", data_dir, "--rank-dir", str(rank_dir)]
    if threads:
        args += ["--threads", str(max(1, threads // processes))]
    if time_limit_s:
        args += ["--time-limit-s", str(time_limit_s)]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (threads or processes) // processes)))
    process = subprocess.Popen(ddp_command(processes, args), env=env)
    stopped_at = None
    while process.poll() is None:
        time.sleep(1.0)
        if stopped_at is None and any(r["metrics"]["status"] != "ok" for r in read_rank_results(rank_dir)):
            stopped_at = time.monotonic()
        # A rank stopped early (OOM, divergence) and wrote its result; the others would wait for it in
        # their next collective until the process-group timeout. Give them a moment, then end them.
        if stopped_at is not None and time.monotonic() - stopped_at > RANK_GRACE_S:
            print(f"a rank stopped early and its peers still run {RANK_GRACE_S:g} s later (waiting for it in a "
                  "collective): ending them", flush=True)
            end_torchrun(process, rank_dir)
    return process.wait()


RANK_GRACE_S = 20.0
# Seconds a rank gets between SIGTERM and SIGKILL when its run is ended. A rank blocked in a collective
# (NCCL, gloo) does not run Python signal handlers, so only SIGKILL ends it.
RANK_KILL_GRACE_S = 5.0


def end_torchrun(process: subprocess.Popen, rank_dir: Path, grace_s: float | None = None) -> None:
    """End a torchrun launch and every rank it started.

    torchrun starts each rank in a session of its own, so signalling torchrun alone can leave a rank
    behind that holds its GPU's memory until the collective timeout; and torchrun's own shutdown waits
    30 s before it kills. So: SIGTERM each rank, SIGKILL those still there ``grace_s`` later, then the same
    for torchrun. Only torchrun's children running this run's worker command are signalled.
    """
    grace_s = RANK_KILL_GRACE_S if grace_s is None else grace_s
    ranks = [pid for pid in _children(process.pid) if str(rank_dir) in _cmdline(pid)]
    for pids, are_ranks in ((ranks, True), ([process.pid], False)):
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids) and process.poll() is None:
            time.sleep(0.2)
        for pid in pids:
            # A rank is checked again: once torchrun is gone its pid could be another process's.
            if _alive(pid) and (not are_ranks or str(rank_dir) in _cmdline(pid)):
                _signal(pid, signal.SIGKILL)
    try:
        process.wait(timeout=grace_s + 30)
    except subprocess.TimeoutExpired:
        process.kill()


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # /proc/<pid>/stat: "pid (comm) state ppid ...": split after the command, which may hold spaces.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                children.append(int(entry.name))
    return children


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (not a zombie waiting to be reaped)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def merge_ranks(rank_results: list[dict], spec: RunSpec, devices: int) -> tuple[dict, list[dict]]:
    """One run's metrics and step records from its ranks: counts summed, times and memory maxed."""
    rank_results = sorted(rank_results, key=lambda r: r["rank"])
    metrics = dict(rank_results[0]["metrics"])  # rank 0 evaluated; its fields are the base
    metrics.pop("rank", None)  # a per-rank field; the ranks are listed under per_rank
    worst = min((r["metrics"]["status"] for r in rank_results), key=STATUS_PRIORITY.index)
    if worst != "ok":
        # Which rank it was, also when the others left no result (ended while waiting for it).
        culprit = next(r for r in rank_results if r["metrics"]["status"] == worst)
        metrics["status"] = worst
        metrics["status_reason"] = f"rank {culprit['rank']}: {culprit['metrics'].get('status_reason')}"
    for key in ("peak_memory_allocated_mb", "peak_memory_reserved_mb", "peak_rss_mb", "wall_time_s", "train_time_s",
                "gpu_mem_used_peak_mb"):
        values = [r["metrics"][key] for r in rank_results if r["metrics"].get(key) is not None]
        if values:
            metrics[key] = max(values)
    # Each rank sampled its own GPU: energy and power add up, utilisation averages.
    for key, combine in (("energy_j", sum), ("gpu_power_mean_w", sum), ("gpu_util_mean", lambda v: sum(v) / len(v))):
        values = [r["metrics"].get(key) for r in rank_results]
        metrics[key] = combine(values) if all(v is not None for v in values) else None
    metrics["per_rank"] = [
        {key: r["metrics"].get(key) for key in ("tokens_per_s", "peak_memory_reserved_mb", "status", "device_name")}
        for r in rank_results
    ]

    # Steps: the same optimizer step on every rank; a step lasts as long as its slowest rank.
    by_step: dict[int, dict] = {}
    for result in rank_results:
        for record in result["steps"]:
            merged = by_step.setdefault(record["step"], {**record, "samples": 0, "tokens": 0, "padded_tokens": 0,
                                                          "flops": 0, "step_time_s": 0.0, "loader_s": 0.0})
            for count in ("samples", "tokens", "padded_tokens", "flops"):
                merged[count] += record[count]
            for slowest in ("step_time_s", "loader_s"):
                merged[slowest] = max(merged[slowest], record[slowest])
    steps = [by_step[key] for key in sorted(by_step)]
    windows = [r["metrics"].get("window_s") for r in rank_results]
    window_s = max(windows) if all(windows) else None
    metrics["window_s"] = window_s
    metrics.update(summarise(steps, window_s, devices))
    metrics.update(derive_efficiency(metrics, spec, devices))
    return metrics, [{field: step.get(field) for field in STEP_FIELDS} for step in steps]


def read_rank_results(rank_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(rank_dir.glob("rank*.json"))]
