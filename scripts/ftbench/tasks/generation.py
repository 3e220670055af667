"""Scoring by generation: the model answers each held-out prompt by greedy decoding, and the answer is scored against
the reference completion. A family whose rows are prompts and completions (instruction data) owns this evaluator;
train/evaluation.py runs it after the forward pass over the same rows, so its score has the same rows, intervals,
evaluations during training, shared base evaluation and quality target as every other eval figure.

Decoding: greedy (``do_sample=False``, one beam), with the KV cache, ``eval_batch_size`` prompts at a time, left-padded
with the attention mask marking the padding (the convention of transformers' ``generate`` for decoders), at most
``max_new_tokens`` new tokens, ending at the tokenizer's end-of-sequence token or the template's end-of-turn token
(a special token that ends the reference completions: ``<|im_end|>``, ``<|eot_id|>``). Only the new tokens are
decoded, without special tokens.

Answers (``answer_metric``), all after ``normalise`` (surrounding whitespace stripped, case folded, runs of whitespace
made one space, punctuation at the end dropped):
- ``exact_match``: the normalised answer equals the normalised reference;
- ``contains``: the normalised reference occurs in the normalised answer (as a substring);
- ``regex``: ``answer_regex``'s first match in the answer (its first group, or the whole match without a group)
  equals its first match in the reference, both normalised; a reference it does not match is compared whole. An
  answer it does not match is wrong, not an error.

Time: the evaluator synchronises the device before and after and reports its seconds (eval_generation_s), the rows
it answered and the tokens it generated (each answer's, up to and including the token that ended it, no padding)
apart from the forward pass; evaluation's time is itself off training's clock (train/evaluation.py).

Torch-free at import (the registry is read at parse time): the scoring functions are plain Python.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import string
import time

import numpy as np

from ftbench.errors import ConfigError
from ftbench.runspec import ANSWER_METRICS
SCORE = "eval_generation_score"  # the share of prompts answered right: a proportion, higher is better
ROWS = "eval_generation_rows"  # prompts answered: the count the score's Wilson interval is on
TOKENS = "eval_generated_tokens"
SECONDS = "eval_generation_s"
FIGURES = (SCORE, ROWS, TOKENS, SECONDS)

_WHITESPACE = re.compile(r"\s+")
_TRAILING_PUNCTUATION = string.punctuation + "。、！？…"


# ---------------------------------------------------------------------------------------------------
# Scoring (pure)


def normalise(text: str) -> str:
    """``text`` as answers are compared: stripped, case-folded, whitespace runs as one space, trailing punctuation
    (ASCII and the common CJK full stops) dropped."""
    text = _WHITESPACE.sub(" ", text.strip().casefold())
    return text.rstrip(_TRAILING_PUNCTUATION + " ")


def extract(pattern: re.Pattern, text: str) -> str | None:
    """The answer ``pattern`` finds in ``text``: its first match's first group (the whole match without groups);
    None where it does not match."""
    found = pattern.search(text)
    if found is None:
        return None
    return found.group(1) if pattern.groups else found.group(0)


def is_right(metric: str, answer: str, reference: str, pattern: re.Pattern | None = None) -> bool:
    """Whether the generated ``answer`` counts as the ``reference`` under ``metric`` (the module's docstring)."""
    if metric == "exact_match":
        return normalise(answer) == normalise(reference)
    if metric == "contains":
        wanted = normalise(reference)
        return bool(wanted) and wanted in normalise(answer)
    if metric == "regex":
        if pattern is None:
            raise ValueError("answer_metric regex needs a pattern")
        got = extract(pattern, answer)
        if got is None:
            return False
        expected = extract(pattern, reference)
        return normalise(got) == normalise(reference if expected is None else expected)
    raise ValueError(f"answer_metric {metric!r} scores nothing; expected one of {', '.join(ANSWER_METRICS[1:])}")


def compile_regex(pattern: str, key: str = "answer_regex") -> re.Pattern:
    """``pattern`` compiled, or ConfigError naming ``key`` (a bad pattern is refused at parse time)."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        raise ConfigError(f"config key {key}: {pattern!r} is not a regular expression ({exc})") from None
    if compiled.groups > 1:
        raise ConfigError(f"config key {key}: {pattern!r} has {compiled.groups} groups; expected at most one (the "
                          "answer), use (?:...) for the others")
    return compiled


def check_settings(answer_metric: str, answer_regex: str | None, key_of) -> None:
    """Refuse settings that cannot score (``key_of(name)``: the config key a setting came from)."""
    if answer_metric == "regex" and not answer_regex:
        raise ConfigError(f"config key {key_of('answer_regex')}: required with answer_metric regex (the pattern that "
                          "extracts the answer, e.g. '#### (\\d+)')")
    if answer_regex:
        compile_regex(answer_regex, key_of("answer_regex"))


# ---------------------------------------------------------------------------------------------------
# Rows: what is asked and what is expected


def prompt_and_reference(ids: np.ndarray, trained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, reference) token ids of a row from its trained-token mask: the reference is the row's last run of
    trained tokens (the last assistant turn, or the completion), the prompt everything before it (earlier turns
    included). A row without trained tokens has an empty reference."""
    positions = np.flatnonzero(np.asarray(trained))
    if len(positions) == 0:
        return np.asarray(ids), np.asarray(ids)[:0]
    end = positions[-1] + 1
    gaps = np.flatnonzero(np.diff(positions) > 1)
    start = positions[gaps[-1] + 1] if len(gaps) else positions[0]
    return np.asarray(ids)[:start], np.asarray(ids)[start:end]


def prompt_rows(split, indices: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, str | None]]:
    """(prompt ids, reference ids, reference text) of a split's rows at ``indices``, from what preparation stored
    beside each row: ``prompt_lengths`` (the generation prompt's tokens), ``trained`` (the mask, whose last span
    ends the reference) and ``references`` (the reference answer's text as the data gives it)."""
    rows = split.take(np.asarray(indices))
    out = []
    for ids, trained, prompt_length, text in zip(rows.input_ids, rows.trained, rows.prompt_lengths, rows.references):
        positions = np.flatnonzero(np.asarray(trained))
        end = positions[-1] + 1 if len(positions) else len(ids)
        out.append((np.asarray(ids)[:prompt_length], np.asarray(ids)[prompt_length:max(end, prompt_length)], text))
    return out


def answer_classes(split) -> np.ndarray | None:
    """A class per row of a split: its normalised reference answer (rows with the same answer share one). The most
    common one's share is the score of always giving that answer (the majority rate a generation score is read
    against: exact match's, a bound for contains and regex); None for a split that keeps no references."""
    references = getattr(split, "references", None)
    if references is None:
        return None
    return np.unique([normalise(str(text)) for text in references], return_inverse=True)[1].astype(np.int64)


def stop_ids(tokenizer, references: list[np.ndarray], model=None) -> list[int]:
    """Token ids that end an answer: the tokenizer's end-of-sequence token, the model's (generation config), and the
    special tokens the reference completions hold (the template's end-of-turn token, which may not be the eos)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {index for index, token in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()
                if getattr(token, "special", False)}
    found = set()
    for reference in references:
        found |= special & {int(i) for i in reference}
    for owner in (tokenizer, getattr(model, "generation_config", None)):
        eos = getattr(owner, "eos_token_id", None)
        found |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return sorted(found)


def until_stop(tokens, stops: set) -> tuple[list[int], bool]:
    """(the tokens before the first stop token, whether one ended them)."""
    kept = []
    for token in tokens:
        if int(token) in stops:
            return kept, True
        kept.append(int(token))
    return kept, False


def text_of(tokenizer, ids, stops: set) -> str:
    """The text of ``ids`` up to the first stop token, without special tokens."""
    return tokenizer.decode(until_stop(ids, stops)[0], skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------------
# Decoding


def left_padded(prompts: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, attention mask) of prompts padded on the left to the longest: the new tokens then follow every prompt
    at the same position."""
    longest = max(len(prompt) for prompt in prompts)
    ids = np.full((len(prompts), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), longest), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, longest - len(prompt):] = prompt
            mask[row, longest - len(prompt):] = 1
    return ids, mask


def generating_model(model):
    """The module that generates: a compiled model's original (generation's shapes change every step, which would
    recompile), a DataParallel or DDP wrapper's module."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model) if type(model).__name__ in ("DataParallel", "DistributedDataParallel") else model


def greedy(model, prompts: list[np.ndarray], pad_id: int, stops: list[int], max_new_tokens: int, device,
           autocast: dict | None = None, synced: bool = False) -> list[list[int]]:
    """The new tokens greedy decoding with the KV cache gives each prompt of one batch (left-padded), up to
    ``max_new_tokens`` or a stop token (kept), without the padding after it."""
    import torch  # deferred: the registry is read at parse time, torch-free
    from transformers import GenerationConfig

    ids, mask = left_padded(prompts, pad_id)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                              eos_token_id=list(stops) or None, pad_token_id=pad_id)
    with torch.autocast(**autocast) if autocast else contextlib.nullcontext():
        out = generating_model(model).generate(input_ids=torch.from_numpy(ids).to(device),
                                               attention_mask=torch.from_numpy(mask).to(device),
                                               generation_config=config, synced_gpus=synced)
    new = out[:, ids.shape[1]:].tolist()
    answers = []
    for row in new:
        kept, stopped = until_stop(row, set(stops))
        answers.append(kept + [row[len(kept)]] if stopped else kept)
    return answers


# ---------------------------------------------------------------------------------------------------
# The evaluator


def _synchronize(device) -> None:
    """Wait for the device's queued work, so a clock read after it counts that work (a no-op on the CPU)."""
    import torch  # deferred: the registry is read at parse time, torch-free

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@functools.lru_cache(maxsize=4)
def _tokenizer(model_def_json: str):
    from ftbench.data.tokenizers import load_tokenizer

    return load_tokenizer(json.loads(model_def_json))


def tokenizer_of(spec):
    """The run's tokenizer (the one its data was prepared with), loaded once per process."""
    return _tokenizer(json.dumps(spec.model_def, sort_keys=True))


def answer_rows(model, rows: list[tuple], spec, tokenizer, device, pad_id: int, fits=None,
                autocast: dict | None = None, synced: bool = False) -> dict:
    """Generate an answer to each (prompt ids, reference ids[, reference text]) of ``rows`` and score them (the
    module's docstring; the reference is its text where given, else its ids decoded up to a stop token):
    {eval_generation_score, eval_generation_rows, eval_generated_tokens, eval_generation_s}. ``fits(rows)`` (a time
    limit's budget, asked before each batch) may end it between batches: the rows answered are then counted."""
    pattern = compile_regex(spec.answer_regex) if spec.answer_regex else None
    stops = stop_ids(tokenizer, [row[1] for row in rows], model)
    order = np.argsort([-len(row[0]) for row in rows], kind="stable")  # similar lengths batched: little padding
    right = answered = generated = 0
    _synchronize(device)
    started = time.perf_counter()
    for first in range(0, len(order), spec.eval_batch_size):
        batch = [rows[i] for i in order[first:first + spec.eval_batch_size]]
        if fits is not None and not fits(len(batch)):
            break
        answers = greedy(model, [row[0] for row in batch], pad_id, stops, spec.max_new_tokens, device, autocast, synced)
        for answer, row in zip(answers, batch):
            generated += len(answer)
            reference = row[2] if len(row) > 2 and row[2] is not None else text_of(tokenizer, row[1], set(stops))
            right += is_right(spec.answer_metric, text_of(tokenizer, answer, set(stops)), reference, pattern)
        answered += len(batch)
    _synchronize(device)
    return {SCORE: right / answered if answered else None, ROWS: answered, TOKENS: generated,
            SECONDS: time.perf_counter() - started}
