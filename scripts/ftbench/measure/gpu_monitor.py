"""GPU utilisation, memory and power sampled through NVML, in a process of its own.

Why a process: a sampling thread in the training process takes the interpreter's lock for every NVML call,
and on a launch-bound run (a small batch, the GPU waiting on Python's kernel launches) that cost the loop
5-10% of its throughput (H100, 1B Llama at batch 2: NVML on / off 0.93, scripts/benchmark_overhead.py). A
separate process (``python -m ftbench.measure.gpu_monitor``) shares no lock with the loop: the run's
process only writes "start" and "stop" to its pipe, outside the timed steps' work.

Energy comes from the driver's energy counter (total millijoules since boot, Volta and newer) read at the
start and end of the measured window; where a GPU has no counter it is integrated from the sampled power.
Without NVML (CPU runs, other vendors) every figure is None: a missing measurement is never reported as zero.
"""

from __future__ import annotations

import importlib
import json
import select
import subprocess
import sys
import time

NULL_RESULT = {
    "gpu_util_mean": None,
    "gpu_mem_used_peak_mb": None,
    "gpu_power_mean_w": None,
    "energy_j": None,
    "nvml_samples": 0,
}
NVML_MODULE = "pynvml"  # nvidia-ml-py; the sampler process may be given another (tests give a stand-in)


def _nvml(module: str = NVML_MODULE):
    try:
        nvml = importlib.import_module(module)
        nvml.nvmlInit()
        return nvml
    except Exception:  # library missing, no driver, unsupported vendor  # noqa: BLE001
        return None


def gpu_uuids(cuda_indices: list[int]) -> list[str]:
    """NVML's UUIDs of the given CUDA device ordinals (so CUDA_VISIBLE_DEVICES is honoured)."""
    import torch  # deferred: only a run that has GPUs asks

    uuids = []
    for index in cuda_indices:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        uuids.append(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    return uuids


def driver_version() -> str | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001
        return None


class Sampling:
    """The samples of some GPUs (NVML handles) over a window, and their summary. Runs in the sampler process."""

    def __init__(self, nvml, handles: list):
        self.nvml, self.handles = nvml, handles
        self.util: list[float] = []
        self.power_w: list[float] = []
        self.mem_peak_bytes = 0
        self._energy_start: list[int | None] = []
        self._t0 = 0.0
        self.duration_s = 0.0

    def _energy_mj(self) -> list[int | None]:
        readings = []
        for handle in self.handles:
            try:
                readings.append(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            except Exception:  # noqa: BLE001
                readings.append(None)
        return readings

    def sample(self) -> None:
        for handle in self.handles:
            try:
                self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                self.power_w.append(self.nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
                self.mem_peak_bytes = max(self.mem_peak_bytes, self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # noqa: BLE001
                pass

    def begin(self) -> None:
        self._energy_start = self._energy_mj()
        self._t0 = time.perf_counter()
        self.sample()

    def end(self) -> dict:
        self.duration_s = time.perf_counter() - self._t0
        self.sample()
        end = self._energy_mj()
        samples_per_gpu = max(1, len(self.power_w) // len(self.handles))
        # Power of all the run's GPUs together: mean per-GPU sample x number of GPUs.
        power_total = sum(self.power_w) / samples_per_gpu if self.power_w else None
        if all(a is not None and b is not None for a, b in zip(self._energy_start, end)):
            energy = sum(b - a for a, b in zip(self._energy_start, end)) / 1000.0
        else:
            energy = power_total * self.duration_s if power_total is not None else None
        return {
            "gpu_util_mean": sum(self.util) / len(self.util) if self.util else None,
            "gpu_mem_used_peak_mb": self.mem_peak_bytes / 2**20 if self.mem_peak_bytes else None,
            "gpu_power_mean_w": energy / self.duration_s if energy is not None and self.duration_s else power_total,
            "energy_j": energy,
            "nvml_samples": len(self.util),
            "nvml_window_s": self.duration_s,
        }


class GpuSampler:
    """Samples the run's GPUs between ``start()`` and ``stop()`` from a sampler process; ``stop()`` returns
    the summary. Started (the process launched, NVML opened) when made, before the measured window."""

    def __init__(self, cuda_indices: list[int], interval_s: float = 0.5, nvml_module: str = NVML_MODULE):
        self.interval_s = interval_s
        self._process: subprocess.Popen | None = None
        self._started = False
        if cuda_indices and _nvml(nvml_module) is not None:
            request = {"uuids": gpu_uuids(cuda_indices), "interval_s": interval_s, "nvml_module": nvml_module}
            self._process = _launch(request)

    @property
    def available(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        if self.available:
            self._process.stdin.write("start\n")
            self._process.stdin.flush()
            self._started = True

    def stop(self) -> dict:
        if not self.available:
            return dict(NULL_RESULT)
        try:
            if not self._started:
                return dict(NULL_RESULT)
            self._process.stdin.write("stop\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline()
            return {key: value for key, value in json.loads(line).items() if key in NULL_RESULT} if line else dict(NULL_RESULT)
        finally:
            self.close()

    def close(self) -> None:
        if self._process is not None:
            self._process.stdin.close()
            self._process.wait(timeout=10)
            self._process = None


def _launch(request: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ftbench.measure.gpu_monitor", json.dumps(request)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)


def serve(request: dict, commands=sys.stdin, out=sys.stdout) -> int:
    """The sampler process: open the GPUs, then on "start" sample every ``interval_s`` until "stop" (or the
    run's process closes the pipe), and print the summary as one JSON line."""
    nvml = _nvml(request.get("nvml_module", NVML_MODULE))
    handles = [nvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in request["uuids"]] if nvml else []
    sampling = Sampling(nvml, handles)
    if commands.readline().strip() != "start":
        return 0  # the run ended before its window began
    sampling.begin()
    while True:
        ready, _, _ = select.select([commands], [], [], float(request["interval_s"]))
        if ready:
            break  # "stop", or the pipe closed
        sampling.sample()
    out.write(json.dumps(sampling.end() if handles else NULL_RESULT) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
