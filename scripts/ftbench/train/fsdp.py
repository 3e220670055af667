"""FSDP runs (``parallel: fsdp``): PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Launched like ddp (ddp.py: torchrun, one process per device, ranks merged after), so everything about
processes, stopping and results is shared; what differs is how the model is wrapped, here:
- each repeated block (a decoder or encoder layer) is its own FSDP unit, then the root takes the rest
  (embeddings, head). A unit's parameters are all-gathered just before its forward (and again before its
  backward when ``fsdp_reshard_after_forward``) and its gradients reduce-scattered after its backward, so a
  device holds 1/world of the parameters, gradients and optimizer state plus the units being computed;
- mixed precision follows the run's precision: the gathered parameters are cast to the autocast dtype
  (bf16/fp16), the sharded masters stay fp32, gradients are reduced in ``fsdp_reduce_dtype`` (default: the
  run's precision);
- ``fsdp_cpu_offload``: the shards, their gradients and the optimizer state live in host memory between
  uses (the optimizer step then runs on the CPU).

The model is built on the CPU and moved to the device unit by unit as it is sharded, so no device ever
holds the whole fp32 model (``build_device``). Evaluation runs on every rank, sharded (each forward needs
every rank's all-gather); rank 0's scores are the run's.
"""

from __future__ import annotations

import torch

from ftbench.errors import UnsupportedConfiguration
from ftbench.measure.memory_estimate import repeated_blocks  # noqa: F401 - the blocks fsdp wraps (and the estimate counts)
from ftbench.runspec import RunSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_supported(spec: RunSpec) -> None:
    """What FSDP2 cannot run here, as an `unsupported` row with the reason (before torchrun starts)."""
    if spec.parallel != "fsdp":
        return
    if spec.method == "qlora":
        # bitsandbytes' Params4bit carries its quantisation state outside the tensor; FSDP2 shards the
        # packed bytes as a DTensor and the state no longer matches what each rank holds.
        raise UnsupportedConfiguration("QLoRA under fsdp: bitsandbytes 4-bit parameters are not sharded by FSDP2 "
                                       "(their quantisation state is not split with them); use ddp or single")
    if spec.optimizer != "adamw" and spec.optimizer != "sgd":
        raise UnsupportedConfiguration(f"optimizer {spec.optimizer} under fsdp: bitsandbytes' 8-bit optimizers do not "
                                       "take FSDP2's sharded (DTensor) parameters; use adamw or sgd")


def build_device(spec: RunSpec, device: torch.device) -> torch.device:
    """Where the model is built: the CPU for fsdp (sharding moves each unit's shard to ``device``)."""
    return torch.device("cpu") if spec.parallel == "fsdp" else device


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
    for block in repeated_blocks(model):
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model
