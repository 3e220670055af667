"""``python -m ftbench <command> ...``: the commands are in cli.py; a train job may first run warm.

A local train job runs in a child of a process that has already imported torch and transformers
(cluster/warmstart.py), when one is there to use; otherwise, and for every other command, here.
"""

from __future__ import annotations

import sys

from ftbench import cli
from ftbench.cluster import warmstart


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if warmstart.wanted(argv):
        status = warmstart.run_warm(argv)
        if status is not None:
            sys.exit(status)
    cli.main(argv)


if __name__ == "__main__":
    main()
