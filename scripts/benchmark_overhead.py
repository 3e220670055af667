"""How much does ftbench's measuring cost? Tokens/s of a run through ftbench vs a bare PyTorch loop.

All sides use the same model, batches, optimizer and precision, in the same process on the same
machine:
- bare: forward, backward, optimizer step; the device is synchronised only at the ends of the window.
- ftbench: trainer.train_run as a pipeline job runs it (a sync and loss read every step, per-step
  records, NVML sampling on a GPU).
- ftbench without NVML: the same, with the sampler given no GPU, isolating the sampler's cost.
Each trial runs the three sides once, in an order that rotates from trial to trial, so drift (clocks,
thermals, other load) and "who ran first" fall on every side alike; the ratios are taken within a
trial and summarised by their median over trials.

    python scripts/benchmark_overhead.py --config config/examples/llama-methods.yaml --run 0 \
        --batch-size 32 --steps 100 --warmup 10 --trials 6

Prints one line per trial, the median ratios and a verdict on each: the targets are ftbench / bare >= 0.97
and NVML sampling on / off >= 0.99. A verdict needs every trial on one side of the target, and the trials
either within 3% of each other or at least 5 of them. When the host's kernel launches are the bottleneck (a small model or batch),
trials of the same loop differ by more than the overhead being measured: run more trials, or raise
--batch-size until the GPU is busy; the script says "not resolved" rather than report a ratio it has not
settled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ftbench.tasks import registry
from ftbench.data import batch_order, prepared
from ftbench.measure import gpu_monitor
from ftbench.experiment import matrix
from ftbench.train import modeling, trainer
from ftbench.experiment import config as ftbench_config
from ftbench.train.devices import Distributed, choose_device, synchronize
from ftbench.train.optimizers import make_optimizer
from ftbench.runspec import RunSpec


def bare_loop(spec: RunSpec, data_dir: str, steps: int, warmup: int) -> float:
    manifest = prepared.verify(data_dir)
    split = registry.load_split(data_dir, "train", manifest)
    device, _ = choose_device(spec, Distributed())
    torch.manual_seed(spec.seed)
    model = modeling.build_model(spec, len(manifest["label_names"] or []) or None, device, manifest["pad_token_id"]).model
    if spec.compile:
        model = torch.compile(model)
    optimizer = make_optimizer(spec, model, device)
    autocast = dict(device_type=device.type, dtype=modeling.DTYPES[spec.precision], enabled=spec.precision != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=spec.precision == "fp16")
    order = batch_order.batch_order(len(split), spec.batch_size, warmup + steps, spec.seed)
    model.train()
    tokens = 0
    start = None
    for step, indices in enumerate(order):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
        batch = registry.family(manifest["task"]).collate(split, indices, manifest["pad_token_id"]).to(device)
        with torch.autocast(**autocast):
            loss = model(**batch.inputs).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            tokens += batch.real_tokens
    synchronize(device)
    return tokens / (time.perf_counter() - start)


def ftbench_loop(spec: RunSpec, data_dir: str, sampling: bool, samples_taken: list[int]) -> float:
    original = gpu_monitor.GpuSampler.__init__
    if not sampling:
        def no_gpus(self, cuda_indices, interval_s):
            original(self, [], interval_s)
        gpu_monitor.GpuSampler.__init__ = no_gpus
    try:
        metrics, _ = trainer.train_run(spec, data_dir)
    finally:
        gpu_monitor.GpuSampler.__init__ = original
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run ended with status {metrics['status']}: {metrics.get('status_reason')}")
    samples_taken.append(metrics["nvml_samples"])
    return metrics["tokens_per_s"]


# Trials of one ratio that span at most this agree: their verdict needs no more of them.
UNRESOLVED_SPREAD = 0.03
# The targets: ftbench within 3% of the bare loop (issue 30), the NVML sampling within 1% of none.
TARGETS = {"ftbench_over_bare": 0.97, "nvml_on_over_off": 0.99}
# Trials that scatter more settle a target only when there are enough of them, all on one side of it, that
# chance alone would rarely put them there: 5 (a sign test: 1 in 32 if each trial were a coin toss).
SIDE_TRIALS = 5


def verdict(values: list[float], target: float) -> str:
    """'meets' / 'misses' the target when every trial lies on that side of it, and the trials either agree
    within UNRESOLVED_SPREAD or number SIDE_TRIALS or more; else 'not resolved' (trials on both sides of the
    target are never settled, however close)."""
    enough = max(values) - min(values) <= UNRESOLVED_SPREAD or len(values) >= SIDE_TRIALS
    if enough and min(values) >= target:
        return "meets"
    if enough and max(values) < target:
        return "misses"
    return "not resolved"


def summarise_trials(trials: list[dict]) -> dict:
    """Median and range of each within-trial ratio, its verdict against its target, and whether both are settled."""
    summary: dict = {}
    for key, target in TARGETS.items():
        values = [trial[key] for trial in trials]
        summary[f"median_{key}"] = statistics.median(values)
        summary[f"range_{key}"] = [min(values), max(values)]
        summary[f"verdict_{key}"] = verdict(values, target)
    summary["resolved"] = all(summary[f"verdict_{key}"] != "not resolved" for key in TARGETS)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--run", type=int, default=0, help="index of the run in the expanded matrix")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per side and trial")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--sample-interval", type=float, help="override the run's gpu_sample_interval_s (seconds)")
    parser.add_argument("--batch-size", type=int, help="override the run's batch size (a larger one makes a small model GPU-bound)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    config = ftbench_config.load_config(args.config)
    spec = matrix.expand_runs(config)[args.run]
    spec = spec.replace(max_steps=args.warmup + args.steps, warmup_steps=args.warmup, epochs=None, max_eval_samples=1)
    if args.batch_size:
        spec = spec.replace(batch_size=args.batch_size)
    if args.sample_interval:
        spec = spec.replace(gpu_sample_interval_s=args.sample_interval)
    if spec.parallel != "single":
        raise SystemExit("the overhead benchmark compares single-device loops; pick a single run")
    with tempfile.TemporaryDirectory(prefix="ftbench-overhead-") as data_dir:
        registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data_dir)
        sides = {
            "bare": lambda: bare_loop(spec, data_dir, args.steps, args.warmup),
            "ftbench": lambda: ftbench_loop(spec, data_dir, sampling=True, samples_taken=nvml_samples),
            "ftbench_no_nvml": lambda: ftbench_loop(spec, data_dir, sampling=False, samples_taken=[]),
        }
        names = list(sides)
        nvml_samples: list[int] = []  # per ftbench trial: 0 means there was nothing to sample (no NVML)
        results = {"run_id": spec.run_id, "batch_size": spec.batch_size,
                   "gpu_sample_interval_s": spec.gpu_sample_interval_s, "steps": args.steps, "warmup": args.warmup, "trials": []}
        for trial in range(args.trials):
            order = names[trial % len(names):] + names[: trial % len(names)]
            speed = {name: sides[name]() for name in order}
            row = {f"{name}_tokens_per_s": speed[name] for name in names}
            row.update(order=order, nvml_samples=nvml_samples[-1], ftbench_over_bare=speed["ftbench"] / speed["bare"],
                       nvml_on_over_off=speed["ftbench"] / speed["ftbench_no_nvml"])
            results["trials"].append(row)
            print(f"trial {trial} ({' > '.join(order)}): bare {speed['bare']:,.0f} tok/s, ftbench {speed['ftbench']:,.0f} "
                  f"({row['ftbench_over_bare']:.3f}x), ftbench without NVML {speed['ftbench_no_nvml']:,.0f} "
                  f"(sampling on/off {row['nvml_on_over_off']:.3f}x)", flush=True)
    results.update(summarise_trials(results["trials"]))
    results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"{spec.run_id} at batch {spec.batch_size} on {results['device']}: " + "; ".join(
        f"{name} median {results[f'median_{key}']:.3f} (target >= {TARGETS[key]}, trials {results[f'range_{key}'][0]:.3f}-"
        f"{results[f'range_{key}'][1]:.3f}): {results[f'verdict_{key}']}"
        for key, name in (("ftbench_over_bare", "ftbench/bare"), ("nvml_on_over_off", "NVML sampling on/off"))))
    if not results["resolved"]:
        print(f"not resolved: the trials of a ratio fall on both sides of its target, or span more than "
              f"{UNRESOLVED_SPREAD:.0%} and are fewer than {SIDE_TRIALS}; where the host is launch-bound: run more "
              "trials, or raise --batch-size until the GPU is busy")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
