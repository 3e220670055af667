"""Batching and scoring by task name, for the training loop (trainer, evaluation, batch-size search): each
call goes to the task's family (registry.py), where the work is."""

from __future__ import annotations

import numpy as np

from ftbench.tasks.base import IGNORE_INDEX, Batch, TokenisedSplit  # noqa: F401 - the loop's names for them
from ftbench.tasks.registry import family


def collate(task: str, split, indices: np.ndarray, pad_token_id: int) -> Batch:
    """One padded batch of ``split``'s rows at ``indices``, as the task's family makes it."""
    return family(task).collate(split, indices, pad_token_id)


def eval_accumulator(task: str):
    """What scores a task's eval batches (``add(output, batch)``, then ``result()``)."""
    return family(task).eval_accumulator()
