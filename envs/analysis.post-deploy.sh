#!/usr/bin/env bash
# Run by `snakemake --use-conda` once, inside envs/analysis.yaml's new environment: installs ftbench
# itself (the rules run `python -m ftbench`) from the repository, FTBENCH_ROOT (set by rules/common.smk;
# this file runs from a copy under .snakemake/conda/, so a relative path would not find it).
set -euo pipefail
: "${FTBENCH_ROOT:?not set: run through snakemake with the repository's Snakefile}"
python -m pip install --no-deps -e "$FTBENCH_ROOT"
