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
``ddp.py``), ``fsdp`` (FSDP2, launched like ddp; see ``fsdp.py``). ``batch_size`` is always per device, so the global batch is batch_size x devices.
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ftbench.train import batch_size_search, evaluation, faults, fsdp, modeling, packing
from ftbench.tasks import batching, registry
from ftbench.data import prepared
from ftbench.measure import environment, flops, gpu_monitor
from ftbench.cluster import warmstart
from ftbench.train.devices import Distributed, autocast_args, choose_device, synchronize
from ftbench.errors import UnsupportedConfiguration
from ftbench.measure.metrics import Warmup, energy_per_token, image_throughput, summarise
from ftbench.train.optimizers import make_grad_scaler, make_optimizer, make_scheduler, scaler_step
from ftbench.runspec import RunSpec


@dataclass
class StopSignal:
    """When the loop must stop early: a wall-clock deadline (the job's time limit minus a margin for
    evaluation and writing results) or a termination request (SIGTERM from the scheduler)."""

    deadline: float | None = None  # time.monotonic() value
    terminate_requested: bool = False
    # When the job's time limit ends it (time.monotonic()), and the seconds kept between the deadline and
    # then: evaluation and writing results happen there (evaluation.py).
    limit: float | None = None
    margin: float = 0.0

    def reason(self, typical_step_s: float) -> str | None:
        if self.terminate_requested:
            return "terminated by the scheduler (SIGTERM)"
        # Stop if another step might not finish before the deadline.
        if self.deadline is not None and time.monotonic() + 2 * typical_step_s >= self.deadline:
            return "stopped before the job's time limit"
        return None


@dataclass
class Run:
    """One run as this process trains it: its settings, where, on what data and model, and what may
    stop it early."""

    spec: RunSpec  # with auto_batch_size, its batch_size becomes the batch found
    device: torch.device
    dist: Distributed
    stop: StopSignal
    injector: faults.Injector
    task: str
    pad_id: int
    train_split: batching.TokenisedSplit | prepared.DiskSplit
    eval_split: batching.TokenisedSplit
    model: torch.nn.Module  # as built, before DataParallel / DDP / torch.compile wrap it
    last_step: int | None = None  # kept current so an OOM or a stop says how far the run got


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


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_run(spec: RunSpec, data_dir: str | Path, stop: StopSignal | None = None,
              dist: Distributed | None = None) -> tuple[dict, list[dict]]:
    """Run one configuration (this process's part of it); return (metrics, step records).

    Expected failures become a status (unsupported, oom, diverged, timeout): the metrics then hold what
    the run had measured until it stopped. Unexpected exceptions propagate: the job fails with its
    traceback rather than writing a fake row.
    """
    stop = stop or StopSignal()
    dist = dist or Distributed()
    started = time.perf_counter()
    loop: dict = {}  # when the training loop's first step started and its last step ended (overhead_s)
    metrics: dict = {"run_id": spec.run_id, "status": "ok", "status_reason": None}
    steps: list[dict] = []
    run = None
    # Test-only fault injection (faults.py), read once per run; without FTBENCH_INJECT_FAULT it does nothing.
    injector = faults.Injector.from_env(spec.run_id, dist.rank)
    try:
        device, note = choose_device(spec, dist)
        metrics.update(status_reason=note, device=device.type,
                       device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else environment.cpu_model(),
                       world_size=spec.devices if (device.type == "cuda" or dist.active) else 1)
        modeling.check_supported(spec, device)
        manifest = prepared.verify(data_dir)
        set_seed(spec.seed)
        load_started = time.perf_counter()
        train_split = registry.load_split(data_dir, "train", manifest, spec.data_source)
        eval_split = registry.load_split(data_dir, "eval", manifest)
        built = modeling.build_model(spec, num_labels=len(manifest["label_names"] or []) or None,
                                     device=fsdp.build_device(spec, device),
                                     pad_token_id=manifest["pad_token_id"])
        run = Run(spec, device, dist, stop, injector, manifest["task"], manifest["pad_token_id"], train_split,
                  eval_split, built.model)
        if spec.batching in packing.PACKED:
            packing.check_isolation(built.model, device)
        metrics.update(trainable_params=built.trainable_params, total_params=built.total_params,
                       load_time_s=time.perf_counter() - load_started)
        if spec.auto_batch_size:
            # Measure at the largest batch that fits: from here on the run is that batch's run.
            # fork_rng: the trials' random numbers (dropout) are given back, so training starts as without them.
            with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
                search = batch_size_search.find_largest_batch(run)
            metrics.update(search.figures())
            if search.found is None:
                raise torch.OutOfMemoryError(f"auto_batch_size: not even a batch of 1 per device fits (tried {search.trials})")
            run.spec = spec.replace(batch_size=search.found)
            metrics["batch_size"] = search.found
        metrics.update(registry.family(run.task).memory_estimate(run.model, run.spec, manifest))
        shape = flops.ModelShape.of(run.model)
        if dist.rank == 0 and spec.parallel == "fsdp":
            # The counter runs the whole model's forward and backward on one device: what fsdp avoids.
            metrics["flops_counted_error"] = "not counted under fsdp (the model is sharded over the ranks)"
        elif dist.rank == 0:
            metrics.update(_count_flops(run, shape))
        engine = _engine(run.spec)
        # ftbench's loop also notes its first and last step times, for overhead_s.
        figures, trained_steps = engine(run, shape, loop) if engine is _train else engine(run, shape)
        metrics.update(figures)
        metrics["peak_rss_mb"] = evaluation.peak_rss_mb()  # training's peak: evaluation's is kept apart
        # A sharded model evaluates on every rank (each forward all-gathers from all); rank 0's scores count.
        sharded = spec.parallel == "fsdp"
        if metrics["status"] in evaluation.EVALUATED and not stop.terminate_requested and (dist.rank == 0 or sharded):
            evaluation.evaluate_run(run, evaluate, metrics, may_stop_early=not sharded)
        steps = trained_steps
    except UnsupportedConfiguration as exc:
        metrics.update(status="unsupported", status_reason=str(exc))
    except torch.OutOfMemoryError as exc:
        metrics.update(status="oom", status_reason=" ".join(str(exc).split())[:300])
        if torch.cuda.is_available():
            # The high-water mark reached before the failed allocation: how far over the run was.
            metrics["peak_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
            metrics["peak_memory_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    if run is not None and run.last_step is not None:
        metrics["last_step"] = run.last_step
    metrics["wall_time_s"] = time.perf_counter() - started
    if loop:
        # Process start to the first step, plus the last step to here less evaluation (a column of its own).
        metrics["overhead_s"] = (environment.process_age_s() - (time.perf_counter() - loop["first"])
                                 + time.perf_counter() - loop.get("last", loop["first"]) - (metrics.get("eval_time_s") or 0.0))
    metrics["warm_start"] = warmstart.job_started_at is not None
    metrics.setdefault("peak_rss_mb", evaluation.peak_rss_mb())
    return metrics, steps


def _engine(spec: RunSpec):
    """What takes the steps: ftbench's loop, or transformers.Trainer with the same instrumentation (hf_engine.py)."""
    if spec.engine == "hf_trainer":
        from ftbench.train import hf_engine

        return hf_engine.train
    return _train


def _wrap_model(run: Run) -> torch.nn.Module:
    """The model as trained: DataParallel / DDP / FSDP / compiled as asked."""
    model, spec, device = run.model, run.spec, run.device
    if spec.parallel == "dp" and device.type == "cuda" and spec.devices > 1:
        model = torch.nn.DataParallel(model, device_ids=list(range(spec.devices)))
    if spec.parallel == "fsdp":
        model = fsdp.shard(model, spec, device)  # in place: run.model is the sharded model from here on
    elif run.dist.active:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if spec.compile:
        model = torch.compile(model)
    return model


def _stop_reason(run: Run, typical_step_s: float) -> str | None:
    """Every rank must stop at the same step, or the others would wait forever in the next all-reduce."""
    reason = run.stop.reason(typical_step_s)
    if not run.dist.active:
        return reason
    flag = torch.tensor([1.0 if reason else 0.0], device=run.device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return reason or ("another rank stopped" if flag.item() > 0 else None)


def _any_rank(run: Run, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: DDP ranks must begin the measured window at the same step."""
    if not run.dist.active:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=run.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return value.item() > 0


def _train(run: Run, shape: flops.ModelShape, loop: dict | None = None) -> tuple[dict, list[dict]]:
    """The training loop: (its figures, step records). A stop (deadline, divergence) is a status in the
    figures; an out-of-memory error propagates, with ``run.last_step`` saying where."""
    spec, device, dist, injector = run.spec, run.device, run.dist, run.injector
    model = _wrap_model(run)
    figures: dict = {}
    full_finetune = spec.method == "full"
    devices = spec.devices
    accum = spec.grad_accum_steps
    total_steps = spec.planned_steps(len(run.train_split))
    if spec.warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({spec.warmup_steps}) must be smaller than the run's {total_steps} steps")
    optimizer = make_optimizer(spec, model, device)
    scheduler = make_scheduler(optimizer, spec, total_steps)
    autocast = autocast_args(device, spec.precision)
    scaler = make_grad_scaler(spec, device)
    # This process's share of each global micro-batch: DataParallel takes all of it, a DDP rank a slice.
    share = spec.batch_size * (devices // dist.world_size)
    order = training_order(run, total_steps)
    warmup = Warmup.of(spec, total_steps)
    loop = {} if loop is None else loop

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
    step_start = loop["first"] = time.perf_counter()
    for step in range(total_steps):
        # Step times are gathered only while the window has not begun: nothing more on the measured steps.
        if window_start is None and warmup.window_begins(step, [s["step_time_s"] for s in steps],
                                                         agree=lambda flag: _any_rank(run, flag)):
            window_start = step_start
            sampler.start()
        stop_reason = _stop_reason(run, steps[-1]["step_time_s"] if steps else 0.0)
        if stop_reason:
            figures.update(status="timeout", status_reason=f"{stop_reason} at step {step} of {total_steps}")
            break
        run.last_step = step
        record = {"step": step, "measured": window_start is not None, "samples": 0, "tokens": 0,
                  "padded_tokens": 0, "capacity_tokens": 0, "flops": 0, "loader_s": 0.0}
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            fetch_start = time.perf_counter()
            indices = next(order)[dist.rank * share : (dist.rank + 1) * share]
            batch = packing.collate(run.task, run.train_split, indices, run.pad_id, spec.batching, spec.seq_len).to(device)
            record["loader_s"] += time.perf_counter() - fetch_start
            record["flops"] += flops.batch_flops(shape, full_finetune, batch)
            if injector:
                if micro == 0:
                    injector.before_step(step)
                injector.check_batch(spec.batch_size)
            # DDP all-reduces gradients only on the last micro-batch of a step. FSDP reduce-scatters every
            # micro-batch's: skipping it would keep whole unsharded gradients, the memory fsdp saves.
            ddp_accumulating = spec.parallel == "ddp" and dist.active and micro < accum - 1
            no_sync = model.no_sync() if ddp_accumulating else contextlib.nullcontext()
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
            if batch.images:
                record["images"] = record.get("images", 0) + batch.images
                record["image_tokens"] = record.get("image_tokens", 0) + batch.image_tokens
            record["tokens"] += batch.real_tokens
            record["padded_tokens"] += batch.padded_tokens
            record["capacity_tokens"] += batch.capacity_tokens
        loss_value = loss_sum.item()  # synchronises; needed to stop before a NaN reaches the weights
        if not math.isfinite(loss_value):
            figures.update(status="diverged", status_reason=f"loss became {loss_value} at step {step}", diverged_step=step)
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
        window_end = loop["last"] = step_end
        step_start = step_end

    figures.update(sampler.stop())
    figures["train_time_s"] = time.perf_counter() - train_started
    # fp16 only (no scaler otherwise): steps the GradScaler skipped for inf/NaN gradients. They count as
    # steps (timed, tokens counted) but did not update the weights.
    figures["grad_scaler_skipped_steps"] = skipped_steps if scaler.is_enabled() else None
    figures.update(total_steps=total_steps, grad_accum_steps=accum, **warmup.figures(len(steps)))
    window_s = (window_end - window_start) if window_start is not None and window_end is not None else None
    figures["window_s"] = window_s
    # This process's counts; a DDP launcher sums ranks (metrics.merge_ranks) and recomputes the summary.
    figures.update(summarise(steps, window_s, devices if dist.world_size == 1 else 1))
    figures.update(image_throughput(steps, window_s, devices if dist.world_size == 1 else 1))
    if not dist.active:
        figures["energy_j_per_token"] = energy_per_token(figures)
    figures.update(steps_and_peaks(steps, figures, spec, local_gpus))
    return figures, steps


def training_order(run: Run, total_steps: int):
    """The global batches of the run's micro-steps, as its ``batching`` draws them (both engines use it)."""
    spec = run.spec
    global_batch, count = spec.batch_size * spec.devices, total_steps * spec.grad_accum_steps
    if spec.batching == "group_by_length":
        return packing.grouped_order(packing.lengths_of(run.train_split), global_batch, count, spec.seed)
    return batch_order(len(run.train_split), global_batch, count, spec.seed)


def steps_and_peaks(steps: list[dict], figures: dict, spec: RunSpec, local_gpus: list[int]) -> dict:
    """What either engine reports from its step records and its GPUs once training ends: final loss, the
    first step, the compilation estimate, packing efficiency and the CUDA peaks."""
    result = {"packing_efficiency": packing.packing_efficiency(steps)}
    if steps:
        result["final_train_loss"] = steps[-1]["loss"]
        result["first_step_s"] = steps[0]["step_time_s"]
        if spec.compile and figures.get("step_time_median_s"):
            # Compilation happens inside the first step; its excess over a normal step estimates it.
            result["compile_time_s"] = max(0.0, steps[0]["step_time_s"] - figures["step_time_median_s"])
    if local_gpus:
        result["peak_memory_allocated_mb"] = max(torch.cuda.max_memory_allocated(i) for i in local_gpus) / 2**20
        result["peak_memory_reserved_mb"] = max(torch.cuda.max_memory_reserved(i) for i in local_gpus) / 2**20
    return result


def _count_flops(run: Run, shape: flops.ModelShape) -> dict:
    """torch.utils.flop_counter on one micro-batch, beside the analytic count for the same (padded)
    batch: the counter sees padded shapes, and checkpointing's recomputed forward."""
    spec, split = run.spec, run.train_split
    indices = np.arange(min(spec.batch_size, len(split)))
    batch = batching.collate(run.task, split, indices, run.pad_id).to(run.device)
    # The counter sees padded shapes: count the analytic FLOPs at padded lengths too.
    inputs_len = batch.inputs["input_ids"].shape[1] if "input_ids" in batch.inputs else batch.padded_tokens // batch.samples
    family = registry.family(run.task)
    targets_len = batch.inputs["labels"].shape[1] if family.separate_targets else 0
    n = batch.samples
    # Images beside text (a dual encoder's pairs): their tokens too, all of one length.
    pictures = batch.image_tokens if family.images_beside_text else 0  # a LLaVA has them in input_ids
    try:
        counted = flops.counted_flops(run.model, batch.inputs, autocast_args(run.device, spec.precision))
    except Exception as exc:  # noqa: BLE001 - the counter is a cross-check; a gap in it must not end the run
        # Seen before flops.attention_flop_formulas: torch 2.11's SDPA formula rejected grouped-query attention.
        run.model.zero_grad(set_to_none=True)
        return {"flops_counted_microbatch": None, "flops_counted_error": f"{type(exc).__name__}: {exc}"[:200]}
    analytic = flops.step_flops(shape, spec.method == "full", n * (inputs_len + targets_len) + pictures,
                                n * inputs_len**2 + pictures * (pictures // n), n * targets_len, n * targets_len**2,
                                batch.image_tokens, batch.vision_tokens, batch.vision_sum_squared_lengths, batch.images)
    return {
        "flops_counted_microbatch": counted,
        "flops_analytic_microbatch": analytic,
        "flops_counted_ratio": counted / analytic if analytic else None,
    }


@torch.no_grad()
def evaluate(model, split: batching.TokenisedSplit, spec: RunSpec, task: str, device: torch.device, pad_id: int,
             another_batch_fits=lambda: True) -> dict:
    """Scores on the eval split; ``another_batch_fits`` (asked before each batch) may end it early, and
    eval_samples counts the examples scored."""
    model.eval()
    count = len(split) if spec.max_eval_samples is None else min(len(split), spec.max_eval_samples)
    scores = batching.eval_accumulator(task)
    order = packing.eval_order(split, count)
    scored = 0
    for start in range(0, count, spec.eval_batch_size):
        if not another_batch_fits():
            break
        indices = order[start : start + spec.eval_batch_size]
        scored += len(indices)
        batch = batching.collate(task, split, indices, pad_id).to(device)
        with torch.autocast(**autocast_args(device, spec.precision)):
            output = model(**batch.inputs)
        scores.add(output, batch)
    model.train()
    return {"eval_samples": scored, "eval_samples_planned": count, **scores.result()}
