"""One training run: a plain PyTorch loop with a warmup window and a measured window.

How the numbers are taken (so they can be trusted):
- the first ``warmup_steps`` optimizer steps (allocator growth, autotuning, torch.compile) are run but
  not measured;
- a warmup step ends with a device synchronisation; the measured window's steps wait for nothing (a sync per step
  would leave the GPU idle while the host launches the next step): each is timed on the device's own timeline
  (CUDA events), the window's two ends are synchronised, and its losses are read a step late (measure/step_clock.py);
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
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from ftbench.train import batch_size_search, evaluation, faults, fsdp, hf_engine, modeling, batching
from ftbench.train.progress import Progress
from ftbench.train.run_state import Run, StopSignal, set_seed, steps_and_peaks, training_order
from ftbench.tasks import registry
from ftbench.tasks.base import Batch, TokenisedSplit
from ftbench.data import batch_order, prepared
from ftbench.experiment import memory_plan
from ftbench.measure import environment, flops, gpu_monitor
from ftbench.measure.step_clock import LaggedLosses, StepClock
from ftbench.train.devices import Distributed, autocast_args, choose_device, local_gpus, synchronize
from ftbench.errors import UnsupportedConfiguration
from ftbench.experiment import feasibility
from ftbench.measure.metrics import Warmup, energy_per_token, image_throughput, summarise
from ftbench.train.optimizers import (make_grad_scaler, make_optimizer, make_scheduler, scaler_step, skip_update_if,
                                      skips_non_finite_on_device)
from ftbench.runspec import RunSpec


def train_run(spec: RunSpec, data_dir: str | Path, stop: StopSignal | None = None,
              dist: Distributed | None = None) -> tuple[dict, list[dict]]:
    """Run one configuration (this process's part of it); return (metrics, step records).

    Expected failures become a status (unsupported, oom, diverged, timeout): the metrics then hold what
    the run had measured until it stopped. Unexpected exceptions propagate: the job fails with its
    traceback rather than writing a fake row.
    """
    stop = stop or StopSignal()
    dist = dist or Distributed()
    # Interpreter start and imports (a warm-started job: its client's start, the fork, any wait): what a cold
    # job on SLURM pays before anything of the run begins.
    startup_s = environment.process_age_s()
    loop_times: dict = {}  # when the training loop's first step started and its last step ended (overhead_s)
    metrics: dict = {"run_id": spec.run_id, "status": "ok", "status_reason": None, "startup_s": startup_s}
    steps: list[dict] = []
    run = None
    try:
        run, manifest = _prepare(spec, data_dir, stop, dist, metrics)
        steps = _measure(run, manifest, metrics, loop_times)
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
    metrics["wall_time_s"] = environment.process_age_s()  # the whole job: from its process start (imports included)
    if loop_times:
        # Process start to the first step, plus the last step to here less evaluation (a column of its own).
        now = time.perf_counter()
        metrics["overhead_s"] = (environment.process_age_s() - (now - loop_times["first"])
                                 + now - loop_times.get("last", loop_times["first"]) - (metrics.get("eval_time_s") or 0.0))
    metrics["warm_start"] = environment.job_started_at is not None
    metrics["warm_start_wait_s"] = environment.warm_start_wait_s
    metrics.setdefault("peak_rss_mb", evaluation.peak_rss_mb())
    return metrics, steps


def _prepare(spec: RunSpec, data_dir: str | Path, stop: StopSignal, dist: Distributed, metrics: dict) -> tuple[Run, dict]:
    """The run before its first step: its device, verified data, the model as built; (run, manifest)."""
    reason = feasibility.unsupported_reason(spec)  # the job asked first; a run trained without a job asks here
    if reason:
        raise UnsupportedConfiguration(reason)
    # Test-only fault injection (faults.py), read once per run; without FTBENCH_INJECT_FAULT it does nothing.
    injector = faults.Injector.from_env(spec.run_id, dist.rank)
    device, note = choose_device(spec, dist)
    metrics.update(status_reason=note, device=device.type,
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else environment.cpu_model(),
                   world_size=spec.devices if (device.type == "cuda" or dist.active) else 1)
    modeling.check_supported(spec, device)
    manifest = prepared.verify(data_dir)
    if device.type == "cuda":  # not launched to discover an OOM the estimate predicts (unless confirm_oom)
        reason = memory_plan.predicted_not_to_fit(spec, torch.cuda.get_device_properties(device).total_memory,
                                                  metrics["device_name"], data_dir, build=modeling.meta_model)
        if reason:
            raise torch.OutOfMemoryError(reason)
    metrics.update(prepared.data_columns(manifest))  # rows dropped: part of the result
    set_seed(spec.seed)
    load_started = time.perf_counter()
    train_split = registry.load_split(data_dir, "train", manifest, spec.data_source, spec)
    eval_split = registry.load_split(data_dir, "eval", manifest)
    built = modeling.build_model(spec, num_labels=len(manifest["label_names"] or []) or None,
                                 device=fsdp.build_device(spec, device), pad_token_id=manifest["pad_token_id"],
                                 vocab_size=manifest.get("vocab_size"))
    run = Run(spec, device, dist, stop, injector, manifest["task"], manifest["pad_token_id"], train_split,
              eval_split, built.model)
    if spec.packed:
        batching.check_isolation(built.model, device)
    metrics.update(trainable_params=built.trainable_params, total_params=built.total_params,
                   load_time_s=time.perf_counter() - load_started, **built.recipe_columns)
    return run, manifest


def _measure(run: Run, manifest: dict, metrics: dict, loop_times: dict) -> list[dict]:
    """Estimate, cross-check, train and evaluate the prepared run into ``metrics``; its step records."""
    if run.spec.auto_batch_size:
        _use_largest_batch(run, metrics)
    if run.spec.packed:  # the largest packed batch of the run sets its peak
        lengths = batching.lengths_of(run.train_split)
        manifest = {**manifest, "largest_packed_batch": batch_order.largest_packed_batch(run.spec, lengths)}
    elif registry.family(run.task).estimate_reads_longest_row:  # a padded batch is as long as its longest row
        manifest = {**manifest, "longest_row": int(batching.lengths_of(run.train_split).max(initial=0))}
    metrics.update(registry.family(run.task).memory_estimate(run.model, run.spec, manifest))
    shape = flops.ModelShape.of(run.model, registry.family(run.task).pooled_heads)
    # fsdp: every rank counts once sharded (_set_up_loop); a plain single-device run counts its first step.
    if run.dist.rank == 0 and run.spec.parallel != "fsdp" and not _counts_flops_in_first_step(run):
        metrics.update(_count_flops(run, shape, run.model))
    engine = hf_engine.train_steps if run.spec.engine == "hf_trainer" else train_steps
    # eval_every: evaluations between steps, the clock paused; the ranks stop at the target together.
    evals = evaluation.DuringTraining(run, evaluate, agree=lambda flag: _any_rank(run, flag))
    figures, steps = engine(run, shape, loop_times, evals)
    metrics.update(figures)
    metrics["peak_rss_mb"] = evals.training_peak_rss_mb()  # training's peak: evaluation's is kept apart
    # A sharded model evaluates on every rank (each forward all-gathers from all); rank 0's scores count.
    sharded = run.spec.parallel == "fsdp"
    if (metrics["status"] in evaluation.EVALUATED and not run.stop.terminate_requested
            and (run.dist.rank == 0 or sharded)):
        evaluation.evaluate_run(run, evaluate, metrics, may_stop_early=not sharded, steps_done=len(steps))
    return steps


def _use_largest_batch(run: Run, metrics: dict) -> None:
    """auto_batch_size: from here on the run is the run of the largest batch that fits."""
    # fork_rng: the trials' random numbers (dropout) are given back, so training starts as without them.
    with torch.random.fork_rng(devices=[run.device.index] if run.device.type == "cuda" else []):
        search = batch_size_search.find_largest_batch(run)
    metrics.update(search.figures())
    if search.found is None:
        raise torch.OutOfMemoryError(f"auto_batch_size: not even a batch of 1 per device fits (tried {search.trials})")
    run.spec = run.spec.replace(batch_size=search.found)
    metrics["batch_size"] = search.found


def _wrap_model(run: Run) -> torch.nn.Module:
    """The model as trained: DataParallel / DDP / FSDP / compiled as asked."""
    model, spec, device = run.model, run.spec, run.device
    if spec.parallel == "dp" and device.type == "cuda" and spec.devices > 1:
        model = torch.nn.DataParallel(model, device_ids=list(range(spec.devices)))
    if spec.parallel == "fsdp":
        model = fsdp.shard(model, spec, device)  # in place: run.model is the sharded model from here on
    elif run.dist.active:
        # gradient_as_bucket_view: the gradients are views into DDP's buckets, not a second fp32 copy beside them
        # at the end of the backward pass (measure/memory_estimate.py).
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                        gradient_as_bucket_view=True)
    if spec.compile:
        model = torch.compile(model)
    return model


def _any_rank(run: Run, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: DDP ranks must begin the measured window, and stop, at the same step."""
    if not run.dist.active:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=run.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return value.item() > 0


def _stop_reason(run: Run, typical_step_s: float) -> str | None:
    """Every rank must stop at the same step, or the others would wait forever in the next all-reduce."""
    reason = run.stop.reason(typical_step_s)
    stopping = _any_rank(run, reason is not None)
    return reason or ("another rank stopped" if stopping else None)


@dataclass
class _Loop:
    """What the loop's steps use: the wrapped model, its optimizer and schedule, the batch order."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object
    autocast: dict
    order: object  # iterator over the global batches of every micro-step
    share: int  # this process's share of each global micro-batch: DataParallel takes all, a DDP rank a slice
    total_steps: int
    local_gpus: list[int]  # the GPUs this process drives (peaks, sampling)
    flop_check: dict  # the FLOP cross-check where the loop takes it (fsdp; the first step: _counts_flops_in_first_step)
    count_first_microbatch: bool  # count the FLOPs of the first step's first micro-batch as it trains
    skip_on_device: bool  # the optimizer skips a non-finite loss's update itself (optimizers.skips_non_finite_on_device)
    progress: Progress  # the job's progress line in its log (train/progress.py)


def train_steps(run: Run, shape: flops.ModelShape, loop_times: dict | None = None,
                evals: evaluation.DuringTraining | None = None) -> tuple[dict, list[dict]]:
    """ftbench's training loop: (its figures, step records). A stop (deadline, divergence) is a status in
    the figures; an out-of-memory error propagates, with ``run.last_step`` saying where. ``evals``: the
    evaluations between steps (eval_every; none without it)."""
    spec, device, dist = run.spec, run.device, run.dist
    loop_times = {} if loop_times is None else loop_times
    evals = evals or evaluation.DuringTraining(run, evaluate, agree=lambda flag: _any_rank(run, flag))
    loop = _set_up_loop(run, shape)
    warmup = Warmup.of(spec, loop.total_steps)
    sampler = gpu_monitor.GpuSampler(loop.local_gpus, spec.gpu_sample_interval_s)
    evals.measure_with(sampler)  # evaluations inside the window pause the sampler with the clock
    loop.model.train()
    train_started = time.perf_counter()
    synchronize(device)
    try:
        figures, steps, window = _take_steps(run, loop, shape, warmup, sampler, loop_times, evals)
    except BaseException:
        sampler.close()  # an OOM or a stop on the way out: the sampler process ends with the window
        raise
    figures.update(sampler.stop())
    figures.update(evals.figures())
    figures.update(loop.flop_check)
    # Training's own time: the evaluations between steps are eval_during_training_s, the one before them base_eval_time_s.
    figures["train_time_s"] = time.perf_counter() - train_started - evals.paused_s
    figures.update(total_steps=loop.total_steps, grad_accum_steps=spec.grad_accum_steps, **warmup.figures(len(steps)))
    window_s = (window[1] - window[0] - evals.paused_within(*window)) if window[0] is not None and window[1] is not None else None
    figures["window_s"] = window_s
    # This process's counts; a DDP launcher sums ranks (metrics.merge_ranks) and recomputes the summary.
    counted_devices = spec.devices if dist.world_size == 1 else 1
    figures.update(summarise(steps, window_s, counted_devices))
    figures.update(image_throughput(steps, window_s, counted_devices))
    if not dist.active:
        figures["energy_j_per_token"] = energy_per_token(figures)
    figures.update(steps_and_peaks(steps, figures, spec, loop.local_gpus))
    return figures, steps


def _set_up_loop(run: Run, shape: flops.ModelShape) -> _Loop:
    spec, device = run.spec, run.device
    total_steps = spec.planned_steps(len(run.train_split))
    if spec.warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({spec.warmup_steps}) must be smaller than the run's {total_steps} steps")
    model = _wrap_model(run)
    # A sharded model's forward and backward need every rank (all-gathers, reduce-scatters): each counts
    # one micro-batch on it, before the peaks are reset. The gathered parameters are whole at compute time,
    # so the counter sees the same matmuls as on one device.
    flop_check = _count_flops(run, shape, model) if spec.parallel == "fsdp" else {}
    count_first_microbatch = _counts_flops_in_first_step(run)
    if count_first_microbatch:  # replaced by the count once the first step has run
        flop_check = {"flops_counted_microbatch": None, "flops_counted_error": "the run took no training step"}
    optimizer = make_optimizer(spec, model, device)
    scaler = make_grad_scaler(spec, device)
    gpus = local_gpus(spec, device)
    for index in gpus:
        torch.cuda.reset_peak_memory_stats(index)
    return _Loop(model, optimizer, make_scheduler(optimizer, spec, total_steps), scaler,
                 autocast_args(device, spec.precision), training_order(run.spec, run.train_split, total_steps),
                 spec.batch_size * (spec.devices // run.dist.world_size), total_steps, gpus, flop_check,
                 count_first_microbatch, skips_non_finite_on_device(optimizer, scaler, spec.parallel),
                 Progress(total_steps, run.dist.world_size, run.stop.deadline, enabled=run.dist.rank == 0))


def _take_steps(run: Run, loop: _Loop, shape: flops.ModelShape, warmup: Warmup, sampler, loop_times: dict,
                evals: evaluation.DuringTraining):
    """The optimizer steps until done or stopped: (figures, step records, (window start, window end)).
    Evaluations due before a step (``evals``) pause the clock: the step's time starts after them. A warmup step
    ends with a synchronisation (its time decides when the window begins); the window's steps wait for nothing:
    their times and losses are read when it is over (measure/step_clock.py)."""
    figures: dict = {"grad_scaler_skipped_steps": 0 if loop.scaler.is_enabled() else None}
    steps: list[dict] = []
    window_start = None
    clock, losses = StepClock(run.device), LaggedLosses(run.device, loop.total_steps)
    step_start = loop_times["first"] = time.perf_counter()
    upcoming = _next_batch(run, loop)
    for step in range(loop.total_steps):
        measured = window_start is not None
        if evals.due(step, loop.total_steps):
            if _previous_step_diverged(run, loop, figures, losses, steps):
                break  # not an evaluation (nor a stop at target) of a run that has diverged
            # In the window the last step may still be running: the pause begins when the device finished it.
            if evals.pause(step, may_stop=measured, since=clock.host_time_of() if measured else step_start):
                figures["stopped_at_target"] = True
                break
            step_start = evals.resumed
            if measured:
                clock.start(step_start)  # the evaluation's time belongs to no step
        if not measured and warmup.window_begins(step, [s["step_time_s"] for s in steps],
                                                 agree=lambda flag: _any_rank(run, flag)):
            window_start, measured = step_start, True
            sampler.start()
            clock.start(step_start)
        stop_reason = _stop_reason(run, _recent_step_s(steps, warmup.used))
        if stop_reason:
            figures.update(status="timeout", status_reason=f"{stop_reason} at step {step} of {loop.total_steps}")
            break
        run.last_step = step
        record = _step_until_update(run, loop, shape, figures, losses, steps, upcoming, measured)
        if record is None:
            loop.optimizer.zero_grad(set_to_none=True)
            break
        record["lr"] = loop.scheduler.get_last_lr()[0]
        loop.scheduler.step()
        loop.optimizer.zero_grad(set_to_none=True)
        if step + 1 < loop.total_steps:  # collated while the GPU runs this update, as a DataLoader's workers would
            upcoming = _next_batch(run, loop)
        if measured:
            clock.boundary(step)
            # The host's time, ahead of the device's: for the deadline, and overhead_s should an OOM end the loop.
            step_end = loop_times["last"] = time.perf_counter()
        else:
            synchronize(run.device)
            step_end = loop_times["last"] = time.perf_counter()
            if loop.skip_on_device and _diverged(figures, losses.get(step), step):
                break
        record.update(step_time_s=step_end - step_start, loss=None if measured else losses.get(step))
        steps.append(record)
        loop.progress.step_done(step, record["tokens"], losses)
        step_start = step_end
    return figures, steps, _close_window(run, loop, figures, (clock, losses), steps, window_start, loop_times)


def _step_until_update(run: Run, loop: _Loop, shape: flops.ModelShape, figures: dict, losses: LaggedLosses,
                       steps: list[dict], upcoming: _PreparedBatch, measured: bool) -> dict | None:
    """One step's forward, backward and optimizer update: its record so far, or None where a loss read before the
    update is not finite (the run diverged; nothing was updated). An out-of-memory error in the window after a step
    whose loss, read a step late, is not finite, is that divergence: the optimizer skipped that step's update, and a
    loop reading each loss before its update would never have started this step."""
    try:
        record, loss = _forward_backward(run, loop, shape, run.last_step, upcoming, measured=measured)
    except torch.OutOfMemoryError:
        if _previous_step_diverged(run, loop, figures, losses, steps):
            return None
        raise
    losses.put(run.last_step, loss)
    if _diverged_before_update(run, loop, figures, losses, loss, steps):
        return None
    # fp16's GradScaler skipped the update (inf/NaN gradients): still a step (timed, tokens counted).
    if scaler_step(loop.scaler, loop.optimizer):
        figures["grad_scaler_skipped_steps"] += 1
    return record


def _diverged_before_update(run: Run, loop: _Loop, figures: dict, losses: LaggedLosses, loss: torch.Tensor,
                            steps: list[dict]) -> bool:
    """Whether to stop before this step's update. Where the optimizer can skip a non-finite loss's update on the
    device, it is told to, and in the window the previous step's loss is read (a step late: reading this step's
    would wait for it). Elsewhere this step's loss is read now, before its update reaches the weights (a sync)."""
    if not loop.skip_on_device:
        return _diverged(figures, loss.item(), run.last_step)
    skip_update_if(loop.optimizer, loss)
    return _previous_step_diverged(run, loop, figures, losses, steps)


def _previous_step_diverged(run: Run, loop: _Loop, figures: dict, losses: LaggedLosses, steps: list[dict]) -> bool:
    """Where the optimizer skips a non-finite loss's update on the device: whether the last step recorded, if it was
    measured (a warmup step's loss was read before its update), had one. If so its update was skipped, its record is
    dropped, and the run stops there. Outside the window the answer is always no, so callers need not ask first."""
    previous = steps[-1] if steps else None
    if not (loop.skip_on_device and previous is not None and previous["measured"]):
        return False
    if not _diverged(figures, losses.get(previous["step"]), previous["step"]):
        return False
    steps.pop()
    run.last_step = previous["step"]
    return True


def _recent_step_s(steps: list[dict], warmup_steps: int | None) -> float:
    """The time a step takes, for the deadline's estimate: the last step's, or the last warmup step's where that is
    longer (``warmup_steps``: how many the window began after, None before it begins). In the window a step's time is
    the host's until the window ends, which in a GPU-bound run is its launch time alone for the first step after the
    window begins or an evaluation (nothing had made the host wait yet). Records before the window are one per step,
    so the last warmup step's is found by its index: this runs before every step."""
    if not steps:
        return 0.0
    last_warmup_s = steps[warmup_steps - 1]["step_time_s"] if warmup_steps else 0.0
    return max(steps[-1]["step_time_s"], last_warmup_s)


def _close_window(run: Run, loop: _Loop, figures: dict, timing: tuple[StepClock, LaggedLosses], steps: list[dict],
                  window_start: float | None, loop_times: dict) -> tuple[float | None, float | None]:
    """The measured window once the loop is over: the device synchronised, the last step's loss checked, each
    measured step's time and loss read; (window start, window end) on the host's clock, the end being when the
    device finished the last step kept (not what the loop queued after it: a diverged step, a stop)."""
    if window_start is None:
        return None, loop_times.get("last")
    clock, losses = timing
    synchronize(run.device)
    if figures.get("status") != "diverged":
        _previous_step_diverged(run, loop, figures, losses, steps)  # the last step's loss, not read yet
    last = steps[-1] if steps and steps[-1]["measured"] else None
    seconds = clock.step_seconds()
    for record in steps:
        if record["measured"]:
            record.update(step_time_s=seconds[record["step"]], loss=losses.get(record["step"]))
    window_end = window_start if last is None else clock.host_time_of(last["step"])
    loop_times["last"] = window_end
    return window_start, window_end


def _diverged(figures: dict, loss_value: float, step: int) -> bool:
    """Whether the step's loss is NaN or infinite; if so, the run's status says so."""
    if math.isfinite(loss_value):
        return False
    figures.update(status="diverged", status_reason=f"loss became {loss_value} at step {step}", diverged_step=step)
    return True


@dataclass
class _PreparedBatch:
    batch: Batch  # on the run's device
    loader_s: float  # host seconds taken to collate it and start its copy to the device


def _next_batch(run: Run, loop: _Loop) -> _PreparedBatch:
    """This process's share of the next global micro-batch, collated and on its way to the device."""
    started = time.perf_counter()
    indices = next(loop.order)[run.dist.rank * loop.share : (run.dist.rank + 1) * loop.share]
    batch = batching.collate(run.task, run.train_split, indices, run.pad_id, run.spec.batching, run.spec.seq_len).to(run.device)
    return _PreparedBatch(batch, time.perf_counter() - started)


def _forward_backward(run: Run, loop: _Loop, shape: flops.ModelShape, step: int, first: _PreparedBatch,
                      measured: bool) -> tuple[dict, torch.Tensor]:
    """One optimizer step's micro-batches, forward and backward: (the step's record so far, its loss on the
    device: nothing here waits for the GPU). ``first`` was prepared during the previous step; the others are
    collated while the GPU runs the micro-batch before."""
    spec, dist, injector = run.spec, run.dist, run.injector
    accum = spec.grad_accum_steps
    record = {"step": step, "measured": measured, "samples": 0, "tokens": 0,
              "padded_tokens": 0, "capacity_tokens": 0, "flops": 0, "loader_s": 0.0}
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(accum):
        prepared_batch = first if micro == 0 else _next_batch(run, loop)
        batch = prepared_batch.batch
        record["loader_s"] += prepared_batch.loader_s
        record["flops"] += flops.batch_flops(shape, spec.method == "full", batch)
        if injector:
            if micro == 0:
                injector.before_step(step)
            injector.check_batch(spec.batch_size)
        # DDP all-reduces gradients only on the last micro-batch of a step. FSDP reduce-scatters every
        # micro-batch's: skipping it would keep whole unsharded gradients, the memory fsdp saves.
        ddp_accumulating = spec.parallel == "ddp" and dist.active and micro < accum - 1
        tally = flops.new_tally() if loop.count_first_microbatch and step == 0 and micro == 0 else None
        with loop.model.no_sync() if ddp_accumulating else contextlib.nullcontext(), tally or contextlib.nullcontext():
            with torch.autocast(**loop.autocast):
                # Only the loss is kept: holding the whole output would keep the logits (batch x S x
                # vocab) alive through backward, memory a usual training loop frees at this point.
                loss = loop.model(**batch.inputs).loss.mean() / accum  # mean: DataParallel returns one loss per GPU
            if injector:
                loss = injector.loss(step, loss)
            loop.scaler.scale(loss).backward()
        if tally:
            loop.flop_check = _flop_check(run, shape, batch, tally.total, count_time_s=None)
        loss_sum += loss.detach()
        _count_batch(record, batch)
    return record, loss_sum


def _count_batch(record: dict, batch: Batch) -> None:
    record["samples"] += batch.samples
    if batch.images:
        record["images"] = record.get("images", 0) + batch.images
        record["image_tokens"] = record.get("image_tokens", 0) + batch.image_tokens
    record["tokens"] += batch.real_tokens
    record["padded_tokens"] += batch.padded_tokens
    record["capacity_tokens"] += batch.capacity_tokens
    if batch.trained_tokens:
        record["trained_tokens"] = record.get("trained_tokens", 0) + batch.trained_tokens


def _counts_flops_in_first_step(run: Run) -> bool:
    """Whether the FLOP cross-check counts the first step's first micro-batch as it trains, instead of a forward
    and backward pass of its own before training (0.8-1.5 s of a short job's overhead on an H100): where what
    trains is what the counter should see, on one device (a DataParallel replica runs in a thread the counter
    does not see; DDP and FSDP synchronise ranks), eager (a compiled graph runs kernels the counter cannot see),
    with nothing recomputed (checkpointing: model FLOPs, not hardware FLOPs), padded batches (the analytic count's
    attention is over padded rows, not a packed batch's segments), and where the first step is not timed (the
    counter slows the step it counts)."""
    spec = run.spec
    return (spec.parallel == "single" and not run.dist.active and spec.engine != "hf_trainer" and not spec.compile
            and not spec.packed and spec.warmup_steps >= 1 and not flops.checkpointed_modules(run.model))


def _count_flops(run: Run, shape: flops.ModelShape, model: torch.nn.Module) -> dict:
    """torch.utils.flop_counter on one micro-batch through ``model``, a pass of its own, beside the analytic count
    for the same (padded) batch. Checkpointing is switched off for the count (model FLOPs, not the recomputed
    forward), so a checkpointed run counts one sample: its batch may fit only with checkpointing on."""
    spec, split = run.spec, run.train_split
    indices = np.arange(min(1 if flops.checkpointed_modules(model) else spec.batch_size, len(split)))
    batch = registry.family(run.task).collate(split, indices, run.pad_id).to(run.device)
    started = time.perf_counter()
    try:
        counted = flops.counted_flops(model, batch.inputs, autocast_args(run.device, spec.precision))
    except Exception as exc:  # noqa: BLE001 - the counter is a cross-check; a gap in it must not end the run
        # Seen before flops.attention_flop_formulas: torch 2.11's SDPA formula rejected grouped-query attention.
        model.zero_grad(set_to_none=True)
        return {"flops_counted_microbatch": None, "flops_counted_error": f"{type(exc).__name__}: {exc}"[:200]}
    return _flop_check(run, shape, batch, counted, count_time_s=time.perf_counter() - started)


def _flop_check(run: Run, shape: flops.ModelShape, batch: Batch, counted: int, count_time_s: float | None) -> dict:
    """The counted FLOPs of ``batch`` beside the analytic count for the same batch at its padded lengths (the
    counter sees padded shapes)."""
    inputs_len = batch.inputs["input_ids"].shape[1] if "input_ids" in batch.inputs else batch.padded_tokens // batch.samples
    family = registry.family(run.task)
    targets_len = batch.inputs["labels"].shape[1] if family.separate_targets else 0
    n = batch.samples
    # Images beside text (a dual encoder's pairs): their tokens too, all of one length.
    pictures = batch.image_tokens if family.images_beside_text else 0  # a LLaVA has them in input_ids
    analytic = flops.step_flops(shape, run.spec.method == "full", n * (inputs_len + targets_len) + pictures,
                                n * inputs_len**2 + pictures * (pictures // n), n * targets_len, n * targets_len**2,
                                batch.image_tokens, batch.vision_tokens, batch.vision_sum_squared_lengths, batch.images, n)
    return {
        "flops_counted_microbatch": counted,
        "flops_analytic_microbatch": analytic,
        "flops_counted_ratio": counted / analytic if analytic else None,
        "flops_count_time_s": count_time_s,
    }


@torch.no_grad()
def evaluate(model, split: TokenisedSplit, spec: RunSpec, task: str, device: torch.device, pad_id: int,
             another_batch_fits=None, indices: np.ndarray | None = None) -> dict:
    """Scores on the eval split (evaluation.score: a seeded stratified sample of it when not all of it is scored:
    max_eval_samples, the rows at ``indices``, or an evaluation a time limit's ``another_batch_fits`` ends early);
    eval_samples counts the examples scored."""
    return evaluation.score(model, split, spec, task, device, pad_id, another_batch_fits, indices)
