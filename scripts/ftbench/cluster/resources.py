"""What each training job asks the scheduler for: GPUs, CPU threads, walltime and host memory.

SLURM gets these through profiles/slurm; locally Snakemake only uses `threads` and, with --resources,
mem_mb/gpu as limits. A guess that is too small costs a killed or stopped job; one too large costs queue
time. These err on the large side and scale with `attempt`, so a job retried (profile `retries`) after
running out of memory or time asks for more. rules/common.smk passes them to the train rule; replace the
estimate of the first attempt per run of snakemake with `--set-resources train:runtime=240 train:mem_mb=64000`
(a retry scales a given value as it scales the estimate: given_per_attempt).

Computed while Snakemake builds the DAG, so nothing here imports torch or transformers: the model's
size comes from its config.json alone.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

from ftbench.measure import model_shape
from ftbench.data import sources
from ftbench.measure.memory_estimate import OPTIMIZER_BYTES
from ftbench.tasks.registry import model_family
from ftbench.errors import FtbenchError
from ftbench.cluster.gpu_slots import visible_gpu_count
from ftbench.runspec import RunSpec, compute_dtype
from ftbench.cluster.slurm import NodeShape

# CPU cores per GPU of a training job (sbatch --cpus-per-gpu): the data is pre-tokenised, so a few
# cores feed a GPU; raise it where your cluster gives each GPU a fixed share of a node's cores anyway.
TRAIN_CPUS_PER_GPU = 4
# CPU cores of a training run without a GPU (num_gpus 0) on a cluster: enough to measure a small model;
# locally such a run takes all of --cores instead.
TRAIN_CPU_THREADS_CLUSTER = 8
# The environment variable that carries an invocation's walltime speed ("gpu" or "cpu", train_speed) from the
# Snakemake that plans it to the Snakemake inside each of its jobs; set it yourself to choose.
TRAIN_SPEED_ENV = "FTBENCH_TRAIN_SPEED"
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
ACHIEVED_FLOPS = {"cpu": 5e10, "fp32": 5e12, "bf16": 3e13, "fp16": 3e13}  # by the dtype a precision computes in
# Parameters assumed when the model's config.json cannot be read while the DAG is built (a hub model
# that is not in the local Hugging Face cache): a 1B model, so small models get generous walltimes.
DEFAULT_MODEL_PARAMS = 1e9
# Vocabulary assumed for a config that does not give one (Llama 2's 32000 tokens).
DEFAULT_VOCAB_SIZE = 32000
# Training examples assumed when the dataset's size is not known before it is prepared (a source
# with its own train split): set train_size in the dataset, or max_steps in the run, to be exact.
DEFAULT_TRAIN_EXAMPLES = 100_000
# Host memory (MB) of a training job: a floor for Python, torch and the tokenised data, plus room for
# the weights as loaded on the host (fp32, twice over while they are moved to the device) per process.
TRAIN_MEM_FLOOR_MB = 8000
TRAIN_HOST_BYTES_PER_PARAM = 8
# Optimizer state bytes per trainable parameter (OPTIMIZER_BYTES): measure.memory_estimate's table, which
# counts GPU memory with it.
# fsdp_cpu_offload's slowdown on the walltime estimate: every step moves the weights to the GPU and back
# and runs the optimizer on the CPU. Measured 17x (Llama 3.2 1B shape, bf16, batch 4 x 1024, one H100).
TRAIN_OFFLOAD_SLOWDOWN = 20
# Answers generated (answer_metric): every batch of eval_batch_size prompts takes up to max_new_tokens decoding
# steps, each one token per row through the whole model. Such a step is bound by kernel launches and weight reads,
# not by FLOPs, so it is counted as this many seconds plus its FLOPs at the achieved rate: a deliberately high
# guess for transformers' generate in eager mode (tens of ms a step on a GPU for 0.1B-8B decoders), which the
# margin doubles.
GENERATION_STEP_S = 0.05


def train_gpus(run: RunSpec) -> int:
    """GPUs of the run's job (sbatch --gpus, the job's total); 0 for CPU runs, which then request no GPU at
    all, and for multi-node runs, which ask per node instead (train_gres)."""
    return run.num_gpus if run.uses_gpu and run.num_nodes == 1 else 0


def train_gres(run: RunSpec) -> str | None:
    """A multi-node run's GPUs per node (sbatch --gres=gpu:G, which counts per node; --gpus=N would let
    SLURM spread the job's total unevenly over its nodes). None for one-node runs."""
    return f"gpu:{run.num_gpus}" if run.uses_gpu and run.num_nodes > 1 else None


def train_nodes(run: RunSpec) -> int:
    """Nodes of the run's job (sbatch --nodes): num_nodes; num_gpus GPUs on each."""
    return run.num_nodes


def train_threads(run: RunSpec, local: bool, cores: int, nodes: Sequence[NodeShape] = ()) -> int:
    """CPU threads of a training job (torch.set_num_threads, and sbatch --cpus-per-task of a CPU run).

    Locally (``local``) a training job takes all ``cores``, so runs are timed one at a time and never
    slow each other down. On a cluster each job has a node share of its own: train_cpus_per_gpu per GPU
    for a GPU run, TRAIN_CPU_THREADS_CLUSTER for a CPU run, at most the CPUs of the partition's
    largest node (``nodes``, from sinfo; empty: not known, asked for as it is).
    """
    if local:
        return cores
    if run.uses_gpu:
        return train_cpus_per_gpu(run, nodes) * run.num_gpus
    largest = max((node.cpus for node in nodes), default=TRAIN_CPU_THREADS_CLUSTER)
    return min(TRAIN_CPU_THREADS_CLUSTER, largest)


def train_cpus_per_gpu(run: RunSpec, nodes: Sequence[NodeShape] = ()) -> int:
    """sbatch --cpus-per-gpu of a GPU run: TRAIN_CPUS_PER_GPU, fitted to the partition's nodes.

    SLURM refuses outright a job that no node can hold ("Requested node configuration is not
    available"), and a retry would ask the same again: on nodes with fewer cores per GPU, ask for what
    the best node with num_gpus GPUs has. No such node at all is refused here, with the numbers."""
    if not run.uses_gpu or not nodes:
        return TRAIN_CPUS_PER_GPU
    shares = [node.cpus // run.num_gpus for node in nodes if node.gpus >= run.num_gpus]
    if not shares or max(shares) < 1:
        offered = ", ".join(sorted({f"{node.gpus} GPUs/{node.cpus} CPUs" for node in nodes}))
        raise FtbenchError(
            f"run {run.run_id} asks for num_gpus {run.num_gpus} on one node, but the nodes of its partition "
            f"have {offered} (sinfo): lower num_gpus or set FTBENCH_GPU_PARTITION to a partition with larger nodes"
        )
    return min(TRAIN_CPUS_PER_GPU, max(shares))


def train_partition(environ: Mapping[str, str]) -> str:
    """SLURM partition of a training job: FTBENCH_GPU_PARTITION, else SBATCH_PARTITION, else "" (the
    cluster's default). CPU runs of the matrix (num_gpus 0) go there too, so one matrix is measured on one
    kind of node. A rule resource, not a profile `set-resources` entry: a user's --set-resources on the
    command line replaces the profile's whole set-resources, but only adds to a rule's resources."""
    return environ.get("FTBENCH_GPU_PARTITION") or environ.get("SBATCH_PARTITION", "")


def train_runtime_minutes(run: RunSpec, attempt: int = 1, local: bool = False,
                          environ: Mapping[str, str] = os.environ, base_eval_in_job: bool = True) -> int:
    """Walltime (minutes) of a training job: startup + margin x the compute estimate, at least
    TRAIN_RUNTIME_FLOOR_MIN, doubled on each retry. The one time limit of the job: the scheduler's (sbatch -t),
    what `snakemake -n` shows, and, through the train rule's `{resources.runtime}`, the job's --time-limit-s,
    inside which the job keeps its own margin to evaluate and write a run that is slower than guessed
    (status=timeout).

    A GPU run is estimated at the speed train_speed decided for the invocation (``environ``), never at that
    of wherever this is evaluated: the Snakemake inside a cluster job, on a node whose GPU it may not see,
    must get the number that was submitted. ``base_eval_in_job``: false where the evaluation before training is
    the shared step's (experiment/base_evaluation.py), which the job reads instead of computing."""
    on_gpu = run.uses_gpu and train_speed(local, environ) == "gpu"
    seconds = TRAIN_STARTUP_S + TRAIN_RUNTIME_MARGIN * train_compute_seconds(run, on_gpu, base_eval_in_job)
    return max(TRAIN_RUNTIME_FLOOR_MIN, math.ceil(seconds / 60)) * 2 ** (attempt - 1)


# Train resources a user may give for one invocation (--set-resources train:runtime=N train:mem_mb=N) that a retry
# scales as it scales the estimate (given_per_attempt).
GIVEN_PER_ATTEMPT = ("runtime", "mem_mb")


def given_per_attempt(name: str, given: int, attempt: int = 1) -> int:
    """A train resource given with --set-resources, on ``attempt``: the given value replaces the estimate of the first
    attempt, and a retry scales it as it scales the estimate (train_runtime_minutes, train_mem_mb): the walltime
    doubles on each retry, the memory grows by the first attempt's amount. Snakemake itself would give every retry
    the same number: a job its walltime ended would end again at the same point."""
    return given * 2 ** (attempt - 1) if name == "runtime" else given * attempt


def train_speed(local: bool, environ: Mapping[str, str] = os.environ) -> str:
    """The speed ("gpu" or "cpu") GPU runs are estimated at: TRAIN_SPEED_ENV where set, else decided here.
    On a cluster a GPU run gets a GPU node: "gpu". Locally (``local``) the run finds this machine's device,
    and with no GPU visible falls back to the CPU (device auto): "cpu", not timed out at a GPU's speed.

    The Snakemake that plans the invocation records its decision in TRAIN_SPEED_ENV (rules/common.smk);
    sbatch hands its environment to the job (--export=ALL), so the Snakemake inside the job reads the decision
    instead of making its own on a node where it may see no GPU."""
    decided = environ.get(TRAIN_SPEED_ENV, "").strip().lower()
    if decided in ("gpu", "cpu"):
        return decided
    if decided:
        raise FtbenchError(f"{TRAIN_SPEED_ENV}={environ[TRAIN_SPEED_ENV]!r}: expected gpu or cpu (or unset)")
    return "gpu" if not local or local_gpu_visible() else "cpu"


@functools.cache
def local_gpu_visible() -> bool:
    """Whether a job started here could see a GPU: none if CUDA_VISIBLE_DEVICES hides them all, else
    what NVML counts (torch-free; no NVML library or driver: none)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return visible_gpu_count() > 0


def train_mem_mb(run: RunSpec, attempt: int = 1) -> int:
    """Host memory (MB) per node of a training job (sbatch --mem is per node): the floor plus the host copy
    of the weights per process of the node, plus, with fsdp_cpu_offload, each process's shard of the
    offloaded states (fp32 weights and gradients, optimizer state)."""
    params = model_params(run.model_def)
    per_process = params * TRAIN_HOST_BYTES_PER_PARAM
    if run.parallel == "fsdp" and run.fsdp_cpu_offload:
        per_process += params * (4 + 4 + OPTIMIZER_BYTES[run.optimizer]) / run.devices
    processes_per_node = run.processes // run.num_nodes
    return math.ceil(TRAIN_MEM_FLOOR_MB + processes_per_node * per_process / 1e6) * attempt


def train_compute_seconds(run: RunSpec, on_gpu: bool | None = None, base_eval_in_job: bool = True) -> float:
    """Compute seconds of one training job on a GPU (``on_gpu``; default: where the run asks for one)
    or the CPU: training tokens per device x 6 FLOPs per parameter (forward + backward), plus the
    evaluations' tokens (``eval_examples_scored``) x 2 per parameter, over ACHIEVED_FLOPS; plus generating answers
    to those prompts where the run scores by generation (``generation_seconds``)."""
    params = model_params(run.model_def)
    examples = run.dataset_def.get("train_size", DEFAULT_TRAIN_EXAMPLES)
    run = largest_batch_run(run, examples)
    per_example = model_family(run.model_def).tokens_per_example(run)  # text: seq_len; images: their tokens
    tokens_per_device = train_steps(run, examples) * run.batch_size * run.grad_accum_steps * per_example
    flops = 6 * params * tokens_per_device
    if run.gradient_checkpointing:
        flops *= 4 / 3  # one more forward pass
    if run.method == "qlora":
        flops *= 2  # 4-bit weights are dequantised on every use
    if run.parallel == "fsdp" and run.fsdp_cpu_offload:
        flops *= TRAIN_OFFLOAD_SLOWDOWN
    flops += 2 * params * eval_examples_scored(run, examples, base_eval_in_job) * per_example
    on_gpu = run.uses_gpu if on_gpu is None else on_gpu
    rate = ACHIEVED_FLOPS[compute_dtype(run.precision)] if on_gpu else ACHIEVED_FLOPS["cpu"]
    answered = eval_examples_scored(run, examples, base_eval_in_job)
    return flops / rate + generation_seconds(run, answered, params, rate, per_example)


def generation_seconds(run: RunSpec, answered: int, params: float, rate: float, prompt_tokens: int = 0) -> float:
    """Seconds of generating answers to ``answered`` eval prompts (the rows the evaluations score, where the run's
    answer_metric asks for answers): each prompt's own forward pass (``prompt_tokens`` at most: the prefill that
    fills the KV cache), then max_new_tokens decoding steps per batch of eval_batch_size (GENERATION_STEP_S each, plus
    its FLOPs at ``rate``)."""
    if run.answer_metric in (None, "none") or answered == 0:
        return 0.0
    batches = math.ceil(answered / run.eval_batch_size)
    step_s = GENERATION_STEP_S + 2 * params * min(run.eval_batch_size, answered) / rate
    return 2 * params * answered * prompt_tokens / rate + batches * run.max_new_tokens * step_s


def eval_examples_scored(run: RunSpec, train_examples: int, base_eval_in_job: bool = True) -> int:
    """Eval examples one training job scores: the final evaluation's (max_eval_samples, else the eval split); the
    same again before training (eval_before_training) unless the shared step scored them (``base_eval_in_job``
    false); with eval_every, eval_subset of them at each evaluation between steps (evaluations_between_steps)."""
    final = run.max_eval_samples or run.dataset_def.get("eval_size", DEFAULT_TRAIN_EXAMPLES // 10)
    scored = final * (2 if run.eval_before_training and base_eval_in_job else 1)
    if run.eval_every:
        scored += evaluations_between_steps(run, train_examples) * min(final, run.eval_subset or final)
    return scored


def evaluations_between_steps(run: RunSpec, train_examples: int) -> int:
    """Subset evaluations the trainer schedules (train/evaluation.py, DuringTraining.due): before every step whose
    index is a multiple of eval_every below the run's steps (step 0 included, the last one possibly a few steps
    before the final evaluation), step 0's being the evaluation before training where there is one. 40 steps at
    eval_every 10: steps 0, 10, 20, 30 (not 40: the final evaluation follows the last step)."""
    scheduled = math.ceil(train_steps(run, train_examples) / run.eval_every)
    return scheduled - (1 if run.eval_before_training else 0)


def largest_batch_run(run: RunSpec, train_examples: int) -> RunSpec:
    """The run at the largest batch it may measure at: with auto_batch_size, the cap of the trainer's search
    (RunSpec.auto_batch_size_cap: auto_batch_size_max, lowered until one global batch fits in the training split)."""
    if not run.auto_batch_size:
        return run
    return run.replace(batch_size=run.auto_batch_size_cap(train_examples))


def train_steps(run: RunSpec, train_examples: int) -> int:
    """Optimizer steps of the run, counted as the trainer counts them (RunSpec.planned_steps)."""
    try:
        return run.planned_steps(train_examples)
    except ValueError:
        return 1  # less than one global batch: the trainer stops at its start with that error


_MODEL_PARAMS: dict[str, float] = {}


def gguf_config(source: dict) -> dict | None:
    """A local GGUF checkpoint's shape from its file's header (its folder has no config.json); None otherwise."""
    if not source.get("gguf_file") or source["kind"] not in ("path", "package"):
        return None
    try:
        return model_shape.gguf_settings(Path(sources.resolve_location(source)) / source["gguf_file"])
    except FtbenchError:
        return None


def model_params(model_def: dict) -> float:
    """Parameter count from the model's config (a config-built model's overrides, a local checkpoint's
    config.json, or a local GGUF file's header; no weights are read), else DEFAULT_MODEL_PARAMS.

    Transformer blocks: 4 h^2 (attention) + 3 h i (a gated MLP; 2 h i for a plain one, so this is on
    the safe side) per layer, plus the embeddings. Good to ~30%, which the runtime margin absorbs; an
    encoder-decoder counts its encoder stack only (T5: about 60% of its parameters). Read once per model
    and process: every job of a model asks for it.
    """
    key = json.dumps(model_def, sort_keys=True)
    if key not in _MODEL_PARAMS:
        config = sources.local_model_config(model_def["source"]) or gguf_config(model_def["source"]) or {}
        shape = model_shape.from_config(config)
        params = DEFAULT_MODEL_PARAMS
        if shape.width and shape.layers:
            vocab = shape.vocab_size or DEFAULT_VOCAB_SIZE
            params = shape.layers * (4 * shape.width**2 + 3 * shape.width * shape.intermediate) + vocab * shape.width
            if isinstance(config.get("vision_config"), dict):  # a dual encoder's vision tower (the above: its text side)
                vision = model_shape.from_config(config["vision_config"])
                params += vision.layers * (4 * vision.width**2 + 3 * vision.width * vision.intermediate)
        _MODEL_PARAMS[key] = params
    return _MODEL_PARAMS[key]


