"""A transformer's shape as its config gives it: width, layers, MLP width, attention heads, vocabulary.

The one reader of these fields, for the resource estimate at parse time (a checkpoint's config.json,
read without importing transformers) and for the FLOP and memory estimates (``model.config.to_dict()``).
Architectures name the fields differently (GPT-2 ``n_embd``, T5 ``d_model``): a config.json keeps each
architecture's own names, so every field is read from the first of its names that is set. A transformers
config object also maps its own names to the usual ones (``attribute_map``); ``from_transformers_config``
applies that map first, so it reads what the object's attributes say. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

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
