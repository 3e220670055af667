"""A run's predicted speed on every GPU of the table, before anything trains: tokens/s with a 95% interval, the
hours of the experiment's budget, and what the number rests on.

A pure function of the run's settings, its model's config, a GPU's row of config/gpus.yaml and a calibration
(experiment/step_time.py, experiment/calibration.py): the plan, the report and the held-out check
(scripts/check_predictions.py) call it alike. What each prediction rests on (``BASES``):
- measured here: a run of this configuration on this GPU model is in the results: the measurement is shown, not a
  prediction (the report and the plan take it from results/metrics.parquet);
- calibrated on this GPU model: the calibration holds runs measured on it (the user's own take precedence);
- probed on this GPU model: no run calibrated it, but a probe of it did (``python -m ftbench probe-gpu``,
  experiment/probes.py): its own matmul, bandwidth, kernel and host figures, with the prior's interval (how well a
  probe carries over to training runs is unmeasured until a check on its runs measures it: calibration.PROBED_SD);
- datasheet only (uncalibrated): its datasheet peak and bandwidth with the calibrated models' efficiencies, and a
  wider interval (the calibration's ``transfer_sd``).
The interval is the calibration's residual spread for the GPU model, its GPU's and host's parts weighed by how much
of the run's step each sets, so it says how well runs like it were predicted, not how noisy the run itself will be;
a parameter no run of the calibration informs widens it by its prior width (calibration.py).
"""

from __future__ import annotations

import math

from ftbench.experiment import calibration as calibrations
from ftbench.experiment import memory_plan, step_time
from ftbench.runspec import RunSpec

BASES = {
    "measured": "measured here",
    "calibrated": "calibrated on this GPU model",
    "probed": "probed on this GPU model",
    "datasheet": "datasheet only (uncalibrated)",
}
HOST_BOUND_NOTE = ("host-bound: the GPU waits on the host's kernel launches, so on a faster host or with `compile` "
                   "this ordering may change")


def basis(gpu_name: str, calibration: calibrations.Calibration, measured: bool = False) -> str:
    """What a number for this GPU model rests on (``BASES``' key)."""
    if measured:
        return "measured"
    if calibration.calibrated(gpu_name):
        return "calibrated"
    return "probed" if calibration.is_probed(gpu_name) else "datasheet"


def predict_on(load: step_time.Workload, gpu: dict, calibration: calibrations.Calibration) -> dict | None:
    """One GPU's prediction for a workload: tokens/s and its 95% interval, the step's terms, the busy share and
    whether the run is host-bound there, what it rests on; None where the table lacks the GPU's figures."""
    terms = step_time.step_terms(load, gpu, calibration.params_for(gpu["name"]), calibration.combine)
    if terms is None:
        return None
    host_bound = terms["busy_share"] < calibrations.HOST_BOUND
    spread = calibration.interval_sd(load, gpu, terms) * calibrations.Z95
    rate = terms["tokens_per_s"]
    return {"gpu": gpu["name"], "tokens_per_s": rate, "tokens_per_s_low": rate * math.exp(-spread),
            "tokens_per_s_high": rate * math.exp(spread), "step_s": terms["step_s"], "busy_share": terms["busy_share"],
            "host_bound": host_bound, "mfu": terms["mfu"], "basis": basis(gpu["name"], calibration),
            "terms": {key: terms[key] for key in ("compute_s", "memory_s", "comm_s", "launch_s", "host_s")}}


def budget_tokens(budget: dict | None, load: step_time.Workload) -> float | None:
    """Real tokens of the experiment's budget: ``tokens`` x epochs, or ``samples`` x epochs x the predicted tokens
    per sample (report/projection.py's rule, with the predicted rather than the measured tokens per sample)."""
    if not budget:
        return None
    epochs = float(budget.get("epochs") or 1)
    if budget.get("tokens") is not None:
        return float(budget["tokens"]) * epochs
    if budget.get("samples") is not None:
        return float(budget["samples"]) * epochs * load.tokens_per_step / load.samples_per_step
    return None


def predict_run(run: RunSpec, gpus: list[dict], calibration: calibrations.Calibration,
                data_root=None, budget: dict | None = None) -> dict:
    """The run's prediction on every GPU of ``gpus``: {"workload", "note", "gpus": [per GPU: predict_on's figures
    plus the budget's train hours and their interval]}. No workload (a model not modelled): a note says why."""
    load, why_not = step_time.workload(run, memory_plan.data_dir_of(run, data_root))
    if load is None:
        return {"workload": None, "note": why_not, "gpus": []}
    tokens = budget_tokens(budget, load)
    rows = []
    for gpu in gpus:
        row = predict_on(load, gpu, calibration)
        if row is None:
            continue
        if tokens is not None:
            row.update(budget_tokens=tokens, hours=tokens / row["tokens_per_s"] / 3600,
                       hours_low=tokens / row["tokens_per_s_high"] / 3600, hours_high=tokens / row["tokens_per_s_low"] / 3600)
        rows.append(row)
    return {"workload": load, "note": "; ".join(load.notes) or None, "gpus": rows}


# Settings that change what a run measures or how long it runs, not how fast a step is: two runs that differ only
# in these are the same configuration for speed (a measured one stands for the other: "measured here").
NOT_SPEED = ("max_steps", "epochs", "seed", "repeat", "run_id", "config_id", "warmup_steps", "warmup_until_stable",
             "warmup_max_steps", "eval_batch_size", "max_eval_samples", "eval_every", "eval_subset", "stop_at_target",
             "eval_before_training", "gpu_sample_interval_s", "learning_rate", "lr_warmup_steps", "weight_decay",
             "target", "confirm_oom", "auto_batch_size", "auto_batch_size_max")


def speed_key(run: RunSpec) -> str:
    """The run's settings that set its step's speed, as one string: equal keys, equal configurations for speed."""
    defaults = RunSpec()
    return run.replace(**{name: getattr(defaults, name) for name in NOT_SPEED}).to_json()
