"""The commands of ``python -m ftbench <command>``: the ones the Snakemake rules run, and a few for users.

    python -m ftbench prepare-data ...   tokenise one dataset into Parquet shards (rule prepare_data)
    python -m ftbench train ...          train and measure one run (rule train)
    python -m ftbench collect ...        gather runs into results/metrics.parquet (rule collect)
    python -m ftbench report ...         figures and results/report.html (rule report)
    python -m ftbench compare ...        merge result sets from several machines into one report
    python -m ftbench check X.yaml       check an experiment file: YAML, schema, references; list its runs
    python -m ftbench plan X.yaml        before training: what fits each GPU, and each GPU's predicted speed, hours and $
    python -m ftbench probe-gpu          a minute on this GPU: its matmul, bandwidth, kernel and host figures for plan
    python -m ftbench projection-check M.parquet   short runs' projections of the long runs of the same configuration, vs measured
    python -m ftbench repair-data DIR    prepare a data folder again where shards were damaged, keeping results
    python -m ftbench schema             print the experiment schema (config/schema.yaml)

Each command prints a one-line ``ftbench: ...`` message and exits 1 on a known error, so a rule's log
ends with the sentence a user needs instead of a traceback; unknown errors keep their traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from ftbench.errors import FtbenchError
from ftbench.experiment import matrix
from ftbench.recipe import recipe_of
from ftbench.runspec import RunSpec

# Each command imports its own stage when it runs (torch for train, matplotlib for report, pandas for
# collect): a job pays only for what it uses, and parse-time commands stay torch-free.


def prepare_data(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Tokenise one dataset into Parquet shards with a manifest.")
    parser.add_argument("--preparation", required=True, help="JSON: data_id, dataset, dataset_def, model_def, seq_len")
    parser.add_argument("--shard-size-mb", type=float, default=matrix.DEFAULT_SHARD_SIZE_MB)
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    from ftbench.data import prepared
    from ftbench.tasks import registry

    job = json.loads(args.preparation)
    manifest = registry.prepare(job["dataset"], job["dataset_def"], job["model_def"], job["seq_len"], args.out, args.shard_size_mb,
                            job.get("model", "model"), job.get("image_size"))
    rows = {name: split["rows"] for name, split in manifest["splits"].items()}
    print(f"prepared {job['dataset']} at seq_len {job['seq_len']}: {rows} rows -> {args.out}")
    print(f"prepared {job['dataset']}: rows dropped: {prepared.dropped_summary(manifest.get('rows_dropped') or {})}")


def train(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train and measure one run.")
    spec_source = parser.add_mutually_exclusive_group(required=True)
    spec_source.add_argument("--spec", help="JSON run spec")
    spec_source.add_argument("--spec-file", help="file holding the JSON run spec (what the train rule passes)")
    parser.add_argument("--data", required=True, help="prepared data folder")
    parser.add_argument("--out", help="metrics.json to write; steps.parquet goes beside it")
    parser.add_argument("--rank-dir", help="(DDP worker started by torchrun) folder for this rank's result")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument(
        "--time-limit-s", type=float, default=None,
        help="the job's wall-clock limit; training stops early (status timeout) leaving a margin to save results",
    )
    parser.add_argument("--watch-pid", type=int, default=None,
                        help="end this job when that process (the Snakemake that started it) ends; ignored under SLURM")
    args = parser.parse_args(argv)
    if not (args.out or args.rank_dir):
        parser.error("one of --out or --rank-dir is required")
    from ftbench.train import job  # torch deferred: the other commands (collect, report, check) run without it

    spec = RunSpec.from_json(args.spec if args.spec is not None else Path(args.spec_file).read_text(encoding="utf-8"))
    metrics = job.run_job(spec, args.data, out=Path(args.out) if args.out else None,
                          rank_dir=Path(args.rank_dir) if args.rank_dir else None, threads=args.threads,
                          time_limit_s=args.time_limit_s, watch_pid=args.watch_pid)
    if metrics is None:
        return  # a rank: the launcher reports the run
    summary = {key: metrics.get(key) for key in ("status", "status_reason", "tokens_per_s", "eval_accuracy")}
    print(f"{spec.run_id}: {summary}")


def collect(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Gather run results into Parquet and CSV, with their costs.")
    parser.add_argument("--parquet", required=True)
    parser.add_argument("--csv", required=True)
    parser.add_argument("--prices-table", default=None, help="price table YAML (default: config/prices.yaml)")
    parser.add_argument("--price-settings", default="{}", help="JSON: the experiment's `prices` key (provider, pricing, ...)")
    parser.add_argument("--budget", default="null", help="JSON: training budget {tokens|samples, epochs} for projections")
    parser.add_argument("--gpu-peaks", default=None, help="GPU peak table YAML (config/gpus.yaml) for MFU; without it mfu stays null")
    parser.add_argument("--summary", default=None, help="text file for the outcome summary (runs per status, why each is not ok)")
    parser.add_argument("--target", default="null", help="JSON: the quality target {metric, value} (tokens, hours and $ to reach it)")
    parser.add_argument("results", nargs="*", help="metrics.json files")
    args = parser.parse_args(argv)
    from ftbench.report import collect as collect_module
    from ftbench.report import cost

    settings = json.loads(args.price_settings) or {}
    if args.prices_table:
        settings["table"] = args.prices_table
    prices = cost.resolve(settings)
    frame = collect_module.collect(args.results, args.parquet, args.csv, prices=prices, budget=json.loads(args.budget),
                                   gpu_peaks=args.gpu_peaks, summary_path=args.summary, target=json.loads(args.target))
    print(f"collected {_count(len(frame), 'run')} -> {args.parquet} (prices: {prices.table_path} {prices.label})")


def report(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Render figures and the HTML report.")
    parser.add_argument("--metrics", required=True, help="metrics.parquet")
    parser.add_argument("--steps", nargs="*", default=[], help="per-run steps.parquet files")
    parser.add_argument("--evals", nargs="*", default=[], help="per-run evals.parquet files (quality against cost)")
    parser.add_argument("--figures", required=True, help="folder for figure PNGs")
    parser.add_argument("--html", required=True)
    parser.add_argument("--title", default="ftbench report")
    parser.add_argument("--recommend", default="{}", help="JSON: {min_accuracy, max_memory_mb} for the recommendation")
    parser.add_argument("--captions", default="{}", help="JSON: {figure name: its one-sentence caption}")
    parser.add_argument("--gpu-peaks", default=None, help="GPU table (config/gpus.yaml): the memory line of GPUs whose name gives no size")
    parser.add_argument("--repeat-scoring", default="median", choices=["median", "trimmed_mean"],
                        help="a configuration's figure from its repeats: their median, or the mean without the fastest and slowest")
    args = parser.parse_args(argv)
    from ftbench.report import report_page as report_module

    written = report_module.build_report(args.metrics, args.steps, args.figures, args.html, title=args.title,
                                         recommend_settings=json.loads(args.recommend) or {},
                                         captions=json.loads(args.captions), gpu_table=args.gpu_peaks,
                                         repeat_scoring=args.repeat_scoring, eval_files=args.evals)
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
    from ftbench.report import compare as compare_module
    from ftbench.report import cost

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
    from ftbench.experiment import config

    sys.stdout.write(config.schema_yaml())


def check(argv: list[str]) -> None:
    """Snakemake reports a YAML syntax error in a --configfile only as "not valid JSON or YAML", before
    ftbench can see the file: this names the file, line and column (and every other config problem)."""
    parser = argparse.ArgumentParser(prog="python -m ftbench check", description=check.__doc__)
    parser.add_argument("experiment", help="experiment YAML file (what you pass to snakemake --configfile)")
    args = parser.parse_args(argv)
    experiment = _load_experiment(args.experiment)
    runs = matrix.expand_runs(experiment)
    print(f"{args.experiment}: valid; {_count(len(runs), 'run')}")
    for run in runs:
        print(f"  {run.run_id}")


def _count(number: int, noun: str) -> str:
    """``1 run``, ``2 runs`` (as the closing summary writes them)."""
    from ftbench.report.summary import count  # deferred: the summary module reads pandas

    return count(number, noun)


def _load_experiment(path: str) -> dict:
    """The experiment file validated, its warnings printed as `snakemake -n` prints them."""
    from ftbench.experiment import config

    from ftbench.report import cost

    experiment = config.load_config(path)
    cost.resolve(experiment.get("prices") or {})  # a price choice that prices nothing is refused here too
    for message in config.experiment_warnings(experiment):
        print(f"ftbench: warning: {message}", file=sys.stderr)
    return experiment


def plan(argv: list[str]) -> None:
    """Before anything trains: each run's memory estimate (from its model's config alone), whether it fits each
    GPU of the table (the estimate's +-10% error band: yes / borderline / no) and the largest per-GPU batch that
    fits there; per GPU its predicted tokens/s, $ per 1M tokens and the hours and dollars of the experiment's budget
    (a calibrated step-time model, with your own measured runs taking precedence), and the cheapest GPU that fits.
    By default a matrix of configurations by GPUs (the budget's $, else $ per 1M tokens); --detail: per run, each
    GPU's memory verdict and figures."""
    from ftbench.experiment import memory_plan
    from ftbench.measure import gpu_table
    from ftbench.report import cost, prediction

    parser = argparse.ArgumentParser(prog="python -m ftbench plan", description=plan.__doc__)
    parser.add_argument("experiment", help="experiment YAML file")
    parser.add_argument("--gpus", default="config/gpus.yaml", help="GPU table with memory_gb (default: %(default)s)")
    parser.add_argument("--data-root", default="results/data",
                        help="prepared data (packed runs read their rows' lengths there; default: %(default)s)")
    parser.add_argument("--calibration", default=str(prediction.DEFAULT_CALIBRATION),
                        help="the step-time model's calibration (default: %(default)s)")
    parser.add_argument("--results", default="results/metrics.parquet",
                        help="your measured runs, where there are some: shown as measured, and fitted over the "
                             "calibration for the GPU models they ran on (default: %(default)s)")
    parser.add_argument("--probes", default=str(prediction.probes.DEFAULT_PROBES),
                        help="GPU probes (python -m ftbench probe-gpu), where there are some (default: %(default)s)")
    parser.add_argument("--detail", action="store_true",
                        help="per run: its memory estimate and, per GPU, fits, largest batch, tokens/s, hours and $")
    args = parser.parse_args(argv)
    calibration, gpus = prediction.with_probe_file(prediction.load_calibration(args.calibration),
                                                   gpu_table.load_peaks(args.gpus), args.probes)
    gpus = [gpu for gpu in gpus if gpu.get("memory_gb")]
    experiment = _load_experiment(args.experiment)
    runs = matrix.expand_runs(experiment)
    prices, budget = cost.resolve(experiment.get("prices") or {}), experiment.get("budget")
    calibration, measured = prediction.own_calibration(args.results, gpus, calibration)
    heading = (f"{args.experiment}: {_count(len(runs), 'run')}; memory per GPU (MiB; fits: estimate +-10% against capacity); "
               + prediction.plan_heading(calibration, prices, budget))
    print(heading if args.detail else textwrap.fill(heading, 120))
    tables, unpriced = [], []
    for run in runs:
        planned = memory_plan.plan_run(run, gpus, args.data_root, build=_meta_model)
        rows = prediction.priced_table([run], gpus, calibration, prices, budget, measured, args.data_root,
                                       {run.run_id: planned})
        if args.detail:
            pick = prediction.cheapest(rows, prediction.cost_column(rows))
            print("\n".join([plan_table(run, planned, rows)]
                            + prediction.plan_footer(rows, None if pick.empty else pick.iloc[0].to_dict())))
        tables.append(rows)
        if planned.get("unsupported"):
            unpriced.append(f"{run.run_id}: unsupported, recorded without training ({planned['unsupported']})")
    if not args.detail:
        print("\n".join(_plan_matrix(tables, runs, unpriced)))


def _plan_matrix(tables: list, runs: list[RunSpec], unpriced: list[str]) -> list[str]:
    """The plan's default output: the price matrix (report/price_matrix.py) within 120 columns, then the runs it
    leaves out and the predictions' notes, each once."""
    import pandas as pd

    from ftbench.report import price_matrix

    table = pd.concat([part for part in tables if not part.empty] or [pd.DataFrame(columns=["gpu"])], ignore_index=True)
    labels = price_matrix.short_labels({run.config_id: run.run_id.rsplit("-", 1)[0] for run in runs})  # no hash
    lines = [""]
    if table["gpu"].notna().any():
        lines += price_matrix.text_lines(price_matrix.price_matrix(table, labels))
    missing = table[table["gpu"].isna()] if "note" in table else table.iloc[0:0]
    unpriced = unpriced + [f"{row['run_id']}: {row['note']}" for row in missing.to_dict("records")]
    notes = [] if "note" not in table else sorted(set(table.loc[table["gpu"].notna(), "note"].dropna()))
    lines += [textwrap.fill(line, 120, subsequent_indent="  ") for line in unpriced]
    lines += [textwrap.fill(f"note: {note}", 120, subsequent_indent="  ") for note in notes]
    lines.append("per run and GPU (memory, largest batch, tokens/s, hours): python -m ftbench plan --detail")
    return lines


def _meta_model(run: RunSpec):
    """The run's model on the meta device, for the plan of a model of two stacks (torch imported only then)."""
    from ftbench.train.modeling import meta_model

    return meta_model(run)


NO_PEAK = "no peak or bandwidth for the run's compute dtype in the GPU table: not predicted"


def plan_table(run: RunSpec, planned: dict, priced=None) -> str:
    """One run's plan as text: its estimate and largest parts, then one line per GPU: what fits there and, from
    ``priced`` (report/prediction.py priced_table's rows of the run), its predicted speed and cost."""
    from ftbench.report import prediction

    lines = [f"\n{run.run_id}  ({run.parallel}, {run.devices} GPU{'s' if run.devices > 1 else ''}, batch {run.batch_size})",
             f"  recipe: {recipe_of(run).text()}"]
    if planned.get("unsupported"):
        return "\n".join(lines + [f"  unsupported: recorded without training ({planned['unsupported']})"])
    by_gpu = {} if priced is None else {row["gpu"]: row for row in priced.to_dict("records") if row["gpu"]}
    if planned["memory_estimate_mb"] is None:
        lines.append(f"  no estimate: {planned['memory_estimate_note']}")
        if by_gpu:
            lines.append(f"  {'GPU':<12} {prediction.PRICED_HEADER}")
            lines += [f"  {gpu:<12} {prediction.priced_cells(row)}" for gpu, row in by_gpu.items()]
        return "\n".join(lines)
    parts = sorted(planned["memory_estimate_parts_mb"].items(), key=lambda item: -item[1])
    shown = ", ".join(f"{name} {value:,.0f}" for name, value in parts if value >= 1)
    lines.append(f"  estimate {planned['memory_estimate_mb']:,.0f} MiB per GPU = peak of: {shown}")
    if planned.get("memory_estimate_host_mb"):
        lines.append(f"  host memory (offloaded states) {planned['memory_estimate_host_mb']:,.0f} MiB per process")
    if planned.get("plan_note"):
        lines.append(f"  note: {planned['plan_note']}")
    lines.append(f"  {'GPU':<12} {'capacity':>10} {'fits':>11} {'largest batch':>14}" + (f" {prediction.PRICED_HEADER}" if by_gpu else ""))
    for row in planned["gpus"]:
        lines.append(f"  {row['gpu']:<12} {row['capacity_mib']:>10,.0f} {row['fits']:>11} {row['largest_batch'] or 'none':>14}"
                     + (f" {prediction.priced_cells(by_gpu.get(row['gpu'])) or NO_PEAK:>26}" if by_gpu else ""))
    return "\n".join(lines)


def _peaks(text: str | None) -> dict | None:
    """--peak-tflops "bf16=989,fp16=989,fp32=67" as dtype -> TFLOP/s."""
    if not text:
        return None
    try:
        return {key.strip(): float(value) for key, value in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise FtbenchError(f"--peak-tflops {text!r}: expected dtype=TFLOP/s pairs, e.g. bf16=989.4,fp16=989.4,fp32=66.9") from None


def probe_gpu(argv: list[str]) -> None:
    """Measure this GPU and its host for a minute at most (matmuls at the examples' widths in bf16, fp16, fp32;
    elementwise and optimizer bandwidth; the kernel floor; the host's time per operation) and write its GPU model's
    probe into a probe file that plan and the report read beside the calibration (measure/gpu_probe.py,
    experiment/probes.py)."""
    from ftbench.experiment import calibration as calibrations
    from ftbench.experiment import probes
    from ftbench.measure import environment, gpu_probe, gpu_table

    parser = argparse.ArgumentParser(prog="python -m ftbench probe-gpu", description=probe_gpu.__doc__)
    parser.add_argument("--out", default=str(probes.DEFAULT_PROBES), help="probe file to add to (default: %(default)s)")
    parser.add_argument("--gpus", default="config/gpus.yaml", help="GPU table (default: %(default)s)")
    parser.add_argument("--calibration", default="config/calibration.yaml",
                        help="calibration whose width_half and reference the printed parameters use (default: %(default)s)")
    parser.add_argument("--device", default="cuda", help="torch device to probe (default: %(default)s; cpu for a try)")
    parser.add_argument("--name", default=None, help="GPU model name for a GPU the table lacks (default: the device's)")
    parser.add_argument("--peak-tflops", default=None, help="a GPU the table lacks: its datasheet dense peaks, "
                        "e.g. bf16=362,fp16=362,fp32=91.6")
    parser.add_argument("--bandwidth-gbs", type=float, default=None,
                        help="a GPU the table lacks: its datasheet memory bandwidth in GB/s")
    args = parser.parse_args(argv)
    calibration = calibrations.load(args.calibration)  # a broken file is said before a minute of measuring
    probe_figures, added = probes.load(args.out)
    gpus = probes.merged_gpus(gpu_table.load_peaks(args.gpus), added)
    import torch  # deferred on purpose: only this command needs it, and the others stay torch-free

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FtbenchError("probe-gpu: no CUDA device visible (--device cpu probes the CPU, for a try)")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpu, new_entry = _probed_gpu(device_name, gpus, args, probes)
    # the CPU device is a try of the command, not a figure anyone predicts with: small shapes, seconds not minutes
    small = {"widths": gpu_probe.WIDTHS[:2], "tokens": 256, "elements": 2**20} if device.type == "cpu" else {}
    result = gpu_probe.run_probe(torch, device, **small)
    if new_entry is not None and result.memory_gb:
        new_entry["memory_gb"] = result.memory_gb
    figures = {**result.figures(), "host": environment.cpu_model(), "torch": str(torch.__version__),
               "cuda": None if torch.version.cuda is None else str(torch.version.cuda)}
    print("\n".join(gpu_probe.summary(result, gpu.get("dense_tflops"), gpu.get("memory_bandwidth_gbs"))))
    probe_figures[gpu["name"]] = figures
    mapped = probes.with_probes(calibration, probe_figures, probes.merged_gpus(gpus, [new_entry] if new_entry else []))
    params = mapped.probed.get(gpu["name"]) or probes.probed_params(figures, gpu, calibration)
    names = (*calibrations.PER_GPU, *calibrations.PROBED_GLOBALS)
    print(f"{gpu['name']} probed ({params.get('from_probe', 'direct')}): " + ", ".join(
        f"{name} {params[name]:.4g}" for name in names if name in params))
    missing = probes.reference_missing(calibration, probe_figures)
    if missing:
        print(f"note: {missing}")
    if calibration.calibrated(gpu["name"]):  # a transfer check in one line: the probe beside what runs measured
        fitted = calibration.params_for(gpu["name"])
        print(f"{gpu['name']} calibrated (measured runs, which take precedence): "
              + ", ".join(f"{name} {fitted[name]:.4g}" for name in names))
    probes.save(args.out, gpu["name"], figures, new_entry)
    print(f"wrote {gpu['name']}'s probe to {args.out}" + (" (and its GPU table entry)" if new_entry else "")
          + ("; plan and the report read it" if Path(args.out) == probes.DEFAULT_PROBES else
             f"; plan reads it with --probes {args.out} (the report reads {probes.DEFAULT_PROBES})"))


def _probed_gpu(device_name: str, gpus: list[dict], args, probes) -> tuple[dict, dict | None]:
    """(the probed device's GPU table entry, the entry to add where the table lacks it), or a one-line error before
    anything is measured where the table lacks it and its datasheet figures are not given."""
    from ftbench.measure import gpu_table

    known = gpu_table.entry_for(device_name, gpus)
    if known is not None and not args.peak_tflops:
        return known, None
    peaks = _peaks(args.peak_tflops)
    if peaks is None or args.bandwidth_gbs is None:
        raise FtbenchError(f"probe-gpu: {device_name!r} matches no GPU of {args.gpus}: give its datasheet figures, "
                           "--peak-tflops bf16=...,fp16=...,fp32=... --bandwidth-gbs N (dense, without sparsity)")
    entry = probes.new_gpu_entry(args.name or device_name, device_name, None, peaks, args.bandwidth_gbs)
    return entry, entry


def projection_check(argv: list[str]) -> None:
    """The projection checked against reality: runs of one configuration that differ only in their steps (as
    config/examples/projection-check.yaml makes them), the short run's projected job time for the long run's
    steps beside the long run's measured one, and the ratio."""
    import pandas as pd

    from ftbench.report import projection
    from ftbench.runspec import settings_fields

    parser = argparse.ArgumentParser(prog="python -m ftbench projection-check", description=projection_check.__doc__)
    parser.add_argument("metrics", help="results/metrics.parquet")
    args = parser.parse_args(argv)
    settings = [f.name for f in settings_fields()]
    table = projection.projection_check(pd.read_parquet(args.metrics), settings)
    if table.empty:
        raise FtbenchError(f"{args.metrics}: no two finished runs of one configuration with different steps")
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.max_colwidth", 60):
        print(table.to_string(index=False, float_format=lambda value: f"{value:.3g}"))


def repair_data(argv: list[str]) -> None:
    """A prepared data folder whose shards were damaged (a tampered or truncated file, a lost shard) is
    prepared again; if the source still gives the same data, the shards are put back and the runs trained
    on it keep their results."""
    from ftbench.tasks import registry

    parser = argparse.ArgumentParser(prog="python -m ftbench repair-data", description=repair_data.__doc__)
    parser.add_argument("data_dir", help="results/data/<data_id> (the folder the error names)")
    args = parser.parse_args(argv)
    restored = registry.repair(args.data_dir)
    if not restored:
        print(f"{args.data_dir}: every shard matches its manifest; nothing to repair")
    for path in restored:
        print(f"restored {path} (same sha256 as the manifest)")


COMMANDS = {
    "prepare-data": prepare_data,
    "train": train,
    "collect": collect,
    "report": report,
    "compare": compare,
    "check": check,
    "plan": plan,
    "probe-gpu": probe_gpu,
    "projection-check": projection_check,
    "repair-data": repair_data,
    "schema": schema,
}


def main(argv: list[str]) -> None:
    """Run the command ``argv`` names (usage on stderr when it names none)."""
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    run(COMMANDS[argv[0]], argv[1:])


def run(command, argv: list[str] | None = None) -> None:
    """Run a command; known errors become one line on stderr and exit status 1."""
    try:
        command(argv)
    except FtbenchError as exc:
        sys.stdout.flush()  # what the command printed first stays before this line in the log
        print(f"ftbench: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


def base_eval(argv: list[str] | None = None) -> None:
    """The evaluation before training shared by the runs that start from the same weights (rule base_eval)."""
    parser = argparse.ArgumentParser(description=base_eval.__doc__)
    parser.add_argument("--spec-file", required=True, help="file holding the JSON spec of a run with these weights")
    parser.add_argument("--data", required=True, help="prepared data folder")
    parser.add_argument("--out", required=True, help="the JSON result to write")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--time-limit-s", type=float, default=None, help="the job's wall-clock limit")
    args = parser.parse_args(argv)
    from ftbench.train import base_eval_job  # torch deferred, as for train

    spec = RunSpec.from_json(Path(args.spec_file).read_text(encoding="utf-8"))
    result = base_eval_job.run_job(spec, args.data, Path(args.out), args.threads, args.time_limit_s)
    print(f"{result['base_eval_id']}: {result['status']} {result.get('reason') or result.get('figures')}")


COMMANDS["base-eval"] = base_eval
