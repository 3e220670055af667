"""Training memory estimated before the first step, stored beside the measured peak.

The model (bytes), so the ratio estimate / measured says where it is off. Every dtype is the run's recipe's
(ftbench/recipe.py):
- weights: 4 bytes per fp32 parameter (full fine-tuning's master weights, LoRA's adapters), 2 per 16-bit one (a
  LoRA run's frozen base under bf16/fp16, every weight under bf16_true); QLoRA: 4-bit base weights at 0.5 byte,
  plus their quantisation constants (one fp32 absmax per block of 64 = 0.0625 byte, or ~0.0159 byte with
  double quantisation), other parameters in fp32.
- weight copies: with bf16/fp16 autocast, the 16-bit copy of every fp32 weight, cast once per step and held for
  the backward pass (2 bytes per parameter); a 16-bit frozen base needs none (only the adapters are cast).
  4-bit weights are dequantised per use.
- gradients: one per trainable parameter, in its dtype (4 bytes, 2 under bf16_true).
- optimizer state per trainable parameter: AdamW 8 (two fp32 moments), 8-bit AdamW 2, SGD with
  momentum 4.
- activations that autograd keeps for the backward pass, per layer and token: a x width + m x
  intermediate bytes, with (a, m) from ACTIVATION_BYTES below. The coefficients were traced here with
  torch.autograd saved-tensor hooks on transformers' Llama and BERT layers (tests/test_measurement.py
  traces them again and holds the estimate to within 10%): the same shape as Korthikanti et al.
  (2022)'s 34 x width, with the MLP term made to follow the MLP's real width and kind. Eager attention
  adds the stored score matrix, 5 x heads x S bytes in 16-bit (fused attention, the default of current
  models, keeps none). Gradient checkpointing keeps only each layer's input (the residual stream, fp32
  under autocast: 4 x width bytes), and one layer's full activations while it is recomputed (recompute).
- adapters (LoRA, QLoRA), traced the same way with all-linear targets on the CPU and on an H100: frozen
  weights change what the layers keep (ADAPTER_WIDTH_BYTES: an RMSNorm with a frozen weight no longer
  keeps its fp32 normalised input, one per norm); each adapted Linear keeps its rank-wide LoRA-A output;
  with lora_dropout on a GPU, a 1-byte mask per element of each adapted Linear's input (a CPU keeps the
  mask in the input's dtype: the estimate is for CUDA). QLoRA: bitsandbytes' 4-bit layers return their
  input's dtype, fp32 after peft's k-bit preparation, so the MLP's elementwise work keeps fp32 copies
  (QLORA_MLP_BYTES).
- logits of a language model: 12 bytes per batch x S x vocab element at the start of the backward
  pass: the loss's fp32 log-softmax output (kept for backward), its gradient and the gradient of its
  input. Large for decoders with big vocabularies.
- precision bf16_true (the weights themselves in bf16, no autocast): 2 bytes per weight and per gradient,
  AdamW's moments in bf16 (4 bytes; SGD's momentum 2; the 8-bit optimizers as before), no 16-bit weight copies,
  DDP's buckets in bf16; activations as for 16-bit parameters under FSDP2 (the residual stream and RMSNorm
  outputs in bf16; checkpointing keeps each layer's bf16 input). Modelled for RMSNorm stacks (Llama-like
  decoders) only: LayerNorm models (encoders, ViT, CLIP, LLaVA's tower) were not traced in bf16 and get a note.
- the peak (peak_bytes): weights + optimizer state + the larger of the start of the backward pass
  (weight copies, activations, logits; no gradient yet) and its end (gradients; with checkpointing also
  the layer inputs and one recomputed layer). Seen on an H100 by reading the allocated memory after each
  phase of a step (Llama-134M shape, bf16, 8 x 1024): the peak came at the start of the backward pass,
  without gradients, and with checkpointing also without autocast's weight copies but the output head's
  (weight_copies_bytes).
- fsdp (FSDP2, per GPU): the fp32 weights, gradients and optimizer state are sharded, 1/world each (none
  on the GPU with fsdp_cpu_offload: they are host memory, memory_estimate_host_mb). In place of autocast's
  weight copies, the gathered (unsharded) parameters in the compute dtype: the root's (embeddings, head,
  kept gathered) plus two blocks (the one computing and the one prefetched), or every block with
  fsdp_reshard_after_forward off (all stay gathered from their forward to their backward). Gradients add
  two blocks' unsharded gradients in the reduce dtype, before their reduce-scatter.
  Its mixed precision casts the parameters themselves to 16 bits, so the residual stream and RMSNorm outputs
  are 16-bit and QLoRA's MLP is not fp32 (SIXTEEN_BIT_PARAMS_RMS_WIDTH_BYTES).
- gradient accumulation (grad_accum_steps > 1): every micro-batch after the first starts its backward pass
  with the gradients accumulated so far (all of them; under fsdp this GPU's shard): the "accumulated" part
  is added to the start of the backward pass.
- ddp (DistributedDataParallel, per GPU): the reducer keeps its own flat fp32 copy of every trainable
  parameter's gradient (its all-reduce buckets, "ddp_buckets"), allocated when the model is wrapped and alive
  for the whole run, so it sits beside the activations at the start of the backward pass. The second step
  rebuilds the buckets in the order gradients became ready and, seen on two H100s (Llama 1B shape, bf16,
  2 x 1024), holds a second copy through that whole step ("ddp_rebuild"): the run's peak, which counts every
  step, is the single-GPU peak plus two copies, the steady state plus one. With gradient accumulation the
  no_sync micro-batches' gradients ("accumulated") stand beside the buckets instead and the rebuild step adds
  nothing more (seen: single + two copies on every step). The trainer wraps with gradient_as_bucket_view, so
  the gradients are views into the buckets at the end of the backward pass (no third copy there); that does
  not shrink the buckets held at its start (zero_grad(set_to_none) drops the views every step).
- dp (DataParallel, one process): each GPU holds a replica's estimate (batch_size is per device). GPU 0 also
  gathers the replicas' outputs, but the trainer keeps only the loss, so the gathered logits are freed before
  the backward pass makes the peak (seen on two H100s, Llama-134M shape, 16 x 1024: GPU 0 at the single run's
  peak plus 21 MB).
- token positions: a padded batch holds batch x seq_len positions (its longest row, the peak's batch);
  pack holds the batch's real tokens in rows of seq_len, padding_free in one row. Which packed batch makes
  the peak is read from the data: the run's largest (data/batch_order.py's largest_packed_batch, over the
  batches its seeded order draws), what activations and logits are counted over. Before the data is
  prepared, packed rows are taken as full (an upper bound, said in the plan's note).
  Under sdpa every attention layer keeps the packed rows' block-diagonal mask as a 16-bit bias
  (PACKED_MASK_BIAS_BYTES): rows x row length^2 each, large for padding_free's one long row.
- kernels liger (traced on an H100 with saved-tensor hooks, Llama layers, bf16: 7,688 fewer bytes per
  layer-token at width 576 / MLP 1,536, where these terms give 7,680): fused RMSNorm keeps its input and
  not its fp32 normalised copy (8 x width per layer, two norms; none with adapters, whose frozen norms
  already keep only their input), SwiGLU recomputes the SiLU (one MLP-wide tensor in the compute dtype);
  fused linear cross-entropy builds no logits: it keeps the gradient of the final hidden states (fp32,
  4 x width per token), the output head's weight gradient (4 bytes per trainable head parameter, computed in
  the forward pass) and one chunk of logits (chunk x vocab fp32, chunk the next power of two of
  tokens / ceil(vocab / width)).
- qlora under fsdp (the 4-bit base kept in the compute dtype's storage and sharded 1/world): per GPU the
  packed 4-bit bytes / world, the quantisation constants whole on every GPU, the other parameters and the
  adapters' gradients and AdamW state / world; gathered, each unit's packed bytes as stored (4-bit stays
  4-bit) plus its other parameters in the compute dtype.
- workspace: the cuBLAS(Lt) workspaces the caching allocator holds from the first matmul on: 32 MiB (read
  from memory_allocated around one bf16 matmul on an H100 / H200, torch 2.11) for each thread that runs
  matmuls, the forward pass's and autograd's backward thread (two 32 MiB blocks in a CUDA memory snapshot). Seen on a tiny ViT (2.7M
  parameters, 64 x 65 tokens, H200): the forward pass added what the activation model says (183 MiB measured,
  188 estimated), the rest of the 0.70 ratio was constant memory of this kind (about 70 MiB); negligible
  beside a large model.
It ignores allocator fragmentation and the CUDA context: compare it with CUDA
max_memory_allocated (not reserved), and expect it to be low by a margin on small models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ftbench.measure import model_shape
from ftbench.recipe import recipe_of
from ftbench.runspec import RunSpec, compute_dtype

if TYPE_CHECKING:  # torch is not imported here: cluster/resources.py reads OPTIMIZER_BYTES at parse time
    import torch

MIB = 2**20
# Optimizer state bytes per trainable parameter (see the module docstring); the resource estimate uses it too.
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "sgd": 4}

# (bytes per layer-token per unit of width, per unit of MLP width), by (norm kind, MLP kind, 16-bit?).
# RMSNorm layers (Llama, Mistral, Qwen, T5) compute in fp32 and keep fp32 copies, hence their larger
# width term; a gated MLP (SwiGLU, GeGLU) keeps four intermediate-wide tensors, a plain one two.
# Traced: rms+gated (Llama) and layer+plain (BERT); the other two pair those norm and MLP terms.
ACTIVATION_BYTES = {
    ("rms", "gated", True): (34, 8),
    ("rms", "gated", False): (40, 16),
    ("rms", "plain", True): (34, 4),
    ("rms", "plain", False): (40, 8),
    ("layer", "gated", True): (24, 8),
    ("layer", "gated", False): (32, 16),
    ("layer", "plain", True): (24, 4),
    ("layer", "plain", False): (32, 8),
}
DROPOUT_MASK_BYTES = {True: 4, False: 8}  # per unit of width, when hidden dropout is on (training mode)
# CLIP's quick_gelu (x * sigmoid(1.702 x), unfused) keeps its sigmoid too: one more intermediate-wide tensor in
# the compute dtype than a fused GELU (traced on CLIP's towers: 20% more activations than BERT's MLP term).
# Under QLoRA the MLP computes in fp32 (QLORA_MLP_BYTES), and so does the sigmoid: 4 bytes (an H100, CLIP
# ViT-B/32's shape, QLoRA: the estimate had missed 2.1 bytes per MLP element of both towers, 0.896 of the peak).
QUICK_GELU_BYTES = {True: 2, False: 4}
# Adapters, per layer-token per unit of width, by (norm kind, 16-bit?), relative to the full fine-tuning
# row above. Llama: -8 for its two frozen RMSNorms, +2 for one more 16-bit copy under autocast; BERT
# (LayerNorm keeps what it keeps whether or not its weight trains): +2 and 0. With a 16-bit frozen base (LoRA's
# default under bf16/fp16) the layers' inputs are 16-bit already, so autocast makes no second 16-bit copy of
# them: traced with saved-tensor hooks on transformers' BERT (-1.8 per unit of width, rounded) and Llama (the
# same -6: its RMSNorm outputs were 16-bit copies under an fp32 base too) layers.
ADAPTER_WIDTH_BYTES = {("rms", True): -6, ("rms", False): -8, ("layer", True): 2, ("layer", False): 0}
ADAPTER_WIDTH_BYTES_16_BIT_BASE = {"rms": -6, "layer": -2}
# QLoRA under 16-bit autocast, per unit of MLP width: the MLP's intermediate-wide tensors kept in fp32 instead
# of 16 bits, 2 more bytes each: three in a gated MLP (gate and up outputs, activation), one in a plain one.
QLORA_MLP_BYTES = {"gated": 6, "plain": 2}
# FSDP2 in 16-bit mixed precision casts the parameters themselves to the compute dtype (MixedPrecisionPolicy), so
# the embeddings' output, the residual stream and an RMSNorm's output are 16-bit where autocast alone keeps
# fp32 (fp32 master weights). Traced (saved-tensor hooks, Llama layers, bf16 parameters under bf16 autocast):
# 10 bytes less per unit of width and layer-token for full fine-tuning; with adapters 8 less than autocast
# alone (their frozen norms keep less already), and QLoRA's MLP stays 16-bit (no QLORA_MLP_BYTES). H100, 2 GPUs:
# the FSDP2 estimates were 1.05-1.12 of the measured peak (full), 1.20-1.25 (QLoRA) without these terms.
# LayerNorm models keep their norms in fp32 under autocast either way: not traced, left as they are.
SIXTEEN_BIT_PARAMS_RMS_WIDTH_BYTES = {"full": -10, "adapters": -8}
# Packed batches under sdpa (the default attention): the block-diagonal mask packed position ids make is turned
# into an additive bias in the compute dtype by every attention layer, each keeping its own for the backward
# pass: 2 bytes (16-bit; 4 in fp32) x rows x row length^2 per layer. Seen on an H100 (134M Llama, padding_free,
# one row of ~3,200 tokens): 0.6 GB, what made the padding-free estimate 0.86-0.90 of the measured peak.
PACKED_MASK_BIAS_BYTES = {True: 2, False: 4}
LORA_DROPOUT_MASK_BYTES = 1  # per element of an adapted Linear's input: CUDA's fused dropout keeps a bool mask
GATE_NAMES = ("gate_proj", "gate_up_proj", "wi_0", "w1")
# The fp32 gradient copy DistributedDataParallel's reducer keeps (its all-reduce buckets), per trainable parameter.
DDP_BUCKET_BYTES = 4
# cuBLAS(Lt) workspaces held by the caching allocator: 32 MiB per thread that runs matmuls, the forward pass's and
# autograd's backward thread (a CUDA memory snapshot of a 1B Llama run on an H100 holds two 32 MiB blocks).
WORKSPACE_BYTES = 2 * 32 * 2**20
# The fraction either side of the estimate within which a measured peak is expected (the model's error band, as
# seen on an H100: 1B/8B full and FSDP runs 1.00-1.12 of the measured peak).
ERROR_BAND = 0.10


def architecture_traits(model: torch.nn.Module) -> tuple[str, str]:
    """(norm kind, MLP kind) read from the module tree: "rms" | "layer", "gated" | "plain"."""
    names = [name for name, _ in model.named_modules()]
    gated = any(name.rsplit(".", 1)[-1] in GATE_NAMES for name in names)
    rms = any("RMSNorm" in type(module).__name__ or type(module).__name__ == "T5LayerNorm" for module in model.modules())
    return ("rms" if rms else "layer"), ("gated" if gated else "plain")


def hidden_dropout(config) -> float:
    for key in ("hidden_dropout_prob", "resid_pdrop", "dropout_rate", "dropout", "hidden_dropout"):
        value = getattr(config, key, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


@dataclass(frozen=True)
class ModelFacts:
    """What the estimate needs of a model: read from the built module (``facts_of``) or, before anything is
    built, from its config alone (``facts_from_config``, torch-free: ``python -m ftbench plan``)."""

    quantised: int  # 4-bit weights, counted as the parameters they stand for
    other: int  # every other parameter
    trainable: int
    shape: model_shape.ConfigShape
    norm: str = "layer"  # "rms" | "layer"
    mlp: str = "plain"  # "gated" | "plain"
    dropout: float = 0.0  # hidden dropout
    quick_gelu: bool = False
    adapted_inputs: tuple[int, ...] = ()  # input widths of the Linears that carry a LoRA adapter
    # per repeated block (the fsdp units): (parameters cast to the compute dtype when gathered, 4-bit ones, trainable)
    blocks: tuple[tuple[int, int, int], ...] = ()
    head_trainable: int = 0  # trainable parameters of the output head over the vocabulary (liger's weight gradient)
    head: int = 0  # parameters of the output head's weight over the vocabulary, trainable or not (its autocast copy)

    @property
    def total(self) -> int:
        return self.quantised + self.other


def adapted_linears(model: torch.nn.Module) -> list[int]:
    """Input widths of the Linear layers that carry a LoRA adapter (peft's LoRA layers have lora_A)."""
    return [module.in_features for module in model.modules() if len(getattr(module, "lora_A", None) or ()) > 0]


def parameter_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(4-bit quantised, other, trainable) parameters; 4-bit weights counted as the parameters they stand for."""
    quantised = other = trainable = 0
    for param in model.parameters():
        quant_state = getattr(param, "quant_state", None)
        if quant_state is not None:
            quantised += int(math.prod(quant_state.shape))
        else:
            other += param.numel()
        if param.requires_grad:
            trainable += param.numel()
    return quantised, other, trainable


def facts_of(model: torch.nn.Module) -> ModelFacts:
    """The facts of a built model (LoRA and 4-bit layers as built)."""
    quantised, other, trainable = parameter_counts(model)
    config = getattr(model, "config", None)
    norm, mlp = architecture_traits(model)
    blocks = tuple(_block_counts(block) for block in repeated_blocks(model))
    head = getattr(model, "get_output_embeddings", lambda: None)()
    head_weight = getattr(head, "weight", None)
    return ModelFacts(quantised, other, trainable, model_shape.from_transformers_config(config), norm, mlp,
                      hidden_dropout(config), getattr(config, "hidden_act", None) == "quick_gelu",
                      tuple(adapted_linears(model)), blocks,
                      head_weight.numel() if head_weight is not None and head_weight.requires_grad else 0,
                      head_weight.numel() if head_weight is not None else 0)


def _block_counts(block: torch.nn.Module) -> tuple[int, int, int]:
    quantised, other, trainable = parameter_counts(block)
    return other, quantised, trainable


def facts_from_config(settings: dict, spec: RunSpec, classifier: bool, num_labels: int = 2) -> ModelFacts:
    """A model's facts from its config settings alone (``model_shape.with_defaults``), before anything is built:
    parameters by kind from the shape (model_shape's counts), adapters from the run's LoRA targets, 4-bit
    weights (QLoRA: every block Linear), trainable ones by method. ``classifier``: a head of ``num_labels``
    outputs (else a language model's head over the vocabulary, tied or not)."""
    shape = model_shape.from_config(settings)
    linears = model_shape.block_linears(settings)
    layers, width, vocab = shape.attention_layers, shape.width, shape.vocab_size or 0
    per_block = model_shape.block_parameters(settings)
    tied = settings.get("tie_word_embeddings", not model_shape.gated(settings))
    head = (num_labels * (width + 1)) if classifier else (0 if tied else vocab * width)
    total = layers * per_block + model_shape.embedding_parameters(settings) + head
    targets = [] if spec.method == "full" else \
        [(fan_in, fan_out) for name, fan_in, fan_out in linears if spec.lora_targets == "all-linear" or name in spec.lora_targets]
    adapters = sum(spec.lora_rank * (fan_in + fan_out) for fan_in, fan_out in targets)
    quantised = sum(fan_in * fan_out for _, fan_in, fan_out in linears) if spec.method == "qlora" else 0
    trainable_block = per_block if spec.method == "full" else adapters
    trainable = total if spec.method == "full" else layers * adapters + (head if classifier else 0)
    lm_head = 0 if classifier else vocab * width
    return ModelFacts(
        quantised=layers * quantised, other=total - layers * quantised + layers * adapters, trainable=trainable,
        shape=shape, norm="rms" if model_shape.gated(settings) else "layer",
        mlp="gated" if model_shape.gated(settings) else "plain",
        dropout=float(next((settings[key] for key in ("hidden_dropout_prob", "resid_pdrop", "dropout") if key in settings), 0.0)),
        quick_gelu=settings.get("hidden_act") == "quick_gelu",
        adapted_inputs=tuple(fan_in for _ in range(layers) for fan_in, _ in targets),
        blocks=((per_block - quantised + adapters, quantised, trainable_block),) * layers,
        head_trainable=lm_head if spec.method == "full" else 0, head=lm_head)


def vocab_of(model) -> int | None:
    """The vocabulary of a built model's config, or of a model's facts."""
    if isinstance(model, ModelFacts):
        return model.shape.vocab_size
    return getattr(getattr(model, "config", None), "vocab_size", None)


def estimate(model, spec: RunSpec, logits_vocab: int | None, packed_batch: tuple[int, int] | None = None) -> dict:
    """The estimate (MiB) and its parts; or, for a run the model does not describe, nulls and a note.
    ``model``: the built module or its ``ModelFacts``. ``logits_vocab``: the vocabulary a language model's
    logits run over (None: a head without such logits, a classifier's). ``packed_batch``: (token positions,
    row width) of a packed run's largest micro-batch (data/batch_order.py); None: rows are full."""
    if spec.compile:
        return no_estimate(NOT_MODELLED_COMPILED)
    facts = model if isinstance(model, ModelFacts) else facts_of(model)
    if spec.precision == "bf16_true" and facts.norm != "rms":
        return no_estimate(NOT_MODELLED_BF16_TRUE)
    parts = estimate_parts(facts, spec, logits_vocab, packed_batch)
    host = None
    if spec.parallel == "fsdp":
        parts, host = sharded(parts, facts, spec)
    return figures(parts, host if spec.parallel == "fsdp" and spec.fsdp_cpu_offload else None)


def figures(parts: dict, host_bytes: float | None = None) -> dict:
    """The estimate's columns from its parts (bytes): the peak and the parts in MiB, and the host memory where
    the run keeps state there (FSDP's CPU offload)."""
    return {"memory_estimate_mb": peak_bytes(parts) / MIB,
            "memory_estimate_parts_mb": {name: value / MIB for name, value in parts.items()},
            "memory_estimate_note": None, "memory_estimate_host_mb": None if host_bytes is None else host_bytes / MIB}


def no_estimate(note: str) -> dict:
    """The estimate's columns for a run the model does not describe: nulls, and ``note`` saying why."""
    return {"memory_estimate_mb": None, "memory_estimate_parts_mb": None, "memory_estimate_note": note,
            "memory_estimate_host_mb": None}


def computes_in_16_bit(spec: RunSpec) -> bool:
    """Whether the run computes in 16 bits (autocast over fp32 master weights, or bf16 weights: bf16_true)."""
    return compute_dtype(spec.precision) != "fp32"


def weight_bytes(spec: RunSpec) -> float:
    """Bytes of one trainable weight, and of one gradient: fp32 masters and adapters, or bf16 themselves (bf16_true)."""
    return recipe_of(spec).trainable_bytes


def frozen_weight_bytes(spec: RunSpec) -> float:
    """Bytes of one frozen, unquantised weight: a LoRA base's dtype (16-bit by default under bf16/fp16), fp32 for
    what QLoRA leaves unquantised."""
    return recipe_of(spec).frozen_bytes


def residual_bytes(facts: ModelFacts, spec: RunSpec) -> float:
    """Bytes per element of the residual stream, each layer's input (what checkpointing keeps): 16-bit when the
    embeddings' weights are (bf16_true, a 16-bit LoRA base) and no LayerNorm (fp32 under autocast) makes it fp32."""
    recipe = recipe_of(spec)
    sixteen = spec.precision == "bf16_true" or (recipe.sixteen_bit_base and facts.norm == "rms")
    return 2 if sixteen else 4


def optimizer_bytes(spec: RunSpec) -> float:
    """Optimizer state per trainable parameter: AdamW's moments and SGD's momentum take the parameter's dtype
    (half under bf16_true); the 8-bit optimizers keep theirs in 8 bits either way."""
    full = OPTIMIZER_BYTES[spec.optimizer]
    return full / 2 if spec.precision == "bf16_true" and spec.optimizer in ("adamw", "sgd") else full


def estimate_parts(facts: ModelFacts, spec: RunSpec, logits_vocab: int | None,
                   packed_batch: tuple[int, int] | None = None) -> dict:
    """Every part in bytes, for one GPU before any sharding (see the module's docstring)."""
    sixteen = computes_in_16_bit(spec)
    constants = 0.0159 if spec.qlora_double_quant else 0.0625
    positions, row = batch_positions(spec, packed_batch)
    parts = {
        "weights": facts.quantised * (0.5 + constants) + facts.trainable * weight_bytes(spec)
        + (facts.other - facts.trainable) * frozen_weight_bytes(spec),
        "weight_copies": weight_copies_bytes(facts, spec, sixteen),
        "gradients": facts.trainable * weight_bytes(spec),
        "optimizer": facts.trainable * optimizer_bytes(spec),
        **activation_parts(facts, spec, sixteen, positions, row),
        "logits": logits_bytes(facts, spec, logits_vocab, positions),
    }
    parts["accumulated"] = parts["gradients"] if spec.grad_accum_steps > 1 else 0
    parts["workspace"] = WORKSPACE_BYTES
    if spec.parallel == "ddp":
        parts["ddp_buckets"] = DDP_BUCKET_BYTES * facts.trainable * weight_bytes(spec) / 4  # in the gradients' dtype
        parts["ddp_rebuild"] = parts["ddp_buckets"] if spec.grad_accum_steps == 1 else 0
    return parts


def weight_copies_bytes(facts: ModelFacts, spec: RunSpec, sixteen_bit: bool) -> float:
    """Autocast's 16-bit copies of the weights, saved for the backward pass. Checkpointing: the copies made
    inside checkpointed layers are not saved (they go with autocast's cache when the forward pass ends, and the
    recompute casts one layer's at a time), but the output head runs outside them and its matmul keeps its
    16-bit weight for the gradient of its input: 2 bytes per head parameter, trainable or not (seen in a CUDA
    memory snapshot of the 1B Llama shape's LoRA and QLoRA runs with checkpointing on an H100: the 501 MB those
    rows missed). Liger's fused cross-entropy computes the head's gradients in the forward pass and keeps no
    copy: its cast goes with autocast's cache, with or without checkpointing. bf16_true: no autocast, no copies.
    A 16-bit frozen base (LoRA under bf16/fp16): only the fp32 trainable weights (adapters, a new head) are cast."""
    if not sixteen_bit or spec.precision == "bf16_true":
        return 0
    if recipe_of(spec).sixteen_bit_base:
        return 0 if spec.gradient_checkpointing else 2 * facts.trainable
    head_copy = 0 if spec.kernels == "liger" else 2 * facts.head
    if spec.gradient_checkpointing:
        return head_copy
    return 2 * (facts.other - facts.head) + head_copy


def batch_positions(spec: RunSpec, packed_batch: tuple[int, int] | None) -> tuple[int, int]:
    """(token positions of one micro-batch on one GPU, the length of its rows). Padded batches: batch x seq_len
    (the longest batch, the one that makes the peak); packed ones: ``packed_batch``, the run's largest, when
    the data says which it is, else full rows (batch x seq_len; padding_free: one row of them)."""
    batch, seq = spec.batch_size, spec.seq_len
    if not spec.packed:
        return batch * seq, seq
    if packed_batch:
        return packed_batch
    return (batch * seq, seq) if spec.batching == "pack" else (batch * seq, batch * seq)


def logits_bytes(facts: ModelFacts, spec: RunSpec, vocab: int | None, positions: int) -> float:
    """The loss's buffers over the vocabulary at the start of the backward pass: 12 bytes per logit (the
    fp32 log-softmax output, its gradient and its input's); with Liger's fused linear cross-entropy, no
    logits: the hidden states' gradient, the head's weight gradient and one chunk of logits."""
    if not vocab:
        return 0
    if spec.kernels != "liger":
        return 12 * positions * vocab
    width = facts.shape.width or 1
    chunk = min(positions, 2 ** math.ceil(math.log2(max(1, math.ceil(positions / math.ceil(vocab / width))))))
    gradient = weight_bytes(spec)  # the hidden states' and the head's gradients, in the weights' dtype
    return gradient * positions * width + gradient * facts.head_trainable + 4 * chunk * vocab


def activation_parts(facts: ModelFacts, spec: RunSpec, sixteen_bit: bool, positions: int, row: int) -> dict:
    """The activations autograd keeps, and with checkpointing the one layer recomputed (bytes), over the
    micro-batch's ``positions`` in rows of ``row`` tokens."""
    shape = facts.shape
    layers, width, inter = shape.attention_layers, shape.width, shape.intermediate
    per_width, per_intermediate = ACTIVATION_BYTES[(facts.norm, facts.mlp, sixteen_bit)]
    if facts.dropout > 0:
        per_width += DROPOUT_MASK_BYTES[sixteen_bit]
    if facts.quick_gelu:
        per_intermediate += QUICK_GELU_BYTES[sixteen_bit and not fp32_qlora_mlp(facts, spec, sixteen_bit)]
    per_layer_token = per_width * width + per_intermediate * inter
    if spec.method in ("lora", "qlora"):
        per_layer_token += adapter_bytes_per_layer_token(facts, spec, inter, width, layers, sixteen_bit)
    if spec.kernels == "liger":
        per_layer_token -= liger_saved_per_layer_token(facts, spec, sixteen_bit)
    if spec.attn_implementation == "eager":
        per_layer_token += 5 * shape.heads * row * (1 if sixteen_bit else 2)
    elif spec.packed and spec.attn_implementation in (None, "sdpa"):
        per_layer_token += PACKED_MASK_BIAS_BYTES[sixteen_bit] * row  # the mask bias, row x row per row
    if sixteen_bit_parameters(facts, spec, sixteen_bit):
        per_layer_token += SIXTEEN_BIT_PARAMS_RMS_WIDTH_BYTES["full" if spec.method == "full" else "adapters"] * width
    if spec.gradient_checkpointing:
        # each layer's input (fp32 under autocast, bf16 under bf16_true); one layer's activations, while the
        # backward pass recomputes it
        return {"activations": positions * layers * residual_bytes(facts, spec) * width, "recompute": positions * per_layer_token}
    return {"activations": positions * layers * per_layer_token, "recompute": 0}


def adapter_bytes_per_layer_token(facts: ModelFacts, spec: RunSpec, inter: int, width: int, layers: int,
                                  sixteen_bit: bool) -> float:
    """What adapters change in the activations kept per layer and token (see the module's docstring)."""
    inputs = facts.adapted_inputs
    per_element = 2 if sixteen_bit else 4
    added = len(inputs) * spec.lora_rank * per_element  # LoRA-A outputs, kept for LoRA-B's gradient
    if spec.lora_dropout:
        added += sum(inputs) * LORA_DROPOUT_MASK_BYTES
    width_bytes = ADAPTER_WIDTH_BYTES_16_BIT_BASE[facts.norm] if recipe_of(spec).sixteen_bit_base and \
        spec.parallel != "fsdp" else ADAPTER_WIDTH_BYTES[(facts.norm, sixteen_bit)]
    per_layer = added / max(layers, 1) + width_bytes * width
    if fp32_qlora_mlp(facts, spec, sixteen_bit):
        per_layer += QLORA_MLP_BYTES[facts.mlp] * inter
    return per_layer


def fp32_qlora_mlp(facts: ModelFacts, spec: RunSpec, sixteen_bit: bool) -> bool:
    """Whether a 16-bit run's MLP computes in fp32: QLoRA's 4-bit layers return their fp32 input's dtype (not
    under FSDP2's 16-bit parameters)."""
    return spec.method == "qlora" and sixteen_bit and not sixteen_bit_parameters(facts, spec, sixteen_bit)


def sixteen_bit_parameters(facts: ModelFacts, spec: RunSpec, sixteen_bit: bool) -> bool:
    """Whether the layers compute with 16-bit parameters (FSDP2's mixed precision casts them; bf16_true) where the traced
    coefficients assume fp32 masters under autocast; RMSNorm models only (see SIXTEEN_BIT_PARAMS_RMS_WIDTH_BYTES)."""
    return (spec.parallel == "fsdp" or spec.precision == "bf16_true") and sixteen_bit and facts.norm == "rms"


def liger_saved_per_layer_token(facts: ModelFacts, spec: RunSpec, sixteen_bit: bool) -> float:
    """What Liger's fused RMSNorm and SwiGLU keep less, per layer and token (see the module's docstring)."""
    saved = 0.0
    if facts.norm == "rms" and spec.method == "full":
        saved += 8 * facts.shape.width  # two norms' fp32 normalised copies
    if facts.mlp == "gated":
        saved += (2 if sixteen_bit else 4) * facts.shape.intermediate  # the SiLU output, recomputed
    return saved


# Why a run gets no estimate (memory_estimate_mb null, this in memory_estimate_note), rather than a wrong one.
NOT_MODELLED_BF16_TRUE = ("not modelled: precision bf16_true is modelled for RMSNorm stacks (Llama-like decoders); "
                          "this model's LayerNorm layers were not traced with bf16 weights")
NOT_MODELLED_COMPILED = ("not modelled for compiled runs: torch.compile fuses elementwise work and keeps fewer "
                         "activations than eager autograd (seen: estimate 1.59x the measured peak)")


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (decoder/encoder layers): the entries of its ModuleLists whose class the
    model names in ``_no_split_modules`` (transformers' list of blocks that must stay whole), or, for a model
    that names none, every entry of a ModuleList of two or more modules of one class. Blocks inside
    ModuleLists only: embeddings (also named there) may share their weight with the output head, which
    must then stay in the same unit. (FSDP wraps these blocks: train/fsdp.py uses it.)"""
    import torch  # deferred: cluster/resources.py imports this module at parse time, torch-free

    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            for entry in module:
                kind = type(entry).__name__
                if kind in names or (not names and all(type(other) is type(entry) for other in module)):
                    blocks.append(entry)
    return blocks


def sharded(parts: dict, facts: ModelFacts, spec: RunSpec) -> tuple[dict, float]:
    """One GPU's parts under FSDP2 (see the module's docstring), and the host bytes that offload holds."""
    world = spec.devices
    compute_bytes = 4 if spec.precision == "fp32" else 2
    reduce_bytes = 4 if (spec.fsdp_reduce_dtype or spec.precision) == "fp32" else 2
    blocks = facts.blocks or ((facts.other, facts.quantised, facts.trainable),)

    def gathered(other: int, quantised: int) -> float:  # a unit's parameters as all-gathered: 4-bit stays packed
        return other * compute_bytes + quantised * 0.5

    in_blocks = (sum(b[0] for b in blocks), sum(b[1] for b in blocks))
    root = gathered(facts.other - in_blocks[0], facts.quantised - in_blocks[1])
    largest = max(gathered(b[0], b[1]) for b in blocks)
    gathered_bytes = root + (2 * largest if spec.fsdp_reshard_after_forward else sum(gathered(b[0], b[1]) for b in blocks))
    constants = 0.0159 if spec.qlora_double_quant else 0.0625
    # 4-bit packed bytes and other parameters sharded; the quantisation constants stay whole on every GPU.
    unquantised = facts.trainable * weight_bytes(spec) + (facts.other - facts.trainable) * frozen_weight_bytes(spec)
    states = {"weights": (facts.quantised * 0.5 + unquantised) / world,
              "gradients": parts["gradients"] / world, "optimizer": parts["optimizer"] / world}
    host = sum(states.values())
    if spec.fsdp_cpu_offload:
        states = dict.fromkeys(states, 0.0)
    states["weights"] += facts.quantised * constants
    in_flight = 2 * max(b[2] for b in blocks) * reduce_bytes  # unsharded gradients awaiting their reduce-scatter
    accumulated = states["gradients"] if spec.grad_accum_steps > 1 else 0
    return {**parts, **states, "gradients": states["gradients"] + in_flight, "accumulated": accumulated,
            "weight_copies": min(gathered_bytes, gathered(facts.other, facts.quantised))}, host


def peak_bytes(parts: dict) -> float:
    """The parts do not all coexist. The backward pass starts with every kept activation and the logits'
    buffers, no gradient yet (but those accumulated over earlier micro-batches, and DDP's buckets); gradients
    then grow as activations are freed (with checkpointing, beside the layer inputs and one recomputed layer).
    The peak is the larger of the two moments."""
    checkpointed = parts["recompute"] > 0  # only checkpointing recomputes; its layer inputs outlast the gradients
    held = parts.get("ddp_buckets", 0) + parts.get("ddp_rebuild", 0)
    backward_start = parts["weight_copies"] + parts["activations"] + parts["logits"] + parts.get("accumulated", 0) + held
    # gradient_as_bucket_view: at the end the gradients are the buckets (one copy), and the rebuild's second copy
    backward_end = max(parts["gradients"], parts.get("ddp_buckets", 0)) + parts.get("ddp_rebuild", 0) + \
        (parts["activations"] + parts["recompute"] if checkpointed else 0)
    return parts["weights"] + parts["optimizer"] + parts.get("workspace", 0) + max(backward_start, backward_end)


def fit(estimate_mb: float, capacity_mb: float, band: float = ERROR_BAND) -> str:
    """Whether an estimate fits a GPU of ``capacity_mb``: "yes" when even band more fits, "no" when even band
    less does not, else "borderline"."""
    if estimate_mb * (1 + band) <= capacity_mb:
        return "yes"
    if estimate_mb * (1 - band) > capacity_mb:
        return "no"
    return "borderline"


def largest_fitting_batch(estimate_at, capacity_mb: float, band: float = ERROR_BAND, cap: int = 4096) -> int:
    """The largest per-GPU batch whose estimate, plus the error band, fits ``capacity_mb`` (0: not even 1);
    ``estimate_at(batch)`` gives the estimate in MiB. The estimate grows with the batch: bisection."""
    if estimate_at(1) * (1 + band) > capacity_mb:
        return 0
    low, high = 1, 2
    while high <= cap and estimate_at(high) * (1 + band) <= capacity_mb:
        low, high = high, high * 2
    high = min(high, cap + 1)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if estimate_at(middle) * (1 + band) <= capacity_mb else (low, middle)
    return low
