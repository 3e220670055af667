"""What a full training run would take, projected from a run's measured window.

The budget is experiment-wide (config key ``budget``): ``tokens`` or ``samples``, times ``epochs``.
It is applied when results are collected, so changing it retrains nothing.
- tokens of the budget: tokens x epochs, or samples x epochs x the run's measured tokens per sample;
- projected_train_hours = budget tokens / measured tokens_per_s (global throughput of the run's devices);
- projected_eval_hours: what evaluation adds: the final evaluation (eval_time_s) and the evaluation before training
  (base_eval_time_s) once each, and with eval_every the subset evaluations between steps at their measured seconds
  each (eval_during_training_s / evaluations_during_training) x those the trainer schedules for the budget's steps
  (before every eval_every-th step, step 0's being the evaluation before training where there is one); the budget's
  steps are its tokens / the measured tokens per step;
- projected_overhead_hours: one job's start (process start to the first step: imports, data, model load, whose
  load_time_s is part of it) and end, as measured (overhead_s), less any wait for the workflow's warm process
  (warm_start_wait_s: a cost of the workflow's start that fell on whichever job came first, not of the
  configuration); checkpoint saves: none in the plan today;
- projected_hours = train + eval + overhead: the job's wall hours, what costs are billed on;
- projected_pflops = budget tokens x the run's analytic model FLOPs per token (scripts/ftbench/measure/flops.py).
A run without a measured window (oom, unsupported, ...) gets nulls; a missing eval or overhead figure counts 0.

Checked against reality (config/examples/projection-check.yaml, ``python -m ftbench projection-check``): the
same configuration run short and long; ``projection_check`` pairs them and puts the short run's projection of
the long run (same formula, for the long run's steps) beside the long run's measured job time.
"""

from __future__ import annotations

import math

import pandas as pd

PROJECTION_COLUMNS = ("projected_tokens", "projected_hours", "projected_pflops", "projected_train_hours",
                      "projected_eval_hours", "projected_overhead_hours")
# Settings that may differ between the short and the long run of one configuration (the rest must be equal).
LENGTH_SETTINGS = ("max_steps", "epochs", "seed", "repeat")


def _number(value) -> float | None:
    if value is None or value is pd.NA:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def budget_tokens(budget: dict | None, row: dict) -> float | None:
    if not budget:
        return None
    epochs = float(budget.get("epochs") or 1)
    if budget.get("tokens") is not None:
        return float(budget["tokens"]) * epochs
    tokens, samples = _number(row.get("tokens_per_s")), _number(row.get("samples_per_s"))
    if budget.get("samples") is not None and tokens and samples:
        return float(budget["samples"]) * epochs * tokens / samples
    return None


def project(row: dict, budget: dict | None) -> dict:
    tokens = budget_tokens(budget, row)
    rate = _number(row.get("tokens_per_s"))
    tflops = _number(row.get("tflops_per_s"))
    out = dict.fromkeys(PROJECTION_COLUMNS)
    if tokens is None or not rate:
        return out
    out["projected_tokens"] = tokens
    out["projected_train_hours"] = tokens / rate / 3600.0
    per_step = tokens_per_step(row)
    out["projected_eval_hours"] = eval_seconds(row, tokens / per_step if per_step else None) / 3600.0
    out["projected_overhead_hours"] = job_overhead_s(row) / 3600.0
    out["projected_hours"] = out["projected_train_hours"] + out["projected_eval_hours"] + out["projected_overhead_hours"]
    if tflops is not None:
        out["projected_pflops"] = tokens * (tflops * 1e12 / rate) / 1e15
    return out


def tokens_per_step(row: dict) -> float | None:
    """Real tokens of one optimizer step (all devices), over the measured window."""
    tokens, steps = _number(row.get("measured_tokens")), _number(row.get("measured_steps"))
    return tokens / steps if tokens and steps else None


def subset_evaluations(steps: float | None, eval_every, before_training: bool) -> int:
    """Subset evaluations between steps in a run of ``steps`` steps, as the trainer schedules them
    (train/evaluation.py, DuringTraining.due): before every step whose index is a multiple of eval_every below
    ``steps``, step 0's being the evaluation before training where the run has one."""
    every = _number(eval_every)
    if not every or not steps:
        return 0
    return max(0, math.ceil(steps / every) - (1 if before_training else 0))


def eval_seconds(row: dict, steps: float | None) -> float:
    """Evaluation seconds of a run of ``steps`` steps: its evaluation before training and its final one (each as long
    whatever the steps), and its subset evaluations between steps (eval_every) at their measured seconds each, as
    many as the trainer schedules for ``steps``."""
    once = (_number(row.get("base_eval_time_s")) or 0.0) + (_number(row.get("eval_time_s")) or 0.0)
    during, made = _number(row.get("eval_during_training_s")), _number(row.get("evaluations_during_training"))
    if not during or not made:
        return once
    before_training = _number(row.get("base_eval_time_s")) is not None
    return once + during / made * subset_evaluations(steps, row.get("eval_every"), before_training)


def job_seconds(row: dict, steps: float) -> float | None:
    """A run's job time (process start to end) for ``steps`` optimizer steps, projected from this run: its
    training loop (warmup included) plus the further steps at its measured window's rate, evaluation at its
    cadence, its overhead."""
    loop, total = _number(row.get("train_time_s")), _number(row.get("total_steps"))
    window, measured = _number(row.get("measured_time_s")), _number(row.get("measured_steps"))
    if loop is None or not total or not window or not measured:
        return None
    return loop + (steps - total) * window / measured + eval_seconds(row, steps) + job_overhead_s(row)


def measured_job_seconds(row: dict) -> float | None:
    """A run's measured job time, process start to end: overhead_s + train_time_s + eval_time_s + base_eval_time_s
    + eval_during_training_s (the evaluations before training and between steps, which train_time_s leaves out),
    less its wait for the warm process (as in the projection, so the two sides compare like with like)."""
    loop = _number(row.get("train_time_s"))
    if loop is None:
        return None
    evaluating = sum(_number(row.get(key)) or 0.0 for key in ("eval_time_s", "base_eval_time_s", "eval_during_training_s"))
    return loop + evaluating + job_overhead_s(row)


def job_overhead_s(row: dict) -> float:
    """The job's own start and end (overhead_s) without the time it waited for the workflow's warm process:
    on an H100 the first job of config/examples/projection-check.yaml spent 22.1 s outside its steps against
    3.5 s for the warm jobs after it (the difference: waiting for the warm process's imports), and a
    projection carrying that wait overstated a 400-step run's job time by 33%."""
    overhead = _number(row.get("overhead_s")) or 0.0
    return max(overhead - (_number(row.get("warm_start_wait_s")) or 0.0), 0.0)


def projection_check(frame: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """Pairs of runs of one configuration (every column of ``settings`` equal but LENGTH_SETTINGS) that ran
    different numbers of steps: the shortest run's projection of each longer one beside that run's measured
    job time, and their ratio (projected / measured)."""
    keys = [name for name in settings if name in frame.columns and name not in LENGTH_SETTINGS]
    ok = frame[frame["status"] == "ok"] if "status" in frame.columns else frame
    rows = []
    for _, group in ok.groupby([ok[key].astype("string").fillna("") for key in keys], sort=False):
        ordered = group.sort_values("total_steps").to_dict("records")
        short = ordered[0]
        for long in ordered[1:]:
            if long["total_steps"] == short["total_steps"]:
                continue
            projected, measured = job_seconds(short, float(long["total_steps"])), measured_job_seconds(long)
            rows.append({"short_run": short["run_id"], "long_run": long["run_id"], "short_steps": short["total_steps"],
                         "long_steps": long["total_steps"], "projected_long_s": projected, "measured_long_s": measured,
                         "ratio": projected / measured if projected and measured else None})
    return pd.DataFrame(rows, columns=["short_run", "long_run", "short_steps", "long_steps", "projected_long_s",
                                       "measured_long_s", "ratio"])


def add_projections(frame: pd.DataFrame, budgets: dict | list | None) -> pd.DataFrame:
    """Projection columns for every row; ``budgets`` is one budget for all rows or one per row."""
    rows = frame.to_dict("records")
    per_row = budgets if isinstance(budgets, list) else [budgets] * len(rows)
    projected = [project(row, budget) for row, budget in zip(rows, per_row)]
    frame = frame.copy()
    for column in PROJECTION_COLUMNS:
        frame[column] = [values[column] for values in projected]
    return frame
