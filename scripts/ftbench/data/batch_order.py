"""Which examples each step of a run takes, and how packed rows are filled: numpy only, so that the memory plan
(at parse time, torch-free) sees the very batches the trainer will draw.

- ``batch_order``: a seeded reshuffle each epoch, the last incomplete global batch dropped (``pad``, ``pack``,
  ``padding_free``).
- ``grouped_order``: ``group_by_length``: the same examples per epoch, but the shuffle is cut into mega-batches of
  ``MEGA_BATCHES`` global batches, each sorted by length and cut into batches, whose order is then shuffled.
- ``pack_rows``: first fit decreasing of a batch's sequences into rows of ``seq_len`` tokens (``pack``), or all in
  one row (``padding_free``).
- ``largest_packed_batch``: the token positions of the run's largest packed micro-batch, the one that sets its
  memory peak. A packed batch holds its sequences' real tokens, so its size follows the lengths drawn: over a
  run's hundreds of batches the largest holds a fifth more than the mean one (seen: rotten tomatoes reviews,
  64 per batch, 30 steps: 3,217 real tokens against a mean of 2,628), and an estimate from the mean length was
  low by as much (H100: estimate / measured 0.74-0.83 on the packed and padding-free rows).
"""

from __future__ import annotations

import numpy as np

from ftbench.runspec import RunSpec

MEGA_BATCHES = 50  # global batches per length-sorted mega-batch: large enough to find similar lengths,
# small enough that a batch's examples still come from a random 50-batch slice of the epoch
# Packed batches whose rows are counted exactly (first fit decreasing) when looking for the largest: the ones
# holding the most real tokens. Rows follow real tokens closely (a row wastes less than its shortest sequence),
# so the largest packed batch is among these; counting every batch of a long run would cost seconds.
PACKED_CANDIDATES = 16


def batch_order(num_examples: int, global_batch: int, count: int, seed: int):
    """Yield ``count`` index arrays of ``global_batch`` examples, reshuffled each epoch (seeded, so every
    DDP rank sees the same order and takes its own slice).

    The last incomplete batch of an epoch is dropped so every measured step has the same shape.
    """
    rng = np.random.default_rng(seed)
    produced = 0
    while produced < count:
        order = rng.permutation(num_examples)
        for start in range(0, num_examples - global_batch + 1, global_batch):
            yield order[start : start + global_batch]
            produced += 1
            if produced == count:
                return


def grouped_order(lengths: np.ndarray, global_batch: int, count: int, seed: int):
    """Like ``batch_order`` (seeded reshuffle each epoch, last incomplete batch dropped), with each batch drawn
    from examples of similar length."""
    rng = np.random.default_rng(seed)
    mega = global_batch * MEGA_BATCHES
    produced = 0
    while produced < count:
        order = rng.permutation(len(lengths))
        usable = order[: len(order) - len(order) % global_batch]  # the same examples batch_order keeps
        batches = []
        for start in range(0, len(usable), mega):
            chunk = usable[start : start + mega]
            # Stable sort: ties keep their shuffled order, so equal lengths are not always batched together.
            chunk = chunk[np.argsort(-lengths[chunk], kind="stable")]
            batches.extend(chunk[i : i + global_batch] for i in range(0, len(chunk), global_batch))
        for index in rng.permutation(len(batches)):
            yield batches[index]
            produced += 1
            if produced == count:
                return


def run_order(spec: RunSpec, num_examples: int, total_steps: int, lengths: np.ndarray | None = None):
    """The global batches of the run's micro-steps (each cut into ``batch_size`` rows per device), as its
    ``batching`` draws them; ``lengths`` (every training row's) is read by group_by_length only."""
    global_batch, count = spec.batch_size * spec.devices, total_steps * spec.grad_accum_steps
    if spec.batching == "group_by_length":
        return grouped_order(np.asarray(lengths), global_batch, count, spec.seed)
    return batch_order(num_examples, global_batch, count, spec.seed)


def pack_rows(lengths: list[int], capacity: int | None) -> list[list[int]]:
    """Sequence indices per row: first fit decreasing into rows of ``capacity`` tokens; None: one row."""
    if capacity is None:
        return [list(range(len(lengths)))]
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        need = lengths[index]
        for row, space in enumerate(free):
            if need <= space:
                rows[row].append(index)
                free[row] -= need
                break
        else:
            if need > capacity:
                raise ValueError(f"a sequence of {need} tokens does not fit a packed row of {capacity}")
            rows.append([index])
            free.append(capacity - need)
    return rows


def packed_shape(lengths: list[int], capacity: int | None) -> tuple[int, int]:
    """(rows, row width) of a packed batch as collated: the rows first fit decreasing makes, each padded to the
    fullest row (padding_free: one row of every token)."""
    rows = pack_rows(lengths, capacity)
    return len(rows), max(sum(lengths[i] for i in row) for row in rows)


def largest_packed_batch(spec: RunSpec, lengths: np.ndarray) -> tuple[int, int]:
    """(token positions, row width) of the run's packed micro-batch with the most positions, over the batches
    its order draws for its planned steps (``spec.batching`` pack or padding_free; ``lengths``: the training
    split's rows)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    micro = spec.batch_size
    batches = [chunk for batch in run_order(spec, len(lengths), spec.planned_steps(len(lengths)), lengths)
               for chunk in np.split(batch, len(batch) // micro)]
    real = np.array([int(lengths[chunk].sum()) for chunk in batches])
    capacity = spec.seq_len if spec.batching == "pack" else None
    largest = (0, 0)
    for index in np.argsort(-real, kind="stable")[:PACKED_CANDIDATES]:
        rows, width = packed_shape([int(n) for n in lengths[batches[index]]], capacity)
        largest = max(largest, (rows * width, width))
    return largest
