"""The model task types a config's ``task:`` key names, and what each needs.

- classification: an encoder (BERT-like) with a new classification head; loss = cross-entropy over
  classes; quality = accuracy.
- causal_lm: a decoder (Llama-like); loss = next-token cross-entropy over the real tokens; quality =
  eval loss, perplexity and next-token accuracy.
- seq2seq: an encoder-decoder (T5-like); loss = cross-entropy over the target tokens.
- image_classification: a vision encoder (ViT-like) with a classification head; loss = cross-entropy
  over classes; quality = accuracy. Data: images (``images.py``), no text.
- image_text_retrieval: an image-text dual encoder (CLIP/SigLIP-like); loss = the model's contrastive
  loss; quality = image->text and text->image recall@1. Data: images and captions (``retrieval.py``).
- vision_language: a LLaVA-style decoder (a vision tower, a projector and a language model) trained on
  image + prompt -> answer; loss = next-token cross-entropy over the answer tokens; quality = eval loss,
  perplexity and token accuracy over the answer tokens. Data: images and text (``vision_language.py``).

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
    modality: str = "text"  # "image": the data is images (prepared and batched by images.py)
    head_modules: tuple[str, ...] = ()  # new output layers LoRA must train in full (when peft has no task type)

    def model_class(self):
        import transformers

        return getattr(transformers, self.auto_model)


TASKS = {
    "classification": Task("classification", "AutoModelForSequenceClassification", "SEQ_CLS", ("label_column",)),
    "causal_lm": Task("causal_lm", "AutoModelForCausalLM", "CAUSAL_LM", ()),
    "seq2seq": Task("seq2seq", "AutoModelForSeq2SeqLM", "SEQ_2_SEQ_LM", ("target_column",)),
    # peft has no image task type: the new head is named instead (ViT's and most image models' "classifier").
    "image_classification": Task("image_classification", "AutoModelForImageClassification", "", (), "image",
                                 ("classifier",)),
    # No new head: the towers' projections are the model's own (retrieval.py batches, scores and prepares it).
    "image_text_retrieval": Task("image_text_retrieval", "AutoModel", "", (), "image"),
    # LoRA targets only the language model (and the projector when named): vision_language.lora_target_modules.
    "vision_language": Task("vision_language", "AutoModelForImageTextToText", "", (), "image"),
}
IMAGE_TASKS = tuple(name for name, task in TASKS.items() if task.modality == "image")


# ViT's defaults, for a model config that names no image or patch size.
DEFAULT_IMAGE_SIZE = 224
DEFAULT_PATCH_SIZE = 16


def image_tokens_per_image(model_config: dict | None, image_size: int | None) -> int:
    """Patch tokens plus the class token a ViT-style encoder makes of one image at ``image_size``
    (null: the config's own size). Reads a config dict only: the resource estimate uses it at parse time.
    A dual encoder's (CLIP's) vision settings are its ``vision_config``."""
    model_config = model_config or {}
    model_config = model_config.get("vision_config") or model_config
    size = int(image_size or model_config.get("image_size", DEFAULT_IMAGE_SIZE))
    return (size // int(model_config.get("patch_size", DEFAULT_PATCH_SIZE))) ** 2 + 1


# A LLaVA model's vision towers and the class tokens each puts before its patch tokens.
VISION_CLASS_TOKENS = {"clip_vision_model": 1, "siglip_vision_model": 0}
# LlavaConfig's vision tower when a config names none (CLIP ViT-L/14 at 336), and CLIPVisionConfig's defaults.
LLAVA_DEFAULT_VISION = {"model_type": "clip_vision_model", "image_size": 336, "patch_size": 14}
CLIP_VISION_DEFAULTS = {"image_size": 224, "patch_size": 32}


def vision_language_image_tokens(model_config: dict | None, image_size: int | None) -> int:
    """Image tokens a LLaVA-style model puts in its text per image at ``image_size`` (null: the vision
    tower's own): the vision tower's patches plus its class token, less the first token when
    vision_feature_select_strategy is 'default' (LLaVA's get_image_features drops it). Reads a config dict
    only (parse time; preparation passes ``config.to_dict()``, where every default is filled in)."""
    model_config = model_config or {}
    vision = {**CLIP_VISION_DEFAULTS, **(model_config.get("vision_config") or LLAVA_DEFAULT_VISION)}
    size = int(image_size or vision["image_size"])
    tokens = (size // int(vision["patch_size"])) ** 2 + VISION_CLASS_TOKENS.get(vision.get("model_type"), 1)
    return tokens - 1 if model_config.get("vision_feature_select_strategy", "default") == "default" else tokens


def model_task(model_def: dict) -> str:
    return model_def.get("task", "classification")
