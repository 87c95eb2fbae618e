"""Chat completions' ``thinking`` object read in-process: which values switch the
template, which are left alone, and that the request's own template kwargs win."""

from __future__ import annotations

import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_k3_plugin.parsers import request_hooks


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
