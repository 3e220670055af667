"""The run table's analysis, for the figures, the report and compare: no drawing, no HTML.

A *configuration* is what the repeats of one setting share: the run's ``config_id`` (its settings
without repeat index and seed, hashed with the model's and dataset's definitions). Runs of one
configuration on different device models are kept apart (``config_key``). Result sets from different
machines are matched by their settings columns instead (``across_machines``): config_id's hash also
covers what differs between machines without changing the run, such as a model's local path or the
ftbench spec version. Its readable label is made of the settings that tell the configurations apart.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ftbench.measure import gpu_table as gpu_tables
from ftbench.report import uncertainty
from ftbench.report.columns import SPEC_COLUMNS
from ftbench.errors import FtbenchError

METHOD_ORDER = ["full", "lora", "qlora"]
# The settings columns of a configuration: the run's settings without its repeat index and seed.
CONFIG_COLUMNS = [c for c in SPEC_COLUMNS if c not in ("repeat", "seed")]
# A configuration whose repeats vary more than this (coefficient of variation of tokens/s) is unstable.
CV_THRESHOLD = 0.05
# A run is unstable when its window-mean tokens/s and the median-based figure (tokens per measured step
# / median step time) differ by more than this: a stretch of slow (or fast) steps moved the mean...
MEAN_MEDIAN_THRESHOLD = 0.03
# ...or when the median step time of the window's second half differs from the first half's by more
# than this: the process sped up or slowed down while it was measured (thermal, contention, caches).
DRIFT_THRESHOLD = 0.05
# Statuses whose measured window is a throughput: a finished run, and a run stopped by its time limit
# after measuring steps (those steps ran normally; only the run was cut short). An oom, diverged,
# unsupported or failed run's steps are not the configuration's speed.
MEASURED_STATUSES = ["ok", "timeout"]
# How a configuration's repeats become one figure: the median, or MLPerf's mean without the fastest
# and the slowest repeat (from three repeats; fewer fall back to the median).
REPEAT_SCORING = {"median": "median of repeats",
                  "trimmed_mean": "mean of repeats without the fastest and the slowest (median below three)"}
# The data_kind of random-token data: its accuracy measures nothing, so no quality figure is shown.
SYNTHETIC = "synthetic"


def is_missing(value) -> bool:
    """True for None, pandas' NA and NaN; False for any other value (strings and lists included)."""
    if value is None or value is pd.NA:
        return True
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):  # lists and other containers: a value, not a missing one
        return False


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that finished (status ok); a null status is not ok."""
    return runs[runs["status"].isin(["ok"])]


def measured_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs whose throughput counts: finished or timed out (MEASURED_STATUSES) with a measured tokens/s."""
    return runs[runs["status"].isin(MEASURED_STATUSES) & runs["tokens_per_s"].notna()]


def unmeasured_counts(runs: pd.DataFrame) -> dict[str, int]:
    """{status: runs} of the runs left out of the throughput figures (no valid measured window)."""
    left = runs[~runs.index.isin(measured_runs(runs).index)]
    return left["status"].astype("string").fillna("no status").value_counts().sort_index().to_dict()


def method_order(methods) -> list[str]:
    """The methods present, in the order full, lora, qlora, then any other alphabetically."""
    present = set(pd.Series(methods).dropna())
    return [m for m in METHOD_ORDER if m in present] + sorted(present - set(METHOD_ORDER))


# ---------------------------------------------------------------------------------------------------
# Configurations and their labels


def short_device(name) -> str:
    """A device's name without the vendor's prefix: 'NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3'."""
    if not isinstance(name, str) or not name:
        return "?"
    return re.sub(r"^(NVIDIA|Tesla)\s+", "", name).replace("GeForce ", "").strip()


def strip_id(ids: pd.Series) -> pd.Series:
    """A run or config id without its hash (and repeat) suffix: the readable part."""
    return ids.astype(str).str.replace(r"(-rep\d+)?-[0-9a-f]{8}$", "", regex=True)


def shorten(labels: pd.Series) -> pd.Series:
    """Drop the name parts every label shares (the one model, dataset, precision, ...): what is left is
    what tells the configurations apart. Labels are kept whole when that would leave one empty."""
    if len(labels.unique()) < 2:
        return labels
    parts = labels.str.split("-")
    common = set.intersection(*(set(p) for p in parts))
    short = parts.map(lambda p: "-".join(x for x in p if x not in common))
    return labels if (short == "").any() else short


def common_parts(runs: pd.DataFrame) -> str:
    """The name parts all configurations share (what shorten() dropped from their labels)."""
    parts = strip_id(runs["run_id"]).str.split("-")
    if parts.empty or len(set(map(tuple, parts))) < 2:
        return ""
    common = set.intersection(*(set(p) for p in parts))
    return " ".join(x for x in parts.iloc[0] if x in common)


def short_hash(keys: pd.Series) -> pd.Series:
    """Each key's first 8 hex digits of sha256: a short, stable id (a configuration's, a scaling series')."""
    return keys.map(lambda key: hashlib.sha256(key.encode()).hexdigest()[:8])


def settings_key(columns: pd.DataFrame) -> pd.Series:
    """Each row's values as one string: a key for the settings in ``columns``."""
    rows = columns.astype("string").fillna("-").itertuples(index=False)
    return pd.Series(["|".join(row) for row in rows], index=columns.index, dtype=object)


def unique_labels(labels: pd.Series, keys: pd.Series) -> pd.Series:
    """Labels with the key's first characters added where one label would name several keys."""
    keys_per_label = keys.groupby(labels).transform("nunique")
    return labels.where(keys_per_label == 1, labels + " [" + keys.str[:4] + "]")


def prepare(runs: pd.DataFrame, across_machines: bool = False, gpu_table: list[dict] | None = None) -> pd.DataFrame:
    """The run table (with the documented columns: collect.typed) plus, per run:

    - ``config``: its configuration (see the module's docstring), the same on every device model;
    - ``config_key``: the configuration on its device model (repeats share it);
    - ``config_name``: readable, unique per configuration; ``config_label``: the name with its device
      when the table has several device models, unique per config_key;
    - ``quality``, ``quality_metric``, ``quality_n``, ``quality_low``, ``quality_high``: the figure that
      judges it for its task, the figure's name, the n of its 95% Wilson interval and the interval
      (see QUALITY); runs on synthetic data have none, and their eval figures are blanked;
    - ``base_quality``: the same figure of the model before training (eval_before_training), null without it;
    - ``device_memory_mb``: its device's memory (gpu_table.capacity_mb), null when unknown.
    """
    runs = runs.copy().reset_index(drop=True)
    synthetic = runs["data_kind"].eq(SYNTHETIC).fillna(False).astype(bool)
    runs.loc[synthetic, [column for column in QUALITY_COLUMNS if column in runs]] = pd.NA
    has_config_id = runs["config_id"].notna().all()  # tables written before config_id existed have none
    identity = runs["config_id"].astype(str) if has_config_id and not across_machines else settings_key(runs[CONFIG_COLUMNS])
    readable = strip_id(runs["config_id"] if has_config_id else runs["run_id"])
    device = runs["device_name"].astype("string").fillna("-")
    runs["config"] = short_hash(identity)
    runs["config_key"] = short_hash(identity + "|" + device)
    name = shorten(readable)
    runs["config_name"] = unique_labels(name, runs["config"])
    if device[device != "-"].nunique() > 1:
        name = name + " @ " + runs["device_name"].map(short_device)
    runs["config_label"] = unique_labels(name, runs["config_key"])
    runs["quality"], _ = quality_column(runs)
    runs["base_quality"], _ = quality_column(runs, BASE)
    judged = [quality_of(runs, i) for i in runs.index]
    runs["quality_metric"] = pd.array([q.name if q else pd.NA for q in judged], dtype="string")
    runs["quality_metric"] = runs["quality_metric"].where(runs["quality"].notna())
    runs["quality_n"] = pd.array([runs.at[i, q.n_column] if q and q.n_column in runs else pd.NA
                                  for i, q in zip(runs.index, judged)], dtype="Int64")
    runs["quality_low"], runs["quality_high"] = _wilson_columns(runs["quality"], runs["quality_n"])
    runs["device_memory_mb"] = pd.array([gpu_tables.capacity_mb(d, gpu_table or []) for d in runs["device_name"]], dtype="Float64")
    return runs


@dataclass(frozen=True)
class Quality:
    """The figure that judges a task's runs: its column (higher is better, in [0, 1]), its name, the
    column of the count its Wilson interval is computed on and what that count counts."""

    column: str
    name: str
    n_column: str = "eval_samples"
    n_note: str = "eval rows"


# The scored-token count is not recorded, and the tokens of one sequence are not independent: the
# sequence count is the cautious n (a wider interval than the token count would give).
_TOKEN_ACCURACY = Quality("eval_token_accuracy", "token accuracy", n_note="eval sequences")
# One entry per task kind: a new task adds its line here.
QUALITY: dict[str, Quality] = {
    "classification": Quality("eval_accuracy", "accuracy"),
    "image_classification": Quality("eval_accuracy", "accuracy"),
    # The mean of image->text and text->image recall@1 over the eval rows (retrieval.py).
    "image_text_retrieval": Quality("eval_recall_at_1", "recall@1"),
    "causal_lm": _TOKEN_ACCURACY,
    "seq2seq": _TOKEN_ACCURACY,
    "vision_language": Quality("eval_token_accuracy", "answer token accuracy", n_note="eval answers"),
    # Generated answers scored against the references (tasks/generation.py), on the prompts answered.
    "instruction": Quality("eval_generation_score", "answer score", n_column="eval_generation_rows",
                           n_note="prompts answered"),
}
# Tasks whose figure in QUALITY a run may not have (instruction data scores generated answers only where its
# answer_metric asks for them): the figure that judges such a run instead.
QUALITY_WITHOUT: dict[str, Quality] = {"instruction": Quality("eval_token_accuracy", "completion token accuracy",
                                                              n_note="eval sequences")}
# Every figure that may judge a run (a report's quality columns, one per name).
QUALITIES = (*QUALITY.values(), *QUALITY_WITHOUT.values())
# The prefix of an eval figure of the model before training (eval_before_training): base_eval_accuracy, ...
BASE = "base_"


def quality_of(runs: pd.DataFrame, index) -> Quality | None:
    """The figure that judges run ``index``: its task's QUALITY, or QUALITY_WITHOUT's where the run has no value of
    that (its base figure follows the same choice, so the two compare like with like)."""
    task = runs.at[index, "task"]
    quality = QUALITY.get(task)
    fallback = QUALITY_WITHOUT.get(task)
    if quality is not None and fallback is not None and (quality.column not in runs
                                                         or is_missing(runs.at[index, quality.column])):
        return fallback
    return quality
# The eval figures hidden for synthetic data (perplexity too: random tokens have no language to model), as trained
# and as built.
_SCORED = ("eval_accuracy", "eval_token_accuracy", "eval_perplexity", "eval_recall_at_1_i2t", "eval_recall_at_1_t2i",
           "eval_recall_at_1", "eval_generation_score")
QUALITY_COLUMNS = (*_SCORED, *(BASE + column for column in _SCORED))


def quality_column(runs: pd.DataFrame, prefix: str = "") -> tuple[pd.Series, str]:
    """(each run's quality: the figure QUALITY names for its task, null for a task it has no entry for;
    the axis name: 'eval <name>', or each name with its tasks when the runs mix them). ``prefix`` BASE: the
    same figure of the model before training (null where the table has no such column)."""
    judged = {i: quality_of(runs, i) for i in runs.index}
    values = pd.Series([runs.at[i, prefix + q.column] if q and prefix + q.column in runs else pd.NA
                        for i, q in judged.items()], index=runs.index, dtype="Float64")
    present = {(judged[i].name, runs.at[i, "task"]) for i in values.index[values.notna()]}
    tasks = list(dict.fromkeys([*QUALITY, *QUALITY_WITHOUT]))
    tasks_by_name = {name: [t for t in tasks if (name, t) in present] for name in dict.fromkeys(q.name for q in QUALITIES)}
    tasks_by_name = {name: named for name, named in tasks_by_name.items() if named}
    if len(tasks_by_name) > 1:
        return values, "eval " + " / ".join(f"{name} ({', '.join(tasks)})" for name, tasks in tasks_by_name.items())
    return values, f"eval {next(iter(tasks_by_name), 'accuracy')}"


def _wilson_columns(values: pd.Series, n: pd.Series) -> tuple[pd.Series, pd.Series]:
    """The 95% Wilson interval of each value on its n (null where either is missing)."""
    bounds = [uncertainty.wilson(float(v), int(k)) if not is_missing(v) and not is_missing(k) and k > 0 else (math.nan, math.nan)
              for v, k in zip(values, n)]
    low, high = zip(*bounds) if bounds else ((), ())
    return (pd.Series(low, index=values.index, dtype="Float64"), pd.Series(high, index=values.index, dtype="Float64"))


def run_labels(runs: pd.DataFrame) -> pd.Series:
    """A label per run (indexed by run_id): its configuration's, with ``#repeat`` where the configuration
    has several runs."""
    repeats = runs.groupby("config_key")["run_id"].transform("size")
    labels = runs["config_label"].where(repeats == 1, runs["config_label"] + " #" + runs["repeat"].astype("string").fillna("?"))
    return pd.Series(labels.to_numpy(), index=runs["run_id"])


PANEL = "panel"  # the column faceted() adds when each (model, dataset) pair with runs gets a panel of its own
PANELS_PER_ROW = 2


def faceted(frame: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """How a per-configuration figure splits into panels: (the frame to draw, seaborn's facet arguments).
    A column per model and a row per dataset where the table has several (accuracy and cost compare within
    one model and dataset). Where most cells of that grid would be empty (each model trained on its own
    dataset, as in a mixed text and image experiment), one panel per (model, dataset) pair that has runs,
    titled with both and wrapped, instead of a grid of empty panels."""
    models, datasets = frame["model"].nunique(), frame["dataset"].nunique()
    pairs = frame[["model", "dataset"]].drop_duplicates()
    if models > 1 and datasets > 1 and len(pairs) <= max(models, datasets):
        frame = frame.assign(**{PANEL: frame["model"].astype(str) + " on " + frame["dataset"].astype(str)})
        return frame, {"col": PANEL, "col_wrap": min(PANELS_PER_ROW, len(pairs))}
    return frame, {"col": "model" if models > 1 else None, "row": "dataset" if datasets > 1 else None}


def panel_columns(layout: dict) -> list[str]:
    """The columns that tell the panels of ``layout`` (faceted's) apart."""
    return [layout[key] for key in ("col", "row") if layout.get(key)]


# ---------------------------------------------------------------------------------------------------
# Each run's measured window, from its steps: interval and stability


def window_figures(steps: pd.DataFrame) -> dict:
    """One run's measured steps (step_time_s, tokens) -> its window's 95% interval of tokens/s (ratio
    interval over the steps) relative to the window mean, the median-based tokens/s relative to it,
    the drift (second half's median step time over the first half's, minus 1), and whether it is unstable
    with the reason. Relative figures, so they apply to the table's tokens/s whatever the steps count
    (one process or all)."""
    times = steps["step_time_s"].astype(float).to_numpy()
    tokens = steps["tokens"].astype(float).to_numpy()
    if len(times) == 1 and times.sum() > 0 and tokens.sum() > 0:
        # A rate from one step (a run stopped at its target, or cut short, right after warmup): no interval, no
        # stability to judge, and nothing to say the step was typical. The row and the report say so.
        return {"window_steps": 1, "unstable": True, "unstable_reason": TOO_SHORT_REASON}
    if len(times) < 2 or times.sum() <= 0 or tokens.sum() <= 0:
        return {"window_steps": len(times)}
    ratio, low, high = uncertainty.ratio_interval(list(tokens), list(times))
    # window mean = sum(tokens) / sum(times); median-based = mean(tokens) / median(time); their ratio, window
    # mean / median-based, is median(time) / mean(time) whatever the tokens per step. Negative: the mean is below.
    mean_vs_median = (np.median(times) / times.mean()) - 1
    half = len(times) // 2
    drift = float(np.median(times[-half:]) / np.median(times[:half]) - 1) if half >= 2 else math.nan
    reasons = []
    if abs(mean_vs_median) > MEAN_MEDIAN_THRESHOLD:
        reasons.append(f"window-mean tokens/s {abs(mean_vs_median):.1%} {'below' if mean_vs_median < 0 else 'above'} "
                       f"the median-based figure (a stretch of {'slow' if mean_vs_median < 0 else 'fast'} steps)")
    if not math.isnan(drift) and abs(drift) > DRIFT_THRESHOLD:
        reasons.append(f"step time {'rose' if drift > 0 else 'fell'} {abs(drift):.1%} from the window's first half to its second")
    return {"window_steps": len(times), "low_ratio": low / ratio, "high_ratio": high / ratio,
            "mean_vs_median": float(mean_vs_median), "drift": drift, "unstable": bool(reasons),
            "unstable_reason": "; ".join(reasons) or None}


TOO_SHORT_REASON = ("one measured step: too short to measure a rate (stopped at its target or cut short right after "
                    "warmup), so its tokens/s and costs rest on that one step, with no interval")
WINDOW_COLUMNS = ["window_steps", "low_ratio", "high_ratio", "mean_vs_median", "drift", "unstable", "unstable_reason"]
# The figures each run's window gives (add_step_figures) that collect stores in the table (columns.py): a run
# without steps (a result set compared without them) keeps what collect computed from its steps.
STORED_WINDOW_FIGURES = ("tokens_per_s_low", "tokens_per_s_high", "tokens_per_s_median_based", "unstable", "unstable_reason")
# Per run, the figures that scale as 1 / throughput and their interval's columns (from the throughput interval).
RUN_PER_THROUGHPUT = {"cost_per_1m_tokens": ("cost_per_1m_tokens_low", "cost_per_1m_tokens_high"),
                      "projected_cost": ("projected_cost_low", "projected_cost_high")}
# What the report computes per run and collect writes into metrics.parquet, both through run_figures'
# functions (prepare's quality, add_step_figures' window): the same numbers in the table and the report.
RUN_FIGURES = ("quality_metric", "quality", "quality_low", "quality_high", "base_quality", *STORED_WINDOW_FIGURES,
               *(column for pair in RUN_PER_THROUGHPUT.values() for column in pair))


def _window_table(runs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """window_figures of each measured run (measured_runs) that has measured steps, indexed like ``runs``."""
    figures = {}
    if not steps.empty and "measured" in steps:
        window = steps[steps["measured"].astype(bool) & steps["run_id"].isin(measured_runs(runs)["run_id"])]
        figures = {run_id: window_figures(group) for run_id, group in window.groupby("run_id", sort=False)}
    table = pd.DataFrame.from_dict(figures, orient="index").reindex(index=runs["run_id"], columns=WINDOW_COLUMNS)
    return table.set_axis(runs.index)


def add_step_figures(runs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Prepared runs plus, for each measured run (measured_runs) with per-step records, the figures of
    its window (window_figures): ``tokens_per_s_low``/``_high`` (its 95% within-run interval: the
    measurement noise of that process, not run-to-run variation), ``tokens_per_s_median_based``,
    ``mean_vs_median``, ``drift``, ``unstable`` and ``unstable_reason``; and the intervals of its cost
    figures (RUN_PER_THROUGHPUT) from the throughput interval. Null where there are no steps, except the
    STORED_WINDOW_FIGURES a table from collect already holds (computed there by this function)."""
    runs = runs.copy()
    table = _window_table(runs, steps)
    speed = runs["tokens_per_s"].astype(float).to_numpy()
    ratios = table[["low_ratio", "high_ratio", "mean_vs_median", "drift"]].astype(float).to_numpy().T
    fresh = {
        "tokens_per_s_low": pd.array(speed * ratios[0], dtype="Float64"),
        "tokens_per_s_high": pd.array(speed * ratios[1], dtype="Float64"),
        # mean_vs_median = window mean / median-based - 1, so the median-based figure is the window mean / (1 + it)
        "tokens_per_s_median_based": pd.array(speed / (1 + ratios[2]), dtype="Float64"),
        "unstable": pd.array(table["unstable"].to_numpy(), dtype="boolean"),
        "unstable_reason": pd.array(table["unstable_reason"].to_numpy(), dtype="string"),
    }
    has_window = table["low_ratio"].notna().to_numpy()
    judged = table["unstable"].notna().to_numpy()  # a one-step window is judged (too short) without an interval
    for column, values in fresh.items():
        values = pd.Series(values, index=runs.index)
        fresh_here = judged if column in ("unstable", "unstable_reason") else has_window
        runs[column] = values.where(fresh_here, runs[column].astype(values.dtype)) if column in runs else values
    runs["window_steps"] = pd.array(table["window_steps"].to_numpy(), dtype="Int64")
    runs["mean_vs_median"] = pd.array(ratios[2], dtype="Float64")
    runs["drift"] = pd.array(ratios[3], dtype="Float64")
    return add_cost_intervals(runs)


def add_cost_intervals(runs: pd.DataFrame) -> pd.DataFrame:
    """Each run's RUN_PER_THROUGHPUT intervals from its throughput interval: cost = price / throughput, so
    the throughput interval's high end gives the cost's low end (an interval reaching 0 tokens/s leaves
    the cost unbounded)."""
    speed = runs["tokens_per_s"].astype(float)
    low, high = runs["tokens_per_s_low"].astype(float), runs["tokens_per_s_high"].astype(float)
    for column, (low_column, high_column) in RUN_PER_THROUGHPUT.items():
        value = runs[column].astype(float)
        runs[low_column] = pd.array(value * speed / high.where(high > 0), dtype="Float64")
        unbounded = (low <= 0) & value.notna() & speed.notna()
        runs[high_column] = pd.array((value * speed / low.where(low > 0)).mask(unbounded, math.inf), dtype="Float64")
    return runs


def run_figures(table: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """The RUN_FIGURES of each row of a run table (collect's, costs included) from its rows and its runs'
    steps (read_steps): what the report shows per run, for collect to store. Indexed like ``table``."""
    figured = add_step_figures(prepare(table), steps)
    return figured[list(RUN_FIGURES)].set_axis(table.index)


STEP_COLUMNS = ["run_id", "step", "measured", "step_time_s", "tokens", "loss"]


def read_steps(step_files: list[str | Path]) -> pd.DataFrame:
    """The per-step records of the runs (results/runs/<run_id>/steps.parquet: the run_id is the folder's
    name) in one table; files that do not exist are skipped."""
    frames = []
    for path in map(Path, step_files):
        if path.is_file():
            frame = pd.read_parquet(path)
            frame["run_id"] = path.parent.name
            frames.append(frame)
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=STEP_COLUMNS)


# ---------------------------------------------------------------------------------------------------
# Configurations: repeats scored, with their intervals


CONFIG_SUMMARY_COLUMNS = [
    "configuration", "config_key", "method", "model", "dataset", "runs", "ok", "measured",
    "tokens_per_s", "tokens_per_s_low", "tokens_per_s_high", "interval_basis", "tokens_per_s_iqr", "tokens_per_s_cv",
    "unstable", "unstable_runs", "cost_per_1m_tokens", "cost_low", "cost_high",
    "accuracy", "accuracy_low", "accuracy_high", "quality_metric", "quality_n", "base_accuracy", "majority_rate",
    "eval_loss", "base_eval_loss", "eval_perplexity", "base_eval_perplexity",
    "peak_memory_mb", "peak_memory_allocated_mb", "peak_memory_reserved_mb", "peak_rss_mb", "memory_estimate_mb",
    "projected_hours", "projected_cost", "projected_cost_low", "projected_cost_high",
]
# A language model's eval loss and perplexity, as trained and as built (medians over the finished runs).
LOSS_FIGURES = ("eval_loss", "base_eval_loss", "eval_perplexity", "base_eval_perplexity")
# The configuration figures that scale as 1 / throughput (the same price and budget at another speed).
PER_THROUGHPUT = {"cost_per_1m_tokens": ("cost_low", "cost_high"), "projected_cost": ("projected_cost_low", "projected_cost_high")}


def score(values: pd.Series, scoring: str = "median") -> float:
    """A configuration's figure from its repeats: the median, or (``trimmed_mean``, three repeats or
    more) the mean without the highest and the lowest. NaN when there is none."""
    if scoring not in REPEAT_SCORING:
        raise FtbenchError(f"repeat scoring {scoring!r}: expected one of {', '.join(REPEAT_SCORING)}")
    values = values.dropna().astype(float)
    if values.empty:
        return math.nan
    if scoring == "trimmed_mean" and len(values) >= 3:
        return uncertainty.trimmed_mean(list(values))
    return float(values.median())


def throughput_interval(measured: pd.DataFrame) -> tuple[float, float, str | None]:
    """(low, high, basis) of a configuration's tokens/s from its measured runs: with three repeats or
    more the Student-t interval of their mean (run-to-run variation); with fewer, the span of the
    runs' within-run intervals (add_step_figures; measurement noise only). NaN without either."""
    speeds = measured["tokens_per_s"].dropna().astype(float)
    if len(speeds) >= 3:
        _, low, high = uncertainty.mean_interval(list(speeds))
        return max(low, 0.0), high, f"repeats: t-interval of the mean of {len(speeds)}"
    if "tokens_per_s_low" in measured and len(speeds) and measured["tokens_per_s_low"].notna().all():
        runs = f"{len(speeds)} run{'s' if len(speeds) > 1 else ''}"
        return float(measured["tokens_per_s_low"].min()), float(measured["tokens_per_s_high"].max()), f"within-run ({runs})"
    return math.nan, math.nan, None


def configurations(runs: pd.DataFrame, scoring: str = "median") -> pd.DataFrame:
    """One row per configuration: its runs, how many finished and how many measured a throughput
    (measured_runs: timed-out runs count), their tokens/s, cost and projections scored over the measured
    repeats (``scoring``: see score) with 95% intervals, IQR, CV, how many runs are unstable (when
    add_step_figures ran), and the median quality with its Wilson interval and peak memories."""
    rows = []
    for key, group in runs.groupby("config_key", sort=False):
        ok, measured = ok_runs(group), measured_runs(group)
        speed = measured["tokens_per_s"].dropna().astype(float)
        cv = speed.std(ddof=1) / speed.mean() if len(speed) > 1 and speed.mean() > 0 else math.nan
        tokens_per_s = score(speed, scoring)
        low, high, basis = throughput_interval(measured)
        accuracy, n = _median(ok, "quality"), _median(ok, "quality_n")
        accuracy_low, accuracy_high = (uncertainty.wilson(accuracy, int(n)) if not math.isnan(accuracy) and n > 0
                                       else (math.nan, math.nan))
        row = {
            "configuration": group["config_label"].iloc[0],
            "config_key": key,
            "method": group["method"].iloc[0],
            "model": group["model"].iloc[0],
            "dataset": group["dataset"].iloc[0],
            "runs": len(group),
            "ok": len(ok),
            "measured": len(measured),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_low": low,
            "tokens_per_s_high": high,
            "interval_basis": basis,
            "tokens_per_s_iqr": speed.quantile(0.75) - speed.quantile(0.25) if len(speed) > 1 else math.nan,
            "tokens_per_s_cv": cv,
            "unstable": bool(cv > CV_THRESHOLD) if not math.isnan(cv) else None,
            "unstable_runs": int(measured["unstable"].eq(True).sum()) if "unstable" in measured else None,
            "accuracy": accuracy,
            "accuracy_low": accuracy_low,
            "accuracy_high": accuracy_high,
            "quality_metric": ok["quality_metric"].dropna().iloc[0] if ok["quality_metric"].notna().any() else None,
            "quality_n": n,
            # what the quality is read against: the model before training, and always answering the majority class
            "base_accuracy": _median(ok, "base_quality"),
            "majority_rate": _median(ok, "eval_majority_class_rate"),
            **{column: _median(ok, column) for column in LOSS_FIGURES},
            "projected_hours": score(measured["projected_hours"], scoring),
            # an OOM run's peak is where it failed, not the configuration's
            **{column: _median(measured, column) for column in
               ("peak_memory_mb", "peak_memory_allocated_mb", "peak_memory_reserved_mb", "peak_rss_mb", "memory_estimate_mb")},
        }
        for column, (low_column, high_column) in PER_THROUGHPUT.items():
            value = score(measured[column], scoring)
            # cost = price / throughput: the throughput interval's ends are the cost's, the other way round
            row[column] = value
            row[low_column] = value * tokens_per_s / high if high > 0 else math.nan
            row[high_column] = value * tokens_per_s / low if low > 0 else math.inf if not math.isnan(low) else math.nan
        rows.append(row)
    table = pd.DataFrame(rows, columns=CONFIG_SUMMARY_COLUMNS)
    table.attrs["scoring"] = scoring  # for the labels of the figures drawn from it
    return table


def _median(frame: pd.DataFrame, column: str) -> float:
    """The median of a column's values; NaN when it has none (or the table has no such column)."""
    if column not in frame:
        return math.nan
    values = frame[column].dropna().astype(float)
    return float(values.median()) if len(values) else math.nan


# ---------------------------------------------------------------------------------------------------
# Ranking with ties: intervals that overlap are not ranked


INTERVALS = {
    "tokens_per_s": ("tokens_per_s_low", "tokens_per_s_high"),
    "cost_per_1m_tokens": ("cost_low", "cost_high"),
    "projected_cost": ("projected_cost_low", "projected_cost_high"),
    "accuracy": ("accuracy_low", "accuracy_high"),
}


def interval(row: pd.Series, column: str) -> tuple[float, float]:
    """A configuration's (low, high) for ``column``; the point itself where it has no interval (peak
    memory: the same run takes the same memory, so equal figures are the only tie)."""
    value = float(row[column])
    low, high = (float(row[c]) if not is_missing(row[c]) else math.nan for c in INTERVALS.get(column, (column, column)))
    return (value, value) if math.isnan(low) or math.isnan(high) else (low, high)


def ranked(configs: pd.DataFrame, column: str, higher_is_better: bool) -> pd.DataFrame:
    """The configurations with a value in ``column``, best first, with ``tied``: whether the 95%
    interval overlaps the leader's (the leader's own row included) - within noise of the best."""
    present = configs[configs[column].notna()].copy()
    present = present.sort_values(column, ascending=not higher_is_better, kind="stable")
    if present.empty:
        return present.assign(tied=pd.Series(dtype=bool))
    best = interval(present.iloc[0], column)
    present["tied"] = [uncertainty.overlap(best, interval(row, column)) for _, row in present.iterrows()]
    return present


def to_separate(a: pd.Series, b: pd.Series, column: str) -> dict:
    """What would separate two configurations whose ``column`` intervals overlap, at their observed
    difference: {'same': True} when there is none; {'eval_rows': n} for quality (repeats score the same
    rows, so only more rows help); {'repeats': n or None (more than 1,000)} when both intervals come
    from repeats (the spread each showed, recovered from its t-interval); else {'window': x}: x times
    longer measured windows would separate the within-run intervals, which bound measurement noise only."""
    difference = float(a[column]) - float(b[column])
    if difference == 0:
        return {"same": True}
    (a_low, a_high), (b_low, b_high) = interval(a, column), interval(b, column)
    half_a, half_b = (a_high - a_low) / 2, (b_high - b_low) / 2
    if column == "accuracy":
        n = max(a["quality_n"], b["quality_n"])
        return {"eval_rows": math.ceil(uncertainty.scale_to_separate(difference, half_a, half_b) * n)}
    counts = int(a["measured"]), int(b["measured"])
    if min(counts) >= 3 and not any(math.isinf(h) for h in (half_a, half_b)):
        sds = [half * math.sqrt(k) / uncertainty.t_quantile(k - 1) for half, k in zip((half_a, half_b), counts)]
        return {"repeats": uncertainty.repeats_to_separate(difference, *sds)}
    return {"window": uncertainty.scale_to_separate(difference, half_a, half_b)}


# ---------------------------------------------------------------------------------------------------
# The recommendation and the Pareto front


def recommend(configs: pd.DataFrame, min_accuracy: float | None = None, max_memory_mb: float | None = None) -> dict:
    """The cheapest finished configuration per method, and the cheapest meeting the floor and ceiling.

    Cheapest = lowest $ per 1M tokens over repeats (the same training budget costs proportionally); when
    no configuration has a price, the fastest (highest tokens/s) stands in and ``basis`` says so.
    Configurations whose 95% interval on that figure overlaps the pick's are a tie with it, not ranked:
    ``tied`` (with the pick) and the per-method table's ``tied_with`` name them.
    ``closest``: the best accuracy and the smallest peak memory any finished configuration reached.
    """
    done = configs[configs["ok"] > 0].copy()
    closest = {"accuracy": done["accuracy"].max(), "peak_memory_mb": done["peak_memory_mb"].min()}
    priced = done["cost_per_1m_tokens"].notna().any()
    column = "cost_per_1m_tokens" if priced else "tokens_per_s"
    done = done[done[column].notna()]
    done = done.sort_values(column, ascending=priced, kind="stable")

    def within_noise(pick: pd.Series, others: pd.DataFrame) -> list[str]:
        reach = interval(pick, column)
        return [row["configuration"] for _, row in others.iterrows()
                if row["config_key"] != pick["config_key"] and uncertainty.overlap(reach, interval(row, column))]

    per_method = done.groupby("method", sort=False).head(1).set_index("method")
    per_method = per_method.reindex(method_order(per_method.index)).reset_index()
    per_method["tied_with"] = [", ".join(within_noise(pick, done[done["method"] == pick["method"]])) or None
                               for _, pick in per_method.iterrows()]
    eligible = meeting(done, min_accuracy, max_memory_mb)
    best = eligible.iloc[0] if not eligible.empty else None
    return {"basis": "cost" if priced else "throughput", "column": column, "per_method": per_method,
            "best": best.to_dict() if best is not None else None,
            "tied": eligible[eligible["configuration"].isin(within_noise(best, eligible))] if best is not None else eligible.iloc[:0],
            "candidates": len(done), "closest": closest}


def meeting(configs: pd.DataFrame, min_accuracy: float | None = None, max_memory_mb: float | None = None) -> pd.DataFrame:
    """The configurations that meet the recommendation's accuracy floor and memory ceiling (a missing figure
    does not meet a bound that is set)."""
    if min_accuracy is not None:
        configs = configs[configs["accuracy"].notna() & (configs["accuracy"] >= min_accuracy)]
    if max_memory_mb is not None:
        configs = configs[configs["peak_memory_mb"].notna() & (configs["peak_memory_mb"] <= max_memory_mb)]
    return configs


def pareto_front(points: pd.DataFrame, cost: str = "cost", quality: str = "quality") -> pd.DataFrame:
    """Points no other point beats on both axes (lower or equal cost and higher or equal accuracy, one
    strictly better), sorted by cost."""
    ordered = points.sort_values([cost, quality], ascending=[True, False])
    front, best = [], -np.inf
    for index, row in ordered.iterrows():
        if row[quality] > best:
            front.append(index)
            best = row[quality]
    return ordered.loc[front]


def clearly_dominated(points: pd.DataFrame) -> pd.Series:
    """Whether some other point beats each one on both axes beyond noise: its whole cost interval below
    and its whole accuracy interval above. A point that is off the front only within noise may still be
    a better trade-off: it is not clearly dominated."""
    def beaten(p: pd.Series) -> bool:
        return bool(((points["cost_high"] < p["cost_low"]) & (points["quality_low"] > p["quality_high"])).any())

    return points.apply(beaten, axis=1).astype(bool) if not points.empty else pd.Series(dtype=bool)


def accuracy_and_cost(configs: pd.DataFrame) -> pd.DataFrame:
    """One point per configuration (configurations()) with a quality and a cost: the cost and quality with
    their 95% intervals (the point itself where a figure has none), method, label, model, dataset;
    ``on_front``: on the Pareto front of its model and dataset; ``near_front``: off it, but not clearly
    dominated (clearly_dominated), so within noise of the front."""
    points = configs[configs["accuracy"].notna() & configs["cost_per_1m_tokens"].notna()].set_index("config_key")
    points = pd.DataFrame({
        "cost": points["cost_per_1m_tokens"].astype(float), "quality": points["accuracy"].astype(float),
        "cost_low": points["cost_low"].astype(float).fillna(points["cost_per_1m_tokens"].astype(float)),
        "cost_high": points["cost_high"].astype(float).fillna(points["cost_per_1m_tokens"].astype(float)),
        "quality_low": points["accuracy_low"].astype(float).fillna(points["accuracy"].astype(float)),
        "quality_high": points["accuracy_high"].astype(float).fillna(points["accuracy"].astype(float)),
        "method": points["method"], "label": points["configuration"], "model": points["model"], "dataset": points["dataset"],
    })
    fronts, near = [], []
    for _, panel in points.groupby(["model", "dataset"], dropna=False):
        fronts.extend(pareto_front(panel).index)
        near.extend(panel.index[~clearly_dominated(panel)])
    points["on_front"] = points.index.isin(fronts)
    points["near_front"] = points.index.isin(near) & ~points["on_front"]
    return points


# ---------------------------------------------------------------------------------------------------
# Device memory


