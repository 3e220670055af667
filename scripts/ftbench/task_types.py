"""The model task types a config's ``task:`` key names, and what each needs.

- classification: an encoder (BERT-like) with a new classification head; loss = cross-entropy over
  classes; quality = accuracy.
- causal_lm: a decoder (Llama-like); loss = next-token cross-entropy over the real tokens; quality =
  eval loss, perplexity and next-token accuracy.
- seq2seq: an encoder-decoder (T5-like); loss = cross-entropy over the target tokens.

Imports nothing heavy: config validation uses it at parse time. How each type is batched and scored is
in ``batching.py``; how its model is built is in ``modeling.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    name: str
    auto_model: str  # transformers Auto class
    peft_task_type: str  # peft TaskType member
    needs: tuple[str, ...]  # dataset keys this task requires

    def model_class(self):
        import transformers

        return getattr(transformers, self.auto_model)


TASKS = {
    "classification": Task("classification", "AutoModelForSequenceClassification", "SEQ_CLS", ("label_column",)),
    "causal_lm": Task("causal_lm", "AutoModelForCausalLM", "CAUSAL_LM", ()),
    "seq2seq": Task("seq2seq", "AutoModelForSeq2SeqLM", "SEQ_2_SEQ_LM", ("target_column",)),
}


def model_task(model_def: dict) -> str:
    return model_def.get("task", "classification")
