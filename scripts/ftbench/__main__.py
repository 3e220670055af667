"""``python -m ftbench <command> ...``: the commands the Snakemake rules run, and a few for users.

    python -m ftbench prepare-data ...   tokenise one dataset into Parquet shards (rule prepare_data)
    python -m ftbench train ...          train and measure one run (rule train)
    python -m ftbench collect ...        gather runs into results/metrics.parquet (rule collect)
    python -m ftbench report ...         figures and results/report.html (rule report)
    python -m ftbench compare ...        merge result sets from several machines into one report
    python -m ftbench check X.yaml       check an experiment file: YAML, schema, references; list its runs
    python -m ftbench repair-data DIR    prepare a data folder again where shards were damaged, keeping results
    python -m ftbench schema             print the experiment schema (config/schema.yaml)
"""

from __future__ import annotations

import sys

from ftbench import cli
from ftbench.cluster import warmstart

def check(argv: list[str]) -> None:
    """Snakemake reports a YAML syntax error in a --configfile only as "not valid JSON or YAML", before
    ftbench can see the file: this names the file, line and column (and every other config problem)."""
    import argparse

    from ftbench.experiment import config, matrix

    parser = argparse.ArgumentParser(prog="python -m ftbench check", description=check.__doc__)
    parser.add_argument("experiment", help="experiment YAML file (what you pass to snakemake --configfile)")
    args = parser.parse_args(argv)
    experiment = config.load_config(args.experiment)
    for message in config.experiment_warnings(experiment):
        print(f"ftbench: warning: {message}", file=sys.stderr)
    runs = matrix.expand_runs(experiment)
    print(f"{args.experiment}: valid; {len(runs)} runs")
    for run in runs:
        print(f"  {run.run_id}")


def repair_data(argv: list[str]) -> None:
    """A prepared data folder whose shards were damaged (a tampered or truncated file, a lost shard) is
    prepared again; if the source still gives the same data, the shards are put back and the runs trained
    on it keep their results."""
    import argparse

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
    "prepare-data": cli.prepare_data,
    "train": cli.train,
    "collect": cli.collect,
    "report": cli.report,
    "compare": cli.compare,
    "check": check,
    "repair-data": repair_data,
    "schema": cli.schema,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if warmstart.wanted(argv):
        # A train job runs in a child of a process that has imported the stack already (warmstart.py).
        status = warmstart.run_warm(argv)
        if status is not None:
            sys.exit(status)
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    cli.run(COMMANDS[argv[0]], argv[1:])


if __name__ == "__main__":
    main()
