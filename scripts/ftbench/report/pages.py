"""The HTML layer of report.html and compare.html: Jinja2 templates (package data in templates/), the
sortable tables, the figure blocks and how numbers are written.

Pages are self-contained: styles and the sorting script are inline and figures are embedded as base64
PNG, so a page opens from disk with no server and no network. Autoescaping is on: values reach a page
as text; markup comes only from the templates.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jinja2
import numpy as np
import pandas as pd

from ftbench import atomic
from ftbench.report.analysis import is_missing
from ftbench.report.columns import COLUMNS

# Columns whose text is long: wrapped instead of widening the table.
WRAPPED = {"status_reason", "unstable_reason", "host_medians", "price_source", "tied_with", "interval_basis"}


def fmt(value, column: str = "") -> str:
    """A cell's text: percentages for CVs, dollars for costs, thousands separators for large numbers."""
    if is_missing(value):
        return ""
    if isinstance(value, str):  # text (an interval written out, a reason) is already written
        return value
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if column.endswith("_cv") or column == "cv":
        return f"{float(value):.1%}"
    if column.startswith(("cost_", "projected_cost", "projected_energy_cost", "energy_cost_", "price_per")):
        return money(value)
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}"
    if isinstance(value, int) and abs(value) >= 100000:
        return f"{value:,}"
    return str(value)


def money(value) -> str:
    """Dollars: cents from $1 up, three significant digits below (costs per token are small)."""
    if is_missing(value):
        return ""
    value = float(value)
    if value >= 100:
        return f"${value:,.0f}"
    if value >= 1 or value == 0:
        return f"${value:.2f}"
    return f"${value:.3g}"


# ---------------------------------------------------------------------------------------------------
# Tables


@dataclass(frozen=True)
class Cell:
    text: str
    raw: str  # the value the sorting script compares (numbers in full precision)
    css: str | None


@dataclass(frozen=True)
class Table:
    """A sortable table (click a header); each cell keeps its raw value for sorting."""

    table_id: str | None
    columns: list[tuple[str, str]]  # (name, its definition: the header's tooltip)
    rows: list[tuple[str | None, list[Cell]]]  # (row class, cells)


def table(frame: pd.DataFrame, columns: list[str], table_id: str | None = None,
          row_class: Callable[[pd.Series], str] | None = None, titles: dict[str, str] | None = None,
          headers: dict[str, str] | None = None, sort_by: dict[str, str] | None = None) -> Table:
    """``headers``: a column's header where it is not the column's name; ``sort_by``: the column whose value
    sorts a column of text (a figure written with its interval sorts by the figure)."""
    titles, headers, sort_by = titles or {}, headers or {}, sort_by or {}
    rows = []
    for _, row in frame.iterrows():
        cells = []
        for column in columns:
            value = row[column]
            css = "wrap" if column in WRAPPED else "text" if isinstance(value, str) else None
            cells.append(Cell(fmt(value, column), _raw(row[sort_by.get(column, column)]), css))
        rows.append((row_class(row) if row_class else None, cells))
    header = [(headers.get(column, column), titles.get(column, COLUMNS.get(column, ("", column))[1])) for column in columns]
    return Table(table_id, header, rows)


def _raw(value) -> str:
    """What the sorting script compares: numbers in full precision, text as it is."""
    number = isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))
    return "" if is_missing(value) else f"{float(value):.12g}" if number else str(value)


# ---------------------------------------------------------------------------------------------------
# Figures


@dataclass(frozen=True)
class FigureBlock:
    """A drawn figure (``png_base64``) with its caption and what it leaves out (``note``), or the note
    saying why it is left out itself (``left_out``)."""

    name: str
    title: str
    caption: str
    png_base64: str | None
    left_out: str | None
    note: str | None = None


def figure_block(name: str, title: str, written: Path | str, captions: dict[str, str], note: str | None = None) -> FigureBlock:
    """``written``: the figure's PNG, or the note saying why it was not drawn; ``note``: what a drawn
    figure leaves out."""
    if isinstance(written, str):
        return FigureBlock(name, title, "", None, written)
    encoded = base64.b64encode(Path(written).read_bytes()).decode("ascii")
    return FigureBlock(name, title, captions.get(name, ""), encoded, None, note)


# ---------------------------------------------------------------------------------------------------
# Rendering

TEMPLATES = jinja2.Environment(
    loader=jinja2.PackageLoader("ftbench.report", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,  # a name the page needs but was not given fails the render
    trim_blocks=True,
    lstrip_blocks=True,
)
TEMPLATES.filters.update(fmt=fmt, money=money)


def render(template: str, path: str | Path, **context) -> None:
    """Render a page template (report.html.j2, compare.html.j2) into ``path``."""
    atomic.write_text(path, TEMPLATES.get_template(template).render(**context))
