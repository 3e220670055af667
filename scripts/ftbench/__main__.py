"""``python -m ftbench <command> ...``: the commands the Snakemake rules run, and a few for users.

    python -m ftbench prepare-data ...   tokenise one dataset into Parquet shards (rule prepare_data)
    python -m ftbench train ...          train and measure one run (rule train)
    python -m ftbench collect ...        gather runs into results/metrics.parquet (rule collect)
    python -m ftbench report ...         figures and results/report.html (rule report)
    python -m ftbench compare ...        merge result sets from several machines into one report
    python -m ftbench schema             print the experiment schema (config/schema.yaml)
"""

from __future__ import annotations

import sys

from . import cli

COMMANDS = {
    "prepare-data": cli.prepare_data,
    "train": cli.train,
    "collect": cli.collect,
    "report": cli.report,
    "compare": cli.compare,
    "schema": cli.schema,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    cli.run(COMMANDS[argv[0]], argv[1:])


if __name__ == "__main__":
    main()
