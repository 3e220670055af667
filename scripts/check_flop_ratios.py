"""Is MFU's FLOP count right on every row? The FLOP cross-check of every run of one or more experiments, cheaply.

Each experiment is copied with every run cut to 3 steps (2 of warmup: a plain one-device run counts its first step
as it trains, the others in a pass of their own), one repeat and 8 evaluation examples, and trained by the workflow
in a folder of its own (collection and the report are skipped). Then one line per run: its status and
``flops_counted_ratio`` (FLOPs counted op by op over the analytic model FLOPs that MFU uses), or why there is none.
Cutting the steps changes the run ids and nothing the count depends on (model, method, batch, sequence length,
precision, kernels, compile, batching, parallelism).

    python scripts/check_flop_ratios.py config/examples/*.yaml --workdir /tmp/flops -- \\
        --cores all --resources gpu=4 --scheduler greedy

Everything after ``--`` goes to each snakemake. Target: every run that trained has a ratio within
FLOP_RATIO_TOLERANCE of 1; the exit status is 1 when one does not, or when a job wrote no result (a run that
failed, ran out of memory or is unsupported is listed, not counted: it has no MFU to check). Every experiment is
checked before the first one trains: one that the workflow would refuse (a missing package or file, a bad key) ends
the script with status 2 and a line naming its file and key, with nothing trained.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from ftbench.experiment import config as ftbench_config
from ftbench.experiment import matrix
from ftbench.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FLOP_RATIO_TOLERANCE = 0.05  # issue 30: within 5%, or no ratio with the reason
# The settings that decide how long a run trains or evaluates: dropped wherever an experiment sets them per run.
LENGTH_SETTINGS = ("max_steps", "warmup_steps", "epochs", "warmup_until_stable", "warmup_max_steps", "eval_every",
                   "eval_before_training", "eval_subset", "max_eval_samples", "stop_at_target")
SHORT_RUN = {"max_steps": 3, "warmup_steps": 2, "max_eval_samples": 8}


def shortened(experiment: dict, base: Path) -> dict:
    """The experiment with every run cut to SHORT_RUN and one repeat, its relative ``kind: path`` sources made
    absolute from ``base`` (the shortened experiment runs in a folder of its own); its matrix otherwise unchanged.
    Runs that differed only in their length become one. An experiment that selects runs by their length
    (``exclude`` entries, ``overrides[].when``) cannot be cut without changing which runs it has: SystemExit."""
    for where, entries in (("exclude", experiment.get("exclude") or []),
                           ("overrides", [entry.get("when") or {} for entry in experiment.get("overrides") or []])):
        for index, entry in enumerate(entries):
            selecting = sorted(set(entry) & set(LENGTH_SETTINGS))
            if selecting:
                raise SystemExit(f"check_flop_ratios: {where}[{index}] selects runs by {', '.join(selecting)}; cutting every "
                                 "run to 3 steps would change which runs the experiment has (select by other settings)")
    short = _absolute_paths(copy.deepcopy(experiment), base)
    for entry in short.get("include") or []:
        for key in LENGTH_SETTINGS:
            entry.pop(key, None)
    for override in short.get("overrides") or []:
        for key in LENGTH_SETTINGS:
            (override.get("set") or {}).pop(key, None)
    for key in LENGTH_SETTINGS:
        (short.get("matrix") or {}).pop(key, None)
    defaults = {key: value for key, value in (short.get("defaults") or {}).items() if key not in LENGTH_SETTINGS}
    short["defaults"] = {**defaults, **SHORT_RUN}
    short["repeats"] = 1
    return short


def _absolute_paths(node, base: Path):
    """Every ``{kind: path, path: relative}`` source under ``node`` with its path made absolute from ``base``."""
    if isinstance(node, dict):
        if node.get("kind") == "path" and isinstance(node.get("path"), str):
            # ~ first, as the workflow reads it (data.sources.resolve_location): "~/data" is not relative to base.
            node["path"] = str((base / Path(node["path"]).expanduser()).resolve())
        for value in node.values():
            _absolute_paths(value, base)
    elif isinstance(node, list):
        for value in node:
            _absolute_paths(value, base)
    return node


def plan_short(config_path: Path, folder: Path, skip: str | None) -> tuple[Path, list[str]]:
    """Write the shortened experiment into ``folder`` and check it as the workflow will: (its path, the run ids to
    train). A config that is wrong (a missing file or package, a bad key) raises here, before anything trains."""
    folder.mkdir(parents=True, exist_ok=True)
    short_path = folder / "config.yaml"
    # Relative paths in an experiment are read from where snakemake runs: here, where this script was started.
    short_path.write_text(yaml.safe_dump(shortened(ftbench_config.load_yaml(config_path), Path.cwd()), sort_keys=False))
    run_ids = [run.run_id for run in matrix.expand_runs(ftbench_config.load_config(short_path))
               if not (skip and re.search(skip, run.run_id))]
    return short_path, run_ids


def train_short(name: str, short_path: Path, run_ids: list[str], snakemake_args: list[str]) -> None:
    """Train the shortened experiment's runs in its folder (where ``short_path`` is); the log beside it."""
    folder = short_path.parent
    targets = [f"results/runs/{run_id}/metrics.json" for run_id in run_ids]
    # Targets before --configfile, which takes every word up to the next option.
    command = [sys.executable, "-m", "snakemake", *targets, "--snakefile", str(ROOT / "Snakefile"), "--directory", str(folder),
               "--keep-going", *snakemake_args, "--configfile", str(short_path)]
    # The rules call `python`: this interpreter's, as when the script runs from an activated environment.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(folder / "snakemake.log", "w") as log:
        status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, check=False).returncode
    print(f"{name}: {len(run_ids)} runs, snakemake exit {status} (log: {folder / 'snakemake.log'})", flush=True)


def run_row(folder: Path, run_id: str) -> dict:
    """One run's status and ratio from its metrics.json (status 'missing' when the job wrote none)."""
    path = folder / "results" / "runs" / run_id / "metrics.json"
    if not path.exists():
        return {"run_id": run_id, "status": "missing", "ratio": None, "why": "no metrics.json (see the job log)"}
    metrics = json.loads(path.read_text())["metrics"]
    why = metrics.get("flops_counted_error") if metrics["status"] == "ok" else metrics.get("status_reason")
    return {"run_id": run_id, "status": metrics["status"], "ratio": metrics.get("flops_counted_ratio"), "why": why or ""}


def needs_attention(row: dict) -> bool:
    """A run that trained without a ratio or with one further than FLOP_RATIO_TOLERANCE from 1, or a job that
    wrote no result at all (it crashed: see its log). A failed, oom or unsupported row has no MFU to check."""
    if row["status"] == "missing":
        return True
    if row["status"] != "ok":
        return False
    return row["ratio"] is None or abs(row["ratio"] - 1) > FLOP_RATIO_TOLERANCE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", type=Path, help="experiment files (config/examples/*.yaml)")
    parser.add_argument("--workdir", type=Path, required=True, help="a folder per experiment is made here")
    parser.add_argument("--skip", help="regular expression: runs whose id matches it are not trained")
    own, extra = (sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:]) if "--" in sys.argv else (sys.argv[1:], [])
    args = parser.parse_args(own)  # what follows "--" goes to each snakemake
    if not any(arg == "--cores" or arg.startswith(("--cores=", "-c")) for arg in extra):
        extra = ["--cores", "all", *extra]  # snakemake refuses to start without it
    plans = []
    for position, config_path in enumerate(args.configs):
        # A folder per experiment; two files of one name (a/x.yaml, b/x.yaml) get two.
        stems = [path.stem for path in args.configs[:position]]
        folder = args.workdir / (config_path.stem if config_path.stem not in stems else f"{config_path.stem}-{position}")
        try:  # every experiment is checked before the first one trains: a bad last file costs no GPU time
            plans.append((config_path, *plan_short(config_path, folder, args.skip)))
        except (ConfigError, OSError, yaml.YAMLError) as exc:
            print(f"check_flop_ratios: {config_path}: {exc}", file=sys.stderr)
            return 2
    rows = []
    for config_path, short_path, run_ids in plans:
        train_short(config_path.name, short_path, run_ids, extra)
        rows += [{"experiment": config_path.stem, **run_row(short_path.parent, run_id)} for run_id in run_ids]
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.4f}"
        flag = "  <-- check" if needs_attention(row) else ""
        print(f"{row['experiment'][:20]:20s} {row['run_id'][:70]:70s} {row['status']:11s} {ratio:7s} {row['why'][:120]}{flag}")
    trained = [row["ratio"] for row in rows if row["status"] == "ok" and row["ratio"] is not None]
    bad = [row for row in rows if needs_attention(row)]
    other = len(rows) - sum(row["status"] == "ok" for row in rows)
    span = f"ratios {min(trained):.4f}-{max(trained):.4f}" if trained else "no ratios"
    print(f"{len(rows)} runs: {sum(row['status'] == 'ok' for row in rows)} trained, {span}; {len(bad)} to check "
          f"(outside ±{FLOP_RATIO_TOLERANCE:.0%}, no ratio, or no result); {other} did not train (listed above with the reason)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
