"""Instruction tuning (task ``instruction``): the decoder of ``causal_lm`` trained on instruction or chat rows
(TRL's four dataset formats: tasks/instruction_rows.py), the loss on the completion or the assistant turns by
default (``loss_on``), quality scored on those tokens.

What a row trains on is decided once, when the data is prepared: the row rendered (the chat template for
conversations), its tokens and the mask of the tokens it trains (``trained``) are stored in the shards, so the
padded, packed and padding-free batches and both engines read the same mask. ``rendered_examples.txt`` beside the
shards shows the first rows as the model sees them, trained tokens marked. Evaluation scores the completion tokens
whatever ``loss_on`` says (the answer is what a user judges); ``loss_on: all`` trains every token.

Beside each row: ``prompt_length`` (tokens before the last trained span: a generation evaluation's prompt) and
``reference`` (that span's text as given: its reference answer).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ftbench import atomic
from ftbench.data import prepared, sources
from ftbench.data.tokenizers import check_vocab, tokenizer_source
from ftbench.errors import ConfigError, SourceError
from ftbench.measure import model_shape
from ftbench.runspec import RunSpec
from ftbench.tasks import instruction_rows as rows_
from ftbench.tasks.base import IGNORE_INDEX, Batch, TokenisedSplit, pad
from ftbench.tasks.causal_lm import CausalLM
from ftbench.tasks.instruction_rows import BadRow, Columns

EXAMPLES_FILE = "rendered_examples.txt"
EXAMPLES_SHOWN = 3
# Synthetic instruction rows: the share of each row that is completion (the rest is prompt).
SYNTHETIC_COMPLETION_SHARE = 0.25


# ---------------------------------------------------------------------------------------------------
# The chat template: the dataset's setting, else the tokenizer's own


def template_setting(dataset_def: dict, where: str) -> str | None:
    """The ``chat_template`` setting's Jinja text: the string itself, or the file it names; None when unset."""
    value = dataset_def.get("chat_template")
    if value is None:
        return None
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(f"config key {where}.chat_template: {value!r} is neither a Jinja template (no {{% or {{{{) "
                          "nor a file")
    return path.read_text(encoding="utf-8")


def tokenizer_has_template(model_def: dict) -> bool | None:
    """Whether the model's tokenizer has a chat template, read from its files without loading it (parse time):
    ``chat_template`` in tokenizer_config.json, a chat_template.jinja beside it, or a GGUF header's
    ``tokenizer.chat_template``. None when its files cannot be read cheaply (a hub tokenizer not in the cache)."""
    source = tokenizer_source(model_def)
    if source is None:
        return False
    if source.get("gguf_file"):
        if source["kind"] not in ("path", "package"):
            return None
        try:
            header = model_shape.gguf_header(Path(sources.resolve_location(source)) / source["gguf_file"])
        except SourceError:
            return None
        return None if header is None else bool(header.get("tokenizer.chat_template"))
    from ftbench.data.tokenizers import _tokenizer_file  # one reader of a tokenizer's files, local or cached

    if _tokenizer_file(source, "chat_template.jinja") is not None:
        return True
    settings = _tokenizer_file(source, "tokenizer_config.json")
    if settings is None:
        return None
    try:
        return bool(json.loads(settings.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return None


def no_template_refusal(dataset_name: str, row_format: str, model_name: str | None) -> str:
    whose = f"model {model_name!r}'s tokenizer" if model_name else "the model's tokenizer"
    return (f"config key datasets.{dataset_name}.chat_template: the {row_format} rows of dataset {dataset_name!r} "
            f"are rendered by a chat template, and {whose} has none; set chat_template to a Jinja template (the text, "
            "or a file holding it)")


# ---------------------------------------------------------------------------------------------------
# Raw rows


def declared_format(dataset_def: dict) -> str | None:
    """The dataset's ``instruction_format`` (None: told from the columns); with ``prompt_template``:
    prompt_completion unless the conversational pair is asked for."""
    declared = dataset_def.get("instruction_format", "auto")
    if declared != "auto":
        return declared
    return "prompt_completion" if "prompt_template" in dataset_def else None


def peek_format(dataset_def: dict, where: str) -> str | None:
    """The format at parse time, from the setting or a local file's first row (read cheaply); None where only
    preparation can tell (a hub dataset, a save_to_disk folder)."""
    declared = declared_format(dataset_def)
    if declared is not None or dataset_def["source"]["kind"] in ("hub", "synthetic"):
        return declared
    try:
        location = Path(sources.resolve_location(dataset_def["source"]))
        data_format = sources.dataset_format(location, dataset_def.get("format"), where)
        if data_format is None or not location.is_file():
            return None
        head = sources.read_table_file(location, data_format, dataset_def.get("encoding", "utf-8"), where,
                                       nrows=1 if data_format != "parquet" else None)
    except (SourceError, ConfigError, OSError):
        return None  # preparation reads the file and says what is wrong with it
    first = head.iloc[0].to_dict() if len(head) else None
    return rows_.detect_format(head.columns, first, Columns.of(dataset_def))


def built_frame(frame: pd.DataFrame, dataset_def: dict, row_format: str, where: str, dropped: dict) -> pd.DataFrame:
    """Prompt-completion rows built from a table of other columns: ``prompt_template`` (a Python format string over
    the row's columns, e.g. ``"Is this review positive or negative?\\n{text}"``) gives the prompt,
    ``completion_column`` the completion, ``completion_map`` its values as the answers (rows of other values
    dropped: other_labels). ``conversational_prompt_completion``: the prompt as a user turn, the completion as the
    assistant's."""
    template, names = dataset_def["prompt_template"], Columns.of(dataset_def)
    if names.completion not in frame.columns:
        raise ConfigError(f"config key {where}.completion_column: column {names.completion!r} not in the data; columns "
                          f"are {', '.join(map(str, frame.columns))}")
    completions = frame[names.completion]
    mapping = dataset_def.get("completion_map")
    before = len(frame)
    if mapping is not None:
        keep = completions.astype(str).isin(set(map(str, mapping)))
        frame, completions = frame[keep], completions[keep].astype(str).map({str(k): v for k, v in mapping.items()})
    dropped["other_labels"] = dropped.get("other_labels", 0) + before - len(frame)
    try:
        prompts = [template.format(**row) for row in frame.to_dict("records")]
    except KeyError as exc:
        raise ConfigError(f"config key {where}.prompt_template: field {exc.args[0]!r} is not a column of the data; "
                          f"columns are {', '.join(map(str, frame.columns))}") from None
    if row_format == "conversational_prompt_completion":
        return pd.DataFrame({"prompt": [[{"role": "user", "content": p}] for p in prompts],
                             "completion": [[{"role": "assistant", "content": str(c)}] for c in completions]})
    return pd.DataFrame({"prompt": prompts, "completion": completions.astype(str).tolist()})


def raw_splits(dataset_name: str, dataset_def: dict, dropped: dict) -> tuple[pd.DataFrame, pd.DataFrame, str, Columns]:
    """(train rows, eval rows, format, column names): the source read (data/sources.py's files, folders and hub
    names), rows built from ``prompt_template`` where set, repeated rows dropped, then split as other datasets are
    (train_size / eval_size of train_split, seeded; or the named eval_split)."""
    where = f"datasets.{dataset_name}"
    tables = prepared.load_source_tables(dataset_def, where)
    row_format, names = declared_format(dataset_def), Columns.of(dataset_def)
    if row_format is None:
        first = next(iter(tables.values()))
        row_format = rows_.detect_format(first.columns, first.iloc[0].to_dict() if len(first) else None, names)
        if row_format is None:
            raise ConfigError(f"config key {where}.instruction_format: cannot tell the format from the columns "
                              f"({', '.join(map(str, first.columns))}); expected {names.text!r}, {names.prompt!r} and "
                              f"{names.completion!r}, or {names.messages!r} (the column settings rename them), or set it")
    for split_name, frame in tables.items():
        counts = dropped.setdefault(split_name, {})
        if "prompt_template" in dataset_def:
            frame, names = built_frame(frame, dataset_def, row_format, where, counts), Columns()
        if dataset_def.get("deduplicate", True):
            keys = _row_keys(frame)
            counts["duplicates"] = int(keys.duplicated().sum())
            frame = frame[~keys.duplicated()]
        tables[split_name] = frame.reset_index(drop=True)
    if "eval_split" in dataset_def:
        train_name, eval_name = dataset_def.get("train_split", "train"), dataset_def["eval_split"]
        train, evaluation = tables.get(train_name), tables.get(eval_name)
        if train is None or evaluation is None:
            raise ConfigError(f"config key {where}.eval_split: splits are {', '.join(tables)}")
        if dataset_def.get("deduplicate", True) and train_name != eval_name and len(evaluation):
            # Official splits can share rows: a row seen in training scores as if it were new.
            seen = _row_keys(evaluation).isin(set(_row_keys(train))) if len(train) else evaluation.index < 0
            dropped[eval_name]["also_in_train"] = int(seen.sum())
            evaluation = evaluation[~seen].reset_index(drop=True)
    else:
        frame = tables.get(dataset_def.get("train_split", "train"), next(iter(tables.values())))
        train, evaluation = prepared.seeded_split(frame, dataset_def, where, "rows remain after building and deduplication")
    return train, evaluation, row_format, names


def _row_keys(frame: pd.DataFrame) -> pd.Series:
    """Each row's content as text (messages included): equal rows, equal keys."""
    return frame.apply(lambda row: json.dumps(row.to_dict(), sort_keys=True, default=_plain), axis=1)


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else str(value)


def encode_split(frame: pd.DataFrame, tokenizer, seq_len: int, row_format: str, names: Columns, template: str | None,
                 counts: dict, bad_rows: str, where: str, split_name: str) -> list[rows_.EncodedRow]:
    """Every row of a split encoded; a bad row counted in ``counts`` by reason, or with ``on_bad_row: fail``
    refused in one line naming the dataset, split and row."""
    encoded = []
    for index, row in enumerate(frame.to_dict("records")):
        try:
            encoded.append(rows_.encode_row(row, tokenizer, seq_len, row_format, names, template))
        except BadRow as bad:
            if bad_rows == "fail":
                raise ConfigError(f"{where}: row {index} of split {split_name!r} cannot be trained on ({bad.reason}: "
                                  f"{bad}); fix it, or set {where}.on_bad_row: skip to drop such rows (counted)") from None
            counts[bad.reason] = counts.get(bad.reason, 0) + 1
    return encoded


# ---------------------------------------------------------------------------------------------------
# Arrow tables and splits in memory


def to_table(encoded: list[rows_.EncodedRow], row_format: str) -> pa.Table:
    """Token ids, the trained mask, lengths, trained-token counts, the generation prompt's length and the reference;
    the rows' format in the schema's metadata."""
    return pa.table({
        "input_ids": pa.array([row.input_ids for row in encoded], type=pa.list_(pa.int32())),
        "trained": pa.array([row.trained for row in encoded], type=pa.list_(pa.int8())),
        "length": pa.array([len(row.input_ids) for row in encoded], type=pa.int32()),
        "trained_tokens": pa.array([row.trained_tokens for row in encoded], type=pa.int32()),
        "prompt_length": pa.array([row.prompt_length for row in encoded], type=pa.int32()),
        "reference": pa.array([row.reference for row in encoded], type=pa.string()),
    }, metadata={"instruction_format": row_format})


def table_format(table: pa.Table) -> str:
    return (table.schema.metadata or {}).get(b"instruction_format", b"").decode() or "unknown"


class InstructionSplit(TokenisedSplit):
    """A split in memory: token ids, each row's trained mask, its generation prompt's length and reference."""

    def __init__(self, input_ids: list[np.ndarray], trained: list[np.ndarray], prompt_lengths: np.ndarray,
                 references: list[str]):
        super().__init__(input_ids=input_ids)
        self.trained = trained
        self.prompt_lengths = prompt_lengths
        self.references = references

    def take(self, indices: np.ndarray) -> "InstructionSplit":
        return InstructionSplit([self.input_ids[i] for i in indices], [self.trained[i] for i in indices],
                                self.prompt_lengths[np.asarray(indices, dtype=np.int64)],
                                [self.references[i] for i in indices])


def from_table(table: pa.Table) -> InstructionSplit:
    def arrays(column: str, dtype) -> list[np.ndarray]:
        values = table[column].combine_chunks()
        offsets = values.offsets.to_numpy()
        flat = values.flatten().to_numpy(zero_copy_only=False).astype(dtype)
        return np.split(flat, offsets[1:-1] - offsets[0]) if len(values) else []

    return InstructionSplit(arrays("input_ids", np.int64), arrays("trained", np.int64),
                            table["prompt_length"].to_numpy().astype(np.int64), table["reference"].to_pylist())


class TrainingOnAll:
    """A split whose rows train every token (``loss_on: all``): the stored mask set to ones as rows are taken."""

    def __init__(self, split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def lengths(self) -> np.ndarray:
        return self.split.lengths()

    def take(self, indices: np.ndarray) -> InstructionSplit:
        rows = self.split.take(indices)
        rows.trained = [np.ones_like(mask) for mask in rows.trained]
        return rows


def sequence_labels(ids: np.ndarray, trained: np.ndarray) -> np.ndarray:
    """A sequence's labels: its token where trained, else ignored; the first token always ignored (nothing of its
    own sequence predicts it, and packed after another sequence it must not be its target)."""
    labels = np.where(trained == 1, ids, IGNORE_INDEX)
    labels[:1] = IGNORE_INDEX
    return labels


def rendered_examples(tokenizer, table: pa.Table, row_format: str, count: int = EXAMPLES_SHOWN) -> str:
    """The first rows of a split as the model sees them: the decoded tokens, the trained ones between [[ and ]]."""
    lines = [f"The first {min(count, table.num_rows)} training rows ({row_format}) as the model reads them, decoded "
             "from the stored tokens. Tokens the loss is computed on (loss_on: completion) are between [[ and ]]; "
             "with loss_on: all every token but the first is.", ""]
    for index, row in enumerate(table.slice(0, count).to_pylist()):
        ids, trained = row["input_ids"], row["trained"]
        pieces, start = [], 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or trained[end] != trained[start]:
                text = tokenizer.decode(ids[start:end])
                pieces.append(f"[[{text}]]" if trained[start] and start > 0 else text)
                start = end
        lines += [f"--- row {index}: {len(ids)} tokens, {row['trained_tokens']} trained, generation prompt "
                  f"{row['prompt_length']} tokens ---", "".join(pieces), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# The family


class Instruction(CausalLM):
    name = "instruction"
    packable = True
    roles: dict[str, str] = {}  # the source columns are the format's (instruction_rows.Columns)
    column_keys = ("text_column", "prompt_column", "completion_column", "messages_column")
    reads_settings = ("loss_on",)
    masks_tokens = True
    generates = True  # held-out prompts answered by generation (tasks/generation.py) where answer_metric asks

    def check_run(self, run: RunSpec, setting_key) -> None:
        """The format known or knowable, and a chat template for conversations: refused here, at parse time,
        where the dataset's first row and the tokenizer's files tell (preparation refuses the rest)."""
        dataset_def, model_source = run.dataset_def, run.model_def["source"]
        check_vocab(run.model, run.model_def, "vocab_size", model_source.get("overrides", {}).get("vocab_size"))
        if dataset_def["source"]["kind"] == "synthetic":
            return
        where = f"datasets.{run.dataset}"
        if model_source["kind"] == "config" and "tokenizer" not in model_source:
            raise ConfigError(f"config key models.{run.model}.source.tokenizer: required to tokenise dataset "
                              f"{run.dataset!r} (without a tokenizer a config model trains on synthetic data only)")
        if "prompt_template" in dataset_def and "completion_column" not in dataset_def:
            raise ConfigError(f"config key {where}.completion_column: required with prompt_template (the column of "
                              "each row's answer)")
        row_format = peek_format(dataset_def, where)
        if row_format is not None and row_format.startswith("conversational"):
            if template_setting(dataset_def, where) is None and tokenizer_has_template(run.model_def) is False:
                raise ConfigError(no_template_refusal(run.dataset, row_format, run.model))

    def data_key(self, dataset_def: dict, dataset_name: str) -> dict:
        """A chat_template file's content (edited, the rows render otherwise: the data is prepared again)."""
        value = dataset_def.get("chat_template")
        if value is None or "{%" in value or "{{" in value:
            return {}
        text = template_setting(dataset_def, f"datasets.{dataset_name}")
        return {"chat_template_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}

    # -- preparation

    def tokenised_tables(self, dataset_name: str, dataset_def: dict, tokenizer, seq_len: int):
        where = f"datasets.{dataset_name}"
        dropped: dict = {}
        train, evaluation, row_format, names = raw_splits(dataset_name, dataset_def, dropped)
        template = template_setting(dataset_def, where)
        if row_format.startswith("conversational") and template is None and not getattr(tokenizer, "chat_template", None):
            raise ConfigError(no_template_refusal(dataset_name, row_format, None))
        train_name = dataset_def.get("train_split", "train")
        eval_name = dataset_def.get("eval_split", train_name)
        tables = {}
        for split_name, frame, source_split in (("train", train, train_name), ("eval", evaluation, eval_name)):
            counts = dropped.setdefault(source_split if source_split in dropped else next(iter(dropped)), {})
            encoded = encode_split(frame, tokenizer, seq_len, row_format, names, template, counts,
                                   dataset_def.get("on_bad_row", "skip"), where, split_name)
            if not encoded:
                raise ConfigError(f"config key {where}: no row of the {split_name} split can be trained on (rows "
                                  f"dropped: {prepared.dropped_summary(dropped)}); expected rows with a completion")
            tables[split_name] = to_table(encoded, row_format)
        return tables, None, dropped

    def preparation_extras(self, out_dir: Path, tokenizer, dataset_def: dict, tables: dict) -> dict:
        """The format in the manifest, and rendered_examples.txt beside the shards."""
        row_format = table_format(tables["train"])
        if tokenizer is not None and "train" in tables:
            atomic.write_text(out_dir / EXAMPLES_FILE, rendered_examples(tokenizer, tables["train"], row_format))
        return {"instruction_format": row_format}

    def split_figures(self, table: pa.Table) -> dict:
        return {"rows": table.num_rows, "tokens": int(pc.sum(table["length"]).as_py() or 0),
                "trained_tokens": int(pc.sum(table["trained_tokens"]).as_py() or 0)}

    def synthetic_tables(self, dataset_def: dict, seq_len: int, vocab_size: int):
        """Random full-length rows, the last SYNTHETIC_COMPLETION_SHARE of each trained (throughput and memory)."""
        plain, _ = super().synthetic_tables(dataset_def, seq_len, vocab_size)
        completion = max(1, int(seq_len * SYNTHETIC_COMPLETION_SHARE))
        tables = {}
        for split_name, table in plain.items():
            encoded = [rows_.EncodedRow(input_ids=ids, trained=[0] * (seq_len - completion) + [1] * completion,
                                        prompt_length=seq_len - completion, reference="")
                       for ids in table["input_ids"].to_pylist()]
            tables[split_name] = to_table(encoded, "synthetic")
        return tables, None

    # -- training side

    def load_split(self, shards: list[Path], manifest: dict, data_source: str):
        return prepared.read_split(shards, from_table, data_source)

    def for_training(self, split, spec: RunSpec):
        return TrainingOnAll(split) if spec.loss_on == "all" else split

    def sequence_labels(self, rows) -> list[np.ndarray]:
        return [sequence_labels(ids, trained) for ids, trained in zip(rows.input_ids, rows.trained)]

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        import torch  # deferred: the registry is read at parse time, torch-free

        rows = split.take(indices)
        ids, mask = pad(rows.input_ids, pad_token_id)
        labels, _ = pad(self.sequence_labels(rows), IGNORE_INDEX)
        lengths = mask.sum(axis=1)
        inputs = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
                  "labels": torch.from_numpy(labels)}
        return Batch(inputs=inputs, samples=len(rows), real_tokens=int(lengths.sum()), padded_tokens=int(mask.size),
                     sum_squared_lengths=int((lengths * lengths).sum()), trained_tokens=int((labels != IGNORE_INDEX).sum()))


FAMILY = Instruction()
