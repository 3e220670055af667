"""The GPU table (config/gpus.yaml): dense peak TFLOP/s per GPU model and dtype, the peak MFU divides by.

Read at collect time (the collect rule passes the file), so a corrected peak re-runs collect and report,
never training. Imports nothing heavy: collect runs in the analysis environment, which has no torch.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import yaml

from .errors import FtbenchError


def load_peaks(path: str | Path) -> list[dict]:
    """The ``gpus`` entries of a GPU table (layout of config/gpus.yaml)."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))["gpus"]
    except (OSError, yaml.YAMLError, TypeError, KeyError) as exc:
        raise FtbenchError(f"GPU table {path}: cannot read its `gpus` list ({exc})") from None


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
