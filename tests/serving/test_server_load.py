"""Under load and faults, through the real ``vllm serve``: every client gets exactly
its own reply, and the server keeps serving.

Each client's forced output carries a tag of its own, so text that strays from one
request into another cannot go unnoticed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.endpoints import ENDPOINTS, MODEL, PROMPT, Reply, chat, chat_stream
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_tools
from vllm_k3_plugin.tools.shapes import TOOLS

pytestmark = pytest.mark.server

CLIENTS = 64
ROUNDS = 2


class Forced:
    """One client's forced output and what every reading of it must give."""

    def __init__(self, text: str, *, stop: bool, expected: tuple) -> None:
        self.text = text
        self.stop = stop
        self.expected = expected  # (reasoning, content, tool calls)

    def ids(self, tokenizer) -> tuple[list[int], int]:
        ids = tokenizer.encode(self.text, add_special_tokens=False)
        if self.stop:
            return [*ids, vocab.END_OF_MSG_ID], len(ids) + 8
        return ids, len(ids)


def answered(tag: str) -> Forced:
    text = f"Thinking {tag}." + vocab.THINK_END + vocab.RESPONSE_START
    text += f"Answer {tag}." + vocab.RESPONSE_END + vocab.MESSAGE_END
    return Forced(text, stop=True, expected=(f"Thinking {tag}.", f"Answer {tag}.", ()))


def skipped_channel(tag: str) -> Forced:
    reply = f"Reply {tag}."
    text = reply + vocab.RESPONSE_END + vocab.MESSAGE_END
    return Forced(text, stop=True, expected=(reply, reply, ()))


def thought_only(tag: str) -> Forced:
    return Forced(
        f"Only thinking {tag}", stop=True, expected=(f"Only thinking {tag}", "", ())
    )


def tool_call(tag: str) -> Forced:
    text = f"Calling {tag}." + render_tools([("get_weather", {"city": tag})])
    text += vocab.MESSAGE_END
    call = ("get_weather", {"city": tag})
    return Forced(text, stop=True, expected=(f"Calling {tag}.", "", (call,)))


def length_cut(tag: str) -> Forced:
    text = f"Thinking {tag}." + vocab.THINK_END + vocab.RESPONSE_START
    text += f"Partial {tag} answer" + vocab.CLOSE + "resp"
    return Forced(
        text, stop=False, expected=(f"Thinking {tag}.", f"Partial {tag} answer", ())
    )


KINDS: list[Callable[[str], Forced]] = [
    answered,
    skipped_channel,
    thought_only,
    tool_call,
    length_cut,
]


def _one_client(url, tokenizer, round_, client) -> tuple[str, Reply, Forced]:
    tag = f"r{round_}c{client}"
    forced = KINDS[client % len(KINDS)](tag)
    endpoint = sorted(ENDPOINTS)[client % len(ENDPOINTS)]
    ids, max_tokens = forced.ids(tokenizer)
    reply = ENDPOINTS[endpoint](url, ids, max_tokens=max_tokens, tools=TOOLS)
    return endpoint, reply, forced


def test_concurrency_soak(k3_server, hf_tokenizer):
    """64 concurrent clients a round, every endpoint and every shape, two rounds."""
    failures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        for round_ in range(ROUNDS):
            futures = [
                pool.submit(_one_client, k3_server, hf_tokenizer, round_, client)
                for client in range(CLIENTS)
            ]
            for client, future in enumerate(futures):
                endpoint, reply, forced = future.result()
                got = (reply.reasoning, reply.content, reply.tool_calls)
                if got != forced.expected:
                    failures.append((round_, client, endpoint, got, forced.expected))
    assert failures == []


def _stream_and_hang_up(url: str, ids: list[int], chunks: int) -> int:
    """Start a streamed chat request, read ``chunks`` events, and disconnect."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": len(ids) + 8,
        "stream": True,
        "tools": TOOLS,
        "vllm_xargs": {"k3_force_ids": ids},
    }
    seen = 0
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data:"):
                seen += 1
                if seen >= chunks:
                    break
    return seen


def _still_serving(url, tokenizer, tag: str) -> None:
    for kind in (answered, skipped_channel, tool_call):
        forced = kind(tag)
        ids, max_tokens = forced.ids(tokenizer)
        for read in (chat, chat_stream):
            reply = read(url, ids, max_tokens=max_tokens, tools=TOOLS)
            assert (reply.reasoning, reply.content, reply.tool_calls) == forced.expected


def test_faults_then_the_server_still_answers_correctly(
    k3_server, hf_tokenizer, k3_server_log
):
    log_start = k3_server_log.stat().st_size
    # A client that hangs up mid-stream, inside the think channel and inside a call
    # argument (the engine aborts the request).
    long_thought = hf_tokenizer.encode("word " * 1500, add_special_tokens=False)
    assert _stream_and_hang_up(k3_server, long_thought, chunks=5) == 5
    mid_call = render_tools([("write_file", {"path": "a", "content": "x " * 1500})])
    mid_call_ids = hf_tokenizer.encode(mid_call, add_special_tokens=False)
    assert _stream_and_hang_up(k3_server, mid_call_ids, chunks=40) == 40
    # Many hang up at once while others are being answered.
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        hangups = [
            pool.submit(_stream_and_hang_up, k3_server, long_thought, 3)
            for _ in range(6)
        ]
        _still_serving(k3_server, hf_tokenizer, "during")
        assert [future.result() for future in hangups] == [3] * 6
    # A non-streamed request whose client gives up: the engine aborts it mid-thought
    # (the 1,500 forced steps take about 5 s on this server, measured). The client
    # gives up at a deadline: httpx's own timeout is per read, and once let a
    # 5.07 s answer through.
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": len(long_thought) + 8,
        "vllm_xargs": {"k3_force_ids": long_thought},
    }

    async def give_up_after(seconds: float) -> None:
        async with httpx.AsyncClient(timeout=None) as client:
            request = client.post(k3_server + "/v1/chat/completions", json=body)
            await asyncio.wait_for(request, seconds)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(give_up_after(1.0))
    # A request the server refuses (longer than the model length).
    client = openai.OpenAI(base_url=k3_server + "/v1", api_key="none")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "word " * 5000}],
            max_tokens=16,
        )
    # max_tokens inside a tool call, and a stream cut inside a marker, on all six.
    cut_call = "Checking." + render_tools([("get_weather", {"city": "Paris"})])
    cut_ids = hf_tokenizer.encode(
        cut_call[: cut_call.index("Paris") + 2], add_special_tokens=False
    )
    for endpoint, read in ENDPOINTS.items():
        reply = read(k3_server, cut_ids, max_tokens=len(cut_ids), tools=TOOLS)
        assert (reply.reasoning, reply.content) == ("Checking.", ""), endpoint
        # Cut calls are in the reply on both paths (rule 9).
        assert len(reply.tool_calls) == 1, endpoint
        forced = length_cut(f"cut-{endpoint}")
        ids, max_tokens = forced.ids(hf_tokenizer)
        reply = read(k3_server, ids, max_tokens=max_tokens, tools=TOOLS)
        assert (reply.reasoning, reply.content, reply.tool_calls) == forced.expected
    _still_serving(k3_server, hf_tokenizer, "after")
    log = k3_server_log.read_bytes()[log_start:].decode(errors="replace")
    our_frames = [
        line
        for line in log.splitlines()
        if 'File "' in line and "vllm_k3_plugin" in line
    ]
    assert our_frames == []


def test_n_choices_each_read_on_their_own(k3_server, hf_tokenizer):
    forced = answered("n")
    ids, max_tokens = forced.ids(hf_tokenizer)
    client = openai.OpenAI(base_url=k3_server + "/v1", api_key="none")
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "n": 3,
        "extra_body": {"vllm_xargs": {"k3_force_ids": ids}},
    }
    whole = client.chat.completions.create(**request)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    for choice in whole.choices:
        got = (choice.message.reasoning, choice.message.content)
        assert got == forced.expected[:2]
    pieces: dict[int, list[str]] = {0: ["", ""], 1: ["", ""], 2: ["", ""]}
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            pieces[choice.index][0] += getattr(delta, "reasoning", None) or ""
            pieces[choice.index][1] += delta.content or ""
    assert {tuple(p) for p in pieces.values()} == {forced.expected[:2]}


def test_responses_next_turn_with_function_call_output(k3_server, hf_tokenizer):
    client = openai.OpenAI(base_url=k3_server + "/v1", api_key="none")
    tools = [{"type": "function", **tool["function"]} for tool in TOOLS]
    first_forced = tool_call("Paris")
    ids, max_tokens = first_forced.ids(hf_tokenizer)
    first = client.responses.create(
        model=MODEL,
        input=PROMPT,
        tools=tools,
        max_output_tokens=max_tokens,
        extra_body={"vllm_xargs": {"k3_force_ids": ids}},
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "functions.get_weather:0",
        "get_weather",
        {"city": "Paris"},
    )
    answer = answered("turn2")
    ids, max_tokens = answer.ids(hf_tokenizer)
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": PROMPT},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": "sunny",
            },
        ],
        tools=tools,
        max_output_tokens=max_tokens,
        extra_body={"vllm_xargs": {"k3_force_ids": ids}},
    )
    assert second.output_text == answer.expected[1]
    (reasoning,) = [item for item in second.output if item.type == "reasoning"]
    assert "".join(part.text for part in reasoning.content) == answer.expected[0]
