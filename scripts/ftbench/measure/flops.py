"""FLOPs of a training step, achieved TFLOP/s and MFU. The conventions, stated once:

- Model FLOPs, not hardware FLOPs: activation recomputation (gradient checkpointing) is not counted, so
  MFU compares configurations by useful work.
- Matmul parameters N: the weights of every Linear layer (LM head included, input embeddings excluded:
  an embedding lookup is not a matmul). LoRA adapters are Linear layers too.
- Per real token: full fine-tuning 6N (forward 2N, backward 4N). With adapters the frozen base weights
  get no weight gradient: 4N + 2N_trainable (forward 2N, input gradients 2N, weight gradients 2N_trainable).
- An encoder classifier's pooler and classifier (BERT, RoBERTa, DistilBERT, ViT) see one pooled token per
  sequence or image: counted once per sequence, not per token (per token they had made MiniLM's FLOPs 1.4% too
  many). Which modules those are, the task family says (``pooled_heads``). peft's untouched original of a head it
  trains as a copy (modules_to_save) never runs: not counted.
- Not modelled: autograd computes no input gradient for a frozen layer that nothing trainable precedes (under
  LoRA, the first layer's unadapted projections), so adapter runs count slightly fewer FLOPs than this
  (flops_counted_ratio on a CPU: MiniLM, 6 layers, LoRA on query and value, 0.980; Llama 134M, 30 layers, LoRA
  on all linear layers, 0.9985 on an H100).
- Attention scores and values add 12 * layers * width * S per token of a sequence of S tokens
  (forward 4 * layers * width * S, backward twice that), summed over each sequence's real length; the
  causal mask is not halved (as in the PaLM paper's MFU).
- Vision-language (LLaVA): the vision tower's Linear layers and attention over its own tokens per image
  (patches and class token), the projector's over the image tokens the decoder receives, the decoder's
  over all its tokens (text and image). A vision tower with no trainable weight runs forward only (2N,
  4 x layers x width x S): nothing before it needs a gradient. The patch-embedding convolution is not
  counted (as for image classification).
- Dual encoders (CLIP, SigLIP: a ``vision_model`` and a ``text_model``): each tower's Linear layers and
  attention over its own tokens (image tokens through the vision tower at its width and depth, caption
  tokens through the text tower), and the heads applied once per image or caption (CLIP's projections,
  SigLIP's pooling heads) once per pair. SigLIP's pooling attention is a MultiheadAttention whose
  key/value projections over the patches (about 1.5% of its vision tower) are not counted.
- MFU = achieved FLOP/s / (dense peak per device x devices), the peak for the run's dtype from a peak
  table the caller loads (``load_peaks``; the shipped one is config/gpus.yaml). Unknown device: MFU is
  None and a warning says so, never a guessed peak.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ftbench.measure import model_shape


@dataclass(frozen=True)
class ModelShape:
    """Matmul parameters and attention shape. For encoder-decoders the encoder part is kept apart: encoder
    weights see the input tokens, decoder weights (LM head included) see the target tokens."""

    linear_params: int  # weights of all Linear layers (what the 2N per token multiplies)
    trainable_linear_params: int
    layers: int  # attention layers a token passes through (decoder layers for seq2seq)
    width: int  # hidden size
    encoder_linear_params: int = 0  # seq2seq only: the encoder's share of linear_params
    encoder_trainable_linear_params: int = 0
    encoder_layers: int = 0
    vision_linear_params: int = 0  # vision-language only: the vision tower's share of linear_params
    vision_trainable_linear_params: int = 0
    projector_linear_params: int = 0  # and the projector's
    projector_trainable_linear_params: int = 0
    vision_layers: int = 0
    vision_width: int = 0
    # Dual encoders only: the vision tower's shape (it sees the image tokens; the fields above are then the
    # text tower's).
    vision: "ModelShape | None" = None
    # Heads applied to one pooled token per sequence, not to every token: a dual encoder's projections (once per
    # image and per caption), an encoder classifier's pooler and classifier (part of linear_params).
    pooled_linear_params: int = 0
    pooled_trainable_linear_params: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module, pooled_heads: tuple[str, ...] = ()) -> "ModelShape":
        """``pooled_heads``: names of the modules applied once per sequence (the task family's)."""
        config = getattr(model, "config", None)
        if getattr(model, "vision_model", None) is not None and getattr(model, "text_model", None) is not None:
            return _dual_encoder_shape(model, config)
        split_encoder = bool(getattr(config, "is_encoder_decoder", False))
        counts = {part: 0 for part in ("linear", "encoder", "vision", "projector", "pooled")}
        trainable = dict(counts)
        for name, count, is_trainable in _linear_layers(model):
            dotted = f".{name}."
            parts = ["linear"] + (["encoder"] if split_encoder and ".encoder." in dotted else []) + \
                (["vision"] if ".vision_tower." in dotted else []) + (["projector"] if ".multi_modal_projector." in dotted else []) + \
                (["pooled"] if any(f".{head}." in dotted for head in pooled_heads) else [])
            for part in parts:
                counts[part] += count
                trainable[part] += count if is_trainable else 0
        shape = model_shape.from_transformers_config(config)
        vision = model_shape.from_config(getattr(config, "vision_config", None) and config.vision_config.to_dict())
        return cls(counts["linear"], trainable["linear"], shape.attention_layers - shape.encoder_layers, shape.width,
                   counts["encoder"], trainable["encoder"], shape.encoder_layers, counts["vision"], trainable["vision"],
                   counts["projector"], trainable["projector"], vision.layers if counts["vision"] else 0,
                   vision.width if counts["vision"] else 0, pooled_linear_params=counts["pooled"],
                   pooled_trainable_linear_params=trainable["pooled"])


def _linear_layers(model: torch.nn.Module):
    """(name, weights, trainable) of every Linear layer (and GPT-2's Conv1D) that the forward pass runs; 4-bit
    weights counted as the values they stand for. peft keeps the original of a layer it trains in full
    (modules_to_save: a classifier head under LoRA) beside the trained copy, and runs only the copy."""
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or not (isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        if ".original_module" in f".{name}":
            continue
        quant_state = getattr(weight, "quant_state", None)
        yield name, int(torch.Size(quant_state.shape).numel()) if quant_state is not None else weight.numel(), weight.requires_grad


# A dual encoder's layers applied to one pooled token per image or caption.
DUAL_ENCODER_HEADS = ("visual_projection", "text_projection", "vision_model.head", "text_model.head")


def _dual_encoder_shape(model: torch.nn.Module, config) -> ModelShape:
    counts = {part: [0, 0] for part in ("vision", "text", "pooled")}
    for name, count, trainable in _linear_layers(model):
        dotted = f".{name}."
        part = "pooled" if any(f".{head}." in dotted for head in DUAL_ENCODER_HEADS) else \
            "vision" if ".vision_model." in dotted else "text"
        counts[part][0] += count
        counts[part][1] += count if trainable else 0
    vision = model_shape.from_transformers_config(config.vision_config)
    text = model_shape.from_transformers_config(config.text_config)
    return ModelShape(*counts["text"], text.layers, text.width,
                      vision=ModelShape(*counts["vision"], vision.layers, vision.width),
                      pooled_linear_params=counts["pooled"][0], pooled_trainable_linear_params=counts["pooled"][1])


def _linear_flops_per_token(params: int, trainable: int, full_finetune: bool) -> int:
    return 6 * params if full_finetune else 4 * params + 2 * trainable


def batch_flops(shape: ModelShape, full_finetune: bool, batch) -> int:
    """step_flops of a tasks.base.Batch's real tokens."""
    return step_flops(shape, full_finetune, batch.real_tokens, batch.sum_squared_lengths, batch.target_tokens,
                      batch.target_sum_squared_lengths, batch.image_tokens, batch.vision_tokens,
                      batch.vision_sum_squared_lengths, batch.images, batch.samples)


def step_flops(shape: ModelShape, full_finetune: bool, tokens: int, sum_squared_lengths: int,
               target_tokens: int = 0, target_sum_squared_lengths: int = 0, image_tokens: int = 0,
               vision_tokens: int = 0, vision_sum_squared_lengths: int = 0, images: int = 0, sequences: int = 0) -> int:
    """Analytic model FLOPs of ``sequences`` sequences with ``tokens`` real tokens in all (targets and image
    tokens included) and the given sums of squared lengths (attention grows with the square of each sequence's
    length). ``image_tokens`` is the part of ``tokens`` that are image tokens. A dual encoder routes them
    (``images`` images, all of the same tokens) through its vision tower; a vision-language model adds its
    vision tower over ``vision_tokens`` and its projector over the ``image_tokens``; other models count
    every token alike, but for an encoder classifier's pooled heads, once per sequence.

    Cross-attention of encoder-decoders is not counted (small next to the linear layers at the lengths
    benchmarked; flops_counted_ratio shows the gap)."""
    if shape.vision is not None:
        per_image = image_tokens // images if images else 0
        text = ModelShape(shape.linear_params, shape.trainable_linear_params, shape.layers, shape.width)
        return (step_flops(shape.vision, full_finetune, image_tokens, image_tokens * per_image)
                + step_flops(text, full_finetune, tokens - image_tokens, sum_squared_lengths - image_tokens * per_image)
                + _linear_flops_per_token(shape.pooled_linear_params, shape.pooled_trainable_linear_params, full_finetune) * images)
    vision = 0
    if shape.vision_linear_params:
        if shape.vision_trainable_linear_params == 0:  # a frozen tower (LoRA) gets no backward pass at all
            per_token, attention_factor = 2 * shape.vision_linear_params, 4
        else:
            per_token = _linear_flops_per_token(shape.vision_linear_params, shape.vision_trainable_linear_params, full_finetune)
            attention_factor = 12
        projector = _linear_flops_per_token(shape.projector_linear_params, shape.projector_trainable_linear_params, full_finetune)
        vision = (per_token * vision_tokens + projector * image_tokens
                  + attention_factor * shape.vision_layers * shape.vision_width * vision_sum_squared_lengths)
    decoder_params = (shape.linear_params - shape.encoder_linear_params - shape.vision_linear_params
                      - shape.projector_linear_params - shape.pooled_linear_params)
    decoder_trainable = (shape.trainable_linear_params - shape.encoder_trainable_linear_params
                         - shape.vision_trainable_linear_params - shape.projector_trainable_linear_params
                         - shape.pooled_trainable_linear_params)
    if shape.pooled_linear_params and not sequences:
        raise ValueError("step_flops: this model has heads applied once per sequence; pass sequences")
    pooled = _linear_flops_per_token(shape.pooled_linear_params, shape.pooled_trainable_linear_params, full_finetune) * sequences
    if shape.encoder_linear_params:
        input_tokens = tokens - target_tokens
        linear = (_linear_flops_per_token(shape.encoder_linear_params, shape.encoder_trainable_linear_params, full_finetune) * input_tokens
                  + _linear_flops_per_token(decoder_params, decoder_trainable, full_finetune) * target_tokens)
        attention = 12 * shape.width * (shape.encoder_layers * sum_squared_lengths + shape.layers * target_sum_squared_lengths)
        return linear + attention + pooled
    attention = 12 * shape.layers * shape.width * sum_squared_lengths
    return _linear_flops_per_token(decoder_params, decoder_trainable, full_finetune) * tokens + attention + vision + pooled


def _attention_forward_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """QK^T and PV of a fused attention kernel: 2 matmuls over every query head. Grouped-query attention
    (fewer key/value heads) shares each key/value head between query heads; the work is per query head."""
    b, heads, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * heads * s_q * s_k * (d + d_v)


def _attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """Backward of a fused attention kernel: the gradients of P, V, Q and K, twice the forward. Model FLOPs:
    the kernel's recomputation of the scores is not counted (torch's own formula counts it), so a fused
    kernel counts what the eager path and the analytic 12 x layers x width x S convention count."""
    return 2 * _attention_forward_flops(query_shape, key_shape, value_shape)


def attention_flop_formulas() -> dict:
    """Formulas for the fused attention kernels that SDPA dispatches to, given to the counter in place of
    torch's: torch 2.11's reject grouped-query attention (fewer key/value heads than query heads: Llama 3,
    Qwen, Mistral shapes), and the CPU kernels have none (the attention term was silently missing). The
    kernels a torch build lacks are skipped."""
    aten = torch.ops.aten
    forward = ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    formulas = {}
    for name in forward:
        for op, formula in ((name, _attention_forward_flops), (f"{name}_backward", _attention_backward_flops)):
            if hasattr(aten, op):
                formulas[getattr(aten, op)] = formula
    return formulas


def four_bit_flop_formulas() -> dict:
    """A FLOP formula for bitsandbytes' fused 4-bit matmul (``bitsandbytes::gemm_4bit``, QLoRA's forward
    through a frozen 4-bit weight): 2 x rows x the weight's out x in features, as for the matmul it replaces.
    Its backward dequantises and calls aten.mm, which torch's formulas count. Without it the cross-check read
    0.73 on an H100 (134M QLoRA) and 0.59 on the CPU: the forward of every 4-bit layer went uncounted."""
    try:
        return {torch.ops.bitsandbytes.gemm_4bit: _four_bit_matmul_flops}
    except (AttributeError, RuntimeError):  # bitsandbytes not imported (no QLoRA run in this process)
        return {}


def _four_bit_matmul_flops(a_shape, b_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    rows = math.prod(a_shape[:-1])
    return 2 * rows * weight_shape[0] * weight_shape[1]


def counted_flops(model: torch.nn.Module, inputs: dict, autocast: dict) -> int:
    """FLOPs of one forward + backward as torch.utils.flop_counter's formulas count them (matmuls, fused
    attention through ``attention_flop_formulas``, bitsandbytes' 4-bit matmuls through
    ``four_bit_flop_formulas``), tallied by ``FlopTally``, with activation checkpointing off
    (``recomputation_off``): the count checks the model FLOPs of this module's convention. Gradients are cleared."""
    tally = new_tally()
    # The random number streams are left as they were (dropout draws from them): a run's numbers must not
    # depend on whether, or on how large a micro-batch, the cross-check counted.
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []), recomputation_off(model), tally:
        with torch.autocast(**autocast):
            output = model(**inputs)
        output.loss.mean().backward()
    model.zero_grad(set_to_none=True)
    return tally.total


def new_tally() -> "FlopTally":
    """A FlopTally with every formula ftbench adds: fused attention and bitsandbytes' 4-bit matmuls."""
    return FlopTally({**attention_flop_formulas(), **four_bit_flop_formulas()})


def checkpointed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward transformers recomputes in the backward pass (its checkpointing flag on)."""
    return [module for module in model.modules() if getattr(module, "gradient_checkpointing", False) is True]


@contextlib.contextmanager
def recomputation_off(model: torch.nn.Module):
    """Activation checkpointing switched off while inside, back on after. Counted with it on, the
    recomputed forward passes made the cross-check read 1.23 (full) and 1.37 (LoRA) for the 134M example's
    checkpointed runs on an H100: a count of hardware FLOPs against analytic model FLOPs."""
    switched = checkpointed_modules(model)
    for module in switched:
        module.gradient_checkpointing = False
    try:
        yield
    finally:
        for module in switched:
            module.gradient_checkpointing = True


class FlopTally(TorchDispatchMode):
    """The total that torch.utils.flop_counter.FlopCounterMode gives, at less cost: the same per-op formulas
    and the same decomposition of ops that have none, without its per-module bookkeeping (hooks on every
    module call and on backward), and trying to decompose each op only once. The identical total
    (tests/test_measurement.py) at 0.57-0.58x FlopCounterMode's time on an H100 for the 134M example's
    full and LoRA passes (scripts/benchmark_flop_count.py; README); where compute dominates, as on a CPU,
    the two differ less.

    Not counted, as there: higher-order operators (torch.compile's control flow, user Triton kernels)."""

    supports_higher_order_operators = True

    def __init__(self, extra_formulas: dict | None = None):
        from torch.utils.flop_counter import flop_registry, shape_wrapper

        super().__init__()
        self.formulas = {**flop_registry, **{op: shape_wrapper(f) for op, f in (extra_formulas or {}).items()}}
        self.total = 0
        self._no_decomposition: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented
        formula = self.formulas.get(func._overloadpacket)
        if formula is None and func not in self._no_decomposition:
            # A composite op without a formula may be made of ops with one (FlopCounterMode does the same).
            with self:
                result = func.decompose(*args, **kwargs)
            if result is not NotImplemented:
                return result
            self._no_decomposition.add(func)
        out = func(*args, **kwargs)
        if formula is not None:
            positional, named = formula_arguments(formula, func, args, kwargs)
            self.total += int(formula(*positional, **named, out_val=out))
        return out


def formula_arguments(formula, func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An op's arguments as its FLOP formula takes them: the tensors it names by position, every other argument
    by its schema name. An overload can put more before them than the formula expects: aten.addmm.dtype_out
    (what Liger's fused linear cross-entropy calls on an H100) has ``out_dtype`` fourth, where addmm's formula
    takes ``out_shape``, which it would then be given twice."""
    slots = _formula_slots(formula)
    if len(args) <= slots:
        return args, kwargs
    names = [argument.name for argument in func._schema.arguments]
    return args[:slots], {**kwargs, **{names[index]: args[index] for index in range(slots, len(args))}}


@functools.lru_cache(maxsize=None)
def _formula_slots(formula) -> int:
    """How many positional arguments a formula takes before ``out_shape`` (shape_wrapper hides the signature)."""
    parameters = list(inspect.signature(inspect.unwrap(formula)).parameters.values())
    for index, parameter in enumerate(parameters):
        if parameter.name == "out_shape" or parameter.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            return index
    return len(parameters)


# ---------------------------------------------------------------------------------------------------
# Peak table and MFU
