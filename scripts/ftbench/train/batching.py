"""How a run's examples become batches (the ``batching`` setting), beyond plain padding.

- ``pad``: each batch padded to its longest row (the task family's ``collate``), batches drawn from a seeded shuffle.
- ``group_by_length``: batches of similar lengths (data/batch_order.py draws them), so little padding; every
  example is still seen once per epoch, and DDP ranks still take their own slice of the same global batch.
- ``pack``: the batch's sequences are packed into rows of up to ``seq_len`` tokens (first fit, longest
  first: data/batch_order.py's ``pack_rows``, which the memory plan reads too). ``padding_free``: all of the
  batch's sequences in one row, no padding.

Packed rows carry no attention mask: ``position_ids`` restart at 0 for each sequence, and transformers'
masking utilities (``masking_utils.find_packed_sequence_indices``, sdpa / eager / flex attention; flash
attention reads the same position ids) turn that into a block-diagonal causal mask, so no token attends
across sequences. A packed row's tail padding is one more such "sequence" whose labels are ignored. The
label of each sequence's first token is ignored too: unpacked, nothing predicts it either; the family's
``sequence_labels`` give each sequence's labels (instruction: its prompt ignored as well, by the mask stored with
the shard). Hence the loss of a packed batch equals the unpacked one (tests/test_batching.py shows it per
sequence). This is for decoders (causal_lm, instruction) only: encoder masks in transformers do not read packed position ids, and classification would
need a per-sequence pooling; config.check_run refuses the other families (``packable`` false) with their reason.

Every sequence of a batch counts its own real length in the attention FLOPs (``sum_squared_lengths``), so
packing never inflates the FLOP count.
"""

from __future__ import annotations

import numpy as np
import torch

from ftbench.data.batch_order import pack_rows
from ftbench.tasks.base import Batch, IGNORE_INDEX
from ftbench.tasks.registry import family


def lengths_of(split) -> np.ndarray:
    """Input length of every row of a split (in memory or on disk)."""
    return np.asarray(split.lengths(), dtype=np.int64)


def collate_packed(task: str, split, indices: np.ndarray, pad_token_id: int, capacity: int | None) -> Batch:
    """The batch's sequences packed into rows (see the module docstring); ``padded_tokens`` is rows x the
    longest row, ``capacity_tokens`` rows x ``capacity`` (padding_free: the row itself)."""
    fam = family(task)
    if not fam.packable:
        raise ValueError(f"packing {task}: {fam.not_packable}")
    taken = split.take(indices)
    sequences, sequence_labels = taken.input_ids, fam.sequence_labels(taken)
    lengths = [len(seq) for seq in sequences]
    rows = pack_rows(lengths, capacity)
    width = max(sum(lengths[i] for i in row) for row in rows)
    ids = np.full((len(rows), width), pad_token_id, dtype=np.int64)
    labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for index in row:
            seq, n = sequences[index], lengths[index]
            ids[r, at : at + n] = seq
            labels[r, at : at + n] = sequence_labels[index]  # its first token ignored: nothing of its own predicts it
            positions[r, at : at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(width - at)  # the tail padding: a sequence of its own, ignored by the loss
    real = int(sum(lengths))
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    inputs = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(positions),
              "labels": torch.from_numpy(labels)}
    return Batch(inputs=inputs, samples=len(sequences), real_tokens=real, padded_tokens=int(ids.size),
                          sum_squared_lengths=int((lengths_arr * lengths_arr).sum()),
                          capacity_tokens=len(rows) * (capacity if capacity is not None else width),
                          trained_tokens=int((labels != IGNORE_INDEX).sum()) if fam.masks_tokens else 0)


def collate(task: str, split, indices: np.ndarray, pad_token_id: int, mode: str, seq_len: int) -> Batch:
    """One micro-batch as the run's ``batching`` makes it."""
    if mode == "pack":
        return collate_packed(task, split, indices, pad_token_id, seq_len)
    if mode == "padding_free":
        return collate_packed(task, split, indices, pad_token_id, None)
    return family(task).collate(split, indices, pad_token_id)


def packing_efficiency(steps: list[dict]) -> float | None:
    """Real tokens / row capacity over the measured steps of a packed run; None for unpacked runs."""
    measured = [s for s in steps if s["measured"] and s.get("capacity_tokens")]
    capacity = sum(s["capacity_tokens"] for s in measured)
    return sum(s["tokens"] for s in measured) / capacity if capacity else None


@torch.no_grad()
def check_isolation(model: torch.nn.Module, device: torch.device, tolerance: float = 1e-2) -> None:
    """Refuse a packed run whose model would let tokens attend across packed sequences: a model (or
    attention implementation) that ignores packed position ids; transformers also ignores them while a KV
    cache is on, which build_model turns off. One small forward pass: a sequence alone,
    then the same sequence packed after another one, must give the same logits."""
    from ftbench.errors import UnsupportedConfiguration

    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    first, second = (torch.randint(1, vocab, (1, n), generator=generator) for n in (5, 7))
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        alone = model(input_ids=second.to(device)).logits.float()
        packed = model(input_ids=torch.cat([first, second], 1).to(device), position_ids=positions.to(device)).logits[:, 5:].float()
    finally:
        model.train(was_training)
    gap = float((alone - packed).abs().max() / alone.abs().max().clamp_min(1e-6))
    if gap > tolerance:
        raise UnsupportedConfiguration(
            f"packed sequences are not kept apart by this model's attention ({type(model).__name__}, attn "
            f"{getattr(model.config, '_attn_implementation', None)}): logits differ by {gap:.2g} of their scale when "
            "another sequence is packed before; use batching group_by_length")
