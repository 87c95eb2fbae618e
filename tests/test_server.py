"""Reasoning and content through a real ``vllm serve``, on every endpoint.

The model is forced to write each shape token by token; each shape ends once by the
stop token (``stop``) and once by a ``max_tokens`` cut (``cut``). All six ways of
reading a reply must return the pinned reasoning and content.
"""

from __future__ import annotations

import pytest

from tests.endpoints import ENDPOINTS, chat, chat_stream
from vllm_k3_plugin import vocab
from vllm_k3_plugin.vocab import (
    CLOSE,
    MESSAGE_END,
    RESPONSE_END,
    RESPONSE_START,
    THINK_END,
    THINK_START,
    TOOLS_END,
    TOOLS_START,
)

pytestmark = pytest.mark.server

SKIPPED = "The answer is 4."
CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

# name: (output, thinking, (reasoning, content) if stopped, (reasoning, content) if cut)
FINAL = RESPONSE_START + "Final." + RESPONSE_END + MESSAGE_END

SHAPES = {
    "think-then-reply": (
        "Let me think."
        + THINK_END
        + RESPONSE_START
        + "Hello!"
        + RESPONSE_END
        + MESSAGE_END,
        True,
        ("Let me think.", "Hello!"),
        ("Let me think.", "Hello!"),
    ),
    "skipped-channel": (
        SKIPPED + RESPONSE_END + MESSAGE_END,
        True,
        (SKIPPED, SKIPPED),
        (SKIPPED, ""),
    ),
    "closer-at-end": (
        "Reply." + RESPONSE_END,
        True,
        ("Reply.", "Reply."),
        ("Reply.", ""),
    ),
    "closer-whitespace": (
        "Reply." + RESPONSE_END + "\n" + MESSAGE_END,
        True,
        ("Reply.\n", "Reply.\n"),
        ("Reply.\n", ""),
    ),
    "quoted-closer": (
        "He wrote "
        + RESPONSE_END
        + " then more."
        + THINK_END
        + RESPONSE_START
        + "Done."
        + RESPONSE_END
        + MESSAGE_END,
        True,
        ("He wrote " + RESPONSE_END + " then more.", "Done."),
        ("He wrote " + RESPONSE_END + " then more.", "Done."),
    ),
    "closer-then-think-exit": (
        "Draft." + RESPONSE_END + THINK_END + FINAL,
        True,
        ("Draft.", "Final."),
        ("Draft.", "Final."),
    ),
    "closer-then-response-open": (
        "Draft." + RESPONSE_END + FINAL,
        True,
        ("Draft.", "Final."),
        ("Draft.", "Final."),
    ),
    "no-closer": ("Just thinking", True, ("Just thinking", ""), ("Just thinking", "")),
    "closer-cut-mid-marker": (
        "Reply." + CLOSE + "response",
        True,
        ("Reply." + CLOSE + "response", ""),
        ("Reply." + CLOSE + "response", ""),
    ),
    "thinking-off": (
        "Hi there." + RESPONSE_END + MESSAGE_END,
        False,
        ("", "Hi there."),
        ("", "Hi there."),
    ),
    "thinking-off-self-opened-think": (
        THINK_START
        + "hmm"
        + THINK_END
        + RESPONSE_START
        + "Ok."
        + RESPONSE_END
        + MESSAGE_END,
        False,
        ("hmm", "Ok."),
        ("hmm", "Ok."),
    ),
    "thinking-off-declined-think": (
        THINK_END + RESPONSE_START + "Ok." + RESPONSE_END + MESSAGE_END,
        False,
        ("", "Ok."),
        ("", "Ok."),
    ),
}


def _request(hf_tokenizer, output: str, ending: str) -> tuple[list[int], int]:
    ids = hf_tokenizer.encode(output, add_special_tokens=False)
    if ending == "stop":
        return [*ids, vocab.END_OF_MSG_ID], len(ids) + 16
    return ids, len(ids)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("ending", ["stop", "cut"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_on_every_endpoint(k3_server, hf_tokenizer, shape, ending, endpoint):
    output, thinking, if_stopped, if_cut = SHAPES[shape]
    ids, max_tokens = _request(hf_tokenizer, output, ending)
    reply = ENDPOINTS[endpoint](
        k3_server, ids, max_tokens=max_tokens, thinking=thinking
    )
    expected = if_stopped if ending == "stop" else if_cut
    assert (reply.reasoning, reply.content) == expected


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_empty_output(k3_server, endpoint):
    reply = ENDPOINTS[endpoint](k3_server, [vocab.END_OF_MSG_ID], max_tokens=4)
    assert (reply.reasoning, reply.content) == ("", "")


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "chat-stream"])
def test_stop_string_counts_as_a_stop(k3_server, hf_tokenizer, read):
    """A stop string leaves no stop id; the reply is still replayed."""
    output = SKIPPED + RESPONSE_END + "STOPHERE and more"
    ids = hf_tokenizer.encode(output, add_special_tokens=False)
    reply = read(k3_server, ids, max_tokens=len(ids) + 8, stop=["STOPHERE"])
    assert (reply.reasoning, reply.content) == (SKIPPED, SKIPPED)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("thinking", [True, False], ids=["in-think", "thinking-off"])
def test_tools_channel(k3_server, hf_tokenizer, endpoint, thinking):
    """Tools in the think channel with no exit, and at offset 0 with thinking off."""
    before = "Need the weather." if thinking else ""
    output = before + TOOLS_START + CALL + TOOLS_END + MESSAGE_END
    ids, max_tokens = _request(hf_tokenizer, output, "stop")
    reply = ENDPOINTS[endpoint](
        k3_server, ids, max_tokens=max_tokens, thinking=thinking, tools=[WEATHER_TOOL]
    )
    assert (reply.reasoning, reply.content) == (before, "")
    assert reply.tool_calls == (("get_weather", {"city": "Paris"}),)
