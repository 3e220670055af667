"""Gather every run's metrics.json into one table: ``metrics.parquet`` plus a CSV twin."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from . import atomic
from .columns import COLUMNS, row_from_result


def build_table(result_files: list[str | Path]) -> pd.DataFrame:
    rows = [row_from_result(json.loads(Path(path).read_text(encoding="utf-8"))) for path in result_files]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    return frame.astype({name: dtype for name, (dtype, _) in COLUMNS.items()})


def collect(result_files: list[str | Path], parquet_path: str | Path, csv_path: str | Path) -> pd.DataFrame:
    frame = build_table(result_files)
    atomic.write_parquet(parquet_path, frame)
    atomic.write_csv(csv_path, frame)
    return frame
