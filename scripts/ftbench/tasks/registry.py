"""The task families, by the name a model's ``task:`` key gives: ``family(name)`` and ``NAMES``.

Adding a family is one module of ``ftbench.tasks`` (a ``TaskFamily`` subclass, see base.py, and its
``FAMILY`` instance) and its line in ``FAMILIES`` below. Nothing outside ``ftbench.tasks`` asks which task a
run is: it asks the run's family.

Torch-free at import: experiment/ reads the registry while Snakemake parses the workflow.
"""

from __future__ import annotations

from pathlib import Path

from ftbench.data import prepared
from ftbench.errors import ConfigError
from ftbench.tasks import (causal_lm, image_classification, image_text_retrieval, instruction, seq2seq,
                           text_classification, vision_language)
from ftbench.tasks.base import TaskFamily

FAMILIES: dict[str, TaskFamily] = {
    module.FAMILY.name: module.FAMILY
    for module in (text_classification, causal_lm, instruction, seq2seq, image_classification, image_text_retrieval,
                   vision_language)
}
NAMES = tuple(FAMILIES)
DEFAULT = "classification"  # a model without a task key
IMAGE_FAMILIES = tuple(name for name, fam in FAMILIES.items() if fam.modality == "image")


# Run settings one family or another reads and the others ignore (TaskFamily.reads_settings).
FAMILY_SETTINGS = frozenset(name for fam in FAMILIES.values() for name in fam.reads_settings)


def without_others_settings(settings: dict, fam: TaskFamily) -> dict:
    """``settings`` with those only other families read set to None: they change nothing for a run of ``fam``, so
    runs that differ in them share one id, and its row shows no value it did not use."""
    return {key: (None if key in FAMILY_SETTINGS and key not in fam.reads_settings else value)
            for key, value in settings.items()}


def family(name: str) -> TaskFamily:
    """The family of task ``name``."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ConfigError(f"task {name!r} is not a task family of this ftbench version; expected one of "
                          f"{', '.join(NAMES)}") from None


def model_family(model_def: dict) -> TaskFamily:
    """The family of a model definition (its ``task`` key; classification when it has none)."""
    return family(model_def.get("task", DEFAULT))


def prepare(dataset_name: str, dataset_def: dict, model_def: dict, seq_len: int, out_dir: str | Path,
            shard_size_mb: float = prepared.DEFAULT_SHARD_SIZE_MB, model_name: str = "model",
            image_size: int | None = None) -> dict:
    """Prepare one dataset for a model (shards and ``manifest.json`` in ``out_dir``), as its family does."""
    return model_family(model_def).prepare(dataset_name, dataset_def, model_def, seq_len, Path(out_dir), shard_size_mb,
                                           model_name, image_size)


def repair(data_dir: str | Path) -> list[Path]:
    """prepared.repair with the preparation of the manifest's family (``python -m ftbench repair-data``)."""
    def again(job: dict, scratch: str, shard_size_mb: float) -> dict:
        return prepare(job["dataset"], job["dataset_def"], job["model_def"], job["seq_len"], scratch, shard_size_mb,
                       job["model"], job.get("image_size"))

    return prepared.repair(data_dir, again)


def load_split(data_dir: str | Path, split_name: str, manifest: dict, data_source: str = "memory", spec=None):
    """A prepared split to draw batches from (in memory, or read from the shards per batch), as the
    manifest's family reads it; with the run's ``spec``, as that run trains on it (``TaskFamily.for_training``)."""
    shards = prepared.shard_paths(data_dir, manifest, split_name)
    fam = family(manifest["task"])
    split = fam.load_split(shards, manifest, data_source)
    return split if spec is None else fam.for_training(split, spec)
