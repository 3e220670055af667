"""Entry point for the `collect` rule; the work is in ftbench.cli.collect."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftbench import cli  # noqa: E402

if __name__ == "__main__":
    cli.run(cli.collect)
