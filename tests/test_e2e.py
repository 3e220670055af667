"""End to end: one real snakemake run of a tiny experiment (full, LoRA, QLoRA) in a temporary folder.

The run itself is the session fixture ``snakemake_run`` in conftest.py.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pandas as pd
import pytest

from ftbench.tasks import registry
from ftbench.data import batch_order, prepared
from ftbench.experiment import matrix
from ftbench.report.columns import COLUMNS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(snakemake_run):
    workdir, config, _ = snakemake_run
    return workdir / "results", config


def test_metrics_parquet_has_one_ok_row_per_run(results):
    folder, config = results
    table = pd.read_parquet(folder / "metrics.parquet")
    runs = matrix.expand_runs(config)
    assert sorted(table["run_id"]) == sorted(run.run_id for run in runs)
    assert table["run_id"].is_unique
    assert (table["status"] == "ok").all(), table[["run_id", "status", "status_reason"]].to_string()
    assert sorted(table["method"]) == ["full", "lora", "qlora"]
    assert (table["measured_steps"] == 4).all() and (table["total_steps"] == 6).all()
    for column in ("tokens_per_s", "samples_per_s", "step_time_median_s", "peak_memory_mb", "wall_time_s",
                   "trainable_params", "total_params"):
        assert table[column].notna().all() and (table[column] > 0).all(), column
    assert table["eval_accuracy"].between(0, 1).all()
    assert table["torch_version"].notna().all() and table["host"].notna().all()


def test_metrics_columns_are_the_documented_ones(results):
    folder, _ = results
    table = pd.read_parquet(folder / "metrics.parquet")
    assert list(table.columns) == list(COLUMNS)
    for name, (dtype, _) in COLUMNS.items():
        assert str(table[name].dtype).lower() == dtype.lower(), (name, table[name].dtype)


def test_csv_twin_matches_the_parquet(results):
    folder, _ = results
    parquet = pd.read_parquet(folder / "metrics.parquet")
    csv = pd.read_csv(folder / "metrics.csv")
    assert list(csv.columns) == list(parquet.columns)
    assert csv["run_id"].tolist() == parquet["run_id"].tolist()
    assert np.allclose(csv["tokens_per_s"], parquet["tokens_per_s"].astype(float))


def test_report_html_is_self_contained_with_embedded_images(results):
    folder, _ = results
    html = (folder / "report.html").read_text(encoding="utf-8")
    images = re.findall(r'<img[^>]*src="data:image/png;base64,([A-Za-z0-9+/=\s]+)"', html)
    assert len(images) >= 3  # memory, throughput, accuracy at least
    for encoded in images:
        assert base64.b64decode(encoded).startswith(b"\x89PNG\r\n\x1a\n")
    # opens from disk with no server: no image, script or stylesheet fetched from elsewhere
    assert not re.search(r'(src|href)="(https?:)?//', html)
    for run_id in pd.read_parquet(folder / "metrics.parquet")["run_id"]:
        assert run_id in html


def test_each_run_folder_has_its_spec_steps_and_environment(results):
    folder, config = results
    for run in matrix.expand_runs(config):
        run_dir = folder / "runs" / run.run_id
        result = json.loads((run_dir / "metrics.json").read_text())
        assert result["spec"] == run.to_dict()  # the job received exactly its own spec
        assert result["metrics"]["status"] == "ok"
        assert result["environment"]["libraries"]["torch"]
        steps = pd.read_parquet(run_dir / "steps.parquet")
        assert len(steps) == 6 and steps["measured"].sum() == 4
        assert int(steps.loc[steps["measured"], "tokens"].sum()) == result["metrics"]["measured_tokens"]


def test_step_tokens_are_the_real_lengths_of_the_stored_sequences(results):
    folder, config = results
    runs = matrix.expand_runs(config)
    (data_id,) = {run.data_id for run in runs}
    data_dir = folder / "data" / data_id
    manifest = prepared.verify(data_dir)
    lengths = np.array([len(ids) for ids in registry.load_split(data_dir, "train", manifest).input_ids])
    for run in runs:
        steps = pd.read_parquet(folder / "runs" / run.run_id / "steps.parquet")
        order = batch_order.batch_order(len(lengths), run.batch_size, len(steps), run.seed)
        expected = [int(lengths[indices].sum()) for indices in order]
        assert steps["tokens"].tolist() == expected
        assert (steps["tokens"] <= steps["padded_tokens"]).all()


def test_one_shared_data_preparation(results):
    folder, config = results
    folders = [path for path in (folder / "data").iterdir() if path.is_dir()]
    assert [path.name for path in folders] == [matrix.expand_runs(config)[0].data_id]
    manifest = prepared.verify(folders[0])
    assert manifest["splits"]["train"]["rows"] == 100 and manifest["splits"]["eval"]["rows"] == 50
