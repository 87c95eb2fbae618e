"""Install faults: the plugin left out by ``VLLM_PLUGINS``, an unsupported vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from vllm_k3_plugin.compat import (
    SUPPORTED_VLLM,
    UnsupportedVLLMError,
    check_vllm_version,
    release,
    unsupported_reason,
)
from vllm_k3_plugin.envs import ALLOW_UNSUPPORTED_VLLM_ENV

# Loads general plugins as every vLLM process does, then reports what ``kimi_k3``
# resolves to and whether any module of ours was imported.
PROBE = textwrap.dedent(
    """
    import sys
    import vllm
    {patch}
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.parser.parser_manager import ParserManager
    reasoning = ReasoningParserManager.get_reasoning_parser("kimi_k3")
    tool = ToolParserManager.get_tool_parser("kimi_k3")
    composed = ParserManager.get_parser(
        tool_parser_name="kimi_k3", reasoning_parser_name="kimi_k3",
        enable_auto_tools=True,
    )
    ours = sorted(m for m in sys.modules if m.startswith("vllm_k3_plugin"))
    print(reasoning.__module__, tool.__module__, composed.__mro__[1].__module__, ours)
    """
)


def _probe(
    env_changes: dict[str, str | None], patch: str = ""
) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(patch=patch)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_loaded_by_default():
    run = _probe({"VLLM_PLUGINS": None})
    assert run.returncode == 0, run.stderr[-2000:]
    reasoning, tool, composed, _ = run.stdout.split(maxsplit=3)
    assert reasoning == "vllm_k3_plugin.parsers.reasoning_parser"
    assert tool == "vllm_k3_plugin.parsers.tool_parser"
    assert composed == "vllm_k3_plugin.parsers.parser"


def test_left_out_with_empty_vllm_plugins():
    run = _probe({"VLLM_PLUGINS": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    reasoning, tool, composed, ours = run.stdout.split(maxsplit=3)
    assert reasoning == "vllm.reasoning.kimi_k3_reasoning_parser"
    assert tool == "vllm.tool_parsers.kimi_k3_tool_parser"
    assert composed.startswith("vllm.")
    assert ours.strip() == "[]"  # nothing of ours was imported


def test_unsupported_vllm_refuses_to_load_naming_the_range():
    run = _probe({"VLLM_PLUGINS": None}, patch="vllm.__version__ = '0.31.2'")
    assert run.returncode != 0
    assert "UnsupportedVLLMError" in run.stderr
    assert f"supports vLLM {SUPPORTED_VLLM}" in run.stderr
    assert "this is vLLM '0.31.2'." in run.stderr


def test_newer_vllm_refusal_names_the_newest_tested_and_the_override():
    run = _probe({"VLLM_PLUGINS": None}, patch="vllm.__version__ = '0.35.0'")
    assert run.returncode != 0
    assert "UnsupportedVLLMError" in run.stderr
    assert "the newest tested 0.34" in run.stderr
    assert "this is vLLM '0.35.0', newer than any tested" in run.stderr
    assert f"{ALLOW_UNSUPPORTED_VLLM_ENV}=1 loads it anyway" in run.stderr


def test_unsupported_vllm_loads_when_allowed():
    run = _probe(
        {"VLLM_PLUGINS": None, ALLOW_UNSUPPORTED_VLLM_ENV: "1"},
        patch="vllm.__version__ = '0.35.0'",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("vllm_k3_plugin.")
    said = run.stdout + run.stderr
    assert "vLLM '0.35.0' is untested with this plugin" in said  # the warning


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.33.1rc2+rocm644", True),
        ("0.33.0.dev12+g1234", True),
        ("0.31.9", False),
        ("0.34.0", True),
        ("0.34.1+cu130", True),
        ("0.35.0", False),
        ("1.0.0", False),
        ("unknown", False),
        ("", False),
    ],
)
def test_version_range(version, supported):
    assert (unsupported_reason(version) is None) == supported


def test_check_raises_or_warns(monkeypatch):
    monkeypatch.delenv(ALLOW_UNSUPPORTED_VLLM_ENV, raising=False)
    with pytest.raises(UnsupportedVLLMError, match="supports vLLM"):
        check_vllm_version("0.20.0", warn=print)
    warned = []
    monkeypatch.setenv(ALLOW_UNSUPPORTED_VLLM_ENV, "1")
    check_vllm_version("0.20.0", warn=warned.append)
    assert len(warned) == 1 and "vLLM '0.20.0' is untested" in warned[0]
    assert release("0.33.2") == (0, 33)


def test_the_registration_line_waits_for_vllms_logging():
    """The API server loads plugins while it parses its arguments, before vLLM
    configures logging: the line is said once vLLM's ``configure_logging_from_args``
    runs, as the API server calls it, and once only (a second registration before
    that queues nothing more)."""
    probe = (
        "import argparse, vllm.logger as vllm_logger; "
        "from vllm.plugins import load_general_plugins; "
        "from vllm_k3_plugin.registration import register_all; "
        "load_general_plugins(); register_all(); print('LOADED', flush=True); "
        "vllm_logger.configure_logging_from_args(argparse.Namespace())"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    said = run.stdout + run.stderr
    registered = "kimi_k3 reasoning and tool parsers registered"
    assert said.count(registered) == 1, said[-2000:]
    assert said.index("LOADED") < said.index(registered)
