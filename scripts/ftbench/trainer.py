"""One training run: a plain PyTorch loop with a warmup window and a measured window.

How the numbers are taken (so they can be trusted):
- the first ``warmup_steps`` steps (allocator growth, autotuning, lazy init) are run but not measured;
- the device is synchronised before every clock read, so a step's time includes its GPU work;
- tokens are the real (unpadded) tokens of each batch, counted from the stored sequence lengths;
- throughput is measured-window tokens / measured-window seconds; global (all devices) and per-device
  throughput are stored apart.
"""

from __future__ import annotations

import math
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import data, environment, modeling
from .errors import UnsupportedConfiguration

STATUSES = ("ok", "oom", "diverged", "timeout", "unsupported", "failed")


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    real_tokens: int  # tokens without padding
    padded_tokens: int  # tokens including padding (batch x longest sequence)

    @property
    def samples(self) -> int:
        return int(self.labels.shape[0])


def collate(split: data.TokenisedSplit, indices: np.ndarray, pad_token_id: int) -> Batch:
    """Pad a batch to its longest sequence; count real tokens before padding is added."""
    sequences = [split.input_ids[i] for i in indices]
    lengths = [len(seq) for seq in sequences]
    longest = max(lengths)
    input_ids = np.full((len(sequences), longest), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    return Batch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        labels=torch.from_numpy(split.labels[indices]),
        real_tokens=int(sum(lengths)),
        padded_tokens=int(longest * len(sequences)),
    )


def batch_order(num_examples: int, batch_size: int, total_steps: int, seed: int):
    """Yield index arrays for ``total_steps`` full batches, reshuffling each epoch (seeded).

    The last incomplete batch of an epoch is dropped so every measured step has the same batch size.
    """
    rng = np.random.default_rng(seed)
    steps_done = 0
    while steps_done < total_steps:
        order = rng.permutation(num_examples)
        for start in range(0, num_examples - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
            steps_done += 1
            if steps_done == total_steps:
                return


def plan_steps(spec: dict, num_train: int) -> int:
    steps_per_epoch = num_train // spec["batch_size"]
    if steps_per_epoch == 0:
        raise ValueError(f"batch_size {spec['batch_size']} is larger than the {num_train} training examples")
    if spec["max_steps"] is not None:
        return spec["max_steps"]
    return max(1, math.ceil(spec["epochs"] * steps_per_epoch))


def choose_device(spec: dict) -> tuple[torch.device, str | None]:
    """The device to train on and, if it differs from what was asked, why."""
    wanted = spec["num_gpus"]
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if wanted == 0:
        return torch.device("cpu"), None
    if available >= wanted:
        return torch.device("cuda", 0), None
    if wanted == 1 and available == 0:
        # The laptop case: a run written for one GPU still gives numbers, clearly marked as CPU numbers.
        return torch.device("cpu"), "no CUDA device visible; ran on the CPU"
    raise UnsupportedConfiguration(f"run asks for {wanted} GPUs but {available} are visible")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the process's high-water resident memory since it started.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Measurement:
    """Per-step records and the figures derived from the measured window."""

    warmup_steps: int
    steps: list[dict] = field(default_factory=list)
    window_start: float | None = None
    window_end: float | None = None

    def record(self, step: int, seconds: float, batch: Batch, loss: float, lr: float) -> None:
        self.steps.append(
            {
                "step": step,
                "measured": step >= self.warmup_steps,
                "step_time_s": seconds,
                "samples": batch.samples,
                "tokens": batch.real_tokens,
                "padded_tokens": batch.padded_tokens,
                "loss": loss,
                "lr": lr,
            }
        )

    def summary(self, world_size: int) -> dict:
        measured = [s for s in self.steps if s["measured"]]
        if not measured or self.window_start is None or self.window_end is None:
            return {"measured_steps": 0}
        seconds = self.window_end - self.window_start
        tokens = sum(s["tokens"] for s in measured)
        samples = sum(s["samples"] for s in measured)
        padded = sum(s["padded_tokens"] for s in measured)
        times = np.array([s["step_time_s"] for s in measured])
        return {
            "measured_steps": len(measured),
            "measured_time_s": seconds,
            "measured_tokens": tokens,
            "samples_per_s": samples / seconds,
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_device": tokens / seconds / world_size,
            "padding_fraction": 1 - tokens / padded if padded else 0.0,
            "step_time_median_s": float(np.median(times)),
            "step_time_p90_s": float(np.percentile(times, 90)),
        }


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(spec: dict, params):
    params = [p for p in params if p.requires_grad]
    if spec["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=spec["learning_rate"], momentum=0.9, weight_decay=spec["weight_decay"])
    return torch.optim.AdamW(params, lr=spec["learning_rate"], weight_decay=spec["weight_decay"])


def make_scheduler(optimizer, spec: dict, total_steps: int):
    """Linear warmup over ``lr_warmup_steps``, then linear decay to zero."""
    warmup = spec["lr_warmup_steps"]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class StopSignal:
    """When the loop must stop early: a wall-clock deadline (the job's time limit minus a margin for
    evaluation and writing results) or a termination request (SIGTERM from the scheduler)."""

    deadline: float | None = None  # time.monotonic() value
    terminate_requested: bool = False

    def reason(self, typical_step_s: float) -> str | None:
        if self.terminate_requested:
            return "terminated by the scheduler (SIGTERM)"
        # Stop if another step might not finish before the deadline.
        if self.deadline is not None and time.monotonic() + 2 * typical_step_s >= self.deadline:
            return "stopped before the job's time limit"
        return None


def train_run(spec: dict, data_dir: str | Path, stop: StopSignal | None = None) -> tuple[dict, list[dict]]:
    """Run one configuration; return (metrics, step records). Expected failures become a status.

    Unexpected exceptions propagate: the job fails with its traceback rather than writing a fake row.
    """
    stop = stop or StopSignal()
    started = time.perf_counter()
    metrics: dict = {"run_id": spec["run_id"], "status": "ok", "status_reason": None}
    steps: list[dict] = []
    try:
        device, note = choose_device(spec)
        metrics["status_reason"] = note
        metrics["device"] = device.type
        metrics["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else environment.cpu_model()
        world_size = spec["num_gpus"] if spec["parallel"] == "dp" and device.type == "cuda" else 1
        metrics["world_size"] = world_size
        modeling.check_supported(spec, device)
        manifest = data.verify(data_dir)
        steps = _train(spec, data_dir, manifest, device, world_size, metrics, stop)
    except UnsupportedConfiguration as exc:
        metrics.update(status="unsupported", status_reason=str(exc))
    except torch.OutOfMemoryError as exc:
        metrics.update(status="oom", status_reason=" ".join(str(exc).split())[:300])
    metrics["wall_time_s"] = time.perf_counter() - started
    metrics["peak_rss_mb"] = peak_rss_mb()
    return metrics, steps


def _train(spec, data_dir, manifest, device, world_size, metrics, stop: StopSignal) -> list[dict]:
    set_seed(spec["seed"])
    load_started = time.perf_counter()
    train_split = data.load_split(data_dir, "train", manifest)
    eval_split = data.load_split(data_dir, "eval", manifest)
    built = modeling.build_model(spec, num_labels=len(manifest["label_names"]), device=device)
    model = built.model
    if world_size > 1:
        model = torch.nn.DataParallel(model, device_ids=list(range(world_size)))
    metrics.update(trainable_params=built.trainable_params, total_params=built.total_params)
    metrics["load_time_s"] = time.perf_counter() - load_started

    total_steps = plan_steps(spec, len(train_split))
    if spec["warmup_steps"] >= total_steps:
        raise ValueError(f"warmup_steps ({spec['warmup_steps']}) must be smaller than the run's {total_steps} steps")
    optimizer = make_optimizer(spec, model.parameters())
    scheduler = make_scheduler(optimizer, spec, total_steps)
    autocast_dtype = modeling.DTYPES[spec["precision"]]
    use_autocast = spec["precision"] != "fp32"
    # GradScaler keeps small fp16 gradients from flushing to zero; bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=spec["precision"] == "fp16")
    pad_id = manifest["pad_token_id"]

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measurement = Measurement(warmup_steps=spec["warmup_steps"])
    model.train()
    train_started = time.perf_counter()
    synchronize(device)
    step_start = time.perf_counter()
    for step, indices in enumerate(batch_order(len(train_split), spec["batch_size"], total_steps, spec["seed"])):
        if step == spec["warmup_steps"]:
            measurement.window_start = step_start
        typical = measurement.steps[-1]["step_time_s"] if measurement.steps else 0.0
        stop_reason = stop.reason(typical)
        if stop_reason:
            metrics.update(status="timeout", status_reason=f"{stop_reason} at step {step} of {total_steps}")
            break
        batch = collate(train_split, indices, pad_id)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=use_autocast):
            output = model(
                input_ids=batch.input_ids.to(device, non_blocking=True),
                attention_mask=batch.attention_mask.to(device, non_blocking=True),
                labels=batch.labels.to(device, non_blocking=True),
            )
        loss = output.loss.mean()  # DataParallel returns one loss per device
        scaler.scale(loss).backward()
        loss_value = loss.item()  # synchronises; needed to stop before a NaN reaches the weights
        if not math.isfinite(loss_value):
            metrics.update(status="diverged", status_reason=f"loss became {loss_value} at step {step}", diverged_step=step)
            optimizer.zero_grad(set_to_none=True)
            break
        scaler.step(optimizer)
        scaler.update()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        step_end = time.perf_counter()
        measurement.record(step, step_end - step_start, batch, loss_value, lr)
        measurement.window_end = step_end
        step_start = step_end
    metrics["train_time_s"] = time.perf_counter() - train_started
    metrics.update(total_steps=total_steps, warmup_steps=spec["warmup_steps"])
    metrics.update(measurement.summary(world_size))
    if measurement.steps:
        metrics["final_train_loss"] = measurement.steps[-1]["loss"]
    if device.type == "cuda":
        metrics["peak_memory_allocated_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        metrics["peak_memory_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20

    if metrics["status"] == "ok":
        eval_started = time.perf_counter()
        metrics.update(evaluate(model, eval_split, spec, device, pad_id))
        metrics["eval_time_s"] = time.perf_counter() - eval_started
    return measurement.steps


@torch.no_grad()
def evaluate(model, split: data.TokenisedSplit, spec: dict, device: torch.device, pad_id: int) -> dict:
    model.eval()
    count = len(split) if spec["max_eval_samples"] is None else min(len(split), spec["max_eval_samples"])
    correct = 0
    loss_sum = 0.0
    for start in range(0, count, spec["eval_batch_size"]):
        indices = np.arange(start, min(start + spec["eval_batch_size"], count))
        batch = collate(split, indices, pad_id)
        with torch.autocast(device.type, dtype=modeling.DTYPES[spec["precision"]], enabled=spec["precision"] != "fp32"):
            output = model(
                input_ids=batch.input_ids.to(device),
                attention_mask=batch.attention_mask.to(device),
                labels=batch.labels.to(device),
            )
        labels = batch.labels.to(device)
        loss_sum += float(output.loss.mean()) * len(indices)
        correct += int((output.logits.argmax(dim=-1) == labels).sum())
    model.train()
    return {"eval_samples": count, "eval_accuracy": correct / count, "eval_loss": loss_sum / count}
