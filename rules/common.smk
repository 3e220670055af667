# Shared helpers: config validation, the run table, and get_* input functions. No rules here.

import json
import math
import re
from pathlib import Path
import sys

# ftbench is installed (pip install -e .): see the README.
from ftbench import config as ftbench_config
from ftbench import matrix
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
# Resources: what each job asks the scheduler for (SLURM through profiles/slurm; locally Snakemake only
# uses `threads` and, with --resources, mem_mb/gpu as limits). A guess that is too small costs a
# killed or stopped job; one too large costs queue time. These err on the large side and scale with
# `attempt`, so a job retried (profile `retries`) after running out of memory or time asks for more.
# Override per run of snakemake with `--set-resources train:runtime=240 train:mem_mb=64000`.

# CPU cores per GPU of a training job (sbatch --cpus-per-gpu): the data is pre-tokenised, so a few
# cores feed a GPU; raise it where your cluster gives each GPU a fixed share of a node's cores anyway.
TRAIN_CPUS_PER_GPU = 4
# CPU cores of a training run without a GPU (num_gpus 0) on a cluster: enough to measure a small model;
# locally such a run takes all of --cores instead.
TRAIN_CPU_THREADS_CLUSTER = 8
# Walltime floor (minutes): short enough to backfill well, long enough for a job's fixed costs
# (queue-side start, imports, model and data load, evaluation, writing results) on a slow file system.
TRAIN_RUNTIME_FLOOR_MIN = 10
# Fixed seconds per training job on top of the compute estimate (start, imports, loading, writing).
TRAIN_STARTUP_S = 300
# Factor on the compute estimate: the per-token cost below is a rough guess (kernel efficiency,
# padding, evaluation overhead, a slow or shared node), so ask for twice what it predicts.
TRAIN_RUNTIME_MARGIN = 2.0
# Achieved (not peak) FLOP/s per device used to turn tokens into seconds. Deliberately low: about 10-20%
# of a current data-centre GPU's peak, and a few cores of a CPU. fp32 runs on a GPU get the fp32 rate
# (TF32 off), half precision the tensor-core rate.
ACHIEVED_FLOPS = {"cpu": 5e10, "fp32": 5e12, "bf16": 3e13, "fp16": 3e13}
# Parameters assumed when the model's config.json cannot be read while the DAG is built (a hub model
# that is not in the local Hugging Face cache): a 1B model, so small models get generous walltimes.
DEFAULT_MODEL_PARAMS = 1e9
# Training examples assumed when the dataset's size is not known before it is prepared (a source
# with its own train split): set train_size in the dataset, or max_steps in the run, to be exact.
DEFAULT_TRAIN_EXAMPLES = 100_000
# Host memory (MB) of a training job: a floor for Python, torch and the tokenised data, plus room for
# the weights as loaded on the host (fp32, twice over while they are moved to the device) per process.
TRAIN_MEM_FLOOR_MB = 8000
TRAIN_HOST_BYTES_PER_PARAM = 8


def run_uses_gpu(run):
    return run.num_gpus > 0 and run.device != "cpu"


def get_train_gpus(wildcards):
    """GPUs of the run's job (sbatch --gpus); 0 for CPU runs, which then request no GPU at all."""
    run = RUNS[wildcards.run_id]
    return run.num_gpus if run_uses_gpu(run) else 0


def get_train_threads(wildcards):
    """CPU threads of a training job (torch.set_num_threads, and sbatch --cpus-per-task of a CPU run).

    Locally a training job takes all of --cores, so runs are timed one at a time and never slow each
    other down. On a cluster each job has a node share of its own: TRAIN_CPUS_PER_GPU per GPU for a GPU
    run, TRAIN_CPU_THREADS_CLUSTER for a CPU run (`workflow.non_local_exec` is true both where jobs are
    submitted and inside them, so both sides agree).
    """
    run = RUNS[wildcards.run_id]
    if not workflow.non_local_exec:
        return workflow.cores
    if run_uses_gpu(run):
        return TRAIN_CPUS_PER_GPU * run.num_gpus
    return TRAIN_CPU_THREADS_CLUSTER


_MODEL_PARAMS_CACHE = {}


def estimate_model_params(model_def):
    """Parameter count from the model's config.json (no weights are read), else DEFAULT_MODEL_PARAMS.

    Transformer blocks: 4 h^2 (attention) + 3 h i (a gated MLP; 2 h i for a plain one, so this is on
    the safe side) per layer, plus the embeddings. Good to ~30%, which the runtime margin absorbs.
    """
    key = json.dumps(model_def, sort_keys=True)
    if key in _MODEL_PARAMS_CACHE:
        return _MODEL_PARAMS_CACHE[key]
    source = model_def["source"]
    settings = None
    try:
        if source["kind"] == "config":
            settings = source.get("overrides", {})
        elif source["kind"] in ("path", "package"):
            from ftbench import sources as ftbench_sources

            settings = json.loads((Path(ftbench_sources.resolve_location(source)) / "config.json").read_text())
    except (OSError, ValueError, FtbenchError):
        settings = None
    params = DEFAULT_MODEL_PARAMS
    if settings:
        settings = {**settings, **settings.get("text_config", {})}
        hidden = settings.get("hidden_size") or settings.get("n_embd") or settings.get("d_model")
        layers = settings.get("num_hidden_layers") or settings.get("n_layer") or settings.get("num_layers")
        if hidden and layers:
            inner = settings.get("intermediate_size") or settings.get("n_inner") or settings.get("d_ff") or 4 * hidden
            vocab = settings.get("vocab_size") or 32000
            params = layers * (4 * hidden * hidden + 3 * hidden * inner) + vocab * hidden
    _MODEL_PARAMS_CACHE[key] = params
    return params


def estimate_train_steps(run):
    """Optimizer steps of the run: max_steps, or epochs over the training split (global batch =
    batch_size x devices x grad_accum_steps, as the trainer counts them)."""
    if run.max_steps:
        return run.max_steps
    devices = max(1, run.num_gpus) if run.parallel in ("dp", "ddp") else 1
    per_step = run.batch_size * devices * run.grad_accum_steps
    examples = run.dataset_def.get("train_size", DEFAULT_TRAIN_EXAMPLES)
    return math.ceil((run.epochs or 1) * examples / per_step)


def estimate_train_seconds(run):
    """Compute seconds of one training job on the device it asks for: training tokens per device
    x 6 FLOPs per parameter (forward + backward), plus evaluation (2 per parameter), over ACHIEVED_FLOPS."""
    params = estimate_model_params(run.model_def)
    # auto_batch_size may measure at up to auto_batch_size_max: plan for the largest.
    if run.auto_batch_size:
        run = run.replace(batch_size=run.auto_batch_size_max)
    tokens_per_device = estimate_train_steps(run) * run.batch_size * run.grad_accum_steps * run.seq_len
    flops = 6 * params * tokens_per_device
    if run.gradient_checkpointing:
        flops *= 4 / 3  # one more forward pass
    if run.method == "qlora":
        flops *= 2  # 4-bit weights are dequantised on every use
    eval_examples = run.max_eval_samples or run.dataset_def.get("eval_size", DEFAULT_TRAIN_EXAMPLES // 10)
    flops += 2 * params * eval_examples * run.seq_len
    rate = ACHIEVED_FLOPS[run.precision] if run_uses_gpu(run) else ACHIEVED_FLOPS["cpu"]
    return flops / rate


def get_train_runtime(wildcards, attempt=1):
    """Walltime (minutes) of a training job: startup + margin x the compute estimate, at least
    TRAIN_RUNTIME_FLOOR_MIN, doubled on each retry. The train rule passes it to the job as its time
    limit, so a run that is slower than guessed stops itself with status=timeout and what it measured."""
    run = RUNS[wildcards.run_id]
    seconds = TRAIN_STARTUP_S + TRAIN_RUNTIME_MARGIN * estimate_train_seconds(run)
    return max(TRAIN_RUNTIME_FLOOR_MIN, math.ceil(seconds / 60)) * 2 ** (attempt - 1)


def get_train_mem_mb(wildcards, attempt=1):
    run = RUNS[wildcards.run_id]
    processes = max(1, run.num_gpus) if run.parallel == "ddp" else 1
    weights_mb = estimate_model_params(run.model_def) * TRAIN_HOST_BYTES_PER_PARAM / 1e6
    return math.ceil(TRAIN_MEM_FLOOR_MB + processes * weights_mb) * attempt
