"""Command-line entry points that the Snakemake rules call (through the thin files in scripts/).

Each command prints a one-line ``ftbench: ...`` message and exits 1 on a known error, so a rule's log
ends with the sentence a user needs instead of a traceback; unknown errors keep their traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import FtbenchError


def prepare_data(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokenise one dataset into Parquet shards with a manifest.")
    parser.add_argument("--task", required=True, help="JSON: dataset, dataset_def, model_def, seq_len")
    parser.add_argument("--shard-size-mb", type=float, default=128)
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    from . import data

    task = json.loads(args.task)
    manifest = data.prepare(task["dataset"], task["dataset_def"], task["model_def"], task["seq_len"], args.out, args.shard_size_mb)
    rows = {name: split["rows"] for name, split in manifest["splits"].items()}
    print(f"prepared {task['dataset']} at seq_len {task['seq_len']}: {rows} rows -> {args.out}")


def train(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train and measure one run.")
    parser.add_argument("--spec", required=True, help="JSON run spec")
    parser.add_argument("--data", required=True, help="prepared data folder")
    parser.add_argument("--out", required=True, help="metrics.json to write; steps.parquet goes beside it")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--time-limit-s", type=float, default=None,
        help="the job's wall-clock limit; training stops early (status timeout) leaving a margin to save results",
    )
    args = parser.parse_args(argv)
    import signal
    import time

    import pandas as pd
    import torch

    from . import atomic, environment, trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = json.loads(args.spec)
    stop = trainer.StopSignal()
    if args.time_limit_s:
        # Keep 10% (at least 60 s, at most half) for evaluation and writing, so a run near its walltime still
        # records what it measured instead of being killed with nothing.
        margin = min(max(60.0, 0.1 * args.time_limit_s), 0.5 * args.time_limit_s)
        stop.deadline = time.monotonic() + args.time_limit_s - margin
    signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "terminate_requested", True))
    metrics, steps = trainer.train_run(spec, args.data, stop)
    out = Path(args.out)
    atomic.write_parquet(out.with_name("steps.parquet"), pd.DataFrame(steps, columns=[
        "step", "measured", "step_time_s", "samples", "tokens", "padded_tokens", "loss", "lr"]))
    # metrics.json is written last: its presence means the run's results are complete.
    atomic.write_json(out, {"spec": spec, "metrics": metrics, "environment": environment.capture()})
    summary = {key: metrics.get(key) for key in ("status", "status_reason", "tokens_per_s", "eval_accuracy")}
    print(f"{spec['run_id']}: {summary}")


def collect(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Gather run results into Parquet and CSV.")
    parser.add_argument("--parquet", required=True)
    parser.add_argument("--csv", required=True)
    parser.add_argument("results", nargs="*", help="metrics.json files")
    args = parser.parse_args(argv)
    from . import collect as collect_module

    frame = collect_module.collect(args.results, args.parquet, args.csv)
    print(f"collected {len(frame)} runs -> {args.parquet}")


def report(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Render figures and the HTML report.")
    parser.add_argument("--metrics", required=True, help="metrics.parquet")
    parser.add_argument("--steps", nargs="*", default=[], help="per-run steps.parquet files")
    parser.add_argument("--figures", required=True, help="folder for figure PNGs")
    parser.add_argument("--html", required=True)
    parser.add_argument("--title", default="ftbench report")
    args = parser.parse_args(argv)
    from . import report as report_module

    report_module.build_report(args.metrics, args.steps, args.figures, args.html, title=args.title)
    print(f"report -> {args.html}")


def run(command, argv: list[str] | None = None) -> None:
    """Run a command; known errors become one line on stderr and exit status 1."""
    try:
        command(argv)
    except FtbenchError as exc:
        print(f"ftbench: {exc}", file=sys.stderr)
        sys.exit(1)
