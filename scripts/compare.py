"""Merge result sets from several machines into one table and report; the work is in ftbench.cli.compare.

    python scripts/compare.py --out results/compare a100=siteA/results/metrics.parquet h100=siteB/results/metrics.parquet
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftbench import cli  # noqa: E402

if __name__ == "__main__":
    cli.run(cli.compare)
