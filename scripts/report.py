"""Entry point for the `report` rule; the work is in ftbench.cli.report."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftbench import cli  # noqa: E402

if __name__ == "__main__":
    cli.run(cli.report)
