"""How long does `snakemake -n` take before anything runs? Parse time as a user sees it.

Three dry runs, each a fresh `snakemake -n` process timed from start to exit (median of --repeats):
- snakemake alone: a workflow with no jobs, the floor that Snakemake's own start-up sets;
- default: the shipped experiment (config/config.yaml);
- matrix: a generated experiment, a config-built Llama on synthetic tokens with the axes method (2) x
  precision (2) x batch_size x seq_len x lora_rank (--axis-values each: 5 gives 500 runs).
For the two experiments it also times, in this process, what ftbench adds to the parse:
``config.validate_config`` and ``matrix.expand_runs`` (first call, which builds the schema, and the
median of the later ones).

    python scripts/benchmark_parse.py --repeats 5 --json parse.json

Targets: the default well under 2 s, 500 runs under 10 s. Every dry run works in a temporary folder
(--directory), so the repository gets no .snakemake/ of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ftbench.experiment import config as ftbench_config
from ftbench.experiment import matrix

ROOT = Path(__file__).resolve().parents[1]
TARGETS_S = {"default": 2.0, "matrix": 10.0}
# A small Llama built from its config: nothing to download, and seq_len up to 1024 fits its positions.
MATRIX_MODEL = {
    "task": "causal_lm",
    "source": {"kind": "config", "architecture": "LlamaConfig",
               "overrides": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                             "num_attention_heads": 4, "vocab_size": 1000, "max_position_embeddings": 1024}},
}
AXIS_POOLS = {"batch_size": [1, 2, 4, 8, 16, 32, 64], "seq_len": [64, 128, 192, 256, 384, 512, 1024],
              "lora_rank": [4, 8, 16, 32, 64, 128, 256]}


def matrix_config(axis_values: int) -> dict:
    """An experiment of 4 x axis_values^3 runs (method and precision take two values each)."""
    if not 1 <= axis_values <= min(len(pool) for pool in AXIS_POOLS.values()):
        raise SystemExit(f"--axis-values: expected 1 to {min(len(pool) for pool in AXIS_POOLS.values())}")
    return {
        "models": {"llama": MATRIX_MODEL},
        "datasets": {"tokens": {"source": {"kind": "synthetic"}, "train_size": 4096, "eval_size": 256}},
        "defaults": {"max_steps": 20, "warmup_steps": 3, "device": "cpu", "num_gpus": 0},
        "matrix": {"model": ["llama"], "dataset": ["tokens"], "method": ["lora", "qlora"], "precision": ["fp32", "bf16"],
                   **{axis: pool[:axis_values] for axis, pool in AXIS_POOLS.items()}},
    }


def snakemake_command() -> list[str]:
    beside = Path(sys.executable).with_name("snakemake")
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "snakemake"]


def time_dry_run(snakefile: Path, workdir: Path, configfile: Path | None, repeats: int) -> list[float]:
    """Seconds of each `snakemake -n` (a new process each time); stops the benchmark if one fails."""
    command = [*snakemake_command(), "-n", "--snakefile", str(snakefile), "--directory", str(workdir)]
    if configfile is not None:
        command += ["--configfile", str(configfile)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        process = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
        samples.append(time.perf_counter() - started)
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited {process.returncode}:\n{process.stderr[-3000:]}")
    return samples


def time_validate_expand(config: dict, repeats: int) -> tuple[int, list[float]]:
    """(runs, seconds of each validate_config + expand_runs): ftbench's own share of a parse."""
    samples = []
    for _ in range(max(2, repeats + 1)):
        started = time.perf_counter()
        ftbench_config.validate_config(config)
        runs = matrix.expand_runs(config)
        samples.append(time.perf_counter() - started)
    return len(runs), samples


def measure(name: str, config: dict | None, folder: Path, repeats: int, snakefile: Path = ROOT / "Snakefile") -> dict:
    folder.mkdir(parents=True)
    configfile = None
    result = {"name": name, "runs": 0, "target_s": TARGETS_S.get(name)}
    if config is not None:
        configfile = folder / "config.yaml"
        configfile.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        runs, in_process = time_validate_expand(config, repeats)
        result.update(runs=runs, validate_expand_first_s=in_process[0],
                      validate_expand_s=statistics.median(in_process[1:]))
    samples = time_dry_run(snakefile, folder, configfile, repeats)
    result.update(dry_run_s=statistics.median(samples), dry_run_samples_s=samples)
    return result


def table(results: list[dict], repeats: int) -> str:
    def seconds(value):
        return "-" if value is None else f"{value:.2f}"

    lines = [f"{'experiment':<16} {'runs':>5} {f'snakemake -n (median of {repeats})':>30} "
             f"{'validate+expand first/median':>29} {'target':>7}"]
    for result in results:
        in_process = ("-" if "validate_expand_s" not in result else
                      f"{result['validate_expand_first_s']:.2f} / {result['validate_expand_s']:.2f}")
        lines.append(f"{result['name']:<16} {result['runs']:>5} {seconds(result['dry_run_s']):>30} "
                     f"{in_process:>29} {seconds(result['target_s']):>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="dry runs per experiment (the median is reported)")
    parser.add_argument("--axis-values", type=int, default=5,
                        help="values of batch_size, seq_len and lora_rank in the generated matrix (runs: 4 x N^3)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats: expected at least 1")
    default = yaml.safe_load((ROOT / "config" / "config.yaml").read_text(encoding="utf-8"))
    generated = matrix_config(args.axis_values)
    with tempfile.TemporaryDirectory(prefix="ftbench-parse-") as scratch:
        scratch = Path(scratch)
        empty = scratch / "Snakefile.empty"
        empty.write_text("rule nothing:\n    output: []\n", encoding="utf-8")
        results = [
            measure("snakemake alone", None, scratch / "alone", args.repeats, snakefile=empty),
            measure("default", default, scratch / "default", args.repeats),
            measure("matrix", generated, scratch / "matrix", args.repeats),
        ]
    print(table(results, args.repeats))
    if args.json:
        args.json.write_text(json.dumps({"repeats": args.repeats, "cpus": os.cpu_count(), "experiments": results},
                                        indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
