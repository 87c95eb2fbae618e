"""What the operator documentation names exists: every path and file name in
README.md, CHANGELOG.md, docs/, examples/ and benchmarks/results/ is in this
repository, every ``VLLM_K3_*`` setting they name is one ``envs.py`` defines (and the
README's settings table lists each one), and no text written for the project's
authors rather than its operators is left in them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_k3_plugin import envs

ROOT = Path(__file__).parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "examples").glob("*.md"),
        *(ROOT / "benchmarks" / "results").glob("*.md"),
    ]
)
# Paths there are vLLM's sources, relative to its package (the page says so).
VLLM_SOURCE_PAGES = {"vllm_in_tree_k3.md"}
_EXTERNAL_LINK = re.compile(r"\[[^\]]*\]\((?:https?|mailto):[^)]*\)")
_TOKEN = re.compile(r"`([^`\n]+)`|\]\(([^)\s]+)\)")
_PATH = re.compile(
    r"^[\w.\-/]+\.(?:py|md|sh|json|jsonl|txt|toml|png|model|yaml|yml|cfg)$"
    r"|^[\w.\-]+/[\w.\-/]*$"
)
# Not paths of this repository: vLLM's package, media types, a model's hub id.
_NOT_OURS = ("vllm/", "application/", "text/", "moonshotai/")
_SKIPPED_DIRS = {".git", "__pycache__", "node_modules"}


def _repository_paths() -> set[str]:
    paths = set()
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT)
        if any(
            part in _SKIPPED_DIRS or part.startswith(".") or part.endswith("egg-info")
            for part in relative.parts
        ):
            continue
        paths.add(relative.as_posix() + ("/" if path.is_dir() else ""))
    return paths


def _named_paths(doc: Path):
    text = _EXTERNAL_LINK.sub("", doc.read_text())
    for match in _TOKEN.finditer(text):
        token = (match.group(1) or match.group(2)).split("#")[0].split("::")[0]
        if (
            token
            and not token.startswith(("http", "/", "-", "$", "~"))
            and " " not in token
            and _PATH.match(token)
            and not token.startswith(_NOT_OURS)
        ):
            yield text[: match.start()].count("\n") + 1, token


def test_every_path_the_docs_name_exists():
    """Relative to the page, to the repository root, or the tail of a repository
    path (``model/mtp.py`` beside a sentence about ``vllm_k3_plugin/``)."""
    paths = _repository_paths()
    missing = []
    for doc in DOCS:
        if doc.name in VLLM_SOURCE_PAGES:
            continue
        for line, token in _named_paths(doc):
            if (doc.parent / token).exists() or (ROOT / token).exists():
                continue
            if any(path == token or path.endswith("/" + token) for path in paths):
                continue
            missing.append(f"{doc.relative_to(ROOT)}:{line}: {token}")
    assert missing == []


def test_the_check_finds_a_missing_path(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See `docs/no_such_page.md`, [the spec](https://example.com/a/b.md) and "
        "`vllm/entrypoints/openai/api_server.py`.\n"
    )
    assert list(_named_paths(page)) == [(1, "docs/no_such_page.md")]


def test_every_setting_the_docs_name_is_defined_and_the_readme_lists_each():
    defined = set(envs.SETTINGS)
    # ``SETTINGS`` lists every setting ``envs.py`` defines a name for.
    assert defined == {
        value
        for name, value in vars(envs).items()
        if name.endswith("_ENV") and isinstance(value, str)
    }
    assert all(name.startswith("VLLM_K3_") for name in defined)
    named = {
        (doc.relative_to(ROOT).as_posix(), setting)
        for doc in DOCS
        for setting in re.findall(r"\bVLLM_K3_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text())
    }
    assert sorted(pair for pair in named if pair[1] not in defined) == []
    table = re.findall(r"^\| `(VLLM_K3_[A-Z_]+)` \|", _readme(), re.MULTILINE)
    assert sorted(table) == sorted(defined)


# Phrases of the project's own work, meaningless to an operator.
INTERNAL = (
    "this machine",
    "registry here",
    "its minutes",
    "GPU machine",
    "device check",
    "device tool",
    "the issue",
    "search index",
    "I confirmed",
    "are done",
    "/work/",
    "this AMX host",
    "measured copy here",
    "required folder",
    "this session",
)


@pytest.mark.parametrize("phrase", INTERNAL)
def test_no_text_for_the_authors(phrase):
    """Found across line breaks too (the text's whitespace collapsed)."""
    places = [
        *DOCS,
        *(ROOT / "scripts").glob("*"),
        *(ROOT / "benchmarks" / "results").glob("*.txt"),
    ]
    wanted = " ".join(phrase.lower().split())
    found = [
        str(path.relative_to(ROOT))
        for path in places
        if wanted in " ".join(path.read_text().lower().split())
    ]
    assert found == []


_DOTTED = re.compile(r"^(vllm_k3_plugin|k3_triton_kernels)(\.\w+)+(:\w+)?$")


def test_every_module_and_name_the_docs_name_exists():
    """``vllm_k3_plugin.wire.MoonshotWireSpec``, ``...model.model:KimiK3ForCausalLM``:
    the longest importable module, then attributes."""
    import importlib

    pytest.importorskip("vllm")
    missing = []
    for doc in DOCS:
        text = _EXTERNAL_LINK.sub("", doc.read_text())
        for token in sorted(set(re.findall(r"`([^`\n]+)`", text))):
            if not _DOTTED.match(token):
                continue
            parts = token.replace(":", ".").split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    found = importlib.import_module(".".join(parts[:cut]))
                    break
                except ImportError:
                    continue
            for attribute in parts[cut:]:
                found = getattr(found, attribute, None)
            if found is None:
                missing.append(f"{doc.relative_to(ROOT)}: {token}")
    assert missing == []


def test_the_readme_says_what_each_ending_of_the_outputs_counter_means():
    from vllm_k3_plugin.parsers.metrics import ENDINGS

    row = next(
        line for line in _readme().splitlines() if "`vllm_k3_outputs_total`" in line
    )
    assert [ending for ending in ENDINGS if f"`{ending}`" not in row] == []


def _readme() -> str:
    return (ROOT / "README.md").read_text()
