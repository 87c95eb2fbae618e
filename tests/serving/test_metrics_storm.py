"""``vllm_k3_outputs_total`` under a storm, through a real ``vllm serve``: streamed
chat requests 32 at a time, half of them left by their client after 1 to 10 frames
of a long thought, the other half read to their end, with malformed requests among
them. Every streamed output that began is counted once: by how it ended if its
end was read, ``aborted`` if its stream closed first. Which of the two an output
its client left gets depends on whether vLLM noticed the client's leaving before
the engine wrote the output's end; the sum does not."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from tests.serving.test_metrics import scrape
from tests.support.endpoints import MODEL, PROMPT
from vllm_k3_plugin.format import vocab

pytestmark = pytest.mark.server

ROUNDS = 2
STREAMS = 200  # a round; every other one is left
CONCURRENT = 32
FINISHED_THOUGHT_WORDS = 150
LEFT_THOUGHT_WORDS = 1200
CHAT_STREAM = (("endpoint", "chat_completions"), ("stream", "true"))
_ASKED = [{"role": "user", "content": PROMPT}]
MALFORMED = tuple(
    body if isinstance(body, bytes) else json.dumps(body).encode()
    for body in (
        b"{not json",
        {"model": MODEL, "stream": True},  # no messages
        {"model": MODEL, "stream": True, "messages": "hi"},  # not a list
        {"model": MODEL, "stream": True, "max_tokens": -1, "messages": _ASKED},
        {"model": "no-such-model", "stream": True, "messages": _ASKED},
    )
)


def _forced(tokenizer, words: int, tag: str) -> list[int]:
    text = " ".join(f"step{tag}" for _ in range(words)) + vocab.THINK_END
    text += vocab.RESPONSE_START + f"Answer {tag}." + vocab.RESPONSE_END
    text += vocab.MESSAGE_END
    return [*tokenizer.encode(text, add_special_tokens=False), vocab.END_OF_MSG_ID]


async def _stream(client, ids: list[int], leave_after: int | None) -> bool:
    """One streamed chat request; ``leave_after``: the frames with text read
    before the client leaves (``None``: read to the end). True if read whole."""
    body = {
        "model": MODEL,
        "messages": _ASKED,
        "max_tokens": len(ids) + 8,
        "stream": True,
        "vllm_xargs": {"k3_force_ids": ids},
    }
    read = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return True
            if not line.startswith("data: "):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("reasoning") or delta.get("content"):
                read += 1
                if leave_after is not None and read >= leave_after:
                    return False  # leaving the block closes the connection
    raise AssertionError("a stream read to its end had no [DONE]")


async def _malformed(client, body: bytes) -> int:
    response = await client.post(
        "/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
    )
    return response.status_code


async def _storm(url: str, tokenizer, round_: int) -> tuple[int, int, list[int]]:
    """Streams finished by their client, streams left, malformed statuses."""
    shuffle = random.Random(round_)
    plan = [
        (index % 2 == 1, shuffle.randint(1, 10) if index % 2 else None)
        for index in range(STREAMS)
    ]
    finished_ids = _forced(tokenizer, FINISHED_THOUGHT_WORDS, f"r{round_}")
    left_ids = _forced(tokenizer, LEFT_THOUGHT_WORDS, f"r{round_}")
    gate = asyncio.Semaphore(CONCURRENT)
    limits = httpx.Limits(max_connections=CONCURRENT + len(MALFORMED))

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def one(left: bool, leave_after: int | None) -> bool:
            async with gate:
                return await _stream(
                    client, left_ids if left else finished_ids, leave_after
                )

        streams = [asyncio.create_task(one(*step)) for step in plan]
        await asyncio.sleep(0.5)
        statuses = await asyncio.gather(*(_malformed(client, b) for b in MALFORMED))
        read_whole = await asyncio.gather(*streams)
    whole = sum(read_whole)
    return whole, STREAMS - whole, list(statuses)


def _vllm_value(url: str, name: str, **labels: str) -> float:
    """The sum of a vLLM metric's samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    text = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def _outputs(samples, ending: str) -> float:
    key = ("vllm_k3_outputs_total", tuple(sorted((*CHAT_STREAM, ("ending", ending)))))
    return samples.get(key, 0)


def _engine_ended(url: str) -> float:
    return sum(
        _vllm_value(url, "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length")
    )


def _settled(url: str, before, timeout_s: float = 60) -> dict[str, float]:
    """The counter's deltas once the engine is idle and the stream closed last has
    been counted (the sum stops moving)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        idle = not any(
            _vllm_value(url, name)
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )
        after = scrape(url)
        deltas = {
            ending: _outputs(after, ending) - _outputs(before, ending)
            for ending in ("answered", "aborted", "cut", "thought_only", "empty")
        }
        if (idle and deltas == last) or time.monotonic() > deadline:
            return deltas
        last = deltas
        time.sleep(1)


def test_every_stream_that_began_is_counted_once_in_a_storm(k3_server, hf_tokenizer):
    for round_ in range(ROUNDS):
        before = scrape(k3_server)
        engine_before = _engine_ended(k3_server)
        whole, left, statuses = asyncio.run(_storm(k3_server, hf_tokenizer, round_))
        counted = _settled(k3_server, before)
        engine_ended = _engine_ended(k3_server) - engine_before

        assert all(400 <= status < 500 for status in statuses), statuses
        assert whole == STREAMS // 2, round_  # no stream meant to finish was cut
        # Each stream counted once; the malformed requests not at all.
        assert sum(counted.values()) == STREAMS, (round_, counted)
        # Read to their end: answered. Left: aborted, or answered where the engine
        # wrote the output's end before vLLM learnt its client had gone.
        assert counted["answered"] >= whole, (round_, counted)
        assert counted["aborted"] <= left, (round_, counted)
        assert counted["answered"] + counted["aborted"] == STREAMS, (round_, counted)
        # Counted as ended only what the engine ended.
        assert counted["answered"] <= engine_ended, (round_, counted, engine_ended)
