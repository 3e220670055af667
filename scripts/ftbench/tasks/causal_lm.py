"""Causal language modelling (task ``causal_lm``): a decoder (Llama-like); loss = next-token cross-entropy
over the real tokens; quality = eval loss, perplexity and next-token accuracy. The one family whose packed
batching is exact (batching.py says why)."""

from __future__ import annotations

import numpy as np

from ftbench.tasks.base import IGNORE_INDEX, TokenisedSplit
from ftbench.tasks.text import TextFamily, TokenAccumulator


class CausalLM(TextFamily):
    name = "causal_lm"
    auto_model = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    packable = True
    not_packable = ""

    def add_labels(self, inputs: dict, rows: TokenisedSplit, ids: np.ndarray, mask: np.ndarray) -> None:
        import torch  # deferred: the registry is read at parse time, torch-free

        # The model shifts labels by one inside; padded positions are ignored by the loss.
        inputs["labels"] = torch.from_numpy(np.where(mask == 1, ids, IGNORE_INDEX))

    def eval_accumulator(self):
        return TokenAccumulator(shift=True)


FAMILY = CausalLM()
