"""Install faults: the plugin left out by ``VLLM_PLUGINS``, an unsupported vLLM;
and what registration logs at start."""

from __future__ import annotations

import logging
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
from vllm_k3_plugin.envs import (
    ALLOW_UNSUPPORTED_VLLM_ENV,
    MODEL_CLASS_ENV,
    MODEL_CLASS_SETTINGS,
)

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


IGNORED = "act only on the plugin's Kimi-K3 model class"


def test_the_registration_lines_wait_for_vllms_logging():
    """The API server loads plugins while it parses its arguments, before vLLM
    configures logging: the registration line, and the warning that the model
    class's settings set here change nothing, are said once vLLM's
    ``configure_logging_from_args`` runs, as the API server calls it, in vLLM's
    format, and once only (registering again before or after that says nothing
    more)."""
    probe = (
        "import argparse, vllm.logger as vllm_logger; "
        "from vllm.plugins import load_general_plugins; "
        "from vllm_k3_plugin.registration import register_all; "
        "load_general_plugins(); register_all(); print('LOADED', flush=True); "
        "vllm_logger.configure_logging_from_args(argparse.Namespace()); "
        "register_all()"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env.update({MODEL_CLASS_ENV: "vllm", "VLLM_K3_MLA": "triton"})
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    said = run.stdout + run.stderr
    registered = "kimi_k3 reasoning and tool parsers registered"
    assert said.count(registered) == 1, said[-2000:]
    assert said.count(IGNORED) == 1, said[-2000:]
    assert said.index("LOADED") < said.index(registered) < said.index(IGNORED)
    (warning,) = [line for line in said.splitlines() if IGNORED in line]
    assert " WARNING " in warning and "[registration.py:" in warning, warning
    assert "VLLM_K3_MLA=triton: these settings" in warning


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def start_log(monkeypatch):
    """What registration logs, at once (vLLM's logging configured) and as in a
    fresh process (nothing said yet), with none of the model class's settings
    set."""
    import vllm.logger as vllm_logger

    from vllm_k3_plugin import registration

    monkeypatch.setattr(vllm_logger, "_last_configured_logging_config", object())
    monkeypatch.setattr(registration, "_SAID", set())
    for env in (MODEL_CLASS_ENV, *MODEL_CLASS_SETTINGS):
        monkeypatch.delenv(env, raising=False)
    logger = logging.getLogger("vllm.k3_plugin")
    records = _Records()
    logger.addHandler(records)
    yield records
    logger.removeHandler(records)


def _warnings(log: _Records) -> list[str]:
    return [
        record.getMessage()
        for record in log.records
        if record.levelno >= logging.WARNING
    ]


def _off_the_cpu(monkeypatch) -> None:
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)


def test_the_model_class_settings_set_where_the_class_is_off_are_named_once(
    start_log, monkeypatch
):
    from vllm_k3_plugin.registration import register_all

    _off_the_cpu(monkeypatch)
    monkeypatch.setenv("VLLM_K3_MOE", "triton")
    monkeypatch.setenv("VLLM_K3_KERNELS", "pytorch")
    register_all()
    register_all()
    assert _warnings(start_log) == [
        "VLLM_K3_KERNELS=pytorch, VLLM_K3_MOE=triton: these settings act only on "
        "the plugin's Kimi-K3 model class, which is off here "
        "(VLLM_K3_MODEL_CLASS=vllm, its default off the CPU): vLLM's in-tree class "
        "serves and ignores them. Unset them, or set VLLM_K3_MODEL_CLASS=plugin to "
        "serve with the plugin's class (not yet run on a GPU)."
    ]


def test_vllm_knows_every_setting(monkeypatch):
    """Registered, the settings are vLLM's known variables: no 'unknown vLLM
    environment variable' warning, and --fail-on-environ-validation starts."""
    from vllm import envs as vllm_envs
    from vllm.platforms.interface import Platform

    from vllm_k3_plugin.envs import SETTINGS
    from vllm_k3_plugin.registration import register_all

    register_all()
    for name in SETTINGS:
        monkeypatch.setenv(name, "1")
        assert name in vllm_envs.environment_variables
    Platform.validate_environ(hard_fail=True)
    monkeypatch.setenv("VLLM_K3_NO_SUCH_SETTING", "1")
    with pytest.raises(ValueError, match="VLLM_K3_NO_SUCH_SETTING"):
        Platform.validate_environ(hard_fail=True)


def test_the_class_turned_off_by_its_setting_is_named_so(start_log, monkeypatch):
    from vllm_k3_plugin.registration import register_all

    monkeypatch.setenv(MODEL_CLASS_ENV, "vllm")
    monkeypatch.setenv("VLLM_K3_KDA", "torch")
    register_all()
    (warning,) = _warnings(start_log)
    assert warning.startswith("VLLM_K3_KDA=torch: these settings")
    assert "is off here (VLLM_K3_MODEL_CLASS=vllm):" in warning


@pytest.mark.parametrize("case", ["class on", "none set"])
def test_no_warning_where_the_class_serves_or_nothing_is_set(
    start_log, monkeypatch, case
):
    from vllm_k3_plugin.registration import register_all

    if case == "class on":  # the CPU's default
        for env in MODEL_CLASS_SETTINGS:
            monkeypatch.setenv(env, "triton")
    else:
        _off_the_cpu(monkeypatch)
    register_all()
    assert _warnings(start_log) == []
