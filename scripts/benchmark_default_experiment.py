"""How long does a new user wait for the default experiment? `snakemake --cores N` from nothing, timed end to end.

Each tree given is copied (its tracked files, `git archive` of HEAD, or the folder as it is with ``--as-is``) into a
scratch folder once; every repeat then deletes results/, logs/ and .snakemake/ and runs the README's command there,
with that tree's own scripts/ first on PYTHONPATH (so two checkouts can be compared with one installed environment),
and ends the run's warm process after it, as a new user's first run has none to fork from.
Trees take turns (A B, B A, A B, ...) so a drift of the machine falls on both alike. Per tree it prints every wall
time, the minimum and the median, and per run the accuracy and its interval, the evaluations during training and
what the evaluations cost, read back from results/metrics.parquet: a change that made the experiment faster has
to keep the same answers.

    python scripts/benchmark_default_experiment.py --tree . --repeats 3
    python scripts/benchmark_default_experiment.py --tree before=/tmp/old-checkout --tree after=. --repeats 3

Run it on a quiet machine: anything else on the cores shows up in the wall time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

# Per-run columns worth seeing next to the wall time (those a tree's metrics.parquet lacks are skipped).
RUN_COLUMNS = ("eval_accuracy", "eval_accuracy_low", "eval_accuracy_high", "base_eval_accuracy",
               "evaluations_during_training", "eval_during_training_s", "base_eval_time_s", "eval_time_s",
               "train_time_s", "tokens_to_target")


def copy_tree(source: Path, destination: Path, as_is: bool) -> None:
    """The files a fresh clone of ``source`` would have (HEAD), or the folder itself with ``as_is``."""
    if as_is:
        shutil.copytree(source, destination, ignore=shutil.ignore_patterns(
            "results", "logs", ".snakemake", ".git", ".venv", "__pycache__"))
        return
    destination.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(source), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(destination)], input=archive, check=True)


def one_run(tree: Path, cores: int) -> tuple[float, pd.DataFrame]:
    """Wall seconds of `snakemake --cores N` in ``tree`` from nothing, and the runs' metrics it wrote."""
    for leftover in ("results", "logs", ".snakemake"):
        shutil.rmtree(tree / leftover, ignore_errors=True)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree / "scripts")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    started = time.perf_counter()
    finished = subprocess.run(["snakemake", "--cores", str(cores)], cwd=tree, env=environment,
                              capture_output=True, text=True)
    wall = time.perf_counter() - started
    # A new user's first run finds no warm process (cluster/warmstart.py): end this one rather than let the next
    # repeat of this tree fork from it.
    subprocess.run([sys.executable, "-m", "ftbench.cluster.warmstart", "stop"], cwd=tree, env=environment,
                   capture_output=True)
    if finished.returncode != 0:
        sys.exit(f"snakemake failed in {tree} (exit {finished.returncode}):\n{finished.stderr[-3000:]}")
    metrics = pd.read_parquet(tree / "results" / "metrics.parquet")
    return wall, metrics[["run_id"] + [c for c in RUN_COLUMNS if c in metrics.columns]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True,
                        help="a checkout to time, optionally labelled: LABEL=PATH (repeatable)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tree (default 3)")
    parser.add_argument("--cores", type=int, default=2, help="snakemake --cores (default 2, the README's)")
    parser.add_argument("--as-is", action="store_true", help="copy the folders as they are, uncommitted edits included")
    args = parser.parse_args()

    labelled = [entry.split("=", 1) if "=" in entry else (Path(entry).resolve().name, entry) for entry in args.tree]
    with tempfile.TemporaryDirectory(prefix="ftbench-default-") as scratch:
        trees = {}
        for label, path in labelled:
            trees[label] = Path(scratch) / label
            copy_tree(Path(path).resolve(), trees[label], args.as_is)
        walls: dict[str, list[float]] = {label: [] for label in trees}
        last_metrics: dict[str, pd.DataFrame] = {}
        for repeat in range(args.repeats):
            order = list(trees) if repeat % 2 == 0 else list(reversed(trees))
            for label in order:
                wall, last_metrics[label] = one_run(trees[label], args.cores)
                walls[label].append(wall)
                print(f"repeat {repeat + 1} {label}: {wall:.1f} s", flush=True)
        for label, times in walls.items():
            print(f"\n{label}: wall {', '.join(f'{t:.1f}' for t in times)} s; "
                  f"min {min(times):.1f} s, median {statistics.median(times):.1f} s")
            with pd.option_context("display.width", 200, "display.max_columns", None):
                print(last_metrics[label].to_string(index=False, float_format=lambda v: f"{v:.3f}"))


if __name__ == "__main__":
    main()
