"""Every command in the README's and examples/README's shell blocks, run as written
(placeholders filled in) where this machine can run it, and otherwise listed here
with why not: a command added to the docs without an entry fails, so the docs
cannot drift from what works. Commands written inline in prose are not read.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.shapes import SHAPES, output_ids

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", ROOT / "examples" / "README.md")

# The commands that are not run here, each with why.
NOT_RUN = {
    "scripts/install.sh": "it built the environment this test runs in (CI runs it "
    "first, on a fresh machine)",
    "scripts/test.sh": "it is the command that runs this test",
    "pip install /path/to/vllm-k3-plugin": "it installs into a deployment's vLLM; "
    "the test environments install the checkout the same way (scripts/install.sh), "
    "and tests/test_wheel.py builds and checks the wheel",
    "vllm serve moonshotai/Kimi-K3 --reasoning-parser kimi_k3 "
    "--enable-auto-tool-choice --tool-call-parser kimi_k3": "it needs Kimi-K3's "
    "weights (no hub is reachable) and GPUs",
}
REPLAY_BUILTIN = ".venv/bin/vllm-k3 replay --against vllm --show 5"
SERVE_ON_CPU = (
    "VLLM_CPU_KVCACHE_SPACE=1 python -m vllm.entrypoints.openai.api_server --model "
    "DIR --reasoning-parser kimi_k3 --enable-auto-tool-choice --tool-call-parser "
    "kimi_k3"
)
CAPTURE = (
    "vllm-k3 capture --base-url http://HOST:8000 --requests requests.jsonl "
    "--out raw.jsonl"
)
REPLAY_FILE = "vllm-k3 replay raw.jsonl --against vllm --show 10 --report replay.json"
TINY = "python -m vllm_k3_plugin.tools.tiny DIR"
RUN = (REPLAY_BUILTIN, TINY, SERVE_ON_CPU, CAPTURE, REPLAY_FILE)
# Run as written elsewhere: the CPU serve command starts the plain server of
# ``tests/model/test_plain_serve.py`` (one server start where two were alike).


def doc_commands() -> list[str]:
    """Each command of each ``bash`` block: continuation lines joined, comments
    dropped, ``&&`` chains split."""
    commands = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].split(" # ")[0].strip()
                if line and not line.startswith("#"):
                    commands += [" ".join(part.split()) for part in line.split("&&")]
    return commands


def test_every_doc_command_is_run_or_says_why_not():
    unaccounted = [c for c in doc_commands() if c not in NOT_RUN and c not in RUN]
    assert not unaccounted, unaccounted
    assert set(RUN) <= set(doc_commands()), "a command run here left the docs"


def _vllm_k3(command: str, **replace: str) -> subprocess.CompletedProcess:
    """``command`` (a ``vllm-k3`` command line) with this environment's
    ``vllm-k3`` script, the one the package installs."""
    words = shlex.split(command)
    words = [replace.get(word, word) for word in words[1:]]
    script = Path(sys.executable).parent / "vllm-k3"
    assert script.is_file(), f"{script}: the package's console script is missing"
    return subprocess.run(
        [str(script), *words],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_readmes_first_command_shows_replies_vllm_loses():
    run = _vllm_k3(REPLAY_BUILTIN.removeprefix(".venv/bin/"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert ": reply lost" in run.stdout


def test_the_tiny_checkpoint_command_writes_a_checkpoint(tmp_path):
    words = shlex.split(TINY)
    assert words[:3] == ["python", "-m", "vllm_k3_plugin.tools.tiny"]
    run = subprocess.run(
        [sys.executable, *words[1:-1], str(tmp_path / "DIR")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    config = json.loads((tmp_path / "DIR" / "config.json").read_text())
    assert config["architectures"] == ["KimiK3ForConditionalGeneration"]


@pytest.mark.server
def test_capture_and_replay_as_written(k3_server, tmp_path, monkeypatch):
    """``capture`` against the test server (``http://HOST:8000`` is its URL) of a
    request whose reply the model writes inside its think channel, then ``replay``
    of what it captured: the reply vLLM's parsers lose is shown."""
    monkeypatch.chdir(tmp_path)
    ids = output_ids(SHAPES["skipped-channel"].output, stop=True)
    request = {
        "id": "skipped",
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": len(ids) + 8,
        "vllm_xargs": {"k3_force_ids": ids},
    }
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    # Run in ``tmp_path``: the docs' file names as written.
    captured = _vllm_k3(CAPTURE, **{"http://HOST:8000": k3_server})
    assert captured.returncode == 0, captured.stderr[-2000:]
    raw = [json.loads(line) for line in (tmp_path / "raw.jsonl").open()]
    assert vocab.THINK_END not in raw[0]["text"]  # the skipped channel's shape
    replayed = _vllm_k3(REPLAY_FILE)
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    assert "skipped: reply lost" in replayed.stdout
    report = json.loads((tmp_path / "replay.json").read_text())
    assert report["outputs"] == 1
