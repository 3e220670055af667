"""engine: hf_trainer: the run's steps taken by transformers.Trainer, measured as ftbench's loop measures.

Most users measure fine-tuning through the Trainer (optimum-benchmark, LLaMA-Factory, axolotl do), and its
own throughput figures have known gaps. Here the Trainer trains and ftbench's instrumentation rides along
in a callback and a Trainer subclass:
- the step clock: the device synchronised at the start of training and at each step's end; a step lasts
  from the previous step's end to its own (batch fetching, clipping and the Trainer's own work included,
  as the loop's clock includes its batch fetching);
- the same warmup (metrics.Warmup, warmup_until_stable included) and measured window, NVML sampling over
  the window (paused, like the clock, for evaluations between steps), CUDA peak memory from the start of
  training, analytic FLOPs;
- real (unpadded) tokens counted from the batches: the data collator attaches each micro-batch's counts,
  training_step takes them off before the model sees the batch (counting at collation would be off by the
  dataloader's look-ahead);
- the same data order as the loop: the sampler is trainer.batch_order's, flattened.

What stays the Trainer's own, and is recorded (hf_* metrics): gradient clipping (max_grad_norm, 1.0 by
default; the loop does not clip), the optimizer and schedule by its names (adamw -> adamw_torch_fused on
CUDA, adamw_torch otherwise; linear schedule after lr_warmup_steps), dataloader workers, and its loss
normalisation over the accumulated micro-batches (by target tokens when the model accepts it).
Not supported yet (status unsupported): dp and ddp (the Trainer would wrap the model itself).
"""

from __future__ import annotations

import math
import tempfile
import time

import numpy as np
import torch

from ftbench.measure import flops, gpu_monitor
from ftbench.train import batching
from ftbench.train.devices import local_gpus, synchronize
from ftbench.train.progress import Progress
from ftbench.train.run_state import Run, steps_and_peaks, training_order
from ftbench.errors import UnsupportedConfiguration
from ftbench.measure.metrics import Warmup, energy_per_token, image_throughput, summarise

COUNTS_KEY = "ftbench_counts"  # the collator's per-micro-batch counts, taken off before the forward pass
OPTIMIZERS = {"adamw": "adamw_torch", "sgd": "sgd", "adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "paged_adamw_8bit"}


def trainer_settings(args) -> dict:
    """The Trainer's settings that change what is measured, as metrics (hf_* columns)."""
    optim = str(getattr(args.optim, "value", args.optim)) + (f" ({args.optim_args})" if args.optim_args else "")
    return {"hf_max_grad_norm": float(args.max_grad_norm), "hf_optim": optim,
            "hf_lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
            "hf_dataloader_workers": int(args.dataloader_num_workers)}


class Meter:
    """ftbench's step records, filled by the Trainer subclass (counts, loss) and the callback (clock)."""

    def __init__(self, run, shape: flops.ModelShape, total_steps: int, local_gpus: list[int]):
        self.run, self.shape = run, shape
        self.total_steps = total_steps
        self.warmup = Warmup.of(run.spec, total_steps)
        self.sampler = gpu_monitor.GpuSampler(local_gpus, run.spec.gpu_sample_interval_s)
        self.local_gpus = local_gpus
        self.steps: list[dict] = []
        self.pending = self._new_record(0, False)
        self.loss_sum = None
        self.loader_s = 0.0  # collation time not yet given to a step
        self.window_start = self.window_end = self.step_start = None
        self.train_started = None
        self.status: dict = {}
        self.skipped_steps = 0
        self.skip_flag = lambda: False  # fp16: whether the last optimizer step was skipped (set once the Trainer exists)
        self.evals = None  # evaluation.DuringTraining (eval_every), set by train_steps
        self.progress = Progress(total_steps, run.dist.world_size, run.stop.deadline, enabled=run.dist.rank == 0)

    def evaluate_if_due(self) -> bool:
        """eval_every: evaluate between steps with the clock paused (the next step starts after it); whether
        the run stops here, at the quality target."""
        done = len(self.steps)
        if self.evals is None or not self.evals.due(done, self.total_steps):
            return False
        stop = self.evals.pause(done, may_stop=self.window_start is not None, since=self.step_start)
        self.step_start = self.evals.resumed
        return stop

    def _new_record(self, step: int, measured: bool) -> dict:
        return {"step": step, "measured": measured, "samples": 0, "tokens": 0, "padded_tokens": 0, "capacity_tokens": 0,
                "flops": 0, "loader_s": 0.0}

    def collate(self, indices: list[int]) -> dict:
        started = time.perf_counter()
        spec = self.run.spec
        batch = batching.collate(self.run.task, self.run.train_split, np.asarray(indices), self.run.pad_id, spec.batching,
                                spec.seq_len)
        counts = {"samples": batch.samples, "tokens": batch.real_tokens, "padded_tokens": batch.padded_tokens,
                  "capacity_tokens": batch.capacity_tokens,
                  "flops": flops.batch_flops(self.shape, self.run.spec.method == "full", batch)}
        if batch.trained_tokens:
            counts["trained_tokens"] = batch.trained_tokens
        if batch.images:
            counts.update(images=batch.images, image_tokens=batch.image_tokens)
            # An image batch holds uint8 pixels that its ``to`` normalises; the Trainer moves tensors itself,
            # so they are normalised here, on the host, as a DataLoader of float pixels would give them.
            batch = batch.to("cpu")
        self.loader_s += time.perf_counter() - started
        return {**batch.inputs, COUNTS_KEY: counts}

    def micro_batch(self, counts: dict, loss: torch.Tensor) -> None:
        for key, value in counts.items():
            self.pending[key] = self.pending.get(key, 0) + value  # images: image runs only
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss

    def begin_window_if_due(self, now: float) -> None:
        step = len(self.steps)
        if self.warmup.window_begins(step, [s["step_time_s"] for s in self.steps]):
            self.window_start = now
            self.sampler.start()
        self.pending = self._new_record(step, self.window_start is not None)
        self.run.last_step = step


def make_callback(meter: Meter):
    from transformers import TrainerCallback

    class FtbenchCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            for index in meter.local_gpus:
                torch.cuda.reset_peak_memory_stats(index)
            meter.train_started = time.perf_counter()
            synchronize(meter.run.device)
            meter.step_start = time.perf_counter()
            meter.evaluate_if_due()  # eval_before_training / eval_every: the untrained model's score, before the first step
            meter.begin_window_if_due(meter.step_start)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            # .item() synchronises, as the loop's does: a NaN loss must not reach the weights.
            loss = meter.loss_sum.item() if meter.loss_sum is not None else float("nan")
            meter.pending["loss"] = loss
            meter.pending["lr"] = kwargs["lr_scheduler"].get_last_lr()[0]
            if not math.isfinite(loss):
                kwargs["model"].zero_grad(set_to_none=True)  # the optimizer skips parameters without gradients
                meter.status = {"status": "diverged", "status_reason": f"loss became {loss} at step {len(meter.steps)}",
                                "diverged_step": len(meter.steps)}
                control.should_training_stop = True

        def on_step_end(self, args, state, control, **kwargs):
            synchronize(meter.run.device)
            now = time.perf_counter()
            record = meter.pending
            record.update(step_time_s=now - meter.step_start, loader_s=meter.loader_s)
            meter.loader_s, meter.loss_sum = 0.0, None
            if meter.status:
                return  # the diverged step updated nothing: not a step of the run
            meter.steps.append(record)
            meter.progress.step_done(record["step"], record["tokens"], loss=record.get("loss"))
            if meter.skip_flag():
                meter.skipped_steps += 1
            meter.window_end = meter.step_start = now
            reason = meter.run.stop.reason(record["step_time_s"])
            if reason and len(meter.steps) < meter.total_steps:
                meter.status = {"status": "timeout", "status_reason": f"{reason} at step {len(meter.steps)} of {meter.total_steps}"}
                control.should_training_stop = True
                return
            if meter.evaluate_if_due():
                meter.status = {"stopped_at_target": True}
                control.should_training_stop = True
                return
            meter.begin_window_if_due(meter.step_start)

    return FtbenchCallback()


def train_steps(run: Run, shape: flops.ModelShape, loop_times: dict | None = None, evals=None) -> tuple[dict, list[dict]]:
    """The run's training through transformers.Trainer: (figures, step records) as trainer.train_steps gives.
    ``loop_times`` (the loop's first and last step, for overhead_s) is left empty: the Trainer's steps are
    timed by its callbacks, not at the loop's edges. ``evals``: evaluation.DuringTraining (eval_every), run from
    the callback between steps with the step clock paused, as the loop does."""
    from transformers import Trainer

    spec, device = run.spec, run.device  # parallel 'single' only: experiment.feasibility refuses the others
    total_steps = spec.planned_steps(len(run.train_split))
    if spec.warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({spec.warmup_steps}) must be smaller than the run's {total_steps} steps")
    meter = Meter(run, shape, total_steps, local_gpus(spec, device))
    meter.evals = evals
    if evals is not None:
        evals.measure_with(meter.sampler)  # evaluations inside the window pause the sampler with the clock
    # The loop's order (its batching's), one index at a time: the Trainer's DataLoader batches it back into
    # the same batches.
    order = [int(i) for batch in training_order(run.spec, run.train_split, total_steps) for i in batch]

    class MeasuredTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return order

        def training_step(self, model, inputs, num_items_in_batch=None):
            counts = inputs.pop(COUNTS_KEY)
            loss = super().training_step(model, inputs, num_items_in_batch)
            meter.micro_batch(counts, loss.detach())
            return loss

    with tempfile.TemporaryDirectory(prefix="ftbench-hf-") as output_dir:
        args = _arguments(spec, total_steps, device, output_dir)
        if device.type == "cuda" and (args.n_gpu > 1 or args.device != device):
            # The Trainer takes cuda:0 and wraps every visible GPU in DataParallel: another run than this one.
            raise UnsupportedConfiguration(f"engine hf_trainer needs its one GPU alone visible (CUDA_VISIBLE_DEVICES); "
                                           f"it sees {args.n_gpu} and would train on {args.device}, not {device}")
        trainer = MeasuredTrainer(model=run.model, args=args, train_dataset=range(len(run.train_split)),
                                  data_collator=meter.collate, callbacks=[make_callback(meter)])
        meter.skip_flag = lambda: bool(getattr(trainer.accelerator, "optimizer_step_was_skipped", False))
        trainer.train()
    return _figures(meter, spec, args, total_steps), meter.steps


def _arguments(spec, total_steps: int, device: torch.device, output_dir: str):
    """TrainingArguments for the run: its batch, accumulation, steps, seed, optimizer, lr and precision;
    nothing saved, logged to services or evaluated."""
    from transformers import TrainingArguments

    optim = OPTIMIZERS[spec.optimizer]
    if optim == "adamw_torch" and device.type == "cuda":
        optim = "adamw_torch_fused"  # the loop's make_optimizer uses the fused kernel on a GPU too
    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=spec.batch_size, gradient_accumulation_steps=spec.grad_accum_steps,
        max_steps=total_steps, seed=spec.seed, learning_rate=spec.learning_rate, weight_decay=spec.weight_decay,
        optim=optim, optim_args="momentum=0.9" if optim == "sgd" else None,  # the loop's SGD has momentum 0.9
        lr_scheduler_type="linear", warmup_steps=spec.lr_warmup_steps, bf16=spec.precision == "bf16", fp16=spec.precision == "fp16", torch_compile=spec.compile,
        use_cpu=device.type == "cpu", report_to=[], save_strategy="no", eval_strategy="no", disable_tqdm=True,
        remove_unused_columns=False, label_names=["labels"],
    )


def _figures(meter: Meter, spec, args, total_steps: int) -> dict:
    steps = meter.steps
    figures = dict(meter.status)
    figures.update(meter.sampler.stop())
    figures.update(meter.evals.figures() if meter.evals else {})
    evaluating_s = meter.evals.paused_s if meter.evals else 0.0  # evaluations between steps, the base one included
    figures["train_time_s"] = time.perf_counter() - meter.train_started - evaluating_s if meter.train_started else None
    figures["grad_scaler_skipped_steps"] = meter.skipped_steps if spec.precision == "fp16" else None
    figures.update(total_steps=total_steps, grad_accum_steps=spec.grad_accum_steps, **meter.warmup.figures(len(steps)))
    window = (meter.window_start, meter.window_end)
    paused = meter.evals.paused_within(*window) if meter.evals else 0.0
    window_s = window[1] - window[0] - paused if None not in window else None
    figures["window_s"] = window_s
    figures.update(summarise(steps, window_s, 1))
    figures.update(image_throughput(steps, window_s, 1))
    figures["energy_j_per_token"] = energy_per_token(figures)
    figures.update(trainer_settings(args))

    figures.update(steps_and_peaks(steps, figures, spec, meter.local_gpus))
    return figures
