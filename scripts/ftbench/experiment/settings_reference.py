"""config/README.md, the settings reference, rendered from what validation itself reads.

Every run setting comes from ``runspec.RunSpec`` (allowed values, default, one-line doc) and every
experiment-level key (models, datasets, sources, budget, prices, ...) from the experiment schema
(``config.load_schema``), so the reference cannot list a setting that does not exist or miss one that does.

    python -m ftbench.experiment.settings_reference           write config/README.md
    python -m ftbench.experiment.settings_reference --check   exit 1 if config/README.md is not current

Torch-free: it imports only the run settings and the schema.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ftbench import runspec
from ftbench.experiment import config, matrix

REPO = Path(__file__).resolve().parents[3]
OUTPUT = REPO / "config" / "README.md"
COMMAND = "python -m ftbench.experiment.settings_reference"

# Run settings by topic, in the order the reference shows them. A setting missing here is listed under
# "Other settings", so a new RunSpec field is never left out of the reference; place it in a group here.
GROUPS: list[tuple[str, str, list[str]]] = [
    ("What is trained", "Which model on which data, how, and for how long.",
     ["model", "dataset", "method", "precision", "batch_size", "seq_len", "epochs", "max_steps", "seed", "loss_on"]),
    ("LoRA and QLoRA", "Ignored (and left out of the run id) for `method: full`; the `qlora_*` settings only "
     "apply to `method: qlora`.",
     ["lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_base_dtype", "qlora_quant_type",
      "qlora_double_quant", "qlora_compute_dtype"]),
    ("Optimisation", "", ["optimizer", "learning_rate", "lr_warmup_steps", "weight_decay", "grad_accum_steps",
                          "gradient_checkpointing"]),
    ("Batches, kernels and engine", "How rows become batches and what computes them.",
     ["batching", "auto_batch_size", "auto_batch_size_max", "kernels", "attn_implementation", "compile", "engine",
      "data_source", "image_size"]),
    ("Devices and parallelism", "`batch_size` is per device: a 2-GPU ddp run takes twice the samples per step.",
     ["device", "num_gpus", "num_nodes", "parallel", "confirm_oom", "fsdp_reshard_after_forward", "fsdp_cpu_offload",
      "fsdp_reduce_dtype"]),
    ("Measurement and evaluation", "", ["warmup_steps", "warmup_until_stable", "warmup_max_steps", "eval_batch_size",
                                        "max_eval_samples", "eval_before_training", "eval_every", "eval_subset",
                                        "stop_at_target", "gpu_sample_interval_s"]),
    ("Answers generated", "Instruction data (`task: instruction`): what the model answers to the held-out prompts, "
     "by greedy decoding with the KV cache (`eval_batch_size` prompts at a time, left-padded, ending at the "
     "end-of-sequence or the template's end-of-turn token), scored against the reference completion at every "
     "evaluation (before, during and after training) beside eval loss and token accuracy on the completion tokens: "
     "`eval_generation_score`, with a Wilson interval on the prompts answered (`eval_generation_rows`), read against "
     "the model's score before training and the share of the most common reference answer (`eval_majority_class_rate`). "
     "It is an instruction run's quality figure and may be the `target`. Generating is timed apart "
     "(`eval_generation_s`, `eval_generated_tokens`), off the training clock like every evaluation and inside the "
     "job's time limit. A setting of the run, like the other evaluation settings; per dataset with "
     "`overrides: [{when: {dataset: ...}, set: {answer_metric: ...}}]`.",
     ["answer_metric", "answer_regex", "max_new_tokens"]),
]

# Meanings of schema keys that carry no description of their own (the schema's own description wins when
# it has one), and defaults applied in code rather than in the schema. Keyed by dotted path; a test checks
# every path still exists in the schema.
NOTES: dict[str, str] = {
    "data": "How prepared (tokenised) data is stored under results/data/.",
    "data.shard_size_mb": "target size of one Parquet shard, in MB; a small dataset makes one shard",
    "defaults": "Run settings of every run, one value each (see [Run settings](#run-settings)).",
    "models.source": "where the weights (or, for kind config, the architecture) come from",
    "models.max_seq_len": "the longest sequence the model takes (default: its config's max_position_embeddings); "
                          "a run's seq_len above it is refused",
    "datasets.source": "where the examples come from",
    "datasets.format": "file format, when the file name does not tell",
    "datasets.text_column": "input text column",
    "datasets.labels": "label values to keep, in the order that defines the class ids (default: all)",
    "datasets.train_split": "name of a split the source has (e.g. train)",
    "datasets.eval_split": "name of a split the source has (e.g. validation, test)",
    "datasets.train_size": "examples in the training part of a split made here (stratified by label)",
    "datasets.eval_size": "examples in the eval part of a split made here",
    "datasets.split_seed": "seed of the split made here",
    "datasets.pixels.height": "image height in pixels",
    "datasets.pixels.width": "image width in pixels",
    "source.revision": "hub revision: branch, tag or commit (kind hub)",
    "budget.tokens": "tokens of one pass over the planned training data",
    "budget.samples": "examples of one pass (projected with each run's measured tokens per example)",
    "budget.epochs": "passes over those tokens or samples (default 1)",
}
CODE_DEFAULTS: dict[str, Any] = {
    "data.shard_size_mb": matrix.DEFAULT_SHARD_SIZE_MB,
    "datasets.deduplicate": True,
    "models.task": "classification",
    "repeats": 1,
}

INTRO = """\
# Experiment settings reference

An experiment is one YAML file, given to Snakemake with `--configfile` (without one, the default
experiment `config/config.yaml` runs). [`config/config.yaml`](config.yaml) is the commented example:
copy it and edit. `python -m ftbench check my.yaml` validates a file and lists its runs; the same check
stops `snakemake -n` with one line naming the key when something is wrong.

```yaml
models:   {NAME: {source: {kind: ...}, task: ...}}       # what is trained; a run names one
datasets: {NAME: {source: {kind: ...}, text_column: ...}} # what it is trained on
defaults: {method: lora, precision: bf16, ...}           # run settings shared by every run
matrix:                                                  # axes: one run per combination
  model: [NAME]
  dataset: [NAME]
  method: [full, lora]
overrides: [{when: {method: full}, set: {learning_rate: 1.0e-4}}]   # adjust matching runs
exclude: [{method: qlora, precision: fp32}]               # drop matching runs
include: [{model: NAME, dataset: NAME, lora_rank: 64}]    # add runs on top of defaults
repeats: 3                                               # measure each run 3 times
budget: {tokens: 1.0e9}                                  # the full training run to project costs onto
prices: {provider: hyperscaler, pricing: spot}           # where the cost columns' prices come from
```

**Run settings vs experiment keys.** Every [run setting](#run-settings) can be given once in `defaults`
(one value for every run) or as a `matrix` axis (a non-empty list; one run per combination of all axes);
`model` and `dataset` must be axes (or given by `include` entries). `overrides`, `exclude` and `include`
entries are run settings too. A setting given nowhere takes the default below. The other top-level keys
(`models`, `datasets`, `budget`, `prices`, ...) describe the experiment as a whole: changing `budget`,
`prices`, `recommend` or `report` re-runs collect and report, never training.

Each run's id is readable plus a hash of its settings; a setting that does not apply to a run (LoRA
rank for full fine-tuning) is dropped before hashing, so such runs are not multiplied.
Price and GPU tables have their own commented files: `config/prices.yaml` ($ per device-hour, per
provider and pricing) and `config/gpus.yaml` (dense peak TFLOP/s per GPU model, for MFU).
The machine-readable form of everything below is `config/schema.yaml`.
"""


def generated_note() -> str:
    return (f"<!-- GENERATED by `{COMMAND}` from scripts/ftbench/runspec.py and "
            "scripts/ftbench/experiment/experiment_schema.yaml. Do not edit: edit those, then run the command "
            "(tests/test_settings_reference.py checks this file is current). -->\n")


def _literal(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, list):
        return "`[" + ", ".join(str(item) for item in value) + "]`"
    if isinstance(value, dict):
        return "`{}`" if not value else "`" + str(value) + "`"
    return f"`{value}`"


def _bounds(schema: dict) -> str:
    low = ("", "")
    if "minimum" in schema:
        low = (">=", schema["minimum"])
    elif "exclusiveMinimum" in schema:
        low = (">", schema["exclusiveMinimum"])
    high = ("<=", schema["maximum"]) if "maximum" in schema else ("", "")
    if low[0] == ">=" and high[0]:
        return f" {low[1]} to {high[1]}"
    parts = [f"{symbol} {value}" for symbol, value in (low, high) if symbol]
    return (" " + ", ".join(parts)) if parts else ""


def describe_values(schema: dict) -> str:
    """What one schema fragment accepts, for a Markdown table cell: `full` \\| `lora`, integer 1 to 64, ..."""
    if "$ref" in schema:
        return "a source (see [Sources](#sources))"
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return " \\| ".join(_literal(value) for value in schema["enum"])
    if "oneOf" in schema:
        return " or ".join(describe_values(option) for option in schema["oneOf"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join("`null`" if item == "null" else describe_values({**schema, "type": item}) for item in kind)
    if kind == "null":
        return "`null`"
    if kind == "boolean":
        return "`true` \\| `false`"
    if kind in ("integer", "number"):
        return kind + _bounds(schema)
    if kind == "array":
        items = schema.get("items", {})
        text = "list" if not items else "list of " + describe_values(items)
        return ("non-empty " if schema.get("minItems", 0) >= 1 else "") + text
    if kind == "object":
        values = schema.get("additionalProperties")
        if isinstance(values, dict) and values:
            return "mapping of name to " + describe_values(values)
        return "mapping"
    return kind or "any value"


def _cell(text: str) -> str:
    """Text for one table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _setting_row(field) -> str:
    meta = field.metadata["setting"]
    if field.name in ("model", "dataset"):
        default = f"required: a name from `{field.name}s`"
    else:
        default = _literal(runspec.RUN_DEFAULTS[field.name])
    return f"| `{field.name}` | {describe_values(meta.schema)} | {default} | {_cell(meta.doc)} |"


def run_settings_section() -> str:
    fields = {f.name: f for f in runspec.settings_fields()}
    grouped = [name for _, _, names in GROUPS for name in names]
    groups = [(title, note, [name for name in names if name in fields]) for title, note, names in GROUPS]
    others = [name for name in fields if name not in grouped]
    if others:
        groups.append(("Other settings", "", others))
    lines = ["## Run settings", "",
             f"All {len(fields)} settings a run can have, from `RunSpec` (scripts/ftbench/runspec.py). Each is a "
             "key of `defaults`, of `overrides` / `exclude` / `include` entries, and a possible `matrix` axis; most "
             "are also columns of `results/metrics.parquet`.", ""]
    for title, note, names in groups:
        lines += [f"### {title}", ""] + ([note, ""] if note else [])
        lines += ["| setting | values | default | meaning |", "|---|---|---|---|"]
        lines += [_setting_row(fields[name]) for name in names] + [""]
    return "\n".join(lines)


def _key_rows(properties: dict, required: list, path: str, prefix: str = "") -> list[str]:
    rows = []
    for key, schema in properties.items():
        where = f"{path}.{key}"
        if "default" in schema:
            default = _literal(schema["default"])
        elif where in CODE_DEFAULTS:
            default = _literal(CODE_DEFAULTS[where])
        else:
            default = "required" if key in required else ""
        meaning = _cell(schema.get("description") or NOTES.get(where, ""))
        rows.append(f"| `{prefix}{key}` | {describe_values(schema)} | {default} | {meaning} |")
        if schema.get("type") == "object" and "properties" in schema:
            rows += _key_rows(schema["properties"], schema.get("required", []), where, f"{prefix}{key}.")
    return rows


def key_table(properties: dict, path: str, required: list | None = None) -> str:
    header = ["| key | values | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + _key_rows(properties, required or [], path)) + "\n"


def _sources_section(schema: dict) -> str:
    source = schema["$defs"]["source"]
    kind = source["properties"]["kind"]
    lines = ["## Sources", "",
             _cell(source.get("description", "")) + " A model, a dataset or a config-built model's tokenizer is "
             "given as `source: {kind: ..., ...}`.", "",
             f"`kind`: {describe_values(kind)}. {_cell(kind.get('description', ''))} "
             "`synthetic` (datasets only) makes random full-length token sequences or images: throughput and "
             "memory without data.", "",
             key_table({k: v for k, v in source["properties"].items() if k != "kind"}, "source")]
    return "\n".join(lines)


def _named_section(schema: dict, key: str, extra: str) -> str:
    block = schema["properties"][key]
    entry = block["additionalProperties"]
    lines = [f"## {key}", "", _cell(block.get("description", "")) + " " + extra, "",
             key_table(entry["properties"], key, entry.get("required", []))]
    return "\n".join(lines)


def _block_section(schema: dict, key: str) -> str:
    block = schema["properties"][key]
    lines = [f"## {key}", "", _cell(block.get("description") or NOTES.get(key, "")), ""]
    if "properties" in block:
        lines.append(key_table(block["properties"], key, block.get("required", [])))
    else:
        default = f" Default: {_literal(CODE_DEFAULTS[key])}." if key in CODE_DEFAULTS else ""
        lines += [f"Values: {describe_values(block)}.{default}", ""]
    return "\n".join(lines)


def experiment_sections(schema: dict) -> str:
    top = schema["properties"]
    described = ["models", "datasets", "defaults", "matrix", "overrides", "exclude", "include"]
    parts = ["## Experiment keys", "", "The top level of an experiment file (`models`, `datasets` and `matrix` "
             "are required; any other key is refused).", "",
             "| key | what it holds |", "|---|---|"]
    for key, block in top.items():
        text = block.get("description") or NOTES.get(key, "")
        parts.append(f"| `{key}` | {_cell(text)} |")
    parts.append("")
    parts.append(_named_section(schema, "models", "Each model is a `source` plus the task it is trained "
                                "for: `classification` (an encoder with a class head; the dataset gives `label_column`), "
                                "`causal_lm` (a decoder: next-token loss, eval perplexity and token accuracy), `seq2seq` "
                                "(an encoder-decoder; the dataset gives `target_column`), or an image task below."))
    parts.append(_named_section(schema, "datasets", "Splits: either `train_size` / `eval_size` / `split_seed` "
                                "(a seeded split keeping each label's share) or `train_split` / `eval_split` "
                                "(splits the source already has)."))
    parts.append(_sources_section(schema))
    for key in top:
        if key not in described + ["models", "datasets"]:
            parts.append(_block_section(schema, key))
    return "\n".join(parts)


def render() -> str:
    """The text of config/README.md."""
    schema = config.load_schema()
    text = "\n".join([generated_note() + INTRO, run_settings_section(), experiment_sections(schema)])
    return text.rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Write config/README.md from RunSpec and the schema.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not what would be written")
    parser.add_argument("path", nargs="?", default=str(OUTPUT), help="output file (default: config/README.md)")
    args = parser.parse_args(argv)
    path, text = Path(args.path), render()
    if args.check:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != text:
            print(f"{path} is not current: run `{COMMAND}`", file=sys.stderr)
            return 1
        print(f"{path} is current")
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
