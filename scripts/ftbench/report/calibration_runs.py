"""The measured runs a calibration is fitted to, as a compact table a person can read and a repository can keep
(config/calibration-runs/*.csv, one file per invocation): exactly the columns the fit reads (the measured window,
the batches' shape, the GPU's busy share), what each run was measured on (GPU, driver, CUDA, library versions,
host and its CPU) and the run's spec as JSON, so the step-time workload is rebuilt from the table alone.

    python scripts/fit_calibration.py --add results/metrics.parquet --to config/calibration-runs/h200-a.csv

A table is written with Python's csv module: floats as their shortest exact repr, missing values empty, rows in
run_id order, so converting the same results twice gives the same bytes and a refit from the tables gives the
same calibration (scripts/fit_calibration.py, tests/test_calibration_runs.py).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import math
from pathlib import Path

from ftbench import atomic
from ftbench.errors import FtbenchError
from ftbench.measure import gpu_table
from ftbench.report import prediction
from ftbench.runspec import RunSpec

# column -> type; in the order written. The fit's inputs (experiment/step_time.py measured_shape,
# report/prediction.py samples), then what the runs were measured on, then the spec.
COLUMNS = {
    "run_id": str, "config_id": str, "device": str, "device_name": str, "world_size": int,
    "measured_steps": int, "measured_time_s": float, "measured_tokens": int, "flops_per_step_analytic": float,
    "tokens_per_s": float, "tokens_per_s_low": float, "tokens_per_s_high": float,
    "padding_fraction": float, "packing_efficiency": float, "shape_change_share": float, "gpu_busy_share": float,
    "data_kind": str,
    "gpu_driver": str, "cuda_version": str, "torch_version": str, "transformers_version": str, "peft_version": str,
    "bitsandbytes_version": str, "cpu": str, "host": str, "git_commit": str, "collected": str,
    "spec": str,
}
DEFAULT_FOLDER = Path("config/calibration-runs")


def from_results(metrics_path: str | Path, gpus: list[dict], specs: dict[str, RunSpec] | None = None) -> list[dict]:
    """The compact rows of a results table's finished GPU runs (those the fit reads: report/prediction.py
    read_measured), each with its spec and the date its table was collected. ``specs``: run_id -> spec for a table
    copied without its runs' folders (its experiment's runs, expanded again)."""
    metrics_path = Path(metrics_path)
    if not metrics_path.is_file():
        raise FtbenchError(f"--add {metrics_path}: not found (expected a results/metrics.parquet)")
    collected = datetime.date.fromtimestamp(metrics_path.stat().st_mtime).isoformat()
    rows = []
    for item in prediction.read_measured(metrics_path, gpus, specs):
        row = {name: item.row.get(name) for name in COLUMNS}
        row.update(collected=collected, spec=json.dumps(item.run.to_dict(), sort_keys=True, separators=(",", ":")))
        rows.append(row)
    if not rows:
        raise FtbenchError(f"--add {metrics_path}: no finished GPU run on a GPU of the table with a readable spec "
                           "(runs/<run_id>/metrics.json beside it, or --experiment naming the config that made it)")
    return sorted(rows, key=lambda row: row["run_id"])


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(float(value)) if isinstance(value, float) else str(value)


def write(path: str | Path, rows: list[dict]) -> None:
    """The rows as a CSV table (atomically)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([list(COLUMNS)] + [[_cell(row.get(name)) for name in COLUMNS] for row in rows])
    atomic.write_text(path, out.getvalue())


def read(path: str | Path) -> list[dict]:
    """A compact table's rows, typed (COLUMNS), missing values None."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [name for name in COLUMNS if name not in (reader.fieldnames or [])]
            if missing:
                raise FtbenchError(f"calibration runs {path}: missing columns {', '.join(missing)} (write it with "
                                   "scripts/fit_calibration.py --add)")
            rows = list(reader)
    except OSError as exc:
        raise FtbenchError(f"calibration runs {path}: not readable ({exc})") from None
    typed = []
    for number, row in enumerate(rows, start=2):
        try:
            typed.append({name: None if row[name] == "" else kind(row[name]) for name, kind in COLUMNS.items()})
        except ValueError as exc:
            raise FtbenchError(f"calibration runs {path}, line {number}: {exc}") from None
    return typed


def measured(path: str | Path, gpus: list[dict]) -> list[prediction.MeasuredRun]:
    """A compact table's runs as the fit reads them (report/prediction.py MeasuredRun), on the GPUs of ``gpus``."""
    out = []
    for row in read(path):
        gpu = gpu_table.entry_for(row["device_name"] or "", gpus)
        if gpu is None:
            continue
        try:
            spec = RunSpec.from_dict(json.loads(row["spec"]))
        except (ValueError, TypeError) as exc:
            raise FtbenchError(f"calibration runs {path}: run {row['run_id']}: its spec is not readable here ({exc})") from None
        out.append(prediction.MeasuredRun(spec, {key: value for key, value in row.items() if key != "spec"},
                                          {**gpu, "device_name": row["device_name"]}))
    return out


def read_any(path: str | Path, gpus: list[dict]) -> list[prediction.MeasuredRun]:
    """The measured runs of a compact table (.csv) or of a results table (metrics.parquet with runs/ beside it)."""
    return measured(path, gpus) if Path(path).suffix == ".csv" else prediction.read_measured(path, gpus)


def tables(folder: str | Path = DEFAULT_FOLDER) -> list[str]:
    """The compact tables of a folder, in name order (what a refit reads by default)."""
    return [str(path) for path in sorted(Path(folder).glob("*.csv"))]
