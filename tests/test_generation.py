"""Scoring by generation (tasks/generation.py): the answer metrics on hand-written cases, the settings refused at parse
time, and greedy decoding of left-padded batches on a tiny config-built Llama (the same tokens as one prompt at a time
and as a decoding loop without a cache; the KV cache used; stop tokens; the tokens and time counted)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ftbench.errors import ConfigError
from ftbench.runspec import RunSpec
from ftbench.tasks import generation
from ftbench.tasks.generation import is_right, normalise


# ---------------------------------------------------------------------------------------------------
# Scoring (pure)


@pytest.mark.parametrize("text, expected", [
    ("  Positive.  ", "positive"),
    ("POSITIVE!!", "positive"),
    ("New\n  York\tcity", "new york city"),
    ("42.", "42"),
    ("3.5", "3.5"),  # punctuation inside is kept
    ("Straße", "strasse"),  # case-folded, not only lower-cased
    ("...", ""),
    ("", ""),
])
def test_normalise_strips_casefolds_collapses_whitespace_and_drops_trailing_punctuation(text, expected):
    assert normalise(text) == expected


@pytest.mark.parametrize("answer, reference, right", [
    ("positive", "Positive", True),
    (" Positive. ", "positive", True),
    ("positive review", "positive", False),  # exact: nothing more
    ("negative", "positive", False),
    ("", "positive", False),
])
def test_exact_match(answer, reference, right):
    assert is_right("exact_match", answer, reference) is right


@pytest.mark.parametrize("answer, reference, right", [
    ("It is Positive, clearly", "positive.", True),
    ("negative", "positive", False),
    ("anything", "  ", False),  # an empty reference is in every text: it matches nothing instead
])
def test_contains(answer, reference, right):
    assert is_right("contains", answer, reference) is right


GSM = re.compile(r"#### (\-?\d+)")


@pytest.mark.parametrize("answer, reference, right", [
    ("so 3 + 4 = 7\n#### 7", "She has 3 + 4 = 7 apples.\n#### 7", True),
    ("#### 8", "work...\n#### 7", False),
    ("the answer is 7", "work...\n#### 7", False),  # no match in the answer: wrong, not an error
    ("#### 7 and then #### 9", "#### 7", True),  # the first match is the answer
    ("#### 7", "7", True),  # a reference the pattern does not match is compared whole
    ("#### 7", "7 apples", False),
])
def test_regex_extracts_the_answer_from_both(answer, reference, right):
    assert is_right("regex", answer, reference, GSM) is right


def test_a_regex_without_a_group_compares_its_whole_match():
    assert is_right("regex", "I think: Yes!", "yes", re.compile(r"(?i)\b(?:yes|no)\b"))
    assert not is_right("regex", "maybe", "yes", re.compile(r"(?i)\b(?:yes|no)\b"))


def test_no_metric_scores_nothing():
    with pytest.raises(ValueError):
        is_right("none", "a", "a")


@pytest.mark.parametrize("pattern, fragment", [("#### (\\d+", "is not a regular expression"),
                                               ("(a)(b)", "expected at most one")])
def test_a_bad_regex_is_one_line_naming_the_key(pattern, fragment):
    with pytest.raises(ConfigError) as error:
        generation.check_settings("regex", pattern, lambda name: f"defaults.{name}")
    message = str(error.value)
    assert message.startswith("config key defaults.answer_regex:") and fragment in message and "\n" not in message


def test_regex_needs_a_pattern():
    with pytest.raises(ConfigError, match="answer_regex: required with answer_metric regex"):
        generation.check_settings("regex", None, lambda name: name)


def test_prompt_and_reference_split_at_the_last_trained_span():
    ids = np.arange(10, 20)
    # system/user, assistant turn 1 (trained), user, assistant turn 2 (trained), a template newline (not trained)
    trained = np.array([0, 0, 1, 1, 0, 0, 1, 1, 1, 0])
    prompt, reference = generation.prompt_and_reference(ids, trained)
    assert prompt.tolist() == list(range(10, 16)) and reference.tolist() == [16, 17, 18]
    prompt, reference = generation.prompt_and_reference(ids, np.zeros(10))
    assert len(reference) == 0 and prompt.tolist() == ids.tolist()


def test_left_padding_puts_every_prompt_against_the_right_edge():
    ids, mask = generation.left_padded([np.array([5, 6, 7]), np.array([8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


# ---------------------------------------------------------------------------------------------------
# Decoding on a tiny Llama


VOCAB, PAD = 64, 0


@pytest.fixture(scope="module")
def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # the tests choose the stops
    return model


PROMPTS = [np.array([3, 9, 14, 27, 5, 8, 30]), np.array([7, 11]), np.array([40, 41, 42, 43]), np.array([6])]


def greedy_without_cache(model, prompt: np.ndarray, steps: int) -> list[int]:
    """The plain definition: the whole sequence through the model each step, the most likely next token appended."""
    import torch

    tokens = torch.tensor([prompt.tolist()])
    with torch.no_grad():
        for _ in range(steps):
            tokens = torch.cat([tokens, model(tokens).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return tokens[0, len(prompt):].tolist()


def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(tiny_llama):
    batched = generation.greedy(tiny_llama, PROMPTS, PAD, [], 6, "cpu")
    alone = [generation.greedy(tiny_llama, [prompt], PAD, [], 6, "cpu")[0] for prompt in PROMPTS]
    assert batched == alone
    assert alone == [greedy_without_cache(tiny_llama, prompt, 6) for prompt in PROMPTS]


def test_decoding_uses_the_kv_cache(tiny_llama):
    lengths = []
    handle = tiny_llama.model.register_forward_pre_hook(
        lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1] if kwargs.get("input_ids") is not None
                                                    else kwargs["inputs_embeds"].shape[1]), with_kwargs=True)
    try:
        generation.greedy(tiny_llama, PROMPTS[:2], PAD, [], 5, "cpu")
    finally:
        handle.remove()
    # The prompt once, then one new token per step: nothing already seen goes through the model again.
    assert lengths == [len(PROMPTS[0])] + [1] * 4


def test_an_answer_ends_at_a_stop_token_and_keeps_it(tiny_llama):
    free = generation.greedy(tiny_llama, PROMPTS, PAD, [], 6, "cpu")
    stop = free[0][2]  # the third token the first prompt generates
    stopped = generation.greedy(tiny_llama, PROMPTS, PAD, [stop], 6, "cpu")
    assert stopped[0] == free[0][:free[0].index(stop) + 1]
    for row, answer in zip(free, stopped):
        expected = row[:row.index(stop) + 1] if stop in row else row
        assert answer == expected  # no padding after a stop counts as generated


class WordTokenizer:
    """Token i reads "w<i>"; 2 is the end of sequence and 63 a special end-of-turn token."""

    eos_token_id, pad_token_id = 2, PAD
    all_special_ids = [PAD, 2, 63]
    added_tokens_decoder: dict = {}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids if not (skip_special_tokens and i in self.all_special_ids))


def spec(**settings) -> RunSpec:
    return RunSpec(model="m", dataset="d", eval_batch_size=3, **{"answer_metric": "exact_match", "max_new_tokens": 4,
                                                                **settings})


def test_answer_rows_scores_counts_tokens_and_times_the_generation(tiny_llama):
    tokenizer = WordTokenizer()
    free = generation.greedy(tiny_llama, PROMPTS, PAD, [], 4, "cpu")
    # References: the first two answers exactly (with the end-of-turn token after them), then two wrong ones.
    references = [np.array(free[0] + [63]), np.array(free[1] + [63]), np.array([50, 63]), np.array([51, 63])]
    figures = generation.answer_rows(tiny_llama, list(zip(PROMPTS, references)), spec(), tokenizer, "cpu", PAD)
    assert figures[generation.ROWS] == 4
    right = [free[2] == [50], free[3] == [51]]
    assert figures[generation.SCORE] == pytest.approx((2 + sum(right)) / 4)
    # 63 ends answers (it ends the references), so a generated 63 ends one early and counts as generated
    expected_tokens = sum(len(answer[:answer.index(63) + 1]) if 63 in answer else len(answer) for answer in free)
    assert figures[generation.TOKENS] == expected_tokens
    assert figures[generation.SECONDS] > 0


def test_a_time_limit_ends_generation_between_batches_and_counts_the_rows_answered(tiny_llama):
    asked = []

    def fits(rows: int) -> bool:
        asked.append(rows)
        return len(asked) == 1

    rows = [(prompt, np.array([50, 2])) for prompt in PROMPTS]
    figures = generation.answer_rows(tiny_llama, rows, spec(), WordTokenizer(), "cpu", PAD, fits=fits)
    assert asked == [3, 1] and figures[generation.ROWS] == 3


def test_stop_ids_hold_the_eos_and_the_end_of_turn_token_of_the_references():
    assert generation.stop_ids(WordTokenizer(), [np.array([5, 6, 63])]) == [2, 63]
    assert generation.stop_ids(WordTokenizer(), [np.array([5, 6])]) == [2]


def test_prompt_rows_read_the_prompt_reference_and_its_text_as_preparation_stored_them():
    class Split:
        input_ids = [np.array([1, 5, 6, 7, 8, 9, 0])]
        trained = [np.array([0, 0, 0, 1, 1, 1, 0])]
        prompt_lengths = np.array([3])
        references = ["Yes"]

        def take(self, indices):
            return self

    (prompt, reference, text), = generation.prompt_rows(Split(), np.array([0]))
    assert prompt.tolist() == [1, 5, 6] and reference.tolist() == [7, 8, 9] and text == "Yes"


def test_the_reference_text_is_scored_as_given_where_there_is_one(tiny_llama):
    answer = generation.greedy(tiny_llama, PROMPTS[:1], PAD, [], 2, "cpu")[0]
    text = WordTokenizer().decode(answer)
    rows = [(PROMPTS[0], np.array([50]), text.upper() + ".")]
    figures = generation.answer_rows(tiny_llama, rows, spec(max_new_tokens=2), WordTokenizer(), "cpu", PAD)
    assert figures[generation.SCORE] == 1.0


def test_the_time_asked_for_counts_generating_the_answers_of_every_evaluation():
    from ftbench.cluster import resources

    run = RunSpec(model="m", dataset="d", batch_size=4, max_steps=10, eval_batch_size=8, device="cpu", num_gpus=0,
                  model_def={"task": "causal_lm", "source": {"kind": "config", "architecture": "LlamaConfig", "overrides": {
                      "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "vocab_size": 1000}}},
                  dataset_def={"source": {"kind": "synthetic"}, "train_size": 100, "eval_size": 40})
    plain = resources.train_compute_seconds(run)
    generating = run.replace(answer_metric="exact_match", max_new_tokens=16)
    added = resources.train_compute_seconds(generating) - plain
    # 40 prompts in 5 batches of 8, 16 steps each: at least GENERATION_STEP_S a step, and the prompts' prefill
    params, rate = resources.model_params(run.model_def), resources.ACHIEVED_FLOPS["cpu"]
    step_s = resources.GENERATION_STEP_S + 2 * params * 8 / rate
    prefill_s = 2 * params * 40 * run.seq_len / rate
    assert added == pytest.approx(prefill_s + 5 * 16 * step_s)
    longer = resources.train_compute_seconds(generating.replace(max_new_tokens=32)) - plain
    assert longer - added == pytest.approx(5 * 16 * step_s)
    # the evaluation before training answers the same prompts again, unless the shared step did
    before = generating.replace(eval_before_training=True)
    assert (resources.train_compute_seconds(before) - resources.train_compute_seconds(before.replace(answer_metric="none"))
            == pytest.approx(2 * added))


# ---------------------------------------------------------------------------------------------------
# Parse time


def parse_error(config: dict) -> str:
    from ftbench.experiment import config as ftbench_config

    with pytest.raises(ConfigError) as caught:
        ftbench_config.validate_config(config)
    return str(caught.value)


def test_a_bad_regex_is_refused_when_the_experiment_is_read(tiny_config_factory):
    config = tiny_config_factory()
    config["defaults"].update(answer_metric="regex", answer_regex="#### (\\d+")
    message = parse_error(config)
    assert message.startswith("config key defaults.answer_regex:") and "\n" not in message, message


def test_generation_on_a_family_without_prompts_is_refused_naming_the_key(tiny_config_factory):
    config = tiny_config_factory()
    config["defaults"]["answer_metric"] = "exact_match"
    message = parse_error(config)
    assert message.startswith("config key defaults.answer_metric:") and "classification" in message, message


def test_a_target_on_the_generation_score_without_generation_is_refused(tiny_config_factory):
    config = tiny_config_factory(target={"metric": "eval_generation_score", "value": 0.8})
    message = parse_error(config)
    assert message.startswith("config key target.metric:") and "answer_metric" in message and "\n" not in message


def test_an_instruction_run_is_judged_by_its_answers_and_by_completion_tokens_where_it_generated_none():
    import pandas as pd

    from ftbench.report import analysis

    runs = pd.DataFrame({"task": ["instruction", "instruction"], "eval_generation_score": [0.8, None],
                         "base_eval_generation_score": [0.5, None], "eval_generation_rows": [200, None],
                         "eval_token_accuracy": [0.6, 0.7], "base_eval_token_accuracy": [0.3, 0.4],
                         "eval_samples": [200, 100]})
    assert [analysis.quality_of(runs, i).name for i in runs.index] == ["answer score", "completion token accuracy"]
    assert analysis.quality_column(runs)[0].tolist() == [0.8, 0.7]
    assert analysis.quality_column(runs, analysis.BASE)[0].tolist() == [0.5, 0.4]  # like with like
    assert [analysis.quality_of(runs, i).n_column for i in runs.index] == ["eval_generation_rows", "eval_samples"]


def test_the_majority_rate_of_generated_answers_is_the_most_common_reference_answer():
    class Split:
        references = ["Positive", "negative.", "positive ", "POSITIVE!", "negative"]

    classes = generation.answer_classes(Split())
    assert np.bincount(classes).max() / len(classes) == pytest.approx(3 / 5)
    assert generation.answer_classes(object()) is None


# ---------------------------------------------------------------------------------------------------
# A run: the generation score at every evaluation, its time off the training clock


@pytest.fixture(scope="module")
def instruction_run(tmp_path_factory):
    """A tiny config-built Llama trained 6 steps on prompt-completion rows (a byte-level BPE tokenizer built here),
    evaluated before training, every 2 steps and at the end, with answers generated and scored by exact match."""
    import pandas as pd
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ftbench.experiment import config as ftbench_config, matrix
    from ftbench.tasks import registry
    from ftbench.train import trainer

    folder = tmp_path_factory.mktemp("instruction-run")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["Is review positive or negative? good bad fine dull plot"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|pad|>", "<|end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|end|>", pad_token="<|pad|>").save_pretrained(folder / "tok")
    words = ["good", "bad", "fine", "dull"]
    rows = [{"prompt": f"Is review {i} {words[i % 4]} positive or negative?", "completion": " positive" if i % 2 else " negative"}
            for i in range(64)]
    pd.DataFrame(rows).to_json(folder / "rows.jsonl", orient="records", lines=True)
    config = {
        "models": {"llama": {"task": "instruction", "source": {
            "kind": "config", "architecture": "LlamaConfig", "tokenizer": {"kind": "path", "path": str(folder / "tok")},
            "overrides": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "max_position_embeddings": 128}}}},
        "datasets": {"rows": {"source": {"kind": "path", "path": str(folder / "rows.jsonl")}, "train_size": 48,
                              "eval_size": 16}},
        "defaults": {"method": "full", "precision": "fp32", "batch_size": 4, "seq_len": 48, "max_steps": 6,
                     "warmup_steps": 1, "learning_rate": 0.001, "device": "cpu", "num_gpus": 0, "eval_batch_size": 8,
                     "eval_every": 2, "eval_subset": 8, "eval_before_training": True, "answer_metric": "exact_match",
                     "max_new_tokens": 3},
        "matrix": {"model": ["llama"], "dataset": ["rows"]},
        "target": {"metric": "eval_generation_score", "value": 0.5},
    }
    ftbench_config.validate_config(config)
    (spec,) = matrix.expand_runs(config)
    registry.prepare("rows", config["datasets"]["rows"], matrix.preparation_model_def(spec.model_def), spec.seq_len,
                     folder / "data")
    torch.set_num_threads(2)
    return trainer.train_run(spec, folder / "data")


@pytest.mark.slow
def test_answers_are_scored_at_every_evaluation_and_their_time_is_kept_off_the_training_clock(instruction_run):
    metrics, steps = instruction_run
    assert metrics["status"] == "ok", metrics.get("status_reason")
    # the final evaluation and the one before training: score, rows, tokens, seconds
    for prefix in ("", "base_"):
        assert 0 <= metrics[f"{prefix}eval_generation_score"] <= 1
        assert metrics[f"{prefix}eval_generation_rows"] == metrics[f"{prefix}eval_samples"] == 16
        assert 16 <= metrics[f"{prefix}eval_generated_tokens"] <= 16 * 3
        assert metrics[f"{prefix}eval_generation_s"] > 0
    assert metrics["eval_generation_s"] < metrics["eval_time_s"]
    # evals.parquet: a row with its Wilson interval at steps 0 (the whole split), 2, 4 (the subset) and 6 (final)
    rows = [row for row in metrics["evals"] if row["metric"] == generation.SCORE]
    assert [(row["step"], row["eval_samples"]) for row in rows] == [(0, 16), (2, 8), (4, 8), (6, 16)]
    assert all(row["low"] <= row["value"] <= row["high"] for row in rows)
    # tokens/s is the measured steps' alone: the evaluations (generation included) are outside the window
    measured = sum(step["step_time_s"] for step in steps if step["measured"])
    assert metrics["window_s"] == pytest.approx(measured, rel=1e-6)
    assert metrics["eval_during_training_s"] > 0


def test_the_generation_score_is_a_proportion_where_higher_is_better():
    from ftbench.tasks.base import is_proportion, reaches

    assert is_proportion(generation.SCORE)
    assert reaches(generation.SCORE, 0.81, 0.8) and not reaches(generation.SCORE, 0.79, 0.8)
    assert not reaches(generation.SCORE, None, 0.8)  # no answers scored: not reached
