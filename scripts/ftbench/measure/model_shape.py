"""A transformer's shape as its config gives it: width, layers, MLP width, attention heads, vocabulary.

The one reader of these fields, for the resource estimate at parse time (a checkpoint's config.json,
read without importing transformers) and for the FLOP and memory estimates (``model.config.to_dict()``).
Architectures name the fields differently (GPT-2 ``n_embd``, T5 ``d_model``): a config.json keeps each
architecture's own names, so every field is read from the first of its names that is set. A transformers
config object also maps its own names to the usual ones (``attribute_map``); ``from_transformers_config``
applies that map first, so it reads what the object's attributes say. Imports nothing heavy.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
INTERMEDIATE_KEYS = ("intermediate_size", "d_ff", "n_inner", "encoder_ffn_dim", "ffn_dim")
HEAD_KEYS = ("num_attention_heads", "num_heads", "n_head")


@dataclass(frozen=True)
class ConfigShape:
    width: int  # hidden size; 0 when the config does not say
    layers: int  # layers of the model's stack (of the encoder, for an encoder-decoder); 0 when unknown
    decoder_layers: int  # an encoder-decoder's decoder layers; 0 for other models
    intermediate: int  # MLP width
    heads: int  # attention heads; 0 when unknown
    vocab_size: int | None

    @property
    def attention_layers(self) -> int:
        """Attention layers a token passes through (both stacks of an encoder-decoder)."""
        return self.layers + self.decoder_layers

    @property
    def encoder_layers(self) -> int:
        """An encoder-decoder's encoder layers; 0 for other models."""
        return self.layers if self.decoder_layers else 0


def from_config(settings: dict | None) -> ConfigShape:
    """The shape from a config dict (config.json, or ``PretrainedConfig.to_dict()``); None gives zeros.

    A multimodal config keeps its language model's fields in ``text_config``: those count."""
    settings = settings or {}
    settings = {**settings, **(settings.get("text_config") or {})}
    width = _first(settings, WIDTH_KEYS, 0)
    layers = _first(settings, LAYER_KEYS, 0)
    decoder_layers = 0
    if settings.get("is_encoder_decoder"):
        # T5 names its decoder stack num_decoder_layers, BART decoder_layers; unset: as deep as the encoder.
        decoder_layers = _first(settings, ("num_decoder_layers", "decoder_layers"), layers)
    return ConfigShape(
        width=width,
        layers=layers,
        decoder_layers=decoder_layers,
        # GPT-2 style configs leave the MLP width unset: four times the width.
        intermediate=_first(settings, INTERMEDIATE_KEYS, 4 * width),
        heads=_first(settings, HEAD_KEYS, 0),
        vocab_size=settings.get("vocab_size") or None,
    )


def from_transformers_config(config) -> ConfigShape:
    """The shape of a loaded model's config object (``model.config``); None gives zeros."""
    if config is None:
        return from_config(None)
    settings = config.to_dict()
    mapped = {usual: settings[own] for usual, own in getattr(config, "attribute_map", {}).items() if own in settings}
    return from_config({**settings, **mapped})


def _first(settings: dict, keys: tuple[str, ...], default: int) -> int:
    """The first key set to a positive number (some configs give per-layer lists: those do not count)."""
    return next((int(settings[key]) for key in keys if _is_count(settings.get(key))), default)


def _is_count(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


# --- parameter counts from the shape alone (the memory plan reads them before anything is built) -------------

# transformers' defaults of the config classes a config-built model names (``source.architecture``), for the keys
# its overrides leave out; read here without importing transformers (which imports torch).
ARCHITECTURE_DEFAULTS = {
    "LlamaConfig": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "vocab_size": 32000, "tie_word_embeddings": False, "hidden_act": "silu"},
    "MistralConfig": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False},
    "Qwen2Config": {"model_type": "qwen2", "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 151936, "tie_word_embeddings": False},
    "BertConfig": {"model_type": "bert", "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 12, "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2,
                   "hidden_dropout_prob": 0.1},
    "ViTConfig": {"model_type": "vit", "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                  "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3},
    "GPT2Config": {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
                   "n_positions": 1024, "resid_pdrop": 0.1, "tie_word_embeddings": True},
}
GATED_TYPES = ("llama", "mistral", "qwen2", "gemma", "phi3", "olmo", "granite")  # RMSNorm, gated MLP
ENCODER_LINEARS = ("query", "key", "value", "dense")  # BERT/ViT attention, then attention output, MLP in, MLP out


def with_defaults(architecture: str | None, settings: dict | None) -> dict:
    """A config's settings over its architecture's defaults (a config.json already holds them all)."""
    return {**ARCHITECTURE_DEFAULTS.get(architecture or "", {}), **(settings or {})}


def gated(settings: dict) -> bool:
    """RMSNorm and a gated MLP (Llama-family decoders); else LayerNorm and a plain MLP."""
    return settings.get("model_type") in GATED_TYPES


def block_linears(settings: dict) -> list[tuple[str, int, int]]:
    """(name, input width, output width) of one block's Linear layers, named as the architecture names them."""
    shape = from_config(settings)
    width, inter = shape.width, shape.intermediate
    if gated(settings):
        heads = shape.heads or 1
        kv = _first(settings, ("num_key_value_heads",), heads) * (width // heads)
        return [("q_proj", width, width), ("k_proj", width, kv), ("v_proj", width, kv), ("o_proj", width, width),
                ("gate_proj", width, inter), ("up_proj", width, inter), ("down_proj", inter, width)]
    return [("query", width, width), ("key", width, width), ("value", width, width), ("dense", width, width),
            ("dense", width, inter), ("dense", inter, width)]


def block_parameters(settings: dict) -> int:
    """Parameters of one block: its Linears (with biases where the architecture has them) and its two norms."""
    linears = block_linears(settings)
    width = from_config(settings).width
    weights = sum(fan_in * fan_out for _, fan_in, fan_out in linears)
    if gated(settings):
        return weights + 2 * width  # no biases (Llama), two RMSNorm weights
    return weights + sum(fan_out for _, _, fan_out in linears) + 4 * width  # biases; two LayerNorms


def embedding_parameters(settings: dict) -> int:
    """The input side: token (or patch) embeddings, learned positions, the final norm."""
    shape = from_config(settings)
    width = shape.width
    if settings.get("model_type") == "vit":
        patch, channels = settings.get("patch_size", 16), settings.get("num_channels", 3)
        tokens = (settings.get("image_size", 224) // patch) ** 2 + 1
        return channels * patch * patch * width + width + (tokens + 1) * width + 2 * width
    positions = 0 if gated(settings) else _first(settings, ("max_position_embeddings", "n_positions"), 0) * width
    token_types = settings.get("type_vocab_size", 0) * width  # BERT's segment embeddings
    pooler = width * width + width if settings.get("model_type") == "bert" else 0  # BERT's pooler (a classifier's input)
    return (shape.vocab_size or 0) * width + positions + token_types + pooler + (1 if gated(settings) else 2) * width
# ---------------------------------------------------------------------------------------------------
# A GGUF checkpoint's shape, from its header (a GGUF folder has no config.json)

# GGUF metadata key (after "<architecture>.") -> the config.json name from_config reads.
GGUF_KEYS = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers", "feed_forward_length": "intermediate_size",
             "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
             "context_length": "max_position_embeddings", "vocab_size": "vocab_size"}


def gguf_settings(path: str | Path) -> dict | None:
    """A GGUF file's shape as config.json names it (hidden_size, num_hidden_layers, ..., vocab_size: the
    tokenizer's token count where the header gives no vocab_size), read from the metadata at the start of the
    file only: gguf.GGUFReader maps and parses every tensor too (1.7 s for a 98 MB file on 2 cores; this reads
    the header in 60 ms, 140 ms with the gguf import). None when the file is not GGUF or cannot be read."""
    metadata = gguf_header(path)
    if metadata is None:
        return None
    architecture = metadata.get("general.architecture")
    settings = {name: metadata[f"{architecture}.{key}"] for key, name in GGUF_KEYS.items() if f"{architecture}.{key}" in metadata}
    settings.setdefault("vocab_size", metadata.get("tokenizer.ggml.tokens"))
    return {key: value for key, value in settings.items() if value is not None} or None


def gguf_header(path: str | Path, tensor_names: bool = False) -> dict | None:
    """A GGUF file's metadata (key -> scalar or string; an array's value is its length), read from the start of
    the file only; with ``tensor_names``, also ``"tensors"``: the names of its tensors (their infos follow the
    metadata). None when the file is not GGUF or cannot be read."""
    # gguf deferred: only GGUF models need its constants, and this module is read at parse time.
    from gguf import GGUF_MAGIC, GGUFValueType

    try:
        with open(path, "rb") as handle:
            magic, version = struct.unpack("<II", handle.read(8))
            if magic != GGUF_MAGIC or version < 2:
                return None
            tensor_count, kv_count = struct.unpack("<QQ", handle.read(16))
            metadata = _gguf_metadata(handle, kv_count, GGUFValueType)
            if tensor_names:
                metadata["tensors"] = [_gguf_tensor_name(handle) for _ in range(tensor_count)]
            return metadata
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return None


def _gguf_tensor_name(handle) -> str:
    """One tensor info's name; its dimensions, type and offset skipped."""
    (length,) = struct.unpack("<Q", handle.read(8))
    name = handle.read(length).decode("utf-8")
    (dims,) = struct.unpack("<I", handle.read(4))
    handle.seek(8 * dims + 4 + 8, 1)
    return name


def gguf_config(path: str | Path) -> dict | None:
    """A GGUF checkpoint's settings as its config.json would give them, for a plan from the config alone: the shape
    (gguf_settings), its model_type (the header's architecture) and whether its output layer is the embedding
    (no ``output.weight`` tensor: tied, as transformers' GGUF loader reads it). None when not readable."""
    header = gguf_header(path, tensor_names=True)
    settings = gguf_settings(path) if header else None
    if not settings:
        return None
    return {**settings, "model_type": header.get("general.architecture"),
            "tie_word_embeddings": "output.weight" not in header["tensors"]}


_SCALARS = {"UINT8": "B", "INT8": "b", "UINT16": "H", "INT16": "h", "UINT32": "I", "INT32": "i", "FLOAT32": "f",
            "BOOL": "?", "UINT64": "Q", "INT64": "q", "FLOAT64": "d"}


def _gguf_metadata(handle, count: int, types) -> dict:
    """Key -> value of the header's scalars and strings; an array's value is its length (elements skipped)."""
    def string() -> str:
        (length,) = struct.unpack("<Q", handle.read(8))
        return handle.read(length).decode("utf-8")

    def value(kind: int):
        name = types(kind).name
        if name == "STRING":
            return string()
        if name == "ARRAY":
            (element, length) = struct.unpack("<IQ", handle.read(12))
            element_name = types(element).name
            if element_name in _SCALARS:
                handle.seek(length * struct.calcsize("<" + _SCALARS[element_name]), 1)
            else:
                for _ in range(length):
                    value(element)
            return length
        fmt = "<" + _SCALARS[name]
        return struct.unpack(fmt, handle.read(struct.calcsize(fmt)))[0]

    metadata = {}
    for _ in range(count):
        key = string()
        (kind,) = struct.unpack("<I", handle.read(4))
        metadata[key] = value(kind)
    return metadata
