"""Does a train job's progress line (train/progress.py) cost tokens/s? The same run with the lines on and off.

Both sides are trainer.train_run as a pipeline job runs it, on the same model, batches and machine, in one process:
- on: a progress line after every step (``--every-s 0``, the default: the worst case, some hundreds of times denser
  than a job's line every 30 s), written to a file as a job's log is;
- off: no progress at all (Progress.step_done does nothing, not even its clock read).
Trials are mirrored as scripts/benchmark_overhead.py's are (on, off, off, on, the order's start rotating), and the
ratio on / off of the typical step's tokens/s is taken within each trial, then summarised over trials: geometric
mean with a 95% interval, median, range, and a verdict against 0.99 ("meets": the interval lies at or above it).
Then the harness's own cost, apart from the run's noise: microseconds per step with no line due, and per line.

    python scripts/benchmark_progress.py --batch-size 2 --steps 60 --warmup 5 --trials 10 --threads 1   # default config, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchmark_overhead import Speed, ftbench_loop, mirrored_trial, settle  # scripts/ is this script's folder

from ftbench.experiment import config as ftbench_config
from ftbench.experiment import matrix
from ftbench.measure.step_clock import LaggedLosses
from ftbench.tasks import registry
from ftbench.train import progress

TARGET = 0.99


def side(spec, data_dir: str, log: Path, every_s: float | None):
    """One pass of the run: progress lines every ``every_s`` seconds into ``log``, or none (None)."""
    def run() -> Speed:
        original_step_done, original_every = progress.Progress.step_done, progress.EVERY_S
        if every_s is None:
            progress.Progress.step_done = lambda self, step, tokens, losses=None: None
        else:
            progress.EVERY_S = every_s
        try:
            with open(log, "a", encoding="utf-8") as handle, contextlib.redirect_stdout(handle):
                return ftbench_loop(spec, data_dir, sampling=False, samples_taken=[])
        finally:
            progress.Progress.step_done, progress.EVERY_S = original_step_done, original_every
    return run


def call_costs(calls: int = 100_000) -> tuple[float, float]:
    """Seconds per step_done without a line due, and per line written (to a file, every call): the harness's own
    cost, apart from any run's noise."""
    losses = LaggedLosses(torch.device("cpu"), 1)
    losses.put(0, torch.tensor(0.5))
    quiet = progress.Progress(total_steps=10**9, every_s=float("inf"))
    quiet.next_at = float("inf")
    started = time.perf_counter()
    for _ in range(calls):
        quiet.step_done(0, 100, losses)
    per_step = (time.perf_counter() - started) / calls
    with tempfile.TemporaryFile("w") as handle:
        speaking = progress.Progress(total_steps=10**9, every_s=0.0, out=handle)
        started = time.perf_counter()
        for _ in range(calls // 10):
            speaking.step_done(0, 100, losses)
        per_line = (time.perf_counter() - started) / (calls // 10)
    return per_step, per_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--run", type=int, default=0, help="index of the run in the expanded matrix")
    parser.add_argument("--steps", type=int, default=40, help="measured steps per pass")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--batch-size", type=int, help="override the run's batch size")
    parser.add_argument("--threads", type=int, help="torch threads (a shared CPU is steadier with fewer)")
    parser.add_argument("--every-s", type=float, default=0.0, help="seconds between progress lines on the 'on' side "
                        "(0: after every step)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = matrix.expand_runs(ftbench_config.load_config(args.config))[args.run]
    spec = spec.replace(max_steps=args.warmup + args.steps, warmup_steps=args.warmup, epochs=None, max_eval_samples=1,
                        **({"batch_size": args.batch_size} if args.batch_size else {}))
    ratios, lines = [], 0
    with tempfile.TemporaryDirectory(prefix="ftbench-progress-") as folder:
        data_dir, log = str(Path(folder) / "data"), Path(folder) / "job.log"
        registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data_dir)
        sides = {"on": side(spec, data_dir, log, args.every_s), "off": side(spec, data_dir, log, None)}
        for trial in range(args.trials):
            order, speed, _ = mirrored_trial(sides, trial)
            ratios.append(speed["on"].typical_step / speed["off"].typical_step)
            print(f"trial {trial} ({' > '.join(order)}, then back): typical step tokens/s on {speed['on'].typical_step:,.0f}, "
                  f"off {speed['off'].typical_step:,.0f}: on/off {ratios[-1]:.3f} (window "
                  f"{speed['on'].window / speed['off'].window:.3f})", flush=True)
        lines = sum(1 for line in log.read_text(encoding="utf-8").splitlines() if line.startswith("progress: "))
    per_step, per_line = call_costs()
    print(f"progress per step without a line due: {per_step * 1e6:.2f} us; per line written: {per_line * 1e6:.1f} us "
          f"(a line every {progress.EVERY_S:g} s in a job)")
    settled = settle(ratios, TARGET)
    interval = f"{settled.interval[0]:.3f}-{settled.interval[1]:.3f}" if settled.interval else "n/a"
    print(f"{spec.run_id}, batch {spec.batch_size}, {args.steps} measured steps a pass, {args.trials} trials, "
          f"{lines} progress lines written: progress on/off {settled.mean:.3f} (95% {interval}), median "
          f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}: {settled.verdict} >= {TARGET}")


if __name__ == "__main__":
    main()
