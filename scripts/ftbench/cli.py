"""Command-line entry points that the Snakemake rules call (``python -m ftbench <command>``).

Each command prints a one-line ``ftbench: ...`` message and exits 1 on a known error, so a rule's log
ends with the sentence a user needs instead of a traceback; unknown errors keep their traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import matrix
from .errors import FtbenchError, TerminatedError


def prepare_data(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokenise one dataset into Parquet shards with a manifest.")
    parser.add_argument("--preparation", required=True, help="JSON: data_id, dataset, dataset_def, model_def, seq_len")
    parser.add_argument("--shard-size-mb", type=float, default=matrix.DEFAULT_SHARD_SIZE_MB)
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    from . import data

    job = json.loads(args.preparation)
    manifest = data.prepare(job["dataset"], job["dataset_def"], job["model_def"], job["seq_len"], args.out, args.shard_size_mb,
                            job.get("model", "model"))
    rows = {name: split["rows"] for name, split in manifest["splits"].items()}
    print(f"prepared {job['dataset']} at seq_len {job['seq_len']}: {rows} rows -> {args.out}")


def train(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train and measure one run.")
    parser.add_argument("--spec", required=True, help="JSON run spec")
    parser.add_argument("--data", required=True, help="prepared data folder")
    parser.add_argument("--out", help="metrics.json to write; steps.parquet goes beside it")
    parser.add_argument("--rank-dir", help="(DDP worker started by torchrun) folder for this rank's result")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--time-limit-s", type=float, default=None,
        help="the job's wall-clock limit; training stops early (status timeout) leaving a margin to save results",
    )
    args = parser.parse_args(argv)
    if not (args.out or args.rank_dir):
        parser.error("one of --out or --rank-dir is required")
    from .runspec import RunSpec

    spec = RunSpec.from_json(args.spec)
    stop = _stop_signal(args.time_limit_s)
    if args.rank_dir:
        _train_rank(spec, args, stop)
        return

    import pandas as pd

    from . import atomic, environment, launch, trainer

    slots = launch.GpuSlots()
    assigned = launch.assign_gpus(spec.num_gpus if spec.device != "cpu" else 0, slots)
    if assigned is not None:
        print(f"using GPUs {assigned}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if spec.parallel == "ddp":
        metrics, steps = _train_ddp(spec, args)
    else:
        metrics, steps = trainer.train_run(spec, args.data, stop)
    if stop.terminate_requested or trainer.TERMINATED_REASON in (metrics.get("status_reason") or ""):
        # Terminated from outside (scancel, preemption): SLURM and Snakemake count the job as failed, and
        # Snakemake may already have cleaned up its outputs, so a metrics.json written now would be taken
        # for a finished run and never trained again. Leave no output; keep what was measured in the log.
        print(f"{spec.run_id} measured before it was terminated: {json.dumps(metrics, default=str)}")
        raise TerminatedError(f"run {spec.run_id} was terminated (SIGTERM) after step {metrics.get('last_step')}: "
                              "no result written, the next invocation trains it again")
    out = Path(args.out)
    atomic.write_parquet(out.with_name("steps.parquet"), pd.DataFrame(steps, columns=trainer.STEP_FIELDS))
    # metrics.json is written last: its presence means the run's results are complete.
    atomic.write_json(out, {"spec": spec.to_dict(), "metrics": metrics, "environment": environment.capture()})
    slots.release()
    summary = {key: metrics.get(key) for key in ("status", "status_reason", "tokens_per_s", "eval_accuracy")}
    print(f"{spec.run_id}: {summary}")


def _stop_signal(time_limit_s: float | None):
    import faulthandler
    import signal
    import time

    from .trainer import StopSignal

    stop = StopSignal()
    if time_limit_s:
        # Keep 10% (at least 60 s, at most half) for evaluation and writing, so a run near its
        # walltime still records what it measured instead of being killed with nothing.
        margin = min(max(60.0, 0.1 * time_limit_s), 0.5 * time_limit_s)
        stop.deadline = time.monotonic() + time_limit_s - margin
    signal.signal(signal.SIGTERM, lambda *_: setattr(stop, "terminate_requested", True))
    # `kill -USR1 <pid>` prints every thread's stack into the job log: where a stuck run is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return stop


def _train_ddp(spec: RunSpec, args) -> tuple[dict, list[dict]]:
    """Launcher side of a DDP run: check it can run, start torchrun, merge the ranks' results."""
    import shutil

    from . import launch, modeling, trainer
    from .errors import UnsupportedConfiguration

    try:
        device, _ = trainer.choose_device(spec, trainer.Distributed())
        modeling.check_supported(spec, device)
    except UnsupportedConfiguration as exc:
        return {"run_id": spec.run_id, "status": "unsupported", "status_reason": str(exc)}, []
    rank_dir = Path(args.out).parent / "ranks"
    shutil.rmtree(rank_dir, ignore_errors=True)
    rank_dir.mkdir(parents=True)
    code = launch.run_ddp(spec, args.data, rank_dir, args.threads, args.time_limit_s)
    results = launch.read_rank_results(rank_dir)
    devices = spec.devices
    stopped_early = [r for r in results if r["metrics"]["status"] != "ok"]
    if len(results) < devices and stopped_early:
        # A rank stopped early (OOM, divergence) and the others were ended while waiting for it: the
        # run's status is that rank's, from what it measured.
        print(f"{devices - len(results)} rank(s) ended without results after rank {stopped_early[0]['rank']} stopped early")
    elif len(results) < devices:
        # A rank died without writing its result (killed, segfault): no honest row can be made.
        raise RuntimeError(f"torchrun exited with {code}; {len(results)} of {devices} ranks wrote results (see the log above)")
    metrics, steps = launch.merge_ranks(results, spec, devices)
    if len(results) < devices:
        metrics["status_reason"] += f"; {devices - len(results)} other rank(s) ended while waiting for it, without results"
    return metrics, steps


def _train_rank(spec: RunSpec, args, stop) -> None:
    """One DDP rank (started by torchrun): train, then write rank<R>.json."""
    import datetime
    import os
    import traceback

    import torch

    from . import atomic, trainer

    if args.threads:
        torch.set_num_threads(args.threads)
    dist = trainer.Distributed.from_env()
    use_cuda = spec.device != "cpu" and torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(dist.local_rank)
    # A bounded timeout: a rank stuck in a collective (a peer died) fails instead of hanging the job.
    timeout = datetime.timedelta(seconds=float(os.environ.get("FTBENCH_DDP_TIMEOUT_S", 600)))
    torch.distributed.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    try:
        metrics, steps = trainer.train_run(spec, args.data, stop, dist)
    except BaseException:
        # Peers may be waiting in a collective this rank will never join: destroying the process group
        # would wait for them too. Exit at once; torchrun and the launcher stop the others.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    metrics["rank"] = dist.rank
    atomic.write_json(Path(args.rank_dir) / f"rank{dist.rank}.json", {"rank": dist.rank, "metrics": metrics, "steps": steps})
    if metrics["status"] != "ok":
        sys.stdout.flush()
        os._exit(0)  # same reason: no collective after a rank stopped early (OOM, divergence)
    torch.distributed.destroy_process_group()


def collect(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Gather run results into Parquet and CSV, with their costs.")
    parser.add_argument("--parquet", required=True)
    parser.add_argument("--csv", required=True)
    parser.add_argument("--prices-table", default=None, help="price table YAML (default: config/prices.yaml)")
    parser.add_argument("--price-settings", default="{}", help="JSON: the experiment's `prices` key (provider, pricing, ...)")
    parser.add_argument("--budget", default="null", help="JSON: training budget {tokens|samples, epochs} for projections")
    parser.add_argument("results", nargs="*", help="metrics.json files")
    args = parser.parse_args(argv)
    from . import collect as collect_module
    from . import cost

    settings = json.loads(args.price_settings) or {}
    if args.prices_table:
        settings["table"] = args.prices_table
    prices = cost.resolve(settings)
    frame = collect_module.collect(args.results, args.parquet, args.csv, prices=prices, budget=json.loads(args.budget))
    print(f"collected {len(frame)} runs -> {args.parquet} (prices: {prices.table_path} {prices.label})")


def report(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Render figures and the HTML report.")
    parser.add_argument("--metrics", required=True, help="metrics.parquet")
    parser.add_argument("--steps", nargs="*", default=[], help="per-run steps.parquet files")
    parser.add_argument("--figures", required=True, help="folder for figure PNGs")
    parser.add_argument("--html", required=True)
    parser.add_argument("--title", default="ftbench report")
    parser.add_argument("--recommend", default="{}", help="JSON: {min_accuracy, max_memory_mb} for the recommendation")
    parser.add_argument("--captions", default="{}", help="JSON: {figure name: its one-sentence caption}")
    parser.add_argument("--gpu-peaks", default=None, help="GPU table (config/gpus.yaml): the memory line of GPUs whose name gives no size")
    parser.add_argument("--repeat-scoring", default="median", choices=["median", "trimmed_mean"],
                        help="a configuration's figure from its repeats: their median, or the mean without the fastest and slowest")
    args = parser.parse_args(argv)
    from . import report as report_module

    written = report_module.build_report(args.metrics, args.steps, args.figures, args.html, title=args.title,
                                         recommend_settings=json.loads(args.recommend) or {},
                                         captions=json.loads(args.captions), gpu_table=args.gpu_peaks,
                                         repeat_scoring=args.repeat_scoring)
    for name, result in written.items():
        print(f"figure {name}: {result if isinstance(result, str) else 'drawn'}")
    print(f"report -> {args.html}")


def compare(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ftbench compare",
        description="Merge result sets (metrics.parquet from different machines or clusters) into one table and "
        "report: the same configuration across GPUs, throughput ratios and cost, node-to-node variance.",
    )
    parser.add_argument("results", nargs="+", metavar="[NAME=]METRICS_PARQUET",
                        help="a result set's metrics.parquet, optionally named (NAME=path); default name: its folder")
    parser.add_argument("--out", required=True, help="folder for compare.html, compare.parquet, compare.csv and figures/")
    parser.add_argument("--prices-table", default="config/prices.yaml", help="re-price every set with this table (default: %(default)s)")
    parser.add_argument("--provider", default=None, help="provider of the price table (default: the table's default)")
    parser.add_argument("--pricing", default=None, choices=["on_demand", "spot"])
    parser.add_argument("--keep-prices", action="store_true", help="keep each set's own costs instead of re-pricing")
    parser.add_argument("--threshold", type=float, default=0.05, help="flag node-to-node variation above this CV (default 0.05)")
    parser.add_argument("--title", default="ftbench comparison")
    parser.add_argument("--captions-dir", default="rules/captions/figures", help="one <figure>.rst caption per figure (default: %(default)s)")
    parser.add_argument("--gpu-peaks", default="config/gpus.yaml", help="GPU table: the memory line of GPUs whose name gives no size (default: %(default)s)")
    args = parser.parse_args(argv)
    from . import compare as compare_module
    from . import cost

    # The defaults are relative to the working directory: the repository root.
    needed = {"--prices-table": None if args.keep_prices else args.prices_table, "--captions-dir": args.captions_dir,
              "--gpu-peaks": args.gpu_peaks}
    for option, path in needed.items():
        if path is not None and not Path(path).exists():
            raise FtbenchError(f"compare: {option} {path} not found (run from the repository root or pass {option} PATH)")
    captions = {path.stem: " ".join(path.read_text(encoding="utf-8").split()) for path in sorted(Path(args.captions_dir).glob("*.rst"))}
    sets = []
    for item in args.results:
        name, _, path = item.rpartition("=") if "=" in item else ("", "", item)
        sets.append((name or None, path))
    prices = None
    if not args.keep_prices:
        prices = cost.resolve({"table": args.prices_table, "provider": args.provider, "pricing": args.pricing})
    result = compare_module.compare(sets, args.out, prices=prices, threshold=args.threshold, title=args.title,
                                    captions=captions, gpu_table=args.gpu_peaks)
    print(f"compared {result['runs']} runs of {result['sets']} result sets -> {result['html']}")


def schema(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="python -m ftbench schema", description="Print the experiment schema as YAML.").parse_args(argv)
    from . import config

    sys.stdout.write(config.schema_yaml())


def run(command, argv: list[str] | None = None) -> None:
    """Run a command; known errors become one line on stderr and exit status 1."""
    try:
        command(argv)
    except FtbenchError as exc:
        print(f"ftbench: {exc}", file=sys.stderr)
        sys.exit(1)
