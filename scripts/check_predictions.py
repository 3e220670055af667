"""The step-time prediction checked against runs it did not see: calibrate on some measured runs, predict the
others, print predicted / measured tokens/s per run and whether each meets its target.

Splits (every one is run unless --only names some):
- family: for each model of the results, calibrate on the runs of the other models and predict its runs
  ("unseen family"). Target for GPU-bound runs: within +-15%.
- folds: the runs cut into --folds groups (every model in each); calibrate on all groups but one, predict it
  ("calibrated family": batch, sequence length, method, precision, kernels varied). Target: within +-10%.
- transfer: for each two GPU models of the results, calibrate on one and predict the other from its datasheet alone
  ("datasheet only"): the error an uncalibrated GPU model's prediction carries (no target; its spread is what
  fit_calibration.py --transfer-sd takes).
Host-bound runs (measured GPU busy below 0.8; predicted where NVML measured nothing) have one target in every
split: the 95% interval contains the measurement.

    python scripts/check_predictions.py results/metrics.parquet
    python scripts/check_predictions.py h200/metrics.parquet h100/metrics.parquet --only transfer
    python scripts/check_predictions.py results/metrics.parquet --combine sum     # the other ways of combining terms

Runs are read as scripts/fit_calibration.py reads them (each table with results/runs/ beside it).
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from collections import defaultdict

import numpy as np

from ftbench.errors import FtbenchError
from ftbench.experiment import calibration as calibrations
from ftbench.experiment import step_time
from ftbench.measure import gpu_table
from ftbench.report import prediction

TARGETS = {"unseen family": 0.15, "calibrated family": 0.10}


def outcome(sample: calibrations.Sample, model: str, kind: str, calibration: calibrations.Calibration) -> dict:
    """One held-out run: its prediction under ``calibration`` against its measurement, and whether it meets the
    target of its kind."""
    terms = step_time.step_terms(sample.workload, sample.gpu, calibration.params_for(sample.gpu["name"]), calibration.combine)
    predicted_host_bound = terms["busy_share"] < calibrations.HOST_BOUND
    busy = sample.busy_share
    host_bound = busy < calibrations.HOST_BOUND if busy is not None else predicted_host_bound
    spread = calibrations.Z95 * calibration.spread(sample.gpu["name"], predicted_host_bound)
    ratio = sample.step_s / terms["step_s"]  # predicted / measured tokens/s
    contains = math.exp(-spread) <= 1 / ratio <= math.exp(spread)
    limit = TARGETS.get(kind)
    meets = contains if host_bound else (abs(ratio - 1) <= limit if limit is not None else None)
    return {"run": sample.run_id, "model": model, "gpu": sample.gpu["name"], "kind": kind,
            "predicted": sample.workload.tokens_per_step / terms["step_s"],
            "measured": sample.workload.tokens_per_step / sample.step_s, "ratio": ratio,
            "predicted_busy": terms["busy_share"], "measured_busy": busy, "host_bound": host_bound,
            "interval": (math.exp(-spread), math.exp(spread)), "contains": contains, "meets": meets}


def family_split(samples, models, start, combine) -> list[dict]:
    out = []
    for model in sorted(set(models)):
        train = [s for s, m in zip(samples, models) if m != model]
        test = [(s, m) for s, m in zip(samples, models) if m == model]
        if not train:
            continue
        fitted = calibrations.fit(train, start, combine)
        out += [outcome(s, m, "unseen family", fitted) for s, m in test if s.gpu["name"] in fitted.gpus]
    return out


def fold_split(samples, models, start, combine, folds: int) -> list[dict]:
    # a run's fold from its name, so a run stays in its fold whatever else the results hold
    fold_of = [zlib.crc32(s.run_id.encode()) % folds for s in samples]
    out = []
    for fold in range(folds):
        train = [s for s, f in zip(samples, fold_of) if f != fold]
        test = [(s, m) for s, m, f in zip(samples, models, fold_of) if f == fold]
        if not train or not test:
            continue
        fitted = calibrations.fit(train, start, combine)
        out += [outcome(s, m, "calibrated family", fitted) for s, m in test if s.gpu["name"] in fitted.gpus]
    return out


def transfer_split(samples, models, start, combine) -> list[dict]:
    out = []
    names = sorted({s.gpu["name"] for s in samples})
    for source in names:
        fitted = calibrations.fit([s for s in samples if s.gpu["name"] == source], start, combine)
        for target in names:
            if target != source:
                out += [outcome(s, m, f"datasheet only (from {source})", fitted)
                        for s, m in zip(samples, models) if s.gpu["name"] == target]
    return out


def print_outcomes(outcomes: list[dict]) -> None:
    print(f"{'run':<58} {'gpu':<9} {'kind':<26} {'pred tok/s':>10} {'meas tok/s':>10} {'pred/meas':>9} "
          f"{'95% of pred/meas':>17} {'busy p/m':>10} target")
    for row in outcomes:
        busy = "-" if row["measured_busy"] is None else f"{row['measured_busy']:.2f}"
        verdict = {True: "met", False: "MISSED", None: "-"}[row["meets"]]
        target = "interval" if row["host_bound"] else f"+-{TARGETS[row['kind']]:.0%}" if row["kind"] in TARGETS else ""
        print(f"{row['run'][:58]:<58} {row['gpu']:<9} {row['kind'][:26]:<26} {row['predicted']:>10,.0f} "
              f"{row['measured']:>10,.0f} {1 / row['ratio']:>9.3f} {row['interval'][0]:>8.3f}-{row['interval'][1]:<8.3f} "
              f"{row['predicted_busy']:>4.2f}/{busy:<5} {target} {verdict}{' (host-bound)' if row['host_bound'] else ''}")


def summary(outcomes: list[dict]) -> list[str]:
    """Per kind and bound: runs, how many met their target, median and largest |predicted / measured - 1|."""
    groups = defaultdict(list)
    for row in outcomes:
        groups[(row["kind"], "host-bound" if row["host_bound"] else "GPU-bound")].append(row)
    lines = []
    for (kind, bound), rows in sorted(groups.items()):
        errors = np.abs(np.array([1 / row["ratio"] for row in rows]) - 1)
        met = [row["meets"] for row in rows if row["meets"] is not None]
        verdict = f"target met {sum(met)}/{len(met)}" if met else "no target"
        lines.append(f"{kind}, {bound}: {len(rows)} runs, {verdict}, |pred/meas - 1| median "
                     f"{np.median(errors):.3f}, max {errors.max():.3f}, log sd {np.sqrt(np.mean(np.log(1 / np.array([r['ratio'] for r in rows])) ** 2)):.3f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tables", nargs="+", help="results/metrics.parquet files (results/runs/ beside each)")
    parser.add_argument("--gpus", default="config/gpus.yaml")
    parser.add_argument("--only", nargs="+", choices=("family", "folds", "transfer"), default=None)
    parser.add_argument("--folds", type=int, default=3)
    parser.add_argument("--combine", choices=step_time.COMBINES, default="smooth")
    args = parser.parse_args(argv)
    gpus = gpu_table.load_peaks(args.gpus)
    measured = [item for table in args.tables for item in prediction.read_measured(table, gpus)]
    samples = prediction.samples(measured)
    model_of = {item.run.run_id: item.run.model for item in measured}
    models = [model_of[sample.run_id] for sample in samples]
    if not samples:
        raise FtbenchError(f"{', '.join(args.tables)}: no finished GPU run to check")
    start, splits = calibrations.priors(), args.only or ["family", "folds", "transfer"]
    outcomes = ((family_split(samples, models, start, args.combine) if "family" in splits else [])
                + (fold_split(samples, models, start, args.combine, args.folds) if "folds" in splits else [])
                + (transfer_split(samples, models, start, args.combine) if "transfer" in splits else []))
    print(f"{len(samples)} runs on {', '.join(sorted({s.gpu['name'] for s in samples}))}; combine {args.combine}")
    print_outcomes(outcomes)
    print("\n".join(summary(outcomes)))


if __name__ == "__main__":
    try:
        main()
    except FtbenchError as exc:
        print(f"ftbench: {exc}", file=sys.stderr)
        sys.exit(1)
