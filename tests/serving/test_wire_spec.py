"""Moonshot's wire spec through a real ``vllm serve`` started with the switch
(``--middleware vllm_k3_plugin.wire.MoonshotWireSpec --enable-prompt-tokens-details``),
read as raw server-sent events: a thinking reply, a tool-call reply and a
non-thinking reply, streamed and not. Checked per frame as the spec's suite checks
them (``docs/moonshot_stream_spec.md``): P0.4 usage on the end frame, P0.1/P0.2 usage
details, P0.6 framing, P0.7/P1.3 constant fields, P0.9 the first frame, P0.10 and the
one-kind-a-frame rule, P0.12 ``reasoning_content``, P0.13/P0.3 a call's first chunk
and its continuations, P1.7 the boundary, P1.10 the end frame's empty delta, P2.1
24-hex ids, P2.2 ``NAME_N`` call ids, P2.3 no summary unless asked."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.support.endpoints import MODEL, PROMPT
from tests.support.expected_tools import (
    MULTI,
    TOOL_SHAPES,
    assert_results_rendered_in_call_order,
)
from tests.support.server import serves_the_model
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_tools
from vllm_k3_plugin.tools.shapes import SHAPES, TOOLS, WEATHER_TOOL, output_ids

pytestmark = pytest.mark.server

SWITCH = ("--middleware", "vllm_k3_plugin.wire.MoonshotWireSpec")
KINDS = ("content", "reasoning_content", "tool_calls")
ENVELOPE = ("id", "object", "created", "model")


@pytest.fixture(scope="module")
def wire_server(tiny_checkpoint, tmp_path_factory):
    from tests.support.server import running_server

    log = tmp_path_factory.mktemp("wire-server") / "vllm-serve.log"
    with running_server(
        tiny_checkpoint, log, *SWITCH, "--enable-prompt-tokens-details"
    ) as url:
        yield url


def _body(shape: str, stream: bool, **extra) -> dict:
    output, thinking, _ = SHAPES[shape]
    ids = output_ids(output, stop=True)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": len(ids) + 16,
        "temperature": 0,
        "stream": stream,
        "thinking": {"type": "enabled" if thinking else "disabled"},
        "vllm_xargs": {"k3_force_ids": ids},
        **extra,
    }
    if shape in TOOL_SHAPES:
        body["tools"] = [WEATHER_TOOL]
        body["tool_choice"] = "auto"
    return body


def _frames(url: str, body: dict) -> list[dict]:
    """The stream's frames, each line checked as P0.6 checks it."""
    frames = []
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert response.status_code == 200
        assert "text/event-stream" in response.headers["content-type"]
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            if data == "[DONE]":
                return frames
            frames.append(json.loads(data))
    raise AssertionError("no [DONE]")


def _usage_ok(usage) -> None:
    assert isinstance(usage, dict), usage
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert type(usage[key]) is int
    assert type(usage["completion_tokens_details"]["reasoning_tokens"]) is int
    assert type(usage["prompt_tokens_details"]["cached_tokens"]) is int


def _read(frames: list[dict], *, resumes: bool = False) -> dict:
    """Walk the frames as the spec does; return what was read. ``resumes``: the
    output thinks again after its thinking ended (between calls), so reasoning
    follows the boundary; otherwise none may (P1.7)."""
    first = frames[0]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", first["id"]), first["id"]  # P2.1
    read = {"reasoning": "", "content": "", "arguments": "", "boundary": False,
            "resumed": ""}  # fmt: skip
    started: set[int] = set()
    summaries = [f for f in frames if f["choices"] == []]
    for frame in frames:
        assert {k: frame[k] for k in ENVELOPE} == {k: first[k] for k in ENVELOPE}
    choices = [f["choices"] for f in frames if f["choices"]]
    assert all(len(c) == 1 for c in choices)
    assert choices[0][0]["delta"].get("role") == "assistant"
    ends = [c[0] for c in choices if c[0]["finish_reason"] is not None]
    assert len(ends) == 1 and choices[-1][0] is ends[0]
    assert ends[0]["delta"] == {}  # P1.10
    _usage_ok(ends[0].get("usage"))  # P0.4
    read["finish"] = ends[0]["finish_reason"]
    for (choice,) in choices[1:-1]:
        delta = choice["delta"]
        assert "role" not in delta
        assert sum(kind in delta for kind in KINDS) <= 1, delta  # one kind a frame
        if "content" in delta:
            assert isinstance(delta["content"], str)  # P0.10
            assert not delta["content"] or not read["reasoning"] or read["boundary"]
            read["content"] += delta["content"]
        if "reasoning_content" in delta:
            text = delta["reasoning_content"]
            if text == "":
                assert read["reasoning"] and not read["boundary"]  # P1.7
                read["boundary"] = True
            else:
                assert delta["reasoning"] == text  # P0.12, beside vLLM's field
                read["reasoning"] += text
                # Thinking resumed after it ended (between calls, after the
                # reply's text): reasoning after the boundary.
                if read["boundary"]:
                    read["resumed"] += text
        for call in delta.get("tool_calls") or ():
            # Thinking ended where the first call began: the boundary before it.
            assert not read["reasoning"] or read["boundary"], delta
            if call["index"] not in started:  # P0.13, P2.2
                assert call["index"] == len(started)  # P0.14, P1.9: 0, 1, ...
                started.add(call["index"])
                name = call["function"]["name"]
                assert (
                    call["type"] == "function" and call["function"]["arguments"] == ""
                )
                assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*_\d+", call["id"])
                assert call["id"].startswith(name + "_")
            else:  # P0.3
                assert set(call) <= {"index", "function"}
                assert set(call["function"]) == {"arguments"}
            read["arguments"] += call["function"].get("arguments") or ""
    read["summaries"] = summaries
    assert bool(read["resumed"]) == resumes, read["resumed"]
    return read


@pytest.mark.parametrize("usage", [False, True], ids=["plain", "include_usage"])
def test_a_thinking_reply(wire_server, usage):
    extra = {"stream_options": {"include_usage": True}} if usage else {}
    read = _read(_frames(wire_server, _body("think-then-reply", True, **extra)))
    assert (read["reasoning"], read["content"]) == ("Let me think.", "Hello!")
    assert read["boundary"] and read["finish"] == "stop"
    assert len(read["summaries"]) == (1 if usage else 0)  # P0.1, P2.3
    for frame in read["summaries"]:
        _usage_ok(frame["usage"])


@pytest.mark.parametrize("shape", ["tools-in-think", "think-between-calls"])
def test_a_tool_call_reply(wire_server, shape):
    """A call from the thought, and thinking resumed between calls then a reply:
    the boundary comes where the thinking first ended, before the first call; the
    resumed thinking follows it as reasoning."""
    resumes = shape == "think-between-calls"
    read = _read(_frames(wire_server, _body(shape, True)), resumes=resumes)
    reasoning, content, ((_, arguments),) = TOOL_SHAPES[shape]
    assert (read["reasoning"], read["content"]) == (reasoning, content)
    assert read["boundary"] and read["finish"] == "tool_calls"
    assert json.loads(read["arguments"]) == json.loads(arguments)


def test_a_reply_without_thinking(wire_server):
    read = _read(_frames(wire_server, _body("thinking-off", True)))
    assert (read["reasoning"], read["content"]) == ("", "Hi there.")
    assert not read["boundary"]


def test_a_whole_reply_carries_reasoning_content(wire_server):
    response = httpx.post(
        wire_server + "/v1/chat/completions",
        json=_body("think-then-reply", False),
        timeout=120,
    )
    assert response.status_code == 200
    body = response.json()
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", body["id"])
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Let me think."
    assert message["content"] == "Hello!"


def test_a_whole_tool_call_reply_has_the_specs_ids(wire_server):
    response = httpx.post(
        wire_server + "/v1/chat/completions",
        json=_body("tools-in-think", False),
        timeout=120,
    )
    assert response.status_code == 200
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["id"] == "get_weather_0"


def test_the_next_turn_matches_results_to_calls_by_the_specs_ids(
    wire_server, hf_tokenizer
):
    """P2.2's ids do not break the next turn: the calls go back with ``NAME_N`` ids
    and their results in the opposite order; vLLM's K3 renderer matches each result
    to its call by id (verbatim) and renders them in call order."""
    body = {**_body("reply-then-calls", False), "tools": TOOLS}
    first = httpx.post(wire_server + "/v1/chat/completions", json=body, timeout=120)
    assert first.status_code == 200
    message = first.json()["choices"][0]["message"]
    calls = message["tool_calls"]
    assert [c["id"] for c in calls] == [
        f"{name}_{n}" for n, (name, _) in enumerate(MULTI)
    ]
    answer = "Sunny; file written."
    ids = output_ids(answer + vocab.RESPONSE_END + vocab.MESSAGE_END, stop=True)
    history = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": message["content"], "tool_calls": calls},
        *reversed(
            [
                {"role": "tool", "tool_call_id": c["id"], "content": f"result {n}"}
                for n, c in enumerate(calls)
            ]
        ),
    ]
    second = httpx.post(
        wire_server + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": history,
            "tools": TOOLS,
            "max_tokens": len(ids) + 8,
            "return_token_ids": True,
            "vllm_xargs": {"k3_force_ids": ids},
        },
        timeout=120,
    )
    assert second.status_code == 200, second.text
    reply = second.json()
    assert reply["choices"][0]["message"]["content"] == answer
    prompt = hf_tokenizer.decode(reply["prompt_token_ids"], skip_special_tokens=False)
    assert_results_rendered_in_call_order(prompt, MULTI)


def test_the_openai_sdk_reads_the_switchs_fields(wire_server):
    """Must-show 2: the ``openai`` SDK reads the thinking (``reasoning_content``), the
    calls and the usage (the summary, and the end frame's ``choices[0].usage``)."""
    client = openai.OpenAI(base_url=wire_server + "/v1", api_key="none")
    thinking, content, usages, ends = [], [], [], []
    for shape in ("think-then-reply", "tools-in-think"):
        body = _body(shape, True, stream_options={"include_usage": True})
        fields = {k: body.pop(k) for k in ("model", "messages", "max_tokens")}
        calls: dict[int, list[str]] = {}
        stream = client.chat.completions.create(
            **fields,
            stream=True,
            stream_options=body.pop("stream_options"),
            tools=body.pop("tools", openai.NOT_GIVEN),
            extra_body={k: v for k, v in body.items() if k != "stream"},
        )
        for chunk in stream:
            if chunk.usage is not None:
                usages.append(chunk.usage)
            for choice in chunk.choices:
                delta = choice.delta
                thinking.append(getattr(delta, "reasoning_content", None) or "")
                content.append(delta.content or "")
                for call in delta.tool_calls or ():
                    entry = calls.setdefault(call.index, ["", ""])
                    entry[0] += (call.function and call.function.name) or ""
                    entry[1] += (call.function and call.function.arguments) or ""
                if choice.finish_reason is not None:
                    ends.append((choice.model_extra or {}).get("usage"))
        if shape == "tools-in-think":
            ((name, arguments),) = calls.values()
            assert (name, json.loads(arguments)) == ("get_weather", {"city": "Paris"})
    reasoning = "".join(thinking)
    assert reasoning == "Let me think." + TOOL_SHAPES["tools-in-think"][0]
    assert "".join(content) == "Hello!"
    assert len(usages) == 2 and all(
        u.completion_tokens_details.reasoning_tokens > 0 for u in usages
    )
    assert all(u.prompt_tokens_details.cached_tokens is not None for u in usages)
    assert len(ends) == 2
    for end in ends:
        _usage_ok(end)


def _choice_frames(frames: list[dict]) -> list[dict]:
    return [f for f in frames if f["choices"]]


def test_several_choices_each_end_with_their_own_usage(wire_server):
    """P0.16: ``n=2``: one choice a frame; each choice's end frame carries its own
    counts with the usage details; the summary comes after both; no middle frame
    has a usage (P1.15: the continuous usage the switch asked vLLM for is not
    passed on)."""
    body = _body("think-then-reply", True, n=2, stream_options={"include_usage": True})
    del body["temperature"]  # vLLM refuses n > 1 when greedy; the ids are forced
    frames = _frames(wire_server, body)
    ends = {}
    for frame in _choice_frames(frames):
        (choice,) = frame["choices"]
        assert "usage" not in frame
        if choice["finish_reason"] is not None:
            assert choice["index"] not in ends and choice["delta"] == {}
            ends[choice["index"]] = choice
    assert sorted(ends) == [0, 1]
    (summary,) = [f for f in frames if not f["choices"]]
    assert frames[-1] is summary
    for end in ends.values():
        _usage_ok(end["usage"])
        assert end["usage"]["prompt_tokens"] == summary["usage"]["prompt_tokens"]
        assert end["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0
    completion = sum(end["usage"]["completion_tokens"] for end in ends.values())
    assert completion == summary["usage"]["completion_tokens"]


def test_internal_content_carries_each_pieces_token_ids(wire_server):
    """P0.5: with ``include_internal_content`` every frame that shows something
    carries ``delta.internal_content.token_ids``; together they are the output's
    ids in order (what the stop step showed nothing for may be left out);
    vLLM's own id fields stay away (the client did not ask for them)."""
    options = {"include_internal_content": True}
    body = _body("think-then-reply", True, stream_options=options)
    frames = _frames(wire_server, body)
    shown: list[int] = []
    with_content = 0
    for frame in _choice_frames(frames)[1:]:
        (choice,) = frame["choices"]
        assert "token_ids" not in choice and "prompt_token_ids" not in frame
        delta = choice["delta"]
        if any(delta.get(kind) for kind in KINDS):
            ids = delta["internal_content"]["token_ids"]
            assert ids and all(isinstance(i, int) and i >= 0 for i in ids)
            shown += ids
            with_content += "content" in delta
    assert with_content > 0
    forced = body["vllm_xargs"]["k3_force_ids"]
    assert shown and forced[: len(shown)] == shown


def test_continuous_usage_rides_on_every_frame(wire_server):
    """The Vendor Verifier's continuous reasoning usage check, on a thought that
    calls a tool: every frame with a choice has a usage with its details (the
    prompt's cached count included), reasoning tokens never fall and are counted
    on each thought piece, and the end frame's own usage, its top-level usage and
    the summary agree."""
    options = {"include_usage": True, "continuous_usage_stats": True,
               "include_internal_content": True}  # fmt: skip
    frames = _frames(wire_server, _body("tools-in-think", True, stream_options=options))
    counted = 0
    for frame in _choice_frames(frames):
        _usage_ok(frame["usage"])
        reasoning = frame["usage"]["completion_tokens_details"]["reasoning_tokens"]
        assert reasoning >= counted
        counted = reasoning
        if frame["choices"][0]["delta"].get("reasoning_content"):
            assert reasoning > 0
    assert any(
        f["choices"][0]["delta"].get("reasoning_content") == ""
        for f in _choice_frames(frames)
    )
    end, summary = frames[-2], frames[-1]
    (choice,) = end["choices"]
    assert choice["finish_reason"] == "tool_calls"
    tokens = {
        usage["completion_tokens_details"]["reasoning_tokens"]
        for usage in (choice["usage"], end["usage"], summary["usage"])
    }
    assert tokens == {counted} and counted > 0


@pytest.mark.parametrize("empty_reply", [False, True], ids=["tools", "empty-reply"])
def test_thinking_closed_before_a_call_ends_at_the_call(wire_server, empty_reply):
    """The Vendor Verifier's continuous reasoning usage check, its last block: the
    model closes its thinking, then opens the tools channel (with or without an
    empty response element before it). The boundary goes before the first
    tool-call frame, and the reasoning token count stays where it was at the
    boundary on every tool-call frame."""
    output = (
        "Need the weather."
        + vocab.THINK_END
        + (vocab.RESPONSE_START + vocab.RESPONSE_END if empty_reply else "")
        + render_tools([("get_weather", {"city": "Paris"})])
        + vocab.MESSAGE_END
    )
    ids = output_ids(output, stop=True)
    options = {"include_usage": True, "continuous_usage_stats": True,
               "include_internal_content": True}  # fmt: skip
    body = {
        **_body("think-then-reply", True, stream_options=options),
        "max_tokens": len(ids) + 16,
        "vllm_xargs": {"k3_force_ids": ids},
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
    }
    frames = _choice_frames(_frames(wire_server, body))
    kinds = [next(iter(f["choices"][0]["delta"]), "") for f in frames]
    boundary = next(
        n for n, f in enumerate(frames)
        if f["choices"][0]["delta"].get("reasoning_content") == ""
    )  # fmt: skip
    calls = [n for n, kind in enumerate(kinds) if kind == "tool_calls"]
    assert calls and boundary < calls[0], kinds
    at_boundary = frames[boundary]["usage"]["completion_tokens_details"]
    for n in calls:
        details = frames[n]["usage"]["completion_tokens_details"]
        assert details["reasoning_tokens"] == at_boundary["reasoning_tokens"] > 0


LONG_PROMPT = " ".join(f"fact {n}: the sea is wide." for n in range(300))


def test_usage_headers_say_the_prompt_and_its_cached_tokens(wire_server):
    """P0.18: ``x-msh-usage-prompt-tokens`` and ``x-msh-usage-cached-tokens``, streamed
    (from the engine's first output) and whole (from the body's usage), equal to
    the usage the reply ends with; a repeated long prompt hits the prefix cache,
    so the cached count is read, not assumed 0."""
    messages = [{"role": "user", "content": LONG_PROMPT}]
    cached = []
    for stream in (True, False, True):
        body = _body("thinking-off", stream, messages=messages)
        if stream:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream(
            "POST", wire_server + "/v1/chat/completions", json=body, timeout=120
        ) as response:
            assert response.status_code == 200
            headers = response.headers
            text = response.read().decode()
        if stream:
            usage = json.loads(text.split("data: ")[-2])["usage"]
        else:
            usage = json.loads(text)["usage"]
        _usage_ok(usage)
        assert int(headers["x-msh-usage-prompt-tokens"]) == usage["prompt_tokens"]
        assert (
            int(headers["x-msh-usage-cached-tokens"])
            == usage["prompt_tokens_details"]["cached_tokens"]
        )
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached[-1] > 0, cached


def test_a_past_turns_reasoning_content_is_rendered_as_its_think_element(
    wire_server, hf_tokenizer
):
    """Clients send each past turn's ``reasoning_content`` back: vLLM reads it as
    the turn's reasoning and the K3 template renders it in the turn's think
    element, before its reply."""
    history = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "reasoning_content": "Two and two.", "content": "4."},
        {"role": "user", "content": "And 3 + 3?"},
    ]
    body = {**_body("think-then-reply", False), "messages": history,
            "return_token_ids": True}  # fmt: skip
    response = httpx.post(wire_server + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    prompt = hf_tokenizer.decode(
        response.json()["prompt_token_ids"], skip_special_tokens=False
    )
    assert (
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Two and two.'
        "<|close|>think<|sep|><|open|>response<|sep|>4.<|close|>response<|sep|>"
    ) in prompt


@pytest.mark.parametrize("effort", ["low", "high", "max"])
def test_reasoning_effort_reaches_the_k3_template(wire_server, effort):
    """vLLM's K3 renderer hands ``reasoning_effort`` low/high/max to the template as
    ``thinking_effort``: the request is served with thinking on."""
    body = {**_body("think-then-reply", False), "reasoning_effort": effort}
    del body["thinking"]
    response = httpx.post(wire_server + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Let me think."


def test_a_reasoning_effort_k3_has_not_is_a_clear_400(wire_server):
    body = {**_body("think-then-reply", False), "reasoning_effort": "medium"}
    response = httpx.post(wire_server + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400
    assert "low, high, max" in response.json()["error"]["message"]


def test_a_stop_string_ends_the_reply_before_it(wire_server):
    """P1.1: the text stops before the stop string, and the finish is ``stop``."""
    ids = output_ids("hello STOPWORD world" + vocab.RESPONSE_END, stop=True)
    body = {**_body("thinking-off", True), "stop": ["STOPWORD"],
            "vllm_xargs": {"k3_force_ids": ids}}  # fmt: skip
    read = _read(_frames(wire_server, body))
    assert read["content"] == "hello " and read["finish"] == "stop"


def test_logprobs_go_on_the_frames_that_show_their_tokens(wire_server):
    """P1.17: no logprobs on the first frame; the others carry ``logprobs.content``
    entries with ``bytes`` and two ``top_logprobs`` each; none without asking."""
    frames = _frames(
        wire_server, _body("thinking-off", True, logprobs=True, top_logprobs=2)
    )
    choices = [f["choices"][0] for f in _choice_frames(frames)]
    assert choices[0].get("logprobs") in (None, {})
    entries = [
        e for c in choices[1:] for e in (c.get("logprobs") or {}).get("content") or ()
    ]
    # vLLM 0.33's stand-in engine computes no logprobs; the model does.
    assert bool(entries) == serves_the_model()
    for entry in entries:
        assert isinstance(entry["token"], str) and "bytes" in entry
        assert len(entry["top_logprobs"]) == 2
    plain = _frames(wire_server, _body("thinking-off", True))
    assert all(f["choices"][0].get("logprobs") is None for f in _choice_frames(plain))


def test_without_the_switch_responses_are_vllms(k3_server):
    """The switch changes nothing for a server that does not name it: vLLM's
    ``reasoning`` only, no boundary frame, no usage on the end frame, vLLM's ids,
    no usage headers; the whole reply has no ``reasoning_content``."""
    body = _body("tools-in-think", True, stream_options={"include_usage": True})
    with httpx.stream(
        "POST", k3_server + "/v1/chat/completions", json=body, timeout=120
    ) as response:
        assert "x-msh-usage-prompt-tokens" not in response.headers
        lines = [line for line in response.iter_lines() if line]
    frames = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert not re.fullmatch(r"chatcmpl-[0-9a-f]{24}", frames[0]["id"])
    deltas = [f["choices"][0]["delta"] for f in frames if f["choices"]]
    assert all("reasoning_content" not in delta for delta in deltas)
    assert any(delta.get("reasoning") for delta in deltas)
    choices = [f["choices"][0] for f in frames if f["choices"]]
    ends = [choice for choice in choices if choice["finish_reason"]]
    assert ends and all("usage" not in end for end in ends)
    calls = [c for delta in deltas for c in delta.get("tool_calls") or ()]
    assert calls[0]["id"].startswith("functions.get_weather:")
    whole = httpx.post(
        k3_server + "/v1/chat/completions",
        json=_body("think-then-reply", False),
        timeout=120,
    )
    assert "reasoning_content" not in whole.json()["choices"][0]["message"]
    assert "x-msh-usage-prompt-tokens" not in whole.headers
