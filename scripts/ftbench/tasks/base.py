"""The interface every task family implements (``TaskFamily``), and what the families share: the batch a
collate makes (``Batch``), rows of token ids in memory (``TokenisedSplit``) and right-padding (``pad``).

A family is one module of ``ftbench.tasks`` and one line of ``registry.FAMILIES``. It owns, for its task:
what the model is (``auto_model``, ``peft_task_type``, ``head_modules``, ``lora_targets``), the parse-time
rules of a run (``check_run``; experiment/ calls them), preparation (``prepare``: raw data to shards and a
manifest), reading the shards back (``load_split``), batching (``collate``), scoring (``eval_accumulator``),
the memory estimate (``memory_estimate``) and the token counts of the estimates (``tokens_per_example``,
``separate_targets``, ``images_beside_text``).

Torch-free at import: the registry is read at Snakemake parse time. Whatever needs torch or transformers
imports it inside the method that uses it, saying so.

Token counting convention (used for every throughput figure): the real, unpadded tokens the model
processes in a step, i.e. input tokens, plus target tokens for seq2seq (the decoder processes them too),
plus image tokens for the image families.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ftbench.runspec import RunSpec
from ftbench.tasks import generation

IGNORE_INDEX = -100  # positions the loss skips (padding)
# Eval figures a lower value of which is better; every other eval figure is a proportion in [0, 1] (accuracy,
# token accuracy, recall@1) where higher is better.
LOWER_IS_BETTER = ("eval_loss", "eval_perplexity")


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of the eval figure ``metric`` is better (accuracy) rather than worse (loss)."""
    return metric not in LOWER_IS_BETTER


def reaches(metric: str, value: float | None, target: float) -> bool:
    """Whether ``value`` of the eval figure ``metric`` is at least as good as ``target``."""
    if value is None or value != value:  # None or NaN: no score
        return False
    return value >= target if higher_is_better(metric) else value <= target


# The count an eval figure's interval is on, where it is not eval_samples (the rows the forward pass scored).
SAMPLES_OF = {generation.SCORE: generation.ROWS}


def is_proportion(metric: str) -> bool:
    """Whether the eval figure ``metric`` is a share of scored items (its interval: Wilson's)."""
    return metric not in LOWER_IS_BETTER


@dataclass
class TokenisedSplit:
    """A split in memory: unpadded token id arrays, plus class labels or target ids."""

    input_ids: list[np.ndarray]
    labels: np.ndarray | None = None  # class ids (classification)
    target_ids: list[np.ndarray] | None = None  # decoder targets (seq2seq)

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> np.ndarray:
        """Input length of every row (length-grouped batching sorts by it)."""
        return np.array([len(ids) for ids in self.input_ids], dtype=np.int64)

    def take(self, indices: np.ndarray) -> "TokenisedSplit":
        """The rows at ``indices``, in that order."""
        return TokenisedSplit(
            input_ids=[self.input_ids[i] for i in indices],
            labels=self.labels[indices] if self.labels is not None else None,
            target_ids=[self.target_ids[i] for i in indices] if self.target_ids is not None else None,
        )


@dataclass
class Batch:
    inputs: dict  # keyword arguments of the model's forward (torch tensors)
    samples: int
    real_tokens: int  # tokens without padding (see the module docstring)
    padded_tokens: int  # positions processed including padding
    sum_squared_lengths: int  # sum over input sequences of real length squared (attention FLOPs)
    target_tokens: int = 0  # seq2seq: the part of real_tokens that is decoder targets
    target_sum_squared_lengths: int = 0
    images: int = 0  # image families: images in the batch
    image_tokens: int = 0  # the part of real_tokens that is image (patch) tokens
    capacity_tokens: int = 0  # packed batches (batching.py): rows x row capacity; 0 when not packed
    # Tokens the loss is computed on (labels not ignored), where a family masks some real tokens out of it
    # (instruction: the prompt); 0 where it does not count them apart.
    trained_tokens: int = 0
    # vision-language: tokens the vision tower processes (its class token included) and their sum of
    # squared lengths per image, for the FLOPs; not part of real_tokens (the decoder's)
    vision_tokens: int = 0
    vision_sum_squared_lengths: int = 0

    def to(self, device) -> "Batch":
        moved = {key: to_device(value, device) for key, value in self.inputs.items()}
        return dataclasses.replace(self, inputs=moved)


def to_device(tensor, device):
    """``tensor`` on ``device`` with the host not waiting for the GPU's queued work: onto a GPU from pinned
    memory, non-blocking. The trainer collates a step's first batch while the step before still runs on the GPU,
    and times it as loader time: a copy from pageable memory (large ones) or torch.tensor(..., device=cuda) waits
    for that work to finish, which would count the GPU's time as the loader's."""
    import torch  # deferred: the registry is read at parse time, torch-free

    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def pad(sequences: list[np.ndarray], value: int) -> tuple[np.ndarray, np.ndarray]:
    """(padded ids, attention mask) padded on the right to the longest sequence."""
    longest = max(len(seq) for seq in sequences)
    ids = np.full((len(sequences), longest), value, dtype=np.int64)
    mask = np.zeros((len(sequences), longest), dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


class TaskFamily:
    """One task family. Class attributes describe it; methods do its part of each stage. The defaults here
    are those most families share; a family overrides what differs."""

    name: str = ""
    auto_model: str = ""  # transformers Auto class
    peft_task_type: str = ""  # peft TaskType member; "" where peft has none (head_modules are named instead)
    head_modules: tuple[str, ...] = ()  # new output layers LoRA must train in full (when peft has no task type)
    # Modules applied to one pooled token per sequence or image, not to every token: the FLOP count counts them
    # once per sequence (measure/flops.py).
    pooled_heads: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # dataset keys the family requires beside its text or image column
    column_keys: tuple[str, ...] = ("text_column",)  # dataset keys naming file columns (checked at parse time)
    modality: str = "text"  # "image": the data holds images
    takes_num_labels: bool = False  # the model is built with the data's class count
    packable: bool = False  # packed batching (batching.py) is exact for it
    not_packable: str = "not supported"  # why packed batching is refused, when it is
    # Whether memory_estimate reads ``longest_row`` beside the manifest's keys (the train split's longest row,
    # which bounds a padded batch's row length), for rows often much shorter than seq_len says.
    estimate_reads_longest_row: bool = False
    separate_targets: bool = False  # labels are a separate decoder sequence (their tokens count apart)
    masks_tokens: bool = False  # some real tokens are not trained (Batch.trained_tokens counts those that are)
    # Run settings only this family reads: experiment/matrix.py nulls them for the families that do not list them.
    reads_settings: tuple[str, ...] = ()
    images_beside_text: bool = False  # image tokens are not in input_ids (a dual encoder's pairs)

    def __repr__(self) -> str:
        return f"<task family {self.name}>"

    # -- the model ------------------------------------------------------------------------------------

    def model_class(self):
        import transformers  # deferred: the registry is read at parse time, torch-free

        return getattr(transformers, self.auto_model)

    def model_kwargs(self, num_labels: int | None) -> dict:
        return {"num_labels": num_labels} if self.takes_num_labels else {}

    def config_overrides(self, overrides: dict, spec: RunSpec) -> dict:
        """A config-built model's overrides for this run (before its vocabulary is set)."""
        return overrides

    def take_vocabulary(self, overrides: dict, vocab_size: int | None, spec: RunSpec) -> dict:
        """A config-built model's overrides with its tokenizer's vocabulary (``vocab_size``: the prepared data's,
        from its manifest), so that its parameters, FLOPs, memory and tokens/s describe the model its tokens
        index, not its config class's default vocabulary. Default: nothing to take (no text vocabulary, or the
        family's config_overrides / make_config sets it)."""
        return overrides

    def make_config(self, config_class, overrides: dict, kwargs: dict, spec: RunSpec):
        """A config-built model's transformers config."""
        return config_class(**overrides, **kwargs)

    def pretrained_kwargs(self) -> dict:
        """Extra from_pretrained keywords for a checkpoint of this family."""
        return {}

    def lora_targets(self, model, spec: RunSpec):
        """What peft's target_modules gets: the run's lora_targets as given."""
        return spec.lora_targets

    # -- parse-time rules -------------------------------------------------------------------------------

    def check_run(self, run: RunSpec, setting_key) -> None:
        """Refuse, with ConfigError naming the key, what this family cannot run (``setting_key(name, value)``:
        the config key a run setting came from). Torch-free: experiment/ calls it at parse time."""

    def tokens_per_example(self, run: RunSpec) -> int:
        """Tokens one training example is, for the parse-time compute estimate (cluster/resources.py)."""
        return run.seq_len

    # -- data -------------------------------------------------------------------------------------------

    def prepare(self, dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, out_dir: Path,
                shard_size_mb: float, model_name: str, image_size: int | None) -> dict:
        raise NotImplementedError

    def load_split(self, shards: list[Path], manifest: dict, data_source: str):
        raise NotImplementedError

    def collate(self, split, indices: np.ndarray, pad_token_id: int) -> Batch:
        raise NotImplementedError

    def data_key(self, dataset_def: dict, dataset_name: str) -> dict:
        """What the data id hashes beside the dataset's settings: the content of files a setting names (a file's
        edit then prepares the data again). None by default, so other families' data ids stay as they were."""
        return {}

    def for_training(self, split, spec: RunSpec):
        """The training split as the run trains on it (instruction: every token with ``loss_on: all``)."""
        return split

    def sequence_labels(self, rows) -> list[np.ndarray]:
        """Each row's labels as a packed row holds them (batching.py): a decoder's tokens, the first ignored."""
        labels = []
        for ids in rows.input_ids:
            row = np.array(ids, dtype=np.int64)
            row[:1] = IGNORE_INDEX  # the first token is predicted by nothing of its own sequence
            labels.append(row)
        return labels

    def row_classes(self, split) -> np.ndarray | None:
        """The class id of every row of a loaded split (the majority-class rate of the rows an evaluation scored is
        read from them); None for a family without classes. A generating family's: the rows' reference answers
        (generation.answer_classes)."""
        return generation.answer_classes(split) if self.generates else None

    def row_strata(self, split) -> np.ndarray | None:
        """What a partial evaluation's rows are stratified by (train/evaluation.py): the rows' classes, where the
        family has them; None: a seeded sample."""
        return self.row_classes(split)

    # -- measuring --------------------------------------------------------------------------------------

    def eval_accumulator(self):
        raise NotImplementedError

    def eval_metrics(self) -> tuple[str, ...]:
        """The eval figures this family's scoring gives (its accumulator's METRICS), e.g. for a quality target."""
        return type(self.eval_accumulator()).METRICS

    # Whether the family answers prompts by generation (tasks/generation.py): its rows are prompts and completions.
    generates: bool = False

    def run_eval_metrics(self, run: RunSpec) -> tuple[str, ...]:
        """The eval figures a run of this family gives: eval_metrics, and the generation score where it generates."""
        if self.generates and run.answer_metric not in (None, "none"):
            return (*self.eval_metrics(), generation.SCORE)
        return self.eval_metrics()

    def generation_rows(self, split, indices: np.ndarray) -> list[tuple]:
        """(prompt ids, reference ids, reference text) of a generating family's split's rows at ``indices``: by
        default read from what preparation stored beside them (generation.prompt_rows)."""
        return generation.prompt_rows(split, indices)

    def generation_scores(self, model, split, indices: np.ndarray, spec: RunSpec, device, pad_id: int, fits=None,
                          autocast: dict | None = None) -> dict:
        """The generation figures (generation.FIGURES) of the rows at ``indices``: none unless the family generates and
        the run's answer_metric asks for them. ``fits(rows)``: a time limit's budget, asked before each batch."""
        if not self.generates or spec.answer_metric in (None, "none") or len(indices) == 0:
            return {}
        return generation.answer_rows(model, self.generation_rows(split, indices), spec, generation.tokenizer_of(spec),
                                      device, pad_id, fits, autocast, synced=spec.parallel == "fsdp")

    def memory_estimate(self, model, spec: RunSpec, manifest: dict) -> dict:
        raise NotImplementedError

    # Whether the memory estimate reads the model itself (two stacks: the plan builds it on the meta device)
    # rather than one stack's facts, which the plan can read off the config.
    estimate_needs_model = False

    def planning_manifest(self, run: RunSpec) -> dict:
        """Manifest figures the memory estimate reads, from the config, for a plan made before the data is
        prepared (the prepared manifest's own replace them): an image family's tokens per image."""
        return {"image_tokens_per_image": self.tokens_per_example(run)}

