"""The step-time prediction checked against runs it did not see: calibrate on some measured runs, predict the
others, print predicted / measured tokens/s per run and whether each meets its target.

Splits (every one is run unless --only names some):
- family: for each model of the results, calibrate on the runs of the other models and predict its runs
  ("unseen family"). Target for GPU-bound runs: within +-15%.
- folds: the runs cut into --folds groups (every model in each); calibrate on all groups but one, predict it
  ("calibrated family": batch, sequence length, method, precision, kernels varied). Target: within +-10%.
- transfer: for each two GPU models of the results, calibrate on one and predict the other from its datasheet alone
  ("datasheet only"): the error an uncalibrated GPU model's prediction carries (no target; its spread is what
  fit_calibration.py --transfer-sd takes). With --transfer-from CALIBRATION the calibration is that file (fitted
  on another GPU model's runs, e.g. config/calibration-transfer/h200.yaml), predicting every run of the tables and
  of --heldout on a GPU model it measured none of; its last line is the log sd over every such run of the tables
  (not --heldout's), the transfer_sd that fit_calibration.py --transfer-from ships.
- heldout (with --heldout): calibrate on every run of the tables and predict the runs of another experiment's table,
  none of which the fit saw. A run of a model the tables hold (the same model definition) is a "calibrated family"
  run, any other an "unseen family" one.
Each calibration is made as fit_calibration.py makes the shipped one: the fit, and its interval from its own runs
each predicted by a fit of the other folds. Host-bound runs (measured GPU busy below 0.8; predicted where NVML
measured nothing) have one target in every split: the 95% interval contains the measurement. pred/meas is predicted over measured tokens/s; the interval
printed is the prediction's 95% interval over the measurement (it contains 1 where that target is met).

    python scripts/check_predictions.py results/metrics.parquet
    python scripts/check_predictions.py config/calibration-runs/*.csv             # the shipped calibration's runs
    python scripts/check_predictions.py results/metrics.parquet --heldout other/results/metrics.parquet
    python scripts/check_predictions.py results/metrics.parquet --heldout other/metrics.parquet --heldout-config other.yaml
    python scripts/check_predictions.py h200/metrics.parquet h100/metrics.parquet --only transfer
    python scripts/check_predictions.py config/calibration-runs/*.csv --only transfer \
        --transfer-from config/calibration-transfer/h200.yaml                      # the H200 fit predicting H100 runs
    python scripts/check_predictions.py results/metrics.parquet --combine sum     # the other ways of combining terms

Runs are read as scripts/fit_calibration.py reads them (a compact table of config/calibration-runs/, or a results
table with results/runs/ beside it). A held-out table
copied without its runs' folders takes its runs' specs from its experiment's config (--heldout-config), expanded
again: a run_id names one spec, so a run the config does not make is left out.
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict

import numpy as np

from ftbench import cli
from ftbench.errors import FtbenchError
from ftbench.experiment import calibration as calibrations
from ftbench.experiment import config as experiment_config
from ftbench.experiment import matrix, step_time
from ftbench.measure import gpu_table
from ftbench.report import calibration_runs, prediction

TARGETS = {"unseen family": 0.15, "calibrated family": 0.10}


def outcome(sample: calibrations.Sample, model: str, kind: str, calibration: calibrations.Calibration,
            split: str = "") -> dict:
    """One held-out run: its prediction under ``calibration`` against its measurement, and whether it meets the
    target of its kind. ``ratio``: predicted / measured tokens/s; ``interval``: the prediction's 95% interval over
    the measurement."""
    terms = step_time.step_terms(sample.workload, sample.gpu, calibration.params_for(sample.gpu["name"]), calibration.combine)
    predicted_host_bound = terms["busy_share"] < calibrations.HOST_BOUND
    busy = sample.busy_share
    host_bound = busy < calibrations.HOST_BOUND if busy is not None else predicted_host_bound
    spread = calibrations.Z95 * calibration.interval_sd(sample.workload, sample.gpu, terms)
    ratio = sample.step_s / terms["step_s"]  # predicted / measured tokens/s: the same tokens per step over each time
    interval = (ratio * math.exp(-spread), ratio * math.exp(spread))
    contains = interval[0] <= 1 <= interval[1]
    limit = TARGETS.get(kind)
    meets = contains if host_bound else (abs(ratio - 1) <= limit if limit is not None else None)
    return {"run": sample.run_id, "model": model, "gpu": sample.gpu["name"], "kind": kind, "split": split or kind,
            "predicted": sample.workload.tokens_per_step / terms["step_s"],
            "measured": sample.workload.tokens_per_step / sample.step_s, "ratio": ratio,
            "predicted_busy": terms["busy_share"], "measured_busy": busy, "host_bound": host_bound,
            "interval": interval, "contains": contains, "meets": meets}


def calibrate(train: list[calibrations.Sample], start, combine) -> calibrations.Calibration:
    """A calibration of ``train`` as fit_calibration.py makes one: the fit, its spread from its own held-out folds."""
    return calibrations.held_out_spread(calibrations.fit(train, start, combine), train, start)


def family_split(samples, models, start, combine) -> list[dict]:
    out = []
    for model in sorted(set(models)):
        train = [s for s, m in zip(samples, models) if m != model]
        test = [(s, m) for s, m in zip(samples, models) if m == model]
        if not train:
            continue
        fitted = calibrate(train, start, combine)
        out += [outcome(s, m, "unseen family", fitted, "family") for s, m in test if s.gpu["name"] in fitted.gpus]
    return out


def fold_split(samples, models, start, combine, folds: int) -> list[dict]:
    fold_of = [calibrations.fold_of(s.run_id, folds) for s in samples]
    out = []
    for fold in range(folds):
        train = [s for s, f in zip(samples, fold_of) if f != fold]
        test = [(s, m) for s, m, f in zip(samples, models, fold_of) if f == fold]
        if not train or not test:
            continue
        fitted = calibrate(train, start, combine)
        out += [outcome(s, m, "calibrated family", fitted, "folds") for s, m in test if s.gpu["name"] in fitted.gpus]
    return out


def transfer_split(samples, models, start, combine) -> list[dict]:
    out = []
    names = sorted({s.gpu["name"] for s in samples})
    for source in names:
        fitted = calibrate([s for s in samples if s.gpu["name"] == source], start, combine)
        for target in names:
            if target != source:
                out += [outcome(s, m, f"datasheet only (from {source})", fitted, "transfer")
                        for s, m in zip(samples, models) if s.gpu["name"] == target]
    return out


def transfer_from_split(path: str, chosen: list[tuple[calibrations.Sample, str]]) -> list[dict]:
    """--transfer-from: the runs on GPU models the calibration file at ``path`` measured none of, predicted by it
    from their datasheet alone, as plan predicts such a GPU model (its interval from the file's transfer_sd)."""
    source = calibrations.load(path)
    kind = f"datasheet only (from {', '.join(source.gpus) or 'priors'})"
    out = [outcome(s, m, kind, source, "transfer") for s, m in chosen if not source.calibrated(s.gpu["name"])]
    if not out:
        raise FtbenchError(f"--transfer-from {path}: every run is on a GPU model it measured "
                           f"({', '.join(source.gpus)}): nothing to predict from a datasheet")
    return out


def heldout_split(samples, models, start, combine, heldout: list[tuple[calibrations.Sample, str, bool]]) -> list[dict]:
    """The runs of another table (sample, model, whether the tables hold its model definition), predicted with the
    calibration fitted on every run of the tables."""
    fitted = calibrate(samples, start, combine)
    return [outcome(s, m, "calibrated family" if seen else "unseen family", fitted, "heldout")
            for s, m, seen in heldout if s.gpu["name"] in fitted.gpus]


def heldout_samples(table: str, config: str | None, gpus: list[dict],
                    known_models: list[dict]) -> list[tuple[calibrations.Sample, str, bool]]:
    """The held-out table's runs as (sample, model, whether ``known_models`` holds its model definition); specs
    from --heldout-config where the table has no runs' folders beside it."""
    specs = {run.run_id: run for run in matrix.expand_runs(experiment_config.load_config(config))} if config else None
    measured = calibration_runs.measured(table, gpus) if table.endswith(".csv") else prediction.read_measured(table, gpus, specs)
    if not measured:
        raise FtbenchError(f"--heldout {table}: no finished GPU run with a readable spec (runs/<run_id>/metrics.json "
                           "beside it, or --heldout-config naming the experiment that made it)")
    model_of = {item.run.run_id: item.run for item in measured}
    return [(sample, model_of[sample.run_id].model, model_of[sample.run_id].model_def in known_models)
            for sample in prediction.samples(measured)]


def print_outcomes(outcomes: list[dict]) -> None:
    print(f"{'run':<58} {'split':<8} {'kind':<26} {'pred tok/s':>10} {'meas tok/s':>10} {'pred/meas':>9} "
          f"{'95% / meas':>13} {'busy p/m':>10} target")
    for row in outcomes:
        busy = "-" if row["measured_busy"] is None else f"{row['measured_busy']:.2f}"
        verdict = {True: "met", False: "MISSED", None: "-"}[row["meets"]]
        target = "interval" if row["host_bound"] else f"+-{TARGETS[row['kind']]:.0%}" if row["kind"] in TARGETS else ""
        print(f"{row['run'][:58]:<58} {row['split']:<8} {row['kind'][:26]:<26} {row['predicted']:>10,.0f} "
              f"{row['measured']:>10,.0f} {row['ratio']:>9.3f} {row['interval'][0]:>6.3f}-{row['interval'][1]:<6.3f} "
              f"{row['predicted_busy']:>4.2f}/{busy:<5} {target} {verdict}{' (host-bound)' if row['host_bound'] else ''}")


def summary(outcomes: list[dict]) -> list[str]:
    """Per split, kind and bound: runs, how many met their target, pred/meas median and range, mean, median and
    largest |predicted / measured - 1|, how many 95% intervals contain the measurement, the log ratios' root mean
    square (what fit_calibration.py --transfer-from takes as transfer_sd, over GPU- and host-bound runs together)."""
    groups = defaultdict(list)
    for row in outcomes:
        groups[(row["split"], row["kind"], "host-bound" if row["host_bound"] else "GPU-bound")].append(row)
    lines = []
    for (split, kind, bound), rows in sorted(groups.items()):
        ratios = np.array([row["ratio"] for row in rows])
        errors = np.abs(ratios - 1)
        met = [row["meets"] for row in rows if row["meets"] is not None]
        verdict = f"target met {sum(met)}/{len(met)}" if met else "no target"
        inside = sum(row["contains"] for row in rows)
        lines.append(f"{split}: {kind}, {bound}: {len(rows)} runs, {verdict}, pred/meas median {np.median(ratios):.3f} "
                     f"({ratios.min():.3f}-{ratios.max():.3f}), |pred/meas - 1| mean {errors.mean():.3f}, median "
                     f"{np.median(errors):.3f}, max {errors.max():.3f}, inside 95% interval {inside}/{len(rows)}, "
                     f"log sd {np.sqrt(np.mean(np.log(ratios) ** 2)):.3f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", help="results/metrics.parquet files (results/runs/ beside each)")
    parser.add_argument("--gpus", default="config/gpus.yaml")
    parser.add_argument("--only", nargs="+", choices=("family", "folds", "transfer", "heldout"), default=None)
    parser.add_argument("--heldout", default=None, help="another results table to predict with the calibration fitted "
                        "on every run of the tables (none of its runs fitted)")
    parser.add_argument("--heldout-config", default=None, help="the experiment config that made --heldout's table, "
                        "for a table copied without its runs' folders")
    parser.add_argument("--transfer-from", metavar="CALIBRATION", default=None,
                        help="transfer: predict the runs (the tables' and --heldout's) on GPU models this calibration "
                        "file measured none of, from their datasheet, instead of fitting one GPU model of the tables")
    parser.add_argument("--folds", type=int, default=calibrations.FOLDS)
    parser.add_argument("--combine", choices=step_time.COMBINES, default="smooth")
    args = parser.parse_args(argv)
    gpus = gpu_table.load_peaks(args.gpus)
    measured = [item for table in args.tables for item in calibration_runs.read_any(table, gpus)]
    samples = prediction.samples(measured)
    model_of = {item.run.run_id: item.run.model for item in measured}
    models = [model_of[sample.run_id] for sample in samples]
    if not samples:
        raise FtbenchError(f"{', '.join(args.tables)}: no finished GPU run to check")
    splits = args.only or ["family", "folds", "transfer"] + (["heldout"] if args.heldout else [])
    if "heldout" in splits and not args.heldout:
        raise FtbenchError("--only heldout: expected --heldout naming the results table to predict")
    transfer_from = args.transfer_from if "transfer" in splits else None
    heldout = heldout_samples(args.heldout, args.heldout_config, gpus, [item.run.model_def for item in measured]
                              ) if args.heldout and ("heldout" in splits or transfer_from) else []
    start = calibrations.priors()
    outcomes = ((family_split(samples, models, start, args.combine) if "family" in splits else [])
                + (fold_split(samples, models, start, args.combine, args.folds) if "folds" in splits else [])
                + (transfer_split(samples, models, start, args.combine) if "transfer" in splits and not transfer_from else [])
                + (transfer_from_split(transfer_from, [*zip(samples, models), *((s, m) for s, m, _ in heldout)])
                   if transfer_from else [])
                + (heldout_split(samples, models, start, args.combine, heldout) if "heldout" in splits else []))
    print(f"{len(samples)} runs on {', '.join(sorted({s.gpu['name'] for s in samples}))}; combine {args.combine}"
          + (f"; {len(heldout)} held-out runs of {args.heldout}" if heldout else ""))
    print_outcomes(outcomes)
    print("\n".join(summary(outcomes)))
    if transfer_from:
        spread = calibrations.transfer_spread(calibrations.load(transfer_from), samples)
        print(f"transfer_sd (fit_calibration.py --transfer-from): {spread:.4f}, the log sd over the tables' "
              f"{len(calibrations.datasheet_only(calibrations.load(transfer_from), samples))} runs predicted datasheet only")


if __name__ == "__main__":
    cli.run(main)  # an ftbench error is one line on stderr and exit status 1, as the package's commands do
