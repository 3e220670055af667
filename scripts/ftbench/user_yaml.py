"""Reading the YAML files users write (experiments, price tables, the GPU table, calibrations): numbers written
as people write them, a key given twice and a syntax error each refused in one line naming the file and line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ftbench.errors import ConfigError

# A number in exponent form as YAML 1.2, JSON and Python write it (1e9, 1.0e9, 5e-4, .5E3). PyYAML follows YAML 1.1,
# whose floats need a dot and a signed exponent (1.0e+9), and reads the others as text: a budget of 1e9 tokens would
# be a string the schema refuses, and a price of 2.1e0 a text no sum can take.
EXPONENT_NUMBER = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _DuplicateKey(Exception):
    def __init__(self, key, line: int, first_line: int):
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line


class UserLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping with the same key twice is an error (plain YAML loaders,
    Snakemake's too, keep the last value silently, so a second model of the same name would replace the first
    unnoticed) and that a number in exponent form is a number (EXPONENT_NUMBER)."""

    def construct_mapping(self, node, deep=False):
        first_lines: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                if key in first_lines:
                    raise _DuplicateKey(key, key_node.start_mark.line + 1, first_lines[key])
                first_lines[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the base loader reports it
                pass
        return super().construct_mapping(node, deep=deep)


# add_implicit_resolver copies SafeLoader's resolvers into UserLoader first: yaml.safe_load is left as it was.
UserLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_NUMBER, list("-+0123456789."))


def loads(text: str, name: str = "<text>") -> Any:
    """YAML text read as load_yaml reads a file (``name`` names it in a refusal)."""
    try:
        return yaml.load(text, Loader=UserLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(
            f"config file {name}, line {exc.line}: duplicate key {exc.key!r} (first given on line {exc.first_line}); "
            "YAML would keep only the last one: rename or remove one of them"
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(f"{exc.context or ''} {exc.problem or ''}".split())
        raise ConfigError(f"config file {name}{where}: not valid YAML ({problem})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {name}: not valid YAML ({' '.join(str(exc).split())})") from None


def load_yaml(path: str | Path) -> Any:
    """A YAML file with duplicate keys and syntax errors reported as one line naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path}: not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not valid YAML ({' '.join(str(exc).split())})") from None
    return loads(text, str(path))
