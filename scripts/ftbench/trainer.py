"""One training run: a plain PyTorch loop with a warmup window and a measured window.

How the numbers are taken (so they can be trusted):
- the first ``warmup_steps`` optimizer steps (allocator growth, autotuning, torch.compile) are run but
  not measured;
- the device is synchronised before every clock read, so a step's time includes its GPU work;
- tokens are the real (unpadded) tokens of every micro-batch of a step (gradient accumulation counted);
- throughput is measured-window tokens / measured-window seconds; global (all devices of the run) and
  per-device throughput are stored apart.

Parallel modes: ``single`` (one device), ``dp`` (torch.nn.DataParallel: one process splits each batch
over the GPUs), ``ddp`` (DistributedDataParallel: one process per device, started by torchrun; see
``launch.py``). ``batch_size`` is always per device, so the global batch is batch_size x devices.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import data, environment, faults, flops, gpu_monitor, memory_estimate, modeling, batching
from .errors import UnsupportedConfiguration
from .runspec import AUTO_BATCH_SIZE_MAX, RunSpec

STATUSES = ("ok", "oom", "diverged", "timeout", "unsupported", "failed")
STEP_FIELDS = ["step", "measured", "step_time_s", "loader_s", "samples", "tokens", "padded_tokens", "flops", "loss", "lr"]


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


TERMINATED_REASON = "terminated by the scheduler (SIGTERM)"


@dataclass
class StopSignal:
    """When the loop must stop early: a wall-clock deadline (the job's time limit minus a margin for
    evaluation and writing results) or a termination request (SIGTERM from the scheduler)."""

    deadline: float | None = None  # time.monotonic() value
    terminate_requested: bool = False

    def reason(self, typical_step_s: float) -> str | None:
        if self.terminate_requested:
            return TERMINATED_REASON
        # Stop if another step might not finish before the deadline.
        if self.deadline is not None and time.monotonic() + 2 * typical_step_s >= self.deadline:
            return "stopped before the job's time limit"
        return None


def batch_order(num_examples: int, global_batch: int, count: int, seed: int):
    """Yield ``count`` index arrays of ``global_batch`` examples, reshuffled each epoch (seeded, so every
    DDP rank sees the same order and takes its own slice).

    The last incomplete batch of an epoch is dropped so every measured step has the same shape.
    """
    rng = np.random.default_rng(seed)
    produced = 0
    while produced < count:
        order = rng.permutation(num_examples)
        for start in range(0, num_examples - global_batch + 1, global_batch):
            yield order[start : start + global_batch]
            produced += 1
            if produced == count:
                return


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


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the process's high-water resident memory since it started.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarise(steps: list[dict], window_s: float | None, devices: int) -> dict:
    """Throughput and step-time figures of the measured window. ``steps`` hold global counts."""
    measured = [s for s in steps if s["measured"]]
    if not measured or not window_s:
        return {"measured_steps": 0}
    tokens = sum(s["tokens"] for s in measured)
    samples = sum(s["samples"] for s in measured)
    padded = sum(s["padded_tokens"] for s in measured)
    step_flops = sum(s["flops"] for s in measured)
    times = np.array([s["step_time_s"] for s in measured])
    return {
        "flops_per_step_analytic": step_flops / len(measured),
        "tflops_per_s": step_flops / window_s / 1e12,
        # Share of step time spent producing the next batch (collate + host-to-device copy).
        "loader_wait_fraction": sum(s["loader_s"] for s in measured) / float(times.sum()),
        "measured_steps": len(measured),
        "measured_time_s": window_s,
        "measured_tokens": tokens,
        "samples_per_s": samples / window_s,
        "tokens_per_s": tokens / window_s,
        "tokens_per_s_per_device": tokens / window_s / devices,
        "padding_fraction": 1 - tokens / padded if padded else 0.0,
        "step_time_median_s": float(np.median(times)),
        "step_time_p90_s": float(np.percentile(times, 90)),
    }


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_optimizer(spec: RunSpec, model: torch.nn.Module, device: torch.device):
    params = [p for p in model.parameters() if p.requires_grad]
    lr, decay = spec.learning_rate, spec.weight_decay
    name = spec.optimizer
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=decay)
    if name in modeling.BNB_OPTIMIZERS:
        import bitsandbytes as bnb

        optimizer_class = bnb.optim.PagedAdamW8bit if name == "paged_adamw_8bit" else bnb.optim.AdamW8bit
        return optimizer_class(params, lr=lr, weight_decay=decay)
    # The fused CUDA kernel updates all parameters in one launch; it needs every parameter on the GPU.
    fused = device.type == "cuda" and all(p.is_cuda and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=decay, fused=fused or None)


def make_scheduler(optimizer, spec: RunSpec, total_steps: int):
    """Linear warmup over ``lr_warmup_steps``, then linear decay to zero."""
    warmup = spec.lr_warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def scaler_step(scaler: torch.amp.GradScaler, optimizer) -> bool:
    """The optimizer step through the GradScaler; True when the scaler skipped it.

    With fp16 the scaler skips a step whose gradients hold inf/NaN (the loss scale was too high) and
    halves the scale: a lower scale after ``update`` is how a skipped step shows. A disabled scaler
    (fp32, bf16) steps the optimizer and never skips.
    """
    scale = scaler.get_scale() if scaler.is_enabled() else None
    scaler.step(optimizer)
    scaler.update()
    return scale is not None and scaler.get_scale() < scale


# ---------------------------------------------------------------------------------------------------
# auto_batch_size: the largest batch that fits, found by trying


def search_batch_size(fits, start: int, cap: int) -> tuple[int | None, int | None, list[list]]:
    """The largest batch ``fits(batch)`` accepts: from ``start``, double until a batch does not fit or
    ``cap`` is reached; if ``start`` itself does not fit, halve until one does.

    Returns (found, oom_at, trials): ``found`` is None when not even a batch of 1 fits; ``oom_at`` is the
    smallest batch that did not fit (None when every batch tried fitted, i.e. the cap was reached);
    ``trials`` lists [batch, fitted] in the order tried. Doubling brackets the boundary to a factor of two
    (found <= true limit < oom_at) in log2(cap / start) trials.
    """
    trials: list[list] = []
    found = oom_at = None
    batch = max(1, min(start, cap))
    while True:
        fitted = bool(fits(batch))
        trials.append([batch, fitted])
        if not fitted:
            oom_at = batch
            break
        found = batch
        if batch >= cap:
            break
        batch = min(2 * batch, cap)
    while found is None and batch > 1:
        batch //= 2
        fitted = bool(fits(batch))
        trials.append([batch, fitted])
        if fitted:
            found = batch
        else:
            oom_at = batch
    return found, oom_at, trials


def _auto_batch_size(spec, bare, split, task, pad_id, device, dist, metrics, injector) -> int:
    """Try one full training step (forward, backward, optimizer step) at growing batch sizes per device,
    catching out-of-memory errors; record the boundary in ``metrics``; return the batch to measure at.

    The trials use a throwaway optimizer with learning rate 0 (the weights do not move, yet its state is
    allocated, as in the real run) on the run's longest sequences. They run eagerly (no torch.compile)
    and, in DDP, on each rank's model before it is wrapped (no gradient all-reduce, so a rank that runs
    out of memory cannot leave the others waiting); the ranks then agree on the smallest batch any of
    them found.
    """
    devices = spec.devices
    per_process = devices // dist.world_size  # DataParallel feeds all devices from one process
    data_cap = len(split) // (devices * spec.grad_accum_steps)
    cap = max(1, min(spec.auto_batch_size_max or AUTO_BATCH_SIZE_MAX, data_cap))
    trial_model = bare
    if spec.parallel == "dp" and device.type == "cuda" and devices > 1:
        trial_model = torch.nn.DataParallel(bare, device_ids=list(range(devices)))
    order = _longest_first(split)
    autocast = dict(device_type=device.type, dtype=modeling.DTYPES[spec.precision], enabled=spec.precision != "fp32")

    def step(batch_size: int, optimizer, scaler) -> None:
        indices = order[np.arange(batch_size * per_process) % len(order)]
        batch = batching.collate(task, split, indices, pad_id).to(device)
        injector.check_batch(batch_size)
        with torch.autocast(**autocast):
            loss = trial_model(**batch.inputs).loss.mean()  # the loss only, as in training (memory)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        synchronize(device)

    def fits(batch_size: int) -> bool:
        optimizer = make_optimizer(spec.replace(learning_rate=1.0), trial_model, device)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
        try:
            step(batch_size, optimizer, scaler)
            fitted = True
        except torch.OutOfMemoryError:
            fitted = False
        # Here the exception and the step's frame (its activations) are gone: free what is left.
        trial_model.zero_grad(set_to_none=True)
        del optimizer, scaler
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return fitted

    started = time.perf_counter()
    found, oom_at, trials = search_batch_size(fits, spec.batch_size, cap)
    if dist.active:
        # Every rank must train at the same batch: the smallest any rank found (0: none fitted somewhere).
        agreed = torch.tensor([found or 0, oom_at or 2**31 - 1], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        found = int(agreed[0]) or None
        oom_at = int(agreed[1]) if int(agreed[1]) < 2**31 - 1 else None
    metrics.update(auto_batch_size_found=found, auto_batch_size_oom_at=oom_at, auto_batch_size_trials=trials,
                   auto_batch_size_cap=cap, auto_batch_size_time_s=time.perf_counter() - started)
    if found is None:
        raise torch.OutOfMemoryError(f"auto_batch_size: not even a batch of 1 per device fits (tried {trials})")
    return found


def _longest_first(split) -> np.ndarray:
    """Row indices, longest sequences first (the padded batch shape is the worst case for memory); split
    order for a split read from disk, whose lengths are not in memory."""
    input_ids = getattr(split, "input_ids", None)
    if input_ids is None:
        return np.arange(len(split))
    return np.argsort([-len(ids) for ids in input_ids], kind="stable")


def train_run(spec: RunSpec, data_dir: str | Path, stop: StopSignal | None = None,
              dist: Distributed | None = None) -> tuple[dict, list[dict]]:
    """Run one configuration (this process's part of it); return (metrics, step records).

    Expected failures become a status (unsupported, oom, diverged, timeout). Unexpected exceptions
    propagate: the job fails with its traceback rather than writing a fake row.
    """
    stop = stop or StopSignal()
    dist = dist or Distributed()
    started = time.perf_counter()
    metrics: dict = {"run_id": spec.run_id, "status": "ok", "status_reason": None}
    steps: list[dict] = []
    # Test-only fault injection (faults.py), read once per run; without FTBENCH_INJECT_FAULT it does nothing.
    injector = faults.Injector.from_env(spec.run_id, dist.rank)
    try:
        device, note = choose_device(spec, dist)
        metrics["status_reason"] = note
        metrics["device"] = device.type
        metrics["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else environment.cpu_model()
        metrics["world_size"] = spec.devices if (device.type == "cuda" or dist.active) else 1
        modeling.check_supported(spec, device)
        manifest = data.verify(data_dir)
        steps = _train(spec, data_dir, manifest, device, dist, metrics, stop, injector)
    except UnsupportedConfiguration as exc:
        metrics.update(status="unsupported", status_reason=str(exc))
    except torch.OutOfMemoryError as exc:
        metrics.update(status="oom", status_reason=" ".join(str(exc).split())[:300])
        if torch.cuda.is_available():
            # The high-water mark reached before the failed allocation: how far over the run was.
            metrics["peak_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            metrics["peak_memory_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    metrics["wall_time_s"] = time.perf_counter() - started
    metrics["peak_rss_mb"] = peak_rss_mb()
    return metrics, steps


def derive_efficiency(metrics: dict, spec: RunSpec, devices: int) -> dict:
    """MFU and energy per token from the summary figures (one place for single, DP and merged DDP runs)."""
    derived = {}
    if metrics.get("device") == "cuda":
        achieved = metrics["tflops_per_s"] * 1e12 if metrics.get("tflops_per_s") else None
        derived.update(flops.mfu(achieved, metrics.get("device_name", ""), spec.precision, devices))
    else:
        derived.update(mfu=None, mfu_peak_tflops=None, mfu_peak_source=None)
    energy, tokens = metrics.get("energy_j"), metrics.get("measured_tokens")
    derived["energy_j_per_token"] = energy / tokens if energy is not None and tokens else None
    return derived


def _wrap_model(model, spec, device, dist):
    """The model as trained: DataParallel / DDP / compiled as asked."""
    if spec.parallel == "dp" and device.type == "cuda" and spec.devices > 1:
        model = torch.nn.DataParallel(model, device_ids=list(range(spec.devices)))
    if dist.active:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if spec.compile:
        model = torch.compile(model)
    return model


def _stop_reason(stop: StopSignal, typical_step_s: float, dist: Distributed, device: torch.device) -> str | None:
    """Every rank must stop at the same step, or the others would wait forever in the next all-reduce."""
    reason = stop.reason(typical_step_s)
    if not dist.active:
        return reason
    flag = torch.tensor([1.0 if reason else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return reason or ("another rank stopped" if flag.item() > 0 else None)


def _train(spec, data_dir, manifest, device, dist, metrics, stop: StopSignal,
           injector: faults.Injector | None = None) -> list[dict]:
    injector = injector or faults.Injector([])
    set_seed(spec.seed)
    task = manifest["task"]
    load_started = time.perf_counter()
    train_split = data.load_split(data_dir, "train", manifest, spec.data_source)
    eval_split = data.load_split(data_dir, "eval", manifest)
    built = modeling.build_model(spec, num_labels=len(manifest["label_names"] or []) or None, device=device,
                                 pad_token_id=manifest["pad_token_id"])
    bare = built.model
    metrics.update(trainable_params=built.trainable_params, total_params=built.total_params)
    metrics["load_time_s"] = time.perf_counter() - load_started
    if spec.auto_batch_size:
        # Measure at the largest batch that fits: from here on the run is that batch's run.
        # fork_rng: the trials' random numbers (dropout) are given back, so training starts as without them.
        with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
            found = _auto_batch_size(spec, bare, train_split, task, manifest["pad_token_id"], device, dist, metrics, injector)
        spec = spec.replace(batch_size=found)
        metrics["batch_size"] = found
    model = _wrap_model(bare, spec, device, dist)
    metrics.update(memory_estimate.estimate(bare, spec, task, getattr(bare.config, "vocab_size", None)))
    shape = flops.ModelShape.of(bare)
    full_finetune = spec.method == "full"

    devices = spec.devices
    accum = spec.grad_accum_steps
    total_steps = spec.planned_steps(len(train_split))
    if spec.warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({spec.warmup_steps}) must be smaller than the run's {total_steps} steps")
    optimizer = make_optimizer(spec, model, device)
    scheduler = make_scheduler(optimizer, spec, total_steps)
    autocast = dict(device_type=device.type, dtype=modeling.DTYPES[spec.precision], enabled=spec.precision != "fp32")
    # GradScaler keeps small fp16 gradients from flushing to zero; bf16 has fp32's range and needs none.
    scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
    pad_id = manifest["pad_token_id"]
    if dist.rank == 0:
        metrics.update(_count_flops(bare, train_split, spec, task, pad_id, device, autocast, shape, full_finetune))
    # This process's share of each global micro-batch: DataParallel takes all of it, a DDP rank a slice.
    share = spec.batch_size * (devices // dist.world_size)
    order = batch_order(len(train_split), spec.batch_size * devices, total_steps * accum, spec.seed)

    # The GPUs this process drives: all of a DataParallel run's, else its own. Touching any other GPU
    # would open a CUDA context there, memory that the rank owning that GPU would then see in NVML.
    local_gpus = [] if device.type != "cuda" else list(range(devices)) if spec.parallel == "dp" else [device.index]
    for index in local_gpus:
        torch.cuda.reset_peak_memory_stats(index)
    sampler = gpu_monitor.GpuSampler(local_gpus, spec.gpu_sample_interval_s)
    steps: list[dict] = []
    skipped_steps = 0
    window_start = window_end = None
    model.train()
    train_started = time.perf_counter()
    synchronize(device)
    step_start = time.perf_counter()
    for step in range(total_steps):
        if step == spec.warmup_steps:
            window_start = step_start
            sampler.start()
        stop_reason = _stop_reason(stop, steps[-1]["step_time_s"] if steps else 0.0, dist, device)
        if stop_reason:
            metrics.update(status="timeout", status_reason=f"{stop_reason} at step {step} of {total_steps}")
            break
        metrics["last_step"] = step  # kept current so an OOM or a stop says how far the run got
        record = {"step": step, "measured": step >= spec.warmup_steps, "samples": 0, "tokens": 0,
                  "padded_tokens": 0, "flops": 0, "loader_s": 0.0}
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            fetch_start = time.perf_counter()
            indices = next(order)[dist.rank * share : (dist.rank + 1) * share]
            batch = batching.collate(task, train_split, indices, pad_id).to(device)
            record["loader_s"] += time.perf_counter() - fetch_start
            record["flops"] += flops.step_flops(shape, full_finetune, batch.real_tokens, batch.sum_squared_lengths,
                                                batch.target_tokens, batch.target_sum_squared_lengths)
            if injector:
                if micro == 0:
                    injector.before_step(step)
                injector.check_batch(spec.batch_size)
            # Gradients are all-reduced only on the last micro-batch of a step.
            no_sync = model.no_sync() if dist.active and micro < accum - 1 else contextlib.nullcontext()
            with no_sync:
                with torch.autocast(**autocast):
                    # Only the loss is kept: holding the whole output would keep the logits (batch x S x
                    # vocab) alive through backward, memory a usual training loop frees at this point.
                    loss = model(**batch.inputs).loss.mean() / accum  # mean: DataParallel returns one loss per GPU
                if injector:
                    loss = injector.loss(step, loss)
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
            record["samples"] += batch.samples
            record["tokens"] += batch.real_tokens
            record["padded_tokens"] += batch.padded_tokens
        loss_value = loss_sum.item()  # synchronises; needed to stop before a NaN reaches the weights
        if not math.isfinite(loss_value):
            metrics.update(status="diverged", status_reason=f"loss became {loss_value} at step {step}", diverged_step=step)
            optimizer.zero_grad(set_to_none=True)
            break
        if scaler_step(scaler, optimizer):
            skipped_steps += 1
        record["lr"] = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        step_end = time.perf_counter()
        record.update(step_time_s=step_end - step_start, loss=loss_value)
        steps.append(record)
        window_end = step_end
        step_start = step_end

    metrics.update(sampler.stop())
    metrics["train_time_s"] = time.perf_counter() - train_started
    # fp16 only (no scaler otherwise): steps the GradScaler skipped for inf/NaN gradients. They count as
    # steps (timed, tokens counted) but did not update the weights.
    metrics["grad_scaler_skipped_steps"] = skipped_steps if scaler.is_enabled() else None
    metrics.update(total_steps=total_steps, warmup_steps=spec.warmup_steps, grad_accum_steps=accum)
    window_s = (window_end - window_start) if window_start is not None and window_end is not None else None
    metrics["window_s"] = window_s
    # This process's counts; a DDP launcher sums ranks (launch.merge_ranks) and recomputes the summary.
    metrics.update(summarise(steps, window_s, devices if dist.world_size == 1 else 1))
    if not dist.active:
        metrics.update(derive_efficiency(metrics, spec, devices))
    if steps:
        metrics["final_train_loss"] = steps[-1]["loss"]
        metrics["first_step_s"] = steps[0]["step_time_s"]
        if spec.compile and metrics.get("step_time_median_s"):
            # Compilation happens inside the first step; its excess over a normal step estimates it.
            metrics["compile_time_s"] = max(0.0, steps[0]["step_time_s"] - metrics["step_time_median_s"])
    if local_gpus:
        metrics["peak_memory_allocated_mb"] = max(torch.cuda.max_memory_allocated(i) for i in local_gpus) / 2**20
        metrics["peak_memory_reserved_mb"] = max(torch.cuda.max_memory_reserved(i) for i in local_gpus) / 2**20

    if metrics["status"] == "ok" and dist.rank == 0:
        eval_started = time.perf_counter()
        metrics.update(evaluate(_unwrap(model), eval_split, spec, task, device, pad_id))
        metrics["eval_time_s"] = time.perf_counter() - eval_started
    return steps


def _count_flops(bare, split, spec, task, pad_id, device, autocast, shape, full_finetune) -> dict:
    """torch.utils.flop_counter on one micro-batch, beside the analytic count for the same (padded)
    batch: the counter sees padded shapes, and checkpointing's recomputed forward."""
    indices = np.arange(min(spec.batch_size, len(split)))
    batch = batching.collate(task, split, indices, pad_id).to(device)
    # The counter sees padded shapes: count the analytic FLOPs at padded lengths too.
    inputs_len = batch.inputs["input_ids"].shape[1]
    targets_len = batch.inputs["labels"].shape[1] if task == "seq2seq" else 0
    n = batch.samples
    try:
        counted = flops.counted_flops(bare, batch.inputs, autocast)
    except Exception as exc:  # noqa: BLE001 - the counter is a cross-check; a gap in it must not end the run
        # Seen: torch 2.11's sdpa counter rejects grouped-query attention (fewer KV heads than heads).
        bare.zero_grad(set_to_none=True)
        return {"flops_counted_microbatch": None, "flops_counted_error": f"{type(exc).__name__}: {exc}"[:200]}
    analytic = flops.step_flops(shape, full_finetune, n * (inputs_len + targets_len), n * inputs_len**2,
                                n * targets_len, n * targets_len**2)
    return {
        "flops_counted_microbatch": counted,
        "flops_analytic_microbatch": analytic,
        "flops_counted_ratio": counted / analytic if analytic else None,
    }


def _unwrap(model):
    """The plain model under torch.compile / DataParallel / DDP wrappers (evaluation runs on one device)."""
    model = getattr(model, "_orig_mod", model)
    while isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


@torch.no_grad()
def evaluate(model, split: batching.TokenisedSplit, spec: RunSpec, task: str, device: torch.device, pad_id: int) -> dict:
    model.eval()
    count = len(split) if spec.max_eval_samples is None else min(len(split), spec.max_eval_samples)
    scores = batching.EvalAccumulator(task)
    for start in range(0, count, spec.eval_batch_size):
        indices = np.arange(start, min(start + spec.eval_batch_size, count))
        batch = batching.collate(task, split, indices, pad_id).to(device)
        with torch.autocast(device.type, dtype=modeling.DTYPES[spec.precision], enabled=spec.precision != "fp32"):
            output = model(**batch.inputs)
        scores.add(output, batch)
    model.train()
    return {"eval_samples": count, **scores.result()}
