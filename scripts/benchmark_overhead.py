"""How much does ftbench's measuring cost? Tokens/s of a run through ftbench vs a bare PyTorch loop.

Both sides use the same model, batches, optimizer and precision, in the same process on the same
machine, alternating A/B so drift (clocks, thermals, other load) hits both equally:
- bare: forward, backward, optimizer step; the device is synchronised only at the ends of the window.
- ftbench: trainer.train_run as a pipeline job runs it (a sync and loss read every step, per-step
  records, NVML sampling on a GPU).
A third side runs ftbench with NVML sampling off, isolating the sampler's cost.

    python scripts/benchmark_overhead.py --config config/examples/llama-methods.yaml --run 0 --steps 30 --trials 3

Prints one line per trial and the median ratios; the target is ftbench / bare >= 0.98.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from ftbench import config as ftbench_config  # noqa: E402
from ftbench import data, gpu_monitor, matrix, modeling, tasks, trainer  # noqa: E402


def bare_loop(spec: dict, data_dir: str, steps: int, warmup: int) -> float:
    manifest = data.verify(data_dir)
    split = data.load_split(data_dir, "train", manifest)
    device, _ = trainer.choose_device(spec, trainer.Distributed())
    torch.manual_seed(spec["seed"])
    model = modeling.build_model(spec, len(manifest["label_names"] or []) or None, device, manifest["pad_token_id"]).model
    if spec["compile"]:
        model = torch.compile(model)
    optimizer = trainer.make_optimizer(spec, model, device)
    autocast = dict(device_type=device.type, dtype=modeling.DTYPES[spec["precision"]], enabled=spec["precision"] != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=spec["precision"] == "fp16")
    order = trainer.batch_order(len(split), spec["batch_size"], warmup + steps, spec["seed"])
    model.train()
    tokens = 0
    start = None
    for step, indices in enumerate(order):
        if step == warmup:
            trainer.synchronize(device)
            start = time.perf_counter()
        batch = tasks.collate(manifest["task"], split, indices, manifest["pad_token_id"]).to(device)
        with torch.autocast(**autocast):
            loss = model(**batch.inputs).loss
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            tokens += batch.real_tokens
    trainer.synchronize(device)
    return tokens / (time.perf_counter() - start)


def ftbench_loop(spec: dict, data_dir: str, sampling: bool) -> float:
    original = gpu_monitor.GpuSampler.__init__
    if not sampling:
        def no_gpus(self, cuda_indices, interval_s=0.1):
            original(self, [], interval_s)
        gpu_monitor.GpuSampler.__init__ = no_gpus
    try:
        metrics, _ = trainer.train_run(spec, data_dir)
    finally:
        gpu_monitor.GpuSampler.__init__ = original
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run ended with status {metrics['status']}: {metrics.get('status_reason')}")
    return metrics["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--run", type=int, default=0, help="index of the run in the expanded matrix")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()

    config = ftbench_config.load_config(args.config)
    spec = dict(matrix.expand_runs(config)[args.run])
    spec.update(max_steps=args.warmup + args.steps, warmup_steps=args.warmup, epochs=None, max_eval_samples=1)
    if spec["parallel"] != "single":
        raise SystemExit("the overhead benchmark compares single-device loops; pick a single run")
    with tempfile.TemporaryDirectory(prefix="ftbench-overhead-") as data_dir:
        data.prepare(spec["dataset"], spec["dataset_def"], spec["model_def"], spec["seq_len"], data_dir)
        results = {"run_id": spec["run_id"], "trials": []}
        for trial in range(args.trials):
            bare = bare_loop(spec, data_dir, args.steps, args.warmup)
            full = ftbench_loop(spec, data_dir, sampling=True)
            unsampled = ftbench_loop(spec, data_dir, sampling=False)
            row = {"bare_tokens_per_s": bare, "ftbench_tokens_per_s": full, "ftbench_no_nvml_tokens_per_s": unsampled,
                   "ftbench_over_bare": full / bare, "nvml_on_over_off": full / unsampled}
            results["trials"].append(row)
            print(f"trial {trial}: bare {bare:,.0f} tok/s, ftbench {full:,.0f} ({full / bare:.3f}x), "
                  f"ftbench without NVML {unsampled:,.0f} (sampling on/off {full / unsampled:.3f}x)", flush=True)
    for key in ("ftbench_over_bare", "nvml_on_over_off"):
        results[f"median_{key}"] = statistics.median(t[key] for t in results["trials"])
    results["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"{spec['run_id']} on {results['device']}: median ftbench/bare = {results['median_ftbench_over_bare']:.3f} "
          f"(target >= 0.98); NVML sampling on/off = {results['median_nvml_on_over_off']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
