"""Instruction rows: the four dataset formats of TRL's documentation, what a bad row is, and one row turned into
token ids and the mask of the tokens it trains (``encode_row``). The family (tasks/instruction.py) prepares
whole datasets with it; anything that must agree with preparation token for token (a comparison with TRL's
SFTTrainer, a test) calls it too.

The formats, by the columns a row has (names are dataset settings; TRL's defaults):

- ``language_modeling``: ``text``, a string. Every token is trained.
- ``prompt_completion``: ``prompt`` and ``completion``, strings. The completion's tokens are trained.
- ``conversational``: ``messages``, a list of ``{role, content}``. The assistant turns' tokens are trained.
- ``conversational_prompt_completion``: ``prompt`` and ``completion``, each a list of messages. The
  completion's tokens are trained.

How a row becomes tokens follows SFTTrainer: strings are tokenised as they are (the tokenizer's own special
tokens added), the tokenizer's end-of-sequence token appended to a text or a completion that lacks it;
conversations are rendered by the chat template (``apply_chat_template``), which ends each turn itself. The
prompt / completion boundary is where the tokens of the prompt alone (rendered with the generation prompt:
``add_generation_prompt=True``) stop agreeing with the tokens of the whole row, never a searched string. An
assistant turn of a multi-turn conversation is bounded the same way: it starts after the conversation before it
rendered with the generation prompt and ends where the conversation up to it ends.

Torch-free: the tokenizer is passed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

FORMATS = ("language_modeling", "prompt_completion", "conversational", "conversational_prompt_completion")
# Roles a message may have (those chat templates render; OpenAI's developer and tool included).
ROLES = ("system", "developer", "user", "assistant", "tool")
TRAINED_ROLE = "assistant"

# Why a row is left out: the manifest's rows_dropped rules of instruction data (prepared.DROP_REASONS words them,
# each a rows_dropped_<rule> column), beside missing_or_empty and duplicates.
BAD_ROW_REASONS = ("bad_message", "unknown_role", "no_assistant_turn", "empty_completion", "prompt_fills_seq_len")


class BadRow(ValueError):
    """A row that cannot be trained on: ``reason`` is a key of BAD_ROW_REASONS (or missing_or_empty)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Columns:
    """The source columns of each role (dataset settings ``text_column``, ``prompt_column``,
    ``completion_column``, ``messages_column``; TRL's names by default)."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"

    @classmethod
    def of(cls, dataset_def: dict) -> "Columns":
        return cls(text=dataset_def.get("text_column", "text"), prompt=dataset_def.get("prompt_column", "prompt"),
                   completion=dataset_def.get("completion_column", "completion"),
                   messages=dataset_def.get("messages_column", "messages"))


@dataclass
class EncodedRow:
    """One row as preparation stores it.

    ``input_ids``: the row's tokens (cut to seq_len). ``trained``: 1 where the token is a target of the loss (the
    model at position t-1 predicts it), 0 elsewhere, the same length; TRL's ``completion_mask`` /
    ``assistant_masks``. The first token is never a target (nothing predicts it) whatever the mask says.
    ``prompt_length``: tokens before the last trained span (a generation evaluation's prompt: for a conversation,
    everything before its last assistant turn, with the generation prompt). ``reference``: the text of that span
    (the completion, or the last assistant turn's content). ``text``: the rendered row, for a reader to inspect.
    """

    input_ids: list[int]
    trained: list[int]
    prompt_length: int
    reference: str
    text: str = ""
    truncated: bool = False
    spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def trained_tokens(self) -> int:
        """Tokens the loss is computed on: the trained positions but the first."""
        return int(sum(self.trained[1:]))


def is_messages(value) -> bool:
    """Whether a cell holds a conversation (a list of mappings), as TRL's is_conversational tells."""
    return isinstance(as_list(value), list) and bool(as_list(value)) and isinstance(as_list(value)[0], dict)


def as_list(value):
    """A cell's list (Parquet and datasets give numpy arrays of dicts; a CSV may hold JSON text)."""
    if isinstance(value, np.ndarray):
        return list(value)
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, list) else value
    return value


def detect_format(columns, first_row: dict | None, names: Columns = Columns()) -> str | None:
    """The format of a table with ``columns`` (``first_row``: one of its rows, to tell strings from messages),
    as TRL tells them; None when the columns fit no format."""
    columns = set(columns)
    if names.messages in columns:
        return "conversational"
    if names.prompt in columns and names.completion in columns:
        sample = (first_row or {}).get(names.prompt)
        return "conversational_prompt_completion" if is_messages(sample) else "prompt_completion"
    if names.text in columns:
        return "language_modeling"
    return None


def messages_of(value, what: str) -> list[dict]:
    """A cell's messages as plain {role, content} dicts; BadRow for a message without them or of an unknown role."""
    value = as_list(value)
    if not isinstance(value, list):
        raise BadRow("bad_message", f"{what} is {type(value).__name__}, not a list of messages")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise BadRow("bad_message", f"{what}[{index}] is not a mapping with a string role and content: {str(message)[:80]!r}")
        if message["role"] not in ROLES:
            raise BadRow("unknown_role", f"{what}[{index}] has role {message['role']!r}; expected one of {', '.join(ROLES)}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def checked_row(row: dict, row_format: str, names: Columns = Columns()) -> dict:
    """The row's parts by role (``text``, or ``prompt`` and ``completion``, or ``messages``), checked; BadRow when it
    cannot be trained on (its reason: missing_or_empty, or one of BAD_ROW_REASONS)."""
    def text(column: str) -> str:
        value = row.get(column)
        if not isinstance(value, str) or not value.strip():
            raise BadRow("missing_or_empty", f"column {column!r} is {'empty' if isinstance(value, str) else 'missing'}")
        return value

    if row_format == "language_modeling":
        return {"text": text(names.text)}
    if row_format == "prompt_completion":
        prompt = text(names.prompt)
        completion = row.get(names.completion)
        if not isinstance(completion, str) or not completion.strip():
            raise BadRow("empty_completion", f"column {names.completion!r} is empty")
        return {"prompt": prompt, "completion": completion}
    if row_format == "conversational":
        messages = messages_of(row.get(names.messages), names.messages)
        assistant = [m for m in messages if m["role"] == TRAINED_ROLE]
        if not assistant:
            raise BadRow("no_assistant_turn", f"{names.messages} has no {TRAINED_ROLE} turn")
        if not any(m["content"].strip() for m in assistant):
            raise BadRow("empty_completion", f"every {TRAINED_ROLE} turn of {names.messages} is empty")
        if messages[0]["role"] == TRAINED_ROLE:
            raise BadRow("bad_message", f"{names.messages} starts with an {TRAINED_ROLE} turn: it has no prompt")
        return {"messages": messages}
    if row_format == "conversational_prompt_completion":
        prompt = messages_of(row.get(names.prompt), names.prompt)
        completion = messages_of(row.get(names.completion), names.completion)
        if not prompt:
            raise BadRow("missing_or_empty", f"{names.prompt} has no message")
        if not any(m["role"] == TRAINED_ROLE for m in completion):
            raise BadRow("no_assistant_turn", f"{names.completion} has no {TRAINED_ROLE} turn")
        if not any(m["content"].strip() for m in completion if m["role"] == TRAINED_ROLE):
            raise BadRow("empty_completion", f"the {TRAINED_ROLE} turns of {names.completion} are empty")
        return {"prompt": prompt, "completion": completion}
    raise ValueError(f"unknown instruction format {row_format!r}; expected one of {', '.join(FORMATS)}")


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """Leading tokens two sequences share (a template may render a prompt alone a little differently)."""
    count = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        count += 1
    return count


def _ids(encoded) -> list[int]:
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)


def _render(tokenizer, messages: list[dict], chat_template: str | None, generation_prompt: bool) -> list[int]:
    return _ids(tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=True, return_dict=True,
                                              add_generation_prompt=generation_prompt))


def _with_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_token
    return text if eos is None or text.endswith(eos) else text + eos


def _spans_of_strings(tokenizer, parts: dict) -> tuple[list[int], list[tuple[int, int]], str]:
    if "text" in parts:
        text = _with_eos(tokenizer, parts["text"])
        ids = _ids(tokenizer(text))
        return ids, [(0, len(ids))], text
    text = parts["prompt"] + _with_eos(tokenizer, parts["completion"])
    ids = _ids(tokenizer(text))
    start = common_prefix_length(_ids(tokenizer(parts["prompt"])), ids)
    return ids, [(start, len(ids))], text


def _spans_of_messages(tokenizer, parts: dict, chat_template: str | None) -> tuple[list[int], list[tuple[int, int]], str]:
    messages = parts["messages"] if "messages" in parts else parts["prompt"] + parts["completion"]
    ids = _render(tokenizer, messages, chat_template, generation_prompt=False)
    # Assistant turns of a conversation; of a prompt-completion pair, the completion's turns (as one span: TRL
    # trains everything after the prompt).
    first = len(parts["prompt"]) if "prompt" in parts else 0
    turns = [i for i in range(first, len(messages)) if messages[i]["role"] == TRAINED_ROLE]
    if "prompt" in parts:
        turns = turns[:1]
    spans = []
    for index in turns:
        start = common_prefix_length(_render(tokenizer, messages[:index], chat_template, True), ids)
        last = len(messages) if "prompt" in parts else index + 1
        end = len(ids) if last == len(messages) else common_prefix_length(
            _render(tokenizer, messages[:last], chat_template, False), ids)
        spans.append((start, max(start, end)))
    text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
    return ids, spans, text


def encode_row(row: dict, tokenizer, seq_len: int, row_format: str, names: Columns = Columns(),
               chat_template: str | None = None, loss_on: str = "completion") -> EncodedRow:
    """One raw row (a mapping of its source columns) as token ids and the mask of the tokens it trains.

    ``tokenizer``: a transformers tokenizer; ``seq_len``: the most tokens kept (the rest cut, as SFTTrainer's
    ``max_length`` cuts); ``row_format``: one of FORMATS (``detect_format`` tells it from the columns);
    ``names``: the source columns of each role; ``chat_template``: a Jinja template used in place of the
    tokenizer's own (conversational formats); ``loss_on``: ``completion`` (the completion or the assistant turns
    are trained: SFTTrainer's completion_only_loss / assistant_only_loss) or ``all`` (every token).

    Raises BadRow (its ``reason`` one of BAD_ROW_REASONS or ``missing_or_empty``) for a row that cannot be
    trained on, including one whose prompt alone fills ``seq_len``.
    """
    parts = checked_row(row, row_format, names)
    if row_format.startswith("conversational"):
        ids, spans, text = _spans_of_messages(tokenizer, parts, chat_template)
    else:
        ids, spans, text = _spans_of_strings(tokenizer, parts)
    trained = np.zeros(len(ids), dtype=np.int64)
    for start, end in spans:
        trained[start:end] = 1
    if loss_on == "all":
        trained[:] = 1
    elif loss_on != "completion":
        raise ValueError(f"loss_on {loss_on!r}: expected completion or all")
    truncated = len(ids) > seq_len
    # A span cut off entirely leaves the row; the row leaves when no span keeps a token after the first position.
    kept = [start for start, end in spans if start < seq_len and end > max(start, 1)]
    if not kept:
        first = spans[0][0] if spans else len(ids)
        raise BadRow("prompt_fills_seq_len", f"the prompt is {first} tokens; seq_len {seq_len} leaves no completion "
                     "token to train")
    last_start = kept[-1]
    ids, trained = ids[:seq_len], trained[:seq_len]
    reference = _reference(parts)
    return EncodedRow(input_ids=[int(i) for i in ids], trained=[int(t) for t in trained], prompt_length=int(last_start),
                      reference=reference, text=text, truncated=truncated, spans=spans)


def _reference(parts: dict) -> str:
    """The text of the row's last trained span, as given (a generation evaluation's reference answer)."""
    if "text" in parts:
        return parts["text"]
    if isinstance(parts.get("completion"), str):
        return parts["completion"]
    turns = parts["completion"] if "completion" in parts else parts["messages"]
    return [m["content"] for m in turns if m["role"] == TRAINED_ROLE][-1]
