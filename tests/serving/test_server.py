"""Reasoning and content through a real ``vllm serve``, on every endpoint.

The model is forced to write each shape token by token; each shape ends once by the
stop token (``stop``) and once by a ``max_tokens`` cut (``cut``). All six ways of
reading a reply must return the pinned reasoning and content.
"""

from __future__ import annotations

import re

import pytest

from tests.support.endpoints import ENDPOINTS, chat, chat_stream
from tests.support.expected_tools import NO_CALL_SHAPES, TOOL_SHAPES
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.vocab import RESPONSE_END
from vllm_k3_plugin.tools.shapes import QUOTED_JSON, SHAPES, SKIPPED_REPLY, output_ids

pytestmark = pytest.mark.server

R = SKIPPED_REPLY

# shape: ((reasoning, content) if stopped, (reasoning, content) if cut by max_tokens)
EXPECTED = {
    "think-then-reply": (("Let me think.", "Hello!"),) * 2,
    "skipped-channel": ((R, R), (R, "")),
    "closer-at-end": (("Reply.", "Reply."), ("Reply.", "")),
    "closer-whitespace": (("Reply.\n", "Reply.\n"), ("Reply.\n", "")),
    "quoted-closer": (("He wrote " + RESPONSE_END + " then more.", "Final."),) * 2,
    "closer-then-think-exit": (("Draft.", "Final."),) * 2,
    "closer-then-response-open": (("Draft.", "Final."),) * 2,
    "unseparated-think-exit": (("Thought.", "Final."),) * 2,
    "self-opened-response": (("Thought.", "Final."),) * 2,
    "no-closer": (("Just thinking", ""),) * 2,
    "closer-cut-mid-marker": (("Reply.", ""),) * 2,
    "thinking-off": (("", "Hi there."),) * 2,
    "quoted-tools-opener": (("", "The section starts with  and lists the calls."),) * 2,
    "bpe-markers": (("", "Use " + QUOTED_JSON + " here."),) * 2,
    "thinking-off-self-opened-think": (("hmm", "Ok."),) * 2,
    "thinking-off-declined-think": (("", "Ok."),) * 2,
    # A call opener that opens nothing: nothing replayed, so read alike however the
    # output ended (both endings read in process, test_reading_contract.py); served
    # ended by the stop token.
    **{shape: (reading, None) for shape, reading in NO_CALL_SHAPES.items()},
}
CASES = [
    (shape, ending)
    for shape, readings in sorted(EXPECTED.items())
    for ending, reading in zip(("stop", "cut"), readings, strict=True)
    if reading is not None
]


def test_every_shape_is_pinned():
    assert set(EXPECTED) | set(TOOL_SHAPES) == set(SHAPES)


def _request(hf_tokenizer, output: str, ending: str) -> tuple[list[int], int]:
    ids = output_ids(output, stop=ending == "stop")
    if ending == "stop":
        return ids, len(ids) + 16
    return ids, len(ids)


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize(("shape", "ending"), CASES)
def test_shape_on_every_endpoint(k3_server, hf_tokenizer, shape, ending, endpoint):
    output, thinking, _ = SHAPES[shape]
    ids, max_tokens = _request(hf_tokenizer, output, ending)
    reply = ENDPOINTS[endpoint](
        k3_server, ids, max_tokens=max_tokens, thinking=thinking
    )
    if_stopped, if_cut = EXPECTED[shape]
    assert (reply.reasoning, reply.content) == (
        if_stopped if ending == "stop" else if_cut
    )


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_empty_output(k3_server, endpoint):
    reply = ENDPOINTS[endpoint](k3_server, [vocab.END_OF_MSG_ID], max_tokens=4)
    assert (reply.reasoning, reply.content) == ("", "")


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "chat-stream"])
def test_stop_string_counts_as_a_stop(k3_server, hf_tokenizer, read):
    """A stop string leaves no stop id; the reply is still replayed."""
    output = R + RESPONSE_END + "STOPHERE and more"
    ids = hf_tokenizer.encode(output, add_special_tokens=False)
    reply = read(k3_server, ids, max_tokens=len(ids) + 8, stop=["STOPHERE"])
    assert (reply.reasoning, reply.content) == (R, R)


def test_every_process_says_the_parsers_registered(k3_server, k3_server_log):
    """The API server (where the parsers read every reply) and the engine core
    (which builds its own reasoning parser: structured output asks it when
    reasoning ended) each log that the plugin registered. The API server loads
    plugins before vLLM configures its logging; the line waits for it."""
    lines = k3_server_log.read_text(errors="replace").splitlines()
    registered = {
        pid
        for pid, line in _by_pid(lines)
        if "kimi_k3 reasoning and tool parsers registered" in line
    }
    # By process id: vLLM 0.34 names the API server's process only after it
    # configured logging (its first lines say ``MainProcess``).
    for process in ("APIServer", "EngineCore"):
        pids = {pid for pid, line in _by_pid(lines) if line.startswith(f"({process} ")}
        assert pids and pids <= registered, (process, pids, registered)


def _by_pid(lines):
    for line in lines:
        found = re.match(r"\(\w+ pid=(\d+)\)", line)
        if found:
            yield found[1], line
