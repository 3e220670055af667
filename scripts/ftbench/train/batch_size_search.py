"""auto_batch_size: the largest per-device batch that fits, found by trying."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ftbench.tasks import registry
from ftbench.train.devices import autocast_args, synchronize
from ftbench.train.optimizers import make_grad_scaler, make_optimizer
from ftbench.train.run_state import Run


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


@dataclass(frozen=True)
class BatchSearch:
    """Where a run's batch-size search found the memory boundary (per device)."""

    found: int | None  # None: not even a batch of 1 fits
    oom_at: int | None  # None: nothing ran out of memory up to the cap
    trials: list[list]
    cap: int
    seconds: float

    def figures(self) -> dict:
        return {"auto_batch_size_found": self.found, "auto_batch_size_oom_at": self.oom_at,
                "auto_batch_size_trials": self.trials, "auto_batch_size_cap": self.cap,
                "auto_batch_size_time_s": self.seconds}


def find_largest_batch(run: Run) -> BatchSearch:
    """Try one full training step (forward, backward, optimizer step) at growing batch sizes per device,
    catching out-of-memory errors.

    The trials use a throwaway optimizer with learning rate 0 (the weights do not move, yet its state is
    allocated, as in the real run) on the run's longest sequences. They run eagerly (no torch.compile)
    and, in DDP, on each rank's model before it is wrapped (no gradient all-reduce, so a rank that runs
    out of memory cannot leave the others waiting); the ranks then agree on the smallest batch any of
    them found.
    """
    spec, device, dist, split = run.spec, run.device, run.dist, run.train_split
    devices = spec.devices
    per_process = devices // dist.world_size  # DataParallel feeds all devices from one process
    cap = spec.auto_batch_size_cap(len(split))
    trial_model = run.model
    if spec.parallel == "dp" and device.type == "cuda" and devices > 1:
        trial_model = torch.nn.DataParallel(run.model, device_ids=list(range(devices)))
    order = _longest_first(split)
    autocast = autocast_args(device, spec.precision)

    def step(batch_size: int, optimizer, scaler) -> None:
        indices = order[np.arange(batch_size * per_process) % len(order)]
        batch = registry.family(run.task).collate(split, indices, run.pad_id).to(device)
        run.injector.check_batch(batch_size)
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
        scaler = make_grad_scaler(spec, device)
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
    return BatchSearch(found, oom_at, trials, cap, time.perf_counter() - started)


def _longest_first(split) -> np.ndarray:
    """Row indices, longest sequences first (the padded batch shape is the worst case for memory); split
    order for a split read from disk, whose lengths are not in memory."""
    input_ids = getattr(split, "input_ids", None)
    if input_ids is None:
        return np.arange(len(split))
    return np.argsort([-len(ids) for ids in input_ids], kind="stable")
