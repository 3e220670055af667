"""The step-time model's free parameters (experiment/step_time.py), fitted to measured runs, and the file that ships
them (config/calibration.yaml).

Two kinds of parameters:
- per GPU model: ``compute_efficiency`` (matmuls at large width, of the dense peak) and ``memory_efficiency`` (of
  the datasheet bandwidth). A GPU model no run was measured on takes the calibrated models' median: its prediction is
  "datasheet only (uncalibrated)", with the wider interval ``transfer_sd``.
- global (the code's and the host's, not the GPU's): the eager traffic multiplier and Liger's and compile's share of
  it, attention's efficiency relative to the matmuls', the width at which matmuls reach half their efficiency, the
  GPU's time per kernel, the host's seconds per step and per unit of host work, compile's share of operations, how
  the GPU and host times overlap, the exposed share of communication. The host figures belong to the CPU they were
  measured on (``host`` names it).

The fit (``fit``): maximum a posteriori in a transformed space (log for positive parameters, logit for efficiencies):
each run's residual is log(predicted / measured step time) over MEASUREMENT_SD; where NVML measured the GPU's busy
share, also log(predicted / measured GPU time) over BUSY_SD, the GPU time measured as busy share x step time (this
is what tells the GPU's terms from the host's in a run where both count); each parameter's residual is its distance
from its starting value over its prior width. A parameter no run informs stays where it started, so a handful of
runs fits what they show and nothing else; the user's own runs start from the shipped calibration.
Levenberg-Marquardt on numerical derivatives, numpy only.

The starting values, none taken from the runs the shipped calibration is fitted to: matmul efficiencies from four
MFU figures of a 1.1B Llama full fine-tune on an H200 (batch 4 and 8, with Liger, bf16_true with Liger at batch 16:
0.34, 0.36, 0.48, 0.57); the eager traffic multiplier and Liger's share of it from a count of a Llama layer's
elementwise kernels' bytes (norms, casts, rotary, residual adds, SwiGLU; forward and backward) over the bytes it
keeps (about 7; Liger's fused norm, rotary and SwiGLU move about 0.55 of that per kept byte); the kernel floor from
back-to-back small kernels running one per 2-4 us on an H100; the host from a plain loop's 152 ms per step on a 134M
Llama at batch 64 x 256 on an H100's host (about 20 us per unit of host work counted here); a 4-bit Linear's host
work as counted on the CPU (qlora_host_factor 1). They are where a fit starts and what an uncalibrated prediction
uses; the shipped file holds only what runs measured.

The interval of a prediction: the residual spread of the calibration's runs on that GPU model (log scale; apart for
host-bound and GPU-bound runs, which scatter differently), at 95% (x 1.96), never below MIN_SD (MIN_SD_HOST_BOUND
for host-bound runs). A fit's own residuals understate how well it predicts a run it did not see, so the shipped
calibration's spread (``held_out_spread``) is that of its runs each predicted by a fit without its fold (FOLDS
folds, a run's fold from its name): how runs like it were predicted when they were new.
"""

from __future__ import annotations

import datetime
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from ftbench import atomic
from ftbench.errors import FtbenchError
from ftbench.experiment import step_time
from ftbench.measure import metrics


@dataclass(frozen=True)
class Param:
    start: float
    prior_sd: float  # width of the prior in the transformed space
    transform: str  # log | logit
    doc: str


GLOBAL = {
    "traffic_eager": Param(7.0, 0.8, "log", "bytes moved by eager elementwise kernels per byte of activations kept"),
    "liger_traffic_ratio": Param(0.55, 0.5, "log", "the same with Liger's fused kernels, as a share of eager's"),
    "compiled_traffic_ratio": Param(0.35, 0.6, "log", "the same under torch.compile, as a share of eager's"),
    "attention_ratio": Param(0.8, 0.5, "log", "fused attention's efficiency relative to the matmuls'"),
    "width_half": Param(110.0, 0.7, "log", "layer width at which matmuls reach half their large-width efficiency"),
    "gpu_op_s": Param(3e-6, 0.7, "log", "GPU seconds per kernel however little it does (launch and ramp)"),
    "host_op_s": Param(20e-6, 0.8, "log", "host seconds per unit of host work (an aten operation dispatched)"),
    "qlora_host_factor": Param(1.0, 1.0, "log", "host work of a 4-bit Linear over what a CPU count of it sees"),
    "host_step_s": Param(3e-3, 1.0, "log", "host seconds per step outside the model (loop, loader, scheduler)"),
    "shape_churn_factor": Param(1.6, 0.4, "log", "host time of batches whose shape changes per step, over fixed shapes"),
    "compiled_host_factor": Param(0.25, 0.8, "log", "share of operations a compiled model still dispatches"),
    "overlap_power": Param(4.0, 0.5, "log", "p of step = (gpu^p + host^p)^(1/p): large is the plain maximum"),
    "comm_exposed": Param(0.3, 0.8, "logit", "share of communication the backward pass does not hide"),
}
PER_GPU = {
    "compute_efficiency": Param(0.7, 0.6, "logit", "matmul efficiency at large width, of the dense peak"),
    "memory_efficiency": Param(0.8, 0.5, "logit", "achieved share of the datasheet memory bandwidth"),
}
MEASUREMENT_SD = 0.05  # a run's step time scatters by a few percent from job to job (host-bound runs more)
# NVML's utilisation is a sampled share (a sample counts busy if any kernel ran in it): the GPU time it gives is
# looser than the step clock's time.
BUSY_SD = 0.15
MIN_SD = 0.03
# Host-bound runs scatter more from job to job: a launch-bound 134M Llama's tokens/s varied 8-15% between jobs of
# one configuration on an H100, so their interval is never narrower than that.
MIN_SD_HOST_BOUND = 0.06
DEFAULT_SD = 0.10  # a GPU model with fewer than MIN_RUNS_FOR_SD runs of a kind
MIN_RUNS_FOR_SD = 3
DEFAULT_TRANSFER_SD = 0.30  # datasheet only: until a check across two GPU models measures it
HOST_BOUND = metrics.HOST_BOUND_BUSY_SHARE  # a predicted busy share below it: host-bound, as a measured one is
Z95 = 1.96


@dataclass(frozen=True)
class Sample:
    """One measured run for the fit: its workload, its GPU's table entry and the measured seconds per step."""

    run_id: str
    workload: step_time.Workload
    gpu: dict
    step_s: float
    busy_share: float | None = None  # measured (NVML), for the check


@dataclass(frozen=True)
class Calibration:
    params: dict  # global parameters
    gpus: dict  # GPU model name -> its parameters and residual spread, runs, where measured
    combine: str = "smooth"
    transfer_sd: float = DEFAULT_TRANSFER_SD
    host: str | None = None  # the CPU the host terms were measured with
    source: str = "priors"  # where it came from (a file, or the runs it was fitted to)
    notes: tuple[str, ...] = field(default=())

    def calibrated(self, gpu_name: str) -> bool:
        return gpu_name in self.gpus

    def params_for(self, gpu_name: str) -> dict:
        """Every parameter for one GPU model: its own where calibrated, else the calibrated models' median."""
        own = self.gpus.get(gpu_name)
        if own is None:
            own = {name: _median([entry[name] for entry in self.gpus.values()], param.start) for name, param in PER_GPU.items()}
        return {**self.params, **{name: own[name] for name in PER_GPU}}

    def spread(self, gpu_name: str, host_bound: bool) -> float:
        """Log-scale standard deviation of a prediction for this GPU model and kind of run."""
        own = self.gpus.get(gpu_name)
        if own is None:
            return self.transfer_sd
        return float(own.get("sd_host_bound" if host_bound else "sd_gpu_bound") or DEFAULT_SD)

    def over(self, base: "Calibration") -> "Calibration":
        """This calibration's GPU models (the user's own) taking precedence over ``base``'s (the shipped one)."""
        return replace(self, gpus={**base.gpus, **self.gpus})


def _median(values: list[float], default: float) -> float:
    return float(np.median(values)) if values else default


def priors() -> Calibration:
    """The starting values: what a prediction rests on before any run was measured."""
    return Calibration({name: param.start for name, param in GLOBAL.items()}, {},
                       source="starting values: no measured run, every GPU model datasheet only")


# --- the file -------------------------------------------------------------------------------------------------

HEADER = """\
# The step-time model's calibration (scripts/ftbench/experiment/step_time.py and calibration.py): what
# `python -m ftbench plan` predicts tokens/s, hours and dollars on every GPU of config/gpus.yaml with.
#   parameters: the code's and the host's, shared by every GPU model (calibration.py says what each is).
#   gpus: per GPU model measured: its efficiencies, the runs they were fitted to and the spread of those runs'
#         residuals, each run predicted by a fit without it (log scale, apart for host-bound and GPU-bound runs):
#         a prediction's 95% interval is x/ exp(1.96 sd).
#   transfer_sd: the spread of a prediction for a GPU model not listed (datasheet only, the listed models' median
#         efficiencies), as a check across two GPU models measured it (scripts/check_predictions.py --transfer).
#   host: the CPU the host terms were measured with; another host's launch speed differs.
# Written by scripts/fit_calibration.py from measured runs; a user's own results/metrics.parquet is fitted
# over it at plan time and takes precedence for the GPU models measured there.
"""


def load(path: str | Path) -> Calibration:
    """A calibration file (layout of config/calibration.yaml); a missing one is the priors."""
    path = Path(path)
    if not path.is_file():
        raise FtbenchError(f"calibration {path}: not found (config/calibration.yaml is the shipped one)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise FtbenchError(f"calibration {path}: not YAML ({' '.join(str(exc).split())})") from None
    problem = _problem(data)
    if problem:
        raise FtbenchError(f"calibration {path}: {problem}")
    params = {name: float((data.get("parameters") or {}).get(name, param.start)) for name, param in GLOBAL.items()}
    return Calibration(params, {name: dict(entry) for name, entry in (data.get("gpus") or {}).items()},
                       data.get("combine", "smooth"), float(data.get("transfer_sd", DEFAULT_TRANSFER_SD)),
                       data.get("host"), str(path))


def _problem(data) -> str | None:
    """What is wrong with a calibration file's content, in its layout's terms; None when it can be used."""
    if not isinstance(data, dict):
        return "expected a mapping with parameters and gpus"
    unknown = sorted(set(data.get("parameters") or {}) - set(GLOBAL))
    if unknown:
        return f"parameters: unknown {unknown}; known: {sorted(GLOBAL)}"
    values = [("parameters." + name, value) for name, value in (data.get("parameters") or {}).items()]
    gpus = data.get("gpus") or {}
    if not isinstance(gpus, dict):
        return "gpus: expected GPU model name -> {compute_efficiency, memory_efficiency, ...}"
    for name, entry in gpus.items():
        if not isinstance(entry, dict) or any(key not in entry for key in PER_GPU):
            return f"gpus.{name}: expected {sorted(PER_GPU)} (and runs, sd_gpu_bound, sd_host_bound)"
        values += [(f"gpus.{name}.{key}", entry[key]) for key in PER_GPU]
    for where, value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            return f"{where}: expected a number > 0, got {value!r}"
    if data.get("combine", "smooth") not in step_time.COMBINES:
        return f"combine: expected one of {', '.join(step_time.COMBINES)}, got {data.get('combine')!r}"
    return None


def save(calibration: Calibration, path: str | Path, measured_on: list[str] | None = None) -> None:
    """Write a calibration file (atomically), with the header that says what it holds and, where given, lines
    saying what its runs were measured on (card, software, the commands)."""
    body = {
        "source": calibration.source,
        "fitted": datetime.date.today().isoformat() if calibration.gpus else None,
        "host": calibration.host,
        "combine": calibration.combine,
        "transfer_sd": round(calibration.transfer_sd, 4),
        "parameters": {name: _rounded(value) for name, value in calibration.params.items()},
        "gpus": {name: {key: _rounded(value) for key, value in entry.items()} for name, entry in calibration.gpus.items()},
    }
    measured = "".join(f"# {line}\n" for line in measured_on or [])
    atomic.write_text(path, measured + HEADER + yaml.safe_dump(body, sort_keys=False, width=120))


def _rounded(value):
    return float(f"{value:.4g}") if isinstance(value, float) else value


# --- the fit --------------------------------------------------------------------------------------------------

def _forward(value: float, transform: str) -> float:
    return math.log(value) if transform == "log" else math.log(value / (1 - value))


def _backward(value: float, transform: str) -> float:
    return math.exp(value) if transform == "log" else 1 / (1 + math.exp(-value))


@dataclass(frozen=True)
class _Layout:
    """Where each free parameter sits in the fit's vector: (GPU model or None for a global one, name, Param)."""

    slots: tuple[tuple[str | None, str, Param], ...]

    @classmethod
    def of(cls, gpu_names: list[str]) -> "_Layout":
        return cls(tuple((None, name, param) for name, param in GLOBAL.items())
                   + tuple((gpu, name, param) for gpu in gpu_names for name, param in PER_GPU.items()))

    def vector(self, calibration: Calibration) -> np.ndarray:
        return np.array([_forward(calibration.params[name] if gpu is None else calibration.params_for(gpu)[name],
                                  param.transform) for gpu, name, param in self.slots])

    def params(self, vector: np.ndarray) -> tuple[dict, dict]:
        """(global parameters, GPU model -> its parameters) of a vector."""
        shared, gpus = {}, {}
        for (gpu, name, param), value in zip(self.slots, vector):
            target = shared if gpu is None else gpus.setdefault(gpu, {})
            target[name] = _backward(float(value), param.transform)
        return shared, gpus


def fit(samples: list[Sample], start: Calibration | None = None, combine: str | None = None,
        source: str = "measured runs", host: str | None = None, iterations: int = 200,
        prior_weight: float = 1.0) -> Calibration:
    """The calibration that best explains ``samples`` (module docstring), starting from ``start`` (the priors).
    ``prior_weight``: how hard the priors hold (1: as documented; near 0: the data alone decide)."""
    start = start or priors()
    combine = combine or start.combine
    if not samples:
        raise FtbenchError("calibration: no measured runs to fit (status ok, a GPU of the table, a measured window)")
    gpu_names = sorted({sample.gpu["name"] for sample in samples})
    layout = _Layout.of(gpu_names)
    centre = layout.vector(start)
    widths = np.array([param.prior_sd for _, _, param in layout.slots])
    measured = np.log([sample.step_s for sample in samples])
    busy = [sample for sample in samples if sample.busy_share]
    measured_gpu = np.log([sample.busy_share * sample.step_s for sample in busy])

    def residuals(vector: np.ndarray) -> np.ndarray:
        shared, gpus = layout.params(vector)
        terms = [step_time.step_terms(s.workload, s.gpu, {**shared, **gpus[s.gpu["name"]]}, combine) for s in samples]
        predicted = np.log([term["step_s"] for term in terms])
        predicted_gpu = np.log([term["gpu_s"] for term, s in zip(terms, samples) if s.busy_share])
        return np.concatenate([(predicted - measured) / MEASUREMENT_SD, (predicted_gpu - measured_gpu) / BUSY_SD,
                               prior_weight * (vector - centre) / widths])

    vector = _levenberg_marquardt(residuals, centre.copy(), iterations)
    shared, gpus = layout.params(vector)
    entries = {name: {**gpus[name], **_spread([s for s in samples if s.gpu["name"] == name], shared, gpus[name], combine)}
               for name in gpu_names}
    return Calibration(shared, entries, combine, start.transfer_sd, host or start.host, source)


def _levenberg_marquardt(residuals, vector: np.ndarray, iterations: int) -> np.ndarray:
    damping, current = 1e-2, residuals(vector)
    cost = float(current @ current)
    for _ in range(iterations):
        jacobian = np.empty((current.size, vector.size))
        for column in range(vector.size):
            shifted = vector.copy()
            shifted[column] += 1e-6
            jacobian[:, column] = (residuals(shifted) - current) / 1e-6
        normal = jacobian.T @ jacobian
        gradient = jacobian.T @ current
        while damping < 1e10:
            step = np.linalg.solve(normal + damping * np.diag(np.diag(normal) + 1e-9), -gradient)
            trial = residuals(vector + step)
            trial_cost = float(trial @ trial)
            if trial_cost < cost:
                improved = cost - trial_cost
                vector, current, cost, damping = vector + step, trial, trial_cost, max(damping / 3, 1e-9)
                break
            damping *= 4
        else:
            return vector
        if improved < 1e-10 * max(cost, 1e-12):
            return vector
    return vector


FOLDS = 3


def fold_of(run_id: str, folds: int = FOLDS) -> int:
    """A run's fold from its name, so a run stays in its fold whatever else the results hold."""
    return zlib.crc32(run_id.encode()) % folds


def held_out_spread(fitted: Calibration, samples: list[Sample], start: Calibration | None = None,
                    folds: int = FOLDS) -> Calibration:
    """``fitted`` (the fit of ``samples``) with each GPU model's residual spread replaced by that of its runs each
    predicted by a fit of the other folds (floors as for a fit's own; host-bound or not as ``fitted`` predicts
    them). A fold whose runs leave no other run of its GPU model leaves those runs out."""
    residuals: dict[str, dict[bool, list[float]]] = {}
    for fold in range(folds):
        train = [s for s in samples if fold_of(s.run_id, folds) != fold]
        test = [s for s in samples if fold_of(s.run_id, folds) == fold]
        if not train or not test:
            continue
        partial = fit(train, start, fitted.combine)
        for sample in (s for s in test if s.gpu["name"] in partial.gpus):
            name = sample.gpu["name"]
            held = step_time.step_terms(sample.workload, sample.gpu, partial.params_for(name), fitted.combine)
            kind = step_time.step_terms(sample.workload, sample.gpu, fitted.params_for(name), fitted.combine)
            residuals.setdefault(name, {True: [], False: []})[kind["busy_share"] < HOST_BOUND].append(
                math.log(held["step_s"] / sample.step_s))
    gpus = {}
    for name, entry in fitted.gpus.items():
        kinds = residuals.get(name, {True: [], False: []})
        gpus[name] = {**entry, "sd_gpu_bound": _sd(kinds[False], own=False),
                      "sd_host_bound": max(MIN_SD_HOST_BOUND, _sd(kinds[True] or kinds[False], own=False)),
                      "spread": f"held out: {folds} folds"}
    return replace(fitted, gpus=gpus)


def _spread(samples: list[Sample], shared: dict, gpu_params: dict, combine: str) -> dict:
    """The runs of one GPU model and the spread of their log residuals, host-bound and GPU-bound apart."""
    kinds: dict[bool, list[float]] = {True: [], False: []}
    for sample in samples:
        terms = step_time.step_terms(sample.workload, sample.gpu, {**shared, **gpu_params}, combine)
        kinds[terms["busy_share"] < HOST_BOUND].append(math.log(terms["step_s"] / sample.step_s))
    device_names = sorted({sample.gpu.get("device_name", "") for sample in samples} - {""})
    return {"runs": len(samples), "host_bound_runs": len(kinds[True]),
            "sd_gpu_bound": _sd(kinds[False]), "sd_host_bound": max(MIN_SD_HOST_BOUND, _sd(kinds[True] or kinds[False])),
            **({"device_name": device_names[0]} if device_names else {})}


def _sd(residuals: list[float], own: bool = True) -> float:
    """Root mean square of log residuals; of a fit's ``own`` runs with n / (n - 1) for what the fit absorbed."""
    if len(residuals) < MIN_RUNS_FOR_SD:
        return DEFAULT_SD
    correction = len(residuals) / (len(residuals) - 1) if own else 1.0
    return max(MIN_SD, float(np.sqrt(np.mean(np.square(residuals)) * correction)))
