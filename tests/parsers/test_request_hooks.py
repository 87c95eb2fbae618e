"""Chat completions' ``thinking`` object read in-process: which values switch the
template, which are left alone, and that the request's own template kwargs win."""

from __future__ import annotations

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_k3_plugin.parsers import request_hooks
from vllm_k3_plugin.parsers.request_state import thinking_requested


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="k3", messages=[{"role": "user", "content": "hi"}], **fields
    )


@pytest.mark.parametrize(
    ("thinking", "switch"),
    [
        ({"type": "disabled"}, False),
        ({"type": "enabled"}, True),
        ({"type": "adaptive"}, True),
        ({"type": "enabled", "budget_tokens": 2048}, True),
        ({"type": "off"}, None),
        ({"type": 0}, None),
        ({}, None),
        ("disabled", None),
        (False, None),
    ],
)
def test_the_thinking_object_sets_the_template_switch(thinking, switch):
    request_hooks.install()
    request_hooks.install()  # idempotent: wrapped once
    params = _request(thinking=thinking).build_chat_params(None, "auto")
    assert params.chat_template_kwargs.get("thinking") == switch


@pytest.mark.parametrize("own", [{"thinking": True}, {"enable_thinking": True}])
def test_the_requests_template_kwargs_win(own):
    request_hooks.install()
    params = _request(
        thinking={"type": "disabled"}, chat_template_kwargs=own
    ).build_chat_params(None, "auto")
    assert params.chat_template_kwargs.get("thinking", True) is True
    assert params.chat_template_kwargs.get("enable_thinking", True) is True


@pytest.mark.parametrize(
    ("thinking", "effort", "on"),
    [("disabled", "high", False), ("enabled", "none", True)],
)
def test_the_thinking_object_wins_over_reasoning_effort(thinking, effort, on):
    """vLLM turns ``reasoning_effort`` into ``enable_thinking`` beside the object's
    ``thinking``; the K3 template, vLLM's K3 renderer and our reading all take
    ``thinking`` first."""
    request_hooks.install()
    params = _request(
        thinking={"type": thinking}, reasoning_effort=effort
    ).build_chat_params(None, "auto")
    assert params.chat_template_kwargs["thinking"] is on
    assert params.chat_template_kwargs["enable_thinking"] is not on
    assert thinking_requested(params.chat_template_kwargs) is on
