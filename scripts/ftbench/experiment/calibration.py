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
work from a tiny Llama timed on an H200 (scripts/count_host_ops.py --device cuda --time: its step is the host's,
and the 4-bit Linears took 2.8 times the host time HOST_UNITS counts for them, where the variants without them came
within 9% of their time at one rate per unit). They are where a fit starts and what an uncalibrated prediction
uses; the shipped file holds only what runs measured.

The interval of a prediction: the residual spread of the calibration's runs on that GPU model (log scale), at 95%
(x 1.96). The GPU's terms and the host's miss by different amounts (a launch-bound run's speed scatters more from
job to job, and the host's time per unit of work differs between models), so the spread is two figures: that of the
GPU's terms (``sd_gpu_bound``) and that of the host's (``sd_host_bound``), and a run's interval weighs them by how
much of its step each sets (step_time's ``host_share`` h: sd^2 = ((1 - h) sd_gpu)^2 + (h sd_host)^2, the first-order
error of log step time when the two terms err independently). A run predicted at 82% GPU busy still has h near 0.7
under the smooth combination, so it takes most of the host's spread: a threshold between host-bound and GPU-bound
gave such runs the GPU-bound runs' narrow interval, which missed them by 19-25% (H200). Both figures are fitted to
the runs' residuals by maximum likelihood with each run's h (``_term_spreads``), never below MIN_SD
(MIN_SD_HOST_BOUND for the host's). Where the runs set fewer than MIN_RUNS_FOR_SD runs' worth of host time (the sum
of their h), the host's spread is not measured but taken as HOST_UNCALIBRATED_SD; likewise DEFAULT_SD for the GPU's.
A parameter none of the calibration's runs depends on (a QLoRA factor fitted without a QLoRA run, compile's and
communication's without a compiled or multi-GPU run) keeps its starting value, and the residuals cannot say how far
off that is: such a parameter is listed as ``uninformed`` (its runs' summed sensitivity below MIN_INFORMING), and a
prediction that depends on it adds its prior width, through its sensitivity, to the interval (``parameter_sd``).
Held out of the fit, the one QLoRA run came out 1.31x fast with its host spread's interval (x/ 1.2) missing it;
its factor's prior width gives x/ 2.
A fit's own residuals understate how well it predicts a run it did not see, so the shipped calibration's spread
(``held_out_spread``) is that of its runs each predicted by a fit without its fold (FOLDS folds, a run's fold from
its name): how runs like it were predicted when they were new.
"""

from __future__ import annotations

import datetime
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from ftbench import atomic, user_yaml
from ftbench.errors import ConfigError, FtbenchError
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
    "qlora_host_factor": Param(2.8, 1.0, "log", "host work of a 4-bit Linear over what a CPU count of it sees"),
    "qlora_matmul_ratio": Param(1.0, 0.3, "log", "a 4-bit Linear's matmul time over a 16-bit one's (dequantise, then multiply)"),
    "host_step_s": Param(3e-3, 1.0, "log", "host seconds per step outside the model (loop, loader, scheduler)"),
    "shape_churn_factor": Param(1.6, 0.4, "log", "host time of batches whose shape changes per step, over fixed shapes"),
    "compiled_host_factor": Param(0.25, 0.8, "log", "share of operations a compiled model still dispatches"),
    "overlap_power": Param(4.0, 0.5, "log", "p of step = (gpu^p + host^p)^(1/p): large is the plain maximum"),
    # Host work the counts leave out, as factors on the counted work: until a run of the kind calibrates one, it
    # stays at 1 and, uninformed, widens the interval of the runs it applies to (by x/ 2.7 at 95% for a
    # host-bound one)
    "fsdp_host_factor": Param(1.0, 0.5, "log", "host work of an fsdp run over its count (FSDP's hooks, gathers, reshards)"),
    "trainer_host_factor": Param(1.0, 0.5, "log", "host work under engine hf_trainer over its count (the Trainer's own)"),
    "comm_exposed": Param(0.3, 0.8, "logit", "share of communication the backward pass does not hide"),
}
PER_GPU = {
    "compute_efficiency": Param(0.7, 0.6, "logit", "matmul efficiency at large width, of the dense peak"),
    "memory_efficiency": Param(0.8, 0.5, "logit", "achieved share of the datasheet memory bandwidth"),
}
# The global parameters a probe of a GPU model and its host gives that model its own values of
# (experiment/probes.py): the kernel floor and the host's terms.
PROBED_GLOBALS = ("gpu_op_s", "host_op_s", "host_step_s")
MEASUREMENT_SD = 0.05  # a run's step time scatters by a few percent from job to job (host-bound runs more)
# NVML's utilisation is a sampled share (a sample counts busy if any kernel ran in it): the GPU time it gives is
# looser than the step clock's time.
BUSY_SD = 0.15
MIN_SD = 0.03
# Host-bound runs scatter more from job to job: a launch-bound 134M Llama's tokens/s varied 8-15% between jobs of
# one configuration on an H100, so their interval is never narrower than that.
MIN_SD_HOST_BOUND = 0.06
DEFAULT_SD = 0.10  # the GPU's terms, where the runs set fewer than MIN_RUNS_FOR_SD runs' worth of them
MIN_RUNS_FOR_SD = 3
# The host's term where no host-bound run measured it: its time per unit of host work then rests on the GPU-bound
# runs' little host time and the prior (a plain loop on another host); between models of one H200 host it was 14-18
# us, and a prior from an H100 host said 20: about 0.3 in log, as uncertain as a GPU known only from its datasheet.
HOST_UNCALIBRATED_SD = 0.30
# Summed over a calibration's runs, d log(step) / d(parameter, transformed) below this: the runs do not inform it
# (one host-bound QLoRA run moves its step by about 0.5 per unit of log qlora_host_factor).
MIN_INFORMING = 0.2
SENSITIVITY_STEP = 0.01  # in the transformed space, for the numerical sensitivities
DEFAULT_TRANSFER_SD = 0.30  # datasheet only: until a check across two GPU models measures it
# A probed GPU model (no run on it): how far a probe carries over to training runs is unmeasured (no second GPU
# model's runs were checked against its probe), so it keeps the prior width, not the datasheet's measured transfer_sd.
PROBED_SD = DEFAULT_TRANSFER_SD
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
    uninformed: tuple[str, ...] = field(default=())  # global parameters no run of it informs (module docstring)
    # GPU model name -> the parameters a probe of it gave (``probed_params``); a calibrated entry takes precedence
    probed: dict = field(default_factory=dict)

    def calibrated(self, gpu_name: str) -> bool:
        return gpu_name in self.gpus

    def is_probed(self, gpu_name: str) -> bool:
        """Whether this GPU model's parameters come from a probe of it (and no measured run calibrated it)."""
        return gpu_name in self.probed and gpu_name not in self.gpus

    def params_for(self, gpu_name: str) -> dict:
        """Every parameter for one GPU model: its own where calibrated, its probe's where probed (efficiencies and
        host terms), else the calibrated models' median."""
        own = self.gpus.get(gpu_name)
        if own is not None:
            return {**self.params, **{name: own[name] for name in PER_GPU}}
        median = {name: _median([entry[name] for entry in self.gpus.values()], param.start) for name, param in PER_GPU.items()}
        # a probe's figures where it has them (a GPU without a 16-bit peak has no compute_efficiency from one)
        probed = {name: value for name, value in self.probed.get(gpu_name, {}).items()
                  if name in PER_GPU or name in PROBED_GLOBALS}
        return {**self.params, **median, **probed}

    def spread(self, gpu_name: str, host_share: float) -> float:
        """Log-scale standard deviation of a prediction for this GPU model, of a run whose step time moves with
        the host term by ``host_share`` (step_time.step_terms): the two terms' spreads weighed by it. A GPU model
        no run calibrated takes ``transfer_sd`` (datasheet only), or PROBED_SD where a probe stands for it."""
        own = self.gpus.get(gpu_name)
        if own is None:
            return PROBED_SD if self.is_probed(gpu_name) else self.transfer_sd
        gpu_sd = float(own.get("sd_gpu_bound") or DEFAULT_SD)
        host_sd = float(own.get("sd_host_bound") or HOST_UNCALIBRATED_SD)
        return math.hypot((1 - host_share) * gpu_sd, host_share * host_sd)

    def parameter_sd(self, load: step_time.Workload, gpu: dict) -> float:
        """Log-scale sd a prediction takes from the uninformed parameters it depends on: each one's prior width
        times the prediction's sensitivity to it (in the transformed space the prior is stated in)."""
        params = self.params_for(gpu["name"])
        if step_time.step_terms(load, gpu, params, self.combine) is None:
            return 0.0
        return math.sqrt(sum((_sensitivity(load, gpu, params, name, self.combine) * GLOBAL[name].prior_sd) ** 2
                             for name in self.uninformed))

    def interval_sd(self, load: step_time.Workload, gpu: dict, terms: dict) -> float:
        """The whole log-scale sd of a prediction (``terms``: its step_terms): the residual spread for its GPU
        model and host share, and what its uninformed parameters add."""
        return math.hypot(self.spread(gpu["name"], terms["host_share"]), self.parameter_sd(load, gpu))

    def over(self, base: "Calibration") -> "Calibration":
        """This calibration's GPU models (the user's own) taking precedence over ``base``'s (the shipped one)."""
        return replace(self, gpus={**base.gpus, **self.gpus}, probed={**base.probed, **self.probed})


def _median(values: list[float], default: float) -> float:
    return float(np.median(values)) if values else default


def priors() -> Calibration:
    """The starting values: what a prediction rests on before any run was measured."""
    return Calibration({name: param.start for name, param in GLOBAL.items()}, {},
                       source="starting values: no measured run, every GPU model datasheet only", uninformed=tuple(GLOBAL))


# --- the file -------------------------------------------------------------------------------------------------

HEADER = """\
# The step-time model's calibration (scripts/ftbench/experiment/step_time.py and calibration.py): what
# `python -m ftbench plan` predicts tokens/s, hours and dollars on every GPU of config/gpus.yaml with.
#   parameters: the code's and the host's, shared by every GPU model (calibration.py says what each is).
#   gpus: per GPU model measured: its efficiencies, the runs they were fitted to and the spread of those runs'
#         residuals, each run predicted by a fit without it (log scale): sd_gpu_bound of the GPU's terms,
#         sd_host_bound of the host's; a prediction's sd weighs them by the share of its step the host sets, and
#         its 95% interval is x/ exp(1.96 sd).
#   transfer_sd: the log spread of a prediction for a GPU model not listed (datasheet only, the listed models' median
#         efficiencies): measured where the command above has --transfer-from (another GPU model's calibration
#         predicting these runs from their datasheet), else the prior 0.3.
#   host: the CPU the host terms were measured with; another host's launch speed differs.
#   uninformed: parameters no run here depends on (they keep their starting values); a prediction that depends on
#         one takes its prior width into its interval.
# Written by scripts/fit_calibration.py from measured runs (the shipped file: from the tables of
# config/calibration-runs/, which the command above refits into this file); a user's own results/metrics.parquet is
# fitted over it at plan time and takes precedence for the GPU models measured there, and GPU probes
# (config/calibration-probed.yaml) stand in for GPU models no run measured.
"""


def load(path: str | Path) -> Calibration:
    """A calibration file (layout of config/calibration.yaml); a missing one is the priors."""
    path = Path(path)
    if not path.is_file():
        raise FtbenchError(f"calibration {path}: not found (config/calibration.yaml is the shipped one)")
    try:
        data = user_yaml.loads(path.read_text(encoding="utf-8"), str(path)) or {}  # 1e-3 a number, as people write it
    except ConfigError as exc:
        raise FtbenchError(f"calibration {path}: not YAML ({' '.join(str(exc).split())})") from None
    problem = _problem(data)
    if problem:
        raise FtbenchError(f"calibration {path}: {problem}")
    given = data.get("parameters") or {}
    params = {name: float(given.get(name, param.start)) for name, param in GLOBAL.items()}
    # a parameter the file does not give (one added since it was fitted) was fitted to nothing
    uninformed = [name for name in GLOBAL if name in (data.get("uninformed") or ()) or name not in given]
    return Calibration(params, {name: dict(entry) for name, entry in (data.get("gpus") or {}).items()},
                       data.get("combine", "smooth"), float(data.get("transfer_sd", DEFAULT_TRANSFER_SD)),
                       data.get("host"), str(path), uninformed=tuple(uninformed))


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
    uninformed = data.get("uninformed") or []
    if not isinstance(uninformed, list) or set(uninformed) - set(GLOBAL):
        return f"uninformed: expected a list of parameter names ({', '.join(GLOBAL)}), got {uninformed!r}"
    if data.get("combine", "smooth") not in step_time.COMBINES:
        return f"combine: expected one of {', '.join(step_time.COMBINES)}, got {data.get('combine')!r}"
    return None


def save(calibration: Calibration, path: str | Path, measured_on: list[str] | None = None,
         fitted: str | None = None) -> None:
    """Write a calibration file (atomically), with the header that says what it holds and, where given, lines
    saying what its runs were measured on (card, software, the commands). ``fitted``: the date it stands for (the
    latest its runs were collected, so a refit of the same runs writes the same file); default today."""
    body = {
        "source": calibration.source,
        "fitted": (fitted or datetime.date.today().isoformat()) if calibration.gpus else None,
        "host": calibration.host,
        "combine": calibration.combine,
        "transfer_sd": round(calibration.transfer_sd, 4),
        "parameters": {name: _rounded(value) for name, value in calibration.params.items()},
        "gpus": {name: {key: _rounded(value) for key, value in entry.items()} for name, entry in calibration.gpus.items()},
        "uninformed": list(calibration.uninformed),
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
    informing = _informing(samples, shared, gpus, combine)
    uninformed = tuple(name for name in start.uninformed if informing[name] < MIN_INFORMING)
    return Calibration(shared, entries, combine, start.transfer_sd, host or start.host, source, uninformed=uninformed)


def _informing(samples: list[Sample], shared: dict, gpus: dict, combine: str) -> dict[str, float]:
    """Per global parameter, how much the runs' step times move with it: the sum over runs of
    |d log(step) / d(parameter, transformed)|."""
    totals = dict.fromkeys(GLOBAL, 0.0)
    for sample in samples:
        params = {**shared, **gpus[sample.gpu["name"]]}
        for name in GLOBAL:
            totals[name] += abs(_sensitivity(sample.workload, sample.gpu, params, name, combine))
    return totals


def _sensitivity(load: step_time.Workload, gpu: dict, params: dict, name: str, combine: str) -> float:
    """d log(step) / d(global parameter ``name``, in the transformed space its prior is stated in), numerically."""
    param = GLOBAL[name]
    moved = _backward(_forward(params[name], param.transform) + SENSITIVITY_STEP, param.transform)
    base = step_time.step_terms(load, gpu, params, combine)["step_s"]
    step = step_time.step_terms(load, gpu, {**params, name: moved}, combine)["step_s"]
    return math.log(step / base) / SENSITIVITY_STEP


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
    residuals: dict[str, list[tuple[float, float]]] = {}
    for fold in range(folds):
        train = [s for s in samples if fold_of(s.run_id, folds) != fold]
        test = [s for s in samples if fold_of(s.run_id, folds) == fold]
        if not train or not test:
            continue
        partial = fit(train, start, fitted.combine)
        for sample in (s for s in test if s.gpu["name"] in partial.gpus):
            name = sample.gpu["name"]
            held = step_time.step_terms(sample.workload, sample.gpu, partial.params_for(name), fitted.combine)
            share = step_time.step_terms(sample.workload, sample.gpu, fitted.params_for(name), fitted.combine)["host_share"]
            residuals.setdefault(name, []).append((math.log(held["step_s"] / sample.step_s), share))
    gpus = {}
    for name, entry in fitted.gpus.items():
        gpus[name] = {**entry, **_term_spreads(residuals.get(name, []), own=False), "spread": f"held out: {folds} folds"}
    return replace(fitted, gpus=gpus)


def _spread(samples: list[Sample], shared: dict, gpu_params: dict, combine: str) -> dict:
    """The runs of one GPU model and the spread of their log residuals (``_term_spreads``)."""
    residuals, host_bound = [], 0
    for sample in samples:
        terms = step_time.step_terms(sample.workload, sample.gpu, {**shared, **gpu_params}, combine)
        residuals.append((math.log(terms["step_s"] / sample.step_s), terms["host_share"]))
        host_bound += terms["busy_share"] < HOST_BOUND
    device_names = sorted({sample.gpu.get("device_name", "") for sample in samples} - {""})
    return {"runs": len(samples), "host_bound_runs": host_bound, **_term_spreads(residuals),
            **({"device_name": device_names[0]} if device_names else {})}


SD_GRID = np.exp(np.linspace(math.log(0.005), math.log(2.0), 121))  # where the likelihood is searched


def _term_spreads(residuals: list[tuple[float, float]], own: bool = True) -> dict:
    """sd_gpu_bound and sd_host_bound from (log residual, host_share) pairs: the pair that makes the residuals
    likeliest when each is normal with sd^2 = ((1 - h) sd_gpu)^2 + (h sd_host)^2 (the module's docstring). A term
    the runs set less than MIN_RUNS_FOR_SD runs' worth of (the sum of 1 - h, of h) is not estimated: DEFAULT_SD,
    HOST_UNCALIBRATED_SD. A fit's ``own`` residuals are scaled by n / (n - 1) for what the fit absorbed."""
    errors = np.array([residual for residual, _ in residuals], dtype=float)
    shares = np.array([share for _, share in residuals], dtype=float)
    gpu_grid = SD_GRID if np.sum(1 - shares) >= MIN_RUNS_FOR_SD else np.array([DEFAULT_SD])
    host_grid = SD_GRID if np.sum(shares) >= MIN_RUNS_FOR_SD else np.array([HOST_UNCALIBRATED_SD])
    gpu_sd, host_sd = gpu_grid[0], host_grid[0]
    if errors.size and (gpu_grid.size > 1 or host_grid.size > 1):
        variance = (np.square(gpu_grid[:, None, None] * (1 - shares)) + np.square(host_grid[None, :, None] * shares)
                    + 1e-12)
        likelihood = -0.5 * np.sum(np.log(variance) + np.square(errors) / variance, axis=2)
        best_gpu, best_host = np.unravel_index(np.argmax(likelihood), likelihood.shape)
        correction = math.sqrt(errors.size / (errors.size - 1)) if own and errors.size > 1 else 1.0
        if gpu_grid.size > 1:
            gpu_sd = gpu_grid[best_gpu] * correction
        if host_grid.size > 1:
            host_sd = host_grid[best_host] * correction
    return {"sd_gpu_bound": max(MIN_SD, float(gpu_sd)), "sd_host_bound": max(MIN_SD_HOST_BOUND, float(host_sd))}


# --- the transfer: a calibration's datasheet-only predictions of runs on a GPU model it never measured ----------

def datasheet_only(source: Calibration, samples: list[Sample]) -> list[Sample]:
    """The runs on GPU models ``source`` measured no run on: the ones it predicts from their datasheet alone."""
    return [sample for sample in samples if not source.calibrated(sample.gpu["name"])]


def transfer_log_errors(source: Calibration, samples: list[Sample]) -> list[float]:
    """log(predicted / measured tokens/s) of every run ``source`` predicts datasheet only (``datasheet_only``)."""
    errors = []
    for sample in datasheet_only(source, samples):
        terms = step_time.step_terms(sample.workload, sample.gpu, source.params_for(sample.gpu["name"]), source.combine)
        errors.append(math.log(sample.step_s / terms["step_s"]))
    return errors


def transfer_spread(source: Calibration, samples: list[Sample]) -> float:
    """``transfer_sd`` measured: the root mean square of ``transfer_log_errors`` (about zero, as the interval is
    centred on the prediction: a bias of the datasheet widens it as a scatter does). GPU- and host-bound runs
    alike, as the datasheet-only interval takes one sd for both."""
    errors = transfer_log_errors(source, samples)
    if len(errors) < MIN_RUNS_FOR_SD:
        names = sorted({sample.gpu["name"] for sample in samples})
        raise FtbenchError(f"transfer from {source.source}: {len(errors)} runs on a GPU model it did not measure "
                           f"(the runs are on {', '.join(names)}; it measured {', '.join(source.gpus) or 'none'}): "
                           f"expected at least {MIN_RUNS_FOR_SD}")
    return math.sqrt(sum(error * error for error in errors) / len(errors))
