"""Tool-call ids through vLLM's scale-out API server: render, generate, derender.

A second turn's calls continue the first turn's count on every path. The scale-out
generate server parses a request that carries no messages (``ParseContext``) and
says the count through ``Parser.set_history_tool_call_count``; its streaming
derender replays the original chat request, messages included. Both must give the
ids the coupled ``/v1/chat/completions`` gives, streamed and not.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.endpoints import MODEL, chat, chat_stream
from tests.support.expected_tools import history_with_calls
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.shapes import SHAPES, TOOLS

pytestmark = pytest.mark.server

EARLIER_CALLS = 2
HISTORY = history_with_calls(EARLIER_CALLS)
WANTED_IDS = (
    "functions.get_weather:2",
    "functions.write_file:3",
    "functions.get_weather:4",
)


@pytest.fixture(scope="module")
def scale_out_parses_with_the_history_count():
    from vllm.parser.abstract_parser import Parser

    if not hasattr(Parser, "set_history_tool_call_count"):
        pytest.skip(
            "this vLLM's scale-out server does not pass the history count "
            "(Parser.set_history_tool_call_count is new in 0.33)"
        )


@pytest.fixture(scope="module")
def second_turn(hf_tokenizer):
    output = SHAPES["reply-then-calls"].output
    ids = [*hf_tokenizer.encode(output, add_special_tokens=False), vocab.END_OF_MSG_ID]
    body = {
        "model": MODEL,
        "messages": HISTORY,
        "tools": TOOLS,
        "max_tokens": len(ids) + 16,
        "vllm_xargs": {"k3_force_ids": ids},
    }
    return ids, body


def _rendered(url: str, body: dict) -> dict:
    response = httpx.post(url + "/v1/chat/completions/render", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def test_generate_with_derender_continues_the_count(
    k3_server, second_turn, scale_out_parses_with_the_history_count
):
    _, body = second_turn
    generate = _rendered(k3_server, body)
    assert generate["parse_context"]["history_tool_call_cnt"] == EARLIER_CALLS
    generate["output_mode"] = "derender"
    response = httpx.post(
        k3_server + "/inference/v1/generate", json=generate, timeout=60
    )
    response.raise_for_status()
    (choice,) = response.json()["choices"]
    calls = choice["message"]["tool_calls"]
    assert tuple(call["id"] for call in calls) == WANTED_IDS
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_derender_continues_the_count(k3_server, second_turn):
    _, body = second_turn
    generate = _rendered(k3_server, body)
    generate.update(stream=True, output_mode="tokens")
    ids_by_index: dict[int, str] = {}
    state = None
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST", k3_server + "/inference/v1/generate", json=generate
        ) as sse,
    ):
        sse.raise_for_status()
        for line in sse.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            derender = {
                "stream": True,
                "model": MODEL,
                "generate_chunk": json.loads(line.removeprefix("data:")),
                "stream_state": state,
                "prompt_token_ids": generate["token_ids"],
                "chat_request": body,
            }
            answer = client.post(
                k3_server + "/v1/chat/completions/derender", json=derender
            )
            answer.raise_for_status()
            answer = answer.json()
            state = answer["stream_state"]
            for choice in answer["chunk"]["choices"]:
                for call in choice["delta"].get("tool_calls") or ():
                    if call.get("id"):
                        ids_by_index.setdefault(call["index"], call["id"])
    assert tuple(ids_by_index[i] for i in sorted(ids_by_index)) == WANTED_IDS


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["whole", "streamed"])
def test_the_coupled_server_gives_the_same_ids(k3_server, second_turn, read):
    ids, _ = second_turn
    reply = read(
        k3_server, ids, max_tokens=len(ids) + 16, tools=TOOLS, messages=HISTORY
    )
    assert reply.tool_call_ids == WANTED_IDS
