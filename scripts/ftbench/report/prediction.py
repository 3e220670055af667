"""Predicted speed and cost beside what was measured: the priced table of `python -m ftbench plan` and of the
report's section, the cheapest GPU that fits each configuration, and calibrations fitted to measured runs.

The predictions are experiment/prediction.py's; this module adds what needs the results and the prices: a measured
run of a configuration on a GPU model shows its measurement ("measured here") in place of the prediction, with the
prediction beside it; the user's own GPU runs are fitted over the shipped calibration and take precedence for the
GPU models they ran on; dollars come from the price table (report/cost.py) for the budget's hours x the run's GPUs.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ftbench.experiment import calibration as calibrations
from ftbench.experiment import memory_plan, prediction, probes, step_time
from ftbench.measure import gpu_table
from ftbench.report import cost
from ftbench.report.analysis import is_missing
from ftbench.runspec import RunSpec

DEFAULT_CALIBRATION = Path("config/calibration.yaml")


@dataclass(frozen=True)
class MeasuredRun:
    """A finished GPU run of the results: its spec, its row of metrics.parquet, its GPU's table entry."""

    run: RunSpec
    row: dict
    gpu: dict


def read_measured(metrics_path: str | Path, gpus: list[dict], specs: dict[str, RunSpec] | None = None) -> list[MeasuredRun]:
    """The finished runs of a results table on a GPU of ``gpus``, each with its spec from the metrics.json the
    table was collected from (results/runs/<run_id>/metrics.json beside it) and how often its batches' shape
    changed (its steps.parquet). A run whose spec this version cannot read (an older spec) is left out with a warning.
    ``specs``: run_id -> spec for a table copied without its runs' folders (its experiment's runs, expanded again:
    a run_id names one spec)."""
    metrics_path = Path(metrics_path)
    frame = pd.read_parquet(metrics_path)
    finished = frame[(frame["status"] == "ok") & (frame["device"] == "cuda") & (frame["measured_steps"].fillna(0) > 1)]
    measured = []
    for row in finished.to_dict("records"):
        gpu = gpu_table.entry_for(row.get("device_name") or "", gpus)
        spec = _spec(metrics_path.parent / "runs" / str(row["run_id"]) / "metrics.json") or (specs or {}).get(row["run_id"])
        if gpu is None or spec is None:
            continue
        clean = {key: (None if is_missing(value) else value) for key, value in row.items()}
        clean["shape_change_share"] = shape_changes(metrics_path.parent / "runs" / str(row["run_id"]) / "steps.parquet")
        measured.append(MeasuredRun(spec, clean, {**gpu, "device_name": row.get("device_name")}))
    return measured


def shape_changes(steps_path: Path) -> float | None:
    """Share of a run's measured steps whose padded positions differ from the step before (its batches' shapes
    changed), from its steps.parquet; None without one."""
    try:
        steps = pd.read_parquet(steps_path, columns=["measured", "padded_tokens"])
    except (OSError, ValueError, KeyError):
        return None
    padded = steps.loc[steps["measured"].astype(bool), "padded_tokens"].to_numpy()
    return float((padded[1:] != padded[:-1]).mean()) if len(padded) > 1 else None


def _spec(path: Path) -> RunSpec | None:
    if not path.is_file():  # a table without its runs' folders (copied alone): nothing to predict from
        return None
    try:
        return RunSpec.from_dict(json.loads(path.read_text(encoding="utf-8"))["spec"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warnings.warn(f"{path}: its run spec is not readable here ({exc}); left out of the calibration", stacklevel=2)
        return None


def samples(measured: list[MeasuredRun]) -> list[calibrations.Sample]:
    """The fit's samples: each measured run's workload (its measured batches) and seconds per step."""
    out = []
    for item in measured:
        try:
            load, _ = step_time.workload(item.run, measured=item.row)
        except Exception as exc:  # noqa: BLE001 - a prediction advises: a run it cannot model is left out, said once
            warnings.warn(f"run {item.run.run_id}: no step-time workload ({type(exc).__name__}: {exc}); left out of the "
                          "calibration", stacklevel=2)
            continue
        if load is None:
            continue
        step_s = item.row["measured_time_s"] / item.row["measured_steps"]
        busy = item.row.get("gpu_busy_share")
        out.append(calibrations.Sample(item.run.run_id, load, item.gpu, step_s, busy))
    return out


def own_calibration(metrics_path: str | Path | None, gpus: list[dict],
                    shipped: calibrations.Calibration) -> tuple[calibrations.Calibration, list[MeasuredRun]]:
    """(the shipped calibration with the user's own GPU runs fitted over it, those taking precedence for the GPU
    models they ran on; the measured runs). No results, or none on a GPU: the shipped calibration as it is."""
    if metrics_path is None or not Path(metrics_path).is_file():
        return shipped, []
    measured = read_measured(metrics_path, gpus)
    fitted = samples(measured)
    if not fitted:
        return shipped, measured
    own = calibrations.fit(fitted, shipped, source=f"your runs in {metrics_path}", host=hosts_of(measured))
    return own.over(shipped), measured


def hosts_of(measured: list[MeasuredRun]) -> str | None:
    """The CPUs the runs were measured with (the host terms are theirs)."""
    cpus = sorted({str(item.row.get("cpu")) for item in measured if item.row.get("cpu")})
    return ", ".join(cpus) or None


def load_calibration(path: str | Path | None) -> calibrations.Calibration:
    """The calibration at ``path`` (the shipped config/calibration.yaml by default)."""
    return calibrations.load(path or DEFAULT_CALIBRATION)


def with_probe_file(calibration: calibrations.Calibration, gpus: list[dict],
                    probe_path: str | Path | None) -> tuple[calibrations.Calibration, list[dict]]:
    """(``calibration`` with the probed GPU models of a probe file (experiment/probes.py), the GPU table with the
    entries the file adds); no file: both as they are."""
    figures, added = probes.load(probe_path)
    gpus = probes.merged_gpus(gpus, added)
    return probes.with_probes(calibration, figures, gpus), gpus


# --- the priced table -----------------------------------------------------------------------------------------

PRICED_COLUMNS = ["run_id", "config_id", "gpu", "fits", "largest_batch", "basis", "tokens_per_s", "tokens_per_s_low",
                  "tokens_per_s_high", "predicted_tokens_per_s", "predicted_tokens_per_s_low",
                  "predicted_tokens_per_s_high", "busy_share", "host_bound", "budget_tokens",
                  "budget_hours", "budget_hours_low", "budget_hours_high", "devices", "price_per_device_hour",
                  "budget_cost", "budget_cost_low", "budget_cost_high", "tokens_per_sample", "cost_per_1m_tokens",
                  "cost_per_1m_tokens_low", "cost_per_1m_tokens_high", "cost_per_1k_samples", "cost_per_1k_samples_low",
                  "cost_per_1k_samples_high", "note"]


def price_of(gpu: dict, prices: cost.Prices) -> float | None:
    """$ per device-hour of a GPU of the table: the price table's model matched by the GPU's name and memory
    ("A100 80GB", as a device name reads), under the experiment's provider and pricing; None where unpriced."""
    name = f"{gpu['name']} {gpu['memory_gb']:g}GB" if gpu.get("memory_gb") else gpu["name"]
    model = prices.model_for("cuda", name)
    return prices.per_device_hour.get(model) if model else None


def measured_index(measured: list[MeasuredRun]) -> dict[tuple[str, str], list[MeasuredRun]]:
    """The measured runs by (configuration for speed, GPU model): what "measured here" looks up."""
    index: dict[tuple[str, str], list[MeasuredRun]] = {}
    for item in measured:
        index.setdefault((prediction.speed_key(item.run), item.gpu["name"]), []).append(item)
    return index


def run_rows(run: RunSpec, gpus: list[dict], calibration: calibrations.Calibration, prices: cost.Prices,
             budget: dict | None, planned: dict, measured: dict, data_root=None) -> list[dict]:
    """One row per GPU of the table for a run: what fits there (``planned``: memory_plan.plan_run's), the
    predicted or measured tokens/s with its interval and basis, the budget's hours and dollars."""
    if planned.get("unsupported"):
        return []
    fits = {row["gpu"]: row for row in planned.get("gpus", [])}
    predicted = prediction.predict_run(run, gpus, calibration, data_root, budget)
    if not predicted["gpus"]:
        why = predicted["note"] or "no GPU of the table has a peak and a bandwidth for its compute dtype"
        return [{**dict.fromkeys(PRICED_COLUMNS), "run_id": run.run_id, "config_id": run.config_id,
                 "note": f"no prediction: {why}"}]
    rows = []
    for figures in predicted["gpus"]:
        gpu = figures["gpu"]
        row = {"run_id": run.run_id, "config_id": run.config_id, "gpu": gpu, "fits": fits.get(gpu, {}).get("fits"),
               "largest_batch": fits.get(gpu, {}).get("largest_batch"), "basis": prediction.BASES[figures["basis"]],
               "tokens_per_s": figures["tokens_per_s"], "tokens_per_s_low": figures["tokens_per_s_low"],
               "tokens_per_s_high": figures["tokens_per_s_high"], "predicted_tokens_per_s": figures["tokens_per_s"],
               "predicted_tokens_per_s_low": figures["tokens_per_s_low"],
               "predicted_tokens_per_s_high": figures["tokens_per_s_high"],
               "busy_share": figures["busy_share"], "host_bound": figures["host_bound"],
               "budget_tokens": figures.get("budget_tokens"), "devices": run.devices, "note": predicted["note"],
               "tokens_per_sample": predicted["workload"].tokens_per_step / predicted["workload"].samples_per_step}
        row.update(_measured_figures(measured.get((prediction.speed_key(run), gpu), [])))
        rows.append(_priced(row, price_of(next(g for g in gpus if g["name"] == gpu), prices)))
    return rows


def _measured_figures(items: list[MeasuredRun]) -> dict:
    """A configuration's measured figures on one GPU model (the median of its repeats; the interval from the
    lowest low end to the highest high end): these replace the prediction's, which stays beside them."""
    if not items:
        return {}
    rates = pd.Series([item.row["tokens_per_s"] for item in items], dtype=float)
    lows = [item.row.get("tokens_per_s_low") or item.row["tokens_per_s"] for item in items]
    highs = [item.row.get("tokens_per_s_high") or item.row["tokens_per_s"] for item in items]
    busy = [item.row["gpu_busy_share"] for item in items if item.row.get("gpu_busy_share") is not None]
    share = float(pd.Series(busy).median()) if busy else None
    return {"basis": prediction.BASES["measured"], "tokens_per_s": float(rates.median()), "tokens_per_s_low": min(lows),
            "tokens_per_s_high": max(highs), "busy_share": share,
            "host_bound": None if share is None else share < calibrations.HOST_BOUND}


def _priced(row: dict, price: float | None) -> dict:
    """The budget's hours and dollars at the row's tokens/s and its interval (training steps only), and, budget or
    not, $ per 1M tokens and per 1k samples (every GPU the run holds, at the row's tokens/s)."""
    tokens = row.get("budget_tokens")
    row["price_per_device_hour"] = price
    for suffix, rate in (("", "tokens_per_s"), ("_low", "tokens_per_s_high"), ("_high", "tokens_per_s_low")):
        hours = tokens / row[rate] / 3600 if tokens and row.get(rate) else None
        row[f"budget_hours{suffix}"] = hours
        row[f"budget_cost{suffix}"] = hours * row["devices"] * price if hours is not None and price is not None else None
        per_1m = row["devices"] * price / (row[rate] * 3600) * 1e6 if row.get(rate) and price is not None else None
        row[f"cost_per_1m_tokens{suffix}"] = per_1m
        row[f"cost_per_1k_samples{suffix}"] = None if per_1m is None else per_1m / 1e6 * row["tokens_per_sample"] * 1e3
    return row


def cost_column(table: pd.DataFrame) -> str:
    """What a table's costs are compared by: the budget's dollars where it has a budget, else $ per 1M tokens."""
    return "budget_cost" if "budget_cost" in table and table["budget_cost"].notna().any() else "cost_per_1m_tokens"


def priced_table(runs: list[RunSpec], gpus: list[dict], calibration: calibrations.Calibration,
                 prices: cost.Prices, budget: dict | None, measured: list[MeasuredRun] | None = None,
                 data_root=None, plans: dict | None = None, build=None) -> pd.DataFrame:
    """Every run on every GPU of the table (``PRICED_COLUMNS``). ``plans``: memory_plan.plan_run's result by
    run_id where the caller has it already (else made here, with ``build`` for models of two stacks)."""
    index = measured_index(measured or [])
    rows = []
    for run in runs:
        planned = (plans or {}).get(run.run_id) or memory_plan.plan_run(run, gpus, data_root, build=build)
        rows += run_rows(run, gpus, calibration, prices, budget, planned, index, data_root)
    return pd.DataFrame(rows, columns=PRICED_COLUMNS)


CHEAPEST_COLUMNS = ["run_id", "gpu", "fits", "budget_cost", "budget_cost_low", "budget_cost_high", "budget_hours",
                    "cost_per_1m_tokens", "cost_per_1m_tokens_low", "cost_per_1m_tokens_high", "basis"]


def cheapest(table: pd.DataFrame, column: str = "budget_cost") -> pd.DataFrame:
    """Per run: the GPU of the table with the lowest ``column`` (the budget's cost, or $ per 1M tokens) among those
    it fits ("yes"; "borderline" where nothing fits surely), with its costs' intervals and basis."""
    picks = []
    for run_id, rows in table.groupby("run_id", sort=False):
        priced = rows[rows[column].notna()]
        for verdict in ("yes", "borderline"):
            fitting = priced[priced["fits"] == verdict]
            if not fitting.empty:
                best = fitting.loc[fitting[column].astype(float).idxmin()]
                picks.append({"run_id": run_id, "fits": verdict,
                              **{key: best[key] for key in CHEAPEST_COLUMNS if key not in ("run_id", "fits")}})
                break
    return pd.DataFrame(picks, columns=CHEAPEST_COLUMNS)


# --- as text (the plan) ---------------------------------------------------------------------------------------

def _span(value, low, high, unit: str = "", digits: str = ",.0f") -> str:
    """A figure and its interval as text; dollars (``unit`` "$") as pages.money writes them (cents below $100)."""
    if is_missing(value):
        return "-"
    write = pages_money if unit == "$" else (lambda number: f"{number:{digits}}")
    text = write(value)
    return text if is_missing(low) or is_missing(high) else f"{text} [{write(low)}-{write(high)}]"


def pages_money(value: float) -> str:
    """Dollars: whole from $100 up, cents from $1, three significant digits below (report/pages.py's money)."""
    return f"${value:,.0f}" if value >= 100 else f"${value:.2f}" if value >= 1 or value == 0 else f"${value:.3g}"


def _hours(value, low, high) -> str:
    digits = ",.0f" if not is_missing(value) and value >= 100 else ".3g"
    return _span(value, low, high, digits=digits)


PRICED_HEADER = (f"{'tokens/s [95%]':>26} {'busy':>5} {'hours [95%]':>20} {'$ [95%]':>22} {'$/1M tokens [95%]':>22} "
                 f"{'$/1k samples':>12}  basis")


def priced_cells(row: dict | None) -> str:
    """One GPU's prediction as the plan prints it beside the GPU's memory verdict ('' where there is none)."""
    if row is None or is_missing(row.get("gpu")):
        return ""
    busy = "-" if is_missing(row["busy_share"]) else f"{row['busy_share']:.2f}"
    flag = " (host-bound)" if row["host_bound"] is True else ""
    return (f"{_span(row['tokens_per_s'], row['tokens_per_s_low'], row['tokens_per_s_high']):>26} {busy:>5} "
            f"{_hours(row['budget_hours'], row['budget_hours_low'], row['budget_hours_high']):>20} "
            f"{_span(row['budget_cost'], row['budget_cost_low'], row['budget_cost_high'], '$'):>22} "
            f"{_span(row['cost_per_1m_tokens'], row['cost_per_1m_tokens_low'], row['cost_per_1m_tokens_high'], '$'):>22} "
            f"{_span(row['cost_per_1k_samples'], None, None, '$'):>12}  {row['basis']}{flag}")


def plan_footer(rows: pd.DataFrame, pick: dict | None) -> list[str]:
    """Under a run's GPU lines: why it has no prediction, the prediction's notes, the cheapest GPU that fits."""
    if rows.empty:
        return []
    lines = [f"  note: {note}" for note in rows["note"].dropna().unique()]
    column = cost_column(rows)
    if pick:
        what = "for the budget" if column == "budget_cost" else "per 1M tokens"
        lines.append(f"  cheapest that fits: {pick['gpu']} ({pick['fits']}), "
                     f"{_span(pick[column], pick[f'{column}_low'], pick[f'{column}_high'], '$')} {what} ({pick['basis']})")
    elif rows[column].notna().any():
        lines.append("  cheapest that fits: none of the table's GPUs fits it")
    return lines


def plan_heading(calibration: calibrations.Calibration, prices: cost.Prices, budget: dict | None) -> str:
    """What the plan's prices rest on: the budget, the prices, the calibration and its GPU models."""
    calibrated = ", ".join(sorted(calibration.gpus)) or "none"
    probed = ", ".join(sorted(name for name in calibration.probed if calibration.is_probed(name)))
    what = ("no budget: $ per 1M tokens" if not budget else
            f"budget {budget.get('tokens') or budget.get('samples'):,} {'tokens' if budget.get('tokens') else 'samples'}"
            f" x {budget.get('epochs') or 1} epochs")
    return (f"speed and cost per GPU ({what}; training steps only, no evaluation or start-up; prices {prices.label} "
            f"from {prices.table_path}; calibration {calibration.source}, calibrated on: {calibrated}; "
            + (f"probed: {probed} (their interval the prior's width: unmeasured); " if probed else "") +
            f"[95%]: the calibration's residual spread, wider where it rests on a parameter no run calibrated)")


# --- the report's section -------------------------------------------------------------------------------------

def result_configurations(frame: pd.DataFrame, metrics_path: str | Path) -> list[tuple[RunSpec, dict | None]]:
    """One (spec, budget) per configuration of a results table (its first run with a readable spec; runs recorded
    unsupported left out), the budget as the run's own projected_tokens (collect's, from the experiment's budget)."""
    chosen: dict[str, tuple[RunSpec, dict | None]] = {}
    for row in frame[frame["status"] != "unsupported"].to_dict("records"):
        if row["config_id"] in chosen:
            continue
        spec = _spec(Path(metrics_path).parent / "runs" / str(row["run_id"]) / "metrics.json")
        if spec is not None:
            tokens = row.get("projected_tokens")
            chosen[row["config_id"]] = (spec, None if is_missing(tokens) else {"tokens": float(tokens)})
    return list(chosen.values())


def _priced_or_note(run: RunSpec, gpus, calibration, prices, budget, measured, data_root) -> pd.DataFrame:
    """priced_table of one run; a run the models cannot read (a spec from another version) is a note, so the
    report is written whatever one configuration holds."""
    try:
        return priced_table([run], gpus, calibration, prices, budget, measured, data_root)
    except Exception as exc:  # noqa: BLE001 - the section advises: a run it cannot price is said, not fatal
        note = f"no prediction: {type(exc).__name__}: {exc}"[:300]
        return pd.DataFrame([{**dict.fromkeys(PRICED_COLUMNS), "run_id": run.run_id, "config_id": run.config_id,
                              "note": note}], columns=PRICED_COLUMNS)


def results_table(metrics_path: str | Path, gpus: list[dict], calibration: calibrations.Calibration,
                  prices: cost.Prices) -> tuple[pd.DataFrame, calibrations.Calibration]:
    """The priced table of a results set's configurations on every GPU of the table (the measured ones as measured),
    and the calibration it used (the user's runs fitted over ``calibration``)."""
    frame = pd.read_parquet(metrics_path)
    own, measured = own_calibration(metrics_path, gpus, calibration)
    data_root = Path(metrics_path).parent / "data"
    parts = [_priced_or_note(run, gpus, own, prices, budget, measured, data_root)
             for run, budget in result_configurations(frame, metrics_path)]
    parts = [part for part in parts if not part.empty]
    table = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=PRICED_COLUMNS)
    return table, own


# The section's table: its columns and what each header's tooltip says. Measured and predicted figures are kept in
# columns of their own, so a predicted number is never read as a measured one.
SECTION_COLUMNS = {
    "configuration": "the configuration (as the Configurations table names it)",
    "GPU": "a GPU of the GPU table (config/gpus.yaml)",
    "fits": "memory estimate against the GPU: yes / borderline / no (What fits)",
    "rests on": "measured here: a run of it on this GPU model is in these results | calibrated on this GPU model | "
                "datasheet only (uncalibrated): the datasheet's peak and bandwidth, with the calibrated GPUs' efficiencies",
    "measured tokens/s": "measured real tokens per second (median of its repeats), where it ran on this GPU model",
    "predicted tokens/s": "the step-time model's tokens per second before training (compute, memory traffic, host)",
    "predicted 95%": "95% interval of the prediction: the calibration's residual spread for this GPU model, weighed by how much of the step the host sets, wider where a parameter no run calibrated counts",
    "measured / predicted": "how the prediction fared where it was measured",
    "GPU busy": "share of the step the GPU runs kernels: measured (NVML) where measured, else predicted",
    "host-bound": "GPU busy below 0.8: the host's launches set the speed, so on a faster host or with compile this "
                  "ordering may change",
    "cost_of_budget_measured": "$ of the budget's training steps at the measured tokens/s (GPUs x $/GPU-hour)",
    "cost_of_budget_predicted": "$ of the budget's training steps at the predicted tokens/s",
    "predicted $ 95%": "the predicted cost's 95% interval",
    "cost_per_1m_tokens": "$ per 1M real tokens trained, budget or not (GPUs x $/GPU-hour at the measured tokens/s where "
                          "measured here, else at the predicted)",
    "cost_per_1k_samples": "$ per 1,000 training examples, as $ per 1M tokens at the run's tokens per example",
}


# The section's headers where a column's name is not words (it stays the name the budget figure reads).
SECTION_HEADERS = {"cost_of_budget_measured": "measured $ of the budget", "cost_of_budget_predicted": "predicted $ of the budget",
                   "cost_per_1m_tokens": "$ per 1M tokens", "cost_per_1k_samples": "$ per 1k samples"}


def section_frame(table: pd.DataFrame, labels: dict | None = None) -> pd.DataFrame:
    """The priced table as the report shows it (SECTION_COLUMNS), one row per configuration and GPU."""
    shown = table[table["gpu"].notna()]
    measured = shown["basis"] == prediction.BASES["measured"]
    predicted_cost = shown["budget_tokens"] / shown["predicted_tokens_per_s"] / 3600 * shown["devices"] * shown["price_per_device_hour"]
    cost_low = shown["budget_tokens"] / shown["predicted_tokens_per_s_high"] / 3600 * shown["devices"] * shown["price_per_device_hour"]
    cost_high = shown["budget_tokens"] / shown["predicted_tokens_per_s_low"] / 3600 * shown["devices"] * shown["price_per_device_hour"]
    frame = pd.DataFrame({
        "configuration": shown["config_id"].map(lambda key: (labels or {}).get(key, key)),
        "GPU": shown["gpu"], "fits": shown["fits"].fillna("?"), "rests on": shown["basis"],
        "measured tokens/s": shown["tokens_per_s"].where(measured),
        "predicted tokens/s": shown["predicted_tokens_per_s"],
        "predicted 95%": [_range(low, high) for low, high in zip(shown["predicted_tokens_per_s_low"], shown["predicted_tokens_per_s_high"])],
        "measured / predicted": (shown["tokens_per_s"] / shown["predicted_tokens_per_s"]).where(measured),
        "GPU busy": shown["busy_share"], "host-bound": shown["host_bound"],
        "cost_of_budget_measured": shown["budget_cost"].where(measured), "cost_of_budget_predicted": predicted_cost,
        "predicted $ 95%": [_range(low, high, money=True) for low, high in zip(cost_low, cost_high)],
        "cost_per_1m_tokens": shown["cost_per_1m_tokens"], "cost_per_1k_samples": shown["cost_per_1k_samples"],
    })
    return frame.astype({"measured tokens/s": "Float64", "measured / predicted": "Float64", "GPU busy": "Float64",
                         "cost_of_budget_measured": "Float64", "cost_of_budget_predicted": "Float64",
                         "cost_per_1m_tokens": "Float64", "cost_per_1k_samples": "Float64"})


def _range(low, high, money: bool = False) -> str:
    if is_missing(low) or is_missing(high):
        return ""
    return f"{pages_money(low)}-{pages_money(high)}" if money else f"{low:,.0f}-{high:,.0f}"
