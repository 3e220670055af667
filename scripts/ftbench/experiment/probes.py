"""GPU probes as a calibration's third source: a probe file (written by ``python -m ftbench probe-gpu``, the
figures of measure/gpu_probe.py per GPU model) and the parameters of the step-time model each probe stands for.

Precedence, per GPU model: runs measured on it (the shipped calibration, your own results) > a probe of it > its
datasheet alone. A probed GPU model's prediction reads "probed on this GPU model"; its interval keeps the prior's
width (calibration.PROBED_SD, 0.3 in log): how well a probe's figures carry over to training runs is unmeasured until
runs on a probed GPU model are checked against it (no GPU model but the calibrated one has been probed).

From figures to parameters (``probed_params``):
- directly (``probed_params`` without a reference; printed by the probe, not used to predict): ``compute_efficiency`` = the median over widths of the 16-bit matmul's achieved share of the dense
  peak x (1 + width_half / width) (the step-time model's width curve inverted, with the calibration's width_half);
  ``memory_efficiency`` = the median bandwidth of the elementwise and optimizer kernels over the datasheet's;
  ``gpu_op_s`` = the kernel floor; ``host_op_s`` = the host's seconds per aten operation.
- scaled, where the file also holds a probe of a GPU model the calibration measured runs on (the reference): each
  parameter is the reference's calibrated value times this probe's figure over the reference probe's
  (``host_step_s`` with the host's ratio). A fit to training runs folds into its efficiencies what a bare kernel
  does not show (shapes, fusion, the allocator), and its host terms count Python calls a dispatch count leaves out:
  the ratio keeps those and carries over only what the probe measured differently.
Only the scaled parameters predict (DIRECT_MISS): ``with_probes`` uses a file's probes once it holds a reference.

A GPU model config/gpus.yaml lacks can be added by its probe with its datasheet peak and bandwidth
(``probe-gpu --peak-tflops bf16=... --bandwidth-gbs ...``): the probe file's ``gpus`` list, read after the GPU table
(its entries match first).
"""

from __future__ import annotations

import datetime
import re
import statistics
from dataclasses import replace
from pathlib import Path

import yaml

from ftbench import atomic
from ftbench.errors import FtbenchError
from ftbench.experiment import calibration as calibrations
from ftbench.measure import gpu_table

DEFAULT_PROBES = Path("config/calibration-probed.yaml")
# Why the direct mapping does not predict: an H100 SXM probed directly (compute_efficiency 0.54, host_op_s 21 us: a
# bare matmul and a raw aten operation, not what the fit to training runs means by them) predicted the 20 runs of
# config/examples/calibration.yaml on it at 0.83x (GPU-bound, median) and 0.68x (host-bound) of their measured
# tokens/s; its datasheet with the H200's calibration at 0.92x and 1.05x (python scripts/check_predictions.py
# config/calibration-runs/*.csv --only transfer --transfer-from config/calibration-transfer/h200.yaml).
DIRECT_MISS = {"GPU-bound": 0.83, "host-bound": 0.68}
PROBED_GLOBALS = calibrations.PROBED_GLOBALS
MATMUL_DTYPES = ("bf16", "fp16")  # the 16-bit matmuls set compute_efficiency: what the examples train in
EFFICIENCY_RANGE = (0.02, 0.98)
REQUIRED = ("device_name", "matmul_tflops", "bandwidth_gbs")

HEADER = """\
# GPU probes: the figures `python -m ftbench probe-gpu` measured per GPU model (matmul TFLOP/s by dtype and hidden
# width, bandwidth GB/s by kernel, the GPU's seconds per tiny kernel, the host's seconds per aten operation), and
# where a GPU model config/gpus.yaml lacks was added with its datasheet peak (gpus). `python -m ftbench plan` and the
# report read this file beside config/calibration.yaml: a GPU model probed here and measured by no run is predicted
# from its probe ("probed on this GPU model"; scripts/ftbench/experiment/probes.py says how the figures become
# the step-time model's parameters), with the prior's interval until a check on its runs measures one.
# A probe of a GPU model the calibration measured runs on is the reference every other probe is scaled by: the
# shipped file holds the H100 SXM's (config/calibration.yaml's GPU model, probed on the host of its calibration runs);
# keep it when you add yours (probe-gpu keeps the other models' probes).
"""


def _direct(figures: dict, gpu: dict, width_half: float) -> dict:
    """The parameters a probe's figures stand for on their own (the module docstring)."""
    out = {}
    peaks = gpu.get("dense_tflops") or {}
    dtype = next((name for name in MATMUL_DTYPES if name in peaks and (figures.get("matmul_tflops") or {}).get(name)), None)
    if dtype is not None:
        rates = figures["matmul_tflops"][dtype]
        out["compute_efficiency"] = statistics.median(
            rate / peaks[dtype] * (1 + width_half / float(width)) for width, rate in rates.items())
    bandwidths = [value for value in (figures.get("bandwidth_gbs") or {}).values() if value]
    if bandwidths and gpu.get("memory_bandwidth_gbs"):
        out["memory_efficiency"] = statistics.median(bandwidths) / gpu["memory_bandwidth_gbs"]
    for name, key in (("gpu_op_s", "kernel_s"), ("host_op_s", "host_op_s")):
        if figures.get(key):
            out[name] = float(figures[key])
    return out


def probed_params(figures: dict, gpu: dict, calibration: calibrations.Calibration,
                  reference: tuple[dict, dict] | None = None) -> dict:
    """The step-time parameters a probe of ``gpu`` stands for, directly or scaled by a ``reference`` (figures of
    a calibrated GPU model's probe, its GPU table entry): the module docstring. A figure the probe lacks leaves the
    calibration's value; efficiencies are kept within EFFICIENCY_RANGE."""
    width_half = calibration.params["width_half"]
    direct = _direct(figures, gpu, width_half)
    how = "direct"
    params = dict(direct)
    if reference is not None:
        ref_figures, ref_gpu = reference
        ref_direct = _direct(ref_figures, ref_gpu, width_half)
        ref_params = calibration.params_for(ref_gpu["name"])
        params = {name: ref_params[name] * value / ref_direct[name]
                  for name, value in direct.items() if ref_direct.get(name)}
        if "host_op_s" in params:
            params["host_step_s"] = ref_params["host_step_s"] * direct["host_op_s"] / ref_direct["host_op_s"]
        how = f"scaled by the probe of {ref_gpu['name']} (calibrated)"
    for name in calibrations.PER_GPU:
        if name in params:
            params[name] = min(max(params[name], EFFICIENCY_RANGE[0]), EFFICIENCY_RANGE[1])
    return {**params, "device_name": figures.get("device_name"), "memory_gb": figures.get("memory_gb"),
            "host": figures.get("host"), "from_probe": how}


def with_probes(calibration: calibrations.Calibration, probes: dict, gpus: list[dict]) -> calibrations.Calibration:
    """``calibration`` with every probed GPU model of the table it can map (its figures, ``probes``: GPU model ->
    figures); the first probed GPU model the calibration also measured runs on is the reference."""
    by_name = {gpu["name"]: gpu for gpu in gpus}
    reference = next(((figures, by_name[name]) for name, figures in probes.items()
                      if calibration.calibrated(name) and name in by_name), None)
    if reference is None:  # the direct mapping misses training runs by more than the datasheet does (DIRECT_MISS)
        return calibration
    probed = {name: probed_params(figures, by_name[name], calibration, reference)
              for name, figures in probes.items() if name in by_name and name != reference[1]["name"]}
    return replace(calibration, probed={**calibration.probed, **probed})


def reference_missing(calibration: calibrations.Calibration, probes: dict) -> str | None:
    """Why a probe file's probes are not used (no probe of a GPU model the calibration measured runs on), or None."""
    if not probes or any(calibration.calibrated(name) for name in probes):
        return None
    calibrated = ", ".join(sorted(calibration.gpus)) or "a calibrated GPU model"
    return (f"the probes ({', '.join(sorted(probes))}) are kept but not used until the file also holds a probe of "
            f"{calibrated} (run probe-gpu there with the same --out): a probe's figures alone predicted an H100's "
            "training runs worse than its datasheet did")


def load(path: str | Path | None) -> tuple[dict, list[dict]]:
    """(GPU model -> probe figures, GPU table entries the file adds) of a probe file; a missing file has none."""
    if path is None or not Path(path).is_file():
        return {}, []
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise FtbenchError(f"probe file {path}: not YAML ({' '.join(str(exc).split())})") from None
    probes, added = data.get("probes") or {}, data.get("gpus") or []
    if not isinstance(probes, dict) or not isinstance(added, list):
        raise FtbenchError(f"probe file {path}: expected `probes: {{GPU model: figures}}` and an optional `gpus` list")
    for name, figures in probes.items():
        missing = [key for key in REQUIRED if not isinstance(figures, dict) or key not in figures]
        if missing:
            raise FtbenchError(f"probe file {path}: probes.{name}: missing {', '.join(missing)} "
                               "(write it with `python -m ftbench probe-gpu`)")
    problem = gpu_table.entries_problem(added) if added else None
    if problem:
        raise FtbenchError(f"probe file {path}: {problem}")
    return probes, added


def merged_gpus(gpus: list[dict], added: list[dict]) -> list[dict]:
    """The GPU table with a probe file's added entries first (they match before the table's), each name once."""
    names = {entry["name"] for entry in added}
    return [*added, *(gpu for gpu in gpus if gpu["name"] not in names)]


def save(path: str | Path, name: str, figures: dict, gpu_entry: dict | None = None) -> None:
    """Write (or replace) one GPU model's probe in a probe file, keeping the others; ``gpu_entry``: its GPU table
    entry where the table lacks it."""
    probes, added = load(path)
    probes[name] = {**figures, "probed": datetime.date.today().isoformat()}
    if gpu_entry is not None:
        added = [entry for entry in added if entry["name"] != name] + [gpu_entry]
    body = {"probes": probes, **({"gpus": added} if added else {})}
    atomic.write_text(path, HEADER + yaml.safe_dump(body, sort_keys=False, width=120))


def new_gpu_entry(name: str, device_name: str, memory_gb: float | None, peaks: dict, bandwidth_gbs: float) -> dict:
    """A GPU table entry (config/gpus.yaml's layout) from a probe and the datasheet's dense peaks and bandwidth."""
    entry = {"name": name, "match": re.escape(device_name), "memory_gb": memory_gb, "memory_bandwidth_gbs": bandwidth_gbs,
             "dense_tflops": dict(peaks)}
    problem = gpu_table.entries_problem([entry])
    if problem:
        raise FtbenchError(f"probe-gpu: the new GPU table entry: {problem}")
    return entry
