"""The report's answer, before any detail: one row per configuration (its status, quality with its 95% interval,
tokens/s, $ per 1M tokens, cost to the quality target, the GPUs its memory estimate fits) and the
recommendation in one sentence.

The sentence ranks as the sections below it do: by cost to the target where the experiment has one and some
configuration reached it (quality_target.rank_to_target), else by $ per 1M training tokens (analysis.recommend;
tokens/s where nothing has a price), among the configurations that meet the experiment's ``recommend`` floor
and ceiling (analysis.meeting). Configurations whose 95% intervals overlap the cheapest's are named with it,
as a tie.
"""

from __future__ import annotations

import pandas as pd

from ftbench.experiment import memory_plan
from ftbench.measure import memory_estimate
from ftbench.report import analysis, pages, quality_target
from ftbench.report.analysis import is_missing
from ftbench.report.pages import fmt, money

# (column, header): the columns keep the run table's names, so a figure is written as everywhere else in the report.
COLUMNS = {"configuration": "configuration", "status": "status", "quality": "quality (95% interval)",
           "tokens_per_s": "tokens/s", "cost_per_1m_tokens": "$ per 1M tokens", "to_target": "cost to target",
           "fits_on": "fits on"}
TITLES = {
    "configuration": "runs that differ only in their repeat index share a configuration (the Configurations table has every figure)",
    "status": "how its runs ended: ok, or why not (the runs table gives each run's reason)",
    "quality": "median quality of its finished runs on the eval split (accuracy; token accuracy for language models; "
               "recall@1 for retrieval) with its 95% Wilson interval",
    "tokens_per_s": "real training tokens per second over the measured window (the median of repeats)",
    "cost_per_1m_tokens": "what a million training tokens processed (prompts included) cost at the measured rate and the "
                          "device's price; cost_per_1m_trained_tokens, in the runs table, divides by the tokens trained",
    "to_target": "$ of training until an evaluation reached the experiment's target (GPU-hours where there is no price), "
                 "with its 95% interval; 'not reached' when its finished runs never got there",
    "fits_on": "the GPUs of the GPU table its memory estimate fits with the estimate's error band to spare, smallest first "
               "(What fits gives every GPU's verdict)",
}


def section(configs: pd.DataFrame, runs: pd.DataFrame, gpus: list[dict], settings: dict) -> dict:
    """The headline: ``table`` (pages.Table, best first, unfinished configurations last), ``sentence`` (the
    recommendation: (text, bold) parts) and ``target`` (whether the experiment has a quality target)."""
    target = quality_target.target_of(runs)
    to_target = quality_target.configurations_to_target(configs, runs) if target else configs.assign(reached=None)
    rows = _ordered(to_target, target is not None)
    several_metrics = rows["quality_metric"].dropna().nunique() > 1
    statuses = runs.groupby("config_key", sort=False)["status"].agg(lambda s: s.astype(str).tolist())
    estimates = runs.groupby("config_key", sort=False)["memory_estimate_mb"].agg(lambda s: s.dropna().iloc[0] if s.notna().any() else None)
    sized = sorted((gpu for gpu in gpus if gpu.get("memory_gb")), key=memory_plan.capacity_mib)
    frame = rows.assign(
        status=[status_text(statuses.get(key, [])) for key in rows["config_key"]],
        quality=[quality_text(row, several_metrics) for _, row in rows.iterrows()],
        to_target=[target_text(row) for _, row in rows.iterrows()],
        to_target_sort=rows["cost_to_target"] if target and rows["cost_to_target"].notna().any() else rows.get("gpu_hours_to_target"),
        fits_on=[fits_text(estimates.get(key), sized) for key in rows["config_key"]],
        _status=[worst_status(statuses.get(key, [])) for key in rows["config_key"]],
    )
    columns = [c for c in COLUMNS if (c != "to_target" or target) and (c != "fits_on" or frame["fits_on"].notna().any())]
    table = pages.table(frame, columns, table_id="headline", titles=TITLES, headers=COLUMNS,
                        sort_by={"quality": "accuracy", "to_target": "to_target_sort"},
                        row_class=lambda row: f"status-{row['_status']}" if row["_status"] != "ok" else None)
    return {"table": table, "sentence": sentence(configs, runs, settings, target), "target": target is not None}


def _ordered(configs: pd.DataFrame, by_target: bool) -> pd.DataFrame:
    """Finished configurations first, cheapest first (to the target when there is one, then per 1M tokens; the
    fastest first where nothing has a price), then those with no finished run."""
    priced = configs["cost_per_1m_tokens"].notna().any()
    keys, ascending = (["cost_per_1m_tokens"], [True]) if priced else (["tokens_per_s"], [False])
    if by_target:
        keys, ascending = ["cost_to_target", "gpu_hours_to_target", *keys], [True, True, *ascending]
    configs = configs.assign(_unfinished=configs["ok"].eq(0))
    return configs.sort_values(["_unfinished", *keys], ascending=[True, *ascending], kind="stable", na_position="last")


def status_text(statuses: list[str]) -> str:
    """'ok', 'ok (3 runs)', '2 ok, 1 timeout': how a configuration's runs ended."""
    counts = pd.Series(statuses, dtype="string").fillna("unknown").value_counts()
    if len(counts) == 1:
        status, count = next(iter(counts.items()))
        return status if count == 1 else f"{status} ({count} runs)"
    return ", ".join(f"{count} {status}" for status, count in counts.items())


def worst_status(statuses: list[str]) -> str:
    """ok when a run finished, else the first run's status (the row's shading)."""
    return "ok" if "ok" in statuses else (statuses[0] if statuses else "unknown")


def quality_text(row: pd.Series, name_it: bool) -> str | None:
    """'0.760 (0.752-0.768)', the metric's name first when the table mixes tasks; None without a quality."""
    if is_missing(row["accuracy"]):
        return None
    low, high = row["accuracy_low"], row["accuracy_high"]
    text = f"{row['accuracy']:.3f}" + (f" ({low:.3f}\u2013{high:.3f})" if not is_missing(low) and not is_missing(high) else "")
    return f"{row['quality_metric']} {text}" if name_it and not is_missing(row["quality_metric"]) else text


def target_text(row: pd.Series) -> str | None:
    """The cost to the target with its interval ('$0.0031 ($0.0020-$0.0042)'), GPU-hours where there is no price,
    'not reached' for a finished configuration that never got there; None otherwise."""
    if not is_missing(row.get("cost_to_target")):
        low, high = row["cost_to_target_low"], row["cost_to_target_high"]
        span = "" if is_missing(low) or is_missing(high) else \
            f" ({money(low)}\u2013{money(high) if high != float('inf') else 'unbounded'})"
        return money(row["cost_to_target"]) + span
    if not is_missing(row.get("gpu_hours_to_target")):
        return f"{row['gpu_hours_to_target']:.3g} GPU-h"
    if row.get("reached") == 0 and row["ok"] > 0:
        return "not reached"
    return None


def fits_text(estimate, gpus: list[dict]) -> str | None:
    """Which GPUs (``gpus``: ascending capacity) the estimate fits: 'all 11', 'L40S 48 GB and up (6 of 11)',
    'none of 11', with the borderline ones; None without an estimate or a GPU table."""
    if is_missing(estimate) or not gpus:
        return None
    verdicts = [memory_estimate.fit(float(estimate), memory_plan.capacity_mib(gpu)) for gpu in gpus]
    fitting = [gpu for gpu, verdict in zip(gpus, verdicts) if verdict == "yes"]
    borderline = [gpu["name"] for gpu, verdict in zip(gpus, verdicts) if verdict == "borderline"]
    if len(fitting) == len(gpus):
        text = f"all {len(gpus)}"
    elif not fitting:
        text = f"none of {len(gpus)}"
    else:
        # The verdict only grows with capacity: the smallest GPU it fits says which.
        text = f"{fitting[0]['name']} {fitting[0]['memory_gb']:g} GB and up ({len(fitting)} of {len(gpus)})"
    return f"{text}; borderline: {', '.join(borderline)}" if borderline else text


# ---------------------------------------------------------------------------------------------------
# The recommendation in one sentence


def sentence(configs: pd.DataFrame, runs: pd.DataFrame, settings: dict, target: dict | None) -> list[tuple[str, bool]]:
    """The recommendation as (text, bold) parts of one sentence (see the module's docstring)."""
    min_accuracy, max_memory = settings.get("min_accuracy"), settings.get("max_memory_mb")
    done = configs[configs["ok"] > 0]
    if done.empty:
        return [("No configuration finished, so there is nothing to recommend; each run's status and reason are in the "
                 "runs table.", False)]
    eligible = analysis.meeting(done, min_accuracy, max_memory)
    among = _condition(min_accuracy, max_memory)
    if eligible.empty:
        closest = [f"the best accuracy was {done['accuracy'].max():.3f}" if done["accuracy"].notna().any() else None,
                   f"the smallest peak memory {fmt(done['peak_memory_mb'].min())} MiB" if done["peak_memory_mb"].notna().any() else None]
        closest = ", ".join(part for part in closest if part)
        return [(f"No finished configuration has {among}, so none is recommended{f' ({closest})' if closest else ''}.", False)]
    suffix = f", among those with {among}" if among else ""
    if target:
        ranked = quality_target.rank_to_target(quality_target.configurations_to_target(eligible, runs))["ranked"]
        if not ranked.empty:
            return _named(ranked[ranked["tied"]], f"the cheapest to reach {target['metric']} {target['value']:g}",
                          _to_target_figure, suffix)
        suffix += f"; {'none of them' if among else 'no configuration'} reached the target {target['metric']} {target['value']:g}"
    if eligible["cost_per_1m_tokens"].notna().any():
        order = analysis.ranked(eligible, "cost_per_1m_tokens", False)
        return _named(order[order["tied"]], "the cheapest per 1M training tokens",
                      lambda row, spans: money(row["cost_per_1m_tokens"]) + (_span(row, "cost_low", "cost_high", money) if spans else ""),
                      suffix)
    order = analysis.ranked(eligible, "tokens_per_s", True)
    return _named(order[order["tied"]], "the fastest", lambda row, spans: f"{fmt(row['tokens_per_s'])} tokens/s",
                  f"{suffix} (no configuration has a price)")


def _to_target_figure(row: pd.Series, spans: bool) -> str:
    """The cost to the target (GPU-hours without a price), with its interval where ``spans``."""
    if not is_missing(row.get("cost_to_target")):
        return money(row["cost_to_target"]) + (_span(row, "cost_to_target_low", "cost_to_target_high", money) if spans else "")
    return f"{row['gpu_hours_to_target']:.3g} GPU-hours"


def _span(row: pd.Series, low: str, high: str, write) -> str:
    """', 95% interval $a-$b' (the figure's interval, written as the figure), or '' without one."""
    if is_missing(row.get(low)) or is_missing(row.get(high)):
        return ""
    return f", 95% interval {write(row[low])}\u2013{write(row[high]) if row[high] != float('inf') else 'unbounded'}"


def _named(leaders: pd.DataFrame, what: str, figure, suffix: str) -> list[tuple[str, bool]]:
    """'Recommended: X, <what> (figure)<suffix>.', or for a tie every configuration in it, named as a tie."""
    names = leaders["configuration"].tolist()
    # ``figure(row, spans)``: a tie names each figure without its interval (the table above has them).
    figures = [figure(row, len(names) == 1) for _, row in leaders.iterrows()]
    if len(names) == 1:
        return [("Recommended: ", False), (names[0], True), (f", {what} ({figures[0]}){suffix}.", False)]
    parts: list[tuple[str, bool]] = [("Recommended: any of ", False)]
    for index, (name, value) in enumerate(zip(names, figures)):
        parts += [(name, True), (f" ({value})" + (", " if index < len(names) - 1 else ""), False)]
    return parts + [(f" \u2014 {what}{suffix}, within noise of each other (their 95% intervals overlap), so none is "
                     "ranked above the others.", False)]


def _condition(min_accuracy, max_memory) -> str:
    parts = ([f"accuracy \u2265 {min_accuracy:g}"] if min_accuracy is not None else []) + \
            ([f"peak memory \u2264 {max_memory:,.0f} MiB"] if max_memory is not None else [])
    return " and ".join(parts)
