"""GPU utilisation, memory and power sampled through NVML, in a process of its own.

Why a process: a sampling thread in the training process takes the interpreter's lock for every NVML call,
and on a launch-bound run (a small batch, the GPU waiting on Python's kernel launches) that cost the loop
5-10% of its throughput (H100, 1B Llama at batch 2: NVML on / off 0.93, scripts/benchmark_overhead.py). A
separate process (``python -m ftbench.measure.gpu_monitor``) shares no lock with the loop: the run's
process only writes commands to its pipe, outside the timed steps' work: "start" and "stop" at the measured
window's ends, and "pause" and "resume" around every evaluation between steps inside it.

The figures cover what the window's time covers: the measured steps, without the evaluations between them
(train/evaluation.py pauses the clock for those, and the sampler with it). Energy comes from the driver's
energy counter (total millijoules since boot, Volta and newer), read where each un-paused span begins and
ends and summed over the spans; where a GPU has no counter it is the sampled power times the un-paused time.
No samples are taken while paused. Without NVML (CPU runs, other vendors) every figure is None: a missing
measurement is never reported as zero.
"""

from __future__ import annotations

import importlib
import json
import os
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
    """The samples of some GPUs (NVML handles) over a window, and their summary. Runs in the sampler process.
    The window is one or more measured spans (``begin`` or ``resume`` to ``pause`` or ``end``): energy and
    time are summed over them, and samples are taken only within them. ``clock``: seconds (tests give a
    stand-in)."""

    def __init__(self, nvml, handles: list, clock=time.perf_counter):
        self.nvml, self.handles, self.clock = nvml, handles, clock
        self.util: list[float] = []
        self.power_w: list[float] = []
        self.mem_peak_bytes = 0
        # Per GPU, millijoules of the closed spans; None once a reading failed (no counter: power x time instead).
        self.energy_mj: list[float | None] = [0] * len(handles)
        self.duration_s = 0.0  # seconds of the closed spans
        self._span_energy_start: list[int | None] | None = None  # None while no span is open
        self._span_t0 = 0.0

    @property
    def measuring(self) -> bool:
        """Whether a span is open: the window has begun and is not paused or ended."""
        return self._span_energy_start is not None

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

    def _open_span(self) -> None:
        self._span_energy_start = self._energy_mj()
        self._span_t0 = self.clock()

    def _close_span(self) -> None:
        self.duration_s += self.clock() - self._span_t0
        end = self._energy_mj()
        self.energy_mj = [None if None in (total, start, stop) else total + stop - start
                          for total, start, stop in zip(self.energy_mj, self._span_energy_start, end)]
        self._span_energy_start = None

    def begin(self) -> None:
        """The window's start: the first span opens, with a sample (the steps before it were training's too)."""
        self._open_span()
        self.sample()

    def pause(self) -> None:
        """An evaluation begins: the span closes, with a last sample of the steps."""
        if self.measuring:
            self.sample()
            self._close_span()

    def resume(self) -> None:
        """The evaluation has ended: a new span opens. No sample yet: NVML's utilisation and power average over
        the last fraction of a second, the evaluation's; the first comes an interval later."""
        if not self.measuring:
            self._open_span()

    def end(self) -> dict:
        """The window's end (paused or not): its summary over the spans."""
        self.pause()
        samples_per_gpu = max(1, len(self.power_w) // len(self.handles))
        # Power of all the run's GPUs together: mean per-GPU sample x number of GPUs.
        power_total = sum(self.power_w) / samples_per_gpu if self.power_w else None
        if None not in self.energy_mj:
            energy = sum(self.energy_mj) / 1000.0
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
    the summary; ``pause()`` and ``resume()`` leave a span inside the window out (an evaluation between steps).
    Started (the process launched, NVML opened) when made, before the measured window."""

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

    def _send(self, command: str) -> None:
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()

    def start(self) -> None:
        if self.available:
            self._send("start")
            self._started = True

    def pause(self) -> None:
        """Leave what follows out of the window until ``resume()``. Before ``start()`` (an evaluation before the
        window) and after ``stop()`` nothing is sent: a first line other than "start" ends the sampler process."""
        if self.available and self._started:
            self._send("pause")

    def resume(self) -> None:
        if self.available and self._started:
            self._send("resume")

    def stop(self) -> dict:
        if not self.available:
            return dict(NULL_RESULT)
        try:
            if not self._started:
                return dict(NULL_RESULT)
            self._send("stop")
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


class Commands:
    """The run's commands, one a line, read from a pipe without reading ahead. A buffered reader given
    "pause\\nresume\\n" in one read would return "pause" and keep "resume" in its buffer, where select() on the
    pipe does not see it: the sampler would stay paused until the next write."""

    def __init__(self, stream):
        self.fd = stream.fileno()
        self.pending = b""

    def next(self, timeout_s: float | None) -> str | None:
        """The next command; "" once the pipe closed; None if ``timeout_s`` passed first (None: wait for one)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self.pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], remaining)
            if not ready:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return ""  # the run's process closed the pipe (it ended, or the window never began)
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return line.decode().strip()


def serve(request: dict, commands=sys.stdin, out=sys.stdout, clock=time.perf_counter) -> int:
    """The sampler process: open the GPUs, then on "start" sample every ``interval_s`` until "stop" (or the
    run's process closes the pipe), and print the summary as one JSON line. "pause" closes the measured span
    and stops sampling until "resume" opens the next: while paused it only waits for the next command."""
    nvml = _nvml(request.get("nvml_module", NVML_MODULE))
    handles = [nvml.nvmlDeviceGetHandleByUUID(uuid) for uuid in request["uuids"]] if nvml else []
    sampling = Sampling(nvml, handles, clock)
    reader = Commands(commands)
    if reader.next(timeout_s=None) != "start":
        return 0  # the run ended before its window began
    sampling.begin()
    interval_s = float(request["interval_s"])
    while True:
        command = reader.next(timeout_s=interval_s if sampling.measuring else None)
        if command is None:
            sampling.sample()  # an interval passed without a command
        elif command == "pause":
            sampling.pause()
        elif command == "resume":
            sampling.resume()
        else:
            break  # "stop", or the pipe closed
    out.write(json.dumps(sampling.end() if handles else NULL_RESULT) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(json.loads(sys.argv[1])))
