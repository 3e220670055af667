"""Tokenizer loading, task-neutral: where a model's tokenizer comes from, loading it, and the vocabulary a
config-built model takes from it. Preparation (tasks/) and model building (train/modeling.py) both use it."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from ftbench.data.sources import load_failure, pretrained_args, resolve_location
from ftbench.errors import ConfigError, FtbenchError, SourceError

# Pad id for synthetic data of a model without a tokenizer: synthetic sequences are never padded, so
# any id below the random-token range works.
SYNTHETIC_PAD_ID = 0


def tokenizer_source(model_def: dict) -> dict | None:
    """The tokenizer's source: the checkpoint's own, or for a config-built model the one it names (or none)."""
    source = model_def["source"]
    return source.get("tokenizer") if source["kind"] == "config" else source


def _tokenizer_file(source: dict, name: str) -> Path | None:
    """A file of a tokenizer's folder, local or in the hub cache (never fetched); None when not there."""
    if source.get("gguf_file"):
        return None
    if source["kind"] == "hub":
        cached = try_to_load_from_cache(source["name"], name, revision=source.get("revision"))
        return Path(cached) if isinstance(cached, str) else None
    try:
        path = Path(resolve_location(source)) / name
    except FtbenchError:
        return None
    return path if path.is_file() else None


def tokenizer_file_vocab(source: dict | None, extra_tokens: tuple[str, ...] = ()) -> int | None:
    """len(tokenizer) as the tokenizer's files give it, read without loading it (parse time: ~5 ms for a
    30k-token tokenizer.json): the model's vocabulary and its added tokens, plus ``extra_tokens`` preparation
    adds where the tokenizer lacks them. None where there is no tokenizer.json to read (a hub tokenizer not in
    the cache, a slow-only tokenizer): the model's job checks then, with the tokenizer loaded."""
    path = _tokenizer_file(source, "tokenizer.json") if source else None
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        vocab = data["model"].get("vocab")
        names = {entry[0] for entry in vocab} if isinstance(vocab, list) else set(vocab or {})
        ids = set(range(len(vocab))) if isinstance(vocab, list) else set((vocab or {}).values())
        ids |= {token["id"] for token in data.get("added_tokens") or []}
        names |= {token["content"] for token in data.get("added_tokens") or []}
        settings = _tokenizer_file(source, "tokenizer_config.json")
        if settings is not None:
            ids |= {int(key) for key in json.loads(settings.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # a layout this reader does not know: the job loads the tokenizer and checks
    return len(ids) + len(set(extra_tokens) - names) if ids else None


def check_vocab(model_name: str, model_def: dict, key: str, explicit: int | None, extra_tokens: tuple[str, ...] = ()) -> None:
    """Parse time: a config-built model's explicit vocabulary (``key`` under its overrides) must be its
    tokenizer's (with the ``extra_tokens`` preparation adds), where the tokenizer's files can be read cheaply."""
    source = tokenizer_source(model_def)
    if explicit is None or model_def["source"]["kind"] != "config" or source is None:
        return
    size = tokenizer_file_vocab(source, extra_tokens)
    if size is not None and explicit != size:
        raise ConfigError(vocab_refusal(model_name, key, explicit, size))


def vocab_refusal(model_name: str, key: str, explicit: int, tokenizer_vocab: int) -> str:
    return (f"config key models.{model_name}.source.overrides.{key}: {explicit}, but the model's tokenizer has "
            f"{tokenizer_vocab} tokens; remove {key} (a config-built model takes its tokenizer's vocabulary) or make "
            "them equal")


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
    if extra.get("gguf_file"):
        _header_special_tokens(tokenizer, Path(location) / extra["gguf_file"])
    if tokenizer.pad_token_id is None:
        # Decoder tokenizers ship without a pad token; padded positions are masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.unk_token
    return tokenizer


def _header_special_tokens(tokenizer, path: Path) -> None:
    """A GGUF tokenizer's bos and eos tokens as its header gives their ids. transformers' conversion of a GPT-2-style
    GGUF vocabulary takes the bos token for the eos (5.17: SmolLM2-135M-Instruct's eos came out <|im_start|>, its
    header says <|im_end|>), and an eos appended to a text or a completion would then be the wrong token."""
    from gguf import GGUFReader  # deferred: GGUF checkpoints only

    fields = GGUFReader(path).fields
    for key, attribute in (("tokenizer.ggml.bos_token_id", "bos_token"), ("tokenizer.ggml.eos_token_id", "eos_token")):
        field = fields.get(key)
        if field is not None:
            setattr(tokenizer, attribute, tokenizer.convert_ids_to_tokens(int(field.parts[field.data[0]][0])))


def config_vocab(model_name: str, overrides: dict, tokenizer_vocab: int) -> int:
    """A config-built model's vocabulary is its tokenizer's: an architecture's default (GPT-2's 50,257)
    beside a tokenizer of 30,522 would train embeddings no token ever reaches, or index past the table.
    A vocab_size set explicitly must agree with the tokenizer."""
    explicit = overrides.get("vocab_size")
    if explicit is not None and explicit != tokenizer_vocab:
        raise ConfigError(vocab_refusal(model_name, "vocab_size", explicit, tokenizer_vocab))
    return tokenizer_vocab
