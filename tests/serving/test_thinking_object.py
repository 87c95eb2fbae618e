"""Chat completions' ``thinking`` object (Moonshot's API form: ``{"type":
"disabled"}``) switches K3's thinking, through a real ``vllm serve``: the prompt is
rendered with the response channel open, and the reply is read as content, streamed
and not. The same output under the default (thinking on) is a thought; the request's
own ``chat_template_kwargs`` win over the object."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.endpoints import MODEL, PROMPT, chat, chat_stream
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.shapes import output_ids

pytestmark = pytest.mark.server

REPLY = "Hi there."
DISABLED = {"thinking": {"type": "disabled"}}


def _ids() -> list[int]:
    """A plain reply and the stop token: content with thinking off, a thought only
    with it on (no closer: nothing to replay)."""
    return output_ids(REPLY, stop=True)


def _forced_body(ids: list[int], **fields) -> dict:
    """A raw request body forcing ``ids``, with ``fields`` added."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": len(ids) + 16,
        "temperature": 0,
        "vllm_xargs": {"k3_force_ids": ids},
        **fields,
    }


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "chat-stream"])
def test_a_disabled_thinking_object_makes_the_reply_content(k3_server, read):
    ids = _ids()
    budget = len(ids) + 16
    disabled = read(k3_server, ids, max_tokens=budget, extra=DISABLED)
    assert (disabled.reasoning, disabled.content) == ("", REPLY)
    enabled = read(
        k3_server, ids, max_tokens=budget, extra={"thinking": {"type": "enabled"}}
    )
    assert (enabled.reasoning, enabled.content) == (REPLY, "")
    default = read(k3_server, ids, max_tokens=budget)
    assert (default.reasoning, default.content) == (REPLY, "")
    overridden = read(
        k3_server,
        ids,
        max_tokens=budget,
        extra={**DISABLED, "chat_template_kwargs": {"thinking": True}},
    )
    assert (overridden.reasoning, overridden.content) == (REPLY, "")


@pytest.mark.parametrize(
    ("thinking", "opened"),
    [({"type": "disabled"}, vocab.RESPONSE), ({"type": "enabled"}, vocab.THINK)],
)
def test_the_prompt_opens_the_channel_the_object_asks_for(
    k3_server, hf_tokenizer, thinking, opened
):
    body = _forced_body(_ids(), return_token_ids=True, thinking=thinking)
    response = httpx.post(k3_server + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    prompt = hf_tokenizer.decode(response.json()["prompt_token_ids"])
    assert prompt.endswith(vocab.opener(opened)), prompt[-80:]


def _has_between_tools() -> bool:
    from vllm.entrypoints.anthropic import protocol

    return hasattr(protocol, "AnthropicThinkingConfigBetweenTools")


@pytest.mark.skipif(
    not _has_between_tools(),
    reason="this vLLM's Messages endpoint has no thinking type between_tools (0.34+)",
)
@pytest.mark.parametrize("stream", [False, True], ids=["messages", "messages-stream"])
def test_messages_between_tools_thinking_reads_the_reply_as_text(k3_server, stream):
    """vLLM 0.34 maps Anthropic's ``between_tools`` to disabled thinking: the prompt
    opens the response channel, and the plugin reads the reply as text."""
    body = _forced_body(_ids(), stream=stream, thinking={"type": "between_tools"})
    response = httpx.post(k3_server + "/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    if stream:
        events = [
            json.loads(line[len("data: ") :])
            for line in response.text.splitlines()
            if line.startswith("data: ")
        ]
        deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
        text = "".join(d.get("text", "") for d in deltas)
        thinking = "".join(d.get("thinking", "") for d in deltas)
    else:
        blocks = response.json()["content"]
        text = "".join(b.get("text", "") for b in blocks if b["type"] == "text")
        thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    assert (thinking, text) == ("", REPLY)
