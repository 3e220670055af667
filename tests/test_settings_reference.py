"""config/README.md, the settings reference, is generated from RunSpec and the experiment schema
(scripts/ftbench/experiment/settings_reference.py): the committed file must be what the generator writes."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT
from ftbench import runspec
from ftbench.experiment import config, settings_reference

REGENERATE = "python -m ftbench.experiment.settings_reference"


def test_committed_reference_is_current():
    committed = (ROOT / "config" / "README.md").read_text(encoding="utf-8")
    assert committed == settings_reference.render(), (
        f"config/README.md is out of date with scripts/ftbench/runspec.py or experiment_schema.yaml: run `{REGENERATE}`"
    )


def test_every_run_setting_is_documented_with_its_default():
    text = settings_reference.render()
    for field in runspec.settings_fields():
        assert f"| `{field.name}` |" in text, f"run setting {field.name} missing from the reference"
    assert f"All {len(runspec.settings_fields())} settings" in text


def test_every_run_setting_has_a_group():
    """A new RunSpec field lands under "Other settings" until it is placed in settings_reference.GROUPS."""
    grouped = {name for _, _, names in settings_reference.GROUPS for name in names}
    assert {f.name for f in runspec.settings_fields()} <= grouped
    assert "### Other settings" not in settings_reference.render()


def test_every_experiment_key_is_documented():
    text = settings_reference.render()
    schema = config.load_schema()
    for key in schema["properties"]:
        assert f"| `{key}` |" in text, f"experiment key {key} missing from the reference"
    for block in ("models", "datasets"):
        for key in schema["properties"][block]["additionalProperties"]["properties"]:
            assert f"| `{key}` |" in text, f"{block}.{key} missing from the reference"
    for key in schema["$defs"]["source"]["properties"]:
        assert f"`{key}`" in text


def test_notes_name_keys_that_exist():
    """A note for a key the schema no longer has would document nothing: drop it with the key."""
    schema = config.load_schema()

    def exists(path: str) -> bool:
        first, *rest = path.split(".")
        node = schema["$defs"]["source"] if first == "source" else schema["properties"].get(first)
        for part in rest:
            if node is None:
                return False
            if "properties" not in node:  # models / datasets: the schema of one named entry
                node = node.get("additionalProperties") or {}
            node = node.get("properties", {}).get(part)
        return node is not None

    stale = [path for path in [*settings_reference.NOTES, *settings_reference.CODE_DEFAULTS] if not exists(path)]
    assert not stale, f"settings_reference notes name keys the schema lacks: {stale}"


def test_check_flag_and_no_torch(tmp_path):
    """--check exits 1 on a stale file and names the command; the generator imports no torch."""
    stale = tmp_path / "README.md"
    stale.write_text("old\n", encoding="utf-8")
    code = ("import sys; from ftbench.experiment import settings_reference as s; "
            f"rc = s.main(['--check', {str(stale)!r}]); "
            "assert 'torch' not in sys.modules, 'the settings reference imported torch'; sys.exit(rc)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert REGENERATE in result.stderr


def test_the_module_map_names_every_module():
    """scripts/ftbench/README.md is the contributors' map: a module missing from it is a module nobody finds."""
    package = ROOT / "scripts" / "ftbench"
    text = (package / "README.md").read_text(encoding="utf-8")
    modules = {path.name for path in package.rglob("*.py") if path.name not in ("__init__.py",)}
    missing = sorted(name for name in modules if f"`{name}`" not in text and f"`{name[:-3]}" not in text)
    assert not missing, f"scripts/ftbench/README.md does not name {missing}"
