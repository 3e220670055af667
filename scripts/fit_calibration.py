"""Fit the step-time model's calibration to measured runs and write it (config/calibration.yaml is the shipped one).

The shipped calibration is a pure function of the tables in config/calibration-runs/ (one CSV per invocation of
config/examples/calibration.yaml: the columns the fit reads, what each run was measured on, its spec): with no
tables named, this refits config/calibration.yaml from them, and the same tables give the same file
(tests/test_calibration_runs.py checks the shipped one). A results folder becomes such a table with --add:

    python scripts/fit_calibration.py --add results/metrics.parquet --to config/calibration-runs/h200-a.csv
    python scripts/fit_calibration.py --experiment config/examples/calibration.yaml \
        --transfer-from config/calibration-transfer/h200.yaml                         # config/calibration.yaml

--transfer-from names a calibration of another GPU model (config/calibration-transfer/h200.yaml: an H200 fit whose
tables are lost, kept as this input): transfer_sd, the spread of a datasheet-only prediction, is then the root mean
square of log(predicted / measured) of that calibration predicting the tables' runs from their GPU's datasheet
(calibrations.transfer_spread), so it is refitted from committed files like every other figure.

Tables may also be results tables (results/metrics.parquet, with results/runs/<run_id>/metrics.json beside it for
each run's spec), read in place; --add of a results table copied without its runs' folders takes the specs from
--experiment, expanded again. Reads every finished GPU run of the tables, fits the parameters
(scripts/ftbench/experiment/calibration.py: per GPU model its efficiencies, globally the traffic multipliers and the host terms), sets each GPU model's interval from
its runs each predicted by a fit of the other folds (calibration.held_out_spread), prints each run's predicted /
measured step time under the fit, and writes the file with a header saying what the runs were measured on (their
cards, driver, torch and library versions, host CPU; --experiment names the config that made them).

    python scripts/fit_calibration.py config/calibration-runs/*.csv my-runs.csv --out my-calibration.yaml
    python scripts/fit_calibration.py a/metrics.parquet b/metrics.parquet --out my-calibration.yaml --combine sum

How well it predicts runs it did not see: scripts/check_predictions.py.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import sys
import textwrap
from pathlib import Path

from ftbench import cli
from ftbench.experiment import calibration as calibrations
from ftbench.experiment import step_time
from ftbench.errors import FtbenchError
from ftbench.measure import gpu_table
from ftbench.report import calibration_runs, prediction

DEFAULT_OUT = "config/calibration.yaml"


def measured_samples(tables: list[str], gpus: list[dict]) -> tuple[list[calibrations.Sample], list[prediction.MeasuredRun]]:
    """The fit's samples from every table (compact .csv or results metrics.parquet), and the measured runs."""
    measured = [item for table in tables for item in calibration_runs.read_any(table, gpus)]
    return prediction.samples(measured), measured


SOFTWARE = (("torch", "torch_version"), ("transformers", "transformers_version"), ("peft", "peft_version"),
            ("bitsandbytes", "bitsandbytes_version"))


def measured_on(measured: list[prediction.MeasuredRun], tables: list[str], experiment: str | None,
                command: str) -> list[str]:
    """The header lines saying what the runs were measured on: cards and driver, software, host CPU, the commands."""
    def values(column: str) -> str:
        return ", ".join(sorted({str(item.row.get(column)) for item in measured if item.row.get(column)})) or "?"
    made = f"the runs of {experiment}" if experiment else f"the runs of {', '.join(tables)}"
    if len(tables) > 1:  # several invocations: say how the runs stand to the configurations
        runs_per_config = collections.Counter(item.run.run_id for item in measured)
        again = sum(count > 1 for count in runs_per_config.values())
        made += f" ({len(runs_per_config)} configurations in {len(tables)} invocations, {again} of them measured more than once)"
    software = ", ".join(f"{name} {values(column)}" for name, column in SOFTWARE)
    lines = textwrap.wrap(f"Fitted to {len(measured)} finished GPU runs: {made}, measured on {values('device_name')} "
                          f"(driver {values('gpu_driver')}, CUDA {values('cuda_version')}), {software}, host CPU "
                          f"{values('cpu')}:", 116)
    if experiment:
        lines.append(f"  snakemake --cores all --resources gpu=1 --configfile {experiment}")
    return [*lines, f"  {command}"]


def report_fit(samples: list[calibrations.Sample], fitted: calibrations.Calibration) -> list[str]:
    """One line per run: predicted and measured seconds per step, their ratio, busy shares; then each GPU model."""
    lines = [f"{'run':<60} {'gpu':<10} {'predicted s':>11} {'measured s':>10} {'ratio':>6} {'busy pred/meas':>14}"]
    for sample in samples:
        terms = step_time.step_terms(sample.workload, sample.gpu, fitted.params_for(sample.gpu["name"]), fitted.combine)
        measured_busy = "-" if sample.busy_share is None else f"{sample.busy_share:.2f}"
        lines.append(f"{sample.run_id[:60]:<60} {sample.gpu['name']:<10} {terms['step_s']:>11.4f} {sample.step_s:>10.4f} "
                     f"{terms['step_s'] / sample.step_s:>6.3f} {terms['busy_share']:>8.2f}/{measured_busy:<5}")
    for name, entry in fitted.gpus.items():
        lines.append(f"{name}: compute_efficiency {entry['compute_efficiency']:.3f}, memory_efficiency "
                     f"{entry['memory_efficiency']:.3f}, {entry['runs']} runs ({entry['host_bound_runs']} host-bound), "
                     f"held-out residual sd GPU-bound {entry['sd_gpu_bound']:.3f}, host-bound {entry['sd_host_bound']:.3f} "
                     f"(95%: x{math.exp(1.96 * entry['sd_gpu_bound']):.3f} / x{math.exp(1.96 * entry['sd_host_bound']):.3f})")
    lines.append("global: " + ", ".join(f"{name} {value:.4g}" for name, value in fitted.params.items()))
    return lines


def add(metrics: str, to: str | None, gpus: list[dict], experiment: str | None) -> None:
    """--add: a results table's finished GPU runs as a compact table (report/calibration_runs.py); the runs' specs
    from results/runs/ beside it, else from --experiment expanded again (a run_id names one spec)."""
    if not to:
        raise FtbenchError("--add: expected --to naming the table to write, e.g. config/calibration-runs/h200-a.csv")
    if Path(to).suffix != ".csv":
        raise FtbenchError(f"--to {to}: expected a .csv file")
    specs = None
    if experiment:
        from ftbench.experiment import config, matrix

        specs = {run.run_id: run for run in matrix.expand_runs(config.load_config(experiment))}
    rows = calibration_runs.from_results(metrics, gpus, specs)
    calibration_runs.write(to, rows)
    gpus_seen = sorted({str(row["device_name"]) for row in rows})
    print(f"wrote {to}: {len(rows)} finished GPU runs of {metrics} ({', '.join(gpus_seen)}); "
          f"refit with: python scripts/fit_calibration.py")


def transfer_spread(source: str | None, given: float | None, samples: list[calibrations.Sample]) -> float | None:
    """transfer_sd: given, or measured from ``source``'s datasheet-only predictions of ``samples``; else None."""
    if source is None:
        return given
    if given is not None:
        raise FtbenchError("--transfer-sd and --transfer-from: expected one of them (--transfer-from measures it)")
    fitted = calibrations.transfer_spread(calibrations.load(source), samples)
    print(f"transfer_sd {fitted:.4f}: the log spread of {source}'s datasheet-only predictions of "
          f"{len(calibrations.datasheet_only(calibrations.load(source), samples))} runs")
    return fitted


def reproducing_command(argv: list[str]) -> str:
    """The command that rebuilds the file, for its header: this one without --out, which says only where it went."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg == "--out" or arg.startswith("--out="):
            skip = arg == "--out"
            continue
        kept.append(arg)
    return " ".join(["python scripts/fit_calibration.py", *kept])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="*", help="compact tables (.csv) or results/metrics.parquet files (results/runs/ "
                        "beside each); default: every table of config/calibration-runs/")
    parser.add_argument("--out", default=DEFAULT_OUT, help="calibration file to write (default: %(default)s)")
    parser.add_argument("--add", metavar="METRICS", default=None,
                        help="write a results/metrics.parquet's finished GPU runs as a compact table (--to) and stop")
    parser.add_argument("--to", default=None, help="with --add: the .csv to write, e.g. config/calibration-runs/h200-a.csv")
    parser.add_argument("--gpus", default="config/gpus.yaml", help="GPU table (default: %(default)s)")
    parser.add_argument("--start", default=None, help="calibration to start from (default: the starting values)")
    parser.add_argument("--combine", choices=step_time.COMBINES, default="smooth", help="how the terms make a step")
    parser.add_argument("--transfer-sd", type=float, default=None,
                        help="log spread of datasheet-only predictions, as check_predictions.py measured it")
    parser.add_argument("--transfer-from", metavar="CALIBRATION", default=None,
                        help="a calibration of another GPU model: transfer_sd is the spread of its datasheet-only "
                        "predictions of the tables' runs (calibrations.transfer_spread)")
    parser.add_argument("--experiment", default=None, help="the experiment config that made the runs (for the header; "
                        "with --add, the runs' specs where the results have no runs/ folder beside them)")
    args = parser.parse_args(argv)
    gpus = gpu_table.load_peaks(args.gpus)
    if args.add:
        add(args.add, args.to, gpus, args.experiment)
        return
    tables = args.tables or calibration_runs.tables()
    if not tables:
        raise FtbenchError(f"no tables named and none in {calibration_runs.DEFAULT_FOLDER}/ (add one with --add)")
    samples, measured = measured_samples(tables, gpus)
    start = calibrations.load(args.start) if args.start else calibrations.priors()
    transfer_sd = transfer_spread(args.transfer_from, args.transfer_sd, samples)
    if transfer_sd is not None:
        start = dataclasses.replace(start, transfer_sd=transfer_sd)
    source = f"{len(samples)} runs of {', '.join(str(Path(table)) for table in tables)}"
    fitted = calibrations.fit(samples, start, args.combine, source=source, host=prediction.hosts_of(measured))
    fitted = calibrations.held_out_spread(fitted, samples, start)
    print("\n".join(report_fit(samples, fitted)))
    command = reproducing_command(argv if argv is not None else sys.argv[1:])
    collected = sorted(str(item.row["collected"]) for item in measured if item.row.get("collected"))
    calibrations.save(fitted, args.out, measured_on(measured, tables, args.experiment, command),
                      fitted=collected[-1] if collected else None)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    cli.run(main)  # an ftbench error is one line on stderr and exit status 1, as the package's commands do
