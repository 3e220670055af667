"""A training step's time on a GPU, predicted before anything trains: what one step asks of a device (``Workload``,
from the run's settings and its model's config alone) and how long a GPU of config/gpus.yaml takes for it
(``step_terms``), given the free parameters a calibration holds (experiment/calibration.py).

The terms, per device and optimizer step:

- compute: the matrix multiplications' FLOPs (the convention of measure/flops.py, on every token position the GPU
  computes, padding included, plus the forward pass gradient checkpointing recomputes) over the dense peak of the
  run's compute dtype (``recipe.compute_dtype``) times an efficiency. Matmul efficiency rises with the width of the
  layers (``compute_efficiency / (1 + width_half / width)``: small matmuls fill fewer of the GPU's units); fused
  attention runs at ``attention_ratio`` of the matmuls' efficiency; QLoRA's 4-bit Linears, which dequantise their
  weight before each matmul, take ``qlora_matmul_ratio`` times a 16-bit matmul's time (GPU-bound QLoRA runs came out
  3-10% fast without it, H200).
- memory traffic: what the kernels that are not matmuls read and write, over the memory bandwidth times an
  efficiency. Counted in bytes from the recipe (recipe.py): the optimizer update (parameters, gradients, moments in
  their dtypes), the gradients written per micro-batch, autocast's 16-bit copies of fp32 weights, QLoRA's
  dequantisation of each 4-bit weight per use, the LoRA branches' elementwise work, and the loss over the
  vocabulary (``LOSS_BYTES`` per logit: eager upcasts the logits to fp32 and runs log-softmax and its backward over
  them, a fixed walk of kernels whatever the layers do; Liger's fused cross-entropy reads a chunk of 16-bit logits
  and writes its gradient in place); and the layers' elementwise work (norms, activations, rotary, residual adds)
  as ``traffic_eager`` x the bytes the memory estimate says a micro-batch keeps of its activations
  (measure/memory_estimate.py): eager PyTorch reads and writes each kept tensor several times (an RMSNorm alone is
  seven kernels). Liger's fused kernels and torch.compile's move ``liger_traffic_ratio`` and
  ``compiled_traffic_ratio`` of that per kept byte: the same tensors in fewer passes, at the same achieved
  bandwidth, so a fit without a Liger run still moves Liger's prediction with eager's. The logits are counted
  apart from the layers because their passes do not scale with the layers' (a 152k vocabulary makes the logits
  half of a Qwen2-0.5B's kept bytes; held out of the fit, its two runs came out at 0.94 and 0.91 of their measured
  tokens/s with the logits at the layers' rate, 1.03 and 0.95 counted apart, H200).
- communication (ddp, fsdp, dp): gradients reduced and sharded weights gathered, over the GPU-to-GPU link
  (``interconnect_gbs``); overlapped with the backward pass but for an exposed share (``comm_exposed``).
- kernel floor: every kernel costs the GPU ``gpu_op_s`` however little it does (its launch and ramp), counted
  per kernel the step launches (the kernel columns of ``HOST_UNITS``): what keeps a launch-bound run's GPU busy at
  all (a 134M LoRA at batch 1 x 256: 12% busy of a 0.22 s step, about 8,000 kernels, where its bytes and FLOPs
  take 2 ms, H200) and part of what LoRA's many small kernels cost a GPU-bound run (without it, the GPU-bound
  runs held out of the fit by model were off by 8% at the median, 14% at most; with it 3% and 6%).
- host: the launch and Python time per step, which does not scale with the GPU: ``host_step_s`` plus ``host_op_s``
  per unit of host work (``HOST_UNITS``: the aten operations a step dispatches plus PY_CALL_UNITS per Python call,
  counted per block, per adapted or 4-bit Linear, per autocast cast, and for checkpointing's recomputation, on a
  tiny model of each structure by scripts/count_host_ops.py; per optimizer tensor). torch.compile dispatches
  ``compiled_host_factor`` of them; FSDP's hooks and the Trainer's own work, which the counts leave out, scale them by
  ``fsdp_host_factor`` and ``trainer_host_factor`` (1 until a run of the kind calibrates one).
  Batches whose shape changes from step to step cost ``shape_churn_factor`` times the host time of fixed shapes, in
  proportion to the share of steps whose shape changes (drawn from the data, or read from a measured run's steps)
  (new shapes miss the caches of the allocator and the kernel selection: a plain loop on a 134M Llama took 152 ms
  per step at one fixed length and 1.61-1.67x that when the length changed every step, H100).

How they combine: kernels run one after another on the GPU, each bound by its own resource (a matmul by the
tensor cores, an elementwise kernel by memory), so the GPU's time is compute + memory + exposed communication
+ the kernel floor.
The host enqueues kernels ahead of the GPU; the step takes the longer of the two, and where they are close each
waits on the other at times: step = (gpu^p + host^p)^(1/p), with ``overlap_power`` p (large: the plain maximum).
The GPU's busy share is gpu / step: the same figure NVML's utilisation measures (measure/metrics.py host_bound),
which is how a host-bound run is told apart.

Torch-free: the plan runs it for every run and GPU before anything is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ftbench.data import batch_order
from ftbench.experiment import memory_plan
from ftbench.measure import memory_estimate, model_shape
from ftbench.recipe import DTYPE_BYTES, recipe_of
from ftbench.runspec import RunSpec
from ftbench.tasks.registry import model_family

MIB = 2**20
# Host work and kernels per micro-batch, as scripts/count_host_ops.py counts them on a tiny model of each structure
# (CPU, torch 2.13, transformers 5.17, peft 0.21, bitsandbytes 0.50): (forward units, backward units, units of
# checkpointing's recomputation, forward kernels, backward kernels). A unit is one aten operation dispatched
# (TorchDispatchMode) or PY_CALL_UNITS Python function calls (sys.setprofile): fitted to the tiny model's CPU time
# per step across full, LoRA and checkpointed variants, a call cost 0.065-0.072 of an operation (two timings), each
# variant within 12% of its time but QLoRA's (0.82: its 4-bit kernels run Python a dispatch count does not see);
# an operation count alone missed full fine-tuning by 28%. Kernels are the operations that are not views. Recomputation replays the forward pass inside the backward one under saved-tensor
# hooks that run Python per saved tensor three times (forward, replay, backward): 2.4 forward passes of host work
# for a full Llama block, 1.5 for LoRA's branches, 2.2 for GPT-2's block; one forward pass of kernels. On an H200's
# host the host-bound 134M Llama runs took 13-15 us per unit, full fine-tuning (7,650 units, 0.104 s), LoRA
# (15,100, 0.216 s) and checkpointed LoRA (29,300, 0.443 s) alike. Liger's blocks are counted as eager ones: its
# Triton kernels do not run on a CPU to count, and a Triton launch from Python costs several dispatches.
PY_CALL_UNITS = 0.065
HOST_UNITS = {
    # a transformer block with 16-bit weights, all trained (bf16_true): Llama's gated (7 Linears) and GPT-2's plain (4)
    "block_gated": (82, 141, 199, 38, 80), "block_plain": (85, 100, 185, 46, 59),
    "autocast_linear": (1.4, 2.3, 3.4, 1.4, 2.3),  # an fp32 Linear weight under autocast: its cast, its gradient's back
    "lora_linear": (20.3, 18.9, 30.9, 11, 10.1),  # an adapted Linear (peft's branch, lora_dropout on), net of its base
    "lora_linear_no_dropout": (16.3, 17.9, 24.8, 8, 9.1),
    # a 4-bit Linear beyond LoRA's: bitsandbytes' dequantisation and matmul as its CPU path runs them; its CUDA path
    # runs more Python than a CPU count sees, which ``qlora_host_factor`` scales (calibration.py)
    "qlora_linear": (4.4, 6.4, 6.7, 2.6, 5.6),
    "head": (74, 37, 0, 31, 26),  # embedding, final norm, output head and loss (not recomputed)
}
# Liger's fused linear cross-entropy runs per chunk of tokens (the memory estimate's chunk): a logits matmul, its
# Triton cross-entropy kernel, the input-gradient matmul and the weight-gradient addmm, with slices and casts (read
# off liger_kernel's fused_linear_cross_entropy_forward): units and kernels per chunk, on top of the head's.
LIGER_CHUNK = (8, 4)
# Optimizer operations per trainable tensor: fused AdamW and foreach SGD launch one kernel for many tensors; the
# bitsandbytes 8-bit optimizers launch per tensor.
OPTIMIZER_OPS_PER_TENSOR = {"adamw": 0.2, "sgd": 0.3, "adamw_8bit": 3, "paged_adamw_8bit": 3}
STEP_OPS = 20  # zero_grad, the scheduler, the loss read, the step's own bookkeeping
# Bytes the loss moves per logit, outside the head's matmul, by kernel kind and compute dtype. Eager (transformers'
# ForCausalLMLoss): the 16-bit logits cast to fp32 (read 2, write 4), log-softmax (three reads of the row and a
# write, 16), nll_loss's backward filling the fp32 gradient (4), log-softmax's backward (three reads and a write,
# 16) and the gradient cast back to 16 bits (read 4, write 2): 48; in fp32 no casts: 36. Liger's fused kernel: the
# 16-bit logits chunk read twice and its gradient written in place: 6. Compiled: the fused loss reads the logits
# and writes their gradient, in fp32 inside: 12 (no run has measured it).
LOSS_BYTES = {("eager", True): 48, ("eager", False): 36, ("liger", True): 6, ("liger", False): 12,
              ("compiled", True): 12, ("compiled", False): 16}
# Bytes an adapted Linear's LoRA branch reads and writes per token, per unit of its input and output width, in
# its forward and backward passes (dropout copy and mask, A's input, B's output scaled and added, the input
# gradient added to the base layer's).
LORA_BYTES_IN = {True: 20, False: 10}  # with / without lora_dropout
LORA_BYTES_OUT = 18
DEQUANT_BYTES = 4.5  # a 4-bit weight per use: read packed (0.5), write 16-bit (2), read by the matmul (2)
CAST_BYTES = 6  # an fp32 weight's 16-bit copy under autocast: read 4, write 2
SAMPLED_BATCHES = 256  # micro-batches drawn from prepared data to average a run's batch shape
# Before the data is prepared: the share of steps whose shape changes, by batching (a padded or grouped batch is as
# long as its longest row, padding_free one row of all: new shapes nearly every step; pack fills rows of seq_len).
FULL_ROW_CHANGES = {"pad": 1.0, "group_by_length": 1.0, "padding_free": 1.0, "pack": 0.5}


@dataclass(frozen=True)
class BatchShape:
    """One micro-batch on one device, averaged over the batches the run draws."""

    tokens: float  # real tokens
    positions: float  # token positions computed (padding included)
    rows: float
    real_square: float  # sum over sequences of real length squared (analytic attention)
    computed_square: float  # sum over rows of computed row length squared (attention as the kernel runs it)
    changes: float = 0.0  # share of micro-batches whose shape differs from the one before
    note: str | None = None


@dataclass(frozen=True)
class Workload:
    """What one optimizer step asks of one device, before a GPU is chosen."""

    tokens_per_step: float  # real tokens per optimizer step, all devices (what tokens/s counts)
    samples_per_step: float
    linear_flops: float  # matmul FLOPs one device computes per step (recomputation and padding included)
    attention_flops: float
    model_flops: float  # analytic model FLOPs per step, all devices (MFU's numerator, measure/flops.py)
    width: int
    activation_bytes: float  # kept activations per device per step (memory estimate), recomputation included
    fixed_bytes: float  # optimizer, gradients, weight casts, dequantisation, LoRA branches
    comm_bytes: float  # bytes over the GPU-to-GPU link per device per step
    host_ops: float  # units of host work per step (per process: HOST_UNITS), the 4-bit Linears' apart
    kernels: str  # eager | liger | compiled: which traffic multiplier
    shape_changes: float  # share of steps whose batch shape differs from the step before (shape_churn_factor)
    compute_dtype: str
    devices: int
    notes: tuple[str, ...] = field(default=())
    loss_bytes: float = 0.0  # the loss's traffic over the logits per device per step (LOSS_BYTES)
    kernel_ops: float = 0.0  # kernels one device runs per step (the kernel floor)
    qlora_host_ops: float = 0.0  # units of host work of the 4-bit Linears per step (qlora_host_factor scales them)
    host_scales: tuple[str, ...] = ()  # factors on the host work for what the counts leave out (fsdp_host_factor, ...)
    quantised_flops: float = 0.0  # of linear_flops, the 4-bit Linears' (qlora_matmul_ratio scales their time)


def full_rows(run: RunSpec, row: int) -> BatchShape:
    """A micro-batch of full rows of ``row`` tokens (synthetic data, images, or data not prepared yet)."""
    batch = run.batch_size
    if run.batching == "padding_free":
        return BatchShape(batch * row, batch * row, 1, batch * row**2, (batch * row) ** 2)
    return BatchShape(batch * row, batch * row, batch, batch * row**2, batch * row**2)


def drawn_rows(run: RunSpec, lengths: np.ndarray) -> BatchShape:
    """The mean micro-batch over the first ``SAMPLED_BATCHES`` the run draws from its training rows' lengths."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), run.seq_len)
    steps = max(1, min(run.planned_steps(len(lengths)), SAMPLED_BATCHES // run.grad_accum_steps + 1))
    micro = run.batch_size
    chunks = [chunk for batch in batch_order.run_order(run, len(lengths), steps, lengths)
              for chunk in np.split(batch, len(batch) // micro)][:SAMPLED_BATCHES]
    figures = np.array([_drawn_batch(run, [int(n) for n in lengths[chunk]]) for chunk in chunks], dtype=float)
    # a row count or row length that changes between batches (column 1: positions, 2: rows)
    shapes = [tuple(row) for row in figures[:, 1:3]]  # (positions, rows): the tensors' shape
    changes = sum(a != b for a, b in zip(shapes, shapes[1:])) / max(1, len(shapes) - 1)
    return BatchShape(*figures.mean(axis=0), changes=changes)


def _drawn_batch(run: RunSpec, lengths: list[int]) -> tuple[float, float, float, float, float]:
    real = sum(lengths)
    real_square = sum(n * n for n in lengths)
    if run.packed:
        rows, width = batch_order.packed_shape(lengths, run.seq_len if run.batching == "pack" else None)
        # padding_free keeps each sequence's attention to itself (variable-length kernels); pack masks a dense row
        square = real_square if run.batching == "padding_free" else rows * width**2
        return real, rows * width, rows, real_square, square
    longest = max(lengths)
    return real, len(lengths) * longest, len(lengths), real_square, len(lengths) * longest**2


def batch_shape(run: RunSpec, data_dir, row: int) -> BatchShape:
    """The run's mean micro-batch: from its prepared data's lengths where there are some, else full rows of
    ``row`` tokens (with a note unless the data is synthetic, whose rows are full)."""
    manifest = memory_plan.prepared_manifest(data_dir) if data_dir is not None else None
    if manifest and manifest.get("splits") and row == run.seq_len:
        return drawn_rows(run, memory_plan.train_lengths(str(data_dir)))
    shape = full_rows(run, row)
    if run.dataset_def.get("source", {}).get("kind") == "synthetic" or row != run.seq_len:
        return shape
    return BatchShape(**{**shape.__dict__, "changes": FULL_ROW_CHANGES[run.batching],
                         "note": "rows taken as full (data not prepared yet: an upper bound)"})


@dataclass(frozen=True)
class MatmulCounts:
    """A single-stack model's Linear weights as measure/flops.py counts them, from its config: every block's
    Linears (adapters included), the output head (a language model's over the vocabulary, seen by every token; a
    classifier's, seen once per sequence), input embeddings left out."""

    per_token: int  # weights every token position multiplies
    per_token_trainable: int
    head: int  # the output head's share of per_token (over the vocabulary; 0 for a classifier)
    pooled: int  # weights applied once per sequence (a classifier's head)
    pooled_trainable: int
    layers: int
    width: int
    adapted: tuple[tuple[int, int], ...]  # (fan_in, fan_out) of one block's adapted Linears
    quantised_linears: int  # 4-bit Linears of the whole model (QLoRA)
    quantised_weights: int  # of per_token, the weights of those 4-bit Linears (QLoRA's frozen base)
    block_linears: int  # Linears per block
    gated: bool


def matmul_counts(settings: dict, run: RunSpec, classifier: bool, num_labels: int) -> MatmulCounts:
    """The run's matmul weights from its model's config (``memory_plan.config_settings``)."""
    shape = model_shape.from_config(settings)
    linears = model_shape.block_linears(settings)
    layers, width = shape.attention_layers, shape.width
    adapted = () if run.method == "full" else tuple(
        (fan_in, fan_out) for name, fan_in, fan_out in linears if run.lora_targets == "all-linear" or name in run.lora_targets)
    adapters = sum(run.lora_rank * (fan_in + fan_out) for fan_in, fan_out in adapted)
    block = sum(fan_in * fan_out for _, fan_in, fan_out in linears) + adapters
    head = 0 if classifier else (shape.vocab_size or 0) * width
    classifier_head = num_labels * width if classifier else 0
    # BERT's pooler is a Linear over the first token, applied once per sequence (flops.py's pooled heads)
    pooler = width * width if classifier and settings.get("model_type") == "bert" else 0
    full = run.method == "full"
    return MatmulCounts(
        per_token=layers * block + head, per_token_trainable=layers * block + head if full else layers * adapters, head=head,
        pooled=classifier_head + pooler, pooled_trainable=classifier_head + (pooler if full else 0),
        layers=layers, width=width, adapted=adapted,
        quantised_linears=layers * len(linears) if run.method == "qlora" else 0,
        quantised_weights=layers * (block - adapters) if run.method == "qlora" else 0, block_linears=len(linears),
        gated=model_shape.gated(settings))


def per_token_flops(counts: MatmulCounts, full: bool) -> int:
    """Model FLOPs per token of the Linear layers (measure/flops.py: 6N, or 4N + 2N_trainable with adapters)."""
    return 6 * counts.per_token if full else 4 * counts.per_token + 2 * counts.per_token_trainable


def pooled_flops(counts: MatmulCounts, full: bool) -> int:
    """Model FLOPs per sequence of the heads applied once per sequence."""
    return 6 * counts.pooled if full else 4 * counts.pooled + 2 * counts.pooled_trainable


def model_flops(counts: MatmulCounts, full: bool, tokens: float, real_square: float, sequences: float) -> float:
    """Analytic model FLOPs of ``tokens`` real tokens in ``sequences`` sequences (measure/flops.py step_flops for a
    single stack): Linear layers per token, 12 x layers x width x length^2 per sequence for attention."""
    return (per_token_flops(counts, full) * tokens + 12 * counts.layers * counts.width * real_square
            + pooled_flops(counts, full) * sequences)


def workload(run: RunSpec, data_dir=None, measured: dict | None = None) -> tuple[Workload | None, str | None]:
    """(what one step of the run asks of one device, or None and why there is no prediction). ``measured``: the
    run's row of results/metrics.parquet, whose measured batches replace the ones drawn from the data
    (``measured_shape``): how a calibration sees the runs it is fitted to."""
    if memory_plan.needs_built_model(run):
        return None, "a model of two stacks: its step time is not predicted from the config"
    settings, why_not = memory_plan.config_settings(run)
    if settings is None:
        return None, why_not
    if model_shape.from_config(settings).decoder_layers:
        return None, "an encoder-decoder: its step time is not modelled (cross-attention, two stacks)"
    family = model_family(run.model_def)
    labels = len(run.dataset_def.get("labels") or ()) or 2
    counts = matmul_counts(settings, run, family.takes_num_labels, labels)
    if measured is not None:
        shape = measured_shape(run, counts, measured)
        if shape is None:
            return None, "no measured window (tokens, steps and FLOPs per step)"
    else:
        shape = batch_shape(run, data_dir, family.tokens_per_example(run))
    kept, why_not = kept_bytes(run, data_dir, shape)
    if kept is None:
        return None, why_not
    facts, _ = memory_plan.config_facts(run)
    return workload_of(run, counts, facts, shape, kept), None


def kept_bytes(run: RunSpec, data_dir, shape: BatchShape) -> tuple[float | None, str | None]:
    """Activations one micro-batch keeps (bytes), from the memory estimate of the run without checkpointing or
    compilation (what eager autograd keeps is what its elementwise kernels wrote), scaled from the estimate's
    micro-batch (its largest) to the mean one. The logits are not in it: the loss's traffic is counted apart
    (LOSS_BYTES)."""
    plain = run.replace(gradient_checkpointing=False, compile=False)
    figures = memory_plan.run_estimate(plain, data_dir)
    parts = figures.get("memory_estimate_parts_mb")
    if not parts:
        return None, f"no memory estimate, so no activation traffic: {figures.get('memory_estimate_note')}"
    estimated_positions = run.batch_size * model_family(run.model_def).tokens_per_example(run)
    if run.packed and memory_plan.prepared_manifest(data_dir):
        estimated_positions = batch_order.largest_packed_batch(plain, memory_plan.train_lengths(str(data_dir)))[0]
    scale = shape.positions / estimated_positions if estimated_positions else 1.0
    return parts.get("activations", 0) * MIB * scale, None


def measured_shape(run: RunSpec, counts: MatmulCounts, row: dict) -> BatchShape | None:
    """The mean micro-batch a measured run trained on, from its row: real tokens per step, positions from its
    padding fraction (or packing efficiency), the squared lengths from its analytic FLOPs per step (the attention
    term is what the Linear layers' FLOPs leave)."""
    steps, tokens, flops = (_number(row.get(key)) for key in ("measured_steps", "measured_tokens", "flops_per_step_analytic"))
    if not steps or not tokens or not flops:
        return None
    # measured_tokens counts the whole window, flops_per_step_analytic one step: both over every device and micro-batch
    micro_batches = (_number(row.get("world_size")) or run.devices) * run.grad_accum_steps
    tokens, flops = tokens / steps / micro_batches, flops / micro_batches
    packing, padding = _number(row.get("packing_efficiency")), _number(row.get("padding_fraction"))
    positions = tokens / packing if packing else tokens / (1 - padding) if padding and padding < 1 else tokens
    rows = max(1.0, positions / run.seq_len) if run.packed else float(run.batch_size)
    full = run.method == "full"
    attention = flops - per_token_flops(counts, full) * tokens - pooled_flops(counts, full) * run.batch_size
    real_square = max(tokens, attention / (12 * counts.layers * counts.width)) if counts.layers and counts.width else tokens
    computed = real_square if run.batching == "padding_free" else rows * (positions / rows) ** 2
    changes = _number(row.get("shape_change_share"))
    if changes is None:
        changes = 0.0 if row.get("data_kind") == "synthetic" else FULL_ROW_CHANGES[run.batching]
    return BatchShape(tokens, positions, rows, real_square, max(computed, real_square), changes)


def _number(value) -> float | None:
    """A figure of a table row as a float; None for a missing one (None, NaN, pandas' NA)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if number != number else number


def workload_of(run: RunSpec, counts: MatmulCounts, facts: memory_estimate.ModelFacts, shape: BatchShape,
                kept: float) -> Workload:
    """The workload from the model's counts and facts, the mean micro-batch and the bytes it keeps."""
    micro, devices, full = run.grad_accum_steps, run.devices, run.method == "full"
    recompute = 1 if run.gradient_checkpointing else 0
    linear = micro * (per_token_flops(counts, full) * shape.positions + pooled_flops(counts, full) * shape.rows
                      + recompute * 2 * counts.per_token * shape.positions)
    attention = micro * 12 * counts.layers * counts.width * shape.computed_square * (1 + recompute / 3)
    # the frozen 4-bit weights: forward and input-gradient matmuls (no weight gradient), and the recomputed forward
    quantised = micro * shape.positions * (4 + 2 * recompute) * counts.quantised_weights
    modelled = devices * micro * model_flops(counts, full, shape.tokens, shape.real_square, shape.rows)
    recipe = recipe_of(run)
    kernels = "compiled" if run.compile else ("liger" if run.kernels == "liger" else "eager")
    units, qlora_units, launched = step_ops(run, counts, shape.positions)
    logits = micro * shape.positions * counts.head / max(counts.width, 1)  # positions x vocabulary
    return Workload(
        tokens_per_step=devices * micro * shape.tokens, samples_per_step=run.examples_per_step,
        linear_flops=linear, attention_flops=attention, model_flops=modelled, width=counts.width,
        activation_bytes=micro * kept * (1 + recompute / 3),
        fixed_bytes=weight_traffic(run, counts, facts, recipe) + lora_traffic(run, counts, shape.positions),
        comm_bytes=comm_bytes(run, facts, recipe), host_ops=units, kernels=kernels, shape_changes=shape.changes,
        compute_dtype=recipe.compute_dtype, devices=devices, notes=tuple(filter(None, [shape.note, *setup_notes(run)])),
        loss_bytes=logits * LOSS_BYTES[(kernels, recipe.compute_dtype != "fp32")], kernel_ops=launched,
        qlora_host_ops=qlora_units, host_scales=host_scales(run), quantised_flops=quantised)


def host_scales(run: RunSpec) -> tuple[str, ...]:
    """The calibration's factors on the run's host work for what HOST_UNITS does not count: FSDP's per-block hooks,
    gathers and reshards; the Trainer's own per-step work."""
    return tuple(name for name, applies in (("fsdp_host_factor", run.parallel == "fsdp"),
                                            ("trainer_host_factor", run.engine == "hf_trainer")) if applies)


def setup_notes(run: RunSpec) -> list[str]:
    """What the prediction leaves out for this run's setup."""
    notes = []
    if run.num_nodes > 1:
        notes.append("between nodes the link is taken as the table's within a host")
    if run.parallel == "fsdp" and run.fsdp_cpu_offload:
        notes.append("CPU offload's host transfers and CPU optimizer are not modelled")
    if run.parallel == "fsdp":
        notes.append("FSDP's own host work per block (its hooks, gathers and reshards) is not counted: "
                     "fsdp_host_factor scales the counted work, and widens the interval until an fsdp run calibrates it")
    if run.engine == "hf_trainer":
        notes.append("engine hf_trainer counted as ftbench's loop: trainer_host_factor scales that for the Trainer's "
                     "own per-step work, and widens the interval until an hf_trainer run calibrates it")
    return notes


def weight_traffic(run: RunSpec, counts: MatmulCounts, facts: memory_estimate.ModelFacts, recipe) -> float:
    """Bytes per device and step moved for the weights outside the matmuls: the optimizer update, the gradients
    written per micro-batch, autocast's copies of fp32 weights per forward pass, QLoRA's dequantisation per use."""
    shards = run.devices if run.parallel == "fsdp" else 1
    micro, recompute = run.grad_accum_steps, int(run.gradient_checkpointing)
    trainable = facts.trainable / shards
    param, state = recipe.trainable_bytes, DTYPE_BYTES[recipe.optimizer_state_dtype]
    # the update reads the parameter and its gradient and writes the parameter; it reads and writes SGD's one
    # momentum, or AdamW's two moments
    update = trainable * (3 * param + (2 if run.optimizer == "sgd" else 4) * state)
    if run.precision == "fp16":
        update += trainable * 3 * param  # GradScaler: unscale (read, write) and the check for inf
    gradients = trainable * param * (2 * micro - 1)  # written once, then read and added to per micro-batch
    casts = 0.0
    if recipe.autocast_dtype is not None:
        cast = fp32_linear_weights(run, counts, recipe)
        casts = CAST_BYTES * cast / shards * micro * (1 + recompute)
    dequantised = facts.quantised * DEQUANT_BYTES * micro * (2 + recompute)
    return update + gradients + casts + dequantised


def fp32_linear_weights(run: RunSpec, counts: MatmulCounts, recipe) -> float:
    """Linear weights kept in fp32 that a 16-bit autocast pass copies: full fine-tuning's masters, the adapters,
    an fp32 frozen base, QLoRA's unquantised head."""
    if run.method == "full":
        return counts.per_token + counts.pooled
    fp32 = counts.per_token_trainable + counts.pooled_trainable
    if recipe.frozen_dtype == "fp32":
        fp32 += counts.per_token - counts.per_token_trainable
    elif recipe.frozen_dtype in ("nf4", "fp4"):
        fp32 += counts.head
    return fp32


def lora_traffic(run: RunSpec, counts: MatmulCounts, positions: float) -> float:
    """Bytes per device and step of the LoRA branches' elementwise work (LORA_BYTES_IN / _OUT)."""
    per_token = sum(LORA_BYTES_IN[run.lora_dropout > 0] * fan_in + LORA_BYTES_OUT * fan_out for fan_in, fan_out in counts.adapted)
    return run.grad_accum_steps * positions * counts.layers * per_token * (1 + int(run.gradient_checkpointing) / 3)


def comm_bytes(run: RunSpec, facts: memory_estimate.ModelFacts, recipe) -> float:
    """Bytes each device sends per step: DDP's gradient all-reduce (in its fp32 buckets, bf16 under bf16_true);
    FSDP2's all-gathers of the 16-bit weights (forward, and again in backward when it reshards) and reduce-scatter
    of the gradients, per micro-batch; DataParallel's copy of the weights to every GPU and the gradients back."""
    n, micro = run.devices, run.grad_accum_steps
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if run.parallel == "ddp":
        return 2 * share * facts.trainable * recipe.trainable_bytes
    if run.parallel == "fsdp":
        gathered = facts.other * DTYPE_BYTES[recipe.compute_dtype] + facts.quantised * 0.5
        reduce_bytes = DTYPE_BYTES[run.fsdp_reduce_dtype or recipe.compute_dtype]
        return micro * share * ((2 if run.fsdp_reshard_after_forward else 1) * gathered + facts.trainable * reduce_bytes)
    return micro * (n - 1) * (facts.total * recipe.frozen_bytes + facts.trainable * recipe.trainable_bytes)


def host_ops(run: RunSpec, counts: MatmulCounts) -> tuple[float, float, float]:
    """(units of host work, of them the 4-bit Linears' (``qlora_host_factor`` scales them), kernels) per micro-batch
    and process (HOST_UNITS): per block forward, backward and recomputation, with its adapted, 4-bit and
    autocast-cast Linears, and the head."""
    recipe = recipe_of(run)
    parts = [("block_gated" if counts.gated else "block_plain", 1, (1, 1, 1, 1, 1))]
    if counts.adapted:
        parts.append(("lora_linear" if run.lora_dropout > 0 else "lora_linear_no_dropout", len(counts.adapted), (1,) * 5))
    if recipe.autocast_dtype is not None and (run.method == "full" or recipe.frozen_dtype == "fp32"):
        # fp32 Linear weights under autocast: full fine-tuning's masters (their gradients cast back too), an fp32
        # frozen base (forward only)
        trained = int(run.method == "full")
        parts.append(("autocast_linear", counts.block_linears, (1, trained, 1, 1, trained)))
    quantised = run.method == "qlora"
    if quantised:
        parts.append(("qlora_linear", counts.block_linears, (1,) * 5))
    recompute = int(run.gradient_checkpointing)

    def per_block(names) -> tuple[float, float]:
        columns = [sum(HOST_UNITS[name][column] * number * used[column] for name, number, used in parts if name in names)
                   for column in range(5)]
        return columns[0] + columns[1] + recompute * columns[2], columns[3] * (1 + recompute) + columns[4]

    units, kernels = per_block({name for name, _, _ in parts})
    qlora_units = per_block({"qlora_linear"})[0] if quantised else 0.0
    head = HOST_UNITS["head"]
    return (counts.layers * (units - qlora_units) + head[0] + head[1], counts.layers * qlora_units,
            counts.layers * kernels + head[3] + head[4])


def step_ops(run: RunSpec, counts: MatmulCounts, positions: float) -> tuple[float, float, float]:
    """(units of host work, of them the 4-bit Linears', kernels) per optimizer step and process (DataParallel's one
    process drives every replica): host_ops per micro-batch, Liger's loss per chunk of ``positions``, the optimizer
    per trainable tensor and the step's own."""
    units, qlora_units, kernels = host_ops(run, counts)
    chunks = liger_chunks(run, counts, positions) if run.kernels == "liger" else 0
    units, kernels = units + LIGER_CHUNK[0] * chunks, kernels + LIGER_CHUNK[1] * chunks
    tensors = trainable_tensors(run, counts)
    optimizer = OPTIMIZER_OPS_PER_TENSOR[run.optimizer] * tensors + (0.2 * tensors + 10 if run.precision == "fp16" else 0)
    micro = (run.devices if run.parallel == "dp" else 1) * run.grad_accum_steps
    return micro * units + optimizer + STEP_OPS, micro * qlora_units, micro * kernels + optimizer


def liger_chunks(run: RunSpec, counts: MatmulCounts, positions: float) -> int:
    """The chunks Liger's fused linear cross-entropy splits a micro-batch's positions into (its chunk: the next
    power of two of positions / ceil(vocabulary / width), as measure/memory_estimate.py counts it)."""
    if not counts.head or not counts.width:
        return 0
    vocab = counts.head // counts.width
    positions = max(1, int(round(positions)))
    chunk = min(positions, 2 ** math.ceil(math.log2(max(1, math.ceil(positions / math.ceil(vocab / counts.width))))))
    return math.ceil(positions / chunk)


def trainable_tensors(run: RunSpec, counts: MatmulCounts) -> int:
    """Trainable parameter tensors: every block's weights, norms (and biases of a LayerNorm stack) and the model's
    ends in full fine-tuning; each adapter's A and B (and a classifier's head) with LoRA."""
    if run.method == "full":
        per_block = counts.block_linears + 2 if counts.gated else 2 * counts.block_linears + 4
        return counts.layers * per_block + 4
    return 2 * len(counts.adapted) * counts.layers + (2 if counts.pooled else 0)


COMBINES = ("smooth", "sum", "roofline")  # how the terms make a step (the module's docstring); smooth is the model


def step_terms(load: Workload, gpu: dict, params: dict, combine: str = "smooth") -> dict | None:
    """Seconds per optimizer step and its terms for one GPU of the table under ``params`` (a calibration's,
    calibration.Calibration.params_for); None where the table lacks the GPU's peak for the run's dtype or its
    bandwidth. ``combine``: smooth (the model), or for comparison sum (gpu + host) and roofline (the larger of
    compute and memory, plus host)."""
    peak, bandwidth = gpu.get("dense_tflops", {}).get(load.compute_dtype), gpu.get("memory_bandwidth_gbs")
    if peak is None or bandwidth is None:
        return None
    efficiency = params["compute_efficiency"]
    matmul = efficiency / (1 + params["width_half"] / max(load.width, 1))
    linear = load.linear_flops + (params["qlora_matmul_ratio"] - 1) * load.quantised_flops
    compute = (linear / (peak * 1e12 * matmul)
               + load.attention_flops / (peak * 1e12 * efficiency * params["attention_ratio"]))
    ratio = 1.0 if load.kernels == "eager" else params[f"{load.kernels}_traffic_ratio"]
    traffic = params["traffic_eager"] * ratio * load.activation_bytes + load.fixed_bytes + load.loss_bytes
    memory = traffic / (bandwidth * 1e9 * params["memory_efficiency"])
    link = gpu.get("interconnect_gbs")
    comm = params["comm_exposed"] * load.comm_bytes / (link * 1e9) if load.comm_bytes and link else 0.0
    dispatched = params["compiled_host_factor"] if load.kernels == "compiled" else 1.0
    units = (load.host_ops + params["qlora_host_factor"] * load.qlora_host_ops) * math.prod(
        params[name] for name in load.host_scales)
    host = params["host_step_s"] + params["host_op_s"] * units * dispatched * (
        1 + (params["shape_churn_factor"] - 1) * load.shape_changes)
    launches = params["gpu_op_s"] * load.kernel_ops * dispatched
    gpu_s = compute + memory + comm + launches
    if combine in ("sum", "roofline"):
        if combine == "roofline":
            gpu_s = max(compute, memory) + comm + launches
        step = gpu_s + host
        host_share = host / step
    else:
        power, longer = params["overlap_power"], max(gpu_s, host)  # scaled by the longer: no underflow at large p
        gpu_part, host_part = (gpu_s / longer) ** power, (host / longer) ** power
        step = longer * (gpu_part + host_part) ** (1 / power)
        host_share = host_part / (gpu_part + host_part)
    # host_share: d log(step) / d log(host), how much of the step's time moves with the host term (the rest moves
    # with the GPU's): what weighs the two kinds of residual spread in a prediction's interval (calibration.py)
    return {"step_s": step, "compute_s": compute, "memory_s": memory, "comm_s": comm, "launch_s": launches,
            "gpu_s": gpu_s, "host_s": host, "host_share": host_share,
            "busy_share": min(1.0, gpu_s / step), "tokens_per_s": load.tokens_per_step / step,
            "mfu": load.model_flops / step / (peak * 1e12 * load.devices)}
