# Shared helpers: config validation, the run table, and get_* input functions. No rules here.

import contextlib
import json
import os
from pathlib import Path
import re
import subprocess
import sys

# ftbench is installed (pip install -e .): see the README.
from ftbench.experiment import config as ftbench_config
from ftbench.data import prepared as ftbench_prepared
from ftbench.experiment import base_evaluation as ftbench_base_evaluation
from ftbench.experiment import matrix
from ftbench.cluster import job_clock as ftbench_job_clock
from ftbench.cluster import kept_rows as ftbench_kept_rows
from ftbench.cluster import progress_relay as ftbench_progress_relay
from ftbench.cluster import resources as ftbench_resources
from ftbench.cluster import slurm as ftbench_slurm
from ftbench.errors import FtbenchError


@contextlib.contextmanager
def stop_on_ftbench_error():
    """ftbench's checks raise FtbenchError with one line naming the key or file: Snakemake stops with that
    line (exit 1) instead of a traceback. Used by every check of the workflow's files."""
    try:
        yield
    except FtbenchError as error:
        sys.stderr.write(f"ftbench: {error}\n")
        sys.exit(1)


# Snakemake's YAML loader keeps the last of two equal keys silently (a second model of the same name
# would replace the first): read the experiment files again with ftbench's strict loader, which stops
# with the file and line.
# Then validate before the DAG is built: a bad key stops `snakemake -n` with one line and no job starts.
# The GPU limit (--resources gpu=N, on the command line or from a profile) too: Snakemake would
# silently shrink a larger request to N.
with stop_on_ftbench_error():
    for _path in workflow.config_settings.configfiles or [Path(workflow.basedir) / "config" / "config.yaml"]:
        ftbench_config.load_yaml(_path)
    ftbench_config.validate_config(config)
    _gpu_limit = workflow.global_resources.get("gpu")
    ftbench_config.check_gpu_limit(config, getattr(_gpu_limit, "value", _gpu_limit))

# The GPU table (each GPU's dense peaks and memory): read by collect (MFU) and report (the memory line).
GPU_TABLE = str(Path(workflow.basedir) / "config" / "gpus.yaml")

# The repository, for the conda environments' post-deploy scripts (envs/*.post-deploy.sh), which run
# from copies under .snakemake/conda/ and install ftbench from here (`--use-conda`).
os.environ.update(FTBENCH_ROOT=str(workflow.basedir))
# Inside a job a cluster executor submitted (SLURM: the rule's job), the train job counts its walltime from the
# scheduler's start of the job (cluster/job_clock.py); a workflow run locally inside an allocation does not.
if workflow.remote_exec:
    os.environ[ftbench_job_clock.SCHEDULED_ENV] = "1"

# --set-resources train:runtime=N (and mem_mb) replaces the train rule's estimate; Snakemake would give every
# retry that same number, so a job its walltime ended would end again at the same point. A given value is made a
# function of the attempt instead (resources.given_per_attempt: what a retry of the estimate gets), keeping its raw
# text for the Snakemake inside each job. Done before rules/train.smk defines the rule, which copies these in.
# (Snakemake's parsed --set-resources: internal, read-only elsewhere; an expression given there is left alone.)
def given_train_resource(name, given):
    def resource(wildcards, attempt=1):
        if name == "runtime" and _cluster_jobs():
            with stop_on_ftbench_error():
                ftbench_job_clock.check_walltime(given, "--set-resources train:runtime")
        return ftbench_resources.given_per_attempt(name, given, attempt)

    return resource


def _scale_given_train_resources():
    """The given train resources made functions of the attempt; {name: the given value}."""
    from snakemake.resources import Resource

    given = workflow.resource_settings._parsed_overwrite_resources.get("train")
    values = {}
    for name in ftbench_resources.GIVEN_PER_ATTEMPT if given else ():
        value = given[name] if name in given else None
        if value is not None and not value.is_evaluable() and isinstance(value.value, int):
            values[name] = value.value
            given[name] = Resource(name, given_train_resource(name, value.value), raw=value.raw)
    return values


GIVEN_TRAIN_RESOURCES = _scale_given_train_resources()


def check_given_walltime():
    """The given train walltime checked once the executor is known, before the first job is submitted: a train
    job's resources are otherwise evaluated only when it is about to run, after its data was prepared."""
    if "runtime" in GIVEN_TRAIN_RESOURCES and workflow.non_local_exec:
        with stop_on_ftbench_error():
            ftbench_job_clock.check_walltime(GIVEN_TRAIN_RESOURCES["runtime"], "--set-resources train:runtime")

RUNS = {run.run_id: run for run in matrix.expand_runs(config)}
DATA_PREPARATIONS = matrix.data_preparations(list(RUNS.values()))
SHARD_SIZE_MB = matrix.shard_size_mb(config)
# base_eval_id -> the run (on one device) whose model the shared evaluation before training builds and scores.
BASE_EVALS = ftbench_base_evaluation.shared_evaluations(RUNS.values())


wildcard_constraints:
    run_id="|".join(map(re.escape, RUNS)) or "NO_RUNS",
    data_id="|".join(map(re.escape, DATA_PREPARATIONS)) or "NO_DATA",


def get_run_spec_json(wildcards):
    """Only this run's own spec reaches its job, so editing one run re-runs only that run."""
    return RUNS[wildcards.run_id].to_json()


# The job reads its spec from a file with exactly params.spec (the rerun trigger) in it, so the shell
# line, which Snakemake prints in every error block, stays short. Written where the job is evaluated
# (also inside a cluster job), and only when it differs.
RUN_SPEC_DIR = Path(".snakemake", "ftbench", "specs")


def get_run_spec_file(wildcards):
    from ftbench import atomic

    path = RUN_SPEC_DIR / f"{wildcards.run_id}.json"
    text = get_run_spec_json(wildcards)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic.write_text(path, text)
    return str(path)


def get_run_data(wildcards):
    return f"results/data/{RUNS[wildcards.run_id].data_id}"


def get_data_preparation_json(wildcards):
    return json.dumps(DATA_PREPARATIONS[wildcards.data_id], sort_keys=True)


def all_run_metrics():
    return [f"results/runs/{run_id}/metrics.json" for run_id in RUNS]


def all_run_steps():
    return [f"results/runs/{run_id}/steps.parquet" for run_id in RUNS]


def all_run_evals():
    return [f"results/runs/{run_id}/evals.parquet" for run_id in RUNS]


# ---------------------------------------------------------------------------------------------------
# Resources of the train rule: the estimate and the reasons for its numbers are in ftbench/cluster/resources.py.
# `workflow.non_local_exec` is true both where jobs are submitted and inside them, so both sides agree
# on a job's threads (both read the partition's nodes with sinfo).


def get_train_gpus(wildcards):
    return ftbench_resources.train_gpus(RUNS[wildcards.run_id])


def get_train_gres(wildcards):
    return ftbench_resources.train_gres(RUNS[wildcards.run_id])


def get_train_nodes(wildcards):
    """Nodes of the run's job. Multi-node runs need a cluster executor (SLURM): checked here, when the DAG
    is built, because while the Snakefile is parsed Snakemake has not chosen its executor yet. A dry run
    executes with Snakemake's dry-run executor whatever --executor says; the intended one shows in
    use_threads, which Snakemake turns on for every non-local executor (and for --use-threads). Inside a
    SLURM job the rule runs in a Snakemake of its own (`srun -n1 ... snakemake --mode remote`, from the
    jobstep plugin) with the local executor: remote mode means a cluster executor submitted the job, so
    it is on the cluster (and was checked where it was submitted)."""
    cluster = workflow.non_local_exec or workflow.remote_exec or (workflow.dryrun and workflow.execution_settings.use_threads)
    run = RUNS[wildcards.run_id]
    with stop_on_ftbench_error():
        ftbench_config.check_nodes(run, config, cluster)
    return ftbench_resources.train_nodes(run)


def get_train_threads(wildcards):
    run = RUNS[wildcards.run_id]
    return ftbench_resources.train_threads(run, local=not _cluster_jobs(), cores=workflow.cores, nodes=_train_nodes())


def get_train_cpus_per_gpu(wildcards):
    run = RUNS[wildcards.run_id]
    cpus = ftbench_resources.train_cpus_per_gpu(run, _train_nodes())
    if run.uses_gpu and cpus < ftbench_resources.TRAIN_CPUS_PER_GPU and not workflow.remote_exec:
        _say_once(f"ftbench: the nodes of partition '{ftbench_resources.train_partition(os.environ) or 'default'}' "
                  f"have {cpus} CPUs per GPU for {run.num_gpus}-GPU runs: asking for --cpus-per-gpu={cpus}, "
                  f"not {ftbench_resources.TRAIN_CPUS_PER_GPU}")
    return cpus


_SAID = set()


def _say_once(line):
    if line not in _SAID:
        _SAID.add(line)
        sys.stderr.write(f"{line}\n")


def get_train_partition(wildcards):
    return ftbench_resources.train_partition(os.environ)


def _train_nodes():
    """The train partition's nodes (sinfo, read once) on a cluster; () locally. Read where jobs are
    submitted and again inside each job, so both fit a job's CPUs alike (no sinfo there: nothing fitted)."""
    if not _cluster_jobs():
        return ()
    return ftbench_slurm.node_shapes(ftbench_resources.train_partition(os.environ))


def _cluster_jobs():
    """Whether jobs run (or, in a dry run, would run) through a cluster executor. A dry run executes
    with the local `dryrun` executor; Snakemake forces use_threads only when the executor it stands in
    for is not local, so `snakemake --profile slurm -n` shows the CPUs that would be submitted."""
    return workflow.non_local_exec or (workflow.dryrun and workflow.execution_settings.use_threads)


# The one start hook of the workflow (after the DAG is built, before the first submission; never in a
# dry run). On a SLURM cluster without accounting, track jobs with squeue: sacct would hang silently.
onstart:
    check_given_walltime()
    ftbench_slurm.choose_status_command(workflow)
    # A row kept beside its outputs (cluster/kept_rows.py) is for a job its scheduler ended after writing it: once
    # the outputs it was published as are here, it is dropped, so a forced rerun trains the run.
    ftbench_kept_rows.forget_published(all_run_metrics())
    start_warm_process()
    start_progress_relay()


def start_progress_relay():
    """Locally, the latest progress line of each running train job, once a minute, on this terminal
    (cluster/progress_relay.py). Not for a cluster: there `tail -f logs/train/<run_id>.log` follows a job."""
    if not workflow.non_local_exec and any(job.rule.name == "train" for job in workflow.dag.needrun_jobs()):
        ftbench_progress_relay.start()


def start_warm_process():
    """Locally, the warm process that train jobs fork from (ftbench/cluster/warmstart.py) starts with the workflow,
    which waits (up to a minute) until it has imported the stack before starting any job: the imports are paid
    once, here, and not inside the first train job's wall time. The wait forgoes overlapping them with data
    preparation, at most the imports' few seconds once per invocation. Not for a cluster (each job is its own
    allocation), not with --use-conda (jobs run another Python), not when no train job is to run. Started
    through `python`, as the rules are, so it is the one the jobs look for."""
    from snakemake.settings.types import DeploymentMethod

    if workflow.non_local_exec or DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
        return
    if any(job.rule.name == "train" for job in workflow.dag.needrun_jobs()):
        subprocess.run(["python", "-m", "ftbench.cluster.warmstart", "start", "--wait"], check=False)


def get_train_runtime(wildcards, attempt=1):
    """The job's one time limit: sbatch -t, what `snakemake -n` shows, and the train rule's --time-limit-s.
    The first Snakemake to estimate it (the one that plans the invocation, or a dry run) decides the speed
    of GPU runs and puts it in the environment, which the jobs it submits inherit (sbatch --export=ALL): the
    Snakemake inside a job, on a node whose GPU it may not see, reads that decision and gets the same number."""
    from ftbench.experiment import base_evaluation

    os.environ.setdefault(ftbench_resources.TRAIN_SPEED_ENV, ftbench_resources.train_speed(local=not _cluster_jobs()))
    run = RUNS[wildcards.run_id]
    return ftbench_resources.train_runtime_minutes(
        run, attempt, base_eval_in_job=not base_evaluation.shares_base_evaluation(run))


def get_train_mem_mb(wildcards, attempt=1):
    return ftbench_resources.train_mem_mb(RUNS[wildcards.run_id], attempt)


# The prepared data (rules/data.smk)


def say_stale_data():
    """One line per prepared data folder of an earlier layout (its manifest version): its prepare_data job runs
    again (the version is one of its params), and so do the runs trained on it. Not inside a cluster job."""
    if workflow.remote_exec:
        return
    for data_id in DATA_PREPARATIONS:
        manifest = Path("results", "data", data_id, ftbench_prepared.MANIFEST_NAME)
        with contextlib.suppress(OSError, ValueError):
            version = json.loads(manifest.read_text(encoding="utf-8")).get("manifest_version")
            if version != ftbench_prepared.MANIFEST_VERSION:
                sys.stderr.write(f"ftbench: note: results/data/{data_id} was prepared by an earlier ftbench (data version "
                                 f"{version}; now {ftbench_prepared.MANIFEST_VERSION}: each split stored in a seeded "
                                 "stratified order): it is prepared again, and the runs on it train again\n")


# The shared evaluation before training (rules/base_eval.smk)


def get_run_base_eval(wildcards):
    """The shared evaluation a run's train job reads: none for a run that scores its own (or none at all)."""
    run = RUNS[wildcards.run_id]
    return [ftbench_base_evaluation.base_eval_path(run)] if ftbench_base_evaluation.shares_base_evaluation(run) else []


def get_base_eval_key_json(wildcards):
    """What the evaluation depends on, and nothing else: another experiment whose first run of these weights has
    other settings (a learning rate, a LoRA rank) finds it unchanged and scores nothing again."""
    return json.dumps(ftbench_base_evaluation.base_eval_key(BASE_EVALS[wildcards.base_eval_id]), sort_keys=True)


def get_base_eval_spec_file(wildcards):
    """The spec of the run the job builds, in a file (not a param: which run of these weights stands for them
    changes nothing the job computes)."""
    from ftbench import atomic

    path = Path(".snakemake", "ftbench", "base_eval_specs", f"{wildcards.base_eval_id}.json")
    text = BASE_EVALS[wildcards.base_eval_id].to_json()
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        atomic.write_text(path, text)
    return str(path)


def _base_eval_run(wildcards):
    return BASE_EVALS[wildcards.base_eval_id]


def get_base_eval_threads(wildcards):
    return ftbench_resources.train_threads(_base_eval_run(wildcards), local=not _cluster_jobs(), cores=workflow.cores,
                                           nodes=_train_nodes())


def get_base_eval_runtime(wildcards, attempt=1):
    """The train job's estimate for the same run (get_train_runtime: the speed decided once per invocation):
    ample for one evaluation, and the same number wherever it is evaluated."""
    os.environ.setdefault(ftbench_resources.TRAIN_SPEED_ENV, ftbench_resources.train_speed(local=not _cluster_jobs()))
    return ftbench_resources.train_runtime_minutes(_base_eval_run(wildcards), attempt)
