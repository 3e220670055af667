"""User documents speak to users: what to run and what it tells them, never the project's history.

A user cannot see the tracker or the commits, and a development log (trial tables, "before this work", "I have
not attributed") buries the commands they need. This checks every user document for issue numbers, commit
hashes and history told in the first person, and keeps the README short enough to read.

User documents: README.md, scripts/README.md, config/README.md (generated: a hit there is fixed in
scripts/ftbench/runspec.py's docs or the schema's descriptions), and the comments of config/config.yaml and
config/examples/*.yaml. Contributors' notes (scripts/ftbench/README.md, code comments) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT

README_MAX_LINES = 250

# An issue or pull-request number: "issue 30", "issues 12 and 30" (the first), "PR 7", "#30".
# "#" must not follow a word character, "&" (an HTML entity) or "/" (a URL anchor), and is digits only,
# so hex colours (#1f77b4, #bbbbbb) and Markdown headings are not numbers.
ISSUE = re.compile(r"\b(?:issues?|PR|pull request|ticket)\s*#?\d+\b|(?<![\w&/])#\d+\b", re.IGNORECASE)

# A commit hash: 7 to 40 lowercase hex characters standing alone, with at least one digit and one letter
# (so plain numbers and words such as "decade" are not hashes). Hex glued to an identifier is left alone:
# a run id's settings hash (lora-r8-fp32-6499c673), a path or a sha256:..., a colour (#1f77b4); a sha256
# digest is 64 characters, longer than any commit hash.
HASH = re.compile(r"(?<![\w#:/.\-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w\-/])")

# History told as history: first person, "before this work", "(was: ...)", dated changes, the old tree.
HISTORY = re.compile(
    r"\bbefore (?:this|that) (?:work|change|session|fix|commit)\b"
    r"|\bthis (?:session|tree)\b"
    r"|\bthe (?:old|previous) (?:script|tree|code|loop|version|behaviou?r)\b"
    r"|\bthe tree before\b"
    r"|\bbefore/after\b"
    r"|\bwas:"
    r"|\bI(?:'ve|'d| have| had| did| ran| measured| found| changed| added| fixed| removed| tried| think| could not)\b"
    r"|\bwe (?:have |had |)(?:changed|added|fixed|removed|made|moved|rewrote|replaced|measured|found|tried)\b"
    r"|\b(?:until|since|before|after) (?:January|February|March|April|May|June|July|August|September|October"
    r"|November|December) \d{4}\b")


def marks(text: str) -> list[str]:
    """What in ``text`` tells history: each issue number, commit hash or history phrase found."""
    found = []
    for name, pattern in (("issue number", ISSUE), ("commit hash", HASH), ("history", HISTORY)):
        found += [f"{name} {match.group(0)!r}" for match in pattern.finditer(text)]
    return found


def yaml_comments(text: str) -> list[str]:
    """The comment of each line of a YAML file ('' where it has none): what follows a '#' that starts the line
    or follows a blank. Setting values are not prose and are left out."""
    comments = []
    for line in text.splitlines():
        match = re.search(r"(?:^|\s)#(.*)$", line)
        comments.append(match.group(1) if match else "")
    return comments


def user_documents() -> dict[str, list[str]]:
    """Each user document by its path, as the lines that are read as prose."""
    docs = {}
    for relative in ("README.md", "scripts/README.md", "config/README.md"):
        path = ROOT / relative
        docs[relative] = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    for path in [ROOT / "config" / "config.yaml", *sorted((ROOT / "config" / "examples").glob("*.yaml"))]:
        docs[str(path.relative_to(ROOT))] = yaml_comments(path.read_text(encoding="utf-8"))
    return docs


def history_in(docs: dict[str, list[str]]) -> list[str]:
    return [f"{path}:{number}: {mark}" for path, lines in docs.items()
            for number, line in enumerate(lines, start=1) for mark in marks(line)]


def test_user_documents_tell_no_history():
    found = history_in(user_documents())
    assert not found, ("user documents name issues, commits or tell the history (say what to run and what it tells, "
                       "in the present):\n" + "\n".join(found))


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move details to " \
                                      "config/README.md, scripts/README.md or scripts/ftbench/README.md"


def test_every_user_document_exists():
    """The check covers files that exist: a renamed document would otherwise go unchecked."""
    docs = user_documents()
    assert len([path for path in docs if path.startswith("config/examples/")]) >= 10
    assert all(lines for lines in docs.values()), [path for path, lines in docs.items() if not lines]


@pytest.mark.parametrize("text", [
    "the 0.87-0.90 shape of issue 30",
    "see #30 for the trials",
    "fixed in PR 12",
    "The tree before this work (`8624fb2`, with its own script)",
    "commit 3124a01e9f",
    "which I have not attributed",
    "I measured 1.2x on an H100",
    "we changed the default",
    "settles its imports at once (was: after the first job forked)",
    "its loop until November 2026",
    "this session's trials",
    "the old script's ratios",
])
def test_history_is_found(text):
    assert marks(text), f"not flagged: {text!r}"


@pytest.mark.parametrize("text", [
    "minilm-rotten_tomatoes-lora-r8-fp32-b32-s64-6499c673",   # a run id's settings hash
    "colour #1f77b4 and #bbbbbb",                             # hex colours
    "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "results/runs/6499c673/metrics.json",
    "30 layers, width 576, 1234567 rows, fp32 and bf16, recall@1, 2 x 1024",
    "hub revision: branch, tag or commit (kind hub)",
    "## Reading the results",
    "  # a YAML comment",
    "the accuracy before and after training; what was measured is what a run delivers",
    "Issues with a GPU: see Troubleshooting",
])
def test_plain_documentation_is_not_flagged(text):
    assert not marks(text), marks(text)


def test_yaml_comments_leave_values_out():
    text = "key: abc1234def   # a comment with #12\nplain: value\n# header line\n"
    assert yaml_comments(text) == [" a comment with #12", "", " header line"]
    assert history_in({"x.yaml": yaml_comments(text)}) == ["x.yaml:1: issue number '#12'"]


def test_readme_keeps_the_test_command_ci_runs():
    """.ci/run runs "the README's test command": a shorter README must not lose it, nor the two commands CI uses."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "```bash\npython -m pytest\n```" in readme
    assert "\npython -m pytest\n" in ci
    for needed in ('-m "not slow"', "bash .ci/install-system.sh"):
        assert needed in readme, f"README.md no longer says {needed}"
