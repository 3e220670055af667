"""The calibration's data in the repository (report/calibration_runs.py, scripts/fit_calibration.py): a results
folder becomes a compact table holding everything the fit reads, a refit from the tables alone is the same
calibration as a fit from the results, and the same tables always give the same file, byte for byte: the shipped
config/calibration.yaml from config/calibration-runs/, and a synthetic calibration from its fixture table.

tests/fixtures/calibration-runs/synthetic-h200.csv is a TEST FIXTURE, not calibration data: the runs of
config/examples/calibration.yaml "measured" at the step time an H200 calibration (config/calibration-transfer/h200.yaml)
predicts on an H200, times a log-normal noise (sd 0.05), made by ``write_fixture`` (``python
tests/test_calibration_runs.py`` writes it again, and the synthetic calibration fitted to it).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from ftbench import cli
from ftbench.errors import FtbenchError
from ftbench.experiment import calibration as calibrations
from ftbench.experiment import config as ftbench_config
from ftbench.experiment import matrix
from ftbench.measure import gpu_table
from ftbench.report import calibration_runs
from test_prediction import H200, experiment, llama, runs_of, write_results

GPUS = gpu_table.load_peaks(ROOT / "config" / "gpus.yaml")
FIXTURE = Path("tests/fixtures/calibration-runs/synthetic-h200.csv")
FIXTURE_CALIBRATION = Path("tests/fixtures/calibration-synthetic.yaml")
FIT = [sys.executable, "scripts/fit_calibration.py"]


def script(name: str):
    """scripts/<name>.py as a module, to call its main in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fit_script():
    return script("fit_calibration")


def write_fixture(folder: Path) -> None:
    """The fixture table (module docstring) and the calibration fitted to it, from the repository's root."""
    runs = matrix.expand_runs(ftbench_config.load_config(str(ROOT / "config/examples/calibration.yaml")))
    metrics = write_results(folder, runs, H200, calibrations.load(ROOT / "config/calibration-transfer/h200.yaml"),
                            noise=0.05, seed=5)
    rows = [{**row, "cpu": "none: synthetic test fixture, made by the step-time model", "host": "fixture",
             "collected": "2026-12-07"} for row in calibration_runs.from_results(metrics, GPUS)]
    calibration_runs.write(ROOT / FIXTURE, rows)
    subprocess.run([*FIT, str(FIXTURE), "--out", str(FIXTURE_CALIBRATION)], cwd=ROOT, check=True, capture_output=True)


def header_command(calibration_file: Path) -> list[str]:
    """The command a calibration file's header says rebuilds it."""
    lines = [line[1:].strip() for line in calibration_file.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
    command = next(line for line in lines if line.startswith("python scripts/fit_calibration.py"))
    return [sys.executable, *shlex.split(command)[1:]]


def refit_matches(calibration_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "refit.yaml"
    done = subprocess.run([*header_command(ROOT / calibration_file), "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert out.read_text(encoding="utf-8") == (ROOT / calibration_file).read_text(encoding="utf-8")


def test_a_refit_from_the_fixture_table_is_its_calibration_byte_for_byte(tmp_path):
    refit_matches(FIXTURE_CALIBRATION, tmp_path)


def test_the_shipped_calibration_is_the_refit_of_its_committed_tables(tmp_path):
    """config/calibration.yaml is a pure function of config/calibration-runs/*.csv (and the transfer check's input
    calibration its header's command names): never skipped, so a shipped file edited by hand or fitted to other
    tables fails here."""
    assert calibration_runs.tables(ROOT / calibration_runs.DEFAULT_FOLDER), "config/calibration-runs/ holds no table"
    shipped = (ROOT / "config/calibration.yaml").read_text(encoding="utf-8")
    assert "config/calibration-runs/" in shipped and "--transfer-from" in shipped
    refit_matches(Path("config/calibration.yaml"), tmp_path)


def test_the_compact_table_holds_everything_the_fit_reads(tmp_path, monkeypatch, capsys):
    """A fit from the table written by --add is the fit from the results folder it came from, and converting the
    same results twice writes the same bytes."""
    runs = runs_of(experiment(tmp_path, {"small": llama(512, 4, 1376, 8, 4, 8000)}, {"method": ["full", "lora"],
                                                                                    "batch_size": [1, 8]}))
    metrics = write_results(tmp_path / "results", runs, H200, calibrations.load(ROOT / "config/calibration.yaml"),
                            noise=0.05, seed=1)
    table, again = tmp_path / "a.csv", tmp_path / "b.csv"
    monkeypatch.chdir(ROOT)
    fit = fit_script()
    for path in (table, again):
        fit.main(["--add", str(metrics), "--to", str(path)])
    assert table.read_bytes() == again.read_bytes()
    # a results table copied without its runs' folders: the specs from its experiment, expanded again
    alone = tmp_path / "alone" / "metrics.parquet"
    alone.parent.mkdir()
    alone.write_bytes(metrics.read_bytes())
    fit.main(["--add", str(alone), "--to", str(tmp_path / "alone.csv"), "--experiment", str(tmp_path / "experiment.yaml")])
    assert ([row["spec"] for row in calibration_runs.read(tmp_path / "alone.csv")]
            == [row["spec"] for row in calibration_runs.read(table)])
    assert table.read_text(encoding="utf-8").splitlines()[0] == ",".join(calibration_runs.COLUMNS)
    from_results = [item for item in calibration_runs.read_any(metrics, GPUS)]
    from_table = calibration_runs.read_any(table, GPUS)
    assert [item.run for item in from_table] == sorted((item.run for item in from_results), key=lambda run: run.run_id)
    fitted = {}
    for name, source in (("results", metrics), ("table", table)):
        out = tmp_path / f"{name}.yaml"
        fit.main([str(source), "--out", str(out)])
        fitted[name] = calibrations.load(out)
    assert "wrote" in capsys.readouterr().out
    assert fitted["table"].params == fitted["results"].params
    assert fitted["table"].gpus == fitted["results"].gpus


def test_a_broken_table_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "broken.csv"
    broken.write_text("run_id,device_name\nx,NVIDIA H200\n", encoding="utf-8")
    with pytest.raises(FtbenchError, match="broken.csv: missing columns config_id"):
        calibration_runs.read(broken)
    monkeypatch.chdir(ROOT)
    fit = fit_script()
    for argv, message in ((["--add", "nowhere/metrics.parquet"],
                           "ftbench: --add: expected --to naming the table to write, e.g. config/calibration-runs/h200-a.csv"),
                          (["--add", "nowhere/metrics.parquet", "--to", str(tmp_path / "x.csv")],
                           "ftbench: --add nowhere/metrics.parquet: not found (expected a results/metrics.parquet)"),
                          ([str(broken)], f"ftbench: calibration runs {broken}: missing columns")):
        with pytest.raises(SystemExit) as stopped:
            cli.run(fit.main, argv)
        assert stopped.value.code == 1
        assert capsys.readouterr().err.strip().startswith(message)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        write_fixture(Path(scratch))
    print(f"wrote {FIXTURE} and {FIXTURE_CALIBRATION}")
