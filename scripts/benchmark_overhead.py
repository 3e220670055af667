"""How much does ftbench's measuring cost? Tokens/s of a run through ftbench vs a bare PyTorch loop.

All sides use the same model, batches (the run's batching and gradient accumulation), optimizer and precision, in
the same process on the same machine:
- bare: forward and backward of each micro-batch, optimizer step; the device is synchronised only at the ends of the
  window.
- ftbench: trainer.train_run as a pipeline job runs it (per-step records, each step's loss copied to the host and
  checked a step later, NVML sampling on a GPU).
- ftbench without NVML: the same, with the sampler given no GPU, isolating the sampler's cost.
Each trial runs every side twice, in an order and then its reverse (bare, ftbench, no-NVML, no-NVML, ftbench,
bare), the order's start rotating from trial to trial. Each side's two passes are centred on the same moment of
the trial, so a host whose speed drifts steadily through a trial (clocks, thermals, other tenants: on launch-bound
H100 runs the bare loop alone moved between 54k and 82k tokens/s from trial to trial) slows every side alike,
and "who ran first" rotates. The ratios are taken within a trial and summarised by their median over trials.

Two speeds per side and trial:
- window: tokens over the whole measured window (synchronised at both ends): what a run delivers.
- typical step: the median over the window's steps of each step's tokens / seconds (both sides time their steps
  with measure/step_clock.py: CUDA events, which add no synchronisation). What the
  harness costs is paid on every step, so it moves the typical step; the stalls of a shared host (on the
  H100 VMs a 0.134 s step now and then takes 0.15-0.20 s) fall on either side at random and move a
  40-step window by 5-20%. The verdicts use the typical step; the window ratio is printed beside it, with
  each side's stall share (window time over typical step time x steps, less 1), so a cost that ftbench
  pays only on some steps still shows.

    python scripts/benchmark_overhead.py --config config/examples/llama-methods.yaml --run 0 \
        --batch-size 32 --steps 100 --warmup 10 --trials 6

Prints one line per trial, then each ratio (typical step) over the trials: its geometric mean with a 95% interval
(Student's t on the trials' log ratios), median and range, and a verdict: the targets are ftbench / bare >= 0.97 and
NVML sampling on / off >= 0.99; "meets" when the interval lies at or above the target, "misses" when below, else "not
resolved", with how many trials would settle it at the scatter seen. When the host's kernel launches are the bottleneck
(a small model or batch), trials of the same loop scatter by 5-10% on the lent H100s (from step to step and from pass to
pass: longer passes do not calm it, more trials do), so such a ratio needs tens of trials; a busy GPU settles it in
five. (Until November 2026 a verdict needed every trial on one side of the target: a rule that a ratio scattering by
more than its margin could never pass, however many trials were run.) ``--out`` is rewritten after every trial
(each pass's step speeds included), so a run that is stopped keeps the trials it finished; ``--time-limit-s`` starts
no trial that would not finish by then at the pace of the slowest so far, and summarises the trials it ran.
``--pool A.json B.json`` adds the trials of earlier ``--out`` files of the same run, batch, sampling interval and GPU
model to this run's before the verdicts (each trial is paired within itself, so trials from several sessions are
independent units alike); with ``--trials 0`` it only settles the pooled trials, without a GPU, and with
``--across-runs`` too the files may be of several runs and batches: one verdict on what the harness costs over that
mix of workloads (each trial keeps its run). ``--gpus 0,1,2,3`` runs the trials on several GPUs of a host at once:
one process per GPU (``CUDA_VISIBLE_DEVICES`` set to it) on an equal share of this process's CPU cores, each its own
``--trials`` into ``<out>.gpu<N>.json``, then one verdict over all of them (with ``--pool``'s): a launch-bound example's
tens of trials in a fraction of the time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ftbench.tasks import registry
from ftbench.data import prepared
from ftbench.measure import gpu_monitor
from ftbench.measure.step_clock import StepClock
from ftbench.experiment import matrix
from ftbench.train import batching, modeling, trainer
from ftbench.experiment import config as ftbench_config
from ftbench.errors import ConfigError
from ftbench.report import uncertainty
from ftbench.train.devices import Distributed, autocast_args, choose_device, synchronize
from ftbench.train.optimizers import make_grad_scaler, make_optimizer
from ftbench.train.run_state import training_order
from ftbench.runspec import RunSpec


@dataclass
class Speed:
    """One side's speed in one trial: tokens/s over the window, and the median step's tokens/s."""

    window: float
    typical_step: float
    stall_share: float  # the window's time beyond steps x the typical step time, as a share of the latter
    step_speeds: tuple[float, ...] = ()  # one pass's tokens/s step by step (--out keeps them: is the noise within passes or between?)

    @classmethod
    def combined(cls, passes: list["Speed"]) -> "Speed":
        """One side's passes of a trial as one speed: the harmonic mean of each figure (the passes take the same
        batches, so that is the speed at their mean time per token: linear drift in time cancels exactly)."""
        return cls(window=len(passes) / sum(1 / p.window for p in passes),
                   typical_step=len(passes) / sum(1 / p.typical_step for p in passes),
                   stall_share=statistics.fmean(p.stall_share for p in passes))

    @classmethod
    def of(cls, step_tokens: list[int], step_seconds: list[float], window_s: float) -> "Speed":
        step_speeds = tuple(tokens / seconds for tokens, seconds in zip(step_tokens, step_seconds))
        return cls(window=sum(step_tokens) / window_s, typical_step=statistics.median(step_speeds),
                   stall_share=window_s / (statistics.median(step_seconds) * len(step_seconds)) - 1,
                   step_speeds=step_speeds)


def bare_loop(spec: RunSpec, data_dir: str, steps: int, warmup: int) -> Speed:
    manifest = prepared.verify(data_dir)
    split = registry.load_split(data_dir, "train", manifest)
    device, _ = choose_device(spec, Distributed())
    torch.manual_seed(spec.seed)
    model = modeling.build_model(spec, len(manifest["label_names"] or []) or None, device, manifest["pad_token_id"]).model
    if spec.compile:
        model = torch.compile(model)
    optimizer = make_optimizer(spec, model, device)
    autocast = autocast_args(device, spec.precision)  # off for fp32 and bf16_true, as in ftbench's loop
    scaler = make_grad_scaler(spec, device)
    model.train()
    step_tokens: list[int] = []
    clock = StepClock(device)  # the one ftbench's window uses: markers on the device's timeline, read at the end
    start = None
    for step, micro_batches in enumerate(step_batches(spec, split, manifest, warmup + steps)):
        if step == warmup:
            synchronize(device)
            start = time.perf_counter()
            clock.start(start)
        tokens = 0
        for batch in micro_batches:
            batch = batch.to(device)
            with torch.autocast(**autocast):
                loss = model(**batch.inputs).loss / len(micro_batches)
            scaler.scale(loss).backward()
            tokens += batch.real_tokens
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            clock.boundary(step)
            step_tokens.append(tokens)
    synchronize(device)
    window_s = time.perf_counter() - start
    return Speed.of(step_tokens, list(clock.step_seconds().values()), window_s)


def step_batches(spec: RunSpec, split, manifest: dict, total_steps: int):
    """Each optimizer step's micro-batches (on the host, collated when the step asks for them), as ftbench's loop
    draws them for this run: its ``batching`` (packed rows, length groups) and its ``grad_accum_steps``. The bare
    loop does the same work per token; drawing plain padded batches of one micro-step each, as it once did, would
    compare ftbench with another workload on a packed or accumulating run."""
    order = iter(training_order(spec, split, total_steps))
    for _ in range(total_steps):
        yield [batching.collate(manifest["task"], split, next(order), manifest["pad_token_id"], spec.batching, spec.seq_len)
               for _ in range(spec.grad_accum_steps)]


def ftbench_loop(spec: RunSpec, data_dir: str, sampling: bool, samples_taken: list[int],
                 sync_every_step: bool = False) -> Speed:
    original = gpu_monitor.GpuSampler.__init__
    boundary = StepClock.boundary
    if not sampling:
        def no_gpus(self, cuda_indices, interval_s):
            original(self, [], interval_s)
        gpu_monitor.GpuSampler.__init__ = no_gpus
    if sync_every_step:  # the window as it was before its steps stopped waiting for the device
        def synchronised_boundary(self, step):
            boundary(self, step)
            if self.cuda:
                torch.cuda.synchronize()
        StepClock.boundary = synchronised_boundary
    try:
        metrics, steps = trainer.train_run(spec, data_dir)
    finally:
        gpu_monitor.GpuSampler.__init__ = original
        StepClock.boundary = boundary
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run ended with status {metrics['status']}: {metrics.get('status_reason')}")
    samples_taken.append(metrics["nvml_samples"])
    measured = [step for step in steps if step["measured"]]
    return Speed.of([step["tokens"] for step in measured], [step["step_time_s"] for step in measured], metrics["window_s"])


# The targets: ftbench within 3% of the bare loop (issue 30), the NVML sampling within 1% of none.
TARGETS = {"ftbench_over_bare": 0.97, "nvml_on_over_off": 0.99}


@dataclass
class Settled:
    """What the trials say of one ratio: its geometric mean over trials and that mean's 95% interval (Student's t
    on the trials' log ratios), the verdict against the target, and how many trials would settle it at this scatter."""

    mean: float
    interval: tuple[float, float] | None  # None from a single trial
    verdict: str  # meets / misses / not resolved
    trials_to_settle: int | None  # where not resolved: the trials whose interval would clear the target (None: over 1000)


def settle(values: list[float], target: float) -> Settled:
    """'meets' when the 95% interval of the trials' mean ratio lies at or above ``target``, 'misses' when it lies
    below, else 'not resolved'. The trials are the independent units (each is paired within itself), so their
    scatter, from whatever source (host stalls, clocks, drift between trials), widens the interval, and more
    trials narrow it: a ratio whose trials scatter by more than its margin still settles, given enough of them.
    Logs, because a ratio and its reciprocal must settle alike."""
    logs = [math.log(value) for value in values]
    if len(values) < 2:
        return Settled(values[0], None, "not resolved", None)
    mean, low, high = uncertainty.mean_interval(logs)
    verdict = "meets" if low >= math.log(target) else "misses" if high < math.log(target) else "not resolved"
    needed = None
    if verdict == "not resolved":
        needed = uncertainty.repeats_to_separate(mean - math.log(target), statistics.stdev(logs), 0.0)
    return Settled(math.exp(mean), (math.exp(low), math.exp(high)), verdict, needed)


def summarise_trials(trials: list[dict]) -> dict:
    """Each within-trial ratio (typical step) over the trials: its geometric mean with 95% interval, median and
    range, its verdict against its target (``settle``), and whether both are settled; the window ratios' medians and
    ranges beside (no verdict: host stalls scatter them)."""
    summary: dict = {}
    for key, target in TARGETS.items():
        values = [trial[key] for trial in trials]
        settled = settle(values, target)
        summary[f"mean_{key}"], summary[f"interval_{key}"] = settled.mean, settled.interval
        summary[f"verdict_{key}"], summary[f"trials_to_settle_{key}"] = settled.verdict, settled.trials_to_settle
        summary[f"median_{key}"] = statistics.median(values)
        summary[f"range_{key}"] = [min(values), max(values)]
        window = [trial[f"window_{key}"] for trial in trials]
        summary[f"median_window_{key}"] = statistics.median(window)
        summary[f"range_window_{key}"] = [min(window), max(window)]
    summary["resolved"] = all(summary[f"verdict_{key}"] != "not resolved" for key in TARGETS)
    for key in set(RATIO_SIDES) - set(TARGETS):
        values = [trial[key] for trial in trials if key in trial]
        if values:  # an attribution, without a verdict
            summary[f"median_{key}"], summary[f"range_{key}"] = statistics.median(values), [min(values), max(values)]
    return summary


def trial_row(order: list[str], speed: dict[str, Speed], nvml_samples: int) -> dict:
    """One trial's figures: each side's speeds and stall share, and the ratios (typical step; window_*: window)."""
    row: dict = {"order": order, "nvml_samples": nvml_samples}
    for name, side in speed.items():
        row.update({f"{name}_tokens_per_s": side.window, f"{name}_typical_step_tokens_per_s": side.typical_step,
                    f"{name}_stall_share": side.stall_share})
    for key, (numerator, denominator) in RATIO_SIDES.items():
        if numerator not in speed or denominator not in speed:
            continue  # a side this benchmark was not asked to run (--sync-side)
        row[key] = speed[numerator].typical_step / speed[denominator].typical_step
        row[f"window_{key}"] = speed[numerator].window / speed[denominator].window
    return row


def mirrored_trial(sides: dict, trial: int) -> tuple[list[str], dict[str, Speed], list[tuple[str, Speed]]]:
    """Run each side (a callable returning its Speed) twice: in an order starting at side ``trial`` (mod the count),
    then in the reverse order; (that order, each side's two passes combined, every pass in the order run). Every
    side's passes are centred on the trial's middle, so drift that is linear in time falls on all sides alike."""
    names = list(sides)
    start = trial % len(names)
    order = names[start:] + names[:start]
    run = [(name, sides[name]()) for name in order + order[::-1]]
    return order, {name: Speed.combined([speed for side, speed in run if side == name]) for name in names}, run


# Which sides each ratio compares.
RATIO_SIDES = {"ftbench_over_bare": ("ftbench", "bare"), "nvml_on_over_off": ("ftbench", "ftbench_no_nvml"),
               # --sync-side: what not waiting for the device in the window gains (no target: an attribution)
               "no_sync_over_sync": ("ftbench", "ftbench_sync_every_step")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="config/config.yaml")
    parser.add_argument("--run", type=int, default=0, help="index of the run in the expanded matrix")
    parser.add_argument("--steps", type=int, default=200, help="measured steps per side and pass (two passes a trial)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5, help="trials to run here (0: only settle --pool's trials)")
    parser.add_argument("--sample-interval", type=float, help="override the run's gpu_sample_interval_s (seconds)")
    parser.add_argument("--batch-size", type=int, help="override the run's batch size (a larger one makes a small model GPU-bound)")
    parser.add_argument("--out", help="write the figures as JSON here (after every trial)")
    parser.add_argument("--sync-side", action="store_true", help="a fourth side: ftbench with the device synchronised "
                        "after every measured step, as its loop was before (no_sync_over_sync: what not waiting gains)")
    parser.add_argument("--time-limit-s", type=float, help="start no trial that would end past this many seconds of "
                        "trials (at the slowest trial's pace so far); the summary covers the trials run (and --pool's)")
    parser.add_argument("--pool", nargs="+", default=[], metavar="OUT_JSON",
                        help="earlier --out files of the same run and GPU model whose trials count with this run's")
    parser.add_argument("--across-runs", action="store_true", help="with --trials 0: --pool's files may be of "
                        "different runs and batches (the same GPU model and sampling interval): what the harness costs "
                        "over that mix of workloads, each trial still paired within itself")
    parser.add_argument("--gpus", type=lanes_of, help="comma-separated CUDA_VISIBLE_DEVICES values (0,1,2,3): "
                        "--trials on each GPU at once, one process per GPU on an equal share of the CPU cores, its "
                        "figures in <out>.gpu<N>.json; then one verdict over them all (needs --out)")
    args = parser.parse_args()
    if args.trials < (0 if args.pool else 1):
        parser.error("--trials: at least 1 (0 only with --pool)")
    if args.across_runs and args.trials:
        parser.error("--across-runs: only with --trials 0 (it settles --pool's files of several runs, running none)")
    if args.gpus:
        check_lanes(parser, args)

    try:
        runs = matrix.expand_runs(ftbench_config.load_config(args.config))
    except ConfigError as error:  # one line naming the file and key, before anything is measured
        raise SystemExit(f"{args.config}: {error}") from None
    if not 0 <= args.run < len(runs):
        parser.error(f"--run: expected an index of {args.config}'s runs, 0 to {len(runs) - 1}, got {args.run}")
    spec = runs[args.run]
    spec = spec.replace(max_steps=args.warmup + args.steps, warmup_steps=args.warmup, epochs=None, max_eval_samples=1)
    if args.batch_size:
        spec = spec.replace(batch_size=args.batch_size)
    if args.sample_interval:
        spec = spec.replace(gpu_sample_interval_s=args.sample_interval)
    if spec.parallel != "single":
        raise SystemExit("the overhead benchmark compares single-device loops; pick a single run")
    if args.gpus:  # the run is valid: the lanes measure, this process settles their trials with --pool's
        pooled_results(spec, args, measuring=False)  # a --pool file that would be refused is, before any lane runs
        args.pool, args.trials = [*run_lanes(args), *args.pool], 0
    results, repeated = pooled_results(spec, args, measuring=bool(args.trials))
    if repeated:
        print(f"--pool: {repeated} trials came more than once (a file given twice, or pooled into a later one): "
              "each counted once", flush=True)
    if args.trials:
        with tempfile.TemporaryDirectory(prefix="ftbench-overhead-") as data_dir:
            registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, data_dir)
            sides, nvml_samples = measured_sides(spec, data_dir, args)
            run_trials(sides, nvml_samples, results, args)
    elif results["trials"]:
        results.update(summarise_trials(results["trials"]))
    if not results["trials"]:
        raise SystemExit("--pool: the pooled files hold no trials")
    if args.out and not args.trials:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print_summary(spec, results)


def pooled_results(spec: RunSpec, args: argparse.Namespace, measuring: bool) -> tuple[dict, int]:
    """The figures of this run before its own trials: what it measures and where (``measuring``: this process runs
    trials), with --pool's trials added (``add_pooled_trials``); and how many of those came more than once."""
    device = torch.cuda.get_device_name(0) if measuring and torch.cuda.is_available() else "cpu"
    results = {"run_id": spec.run_id, "batch_size": spec.batch_size, "gpu_sample_interval_s": spec.gpu_sample_interval_s,
               "steps": args.steps if measuring else None, "warmup": args.warmup if measuring else None,
               "device": device if measuring else None, "trials": []}  # pooled trials each name their file
    if measuring:  # where this process ran: a lane of --gpus, or what its caller gave it
        results.update(cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"), cpu_cores=sorted(os.sched_getaffinity(0)))
    if args.across_runs:  # nothing of --config's run applies: the first pooled file sets what the others must match
        results.update(dict.fromkeys(POOLED_MUST_MATCH))
    try:
        repeated = sum(add_pooled_trials(results, path, args.across_runs) for path in args.pool)
    except ValueError as error:
        raise SystemExit(f"--pool: {error}") from None
    return results, repeated


def lanes_of(text: str) -> list[str]:
    """--gpus: the GPUs to run lanes on, as CUDA_VISIBLE_DEVICES values (indices or UUIDs), each once."""
    lanes = [lane.strip() for lane in text.split(",")]
    if not all(lanes) or len(set(lanes)) != len(lanes):
        raise argparse.ArgumentTypeError(f"expected distinct GPUs separated by commas (0,1,2,3), got {text!r}")
    return lanes


def check_lanes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--gpus needs trials to run, a file to settle them in, and at least one CPU core per lane."""
    if not args.trials:
        parser.error("--gpus: needs --trials of at least 1 (the trials each GPU runs)")
    if not args.out:
        parser.error("--gpus: needs --out (each GPU's figures go beside it, in <out>.gpu<N>.json)")
    if len(args.gpus) > len(os.sched_getaffinity(0)):
        parser.error(f"--gpus: {len(args.gpus)} GPUs but {len(os.sched_getaffinity(0))} CPU cores to run them on: "
                     "one core at least per GPU")


def run_lanes(args: argparse.Namespace) -> list[str]:
    """Run this benchmark once per GPU of --gpus, all at once: each process sees only its GPU and runs on its own equal
    share of this process's CPU cores (a launch-bound loop is as fast as the cores launching its kernels, so lanes
    must not take each other's), with --pool and --gpus left out. Returns the --out files the lanes wrote; a lane
    that failed is named with its log, and the trials it finished still count. Stopping this process (SIGTERM, as
    `timeout` does, or Ctrl-C) stops the lanes: none is left holding a GPU."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // len(args.gpus)
    lanes: dict[str, tuple[subprocess.Popen, object]] = {}
    previous = signal.signal(signal.SIGTERM, lambda number, _: sys.exit(128 + number))
    try:
        for number, gpu in enumerate(args.gpus):
            out = f"{args.out}.gpu{number}.json"
            Path(out).unlink(missing_ok=True)  # an earlier run's: it would pool as this one's were this lane to fail
            log = open(f"{args.out}.gpu{number}.log", "w")  # noqa: SIM115 - closed once the lane has ended
            lane_cores = cores[number * share:(number + 1) * share]
            lanes[out] = (subprocess.Popen([sys.executable, __file__, *lane_arguments(args), "--out", out], stdout=log,
                                           stderr=subprocess.STDOUT, env=os.environ | {"CUDA_VISIBLE_DEVICES": gpu},
                                           preexec_fn=lambda lane_cores=lane_cores: os.sched_setaffinity(0, lane_cores)),
                          log)
            print(f"lane {number}: GPU {gpu}, CPU cores {core_ranges(lane_cores)}, log {log.name}", flush=True)
        for out, (process, log) in lanes.items():
            if process.wait():
                print(f"lane {out}: exit status {process.returncode} (log {log.name})", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process, log in lanes.values():
            if process.poll() is None:  # this process is being stopped: so are its lanes
                process.terminate()
                process.wait()
            log.close()
    written = [out for out in lanes if Path(out).exists()]  # rewritten after every trial: a failed lane's count
    if not written:
        raise SystemExit(f"--gpus: no lane finished a trial (logs: {args.out}.gpu<N>.log)")
    return written


def core_ranges(cores: list[int]) -> str:
    """CPU core numbers as ranges: [0, 1, 2, 3, 8] -> '0-3,8'."""
    ranges: list[list[int]] = []
    for core in cores:
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{first}-{last}" if last > first else str(first) for first, last in ranges)


def lane_arguments(args: argparse.Namespace) -> list[str]:
    """This run's command line for one lane: what measures, without --gpus, --pool and --out."""
    arguments = ["--config", args.config, "--run", str(args.run), "--steps", str(args.steps), "--warmup",
                 str(args.warmup), "--trials", str(args.trials)]
    for option, value in (("--sample-interval", args.sample_interval), ("--batch-size", args.batch_size),
                          ("--time-limit-s", args.time_limit_s)):
        if value is not None:
            arguments += [option, str(value)]
    return arguments + (["--sync-side"] if args.sync_side else [])


# What must agree for trials to be pooled: the same run and batch, sampled alike, on the same GPU model. The
# passes' lengths may differ (each trial keeps its own steps and warmup): a trial's ratio compares sides of one length.
POOLED_MUST_MATCH = ("run_id", "batch_size", "gpu_sample_interval_s", "device")
# --across-runs: what may differ between the pooled files (each trial keeps its own); the rest must still match.
POOLED_ACROSS_RUNS_MAY_DIFFER = ("run_id", "batch_size")
# What a pooled trial must hold: the ratios the verdicts and the summary read.
TRIAL_RATIOS = (*TARGETS, *(f"window_{key}" for key in TARGETS))


def add_pooled_trials(results: dict, path: str, across_runs: bool = False) -> int:
    """Add the trials of an earlier --out file to ``results``, after checking that it measured the same thing
    (POOLED_MUST_MATCH, less POOLED_ACROSS_RUNS_MAY_DIFFER ``across_runs``; a key of ``results`` that is None takes the
    first file's). Each trial keeps the file it was first measured into (``pooled_from``), its passes' length, and
    across runs its run and batch; a trial already in ``results`` (a file given twice, or an --out that pooled it
    already) is not added again. Returns how many were skipped so; ValueError names the file."""
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot be read as a benchmark_overhead --out file ({error})") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("trials"), list):
        raise ValueError(f"{path}: expected a benchmark_overhead --out file: a JSON object with a list of trials")
    may_differ = POOLED_ACROSS_RUNS_MAY_DIFFER if across_runs else ()
    for key in POOLED_MUST_MATCH:
        if key in may_differ:
            continue
        if results[key] is None:
            results[key] = earlier.get(key)
        if earlier.get(key) != results[key]:
            raise ValueError(f"{path}: {key} is {earlier.get(key)!r}, this run's is {results[key]!r}: "
                             + ("only trials of the same sampling interval and GPU model pool across runs" if across_runs
                                else "only trials of the same run, batch, sampling interval and GPU model pool"))
    seen = {_trial_identity(trial) for trial in results["trials"]}
    repeated = 0
    for index, trial in enumerate(earlier["trials"]):
        if not isinstance(trial, dict) or not all(isinstance(trial.get(key), (int, float)) for key in TRIAL_RATIOS):
            raise ValueError(f"{path}: trial {index} lacks a number for one of {', '.join(TRIAL_RATIOS)}")
        identity = _trial_identity(trial)
        if identity in seen:
            repeated += 1
            continue
        seen.add(identity)
        measured_on = {key: earlier.get(key) for key in may_differ}
        results["trials"].append({"pooled_from": path, "steps": earlier.get("steps"), "warmup": earlier.get("warmup"),
                                  **measured_on, **trial})
    return repeated


def _trial_identity(trial: dict) -> str:
    """A trial's measured figures (each pass's step speeds among them): the same in every file it was pooled into."""
    added_when_pooled = ("pooled_from", "steps", "warmup", *POOLED_ACROSS_RUNS_MAY_DIFFER)
    return json.dumps({key: value for key, value in trial.items() if key not in added_when_pooled}, sort_keys=True)


def measured_sides(spec: RunSpec, data_dir: str, args: argparse.Namespace) -> tuple[dict, list[int]]:
    """Each side as a callable that runs one pass and returns its Speed; and the list the ftbench side appends each
    pass's NVML sample count to."""
    nvml_samples: list[int] = []  # per ftbench pass: 0 means there was nothing to sample (no NVML)
    sides = {
        "bare": lambda: bare_loop(spec, data_dir, args.steps, args.warmup),
        "ftbench": lambda: ftbench_loop(spec, data_dir, sampling=True, samples_taken=nvml_samples),
        "ftbench_no_nvml": lambda: ftbench_loop(spec, data_dir, sampling=False, samples_taken=[]),
    }
    if args.sync_side:
        sides["ftbench_sync_every_step"] = lambda: ftbench_loop(spec, data_dir, sampling=True, samples_taken=[],
                                                               sync_every_step=True)
    return sides, nvml_samples


def run_trials(sides: dict, nvml_samples: list[int], results: dict, args: argparse.Namespace) -> None:
    """Up to ``args.trials`` mirrored trials (fewer when ``args.time_limit_s`` would be passed), each printed as it
    ends and added to ``results`` with the summary so far; ``args.out`` rewritten after each."""
    started = time.monotonic()
    slowest_trial_s = 0.0
    for trial in range(args.trials):
        elapsed = time.monotonic() - started
        if args.time_limit_s and trial and elapsed + slowest_trial_s > args.time_limit_s:
            print(f"time limit: {trial} of {args.trials} trials run in {elapsed:.0f} s; the next would end past "
                  f"{args.time_limit_s:.0f} s", flush=True)
            return
        order, speed, passes = mirrored_trial(sides, trial)
        slowest_trial_s = max(slowest_trial_s, time.monotonic() - started - elapsed)
        row = trial_row(order, speed, nvml_samples[-1]) | {"steps": args.steps, "warmup": args.warmup}
        row["passes"] = [{"side": name, "typical_step_tokens_per_s": pass_speed.typical_step,
                          "step_tokens_per_s": list(pass_speed.step_speeds)} for name, pass_speed in passes]
        results["trials"].append(row)
        print(f"trial {trial} ({' > '.join(order)}, then back), typical step / window tokens/s: "
              + ", ".join(f"{name} {speed[name].typical_step:,.0f} / {speed[name].window:,.0f} "
                          f"(stalls {speed[name].stall_share:+.1%})" for name in sides)
              + f"; ftbench/bare {row['ftbench_over_bare']:.3f}x (window {row['window_ftbench_over_bare']:.3f}x), "
              f"sampling on/off {row['nvml_on_over_off']:.3f}x (window {row['window_nvml_on_over_off']:.3f}x)"
              + (f", no sync / sync every step {row['no_sync_over_sync']:.3f}x" if "no_sync_over_sync" in row else ""),
              flush=True)
        results.update(summarise_trials(results["trials"]))
        if args.out:  # after every trial: a run stopped from outside keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=2))


def print_summary(spec: RunSpec, results: dict) -> None:
    """Each ratio's mean over trials with its interval, median and range, and verdict, in one line; how many trials
    would settle a ratio that is not settled."""
    lines = []
    for key, name in (("ftbench_over_bare", "ftbench/bare"), ("nvml_on_over_off", "NVML sampling on/off")):
        interval = results[f"interval_{key}"]
        low, high = results[f"range_{key}"]
        line = (f"{name} {results[f'mean_{key}']:.3f}"
                + (f" (95% interval {interval[0]:.3f}-{interval[1]:.3f}" if interval else " (one trial: no interval")
                + f"; median {results[f'median_{key}']:.3f}, trials {low:.3f}-{high:.3f}; target >= {TARGETS[key]}): "
                f"{results[f'verdict_{key}']}")
        needed = results[f"trials_to_settle_{key}"]
        if results[f"verdict_{key}"] == "not resolved":
            line += f" (at this scatter about {needed} trials would settle it)" if needed else " (over 1000 trials would)"
        window_low, window_high = results[f"range_window_{key}"]
        lines.append(line + f"; window median {results[f'median_window_{key}']:.3f} ({window_low:.3f}-{window_high:.3f})")
    origins = [trial["pooled_from"] for trial in results["trials"] if "pooled_from" in trial]
    runs = sorted({trial["run_id"] for trial in results["trials"] if trial.get("run_id")})
    measured = (f"across {len(runs)} runs ({', '.join(runs)})" if results["run_id"] is None
                else f"{spec.run_id} at batch {spec.batch_size}")
    print(f"{measured} on {results['device']}, {len(results['trials'])} trials"
          + (f" ({len(origins)} of them measured into {len(set(origins))} earlier files)" if origins else "")
          + ", typical step, geometric mean: " + "; ".join(lines))
    if "median_no_sync_over_sync" in results:
        low, high = results["range_no_sync_over_sync"]
        print(f"ftbench / ftbench synchronising every step: median {results['median_no_sync_over_sync']:.3f} "
              f"(typical step; trials {low:.3f}-{high:.3f})")
    if not results["resolved"]:
        print("not resolved: a ratio's 95% interval still spans its target; run more trials (--trials), or raise "
              "--batch-size until the GPU is busy (a launch-bound host scatters trials by 5-10%)")


if __name__ == "__main__":
    main()
