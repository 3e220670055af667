"""What fits, before anything trains: each run's memory estimate from its model's config alone, against the
GPUs of config/gpus.yaml (``python -m ftbench plan X.yaml``), and the check a train job makes on its own GPU
before it builds the model (train/trainer.py ``_prepare``).

The estimate is measure/memory_estimate.py's, from ``facts_from_config`` (parameter counts by kind derived
from the config's shape, no model built, torch-free). A model of two stacks (a dual encoder's towers, a
vision-language model's tower and decoder) is estimated by its family from the model itself, built with no
memory behind it (train/modeling.py ``meta_model``, passed in as ``build``: this layer imports no torch). A GPU's verdict allows for the estimate's error band
(memory_estimate.ERROR_BAND, +-10%): "yes" when the estimate plus the band fits, "no" when even the estimate
less the band does not, "borderline" between. The largest fitting batch is the largest per-GPU batch whose
estimate plus the band fits. Capacity: the table's memory_gb taken as GiB (an "80 GB" H100 shows 79.6 GiB to
CUDA), less CUDA_CONTEXT_MIB for the context and library handles the allocator does not count.

Packed batches (pack, padding_free) hold the training split's real tokens: where the data is prepared, the
run's largest packed batch from its rows' lengths (data/batch_order.py, the order the trainer draws), else
full rows (an upper bound, said in the note).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ftbench.data import batch_order, prepared, sources
from ftbench.data.tokenizers import tokenizer_source
from ftbench.errors import FtbenchError
from ftbench.experiment import feasibility
from ftbench.measure import memory_estimate, model_shape
from ftbench.runspec import RunSpec
from ftbench.tasks.registry import model_family

CUDA_CONTEXT_MIB = 512  # CUDA context, cuBLAS/cuDNN handles: memory a GPU loses outside the caching allocator
MIB_PER_GIB = 1024


def run_estimate(run: RunSpec, data_dir: str | Path | None = None, batch_size: int | None = None,
                 model: object | None = None, unbuilt_note: str | None = None) -> dict:
    """The run's estimate (memory_estimate's figures, plus ``plan_note``), from its model's config alone; packed
    batches from its prepared data in ``data_dir``, where there is one. ``model``: the run's model on the meta
    device, which a model of two stacks needs (``needs_built_model``; else a note says why there is none)."""
    run = run.replace(batch_size=batch_size) if batch_size else run
    family = model_family(run.model_def)
    if local_config(run.model_def["source"]) is None:
        return _no_estimate(NOT_READABLE)
    manifest = prepared_manifest(data_dir) or {}
    manifest = {"seq_len": run.seq_len, **family.planning_manifest(run), **manifest}
    if needs_built_model(run):
        if model is None:
            return _no_estimate(unbuilt_note or UNBUILT_NOTES["qlora" if run.method == "qlora" else "other"])
        return _estimate_of_model(family, model, run, manifest, data_dir)
    facts, why_not = config_facts(run)
    if facts is None:
        return _no_estimate(why_not)
    lengths = train_lengths(str(data_dir)) if run.packed and manifest.get("splits") else None
    if lengths is not None:
        manifest["largest_packed_batch"] = batch_order.largest_packed_batch(run, lengths)
    figures = family.memory_estimate(facts, run, manifest)
    notes = []
    if run.packed and lengths is None:
        notes.append("packed rows taken as full (data not prepared yet: its lengths are unknown)")
    # dp: GPU 0 also gathers every replica's outputs, but the trainer keeps only the loss, so the gathered logits
    # are gone before the backward pass makes the peak: on two H100s (dp-vs-ddp.yaml) GPU 0's peak was the
    # single-GPU run's plus 21 MB, and the replica's estimate 1.021 of it.
    figures["plan_note"] = "; ".join(notes) or None
    return figures


NOT_READABLE = "the model's config is not readable here (a hub model): no estimate before it is loaded"


def local_config(source: dict) -> dict | None:
    """The model's config settings read here, with no network and no weights: a config-built model's overrides, a
    local folder's config.json, or a local GGUF file's header; None otherwise."""
    settings = sources.local_model_config(source)
    if settings is None and source.get("gguf_file") and source["kind"] in ("path", "package"):
        try:
            path = Path(sources.resolve_location(source)) / source["gguf_file"]
            settings = _gguf_config(str(path), path.stat().st_mtime_ns)
        except (FtbenchError, OSError):
            return None
    return dict(settings) if settings is not None else None


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, mtime_ns: int) -> dict | None:
    """model_shape.gguf_config, once per file version: its header lists every token (0.1 s), and a plan asks for
    the settings once per batch size it tries on every GPU."""
    return model_shape.gguf_config(path)


def config_settings(run: RunSpec) -> tuple[dict | None, str | None]:
    """(the run's model config over its architecture's defaults, with its vocabulary; or None and why not): what a
    plan made from the config alone reads. A model of two stacks has no such settings (``needs_built_model``)."""
    source = run.model_def["source"]
    settings = local_config(source)
    if settings is None:
        return None, NOT_READABLE
    settings = model_shape.with_defaults(source.get("architecture"), settings)
    if settings.get("text_config") or settings.get("vision_config"):
        return None, "a multimodal config is not planned from the config by this task's family"
    vocab = settings.get("vocab_size") or tokenizer_vocab(run.model_def)
    return ({**settings, "vocab_size": vocab} if vocab else settings), None


def config_facts(run: RunSpec) -> tuple[memory_estimate.ModelFacts | None, str | None]:
    """(the run's model facts from its config alone, or None and why not): parameters by kind, shape, adapters."""
    settings, why_not = config_settings(run)
    if settings is None:
        return None, why_not
    labels = len(run.dataset_def.get("labels") or ()) or 2
    return memory_estimate.facts_from_config(settings, run, model_family(run.model_def).takes_num_labels, labels), None


def _estimate_of_model(family, model, run: RunSpec, manifest: dict, data_dir) -> dict:
    """The family's estimate from the run's (meta-device) model. A padded batch is as long as its longest row: read
    from the prepared data as the train job does, else the most a row holds (an upper bound, in the note)."""
    note = None
    if family.estimate_reads_longest_row:
        if manifest.get("splits"):
            manifest = {**manifest, "longest_row": int(train_lengths(str(data_dir)).max(initial=0))}
        else:
            note = "rows taken as seq_len plus the image's tokens (data not prepared yet: an upper bound)"
    try:
        figures = family.memory_estimate(model, run, manifest)
    except Exception as exc:  # noqa: BLE001 - an estimate advises: one it cannot make leaves the run to train
        return _no_estimate(f"no estimate: {type(exc).__name__}: {exc}"[:300])
    return {**figures, "plan_note": note}


# Why a model of two stacks has no estimate before its train job builds it.
UNBUILT_NOTES = {
    "qlora": "a QLoRA model of two stacks is estimated once loaded (bitsandbytes quantises only real weights): the train job does",
    "other": "a model of two stacks is estimated from the model built on the meta device: `python -m ftbench plan` and the train job do",
}


def built_model(run: RunSpec, build) -> tuple[object | None, str | None]:
    """(the run's model from ``build``, where its estimate needs one; why there is none, if building it failed)."""
    if build is None or not needs_built_model(run):
        return None, None
    try:
        return build(run), None
    except Exception as exc:  # noqa: BLE001 - an estimate advises: a model it cannot build is trained, not refused
        return None, f"no estimate: the model could not be built on the meta device ({type(exc).__name__}: {exc})"[:300]


def needs_built_model(run: RunSpec) -> bool:
    """Whether the run's family estimates from the model (a dual encoder's towers, a vision-language model's
    tower and decoder) rather than from one stack's facts read off the config."""
    return model_family(run.model_def).estimate_needs_model


def _no_estimate(note: str) -> dict:
    return {**memory_estimate.no_estimate(note), "plan_note": None}


def tokenizer_vocab(model_def: dict) -> int | None:
    """The vocabulary of a local tokenizer folder (tokenizer.json or vocab.txt), read without transformers."""
    source = tokenizer_source(model_def)
    if not source or source.get("kind") not in ("path", "package"):
        return None
    try:
        folder = Path(sources.resolve_location(source))
        if (folder / "tokenizer.json").is_file():
            data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
            vocab = data.get("model", {}).get("vocab") or {}
            added = {token["id"] for token in data.get("added_tokens") or ()} - set(vocab.values() if isinstance(vocab, dict) else ())
            return len(vocab) + len(added) or None
        if (folder / "vocab.txt").is_file():
            return sum(1 for _ in (folder / "vocab.txt").open(encoding="utf-8")) or None
    except (OSError, ValueError, Exception):  # noqa: BLE001 - a plan goes on without the tokenizer's vocabulary
        return None
    return None


def prepared_manifest(data_dir: str | Path | None) -> dict | None:
    """The manifest of the prepared data in ``data_dir``, where it is prepared already."""
    if data_dir is None:
        return None
    try:
        return json.loads((Path(data_dir) / prepared.MANIFEST_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def train_lengths(data_dir: str):
    """Every training row's length, read from the prepared shards' length column."""
    manifest_path = Path(data_dir) / prepared.MANIFEST_NAME
    return _train_lengths(data_dir, manifest_path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _train_lengths(data_dir: str, manifest_mtime_ns: int):
    # The plan asks once per run and batch size: read once per preparation of the data (its manifest's time).
    manifest = prepared_manifest(data_dir)
    return prepared.DiskSplit(prepared.shard_paths(data_dir, manifest, "train"), decode=None).lengths()


def data_dir_of(run: RunSpec, data_root: str | Path | None) -> Path | None:
    """Where the run's data is prepared under ``data_root`` (results/data), if given."""
    return Path(data_root) / run.data_id if data_root is not None else None


def capacity_mib(gpu: dict) -> float:
    """The memory training can allocate on a GPU of the table (see the module's docstring)."""
    return gpu["memory_gb"] * MIB_PER_GIB - CUDA_CONTEXT_MIB


def plan_run(run: RunSpec, gpus: list[dict], data_root: str | Path | None = None, build=None) -> dict:
    """The run's estimate, and per GPU of the table: its capacity, the verdict and the largest fitting batch.
    ``build``: makes the run's model on the meta device (train/modeling.py meta_model), once, where needed.
    A run this version records as ``unsupported`` without training (experiment/feasibility.py) gets no estimate
    and no GPU rows: ``unsupported`` holds the reason, as the run's row will."""
    reason = feasibility.unsupported_reason(run)
    if reason:
        return {**_no_estimate(f"unsupported: {reason}"), "unsupported": reason, "gpus": []}
    data_dir = data_dir_of(run, data_root)
    model, unbuilt_note = built_model(run, build)
    figures = run_estimate(run, data_dir, model=model, unbuilt_note=unbuilt_note)
    rows = []
    for gpu in gpus:
        if not gpu.get("memory_gb") or figures["memory_estimate_mb"] is None:
            continue
        capacity = capacity_mib(gpu)
        largest = memory_estimate.largest_fitting_batch(
            lambda batch: run_estimate(run, data_dir, batch, model)["memory_estimate_mb"], capacity)
        rows.append({"gpu": gpu["name"], "capacity_mib": capacity,
                     "fits": memory_estimate.fit(figures["memory_estimate_mb"], capacity), "largest_batch": largest})
    return {**figures, "unsupported": None, "gpus": rows}


def predicted_not_to_fit(run: RunSpec, capacity_bytes: int, device_name: str, data_dir: str | Path | None = None,
                         build=None) -> str | None:
    """The status_reason of a run predicted not to fit its own GPU ("no": beyond the error band), else None.
    A run with auto_batch_size searches for what fits instead, and one without an estimate is launched.
    ``build``: as for plan_run."""
    if run.auto_batch_size or run.confirm_oom:
        return None
    model, _ = built_model(run, build)
    figures = run_estimate(run, data_dir, model=model)
    estimate = figures["memory_estimate_mb"]
    capacity = capacity_bytes / 2**20 - CUDA_CONTEXT_MIB
    if estimate is None or memory_estimate.fit(estimate, capacity) != "no":
        return None
    return (f"predicted not to fit: estimate {estimate / MIB_PER_GIB:.1f} GiB > {capacity / MIB_PER_GIB:.1f} GiB on "
            f"{device_name} (set confirm_oom: true to run it anyway)")

