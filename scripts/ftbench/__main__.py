"""``python -m ftbench <command> ...``: the commands are in cli.py; a train job may first run warm.

A local train job runs in a child of a process that has already imported torch and transformers
(cluster/warmstart.py), when one is there to use; otherwise, and for every other command, here.
"""

from __future__ import annotations

import sys

from ftbench.cluster import warmstart


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if warmstart.wanted(argv):
        status = warmstart.run_warm(argv)
        if status is not None:
            sys.exit(status)
    # Deferred on purpose: a warm-started job's own process only hands its command over, and importing the
    # commands (pandas, pyarrow, the task families: 0.4 s here, about 1.5 s on an H100 host) was most of
    # the 2 s such a job spent before its run began.
    from ftbench import cli

    cli.main(argv)


if __name__ == "__main__":
    main()
