"""What a run's figures are, in one place: the statuses a run ends with, the per-step record, the
summary of the measured window, the efficiency figures derived from it, and merging DDP ranks.

Light on purpose (no torch at import): the table's column docs (columns.py) read the statuses here.
"""

from __future__ import annotations

import numpy as np

from ftbench.errors import FtbenchError, describe
from ftbench.measure import gpu_table
from ftbench.runspec import compute_dtype

# How a run ended and what that means, worst first: when DDP ranks disagree, the run is only as good
# as its worst rank.
STATUSES = {
    "failed": "ended in an error with no status of its own",
    "oom": "ran out of device memory (last_step says where)",
    "diverged": "the loss became NaN or infinite; stopped before that step's update",
    "timeout": "stopped early: the job's time limit was near",
    "unsupported": "this machine cannot run the configuration (status_reason says why)",
    "ok": "trained, measured and evaluated",
}

STEP_FIELDS = ["step", "measured", "step_time_s", "loader_s", "samples", "tokens", "padded_tokens", "flops", "loss", "lr"]
# Counts a step record of an image run also has: its images, and the part of its tokens that are image tokens.
IMAGE_COUNTS = ("images", "image_tokens")
# A step record of a family that trains some tokens only (instruction data: the completions) also counts those.
OPTIONAL_COUNTS = (*IMAGE_COUNTS, "trained_tokens")

MFU_FIELDS = ("mfu", "mfu_peak_tflops", "mfu_peak_source")

# evals.parquet: one row per evaluation and eval figure. ``step``: optimizer steps done when it was taken;
# ``tokens`` / ``samples`` / ``train_s``: what those steps processed (all devices) and took (their step times:
# evaluations excluded, warmup included); ``scope``: subset (during training, eval_subset examples) or full
# (the final evaluation); ``low`` / ``high``: the 95% Wilson interval of a proportion on ``eval_samples``
# (sequences for token accuracy: the cautious n), null for a loss or perplexity.
EVAL_FIELDS = ["evaluation", "step", "tokens", "samples", "train_s", "eval_s", "scope", "eval_samples", "metric", "value",
               "low", "high"]


def describe_statuses() -> str:
    return " | ".join(f"{name}: {meaning}" for name, meaning in STATUSES.items())


def worst_status(statuses) -> str:
    order = list(STATUSES)
    return min(statuses, key=order.index)


def failed_metrics(run_id: str, exc: BaseException) -> dict:
    """The figures of a run that ended in an error: its status and the error in one line (an unknown
    error's traceback is in the job log)."""
    if isinstance(exc, FtbenchError):
        reason = " ".join(str(exc).split())[:400]
    else:
        reason = describe(exc) + " (traceback in the job log)"
    return {"run_id": run_id, "status": "failed", "status_reason": reason}


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
        **trained_throughput(measured, tokens, window_s),
    }


def trained_throughput(measured: list[dict], tokens: int, window_s: float) -> dict:
    """Tokens the loss was computed on, apart from those processed, where the steps count them (a family that
    trains some tokens only: instruction data's completions); nothing otherwise."""
    if not any("trained_tokens" in step for step in measured):
        return {}
    trained = sum(step.get("trained_tokens", 0) for step in measured)
    return {"measured_trained_tokens": trained, "trained_tokens_per_s": trained / window_s,
            "trained_token_fraction": trained / tokens if tokens else None}


# warmup_until_stable's rule: warmup ends once the last SETTLE_STEPS step times all lie within
# SETTLE_TOLERANCE of their median (allocator growth, autotuning and recompilation make early steps slow or
# uneven; a steady loop repeats its step time to a few percent).
SETTLE_STEPS = 5
SETTLE_TOLERANCE = 0.05


def settled(step_times: list[float], k: int = SETTLE_STEPS, tolerance: float = SETTLE_TOLERANCE) -> bool:
    """Whether the last ``k`` step times are each within ``tolerance`` (relative) of their median."""
    if len(step_times) < k:
        return False
    last = np.asarray(step_times[-k:], dtype=float)
    median = float(np.median(last))
    return bool(np.all(np.abs(last - median) <= tolerance * median))


class Warmup:
    """When the measured window begins: after ``warmup_steps``; with ``until_stable`` later, once step
    times have settled (``settled``), and at the latest after ``max_steps`` warmup steps (default half the
    run). Total steps do not change: what warmup takes longer, the window has fewer steps (measured_steps
    says how many)."""

    def __init__(self, warmup_steps: int, until_stable: bool, max_steps: int | None, total_steps: int):
        self.min_steps = warmup_steps
        self.until_stable = until_stable
        self.max_steps = max(warmup_steps, max_steps if max_steps is not None else total_steps // 2)
        self.used: int | None = None  # warmup steps actually run, once the window has begun
        self.settled: bool | None = None  # with until_stable: whether the rule (not the cap) ended warmup

    @classmethod
    def of(cls, spec, total_steps: int) -> "Warmup":
        return cls(spec.warmup_steps, spec.warmup_until_stable, spec.warmup_max_steps, total_steps)

    def window_begins(self, step: int, step_times: list[float], agree=lambda flag: flag) -> bool:
        """Called before each step with the times of the steps run so far: True once, at the first measured
        step. ``agree`` makes DDP ranks decide together (any rank settled: all begin)."""
        if self.used is not None or step < self.min_steps:
            return False
        if self.until_stable:
            self.settled = agree(settled(step_times))
            if not self.settled and step < self.max_steps:
                return False
        self.used = step
        return True

    def figures(self, steps_run: int) -> dict:
        """warmup_steps: the steps run before the window (all of them if it never began)."""
        return {"warmup_steps": self.used if self.used is not None else steps_run,
                "warmup_settled": self.settled if self.until_stable else None}


def image_throughput(steps: list[dict], window_s: float | None, devices: int) -> dict:
    """Images, image tokens and text tokens per second over the measured steps (all devices together);
    nothing for a run whose steps carry no images."""
    measured = [step for step in steps if step["measured"]]
    if not measured or not window_s or not any("images" in step for step in measured):
        return {}
    images = sum(step.get("images", 0) for step in measured)
    image_tokens = sum(step.get("image_tokens", 0) for step in measured)
    tokens = sum(step["tokens"] for step in measured)
    return {
        "measured_images": images,
        "images_per_s": images / window_s,
        "images_per_s_per_device": images / window_s / devices,
        "image_tokens_per_s": image_tokens / window_s,
        "text_tokens_per_s": (tokens - image_tokens) / window_s,
    }


# A run whose GPU was busy for less than this share of its measured window waited on its host (Python, kernel
# launches, the loader) for the rest: its speed is the host's, and a faster host or torch.compile (fewer launches)
# would change it where a faster GPU would not. GPU-bound runs read 0.95-1.0; a 134M Llama at batch 64 x 256
# read 0.12-0.47 on an H200.
HOST_BOUND_BUSY_SHARE = 0.8


def gpu_busy(metrics: dict) -> dict:
    """gpu_busy_share (NVML's utilisation over the measured window, the share of its sample periods in which a
    kernel ran, as a fraction) and host_bound (below HOST_BOUND_BUSY_SHARE); both None without NVML."""
    util = metrics.get("gpu_util_mean")
    if util is None or not metrics.get("nvml_samples"):
        return {"gpu_busy_share": None, "host_bound": None}
    share = float(util) / 100
    return {"gpu_busy_share": share, "host_bound": share < HOST_BOUND_BUSY_SHARE}


def energy_per_token(metrics: dict) -> float | None:
    """GPU energy of the measured window per real token (None without NVML energy or tokens)."""
    energy, tokens = metrics.get("energy_j"), metrics.get("measured_tokens")
    return energy / tokens if energy is not None and tokens else None


def mfu(row: dict, peaks: list[dict]) -> dict:
    """mfu, mfu_peak_tflops and mfu_peak_source of one run (a row of the table, before typing): its
    analytic TFLOP/s over the dense peak of its precision on its GPU (``peaks``: config/gpus.yaml's
    entries) times the GPUs that trained together. A CPU run has none."""
    if row.get("device") != "cuda":
        return dict.fromkeys(MFU_FIELDS)

    achieved = row["tflops_per_s"] * 1e12 if row.get("tflops_per_s") else None
    return gpu_table.mfu(achieved, row.get("device_name") or "", compute_dtype(row["precision"]), row["world_size"],
                         peaks=peaks)


def merge_ranks(rank_results: list[dict], devices: int) -> tuple[dict, list[dict]]:
    """One run's metrics and step records from its DDP ranks' results ({rank, metrics, steps} each):
    counts summed, times and memory maxed."""
    rank_results = sorted(rank_results, key=lambda r: r["rank"])
    metrics = dict(rank_results[0]["metrics"])  # rank 0 evaluated; its fields are the base
    metrics.pop("rank", None)  # a per-rank field; the ranks are listed under per_rank
    metrics.pop("rank_meeting_s", None)  # each rank's span at the meeting before the first step: in its rank file only
    worst = worst_status(r["metrics"]["status"] for r in rank_results)
    if worst != "ok":
        # Which rank it was, also when the others left no result (ended while waiting for it).
        culprit = next(r for r in rank_results if r["metrics"]["status"] == worst)
        metrics["status"] = worst
        metrics["status_reason"] = f"rank {culprit['rank']}: {culprit['metrics'].get('status_reason')}"
    for key in ("peak_memory_allocated_mb", "peak_memory_reserved_mb", "peak_rss_mb", "wall_time_s", "train_time_s",
                "startup_s", "gpu_mem_used_peak_mb"):
        values = [r["metrics"][key] for r in rank_results if r["metrics"].get(key) is not None]
        if values:
            metrics[key] = max(values)
    # Each rank sampled its own GPU: energy and power add up, utilisation averages.
    for key, combine in (("energy_j", sum), ("gpu_power_mean_w", sum), ("gpu_util_mean", lambda v: sum(v) / len(v))):
        values = [r["metrics"].get(key) for r in rank_results]
        metrics[key] = combine(values) if all(v is not None for v in values) else None
    metrics["per_rank"] = [
        {key: r["metrics"].get(key) for key in ("tokens_per_s", "peak_memory_reserved_mb", "status", "device_name")}
        for r in rank_results
    ]

    # Steps: the same optimizer step on every rank; a step lasts as long as its slowest rank.
    by_step: dict[int, dict] = {}
    for result in rank_results:
        for record in result["steps"]:
            merged = by_step.setdefault(record["step"], {**{k: v for k, v in record.items() if k not in OPTIONAL_COUNTS},
                                                          "samples": 0, "tokens": 0, "padded_tokens": 0,
                                                          "flops": 0, "step_time_s": 0.0, "loader_s": 0.0})
            for count in ("samples", "tokens", "padded_tokens", "flops"):
                merged[count] += record[count]
            for count in OPTIONAL_COUNTS:  # image runs' images, masked runs' trained tokens: summed like tokens
                if count in record:
                    merged[count] = merged.get(count, 0) + record[count]
            for slowest in ("step_time_s", "loader_s"):
                merged[slowest] = max(merged[slowest], record[slowest])
    steps = [by_step[key] for key in sorted(by_step)]
    windows = [r["metrics"].get("window_s") for r in rank_results]
    window_s = max(windows) if all(windows) else None
    metrics["window_s"] = window_s
    metrics.update(summarise(steps, window_s, devices))
    metrics.update(image_throughput(steps, window_s, devices))
    metrics["energy_j_per_token"] = energy_per_token(metrics)
    return metrics, [{field: step.get(field) for field in STEP_FIELDS} for step in steps]


def with_counts(evals: list[dict], steps: list[dict]) -> list[dict]:
    """Evaluation rows with the tokens, samples and step seconds of the steps done before each (``step`` of
    them), from the run's step records: all devices' counts once a DDP run's ranks are merged, so the ranks
    need no collective to count."""
    tokens, samples, seconds = [0], [0], [0.0]
    for record in steps:
        tokens.append(tokens[-1] + record["tokens"])
        samples.append(samples[-1] + record["samples"])
        seconds.append(seconds[-1] + record["step_time_s"])
    done = len(steps)
    return [{**row, "tokens": tokens[min(row["step"], done)], "samples": samples[min(row["step"], done)],
             "train_s": seconds[min(row["step"], done)]} for row in evals]
