"""Instruction fine-tuning two ways on the same rows: TRL's SFTTrainer and ftbench.

``check`` (CPU, seconds): does ftbench train on the tokens SFTTrainer trains on? For the first rows of each dataset
format of TRL's documentation (language modelling, prompt-completion, conversational, conversational
prompt-completion), under two chat templates (ChatML as SmolLM2-Instruct renders it, and Llama 3's), it compares

- the token ids and the trained-token mask of every row: SFTTrainer's prepared ``input_ids`` and ``labels != -100``
  against ftbench's prepared shards (the instruction family's ``prepare``, i.e. ``tasks.instruction_rows.encode_row``),
  position by position (the first position excluded: nothing predicts it, in either);
- the first optimizer step's loss, in fp32, over one batch holding all those rows: SFTTrainer's own training step
  (``train()``) against ftbench's own (``train.trainer.train_run`` on the prepared shards), both from the same
  checkpoint; and again with packing (SFTTrainer ``packing=True``, best-fit decreasing and padding-free: the loss its
  step computes on its first packed batch; ftbench ``batching: pack``, its first step), which must keep the masks and
  the sequence boundaries and so give the same loss.

SFTTrainer's settings are the ones matching ftbench's defaults: ``completion_only_loss`` (its default) for
prompt-completion data, ``assistant_only_loss=True`` for conversations, gradient checkpointing off, fp32. TRL computes an
assistant-only mask only from a template with ``{% generation %}`` markers: Llama 3's template it recognises and swaps
for its own marked copy; for ChatML (SmolLM2's template has no markers, and TRL refuses to guess) it is given this
script's ChatML with markers around each assistant turn's tokens after the generation prompt, checked to render every
row exactly as the plain one does.

The tokenizer is byte-level BPE trained here on the rows themselves (no download), with both templates' special
tokens; the model a two-layer Llama built from its config with seeded weights, saved once and loaded by both ways.

``speed`` (GPU): tokens/s and peak allocated memory of SFTTrainer and of ftbench on one configuration: a Llama shape
built from its config (random weights; the same shapes as compare_ecosystem.py), full fine-tuning or LoRA, bf16
autocast, the same batch, seq_len, packing setting and synthetic instruction rows, each way in a process of its own.
Warmup steps are excluded, the device is synchronised before each clock reading, and tokens are the rows' real tokens
(no padding). Packing: SFTTrainer packs the dataset into rows of ``seq_len`` (``packing=True``: best-fit decreasing,
then padding-free, all of a batch's rows in one) and its batch counts packed rows; ftbench's ``batching: pack`` packs a
batch's sequences into rows of ``seq_len`` and its batch counts sequences, so ftbench is given the batch of sequences
that fills as many packed rows (both ways' tokens per step are printed). Attention: the model's default (sdpa) in
both unless ``--attn`` names another; with sdpa a padding-free row spans the whole batch, so flash_attention_2 (where
flash-attn is installed) is the setting SFTTrainer's packing is meant for. Where the two differ by design:
SFTTrainer computes its loss with a fused LM head over the trained positions only (no batch x seq x vocabulary
logits tensor, no LM-head matmul on prompt tokens), ftbench through the model's own loss over every position.

    python scripts/compare_sft.py check
    python scripts/compare_sft.py speed --shape 1b --method full --batch 4 --seq 2048 --packing
    python scripts/compare_sft.py speed --shape 8b --method lora --batch 2 --seq 2048 --packing

Needs TRL (requirements-compare.txt, installed with ``--no-deps``), peft and datasets. ``check`` exits 1 when a pair
disagrees; ``speed`` when a way fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ftbench.tasks.instruction_rows import FORMATS, common_prefix_length  # the installed package (pip install -e .)

ROOT = Path(__file__).resolve().parents[1]

TEMPLATES = ("chatml", "llama3")
LOSS_TOLERANCE = 1e-3  # fp32: the two ways' first-step losses must agree this closely
CHECK_SEQ_LEN = 128
SEED = 0

# The first rows of each format: short, varied (a system turn or none, two assistant turns, punctuation at the
# prompt/completion boundary, a completion already ending in a newline).
CHECK_ROWS = {
    "language_modeling": [
        {"text": "The quick brown fox jumps over the lazy dog."},
        {"text": "Rotten Tomatoes collects reviews of films; each one is fresh or rotten."},
        {"text": "A short line"},
        {"text": "Tokens are counted without padding, and trained tokens apart from processed ones.\n"},
    ],
    "prompt_completion": [
        {"prompt": "Is this review positive or negative? A warm, funny film.", "completion": " positive"},
        {"prompt": "What is the capital of France?", "completion": " Paris."},
        {"prompt": "Translate to French: good morning\n", "completion": "bonjour\n"},
        {"prompt": "Add 2 and 3.", "completion": " The sum is 5, so the answer is #### 5"},
    ],
    "conversational": [
        {"messages": [{"role": "user", "content": "Is this review positive or negative? A dull, slow film."},
                      {"role": "assistant", "content": "negative"}]},
        {"messages": [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": "What colour is the sky?"},
                      {"role": "assistant", "content": "Blue."}]},
        {"messages": [{"role": "user", "content": "Name a fruit."},
                      {"role": "assistant", "content": "An apple."},
                      {"role": "user", "content": "Another one?"},
                      {"role": "assistant", "content": "A pear, then."}]},
        {"messages": [{"role": "user", "content": "Say hello."},
                      {"role": "assistant", "content": "Hello!"}]},
    ],
    "conversational_prompt_completion": [
        {"prompt": [{"role": "user", "content": "Is this review positive or negative? Superb cast."}],
         "completion": [{"role": "assistant", "content": "positive"}]},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many legs has a cat?"}],
         "completion": [{"role": "assistant", "content": "Four."}]},
        {"prompt": [{"role": "user", "content": "Spell cat backwards."}],
         "completion": [{"role": "assistant", "content": "tac"}]},
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"}],
         "completion": [{"role": "assistant", "content": "Goodbye!"}]},
    ],
}

# The special tokens of both templates, and each tokenizer's roles for them (as SmolLM2-Instruct and Llama 3 Instruct
# ship them: SmolLM2 adds no BOS and pads with its end-of-turn token; Llama 3 adds its BOS and has a pad token).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|finetune_right_pad_id|>"]
TOKENIZER_ROLES = {
    "chatml": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "add_bos": False},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|finetune_right_pad_id|>",
               "add_bos": True},
}
CHATML_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Beside a checkpoint: the template SFTTrainer is given for conversations, where it is not the tokenizer's own.
TRL_TEMPLATE_FILE = "trl_chat_template.jinja"

# initializer_range 0.2, not Llama's 0.02: the per-token losses of a model that close to uniform all sit near
# ln(vocabulary) (spread 0.15), so a token trained by one way and not the other could hide inside the loss tolerance;
# at 0.2 they spread by ~1.9 and one token more or less in a batch of ~50 moves the mean loss by ~0.04.
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True,
              "initializer_range": 0.2}


# ---------------------------------------------------------------------------------------------------------------
# Templates, tokenizer and model (offline)


def chatml_template(generation_markers: bool) -> str:
    """ChatML as SmolLM2-Instruct's template renders it (a default system turn where the conversation has none).
    With ``generation_markers``, each assistant turn's tokens after the generation prompt (its content and its
    ``<|im_end|>`` line end) sit between ``{% generation %}`` markers: the span TRL's assistant-only mask trains."""
    start, end = ("{% generation %}", "{% endgeneration %}") if generation_markers else ("", "")
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "{{ '<|im_start|>system\\n" + CHATML_DEFAULT_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        + start + "{{ message['content'] + '<|im_end|>\\n' }}" + end +
        "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


def llama3_template() -> str:
    """Llama 3's chat template as TRL ships it for recognising it (trl/chat_templates/llama3.jinja): TRL swaps in its
    own copy with generation markers for assistant_only_loss, so the user's template is the plain one."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / "llama3.jinja").read_text(encoding="utf-8")


def plain_template(style: str) -> str:
    return chatml_template(False) if style == "chatml" else llama3_template()


def corpus_of(rows_by_format: dict) -> list[str]:
    """Every string the rows and the templates hold: the BPE tokenizer's training text."""
    texts = [CHATML_DEFAULT_SYSTEM, "system user assistant"]
    for rows in rows_by_format.values():
        for row in rows:
            for value in row.values():
                texts.extend([value] if isinstance(value, str) else [m["content"] for m in value])
    return texts


def build_tokenizer(folder: Path, style: str, texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer trained on ``texts`` (GPT-2's pre-tokenisation, as Llama 3's and SmolLM2's are),
    the special tokens of both templates, ``style``'s roles for them and its plain chat template; saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    roles = TOKENIZER_ROLES[style]
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(texts, trainer)
    if roles["add_bos"]:
        bos = roles["bos_token"]
        model.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                             special_tokens=[(bos, model.token_to_id(bos))])
    else:
        model.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token=roles["bos_token"],
                                        eos_token=roles["eos_token"], pad_token=roles["pad_token"])
    tokenizer.chat_template = plain_template(style)
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_checkpoint(folder: Path, style: str, rows_by_format: dict, vocab_size: int = 600):
    """The check's checkpoint in ``folder``: a tokenizer trained on the rows with ``style``'s template, the template
    SFTTrainer is given for it (``TRL_TEMPLATE_FILE``: ChatML with generation markers), and a tiny Llama."""
    tokenizer = build_tokenizer(folder, style, corpus_of(rows_by_format), vocab_size)
    if style == "chatml":
        (folder / TRL_TEMPLATE_FILE).write_text(chatml_template(True), encoding="utf-8")
    return save_tiny_llama(folder, tokenizer)


def checkpoint_from_tokenizer(folder: Path, tokenizer_dir: str, trl_template: str | None):
    """The check's checkpoint on a tokenizer of the user's (a folder holding one, e.g. SmolLM2-Instruct's saved
    from its GGUF file): the tokenizer copied, ``trl_template`` (``chatml``: this script's ChatML with generation
    markers; or a Jinja file) as the template SFTTrainer gets, and a tiny Llama of its vocabulary."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(folder)
    if trl_template:
        text = chatml_template(True) if trl_template == "chatml" else Path(trl_template).read_text(encoding="utf-8")
        (folder / TRL_TEMPLATE_FILE).write_text(text, encoding="utf-8")
    return save_tiny_llama(folder, tokenizer)


def save_tiny_llama(folder: Path, tokenizer):
    """A two-layer Llama of the tokenizer's vocabulary with seeded fp32 weights, saved beside it; the tokenizer."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**TINY_LLAMA, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return tokenizer


# ---------------------------------------------------------------------------------------------------------------
# TRL's way


def sft_trainer(folder: Path, dataset, row_format: str, seq_len: int, packing: bool, out: Path, model=None,
                peft_config=None, callbacks=(), **settings):
    """SFTTrainer as a user sets it up for ``dataset`` (a datasets.Dataset), with the settings that match ftbench's
    defaults (module docstring; ``settings``: SFTConfig's others), the tokenizer and model of ``folder`` (and for
    conversations its ``TRL_TEMPLATE_FILE`` where there is one); its dataset is prepared when it returns
    (``trainer.train_dataset``)."""
    import torch
    import transformers
    from trl import SFTConfig, SFTTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    conversational = row_format.startswith("conversational")
    template = folder / TRL_TEMPLATE_FILE if conversational and (folder / TRL_TEMPLATE_FILE).is_file() else None
    config = SFTConfig(**{
        "output_dir": str(out), "max_length": seq_len, "packing": packing, "per_device_train_batch_size": len(dataset),
        "max_steps": 1, "learning_rate": 2e-4, "lr_scheduler_type": "constant", "warmup_steps": 0, "seed": SEED,
        "assistant_only_loss": row_format == "conversational", "gradient_checkpointing": False, "bf16": False,
        "fp16": False, "chat_template_path": str(template) if template else None, "report_to": [],
        "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True, "dataloader_num_workers": 0,
        "use_cpu": not torch.cuda.is_available(), **settings})
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config, callbacks=list(callbacks))
    trainer.remove_callback(transformers.PrinterCallback)  # its end-of-training dict on stdout: this script prints its own
    return trainer


def trl_rows(trainer) -> list[tuple[list[int], list[int]]]:
    """(token ids, trained mask) of each prepared row, in the rows' order (SFTTrainer shuffles only when asked)."""
    return [(list(row["input_ids"]), [int(label != -100) for label in row["labels"]]) for row in trainer.train_dataset]


def record_losses(trainer) -> list[float]:
    """The loss of every micro-batch SFTTrainer trains on, as its training step computes and backpropagates it."""
    losses: list[float] = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, *args, **kwargs):
        loss = compute_loss(model, inputs, *args, **kwargs)
        losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = recording
    return losses


def trl_first_loss(trainer) -> float:
    """The loss of SFTTrainer's first optimizer step (one batch, one micro-batch)."""
    losses = record_losses(trainer)
    trainer.train()
    return losses[0]


def trl_first_batch_loss(trainer) -> float:
    """SFTTrainer's loss on its first batch as its training step computes it (its data loader, collator and
    ``compute_loss``), without the step's update, which comes after the loss: the first-step loss at the cost of a
    forward pass (a whole ``train()`` also pays a garbage collection of the process at its end)."""
    import torch

    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, batch))


def trl_side(folder: Path, style: str, data: Path, row_format: str, seq_len: int, scratch: Path) -> dict:
    """SFTTrainer's prepared rows and its first-step loss on the dataset folder's train split: unpacked through its
    training loop (``train()``), packed through the same step's loss on its first packed batch."""
    import datasets

    dataset = datasets.load_from_disk(str(data))["train"]
    out = scratch / f"trl-{style}-{row_format}"
    out.mkdir(parents=True, exist_ok=True)
    # On the CPU as ftbench's side of the check is, on a machine with a GPU too: one device's fp32 arithmetic for both.
    trainer = sft_trainer(folder, dataset, row_format, seq_len, False, out, use_cpu=True)
    prepared = trl_rows(trainer)
    return {"rows": prepared, "loss": trl_first_loss(trainer),
            "packed_loss": trl_first_batch_loss(sft_trainer(folder, dataset, row_format, seq_len, True, out,
                                                            use_cpu=True))}


# ---------------------------------------------------------------------------------------------------------------
# ftbench's way: the instruction family's preparation and ftbench's training step


def write_dataset(folder: Path, rows: list[dict], eval_rows: list[dict]) -> Path:
    """The rows as a datasets folder (save_to_disk: a train and an eval split), the one copy both ways read."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "eval": datasets.Dataset.from_list(eval_rows)}).save_to_disk(str(folder))
    return folder


def ftbench_spec(model_dir: Path, data_dir: Path, row_format: str, seq_len: int, batch: int, batching: str,
                 extra: dict | None = None, model_source: dict | None = None):
    """The run ftbench trains: the instruction family on the dataset folder, with the check's settings (fp32, full
    fine-tuning, the CPU, one batch holding every row) unless ``extra`` sets others."""
    from ftbench.experiment import config as ftconfig
    from ftbench.experiment import matrix

    defaults = {"method": "full", "precision": "fp32", "batch_size": batch, "seq_len": seq_len, "max_steps": 2,
                "warmup_steps": 1, "learning_rate": 2e-4, "device": "cpu", "num_gpus": 0, "eval_batch_size": batch,
                "batching": batching, "seed": SEED, **(extra or {})}
    config = {
        "models": {"tiny": {"task": "instruction", "source": model_source or {"kind": "path", "path": str(model_dir)}}},
        "datasets": {"rows": {"source": {"kind": "path", "path": str(data_dir)}, "instruction_format": row_format,
                              "train_split": "train", "eval_split": "eval"}},
        "defaults": defaults,
        "matrix": {"model": ["tiny"], "dataset": ["rows"]},
    }
    ftconfig.validate_config(config)
    (spec,) = matrix.expand_runs(config)
    return spec


def ftbench_prepare(spec, out: Path) -> Path:
    """The family's preparation (what ``snakemake``'s prepare_data runs): shards and manifest in ``out``."""
    from ftbench.tasks import registry

    registry.prepare(spec.dataset, spec.dataset_def, spec.model_def, spec.seq_len, out)
    return out


def ftbench_rows(prepared_dir: Path, spec) -> list[tuple[list[int], list[int]]]:
    """(token ids, trained mask) of each row of the prepared train split, as the run ``spec`` trains on it."""
    from ftbench.data import prepared
    from ftbench.tasks import registry

    split = registry.load_split(prepared_dir, "train", prepared.read_manifest(prepared_dir), spec=spec)
    taken = split.take(list(range(len(split))))
    return [(ids.tolist(), mask.tolist()) for ids, mask in zip(taken.input_ids, taken.trained)]


def ftbench_first_loss(spec, prepared_dir: Path) -> float:
    """The loss of ftbench's first optimizer step (a warmup step: its loss is read before its update), trained by
    train.trainer.train_run on the prepared shards."""
    from ftbench.train import trainer

    metrics, steps = trainer.train_run(spec, prepared_dir)
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run {metrics['status']}: {metrics.get('status_reason')}")
    return float(steps[0]["loss"])


def ftbench_side(folder: Path, data: Path, row_format: str, seq_len: int, scratch: Path,
                 settings: dict | None = None) -> dict:
    """ftbench's prepared rows and its first-step loss over one batch of all of them (the rows preparation kept),
    unpacked (``batching: pad``) and packed (``pack``), with the run ``settings`` given beside the check's."""
    spec = ftbench_spec(folder, data, row_format, seq_len, 1, "pad", settings)
    prepared_dir = ftbench_prepare(spec, scratch / f"prepared-{data.name}")  # the same shards whatever the batch
    rows = ftbench_rows(prepared_dir, spec)
    losses = {key: ftbench_first_loss(ftbench_spec(folder, data, row_format, seq_len, len(rows), batching, settings),
                                      prepared_dir) for key, batching in (("loss", "pad"), ("packed_loss", "pack"))}
    return {"rows": rows, **losses}


# ---------------------------------------------------------------------------------------------------------------
# The check


# One held-out row per format: the eval split ftbench's run needs (its evaluations), no part of the comparison.
CHECK_EVAL_ROWS = {
    "language_modeling": [{"text": "An evaluation row."}],
    "prompt_completion": [{"prompt": "Is this review positive or negative? Clever.", "completion": " positive"}],
    "conversational": [{"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}]}],
    "conversational_prompt_completion": [{"prompt": [{"role": "user", "content": "Say no."}],
                                          "completion": [{"role": "assistant", "content": "No."}]}],
}


def same_rendering(tokenizer, rows: list[dict], marked_template: str) -> bool:
    """Whether the template SFTTrainer is given (with generation markers) renders every conversation exactly as the
    tokenizer's own (what ftbench renders with)."""
    for row in rows:
        messages = row["messages"] if "messages" in row else row["prompt"] + row["completion"]
        texts = {tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
                 for template in (None, marked_template)}
        if len(texts) != 1:
            return False
    return True


def compare_rows(trl: list[tuple[list[int], list[int]]], ftbench: list[tuple[list[int], list[int]]]) -> list[dict]:
    """Per row of SFTTrainer's (in the dataset's order), ftbench's row of the same tokens and where the trained masks
    differ (positions from 1: the first token is no target in either); a row whose tokens ftbench has not, the first
    position where they part from ftbench's nearest row."""
    theirs = {tuple(ids): mask for ids, mask in ftbench}
    compared = []
    for index, (ids, mask) in enumerate(trl):
        other = theirs.get(tuple(ids))
        if other is None:
            nearest = max(ftbench, key=lambda row: common_prefix_length(row[0], ids))[0] if ftbench else []
            compared.append({"row": index, "same_ids": False, "ids_part_at": common_prefix_length(nearest, ids),
                             "trl_length": len(ids), "ftbench_length": len(nearest)})
            continue
        differ = [position for position in range(1, len(ids)) if mask[position] != other[position]]
        compared.append({"row": index, "same_ids": True, "mask_differs_at": differ,
                         "trained": sum(mask[1:]), "ftbench_trained": sum(other[1:])})
    return compared


def check_format(folder: Path, style: str, row_format: str, seq_len: int, scratch: Path,
                 ftbench_settings: dict | None = None) -> dict:
    """One template and format: both ways on the same dataset folder; the rows compared, both first-step losses.
    ``ftbench_settings``: run settings of ftbench's beside the check's (a test's way to make them differ)."""
    rows = CHECK_ROWS[row_format]
    data = write_dataset(scratch / f"data-{style}-{row_format}", rows, CHECK_EVAL_ROWS[row_format])
    trl = trl_side(folder, style, data, row_format, seq_len, scratch)
    ours = ftbench_side(folder, data, row_format, seq_len, scratch, ftbench_settings)
    compared = compare_rows(trl["rows"], ours["rows"])
    same = len(ours["rows"]) == len(trl["rows"]) and all(row["same_ids"] and not row["mask_differs_at"]
                                                          for row in compared)
    return {"template": style, "format": row_format, "rows": len(rows), "kept": len(trl["rows"]), "masks_equal": same,
            "tokens": sum(len(ids) for ids, _ in trl["rows"]), "trained": sum(sum(mask[1:]) for _, mask in trl["rows"]),
            "rows_compared": compared,
            "rows_trl": trl["rows"], "rows_ftbench": ours["rows"],
            **{f"{way}_{key}": side[key] for way, side in (("trl", trl), ("ftbench", ours))
               for key in ("loss", "packed_loss")}}


def check(args, scratch: Path | None = None) -> list[dict]:
    """Every template x format: see the module docstring. One result per pair; checkpoints, dataset folders and
    prepared shards in ``scratch`` (a temporary folder without it): ``scratch / model-<template>`` and
    ``scratch / data-<template>-<format>``."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if scratch is None:
        with tempfile.TemporaryDirectory() as scratch_name:
            return check(args, Path(scratch_name))
    results = []
    for style in ([args.tokenizer_name] if args.tokenizer else args.templates.split(",")):
        folder = scratch / f"model-{style}"
        tokenizer = (checkpoint_from_tokenizer(folder, args.tokenizer, args.trl_template) if args.tokenizer else
                     build_checkpoint(folder, style, {**CHECK_ROWS, "eval": sum(CHECK_EVAL_ROWS.values(), [])}))
        marked = folder / TRL_TEMPLATE_FILE
        if marked.is_file() and not same_rendering(tokenizer, CHECK_ROWS["conversational"]
                                                   + CHECK_ROWS["conversational_prompt_completion"], marked.read_text()):
            raise SystemExit(f"compare_sft: the template SFTTrainer gets ({TRL_TEMPLATE_FILE}) renders the rows "
                             "otherwise than the tokenizer's own")
        for row_format in args.formats.split(","):
            try:
                result = check_format(folder, style, row_format, args.seq, scratch)
            except ValueError as exc:  # SFTTrainer refusing the setup, e.g. assistant-only loss without markers
                result = {"template": style, "format": row_format, "error": f"{type(exc).__name__}: {exc}"}
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if not k.startswith("rows_")}), flush=True)
    return results


def check_passes(result: dict) -> bool:
    return "error" not in result and result["masks_equal"] and all(
        abs(result[f"trl_{key}"] - result[f"ftbench_{key}"]) <= LOSS_TOLERANCE for key in ("loss", "packed_loss"))


def print_check(results: list[dict]) -> None:
    print(f"\n{'template':8} {'format':33} {'rows':>4} {'kept':>4} {'tokens':>6} {'trained':>7} {'masks':>6} {'TRL loss':>9} "
          f"{'ftbench':>9} {'|diff|':>8} {'TRL packed':>10} {'ftbench':>9} {'|diff|':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['template']:8} {r['format']:33} {r['error'][:300]}")
            continue
        print(f"{r['template']:8} {r['format']:33} {r['rows']:>4} {r['kept']:>4} {r['tokens']:>6} {r['trained']:>7} "
              f"{'equal' if r['masks_equal'] else 'DIFFER':>6} "
              f"{r['trl_loss']:9.5f} {r['ftbench_loss']:9.5f} {abs(r['trl_loss'] - r['ftbench_loss']):8.1e} "
              f"{r['trl_packed_loss']:10.5f} {r['ftbench_packed_loss']:9.5f} "
              f"{abs(r['trl_packed_loss'] - r['ftbench_packed_loss']):8.1e}")
        for row in r["rows_compared"]:
            if not row["same_ids"]:
                print(f"    row {row['row']}: token ids differ from position {row['ids_part_at']} "
                      f"(TRL {row['trl_length']} tokens, ftbench's nearest {row['ftbench_length']})")
            elif row["mask_differs_at"]:
                print(f"    row {row['row']}: trained masks differ at positions {row['mask_differs_at']} "
                      f"(TRL trains {row['trained']} tokens, ftbench {row['ftbench_trained']})")
    failed = [r for r in results if not check_passes(r)]
    print(f"\n{len(results) - len(failed)}/{len(results)} template x format pairs agree (masks equal, first-step "
          f"losses within {LOSS_TOLERANCE:g}, unpacked and packed)")


# ---------------------------------------------------------------------------------------------------------------
# Speed (GPU): tokens/s and peak memory, each way in a process of its own


SYLLABLES = [consonant + vowel for consonant in "bcdfghjklmnprstvwz" for vowel in "aeiou"] + ["th", "sh", "ch", "qu"]


def random_words(rng, count: int) -> list[str]:
    return ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 5))) for _ in range(count)]


def speed_rows(count: int, seq_len: int, seed: int = SEED) -> list[dict]:
    """Prompt-completion rows of random words, lengths spread from a tenth of seq_len to about its whole (the
    completion a quarter of each), so packing has rows of every size to fill."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        words = rng.randint(max(4, seq_len // 20), max(8, seq_len // 2))  # ~1.5-2 tokens a word
        completion = max(1, words // 4)
        rows.append({"prompt": " ".join(random_words(rng, words - completion)),
                     "completion": " " + " ".join(random_words(rng, completion))})
    return rows


def speed_assets(folder: Path, shape: dict, seq_len: int, rows: int) -> tuple[Path, Path]:
    """(tokenizer folder, dataset folder): a ChatML-style tokenizer trained here to exactly the shape's vocabulary
    (random-word BPE, so ftbench's config-built model and SFTTrainer's take the shape's embedding), and the rows."""
    import random

    tokenizer_dir, data_dir = folder / "tokenizer", folder / "rows"
    corpus_rng = random.Random(SEED + 1)
    corpus = [" ".join(random_words(corpus_rng, 100)) for _ in range(4000)]
    tokenizer = build_tokenizer(tokenizer_dir, "chatml", corpus, shape["vocab_size"])
    if len(tokenizer) != shape["vocab_size"]:
        raise SystemExit(f"compare_sft: the tokenizer has {len(tokenizer)} tokens, the shape {shape['vocab_size']}")
    all_rows = speed_rows(rows + 8, seq_len)
    write_dataset(data_dir, all_rows[:rows], all_rows[rows:])
    return tokenizer_dir, data_dir


def mean_row_tokens(tokenizer_dir: Path, data_dir: Path, seq_len: int) -> float:
    """Mean tokens of a prepared row (prompt, completion, end-of-sequence; cut to seq_len): sizes ftbench's packed
    batch."""
    import datasets
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = datasets.load_from_disk(str(data_dir))["train"]
    lengths = [min(seq_len, len(tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]))
               for row in rows]
    return sum(lengths) / len(lengths)


def speed(args) -> list[dict]:
    import datasets
    from compare_ecosystem import SHAPES

    datasets.disable_progress_bars()
    shape = SHAPES[args.shape]
    results = []
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        steps = args.warmup + args.steps
        # Enough rows for every step of either way without a second epoch: a row averages about half of seq_len, so
        # a packed step of batch x seq_len tokens takes about 2 x batch rows; 4 x batch leaves room.
        rows = 4 * args.batch * steps
        tokenizer_dir, data_dir = speed_assets(scratch, shape, args.seq, rows)
        mean = mean_row_tokens(tokenizer_dir, data_dir, args.seq)
        # Packed, SFTTrainer's batch counts rows of seq_len, ftbench's the sequences packed into them (module docstring).
        ftbench_batch = max(args.batch, round(args.batch * args.seq / mean)) if args.packing else args.batch
        for method in args.method.split(","):
            row = {"shape": args.shape, "method": method, "batch": args.batch, "seq": args.seq, "packing": args.packing,
                   "ftbench_batch": ftbench_batch, "mean_row_tokens": mean}
            for way in args.ways.split(","):
                row[way] = run_way(way, method, args, tokenizer_dir, data_dir, ftbench_batch)
                print(json.dumps({"method": method, "way": way, **row[way]}), flush=True)
            results.append(row)
    return results


def run_way(way: str, method: str, args, tokenizer_dir: Path, data_dir: Path, ftbench_batch: int) -> dict:
    """One way in a process of its own (each peak of allocated memory its own); its JSON result, or its error."""
    command = [sys.executable, __file__, "way", way, "--method", method, "--shape", args.shape, "--batch",
               str(args.batch), "--ftbench-batch", str(ftbench_batch), "--seq", str(args.seq), "--warmup",
               str(args.warmup), "--steps", str(args.steps), "--tokenizer", str(tokenizer_dir), "--data", str(data_dir)]
    if args.packing:
        command.append("--packing")
    if args.attn:
        command += ["--attn", args.attn]
    process = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        return {"error": (process.stderr or process.stdout).strip().splitlines()[-3:]}
    return json.loads(lines[-1])


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def trl_speed(args) -> dict:
    """SFTTrainer on the rows: the model built from the shape's config as compare_ecosystem.py builds it (full: fp32
    weights; LoRA: a bf16 base and peft's LoraConfig handed to SFTTrainer), bf16 autocast, fused AdamW, no clipping,
    gradient checkpointing off (ftbench's default); the measured steps timed between synchronised clock readings,
    their real tokens counted from each batch (attention mask, or a padding-free row's length)."""
    import datasets
    import peft
    import torch
    import transformers
    from compare_ecosystem import LEARNING_RATE, LORA, SHAPES

    torch.manual_seed(SEED)
    with torch.device(device_name()):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**SHAPES[args.shape], use_cache=False),
            dtype=torch.float32 if args.method == "full" else torch.bfloat16,
            **({"attn_implementation": args.attn} if args.attn else {}))
    peft_config = peft.LoraConfig(task_type="CAUSAL_LM", **LORA) if args.method == "lora" else None
    clock = step_clock(args.warmup)
    with tempfile.TemporaryDirectory() as out:
        trainer = sft_trainer(Path(args.tokenizer), datasets.load_from_disk(args.data)["train"], "prompt_completion",
                              args.seq, args.packing, Path(out), model=model, peft_config=peft_config,
                              callbacks=[clock], per_device_train_batch_size=args.batch,
                              max_steps=args.warmup + args.steps, bf16=True, optim="adamw_torch_fused",
                              max_grad_norm=0.0, learning_rate=LEARNING_RATE)
        count_tokens(trainer, clock)
        trainer.train()
    return clock.result()


def count_tokens(trainer, clock) -> None:
    """Each micro-batch's real tokens (its attention mask's ones, or a padding-free batch's one row, which holds no
    padding: ``pad_to_multiple_of`` unset) and trained ones (labels other than -100 that a position predicts)."""
    compute_loss = trainer.compute_loss

    def counting(model, inputs, *args, **kwargs):
        mask = inputs.get("attention_mask")
        clock.tokens += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        clock.trained += int((inputs["labels"][:, 1:] != -100).sum())  # targets once shifted
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = counting


def step_clock(warmup: int):
    """A callback timing SFTTrainer's measured window: the device synchronised and the clock read when the warmup's
    last step ends and when each later step ends; the tokens of the steps in between; the peak allocated memory
    from the first step on (the model already built, as ftbench resets its peak)."""
    import torch
    import transformers

    class StepClock(transformers.TrainerCallback):
        def __init__(self):
            self.tokens = self.trained = self.window_tokens = self.window_trained = self.measured_steps = 0
            self.started = self.ended = None

        def on_train_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            if state.global_step == warmup:
                self.started, self.tokens, self.trained = time.perf_counter(), 0, 0
            elif state.global_step > warmup:
                self.ended, self.window_tokens, self.window_trained = time.perf_counter(), self.tokens, self.trained
                self.measured_steps = state.global_step - warmup

        def result(self) -> dict:
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
            seconds = self.ended - self.started
            return {"peak_gib": peak, "tokens_per_s": self.window_tokens / seconds,
                    "trained_tokens_per_s": self.window_trained / seconds,
                    "tokens_per_step": self.window_tokens / self.measured_steps}

    return StepClock()


def ftbench_speed(args) -> dict:
    """ftbench's own job (``python -m ftbench train``) on the instruction family's prepared rows: the shape built
    from its config with the same tokenizer, the same recipe, ``batching: pack`` where SFTTrainer packs."""
    from compare_ecosystem import LEARNING_RATE, LORA, SHAPES

    overrides = {key: value for key, value in SHAPES[args.shape].items() if key != "vocab_size"}  # the tokenizer's
    model_source = {"kind": "config", "architecture": "LlamaConfig", "overrides": overrides,
                    "tokenizer": {"kind": "path", "path": str(args.tokenizer)}}
    settings = {"method": args.method, "precision": "bf16", "learning_rate": LEARNING_RATE, "device": "auto",
                "num_gpus": 1 if device_name() == "cuda" else 0, "max_steps": args.warmup + args.steps,
                "warmup_steps": args.warmup, "lora_rank": LORA["r"], "lora_alpha": LORA["lora_alpha"],
                "lora_dropout": LORA["lora_dropout"], "lora_targets": LORA["target_modules"],
                "attn_implementation": args.attn}
    spec = ftbench_spec(Path(args.tokenizer), Path(args.data), "prompt_completion", args.seq, args.ftbench_batch,
                        "pack" if args.packing else "pad", settings, model_source)
    with tempfile.TemporaryDirectory() as folder:
        data, out = ftbench_prepare(spec, Path(folder) / "data"), Path(folder) / "run" / "metrics.json"
        out.parent.mkdir()
        subprocess.run([sys.executable, "-m", "ftbench", "train", "--spec", spec.to_json(), "--data", str(data),
                        "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
        metrics = json.loads(out.read_text())["metrics"]
    if metrics["status"] != "ok":
        raise SystemExit(f"ftbench run {metrics['status']}: {metrics.get('status_reason')}")
    peak = metrics.get("peak_memory_allocated_mb")
    return {"peak_gib": peak / 1024 if peak is not None else None, "tokens_per_s": metrics["tokens_per_s"],
            "trained_tokens_per_s": metrics.get("trained_tokens_per_s"),
            "tokens_per_step": metrics["measured_tokens"] / args.steps if metrics.get("measured_tokens") else None}


def print_speed(results: list[dict]) -> None:
    print(f"\n{'shape':5} {'method':6} {'batch x seq':>11} {'packing':>7} {'way':8} {'GiB':>7} {'tokens/s':>10} "
          f"{'trained/s':>10} {'tokens/step':>11}")
    for row in results:
        for way in ("trl", "ftbench"):
            result = row.get(way, {})
            if "error" in result or not result:
                print(f"{row['shape']:5} {row['method']:6} {row['batch']:>5} x {row['seq']:<5} {str(row['packing']):>7} "
                      f"{way:8} error: {result.get('error')}")
                continue
            print(f"{row['shape']:5} {row['method']:6} {row['batch']:>5} x {row['seq']:<5} {str(row['packing']):>7} "
                  f"{way:8} {result['peak_gib'] or float('nan'):7.2f} {result['tokens_per_s']:10,.0f} "
                  f"{result['trained_tokens_per_s'] or float('nan'):10,.0f} {result['tokens_per_step'] or float('nan'):11,.0f}")
        mine, theirs = row.get("ftbench", {}), row.get("trl", {})
        if "tokens_per_s" in mine and "tokens_per_s" in theirs:
            memory = f"{mine['peak_gib'] / theirs['peak_gib']:.3f}" if mine["peak_gib"] and theirs["peak_gib"] else "-"
            print(f"{'':40} ftbench/TRL: tokens/s {mine['tokens_per_s'] / theirs['tokens_per_s']:.3f}, memory {memory}")


# ---------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    check_mode = modes.add_parser("check", help="CPU: masks and first-step losses per format (seconds)")
    check_mode.add_argument("--templates", default=",".join(TEMPLATES), help="chatml, llama3, or both comma-separated")
    check_mode.add_argument("--formats", default=",".join(FORMATS))
    check_mode.add_argument("--seq", type=int, default=CHECK_SEQ_LEN)
    check_mode.add_argument("--out", help="write the results as JSON here")
    check_mode.add_argument("--tokenizer", help="a folder holding a tokenizer of yours to check with (its own chat "
                                                "template) in place of the two built here")
    check_mode.add_argument("--tokenizer-name", default="custom", help="its name in the table")
    check_mode.add_argument("--trl-template", help="with --tokenizer: the template SFTTrainer gets for assistant-only "
                                                   "loss where the tokenizer's has no generation markers: chatml (this "
                                                   "script's, SmolLM2's rendering) or a Jinja file")
    speed_mode = modes.add_parser("speed", help="GPU: tokens/s and peak memory of both ways on one configuration")
    speed_mode.add_argument("--ways", default="trl,ftbench")
    speed_mode.add_argument("--out", help="write the results as JSON here")
    way_mode = modes.add_parser("way")  # one way of `speed`, in this process (run_way starts it)
    way_mode.add_argument("way", choices=("trl", "ftbench"))
    way_mode.add_argument("--tokenizer", required=True)
    way_mode.add_argument("--data", required=True)
    way_mode.add_argument("--ftbench-batch", type=int, required=True)
    for mode in (speed_mode, way_mode):
        mode.add_argument("--shape", default="1b", help="a shape of compare_ecosystem.py: 1b, 8b, tiny")
        mode.add_argument("--method", default="lora", help="full or lora (speed: several comma-separated)")
        mode.add_argument("--batch", type=int, default=4, help="sequences a step (packed: rows of seq_len, SFTTrainer's)")
        mode.add_argument("--seq", type=int, default=2048)
        mode.add_argument("--packing", action="store_true", help="SFTTrainer packing=True; ftbench batching: pack")
        mode.add_argument("--warmup", type=int, default=3, help="steps run before the clock starts (at least 1)")
        mode.add_argument("--steps", type=int, default=10, help="measured steps after the warmup")
        mode.add_argument("--attn", help="attn_implementation of both ways (sdpa, flash_attention_2, ...); default: "
                                         "the model's")
    args = parser.parse_args(argv)
    if args.mode != "check" and (args.warmup < 1 or args.steps < 1):
        parser.error("--warmup and --steps: at least 1 each (the clock starts when the last warmup step ends)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "way":
        print(json.dumps(trl_speed(args) if args.way == "trl" else ftbench_speed(args)))
        return 0
    results = check(args) if args.mode == "check" else speed(args)
    (print_check if args.mode == "check" else print_speed)(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.mode == "check":
        return 0 if all(check_passes(r) for r in results) else 1
    return 0 if all("error" not in row[way] for row in results for way in args.ways.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
