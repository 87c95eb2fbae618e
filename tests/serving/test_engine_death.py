"""Streams an engine fault ends: the engine core process killed while six streams
are open (two each on chat completions, Responses and Messages, through the
``openai`` and ``anthropic`` SDKs' stream helpers), on a server without and with
Moonshot's wire switch.

Each stream must end within 30 s with its endpoint's own failure, never a
transport error: chat completions vLLM's error frame, which the SDK raises as an
``APIError`` (with the switch, the spec's end frame, ``finish_reason:
server_interrupted``); Responses ``response.failed`` after its open items are
closed (``parsers/stream_faults.py``: vLLM alone drops the connection
mid-chunk); Messages Anthropic's ``error`` event, which the SDK raises as an
``APIStatusError``. Every character read was sent once: the forced thought is
numbered words, and what each stream read is a prefix of it (and, on Responses,
what the closing events say was sent). Then ``/health`` fails and the server exits.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.serving.test_wire_spec import SWITCH
from tests.support.endpoints import MODEL, PROMPT
from tests.support.force import STEP_DELAY_ENV
from tests.support.server import running_server
from vllm_k3_plugin.tools.shapes import SHAPES, output_ids

pytestmark = pytest.mark.server

# Long enough that every stream is still generating when the engine dies: about
# 7,000 tokens, past the test servers' usual model length (the tiny checkpoint's
# is 8,192), at no more than 200 steps a second.
LONG = " ".join(f"w{number}" for number in range(2800))
LONG_MODEL = ("--max-model-len", "8192")
PACED = {STEP_DELAY_ENV: "0.005"}
SHORT_THOUGHT, SHORT_REPLY = "Let me think.", "Hello!"
# (reasoning, content) of the output each server is given: a long thought; with
# the switch, which holds a thought back until the think channel is decided, a
# long reply.
TEXTS = {False: (LONG, SHORT_REPLY), True: (SHORT_THOUGHT, LONG)}


def forced_ids(switched: bool) -> list[int]:
    reasoning, content = TEXTS[switched]
    output = SHAPES["think-then-reply"].output
    output = output.replace(SHORT_THOUGHT, reasoning).replace(SHORT_REPLY, content)
    return output_ids(output, stop=True)


PER_ENDPOINT = 2
DELTAS_BEFORE_THE_FAULT = 3
STREAM_END_S = 30.0
SERVER_EXIT_S = 60.0


class Stream:
    """One open stream: the reasoning it read, how it ended and when."""

    def __init__(self, endpoint: str, switched: bool) -> None:
        self.endpoint = endpoint
        self.long_is_reasoning = not switched
        self.read: list[str] = []
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.ended_at: float | None = None
        self.outcome = ""
        self.closing: list = []
        """Responses: the events after the last delta."""

    def delta(self, text: str, started: threading.Barrier, *, reasoning: bool) -> None:
        (self.reasoning if reasoning else self.content).append(text)
        self.read.append(text)
        # The fault comes once every stream is inside the output's long part.
        long_part = self.reasoning if self.long_is_reasoning else self.content
        if reasoning == self.long_is_reasoning and (
            len(long_part) == DELTAS_BEFORE_THE_FAULT
        ):
            started.wait(timeout=120)


def _chat(url: str, ids: list[int], stream: Stream, started) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=len(ids) + 16,
        stream=True,
        extra_body={"vllm_xargs": {"k3_force_ids": ids}},
    )
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            text = getattr(delta, "reasoning", None) or getattr(
                delta, "reasoning_content", None
            )
            if text:
                stream.delta(text, started, reasoning=True)
            if delta.content:
                stream.delta(delta.content, started, reasoning=False)
            if choice.finish_reason:
                stream.outcome = f"finish_reason {choice.finish_reason}"


def _responses(url: str, ids: list[int], stream: Stream, started) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    with client.responses.stream(
        model=MODEL,
        input=PROMPT,
        max_output_tokens=len(ids) + 16,
        extra_body={"vllm_xargs": {"k3_force_ids": ids}},
    ) as events:
        for event in events:
            if event.type == "response.reasoning_text.delta":
                stream.delta(event.delta, started, reasoning=True)
            elif event.type == "response.output_text.delta":
                stream.delta(event.delta, started, reasoning=False)
            elif stream.read:
                stream.closing.append(event)
            if event.type in ("response.failed", "response.completed", "error"):
                stream.outcome = event.type


def _messages(url: str, ids: list[int], stream: Stream, started) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    with client.messages.stream(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=len(ids) + 16,
        extra_body={"vllm_xargs": {"k3_force_ids": ids}},
    ) as events:
        for event in events:
            if event.type == "content_block_delta":
                if event.delta.type == "thinking_delta":
                    stream.delta(event.delta.thinking, started, reasoning=True)
                elif event.delta.type == "text_delta":
                    stream.delta(event.delta.text, started, reasoning=False)
            elif event.type == "message_stop":
                stream.outcome = "message_stop"


READERS = {"chat": _chat, "responses": _responses, "messages": _messages}


def _run(reader, url, ids, stream: Stream, started) -> None:
    try:
        reader(url, ids, stream, started)
    except (openai.APIConnectionError, anthropic.APIConnectionError) as error:
        stream.outcome = f"transport error {error.__cause__ or error!r}"
    except (openai.APIError, anthropic.APIError) as error:
        stream.outcome = f"API error {type(error).__name__}: {error}"
    except threading.BrokenBarrierError:
        stream.outcome = "ended before the fault"
    except Exception as error:
        stream.outcome = f"{type(error).__name__}: {error}"
    stream.ended_at = time.monotonic()


@pytest.fixture(params=["plain", "wire-switch"])
def switched(request) -> bool:
    return request.param == "wire-switch"


def test_every_stream_ends_with_its_endpoints_failure(
    tiny_checkpoint, tmp_path, switched
):
    ids = forced_ids(switched)
    log = tmp_path / "vllm-serve.log"
    with running_server(
        tiny_checkpoint, log, *LONG_MODEL, *(SWITCH if switched else ()), env=PACED
    ) as url:
        streams = [
            Stream(endpoint, switched)
            for endpoint in READERS
            for _ in range(PER_ENDPOINT)
        ]
        started = threading.Barrier(len(streams) + 1)
        threads = [
            threading.Thread(
                target=_run, args=(READERS[s.endpoint], url, ids, s, started)
            )
            for s in streams
        ]
        for thread in threads:
            thread.start()
        started.wait(timeout=120)
        (engine,) = set(
            re.findall(r"\(EngineCore\S* pid=(\d+)\)", log.read_text(errors="replace"))
        )
        fault_at = time.monotonic()
        os.kill(int(engine), signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=STREAM_END_S + 30)
        for stream in streams:
            what = (stream.endpoint, stream.outcome)
            assert stream.ended_at is not None, what
            assert stream.ended_at - fault_at < STREAM_END_S, what
            assert len(stream.read) >= DELTAS_BEFORE_THE_FAULT, what
            _assert_sent_once(stream, *TEXTS[switched])
            _assert_failed(stream, switched)
        with pytest.raises((httpx.HTTPStatusError, httpx.TransportError)):
            httpx.get(url + "/health", timeout=5).raise_for_status()
        deadline = time.monotonic() + SERVER_EXIT_S
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                break
            time.sleep(1)
        else:
            pytest.fail(f"the server still answers {SERVER_EXIT_S:.0f} s after")


def _assert_sent_once(stream: Stream, reasoning: str, content: str) -> None:
    """What the stream read is the output's start, each character once."""
    thought, reply = "".join(stream.reasoning), "".join(stream.content)
    if reply:
        assert thought.strip() == reasoning, (stream.endpoint, thought[-80:])
        assert content.startswith(reply.lstrip()), (stream.endpoint, reply[-80:])
    else:
        assert reasoning.startswith(thought.lstrip()), (stream.endpoint, thought[-80:])


def _assert_failed(stream: Stream, switched: bool) -> None:
    outcome = stream.outcome
    if stream.endpoint == "chat":
        if switched:
            assert outcome == "finish_reason server_interrupted", outcome
        else:
            assert outcome.startswith("API error APIError:"), outcome
    elif stream.endpoint == "messages":
        assert outcome.startswith("API error"), outcome
        assert "APIConnectionError" not in outcome, outcome
    else:
        assert outcome == "response.failed", outcome
        failed = stream.closing[-1]
        assert failed.response.status == "failed"
        assert failed.response.error.code == "server_error"
        # The open item closed with exactly what was sent of it.
        if switched:
            kind, read = "output_text", "".join(stream.content)
        else:
            kind, read = "reasoning_text", "".join(stream.reasoning)
        (done,) = [e for e in stream.closing if e.type == f"response.{kind}.done"]
        assert done.text == read
        (item,) = [
            e.item
            for e in stream.closing
            if e.type == "response.output_item.done" and e.item.status == "incomplete"
        ]
        assert item.content[0].text == read
