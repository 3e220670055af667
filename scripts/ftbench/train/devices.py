"""Where a run trains: the device, this process's place in a DDP group, autocast and device syncs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ftbench.train import modeling
from ftbench.errors import UnsupportedConfiguration
from ftbench.runspec import RunSpec, compute_dtype


@dataclass(frozen=True)
class Distributed:
    """This process's place in a torchrun group (rank 0 of 1 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "Distributed":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def active(self) -> bool:
        return self.world_size > 1


def choose_device(spec: RunSpec, dist: Distributed) -> tuple[torch.device, str | None]:
    """The device this process trains on and, if it differs from what was asked, why."""
    wanted = spec.num_gpus
    if spec.device == "cpu" or wanted == 0:
        return torch.device("cpu"), None
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available >= wanted:
        return torch.device("cuda", dist.local_rank), None
    if wanted == 1 and available == 0 and spec.device == "auto":
        # The laptop case: a run written for one GPU still gives numbers, clearly marked as CPU numbers.
        return torch.device("cpu"), "no CUDA device visible; ran on the CPU"
    raise UnsupportedConfiguration(f"run asks for {wanted} GPUs but {available} are visible")


def local_gpus(spec: RunSpec, device: torch.device) -> list[int]:
    """The GPUs this process drives (their peaks are the run's): all of a DataParallel run's, else its own, none on a
    CPU. Touching any other GPU would open a CUDA context there, memory that the rank owning that GPU would then see
    in NVML."""
    if device.type != "cuda":
        return []
    if spec.parallel == "dp":
        return list(range(spec.devices))
    return [device.index if device.index is not None else torch.cuda.current_device()]


def autocast_args(device: torch.device, precision: str) -> dict:
    """``torch.autocast(**autocast_args(...))`` for a run's precision: on for the mixed precisions (bf16, fp16: the
    weights stay fp32 masters), off for fp32 and for bf16_true (the weights are bf16 themselves)."""
    return {"device_type": device.type, "dtype": modeling.DTYPES[compute_dtype(precision)],
            "enabled": precision in ("bf16", "fp16")}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
