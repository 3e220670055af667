"""The cost of reaching a quality: when each run reached the experiment's target (``target: {metric, value}``),
and the configurations ranked by what that cost.

A run's evaluations (its evals.parquet: every eval_every steps on a fixed eval subset, then the final one on
the whole split) are a curve of the metric against the tokens trained. The target is reached where the
curve first gets there, linearly interpolated between the two evaluations that straddle it
(``crossing``); a run whose first evaluation already meets it reached it there. From the tokens:

- ``hours_to_target`` = tokens_to_target / the run's measured tokens/s (the measured window's rate, as the
  budget projection uses: evaluation time, which is kept off the clock, and warmup are not in it);
- ``gpu_hours_to_target`` = hours x billed devices, ``cost_to_target`` = hours x the run's $ per hour;
- ``train_s_to_target``: the run's own step seconds to the target (warmup included, evaluations not);
- ``cost_to_target_low`` / ``_high``: where the upper and the lower end of the evaluations' 95% intervals
  reach the target, at the same rate (inf when the lower end never does): the uncertainty of the crossing.

A run that never gets there has null figures and ``target_reached`` false. The budget projection
(projected_hours / projected_cost: a fixed amount of training at the measured rate) answers another question
than the cost to target (how much training this configuration needed to reach the quality); both are kept.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ftbench.report import analysis, uncertainty
from ftbench.report.analysis import is_missing
from ftbench.tasks.base import higher_is_better, reaches

# The columns add_to_target fills (documented in columns.py).
TARGET_COLUMNS = ("target_metric", "target_value", "target_reached", "tokens_to_target", "train_s_to_target",
                  "hours_to_target", "gpu_hours_to_target", "cost_to_target", "cost_to_target_low", "cost_to_target_high")
PROJECTION_VS_TARGET = ("The budget projection (projected hours and cost) prices a fixed amount of training at the measured "
                        "rate; the cost to target prices the training each configuration needed to reach the quality target. "
                        "They answer different questions, so both are shown.")


def crossing(xs: list[float], values: list[float], metric: str, target: float) -> float | None:
    """The x (tokens, seconds, ...) where the curve ``values`` over ascending ``xs`` first reaches ``target``:
    linear between the last point short of it and the first that reaches it; that point's x when it is the
    first; None when no point reaches it."""
    for i, value in enumerate(values):
        if not reaches(metric, value, target):
            continue
        if i == 0:
            return float(xs[0])
        before = values[i - 1]
        share = (target - before) / (value - before)  # in (0, 1]: before is short of the target, value reaches it
        return float(xs[i - 1] + share * (xs[i] - xs[i - 1]))
    return None


def run_to_target(evals: pd.DataFrame, target: dict, run: dict) -> dict:
    """The to-target figures of one run (``run``: its row, with tokens_per_s, price_per_hour, billed_devices)
    from its evaluation rows."""
    metric, value = target["metric"], float(target["value"])
    out = dict.fromkeys(TARGET_COLUMNS)
    out.update(target_metric=metric, target_value=value)
    rows = evals[evals["metric"] == metric].sort_values(["step", "evaluation"], kind="stable") if not evals.empty else evals
    if rows.empty:
        return out  # never evaluated on that figure: target_reached stays null
    tokens = rows["tokens"].astype(float).tolist()
    out["tokens_to_target"] = crossing(tokens, rows["value"].astype(float).tolist(), metric, value)
    out["target_reached"] = out["tokens_to_target"] is not None
    if not out["target_reached"]:
        return out
    out["train_s_to_target"] = crossing(rows["train_s"].astype(float).tolist(), rows["value"].astype(float).tolist(), metric, value)
    # The band's ends: the optimistic end reaches it first, the pessimistic end last (or never).
    optimistic, pessimistic = ("high", "low") if higher_is_better(metric) else ("low", "high")
    band = [crossing(tokens, rows[end].astype(float).fillna(rows["value"].astype(float)).tolist(), metric, value)
            for end in (optimistic, pessimistic)]
    rate, per_hour, devices = run.get("tokens_per_s"), run.get("price_per_hour"), run.get("billed_devices")
    if is_missing(rate) or not rate > 0:
        return out
    out["hours_to_target"] = out["tokens_to_target"] / rate / 3600.0
    if not is_missing(devices):
        out["gpu_hours_to_target"] = out["hours_to_target"] * devices
    if not is_missing(per_hour):
        out["cost_to_target"] = out["hours_to_target"] * per_hour
        out["cost_to_target_low"], out["cost_to_target_high"] = (
            math.inf if reach is None else reach / rate / 3600.0 * per_hour for reach in band)
    return out


def read_evals(paths: list[str | Path]) -> pd.DataFrame:
    """Every run's evals.parquet, with its run_id (the folder's name); runs without one are left out."""
    frames = []
    for path in map(Path, paths):
        if path.is_file():
            frame = pd.read_parquet(path)
            if not frame.empty:
                frames.append(frame.assign(run_id=path.parent.name))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["run_id", "metric", "step"])


def add_to_target(frame: pd.DataFrame, result_files: list[str | Path], target: dict | None) -> pd.DataFrame:
    """The run table (costs filled) with each run's to-target columns, from the evals.parquet beside each of
    its metrics.json; all null without a target."""
    frame = frame.copy()
    if not target:
        return frame
    evals = read_evals([Path(path).with_name("evals.parquet") for path in result_files])
    by_run = dict(tuple(evals.groupby("run_id"))) if not evals.empty else {}
    rows = [run_to_target(by_run.get(record["run_id"], evals.iloc[:0]), target,
                          {k: (None if is_missing(v) else v) for k, v in record.items()})
            for record in frame.to_dict("records")]
    values = pd.DataFrame(rows, columns=list(TARGET_COLUMNS), index=frame.index)
    for name in TARGET_COLUMNS:
        frame[name] = values[name]
    return frame


# ---------------------------------------------------------------------------------------------------
# The report: curves, configurations, the ranking by cost to target


def curves(runs: pd.DataFrame, evals: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """(one point per configuration and evaluation step: the median over its finished runs of the metric, its
    interval, and x = $ spent (or GPU-hours without a price) at the run's measured rate; the unit of x).
    The metric is the target's, or without a target each task's quality figure (analysis.QUALITY)."""
    done = runs[runs["status"].isin(["ok"]) & runs["tokens_per_s"].notna()]
    if evals.empty or done.empty:
        return pd.DataFrame(), None
    target = target_of(runs)
    wanted = done["task"].map(lambda task: target["metric"] if target else getattr(analysis.QUALITY.get(task), "column", None))
    points = evals.merge(done[["run_id", "config_key", "config_label", "method", "model", "dataset", "tokens_per_s",
                               "price_per_hour", "billed_devices"]].assign(wanted=wanted), on="run_id")
    points = points[points["metric"] == points["wanted"]]
    if points.empty:
        return pd.DataFrame(), None
    priced = points["price_per_hour"].notna().all()
    hours = points["tokens"].astype(float) / points["tokens_per_s"].astype(float) / 3600.0
    points["x"] = hours * points["price_per_hour" if priced else "billed_devices"].astype(float)
    keys = ["config_key", "config_label", "method", "model", "dataset", "metric", "step", "scope"]
    table = points.groupby(keys, as_index=False, dropna=False)[["x", "value", "low", "high"]].median()
    return table.sort_values(["config_key", "step", "scope"], ascending=[True, True, False]), "$" if priced else "GPU-hours"


def target_of(runs: pd.DataFrame) -> dict | None:
    """The experiment's target, as the run table recorded it (target_metric, target_value); None without one."""
    named = runs[runs["target_metric"].notna()] if "target_metric" in runs else runs.iloc[:0]
    if named.empty:
        return None
    return {"metric": str(named["target_metric"].iloc[0]), "value": float(named["target_value"].iloc[0])}


def configurations_to_target(configs: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The configurations (analysis.configurations) with, over their finished runs: ``reached`` (runs that
    reached the target), ``tokens_to_target``, ``gpu_hours_to_target``, ``cost_to_target`` (medians) and its 95%
    interval ``cost_to_target_low`` / ``_high``: the crossing's band, widened by the throughput interval."""
    configs = configs.copy()
    columns = {"reached": [], "tokens_to_target": [], "gpu_hours_to_target": [], "cost_to_target": [],
               "cost_to_target_low": [], "cost_to_target_high": []}
    for _, config in configs.iterrows():
        group = analysis.ok_runs(runs[runs["config_key"] == config["config_key"]])
        reached = group[group["target_reached"].eq(True).fillna(False)] if "target_reached" in group else group.iloc[:0]
        columns["reached"].append(len(reached) if target_of(runs) else None)
        for name in ("tokens_to_target", "gpu_hours_to_target", "cost_to_target", "cost_to_target_low", "cost_to_target_high"):
            values = reached[name].astype(float) if name in reached else pd.Series(dtype=float)
            # A run whose pessimistic end never reaches the target (inf) keeps the configuration's high end unbounded.
            columns[name].append(float(values.median()) if len(values) else math.nan)
        speed, low, high = (float(config[c]) for c in ("tokens_per_s", "tokens_per_s_low", "tokens_per_s_high"))
        if not math.isnan(low) and low > 0 and not math.isnan(high):
            columns["cost_to_target_low"][-1] *= speed / high  # cost = tokens / rate x price: a faster rate, a lower cost
            columns["cost_to_target_high"][-1] *= speed / low
    for name, values in columns.items():
        configs[name] = values
    return configs


def rank_to_target(configs: pd.DataFrame) -> dict:
    """The configurations that reached the target, cheapest first (by cost to target; by GPU-hours when none
    has a price), with ``tied``: whether its 95% interval overlaps the leader's (within noise, not ranked, as
    analysis.ranked); and those of the finished ones that never reached it."""
    finished = configs[configs["ok"] > 0]
    priced = finished["cost_to_target"].notna().any()
    column = "cost_to_target" if priced else "gpu_hours_to_target"
    reached = finished[finished[column].notna()].sort_values(column, kind="stable")
    if not reached.empty:
        def span(row):
            if not priced or is_missing(row["cost_to_target_low"]) or is_missing(row["cost_to_target_high"]):
                return (float(row[column]), float(row[column]))
            return (float(row["cost_to_target_low"]), float(row["cost_to_target_high"]))

        best = span(reached.iloc[0])
        reached = reached.assign(tied=[uncertainty.overlap(best, span(row)) for _, row in reached.iterrows()])
    never = finished[finished["reached"].eq(0)]["configuration"].tolist() if "reached" in finished else []
    return {"column": column, "basis": "cost" if priced else "GPU-hours", "ranked": reached, "never": never}
