# Shared helpers: config validation, the run table, and get_* input functions. No rules here.

import json
import re
import sys

# ftbench is installed (pip install -e .): see the README.
from ftbench import config as ftbench_config
from ftbench import matrix
from ftbench import resources as ftbench_resources
from ftbench.errors import FtbenchError

# Validate before the DAG is built: a bad key stops `snakemake -n` with one line and no job starts.
# The GPU limit (--resources gpu=N, on the command line or from a profile) too: Snakemake would
# silently shrink a larger request to N.
try:
    ftbench_config.validate_config(config)
    _gpu_limit = workflow.global_resources.get("gpu")
    ftbench_config.check_gpu_limit(config, getattr(_gpu_limit, "value", _gpu_limit))
except FtbenchError as error:
    sys.stderr.write(f"ftbench: {error}\n")
    sys.exit(1)

RUNS = {run.run_id: run for run in matrix.expand_runs(config)}
DATA_PREPARATIONS = matrix.data_preparations(list(RUNS.values()))
SHARD_SIZE_MB = matrix.shard_size_mb(config)


wildcard_constraints:
    run_id="|".join(map(re.escape, RUNS)) or "NO_RUNS",
    data_id="|".join(map(re.escape, DATA_PREPARATIONS)) or "NO_DATA",


def get_run_spec_json(wildcards):
    """Only this run's own spec reaches its job, so editing one run re-runs only that run."""
    return RUNS[wildcards.run_id].to_json()


def get_run_data(wildcards):
    return f"results/data/{RUNS[wildcards.run_id].data_id}"


def get_data_preparation_json(wildcards):
    return json.dumps(DATA_PREPARATIONS[wildcards.data_id], sort_keys=True)


def all_run_metrics():
    return [f"results/runs/{run_id}/metrics.json" for run_id in RUNS]


def all_run_steps():
    return [f"results/runs/{run_id}/steps.parquet" for run_id in RUNS]


# ---------------------------------------------------------------------------------------------------
# Resources of the train rule: the estimate and the reasons for its numbers are in ftbench/resources.py.
# `workflow.non_local_exec` is true both where jobs are submitted and inside them, so both sides agree
# on a job's threads.


def get_train_gpus(wildcards):
    return ftbench_resources.train_gpus(RUNS[wildcards.run_id])


def get_train_gres(wildcards):
    return ftbench_resources.train_gres(RUNS[wildcards.run_id])


def get_train_nodes(wildcards):
    """Nodes of the run's job. Multi-node runs need a cluster executor (SLURM): checked here, when the DAG
    is built, because while the Snakefile is parsed Snakemake has not chosen its executor yet. A dry run
    executes with Snakemake's dry-run executor whatever --executor says; the intended one shows in
    use_threads, which Snakemake turns on for every non-local executor (and for --use-threads)."""
    cluster = workflow.non_local_exec or (workflow.dryrun and workflow.execution_settings.use_threads)
    try:
        ftbench_config.check_nodes(config, cluster)
    except FtbenchError as error:
        sys.stderr.write(f"ftbench: {error}\n")
        sys.exit(1)
    return ftbench_resources.train_nodes(RUNS[wildcards.run_id])


def get_train_threads(wildcards):
    return ftbench_resources.train_threads(RUNS[wildcards.run_id], local=not workflow.non_local_exec, cores=workflow.cores)


def get_train_runtime(wildcards, attempt=1):
    return ftbench_resources.train_runtime_minutes(RUNS[wildcards.run_id], attempt)


def get_train_mem_mb(wildcards, attempt=1):
    return ftbench_resources.train_mem_mb(RUNS[wildcards.run_id], attempt)
