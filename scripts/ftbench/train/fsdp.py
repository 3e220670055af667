"""FSDP runs (``parallel: fsdp``): PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Launched like ddp (ddp.py: torchrun, one process per device, ranks merged after), so everything about
processes, stopping and results is shared; what differs is how the model is wrapped, here:
- each repeated block (a decoder or encoder layer) is its own FSDP unit, then the root takes the rest
  (embeddings, head). A unit's parameters are all-gathered just before its forward (and again before its
  backward when ``fsdp_reshard_after_forward``) and its gradients reduce-scattered after its backward, so a
  device holds 1/world of the parameters, gradients and optimizer state plus the units being computed;
- mixed precision follows the run's precision: the gathered parameters are cast to the autocast dtype
  (bf16/fp16), the sharded masters stay fp32, gradients are reduced in ``fsdp_reduce_dtype`` (default: the
  run's precision). A LoRA run's frozen base is sharded in its 16-bit dtype beside fp32 adapters in the same
  unit (ftbench/recipe.py): FSDP2 asks a uniform dtype of a unit's trainable parameters only (torch releases
  that asked it of all of them are refused by name: ``mixes_frozen_dtypes``);
- ``fsdp_cpu_offload``: the shards, their gradients and the optimizer state live in host memory between
  uses (the optimizer step then runs on the CPU).

Where the model is built (``build_device``), so that no process ever holds the whole fp32 model:
- a config-built model (random weights) is built on the meta device (shapes only, no memory), sharded,
  and only then materialised: each rank allocates its own shards on its GPU and initialises them there
  with the model's own initialisation rules (transformers' ``initialize_weights``: normal weights, unit
  norms, rotary tables; LoRA's own for the adapters). An 8B model then costs each process seconds and no
  host memory, where building it in fp32 on the CPU took 127 s and 32 GB per process (H100, round 2);
- a checkpoint is loaded on the CPU and moved to the device unit by unit as it is sharded;
- QLoRA: the 4-bit model is built on the GPU (it is a quarter of bf16), its packed weights stored in the
  run's compute dtype (``bnb_4bit_quant_storage``) so that FSDP2 can shard them like any floating-point
  tensor without casting them (their dtype is the mixed-precision dtype already); each 4-bit layer keeps
  its quantisation state on the module, where bitsandbytes finds it again when FSDP2 hands the layer a
  plain, gathered parameter. The LoRA adapters are the only trainable, sharded-and-reduced parameters.

Evaluation runs on every rank, sharded (each forward needs every rank's all-gather); rank 0's scores are
the run's.
"""

from __future__ import annotations

import torch

from ftbench.measure.memory_estimate import repeated_blocks  # noqa: F401 - the blocks fsdp wraps (and the estimate counts)
from ftbench.runspec import RunSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mixes_frozen_dtypes() -> bool:
    """Whether this torch's FSDP2 shards a unit whose frozen parameters have another dtype than its trainable ones
    (a 16-bit LoRA base beside fp32 adapters): it does where its dtype check looks at trainable parameters only.
    Older releases checked every parameter and failed at the first forward pass, after the model was built."""
    import inspect

    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        return "requires_grad" in inspect.getsource(FSDPParamGroup._init_mp_dtypes)
    except (ImportError, AttributeError, OSError, TypeError):
        return False


def build_device(spec: RunSpec, device: torch.device) -> torch.device:
    """Where the model is built (the module docstring says why): ``device`` for every parallel mode but fsdp;
    under fsdp the meta device for a config-built model, ``device`` for QLoRA, the CPU for a checkpoint."""
    if spec.parallel != "fsdp" or spec.method == "qlora":
        return device
    return torch.device("meta") if spec.model_def["source"]["kind"] == "config" else torch.device("cpu")


def policies(spec: RunSpec) -> dict:
    """fully_shard's keyword arguments for the run's settings."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    compute = DTYPES[spec.precision]
    reduce = DTYPES[spec.fsdp_reduce_dtype or spec.precision]
    return {
        # fp32 runs: no cast (param_dtype None keeps the parameters' own dtype).
        "mp_policy": MixedPrecisionPolicy(param_dtype=None if spec.precision == "fp32" else compute,
                                          reduce_dtype=reduce),
        "offload_policy": CPUOffloadPolicy() if spec.fsdp_cpu_offload else OffloadPolicy(),
        "reshard_after_forward": spec.fsdp_reshard_after_forward,
    }


def shard(model: torch.nn.Module, spec: RunSpec, device: torch.device) -> torch.nn.Module:
    """Shard ``model`` in place over the process group's ranks: every repeated block, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    kwargs = policies(spec)
    if spec.method == "qlora":
        keep_quant_state_on_modules(model)
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    if any(param.is_meta for param in model.parameters()):
        # With offload the shards live in host memory between uses: they are made there.
        materialise(model, torch.device("cpu") if spec.fsdp_cpu_offload else device)
    return model


def materialise(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate a meta-built, sharded model's shards on ``device`` and initialise them: the model's own rules
    for its weights and buffers, then LoRA's for its adapters (zero B: the adapted model starts as the base)."""
    model.to_empty(device=device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.initialize_weights()  # transformers' rules, module by module; each rank fills its own shards
    for module in model.modules():
        if hasattr(module, "reset_lora_parameters"):
            for adapter in module.lora_A:
                module.reset_lora_parameters(adapter, True)


def keep_quant_state_on_modules(model: torch.nn.Module) -> None:
    """Each 4-bit layer keeps its weight's quantisation state itself: FSDP2 replaces the weight with a plain
    gathered parameter, and bitsandbytes' Linear4bit takes the state from the module when the weight has none."""
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            module.quant_state = state
