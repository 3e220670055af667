"""Tokenizer loading, task-neutral: where a model's tokenizer comes from, loading it, and the vocabulary a
config-built model takes from it. Preparation (tasks/) and model building (train/modeling.py) both use it."""

from __future__ import annotations

from ftbench.data.sources import load_failure, pretrained_args
from ftbench.errors import ConfigError, SourceError

# Pad id for synthetic data of a model without a tokenizer: synthetic sequences are never padded, so
# any id below the random-token range works.
SYNTHETIC_PAD_ID = 0


def tokenizer_source(model_def: dict) -> dict | None:
    """The tokenizer's source: the checkpoint's own, or for a config-built model the one it names (or none)."""
    source = model_def["source"]
    return source.get("tokenizer") if source["kind"] == "config" else source


def config_vocab_size(model_def: dict) -> int | None:
    return model_def["source"].get("overrides", {}).get("vocab_size") if model_def["source"]["kind"] == "config" else None


def load_tokenizer(model_def: dict):
    """The model's tokenizer, or None for a config-built model without one (synthetic data only)."""
    source = tokenizer_source(model_def)
    if source is None:
        return None
    # Imported only now: AutoTokenizer pulls in transformers' Auto model classes and generation (3 s of a
    # data job on 2 cores), which a config-built model's synthetic data never needs.
    from transformers import AutoTokenizer

    location, extra = pretrained_args(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **extra)
    except (OSError, ValueError) as exc:
        raise SourceError(load_failure("tokenizer", source, location, exc)) from None
    if tokenizer.pad_token_id is None:
        # Decoder tokenizers ship without a pad token; padded positions are masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def config_vocab(model_name: str, overrides: dict, tokenizer_vocab: int) -> int:
    """A config-built model's vocabulary is its tokenizer's: an architecture's default (GPT-2's 50,257)
    beside a tokenizer of 30,522 would train embeddings no token ever reaches, or index past the table.
    A vocab_size set explicitly must agree with the tokenizer."""
    explicit = overrides.get("vocab_size")
    if explicit is not None and explicit != tokenizer_vocab:
        raise ConfigError(
            f"config key models.{model_name}.source.overrides.vocab_size: {explicit}, but the tokenizer the data was "
            f"prepared with has {tokenizer_vocab} tokens; remove vocab_size (the model then takes the tokenizer's) or "
            "make them equal"
        )
    return tokenizer_vocab
