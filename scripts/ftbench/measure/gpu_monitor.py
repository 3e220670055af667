"""GPU utilisation, memory and power sampled through NVML in a background thread.

Energy comes from the driver's energy counter (total millijoules since boot, Volta and newer) read at
the start and end of the measured window; where a GPU has no counter it is integrated from the
sampled power. Without NVML (CPU runs, other vendors) every figure is None: a missing measurement is
never reported as zero.

Cost: one NVML query per GPU per interval (``gpu_sample_interval_s``, default 0.5 s) from a sleeping
thread; the GIL is held only for the call itself. scripts/benchmark_overhead.py measures the effect on
throughput.
"""

from __future__ import annotations

import threading
import time

NULL_RESULT = {
    "gpu_util_mean": None,
    "gpu_mem_used_peak_mb": None,
    "gpu_power_mean_w": None,
    "energy_j": None,
    "nvml_samples": 0,
}


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # library missing, no driver, unsupported vendor  # noqa: BLE001
        return None


def nvml_handles(cuda_indices: list[int]):
    """NVML handles for the given CUDA device ordinals (matched by UUID, so CUDA_VISIBLE_DEVICES is honoured)."""
    nvml = _nvml()
    if nvml is None:
        return None, []
    import torch

    handles = []
    for index in cuda_indices:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        try:
            handles.append(nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"))
        except Exception:  # noqa: BLE001
            return None, []
    return nvml, handles


def driver_version() -> str | None:
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        version = nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else version
    except Exception:  # noqa: BLE001
        return None


class GpuSampler:
    """Samples the run's GPUs between ``start()`` and ``stop()``; ``stop()`` returns the summary."""

    def __init__(self, cuda_indices: list[int], interval_s: float = 0.5):
        self.interval_s = interval_s
        self.nvml, self.handles = nvml_handles(cuda_indices) if cuda_indices else (None, [])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.util: list[float] = []
        self.power_w: list[float] = []
        self.mem_peak_bytes = 0
        self._energy_start: list[int | None] = []
        self._t0 = 0.0
        self.duration_s = 0.0

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def _energy_mj(self) -> list[int | None]:
        readings = []
        for handle in self.handles:
            try:
                readings.append(self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
            except Exception:  # noqa: BLE001
                readings.append(None)
        return readings

    def _sample(self) -> None:
        for handle in self.handles:
            try:
                self.util.append(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
                self.power_w.append(self.nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0)
                self.mem_peak_bytes = max(self.mem_peak_bytes, self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception:  # noqa: BLE001
                pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        if not self.available:
            return
        self._energy_start = self._energy_mj()
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="ftbench-nvml", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        if not self.available or self._thread is None:
            return dict(NULL_RESULT)
        self._stop.set()
        self._thread.join()
        self.duration_s = time.perf_counter() - self._t0
        self._sample()
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
        }
