"""Evaluation: during training (eval_every), with the clock paused, and after training within the job's
time, with the memory peaks of training and evaluation kept apart.

- During training (``DuringTraining``): every eval_every optimizer steps, and once before the first, the
  device is synchronised, the clock paused, a fixed seeded eval subset scored (eval_subset examples, the
  same for every run), the time spent recorded apart (eval_during_training_s), and the clock resumed: the
  next step's time starts after it, and the measured window's seconds leave it out (``paused_within``), so
  tokens/s is that of the steps alone. The GPU sampler (measure.gpu_monitor) is paused with the clock, so the
  window's energy, power and utilisation leave the evaluations out too (``measure_with``). Its batches are no
  larger than a training batch, so its memory stays under a training step's. A DDP run evaluates on rank 0
  (the unwrapped model: no collective) and every rank learns the stop decision from it (``agree``); an fsdp
  run evaluates on every rank (a sharded forward).
  Each evaluation becomes rows of evals.parquet (measure.metrics.EVAL_FIELDS), the final one too.

- Before training (``eval_before_training``): the model as built is scored before the first step, on the final
  evaluation's examples at its batch size, so the base figures (base_eval_*) and the final ones differ only in
  the weights. It is a pause like those above (engines, ranks and the clock alike; it is the step-0 row of
  evals.parquet with eval_every, in place of that step's subset evaluation), its time is base_eval_time_s, and
  the memory peaks are reset after it: a forward pass at eval_batch_size must not become training's peak.
  Where the workflow computed it once for every run that starts from the same weights (rule base_eval,
  train/base_eval_job.py), the job names that result in FTBENCH_BASE_EVAL and the run takes its figures
  (``read_shared_base``) instead of scoring; base_eval_time_s is then the shared evaluation's time.

- Which rows (``score``): every evaluation that scores part of the eval split (max_eval_samples, eval_subset,
  one cut short by the job's time limit) scores a seeded stratified sample of it, never its first rows by
  position: the rows are taken in ``eval_order`` (prepared.fair_order over the family's classes, the same for
  every run), whose every prefix holds each class in its share. max_eval_samples is its first rows, eval_subset
  the first of those. Where a time limit may end it, the rows planned are scored in rounds (``rounds``: a probe,
  then the rest at once where it fits, else ROUND_BATCHES batches at a time; longest first within a round, for
  little padding), and it ends only between rounds, so the rows scored are again a prefix of eval_order. The
  row's majority-class rate is that of the rows scored.

- A run stopped by the job's time limit (status timeout) is evaluated too: its row carries the accuracy
  of the model it trained, with the steps it did. The job keeps a margin for this (job.stop_signal);
  evaluation scores rounds while another one fits in what is left of it, keeping WRITE_RESERVE for
  writing the results, and ``eval_samples`` says how many examples were scored.
- Evaluation has a memory peak of its own (its batch size, no optimizer), so it must not raise the
  training figure: peak_rss_mb / the CUDA peaks are read when training ends, then the peaks are reset
  and evaluation's is stored apart (eval_peak_memory_mb).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from ftbench.data import prepared
from ftbench.experiment import base_evaluation
from ftbench.measure.intervals import wilson
from ftbench.tasks import registry
from ftbench.tasks.base import SAMPLES_OF, is_proportion, reaches
from ftbench.tasks.generation import SCORE as GENERATION_SCORE
from ftbench.train import batching
from ftbench.train.devices import autocast_args, local_gpus, synchronize

# Statuses whose model is evaluated: trained to its end, or to the job's time limit.
EVALUATED = ("ok", "timeout")
# Share of the job's evaluation margin kept for writing the results after the last eval batch.
WRITE_RESERVE = 0.25
# The seed of eval_order: fixed, not the run's, so every run and repeat scores the same examples.
EVAL_ORDER_SEED = 0
# The shared evaluation before training a train job reads (rule base_eval's output), where the workflow made one.
SHARED_BASE_ENV = "FTBENCH_BASE_EVAL"
# Batches of one round of an evaluation a time limit may end (between rounds), where the rest may not fit at once:
# sorted by length within a round of 4 batches, batches pad about as little as sorted over the whole split.
ROUND_BATCHES = 4


def peak_rss_mb() -> float | None:
    """The process's resident-memory high-water mark since start or the last reset_peak_rss (VmHWM)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Start a new resident-memory high-water mark (Linux >= 4.0: /proc/self/clear_refs, value 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class EvalBudget:
    """Whether another part of an evaluation (score's rounds) fits before ``limit`` (time.monotonic() at which the
    job ends), keeping ``reserve`` seconds for writing; a part is expected to take its units (rows, batches) times
    the slowest unit of the parts so far."""

    def __init__(self, limit: float | None, reserve: float, clock=time.monotonic):
        self.limit, self.reserve, self.clock = limit, reserve, clock
        self.slowest = 0.0
        self.last = None
        self.last_units = 1

    def another_batch_fits(self, units: int = 1) -> bool:
        """Whether a part of ``units`` units fits (asked before each part; the time since the last ask is that
        of the part then asked for, when it was scored)."""
        now = self.clock()
        if self.last is not None:
            self.slowest = max(self.slowest, (now - self.last) / self.last_units)
        self.last, self.last_units = now, max(units, 1)
        return self.limit is None or now + self.slowest * units + self.reserve < self.limit


def evaluate_run(run, evaluate, metrics: dict, may_stop_early: bool = True, steps_done: int | None = None) -> None:
    """Evaluate ``run`` (a trainer.Run) with ``evaluate`` within the job's time, into ``metrics``: its
    figures, its time and its own memory peak; a note in status_reason when the time limit cut it short.
    Call after the training figures (and their peaks) were taken. ``may_stop_early`` False: score every
    batch (a sharded model evaluates on every rank, and ranks that stopped at different batches would
    wait for each other in the next all-gather)."""
    local_gpus = [run.device.index] if run.device.type == "cuda" else []
    for index in local_gpus:
        synchronize(run.device)
        torch.cuda.reset_peak_memory_stats(index)
    rss_reset = reset_peak_rss()
    stop = run.stop
    budget = EvalBudget(stop.limit, WRITE_RESERVE * stop.margin if stop.limit else 0.0)
    started = time.perf_counter()
    figures = evaluate(run.model, run.eval_split, run.spec, run.task, run.device, run.pad_id,
                       another_batch_fits=budget.another_batch_fits if may_stop_early else None)
    figures["eval_time_s"] = time.perf_counter() - started
    if run.spec.dataset_def["source"]["kind"] == "synthetic":
        figures["eval_majority_class_rate"] = None  # random labels: no majority class to read a score against
    if local_gpus:
        figures["eval_peak_memory_mb"] = max(torch.cuda.max_memory_allocated(i) for i in local_gpus) / 2**20
    elif rss_reset:
        figures["eval_peak_memory_mb"] = peak_rss_mb()
    if steps_done is not None:  # the final evaluation is the last row of evals.parquet
        evaluation = len({row["evaluation"] for row in metrics.get("evals", [])})
        metrics.setdefault("evals", []).extend(eval_rows(registry.family(run.task).run_eval_metrics(run.spec), figures, evaluation,
                                                         steps_done, "full", figures["eval_time_s"]))
    planned = figures.pop("eval_samples_planned")
    answered = figures.get(SAMPLES_OF.get(GENERATION_SCORE, ""), figures["eval_samples"])
    if figures["eval_samples"] < planned or answered < figures["eval_samples"]:
        note = (f"evaluated on a seeded stratified {figures['eval_samples']} of {planned} eval samples"
                f"{f', answers generated for {answered} of them' if answered < figures['eval_samples'] else ''} (the "
                "job's time limit)")
        metrics["status_reason"] = f"{metrics['status_reason']}; {note}" if metrics.get("status_reason") else note
    metrics.update(figures)


def eval_order(split, task: str) -> np.ndarray:
    """Every row of an eval split in the order partial evaluations take them: a seeded order (EVAL_ORDER_SEED, the
    same for every run) stratified by the family's classes (prepared.fair_order), so that its first k rows are a
    seeded stratified sample of the split, whatever order the split itself is in."""
    return prepared.fair_order(registry.family(task).row_strata(split), len(split), EVAL_ORDER_SEED)


def read_shared_base(spec) -> dict | None:
    """The shared evaluation before training this job was given (SHARED_BASE_ENV), if it scored these weights
    (its key is the run's) and succeeded; None otherwise, saying why where one was given: the run then scores
    its model itself."""
    path = os.environ.get(SHARED_BASE_ENV)
    if not path:
        return None
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        result = {"status": "unreadable", "reason": str(exc)}
    key = json.loads(json.dumps(base_evaluation.base_eval_key(spec), sort_keys=True, default=str))
    if result.get("status") == "ok" and result.get("key") == key:
        return result
    why = result.get("reason") if result.get("status") != "ok" else "it scored other weights (another key)"
    print(f"ftbench: the shared evaluation before training {path} is not this run's ({why}): evaluating before "
          "training in this job", flush=True)
    return None


def subset_indices(size: int, subset: int | None, strata: np.ndarray | None = None) -> np.ndarray:
    """The eval rows an evaluation during training scores (eval_subset): the first ``subset`` of the split's ``size``
    rows in eval_order (``strata``: the family's row_strata), so a seeded stratified sample, the same rows for every
    run and the first of those max_eval_samples takes; in row order; all rows when subset is None or larger."""
    if subset is None or subset >= size:
        return np.arange(size)
    return np.sort(prepared.fair_order(strata, size, EVAL_ORDER_SEED)[:subset])


@torch.no_grad()
def score(model, split, spec, task: str, device, pad_id: int, another_round_fits=None,
          indices: np.ndarray | None = None) -> dict:
    """Scores of ``model`` on the eval split's rows at ``indices`` (default: its first max_eval_samples rows of
    eval_order) and the majority-class rate of the rows scored. ``another_round_fits(rows)`` (a time limit's
    EvalBudget, asked before each round: ``rounds``) may end it between rounds: the rows scored are then the first
    rounds' (a prefix of the rows planned, in eval_order: a stratified sample too); None: every row is scored, as
    one round. Rows are scored longest first within a round (no score depends on the order)."""
    family = registry.family(task)
    planned = eval_order(split, task)[: spec.max_eval_samples] if indices is None else np.asarray(indices)
    lengths = batching.lengths_of(split)
    scores, scored = family.eval_accumulator(), []
    model.eval()
    for start, end in rounds(len(planned), spec.eval_batch_size, another_round_fits):
        rows = planned[start:end]
        rows = rows[np.argsort(-lengths[rows], kind="stable")]
        for first in range(0, len(rows), spec.eval_batch_size):
            batch = family.collate(split, rows[first : first + spec.eval_batch_size], pad_id).to(device)
            with torch.autocast(**autocast_args(device, spec.precision)):
                output = model(**batch.inputs)
            scores.add(output, batch)
        scored.append(rows)
    scored_rows = np.concatenate(scored) if scored else np.zeros(0, dtype=np.int64)
    # Answers generated for the same rows (a generating family's answer_metric), timed apart: eval_generation_s.
    generated = family.generation_scores(model, split, np.sort(scored_rows), spec, device, pad_id, another_round_fits,
                                         autocast_args(device, spec.precision))
    model.train()
    return {"eval_samples": len(scored_rows), "eval_samples_planned": len(planned), **scores.result(), **generated,
            "eval_majority_class_rate": majority_rate(family.row_classes(split), scored_rows)}


def rounds(rows: int, batch_size: int, fits=None):
    """(start, end) of each round of an evaluation's ``rows`` planned rows, while ``fits(rows)`` (a time limit's
    EvalBudget; asked before each round, its estimate from the rounds so far) says the next one fits: one round of
    them all without a limit; with one, a probe of a quarter batch first (nothing is timed yet), then the rest in
    one round where twice its estimate fits (the usual case: no more padding than scoring all at once), else
    rounds of ROUND_BATCHES batches."""
    if fits is None:
        if rows:
            yield 0, rows
        return
    start, size = 0, max(1, batch_size // 4)
    while start < rows:
        if start and fits(2 * (rows - start)):
            yield start, rows
            return
        end = min(start + size, rows)
        if not fits(end - start):
            return
        yield start, end
        start, size = end, ROUND_BATCHES * batch_size


def majority_rate(classes: np.ndarray | None, rows: np.ndarray) -> float | None:
    """The share of the most common class among ``rows`` (the accuracy of always answering it: what an accuracy
    on those rows is read against); None without classes or rows."""
    if classes is None or len(rows) == 0:
        return None
    return float(np.unique(np.asarray(classes)[rows], return_counts=True)[1].max() / len(rows))


def eval_rows(metrics: tuple[str, ...], scores: dict, evaluation: int, step: int, scope: str, eval_s: float) -> list[dict]:
    """The evals.parquet rows of one evaluation: one per eval figure in ``metrics`` that ``scores`` has, with
    its 95% Wilson interval on the examples scored where it is a proportion (counts and train_s are filled in
    from the step records when the job writes them: measure.metrics.with_counts)."""
    rows = []
    for metric in metrics:
        value = scores.get(metric)
        if value is None:
            continue
        n = int(scores.get(SAMPLES_OF.get(metric, "eval_samples")) or 0)  # the rows this figure was computed on
        low, high = wilson(float(value), n) if is_proportion(metric) and n > 0 and 0 <= value <= 1 else (None, None)
        rows.append({"evaluation": evaluation, "step": step, "eval_s": eval_s, "scope": scope, "eval_samples": n,
                     "metric": metric, "value": float(value), "low": low, "high": high})
    return rows


class DuringTraining:
    """eval_every and eval_before_training: evaluations between optimizer steps, outside the timed window (the
    module's docstring).
    ``evaluate``: trainer.evaluate; ``agree(flag)``: whether the flag holds on any rank (every rank calls
    ``pause`` at the same step, so the ranks skip, and stop, together)."""

    def __init__(self, run, evaluate, agree=lambda flag: flag):
        spec = run.spec
        self.run, self.evaluate, self.agree = run, evaluate, agree
        self.every = spec.eval_every
        self.target = spec.target if spec.stop_at_target else None
        self._indices = None  # the eval_subset rows (subset_indices), chosen at the first evaluation during training
        self.metrics = registry.family(run.task).run_eval_metrics(spec)
        self.before_training = spec.eval_before_training
        self.shared_base = read_shared_base(spec) if self.before_training else None
        self.rows: list[dict] = []
        self.pauses: list[tuple[float, float]] = []  # (start, end) of each subset evaluation, time.perf_counter()
        self.base_pause: tuple[float, float] | None = None  # the same of the evaluation before training
        self.base_figures: dict = {}  # base_eval_* of the model as built (eval_before_training)
        self.loading_peak_rss_mb: float | None = None  # the resident peak before the base evaluation reset it
        self.evaluated = 0  # pauses that evaluated (one near the deadline skips it)
        self.meeting: tuple[float, float] | None = None  # the ranks' meeting before the first step (_meet)
        self.sampler = None  # the measured window's gpu_monitor.GpuSampler (measure_with), paused with the clock

    def measure_with(self, sampler) -> None:
        """The engine's GPU sampler (gpu_monitor.GpuSampler, made after this object): every evaluation pauses it
        as it pauses the clock, so energy per token counts the steps' energy alone, as tokens/s counts their time.
        One before the window starts (the base evaluation) pauses nothing: the sampler ignores it."""
        self.sampler = sampler

    def due(self, steps_done: int, total_steps: int) -> bool:
        """Whether to evaluate before the next step: before the first with eval_before_training, and every
        eval_every steps from the first (the final evaluation follows the last step), a few steps before the
        final one too: the quality target is read off these points, and one left out can move where, or
        whether, a run reaches it."""
        if steps_done == 0 and self.before_training:
            return True
        return self.every is not None and steps_done < total_steps and steps_done % self.every == 0

    def pause(self, steps_done: int, may_stop: bool, since: float | None = None) -> bool:
        """Evaluate now with the clock paused (from ``since``, the last step's end, so no moment between steps
        is lost to either); whether the run stops here, having reached the target (only when ``may_stop``: the
        measured window has begun, so the run has a throughput)."""
        if steps_done == 0 and self.before_training:
            if self.shared_base is not None:
                self._take_shared_base(since)
            else:
                self._pause_for_base(since)
            return False  # nothing was trained to reach a target yet
        run = self.run
        last = self.pauses[-1][1] - self.pauses[-1][0] if self.pauses else 0.0
        stop = False
        with self._clock_paused(since, self.pauses.append):
            # An evaluation that might not end before the deadline is skipped: the final one needs that time.
            near = run.stop.deadline is not None and time.monotonic() + 2 * last >= run.stop.deadline
            if not self.agree(near):
                self.evaluated += 1
                scoring = time.perf_counter()
                scores = self._score() if run.dist.rank == 0 or run.spec.parallel == "fsdp" else {}
                eval_s = time.perf_counter() - scoring
                if run.dist.rank == 0:
                    self.rows.extend(eval_rows(self.metrics, scores, self._evaluations(), steps_done, "subset", eval_s))
                metric = self.target["metric"] if self.target else None
                stop = self.agree(may_stop and metric is not None and reaches(metric, scores.get(metric), self.target["value"]))
        return stop

    @contextlib.contextmanager
    def _clock_paused(self, since: float | None, record):
        """The bracket of every evaluation between steps: the device synchronised at both ends, and
        ``record((start, end))`` given its span, from ``since`` (the last step's end) when there is one. The GPU
        sampler is paused between the synchronisations: the steps' kernels are done, the evaluation's not begun."""
        synchronize(self.run.device)
        started = time.perf_counter() if since is None else since
        if self.sampler is not None:
            self.sampler.pause()
        yield
        synchronize(self.run.device)
        if self.sampler is not None:
            self.sampler.resume()
        record((started, time.perf_counter()))

    def _pause_for_base(self, since: float | None) -> None:
        """The evaluation before training (eval_before_training), with the clock paused from ``since`` as ``pause``
        does: rank 0 scores (every rank under fsdp), and no rank starts training before it is done."""
        run = self.run
        sharded = run.spec.parallel == "fsdp"
        with self._clock_paused(since, lambda span: setattr(self, "base_pause", span)):
            scoring = time.perf_counter()
            scores = self._score_base(sharded) if run.dist.rank == 0 or sharded else {}
            eval_s = time.perf_counter() - scoring
            if run.dist.rank == 0 and self.every is not None:
                self.rows.extend(eval_rows(self.metrics, scores, self._evaluations(), 0, "full", eval_s))
            self._meet()  # a DDP rank waits here for rank 0's scoring, not inside its first step
        if scores:
            scores.pop("eval_samples_planned")
            scores.pop("eval_majority_class_rate", None)  # the row's is the final evaluation's (its rows' rate)
            self.base_figures = {f"base_{name}": value for name, value in scores.items()}
            self.base_figures["base_eval_time_s"] = self.base_pause[1] - self.base_pause[0]

    def _take_shared_base(self, since: float | None) -> None:
        """The evaluation before training computed once for every run of these weights (``shared_base``): its
        figures and step-0 row, no scoring here. The ranks still meet once, as after the evaluation scored here."""
        with self._clock_paused(since, lambda span: setattr(self, "base_pause", span)):
            scores = dict(self.shared_base["figures"])
            if self.run.dist.rank == 0 and self.every is not None:
                self.rows.extend(eval_rows(self.metrics, scores, self._evaluations(), 0, "full",
                                           self.shared_base["eval_time_s"]))
            self._meet()
        if self.run.dist.rank == 0:
            scores.pop("eval_samples_planned", None)
            scores.pop("eval_majority_class_rate", None)
            self.base_figures = {f"base_{name}": value for name, value in scores.items()}
            self.base_figures["base_eval_time_s"] = self.shared_base["eval_time_s"]

    def _meet(self) -> None:
        """The ranks' one meeting before the first step (``agree`` is a collective: a barrier). Its span on this rank,
        from arriving to leaving (time.monotonic(): one clock for the ranks of a host), is the rank's rank_meeting_s:
        no rank leaves before the last one arrived."""
        arrived = time.monotonic()
        self.agree(False)
        self.meeting = (arrived, time.monotonic())

    def _score_base(self, sharded: bool) -> dict:
        """The model as built, scored like the final evaluation: the same examples, eval_batch_size. It ends early
        only at the job's training deadline (base_eval_samples then says how many were scored), and never under
        fsdp, whose ranks must score the same batches (each forward all-gathers from all)."""
        run = self.run
        fits = None if sharded else EvalBudget(run.stop.deadline, 0.0).another_batch_fits
        with training_layout_kept(run.model), peaks_reset_after(run.device, local_gpus(run.spec, run.device)) as peak:
            scores = self.evaluate(run.model, run.eval_split, run.spec, run.task, run.device, run.pad_id,
                                   another_batch_fits=fits)
        self.loading_peak_rss_mb = peak
        return scores

    def _evaluations(self) -> int:
        """Evaluations so far: the next one's index in evals.parquet."""
        return len(self.pauses) + (self.base_pause is not None)

    @property
    def resumed(self) -> float:
        """When the clock resumed after the last evaluation (time.perf_counter()): the next step starts there."""
        return self.pauses[-1][1] if self.pauses else self.base_pause[1]

    @property
    def paused_s(self) -> float:
        """Seconds of every evaluation between steps, the base one included: none of it is training's time."""
        return sum(b - a for a, b in self._all_pauses())

    def training_peak_rss_mb(self) -> float | None:
        """Training's resident-memory peak (read when training ends): the process's since the base evaluation
        reset it, or loading's before it if that was higher; the process's own without a base evaluation."""
        peaks = [peak for peak in (self.loading_peak_rss_mb, peak_rss_mb()) if peak is not None]
        return max(peaks) if peaks else None

    def _all_pauses(self) -> list[tuple[float, float]]:
        return ([self.base_pause] if self.base_pause else []) + self.pauses

    def _score(self) -> dict:
        run = self.run
        # Batches no larger than a training batch: a forward without gradients then stays under a training
        # step's memory, so the run's training peaks are not raised by it.
        spec = run.spec.replace(eval_batch_size=min(run.spec.eval_batch_size, run.spec.batch_size))
        if self._indices is None:
            size, subset = len(run.eval_split), run.spec.eval_subset
            strata = registry.family(run.task).row_strata(run.eval_split) if subset is not None and subset < size else None
            self._indices = subset_indices(size, subset, strata)
        with training_layout_kept(run.model):
            return self.evaluate(run.model, run.eval_split, spec, run.task, run.device, run.pad_id, indices=self._indices)

    def paused_within(self, start: float | None, end: float | None) -> float:
        """Seconds of the evaluations between ``start`` and ``end`` (the measured window's ends)."""
        if start is None or end is None:
            return 0.0
        return sum(b - a for a, b in self._all_pauses() if a >= start and b <= end)

    def figures(self) -> dict:
        """For the run's metrics: the base figures (eval_before_training), and with eval_every the evaluations'
        rows and the subset evaluations' count and time."""
        figures = dict(self.base_figures)
        if self.meeting is not None and self.run.dist.world_size > 1:  # a rank's own figure: merge_ranks takes it off
            figures["rank_meeting_s"] = list(self.meeting)
        if self.every is not None:
            figures.update(evals=self.rows, evaluations_during_training=self.evaluated,
                           eval_during_training_s=sum(b - a for a, b in self.pauses))
        return figures


@contextlib.contextmanager
def peaks_reset_after(device, gpus: list[int]):
    """Around an evaluation before training: the memory peaks (CUDA's on ``gpus``, the process's resident
    high-water mark) are reset after it, so those read when training ends are the steps'. Yields the resident
    peak reached before it (loading's), which the reset loses: the caller keeps it."""
    synchronize(device)
    before = peak_rss_mb()
    try:
        yield before
    finally:
        synchronize(device)
        for index in gpus:
            torch.cuda.reset_peak_memory_stats(index)
        reset_peak_rss()


@contextlib.contextmanager
def training_layout_kept(model):
    """Keep QLoRA's 4-bit weights in their training layout through an evaluation between steps: on a CPU with
    AVX512-BF16, bitsandbytes repacks a 4-bit layer's weight for inference the first time it runs in eval mode
    without gradients (support_avx512bf16_for_cpu), for good, and the training steps after it then take the
    inference kernel and fail (an in-place bias add on a tensor that requires grad). The final evaluation, after
    training, may repack."""
    layers = [module for module in model.modules() if getattr(module, "support_avx512bf16_for_cpu", False)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    try:
        yield
    finally:
        for layer in layers:
            layer.support_avx512bf16_for_cpu = True
