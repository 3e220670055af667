# Shared helpers: config validation, the run table, and get_* input functions. No rules here.

import json
import re
from pathlib import Path
import sys

sys.path.insert(0, str(Path(workflow.basedir) / "scripts"))

from ftbench import config as ftbench_config  # noqa: E402
from ftbench import matrix  # noqa: E402
from ftbench.errors import FtbenchError  # noqa: E402

# Validate before the DAG is built: a bad key stops `snakemake -n` with one line and no job starts.
try:
    ftbench_config.validate_config(config)
except FtbenchError as error:
    sys.stderr.write(f"ftbench: {error}\n")
    sys.exit(1)

RUNS = {run["run_id"]: run for run in matrix.expand_runs(config)}
DATA_TASKS = matrix.data_tasks(list(RUNS.values()))
SHARD_SIZE_MB = matrix.shard_size_mb(config)


wildcard_constraints:
    run_id="|".join(map(re.escape, RUNS)) or "NO_RUNS",
    data_id="|".join(map(re.escape, DATA_TASKS)) or "NO_DATA",


def get_run_spec_json(wildcards):
    """Only this run's own spec reaches its job, so editing one run re-runs only that run."""
    return json.dumps(RUNS[wildcards.run_id], sort_keys=True)


def get_run_data(wildcards):
    return f"results/data/{RUNS[wildcards.run_id]['data_id']}"


def get_data_task_json(wildcards):
    return json.dumps(DATA_TASKS[wildcards.data_id], sort_keys=True)


def get_run_gpus(wildcards):
    return RUNS[wildcards.run_id]["num_gpus"]


def all_run_metrics():
    return [f"results/runs/{run_id}/metrics.json" for run_id in RUNS]


def all_run_steps():
    return [f"results/runs/{run_id}/steps.parquet" for run_id in RUNS]
