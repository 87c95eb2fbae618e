"""Malformed outputs through all six endpoint readings of a real ``vllm serve``
(issue 26's bad-input corpus): each request answers 200 with a body its SDK reads,
every reading says the same (streamed equals whole, endpoint by endpoint), and the
words planted in each region of the output reach the client in some field:
reasoning, content, or a call's name or arguments (kept as text where they are not
JSON). Outputs are forced token by token, control atoms as their ids. The tiny
server reads 30 calls in one output; 10,000 are read by the reader itself
(``tests/format/test_tools.py``)."""

from __future__ import annotations

import random

import pytest

from tests.support.endpoints import ENDPOINTS
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.shapes import TOOLS, WEATHER_TOOL, output_ids

pytestmark = pytest.mark.server

CALL = '<|open|>call tool="get_weather" index="1"<|sep|>'
ARGUMENT = '<|open|>argument key="city" type="string"<|sep|>'
ANSWER = vocab.RESPONSE_END + vocab.MESSAGE_END

# name: (output, thinking, words that must reach the client)
CORPUS = {
    "unterminated call": (
        vocab.TOOLS_START + CALL + ARGUMENT + "Parisword",
        False,
        ("Parisword",),
    ),
    "invalid json block": (
        vocab.TOOLS_START + CALL + '<|open|>json type="object"<|sep|>{"city": "Lyonword'
        + vocab.JSON_END + vocab.CALL_END + vocab.TOOLS_END + vocab.MESSAGE_END,
        False,
        ("Lyonword",),
    ),
    "json block that is not JSON": (
        vocab.TOOLS_START + CALL + '<|open|>json type="object"<|sep|>city = Bernword'
        + vocab.JSON_END + vocab.CALL_END + vocab.TOOLS_END + vocab.MESSAGE_END,
        False,
        ("Bernword",),
    ),
    "garbage attributes": (
        "Beforeword" + '<|open|>call tool=get_weather" index==<|sep|>'
        + ARGUMENT + "Romeword" + vocab.ARGUMENT_END + vocab.CALL_END + ANSWER,
        False,
        ("Beforeword", "Romeword"),
    ),
    "markers inside values": (
        "Thinkword" + vocab.THINK_END + vocab.RESPONSE_START + "Replyword"
        + vocab.RESPONSE_END + vocab.TOOLS_START + CALL + ARGUMENT + "Osloword"
        + vocab.THINK_END + "Afterword" + vocab.ARGUMENT_END + vocab.CALL_END
        + vocab.TOOLS_END + vocab.MESSAGE_END,
        True,
        ("Thinkword", "Replyword", "Osloword", "Afterword"),
    ),
    "unknown elements and stray separators": (
        "Startword" + '<|open|>widget size="3"<|sep|>Widgetword<|close|>widget<|sep|>'
        + vocab.SEP + "Endword" + ANSWER,
        False,
        ("Startword", "Widgetword", "Endword"),
    ),
    "many calls": (
        vocab.TOOLS_START
        + "".join(
            CALL + ARGUMENT + f"c{n}w" + vocab.ARGUMENT_END + vocab.CALL_END
            for n in range(30)
        )
        + vocab.TOOLS_END + vocab.MESSAGE_END,
        False,
        ("c0w", "c29w"),
    ),
}  # fmt: skip


def _random_ids(seed: int, count: int) -> list[int]:
    """Byte-level BPE tokens (invalid UTF-8 among them) and control ids, mixed."""
    chooser = random.Random(seed)
    controls = [vocab.OPEN_ID, vocab.CLOSE_ID, vocab.SEP_ID]
    plain = output_ids("ab 思考 \U0001f30d é", stop=False)
    return [
        chooser.choice(controls)
        if chooser.random() < 0.2
        else chooser.choice(plain + list(range(128, 256)))
        for _ in range(count)
    ]


def _seen(reply) -> str:
    names = " ".join(name for name, _ in reply.tool_calls)
    return " ".join((reply.reasoning, reply.content, names, *reply.raw_arguments))


def _same_reading(reply) -> tuple:
    return (reply.reasoning, reply.content, reply.tool_calls)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_a_malformed_output_answers_every_reading(k3_server, name):
    output, thinking, words = CORPUS[name]
    ids = output_ids(output, stop=True)
    readings = {}
    for endpoint, read in sorted(ENDPOINTS.items()):
        reply = read(
            k3_server,
            ids,
            max_tokens=len(ids) + 8,
            thinking=thinking,
            tools=TOOLS,
        )
        seen = _seen(reply)
        for word in words:
            assert word in seen, (endpoint, word, reply)
        readings[endpoint] = reply
    for endpoint in ("chat", "responses", "messages"):
        whole, streamed = readings[endpoint], readings[endpoint + "-stream"]
        assert _same_reading(whole) == _same_reading(streamed), endpoint


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_tokens_answer_every_reading(k3_server, seed):
    ids = [*_random_ids(seed, 400), vocab.END_OF_MSG_ID]
    readings = {}
    for endpoint, read in sorted(ENDPOINTS.items()):
        readings[endpoint] = read(
            k3_server, ids, max_tokens=len(ids) + 8, tools=[WEATHER_TOOL]
        )
    for endpoint in ("chat", "responses", "messages"):
        whole, streamed = readings[endpoint], readings[endpoint + "-stream"]
        assert _same_reading(whole) == _same_reading(streamed), endpoint
