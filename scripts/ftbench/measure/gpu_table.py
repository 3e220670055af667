"""The GPU table (config/gpus.yaml): dense peak TFLOP/s per GPU model and dtype, the peak MFU divides by; memory
capacity, memory bandwidth and the GPU-to-GPU link, what the step-time prediction (experiment/step_time.py) reads.

Read at collect time (the collect rule passes the file), so a corrected peak re-runs collect and report,
never training. Imports nothing heavy: collect runs in the analysis environment, which has no torch.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

from ftbench import user_yaml
from ftbench.errors import ConfigError, FtbenchError


def load_peaks(path: str | Path) -> list[dict]:
    """The ``gpus`` entries of a GPU table (layout of config/gpus.yaml)."""
    path = Path(path)
    try:
        peaks = user_yaml.loads(path.read_text(encoding="utf-8"), str(path))["gpus"]
    except (OSError, UnicodeDecodeError, ConfigError, TypeError, KeyError) as exc:
        raise FtbenchError(f"GPU table {path}: cannot read its `gpus` list ({' '.join(str(exc).split())})") from None
    problem = entries_problem(peaks)
    if problem:
        raise FtbenchError(f"GPU table {path}: {problem}")
    return peaks


def entries_problem(peaks) -> str | None:
    """What is wrong with a table's ``gpus`` list, in its layout's terms; None when it can be used."""
    if not isinstance(peaks, list):
        return f"gpus: expected a list of {{name, match, memory_gb, dense_tflops}}, got {type(peaks).__name__}"
    for index, entry in enumerate(peaks):
        where = f"gpus[{index}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("match"), str):
            return f"{where}: expected a mapping with a name and a match (a regular expression), got {entry!r}"
        try:
            re.compile(entry["match"])
        except re.error as exc:
            return f"{where}.match: {entry['match']!r} is not a regular expression ({exc})"
        tflops = entry.get("dense_tflops")
        if not isinstance(tflops, dict) or not all(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 for value in tflops.values()):
            return f"{where}.dense_tflops: expected dtype -> peak TFLOP/s > 0 (e.g. {{bf16: 989.4}}), got {tflops!r}"
        for key, expected in SIZES.items():
            value = entry.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                return f"{where}.{key}: expected {expected} > 0, got {value!r}"
    return None


# Optional per-GPU figures and what each must be.
SIZES = {"memory_gb": "a size in GB", "memory_bandwidth_gbs": "a bandwidth in GB/s",
         "interconnect_gbs": "a bandwidth in GB/s"}


def entry_for(device_name: str, peaks: list[dict]) -> dict | None:
    """The first table entry whose ``match`` fits a device name (torch's, or a table entry's own name), or None."""
    return next((entry for entry in peaks if re.search(entry["match"], device_name or "", flags=re.IGNORECASE)), None)


def peak_tflops(device_name: str, dtype: str, peaks: list[dict]) -> tuple[float | None, str | None]:
    """(dense peak TFLOP/s per device, the table entry used) for a device name and dtype, or (None, None)."""
    for entry in peaks:
        if re.search(entry["match"], device_name or "", flags=re.IGNORECASE):
            value = entry["dense_tflops"].get(dtype)
            return (float(value), f"{entry['name']} {dtype}") if value is not None else (None, None)
    return None, None


def mfu(achieved_flops_per_s: float | None, device_name: str, dtype: str, devices: int, peaks: list[dict]) -> dict:
    peak, source = peak_tflops(device_name, dtype, peaks)
    if achieved_flops_per_s is None:
        return {"mfu": None, "mfu_peak_tflops": peak, "mfu_peak_source": source}
    if peak is None:
        warnings.warn(f"no {dtype} peak for device {device_name!r} in the GPU peak table: MFU left empty", stacklevel=2)
        return {"mfu": None, "mfu_peak_tflops": None, "mfu_peak_source": None}
    return {
        "mfu": achieved_flops_per_s / (peak * 1e12 * devices),
        "mfu_peak_tflops": peak,
        "mfu_peak_source": source,
    }


def capacity_mb(device_name, gpu_table: list[dict]) -> float | None:
    """Memory of one device (MiB): the size in the device's own name ("A100-SXM4-40GB", "H100 80GB HBM3")
    when it has one, else the memory_gb of the first GPU table entry whose ``match`` fits; None when unknown."""
    if not isinstance(device_name, str):
        return None
    named = re.search(r"(\d+)\s*GB\b", device_name, flags=re.IGNORECASE)
    if named:
        return float(named.group(1)) * 1024
    for entry in gpu_table:
        if re.search(entry.get("match", "$^"), device_name, flags=re.IGNORECASE):
            memory = entry.get("memory_gb")
            return float(memory) * 1024 if memory else None
    return None
