"""The report's section on predicted speed and cost: every configuration of the results on every GPU of the table
(report/prediction.py's priced table), measured figures and predicted ones in columns of their own, the cheapest
GPU that fits each configuration, the host-bound runs named, and the budget-cost figure."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from markupsafe import Markup

from ftbench.experiment import calibration as calibrations
from ftbench.experiment.prediction import BASES
from ftbench.measure.metrics import HOST_BOUND_BUSY_SHARE
from ftbench.report import cost, figures, pages, prediction, price_matrix
from ftbench.report.analysis import is_missing

TEMPLATE = "prediction.html.j2"


def host_bound_notes(runs: pd.DataFrame) -> list[str]:
    """One line per measured host-bound run: its busy share and what that means for its ranking."""
    if "host_bound" not in runs:
        return []
    flagged = runs[runs["host_bound"].fillna(False).astype(bool)]
    return [f"{row['run_id']}: GPU busy {row['gpu_busy_share']:.0%} of its measured window (below "
            f"{HOST_BOUND_BUSY_SHARE:.0%}): host-bound, its speed is the host's kernel launches; on a faster host or "
            "with compile this ordering may change" for row in flagged.to_dict("records")]


def calibration_notes(calibration: calibrations.Calibration) -> list[str]:
    """What the predictions rest on."""
    calibrated = ", ".join(f"{name} ({entry.get('runs', '?')} runs)" for name, entry in sorted(calibration.gpus.items()))
    probed = ", ".join(sorted(name for name in calibration.probed if calibration.is_probed(name)))
    width = f"x{math.exp(calibrations.Z95 * calibration.transfer_sd):.2f} either way"
    probed_width = f"x{math.exp(calibrations.Z95 * calibrations.PROBED_SD):.2f} either way"
    return [f"Calibration: {calibration.source}; calibrated GPU models: {calibrated or 'none'}. "
            + (f"Probed GPU models ({probed}): predicted from their probe's figures; how well a probe carries over to "
               f"training runs is unmeasured, so their interval keeps the prior's width ({probed_width}). " if probed else "")
            + f"Other GPU models are datasheet only: their interval is wider ({width}).",
            "Predicted hours and dollars cover the budget's training steps only (no evaluation or job start-up)."]


def section(metrics_path: str | Path, gpus: list[dict], figures_dir: str | Path, captions: dict[str, str] | None = None,
            labels: dict | None = None, config_dir: str | Path | None = None,
            prices: cost.Prices | None = None) -> tuple[Markup | None, dict]:
    """(the section's HTML, the figure drawn: name -> PNG path or the note why not). None where no configuration
    has a prediction. ``labels``: config_id -> the configuration's label in the report. ``config_dir``: the folder of
    calibration.yaml and prices.yaml (the GPU table's); without one, the starting values and the default prices."""
    config_dir = Path(config_dir) if config_dir is not None else Path("config")
    calibration_path = config_dir / "calibration.yaml"
    shipped = calibrations.load(calibration_path) if calibration_path.is_file() else calibrations.priors()
    shipped, gpus = prediction.with_probe_file(shipped, gpus, config_dir / prediction.probes.DEFAULT_PROBES.name)
    prices = prices or cost.resolve({}, default_table=config_dir / "prices.yaml")
    table, calibration = prediction.results_table(metrics_path, [g for g in gpus if g.get("memory_gb")], shipped, prices)
    shown = prediction.section_frame(table, labels)
    if shown.empty:
        return None, {}
    written = figures.save({figures.BUDGET_COST.name: figures.draw(figures.BUDGET_COST, shown)}, figures_dir)
    left_out = shown[~shown["fits"].isin(["yes", "borderline"])]
    note = (f"left out where the configuration does not fit: {len(left_out)} of {len(shown)} (configuration, GPU) pairs"
            if not left_out.empty else None)
    block = pages.figure_block(figures.BUDGET_COST.name, figures.BUDGET_COST.title, written[figures.BUDGET_COST.name],
                               captions or {}, note)
    runs = pd.read_parquet(metrics_path)
    no_prediction = [f"{row['run_id']}: {row['note']}" for row in table[table["gpu"].isna()].to_dict("records")
                     if not is_missing(row["note"])]
    html = pages.TEMPLATES.get_template(TEMPLATE).render(
        matrix=price_matrix.price_matrix(table, labels), marked=price_matrix.marked, cell_class=_cell_class,
        table=pages.table(shown, list(prediction.SECTION_COLUMNS), table_id="prediction-table",
                          row_class=_row_class, titles=prediction.SECTION_COLUMNS, headers=prediction.SECTION_HEADERS),
        figure=block, host_bound=host_bound_notes(runs), notes=calibration_notes(calibration) + no_prediction)
    return Markup(html), written


def _cell_class(cell: price_matrix.MatrixCell) -> str:
    kinds = ["measured" if cell.measured else "predicted"]
    kinds += ["cheapest"] if cell.cheapest else []
    kinds += ["nofit"] if cell.fits == "no" else ["none"] if not cell.interval else []
    return " ".join(kinds)


def _row_class(row: pd.Series) -> str:
    return "measured" if row["rests on"] == BASES["measured"] else "predicted"
