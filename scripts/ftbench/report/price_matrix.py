"""The price matrix: configurations by GPUs, one cell per pair, as a person scans it. `python -m ftbench plan`
prints it and the report's "Predicted speed and cost per GPU" section shows it, both from ``price_matrix`` (the
cells' words and figures are written once, here; the terminal and the page only lay them out).

A cell: the budget's dollars where the experiment sets a ``budget``, else $ per 1M tokens (always known where the
GPU has a price); its 95% interval under it; marked where it is the cheapest GPU that fits the configuration,
and where it was measured here rather than predicted; "does not fit" where the memory estimate says so. A
configuration host-bound on some GPUs says so once, beside its name.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import pandas as pd

from ftbench.experiment.prediction import BASES
from ftbench.report import prediction
from ftbench.report.analysis import is_missing

CHEAPEST_MARK = "*"
MEASURED_MARK = "(m)"  # not a bare "m", which reads as millions after a dollar figure
TERMINAL_WIDTH = 120


@dataclass(frozen=True)
class MatrixCell:
    value: str  # the figure ("$12.34"), or why there is none ("no fit", "no price", "-")
    interval: str  # its 95% interval in the value's unit ("9.80-15.60"), "" where there is none
    measured: bool
    cheapest: bool
    fits: str | None  # yes | borderline | no
    detail: str  # tokens/s with its interval, what it rests on, GPU busy, fits: a tooltip, or --detail's line


@dataclass(frozen=True)
class MatrixRow:
    label: str
    host_bound: list[str]  # the GPUs it is predicted (or measured) host-bound on
    cells: list[MatrixCell]

    def note(self, width: int = 200) -> str:
        """Host-bound, said once for the configuration: on which GPUs, or how many where the names are too long."""
        if not self.host_bound:
            return ""
        priced = sum(cell.value != "-" for cell in self.cells)
        if len(self.host_bound) >= priced:
            return "host-bound on every GPU"
        named = f"host-bound on {', '.join(self.host_bound)}"
        return named if len(named) <= width else f"host-bound on {len(self.host_bound)} of {priced} GPUs"


@dataclass(frozen=True)
class PriceMatrix:
    unit: str  # what the cells hold
    gpus: list[str]
    rows: list[MatrixRow]
    legend: str


def _money_span(value, low, high) -> tuple[str, str]:
    if is_missing(value):
        return "-", ""
    interval = ("" if is_missing(low) or is_missing(high) else
                f"{prediction.pages_money(low)[1:]}-{prediction.pages_money(high)[1:]}")  # the unit once, on the value
    return prediction.pages_money(value), interval


def _cell(row: dict, column: str, cheapest_gpu: str | None) -> MatrixCell:
    measured = row["basis"] == BASES["measured"]
    fits = None if is_missing(row.get("fits")) else row["fits"]
    rate = row["tokens_per_s"]
    tokens = "-" if is_missing(rate) else (f"{rate:,.0f} tokens/s" + (
        "" if is_missing(row["tokens_per_s_low"]) else f" [{row['tokens_per_s_low']:,.0f}-{row['tokens_per_s_high']:,.0f}]"))
    busy = "" if is_missing(row["busy_share"]) else f", GPU busy {row['busy_share']:.2f}"
    per_1k = ("" if is_missing(row.get("cost_per_1k_samples")) else
              f", {prediction.pages_money(row['cost_per_1k_samples'])} per 1k samples")
    detail = f"{row['gpu']}: {tokens}{busy}{per_1k}; {row['basis']}; fits: {fits or '?'}"
    if fits == "no":
        return MatrixCell("no fit", "", measured, False, fits, detail)
    if is_missing(row.get("price_per_device_hour")):
        return MatrixCell("no price", "", measured, False, fits, detail)
    value, interval = _money_span(row[column], row[f"{column}_low"], row[f"{column}_high"])
    if fits == "borderline":
        value += "?"
    return MatrixCell(value, interval, measured, row["gpu"] == cheapest_gpu, fits, detail)


def price_matrix(table: pd.DataFrame, labels: dict | None = None) -> PriceMatrix:
    """The matrix of a priced table (report/prediction.py PRICED_COLUMNS): one row per configuration (its first
    run), one column per GPU; ``labels``: config_id -> the configuration's name (default: its config_id)."""
    shown = table[table["gpu"].notna()]
    column = prediction.cost_column(shown)
    picks = {row["run_id"]: row["gpu"] for row in prediction.cheapest(shown, column).to_dict("records")}
    gpus = list(dict.fromkeys(shown["gpu"]))
    rows = []
    for config_id, runs in shown.groupby("config_id", sort=False):
        first = runs[runs["run_id"] == runs["run_id"].iloc[0]]
        by_gpu = {row["gpu"]: row for row in first.to_dict("records")}
        cells = [_cell(by_gpu[gpu], column, picks.get(first["run_id"].iloc[0])) if gpu in by_gpu
                 else MatrixCell("-", "", False, False, None, f"{gpu}: no prediction") for gpu in gpus]
        bound = [gpu for gpu, row in by_gpu.items() if row["host_bound"] is True]
        rows.append(MatrixRow((labels or {}).get(config_id, config_id), bound, cells))
    unit = ("$ of the budget's training steps" if column == "budget_cost" else "$ per 1M tokens")
    legend = (f"{CHEAPEST_MARK} the cheapest GPU that fits; {MEASURED_MARK} measured here, the rest predicted; ? a "
              "borderline fit; no fit: the memory estimate exceeds the GPU; host-bound: the host's kernel launches set "
              "the speed, so on a faster host or with compile the order may change")
    return PriceMatrix(unit, gpus, rows, legend)


def marked(cell: MatrixCell, measured_mark: bool = True) -> str:
    """The cell's figure with its marks: the cheapest that fits, and (unless the page shows it by its style)
    measured here."""
    return cell.value + (CHEAPEST_MARK if cell.cheapest else "") + (MEASURED_MARK if cell.measured and measured_mark else "")


def short_labels(names: dict[str, str]) -> dict[str, str]:
    """Configuration names without the parts every one of them shares (the dataset, a common precision)."""
    parts = {key: name.split("-") for key, name in names.items()}
    shared = set.intersection(*(set(split) for split in parts.values())) if len(parts) > 1 else set()
    return {key: "-".join(part for part in split if part not in shared) or names[key] for key, split in parts.items()}


def text_lines(matrix: PriceMatrix, width: int = TERMINAL_WIDTH) -> list[str]:
    """The matrix for a terminal of ``width`` columns: the configurations down the side, as many GPUs across as
    fit, the rest in further blocks; each cell its figure over its interval; host-bound said under the name."""
    # wide enough for the names (up to 34) and the host-bound notes in their short form ("on 5 of 9 GPUs")
    label_width = max(min(34, max([len(row.label) for row in matrix.rows] + [13])),
                      *(len(row.note(0)) for row in matrix.rows))
    widths = [max(len(gpu), *(max(len(marked(row.cells[i])), len(row.cells[i].interval)) for row in matrix.rows))
              for i, gpu in enumerate(matrix.gpus)]
    lines = textwrap.wrap(f"Cells: {matrix.unit}, its 95% interval under it; {matrix.legend}", width)
    start = 0
    while start < len(matrix.gpus):
        end, used = start, label_width
        while end < len(matrix.gpus) and (end == start or used + 2 + widths[end] <= width):
            used += 2 + widths[end]
            end += 1
        block = range(start, end)
        lines.append(f"{'configuration':<{label_width}}" + "".join(f"  {matrix.gpus[i]:>{widths[i]}}" for i in block))
        for row in matrix.rows:
            label = row.label if len(row.label) <= label_width else row.label[:label_width - 1] + "~"
            lines.append(f"{label:<{label_width}}" + "".join(f"  {marked(row.cells[i]):>{widths[i]}}" for i in block))
            note = row.note(label_width)
            lines.append(f"{note:<{label_width}}" + "".join(f"  {row.cells[i].interval:>{widths[i]}}" for i in block))
        start = end
    return lines
