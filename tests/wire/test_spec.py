"""Moonshot's wire spec as a rewrite of vLLM's chat completions exchange, on frames
shaped as vLLM 0.32 to 0.34 send them (``docs/moonshot_stream_spec.md``), and
through the ASGI middleware with the stream cut at every byte."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_k3_plugin.wire import MoonshotWireSpec
from vllm_k3_plugin.wire import facts as engine_facts
from vllm_k3_plugin.wire.facts import EngineFacts
from vllm_k3_plugin.wire.middleware import CACHED_TOKENS_HEADER, PROMPT_TOKENS_HEADER
from vllm_k3_plugin.wire.request import Asked, rewrite_request
from vllm_k3_plugin.wire.spec import BOUNDARY, INTERRUPTED, rewrite_body
from vllm_k3_plugin.wire.stream import StreamRewrite

ENVELOPE = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 7,
    "model": "k3",
}
USAGE = {
    "prompt_tokens": 5,
    "completion_tokens": 9,
    "total_tokens": 14,
    "prompt_tokens_details": {"cached_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 4},
}


def chunk(delta, finish=None, **choice):
    return {
        **ENVELOPE,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish,
                **choice,
            }
        ],
    }


def summary():
    return {**ENVELOPE, "choices": [], "usage": USAGE}


FIRST = chunk({"role": "assistant", "content": ""})


def run(frames, wants_usage=False, history=0, facts=None, **asked):
    rewrite = StreamRewrite(
        Asked(usage=wants_usage, history=history, **asked), facts or EngineFacts()
    )
    out = []
    for frame in frames:
        frame = json.loads(json.dumps(frame))  # a fresh copy, as parsed off the wire
        sent = rewrite.chunk(frame)
        out += [frame] if sent is None else sent
    return out + rewrite.done()


def deltas(frames):
    return [
        (f["choices"][0]["delta"], f["choices"][0]["finish_reason"])
        for f in frames
        if f["choices"]
    ]


def test_a_thinking_reply():
    out = run(
        [
            FIRST,
            chunk({"reasoning": "Let me"}),
            chunk({"reasoning": " think."}),
            chunk({"content": "Hello"}),
            chunk({"content": "!"}, "stop"),
            summary(),
        ]
    )
    assert deltas(out) == [
        ({"role": "assistant", "content": ""}, None),
        ({"reasoning": "Let me", "reasoning_content": "Let me"}, None),
        ({"reasoning": " think.", "reasoning_content": " think."}, None),
        (BOUNDARY, None),
        ({"content": "Hello"}, None),
        ({"content": "!"}, None),
        ({}, "stop"),
    ]
    end = out[-1]["choices"][0]
    assert end["usage"] == USAGE
    assert all(frame["choices"] for frame in out)  # the summary was not asked for
    for frame in out:
        assert {k: frame[k] for k in ENVELOPE} == ENVELOPE


def test_the_summary_reaches_a_client_that_asked_for_it():
    out = run([FIRST, chunk({"content": "Hi"}, "stop"), summary()], wants_usage=True)
    assert out[-1] == summary()
    assert out[-2]["choices"][0]["usage"] == USAGE


def test_a_mixed_delta_is_split_one_kind_a_frame():
    call = [{"index": 0, "id": "functions.f:0", "type": "function",
             "function": {"name": "f", "arguments": ""}}]  # fmt: skip
    out = run(
        [
            FIRST,
            chunk({"reasoning": "Hm.", "content": "Ok", "tool_calls": call}),
            chunk({"content": None, "tool_calls": []}, "tool_calls"),
        ]
    )
    assert deltas(out)[1:] == [
        ({"reasoning": "Hm.", "reasoning_content": "Hm."}, None),
        (BOUNDARY, None),
        ({"content": "Ok"}, None),
        ({"tool_calls": [{**call[0], "id": "f_0"}]}, None),
        ({}, "tool_calls"),
    ]


def test_a_thought_only_output_ends_thinking_before_the_end_frame():
    out = run([FIRST, chunk({"reasoning": "Just thinking"}, "length"), summary()])
    assert deltas(out)[1:] == [
        ({"reasoning": "Just thinking", "reasoning_content": "Just thinking"}, None),
        (BOUNDARY, None),
        ({}, "length"),
    ]


def test_no_reasoning_no_boundary_and_a_null_content_is_dropped():
    out = run([FIRST, chunk({"content": None}), chunk({"content": "Hi."}, "stop")])
    assert deltas(out)[1:] == [({"content": "Hi."}, None), ({}, "stop")]
    assert "usage" not in out[-1]["choices"][0]  # no summary came: none to give


def test_per_token_fields_ride_on_the_last_piece():
    logprobs = {"content": [{"token": "x", "logprob": -0.1}]}
    out = run([FIRST, chunk({"reasoning": "a", "content": "b"}, logprobs=logprobs)])
    pieces = [f["choices"][0] for f in out[1:]]
    assert [p.get("logprobs") for p in pieces] == [None, None, logprobs]
    assert [p["delta"] for p in pieces][-1] == {"content": "b"}


def test_unknown_payloads_pass_through():
    other = {"something": "else"}
    assert run([other]) == [other]


ERROR = {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}


def test_an_error_mid_stream_ends_the_open_choices_instead():
    """P1.16: no error-only frame; each choice still open gets its boundary if due
    and an end frame with the spec's ``server_interrupted``; one that never
    started gets its first frame too."""
    out = run([FIRST, chunk({"reasoning": "Hm"}), ERROR], choices=2)
    assert deltas(out)[1:] == [
        ({"reasoning": "Hm", "reasoning_content": "Hm"}, None),
        (BOUNDARY, None),
        ({}, INTERRUPTED),
        ({"role": "assistant", "content": ""}, None),
        ({}, INTERRUPTED),
    ]
    assert [f["choices"][0]["index"] for f in out[2:]] == [0, 0, 1, 1]
    for frame in out:
        assert {k: frame[k] for k in ENVELOPE} == ENVELOPE


def test_an_error_before_any_frame_is_still_a_stream_of_frames():
    rewrite = StreamRewrite(Asked(model="k3", response_id="chatcmpl-abc"))
    out = rewrite.chunk(ERROR)
    assert [f["choices"][0]["delta"] for f in out] == [
        {"role": "assistant", "content": ""},
        {},
    ]
    assert {f["id"] for f in out} == {"chatcmpl-abc"}
    assert {f["model"] for f in out} == {"k3"}


def test_the_request_asks_vllm_for_the_usage_summary():
    body = {"model": "k3", "messages": [], "stream": True}
    upstream, asked = rewrite_request(body)
    # Continuous usage off: vLLM reads it only with the summary the client did not
    # ask for.
    assert not asked.usage
    assert upstream["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": False,
    }
    upstream, asked = rewrite_request(
        {**body, "stream_options": {"continuous_usage_stats": True}}
    )
    assert upstream["stream_options"]["continuous_usage_stats"] is False
    assert not asked.continuous_usage
    not_options = {**body, "stream_options": "yes"}
    upstream, asked = rewrite_request(not_options)  # vLLM's 400, as without
    assert upstream["stream_options"] == "yes" and not asked.usage
    upstream, asked = rewrite_request(
        {
            **body,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        }
    )
    assert asked.usage and upstream["stream_options"]["continuous_usage_stats"] is False
    upstream, asked = rewrite_request({"model": "k3", "messages": []})
    assert "stream_options" not in upstream and not asked.usage  # not streamed


def test_several_choices_or_internal_content_ask_vllm_for_more():
    """P0.16: per-choice counts come only on vLLM's continuous usage frames; P0.5:
    token ids only with ``return_token_ids``."""
    body = {"model": "k3", "messages": [], "stream": True, "n": 2}
    upstream, asked = rewrite_request(body)
    assert upstream["stream_options"]["continuous_usage_stats"] is True
    assert asked.choices == 2 and not asked.continuous_usage
    options = {"include_usage": True, "continuous_usage_stats": True,
               "include_internal_content": True}  # fmt: skip
    upstream, asked = rewrite_request({**body, "n": 1, "stream_options": options})
    assert asked.continuous_usage and asked.internal_content and not asked.token_ids
    assert upstream["return_token_ids"] is True


def test_the_response_id_is_24_hex_digits_unless_the_client_named_one():
    """vLLM answers ``chatcmpl-`` and the request's ``request_id`` (P2.1)."""
    upstream, _ = rewrite_request({"model": "k3", "messages": []})
    assert re.fullmatch(r"[0-9a-f]{24}", upstream["request_id"])
    upstream, _ = rewrite_request({"model": "k3", "messages": [], "request_id": "x"})
    assert upstream["request_id"] == "x"


def test_a_calls_first_chunk_names_it_and_its_arguments_follow():
    """P0.13 and P2.2: the first chunk of a call carries ``arguments: ""`` and the
    id ``NAME_N`` (``N`` from ``functions.NAME:N``, or the conversation's count);
    its arguments, and several calls in one delta, go out one piece a frame."""
    calls = [
        {"index": 0, "id": "functions.get_weather:3", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city"'}},
        {"index": 1, "id": "chatcmpl-tool-ab12", "type": "function",
         "function": {"name": "f", "arguments": ""}},
    ]  # fmt: skip
    more = [{"index": 0, "function": {"arguments": ': "Paris"}'}}]
    out = run([chunk({"tool_calls": calls}), chunk({"tool_calls": more})], history=3)
    assert [f["choices"][0]["delta"]["tool_calls"] for f in out] == [
        [{"index": 0, "id": "get_weather_3", "type": "function",
          "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"city"'}}],
        [{"index": 1, "id": "f_4", "type": "function",
          "function": {"name": "f", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": ': "Paris"}'}}],
    ]  # fmt: skip


def test_a_whole_reply_gets_the_specs_call_ids():
    body = {"choices": [{"message": {"tool_calls": [
        {"id": "functions.get_weather:1", "function": {"name": "get_weather"}},
        {"id": "chatcmpl-tool-x", "function": {"name": "f"}},
    ]}}]}  # fmt: skip
    calls = rewrite_body(body, history=1)["choices"][0]["message"]["tool_calls"]
    assert [call["id"] for call in calls] == ["get_weather_1", "f_2"]


def test_a_whole_reply_gets_reasoning_content():
    body = {
        "choices": [
            {"message": {"role": "assistant", "reasoning": "r", "content": "c"}}
        ]
    }
    assert rewrite_body(body)["choices"][0]["message"]["reasoning_content"] == "r"


# -- the ASGI middleware --------------------------------------------------------------


def sse(frames):
    body = b"".join(
        # As vLLM writes them: compact, UTF-8 unescaped.
        b"data: "
        + json.dumps(f, separators=(",", ":"), ensure_ascii=False).encode()
        + b"\n\n"
        for f in frames
    )
    return body + b"data: [DONE]\n\n"


def serve(app, path, request, cut=None):
    """The middleware around ``app``; the response body as sent, and its start."""
    sent = []
    body = json.dumps(request).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path,
             "headers": [(b"content-type", b"application/json")]}  # fmt: skip
    asyncio.run(MoonshotWireSpec(app)(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    data = b"".join(
        m.get("body", b"") for m in sent if m["type"] == "http.response.body"
    )
    return start, data


def streaming_app(frames, cut):
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen["request"] = json.loads(message["body"])
        events_type = (b"content-type", b"text/event-stream; charset=utf-8")
        await send(
            {"type": "http.response.start", "status": 200, "headers": [events_type]}
        )
        data = sse(frames)
        if cut is None:  # one event a message, as vLLM sends them
            pieces = [event + b"\n\n" for event in data.split(b"\n\n") if event]
        else:
            pieces = [data[i : i + cut] for i in range(0, len(data), cut)]
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app, seen


FRAMES = [
    FIRST,
    chunk({"reasoning": "Plan é 🌍."}),
    chunk({"reasoning": "More.", "content": "Answer"}),
    chunk({"content": "."}, "stop"),
    summary(),
]


def events(data):
    return [
        json.loads(e[len(b"data: ") :]) if e != b"data: [DONE]" else "[DONE]"
        for e in data.split(b"\n\n")
        if e
    ]


@pytest.mark.parametrize("cut", [1, 3, 7, 64, 100_000])
def test_the_middleware_rewrites_the_stream_however_it_is_cut(cut):
    app, seen = streaming_app(FRAMES, cut)
    _, data = serve(app, "/v1/chat/completions", {"model": "k3", "stream": True})
    assert seen["request"]["stream_options"]["include_usage"] is True
    got = events(data)
    assert got[-1] == "[DONE]"
    assert got[:-1] == run(FRAMES)


PLAIN_PIECES = [
    FIRST,
    chunk({"reasoning": "Plan"}, token_ids=None),
    chunk({"reasoning": " é 🌍"}, token_ids=None),
    chunk({"reasoning": ' "quoted"'}, token_ids=None),
    chunk({"reasoning": "line\n"}, token_ids=None),
    chunk({"reasoning": "\u0001"}, token_ids=None),
    chunk({"reasoning": " more"}, token_ids=None),
    chunk({"content": "Answer"}, token_ids=None),
    chunk({"content": " 是"}, token_ids=None),
    chunk({"content": "back\\slash"}, token_ids=None),
    chunk({"content": " done"}, token_ids=None),
    chunk({"content": "."}, "stop"),
    summary(),
]


@pytest.fixture
def matched(monkeypatch):
    """Whether each call of ``StreamRewrite.framed`` matched its event."""
    calls = []
    framed = StreamRewrite.framed

    def counting(self, event):
        out = framed(self, event)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(StreamRewrite, "framed", counting)
    return calls


def test_most_events_are_matched_as_bytes_and_rewritten_alike(matched):
    """One event a message, as vLLM sends them: the events that differ from one
    already read only in a plain text go through ``framed`` (compared as bytes),
    the rest are read; the stream is what the parsed path gives."""
    app, _ = streaming_app(PLAIN_PIECES, None)
    _, data = serve(app, "/v1/chat/completions", {"model": "k3", "stream": True})
    assert events(data)[:-1] == run(PLAIN_PIECES)
    # Matched: " é 🌍", " more" and " 是", " done". The first of each kind is read
    # (and learnt from), as are texts with quotes, escapes and control characters,
    # the first content (the boundary goes before it) and the end frame.
    assert matched.count(True) == 4


def test_the_middleware_rewrites_a_whole_reply_and_its_length():
    reply = {"choices": [{"message": {"reasoning": "r", "content": "c"}}]}

    async def app(scope, receive, send):
        await receive()
        body = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})

    start, data = serve(app, "/v1/chat/completions", {"model": "k3"})
    assert json.loads(data)["choices"][0]["message"]["reasoning_content"] == "r"
    assert dict(start["headers"])[b"content-length"] == str(len(data)).encode()


@pytest.mark.parametrize(
    ("path", "status"), [("/v1/completions", 200), ("/v1/chat/completions", 400)]
)
def test_other_paths_and_errors_pass_through(path, status):
    error = b'{"error":{"message":"bad","type":"BadRequestError","code":400}}'

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": error})

    start, data = serve(app, path, {"model": "k3", "stream": True})
    assert start["status"] == status and data == error


def test_the_last_steps_tokens_go_out_before_the_end_frame():
    """vLLM's finishing chunk may show nothing and still carry the step's tokens."""
    logprobs = {"content": [{"token": "<|end|>", "logprob": -0.5}]}
    out = run(
        [FIRST, chunk({}, "stop", logprobs=logprobs, token_ids=[2]), summary()],
        token_ids=True,
    )
    assert [f["choices"][0] for f in out[1:]] == [
        {"index": 0, "delta": {}, "logprobs": logprobs, "finish_reason": None,
         "token_ids": [2]},
        {"index": 0, "delta": {}, "finish_reason": "stop", "usage": USAGE},
    ]  # fmt: skip


def test_the_boundary_goes_before_the_first_call():
    """Reasoning, then a call: thinking ended where the call began, so the boundary
    goes before the call's first frame (KVV's continuous reasoning usage check)."""
    call = [{"index": 0, "id": "functions.f:0", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]  # fmt: skip
    out = run([FIRST, chunk({"reasoning": "Need data."}), chunk({"tool_calls": call}),
               chunk({}, "tool_calls"), summary()])  # fmt: skip
    kinds = [next(iter(d), "end") for d, _ in deltas(out)[1:]]
    assert kinds == ["reasoning", "reasoning_content", "tool_calls", "tool_calls",
                     "end"]  # fmt: skip
    assert deltas(out)[2][0] == BOUNDARY


def test_thinking_resumed_between_calls_follows_the_boundary():
    """Reasoning, a call, more reasoning, then text: the boundary goes where the
    thinking first ended, before the call; the resumed thinking goes on as
    reasoning after it, as a think block after the reply's text does."""
    call = [{"index": 0, "id": "functions.f:0", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]  # fmt: skip
    out = run(
        [
            FIRST,
            chunk({"reasoning": "Need data."}),
            chunk({"tool_calls": call}),
            chunk({"reasoning": " Resumed."}),
            chunk({"content": "Final."}),
            chunk({}, "stop"),
            summary(),
        ]
    )
    kinds = [next(iter(d), "end") for d, _ in deltas(out)[1:]]
    assert kinds == ["reasoning", "reasoning_content", "tool_calls", "tool_calls",
                     "reasoning", "content", "end"]  # fmt: skip
    assert deltas(out)[2][0] == BOUNDARY
    assert deltas(out)[5][0]["reasoning_content"] == " Resumed."


def test_an_error_frame_after_the_end_flushes_what_was_held():
    out = run([FIRST, chunk({"content": "Hi"}, "stop"), ERROR])
    assert deltas(out)[1:] == [({"content": "Hi"}, None), ({}, "stop")]


def test_a_request_the_client_left_is_not_served():
    called = []

    async def app(scope, receive, send):
        called.append(scope)

    parts = iter(
        [
            {"type": "http.request", "body": b'{"stream":', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive():
        return next(parts)

    async def send(message):
        raise AssertionError("nothing to send")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": []}  # fmt: skip
    asyncio.run(MoonshotWireSpec(app)(scope, receive, send))
    assert not called


def test_a_lone_surrogate_in_the_request_stays_escaped():
    app, seen = streaming_app(FRAMES, 64)
    request = {"model": "k3", "stream": True,
               "messages": [{"role": "user", "content": "a\ud83d"}]}  # fmt: skip
    _, data = serve(app, "/v1/chat/completions", request)
    assert seen["request"]["messages"][0]["content"] == "a\ud83d"
    assert events(data)[-1] == "[DONE]"


@pytest.mark.parametrize("cut", [1, 3, 7, 9, 11, 100_000])
def test_crlf_framed_events_are_read_as_events_however_they_are_cut(cut):
    frames = [FIRST, chunk({"reasoning": "r"}), chunk({"content": "c"}, "stop")]

    async def app(scope, receive, send):
        await receive()
        events_type = (b"content-type", b"text/event-stream")
        await send(
            {"type": "http.response.start", "status": 200, "headers": [events_type]}
        )
        body = sse(frames).replace(b"\n", b"\r\n")
        for at in range(0, len(body), cut):
            piece = body[at : at + cut]
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    _, data = serve(app, "/v1/chat/completions", {"model": "k3", "stream": True})
    assert b"\r" not in data
    assert events(data)[:-1] == run(frames)


def test_a_continuation_whose_id_is_null_goes_on_unchanged():
    """vLLM's shared tool-delta helper writes continuations with ``"id": null``."""
    more = chunk({"tool_calls": [{"index": 0, "id": None,
                                  "function": {"arguments": "{}"}}]})  # fmt: skip
    assert StreamRewrite().chunk(more) is None


def test_tool_calls_that_are_not_a_list_go_on_as_they_came():
    for odd in ({"index": 0}, "x"):
        out = run([FIRST, chunk({"tool_calls": odd})])
        assert out[1]["choices"][0]["delta"] == {"tool_calls": odd}


def test_messages_that_are_not_a_list_count_no_calls():
    from vllm_k3_plugin.wire.request import history_calls

    assert history_calls({"messages": 5}) == 0
    assert history_calls({"messages": [{"role": "assistant",
                                        "tool_calls": [{}, {}]}]}) == 2  # fmt: skip


_TEXT = st.text(
    st.characters(codec="utf-8", exclude_categories=()) | st.sampled_from('"\\\n\t/'),
    max_size=6,
)
_DELTAS = st.one_of(
    st.fixed_dictionaries({"reasoning": _TEXT}),
    st.fixed_dictionaries({"content": _TEXT}),
    st.fixed_dictionaries({"content": st.none()}),
    st.fixed_dictionaries({"reasoning": _TEXT, "content": _TEXT}),
    st.just({}),
)
_CHUNKS = st.builds(
    lambda delta, index, finish, extra: {
        **ENVELOPE,
        "choices": [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            | extra
        ],
    },
    _DELTAS,
    st.integers(0, 1),
    st.sampled_from([None, None, None, "stop"]),
    st.sampled_from([{}, {"token_ids": None}, {"token_ids": [5]}]),
)


_COUNTS = st.integers(0, 99)
_USAGES = st.builds(
    lambda prompt, completion, details: {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        **details,
    },
    _COUNTS,
    _COUNTS,
    st.sampled_from([
        {},
        {"completion_tokens_details": None},
        {"completion_tokens_details": {"reasoning_tokens": 3}},
        {"prompt_tokens_details": {"cached_tokens": 2}},
    ]),
)  # fmt: skip
_CHUNKS_WITH_USAGE = st.builds(
    lambda chunk, usage, after: {**chunk, "usage": usage, **after},
    _CHUNKS,
    _USAGES,
    # What vLLM 0.33 writes after the usage.
    st.sampled_from([{}, {"kv_transfer_params": None}]),
)


def _same_as_parsed(chunks, ascii_only, asked, facts):
    unparsed = StreamRewrite(asked, EngineFacts(**facts))
    parsed = StreamRewrite(asked, EngineFacts(**facts))
    for payload in chunks:
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=ascii_only)
        event = b"data: " + data.encode() + b"\n\n"
        framed = unparsed.framed(event)
        fast = unparsed.raw(data.encode()) if framed is None else framed[6:-2]
        if fast is None:
            got = unparsed.chunk(json.loads(data))
            got = [json.loads(data)] if got is None else got
        else:
            got = [json.loads(fast)]
        sent = parsed.chunk(json.loads(data))
        assert got == ([json.loads(data)] if sent is None else sent)
        assert unparsed._choices == parsed._choices
    assert unparsed.done() == parsed.done()


@given(st.lists(_CHUNKS, max_size=8), st.booleans())
def test_the_unparsed_path_sends_what_the_parsed_path_sends(chunks, ascii_only):
    """``StreamRewrite.framed`` on vLLM's events, else ``raw`` on their compact
    bytes, gives what ``chunk`` gives on the parsed payload, chunk by chunk, and
    leaves the same state behind."""
    _same_as_parsed(chunks, ascii_only, Asked(), {})


@given(
    st.lists(_CHUNKS_WITH_USAGE, max_size=8),
    st.booleans(),
    st.sampled_from([{}, {"prompt_tokens": 5, "cached_tokens": 4}]),
)
def test_the_unparsed_path_sends_what_the_parsed_path_sends_with_usage(
    chunks, ascii_only, facts
):
    """The same with the continuous usage a client asked for on every chunk, the
    prompt's cached tokens known or not."""
    asked = Asked(usage=True, continuous_usage=True)
    _same_as_parsed(chunks, ascii_only, asked, facts)


@pytest.mark.parametrize(
    "data",
    [
        b'{"id":"a","choices":[{"index":0,"delta":{"content":"x"}}],"choices":null}',
        b'{"id":"a","choices":[{"index":0,"delta":{"content":"x"},"delta":null}]}',
        b'{"id":"a","choices":[{"index":01,"delta":{"content":"x"}}]}',
        b'{"id":"a","choices":[{"index":0,"delta":{"content":"x\ny"}}]}',
        b'{"id":"a","choices":[{"index":0,"delta":{"content":"\\x"}}]}',
        b'{"id":"a","choices":[{"index":0,"delta":{"content":""}}]}',
        b'{"id":"a","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"stop"}]}',
        b'{"id": "a","choices":[{"index":0,"delta":{"content":"x"}}]}',
    ],
)
def test_what_is_not_written_as_vllm_writes_a_piece_is_parsed(data):
    assert StreamRewrite().raw(data) is None


def continuous(index, completion, reasoning, delta=None, finish=None, **choice):
    frame = chunk(delta if delta is not None else {}, finish, **choice)
    frame["choices"][0]["index"] = index
    frame["usage"] = {
        "prompt_tokens": 5,
        "completion_tokens": completion,
        "total_tokens": 5 + completion,
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }
    return frame


def test_each_of_several_choices_ends_with_its_own_usage():
    """P0.16: each end frame carries its choice's counts (vLLM's continuous usage,
    asked for and not passed on: the client did not ask for it, P1.15) and the
    prompt's details from the summary."""
    frames = [
        continuous(0, 0, 0, {"role": "assistant", "content": ""}),
        continuous(1, 0, 0, {"role": "assistant", "content": ""}),
        continuous(0, 1, 0, {"content": "A"}),
        continuous(1, 1, 0, {"content": "B"}),
        continuous(1, 2, 0, {"content": "b"}, "stop"),
        continuous(0, 3, 0, {"content": "a"}, "length"),
        {**ENVELOPE, "choices": [], "usage": {**USAGE, "completion_tokens": 5}},
    ]
    out = run(frames, wants_usage=True, choices=2)
    assert all("usage" not in f for f in out if f["choices"])
    ends = {f["choices"][0]["index"]: f["choices"][0] for f in out
            if f["choices"] and f["choices"][0]["finish_reason"]}  # fmt: skip
    for index, completion in ((0, 3), (1, 2)):
        assert ends[index]["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": completion,
            "total_tokens": 5 + completion,
            "completion_tokens_details": {"reasoning_tokens": 0},
            "prompt_tokens_details": {"cached_tokens": 0},
        }
    assert out[-1]["choices"] == []


def test_continuous_usage_asked_for_rides_on_every_frame_with_the_cached_count():
    """The Vendor Verifier's continuous reasoning usage check: every frame with a
    choice has a top-level usage with ``prompt_tokens_details.cached_tokens`` (the
    engine's first output told it), the boundary frame included, and the end
    frame's own usage agrees with it."""
    frames = [
        continuous(0, 0, 0, {"role": "assistant", "content": ""}),
        continuous(0, 1, 1, {"reasoning": "Hm"}),
        continuous(0, 2, 1, {"content": "Ok"}, "stop"),
        {**ENVELOPE, "choices": [], "usage": {**USAGE, "completion_tokens": 2,
                                              "total_tokens": 7}},
    ]  # fmt: skip
    facts = EngineFacts(prompt_tokens=5, cached_tokens=3)
    out = run(frames, wants_usage=True, facts=facts, continuous_usage=True)
    with_choices = [f for f in out if f["choices"]]
    assert [next(iter(f["choices"][0]["delta"])) if f["choices"][0]["delta"] else "end"
            for f in with_choices] == [
        "role", "reasoning", "reasoning_content", "content", "end"]  # fmt: skip
    for frame in with_choices:
        assert frame["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    end = with_choices[-1]
    assert (
        end["usage"]["completion_tokens_details"]
        == end["choices"][0]["usage"]["completion_tokens_details"]
    )


def _with_usage(frame, completion, reasoning):
    """``frame`` with continuous usage as vLLM 0.33 writes it (its field order,
    and the null after the usage)."""
    return {
        **frame,
        "usage": {
            "prompt_tokens": 5,
            "total_tokens": 5 + completion,
            "completion_tokens": completion,
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        },
        "kv_transfer_params": None,
    }


USAGE_PIECES = [
    _with_usage(FIRST, 0, 0),
    _with_usage(chunk({"reasoning": "Plan"}, token_ids=None), 1, 1),
    _with_usage(chunk({"reasoning": " é 🌍"}, token_ids=None), 2, 2),
    _with_usage(chunk({"reasoning": ' "q"'}, token_ids=None), 3, 3),
    _with_usage(chunk({"reasoning": " more"}, token_ids=None), 4, 4),
    _with_usage(chunk({"content": "Ok"}, token_ids=None), 5, 4),
    _with_usage(chunk({"content": " 是"}, token_ids=None), 6, 4),
    _with_usage(chunk({"content": "."}, "stop"), 7, 4),
    {**ENVELOPE, "choices": [], "usage": {**USAGE, "completion_tokens": 7,
                                          "total_tokens": 12}},
]  # fmt: skip


def test_continuous_usage_events_are_matched_as_bytes_too(matched):
    """A client that asked for continuous usage: the events that differ from one
    already read only in a plain text and the counts go through ``framed``, with
    the cached tokens added to their usage; the stream is the parsed path's."""
    frames_app, _ = streaming_app(USAGE_PIECES, None)

    async def app(scope, receive, send):
        engine_facts.record(5, 3)  # what the serving hook does
        await frames_app(scope, receive, send)

    options = {"include_usage": True, "continuous_usage_stats": True}
    request = {"model": "k3", "stream": True, "stream_options": options}
    _, data = serve(app, "/v1/chat/completions", request)
    facts = EngineFacts(prompt_tokens=5, cached_tokens=3)
    expected = run(USAGE_PIECES, wants_usage=True, facts=facts, continuous_usage=True)
    assert events(data)[:-1] == expected
    for frame in expected[1:-1]:
        assert frame["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}
    # Matched: " é 🌍", " more" and " 是"; read: the first of each kind, the quoted
    # text, the first content (the boundary goes before it) and the end frame.
    assert matched.count(True) == 3


def test_internal_content_carries_the_token_ids_of_what_each_piece_shows():
    """P0.5: the ids vLLM returned per step move into ``delta.internal_content``; a
    step that showed nothing lends its ids to the next piece; a step split into
    several pieces spreads its ids over them, none going without; vLLM's own id
    fields go unless the client asked for them."""
    first = {**FIRST, "prompt_token_ids": [1, 2]}
    frames = [
        first,
        chunk({}, token_ids=[10]),
        chunk({"content": "Hi"}, token_ids=[11]),
        chunk({"reasoning": "r", "content": "!"}, token_ids=[12, 13, 14]),
        chunk({"reasoning": "s", "content": "?"}, "stop", token_ids=[15]),
    ]
    out = run(frames, internal_content=True)
    assert "prompt_token_ids" not in out[0]
    shown = [f["choices"][0] for f in out[1:]]
    assert [c["delta"].get("internal_content") for c in shown] == [
        {"token_ids": [10, 11]},
        {"token_ids": [12]},
        None,  # the boundary shows nothing
        {"token_ids": [13, 14]},
        {"token_ids": [15]},
        {"token_ids": [15]},  # one token, two pieces
        None,  # the end frame
    ]
    assert all("token_ids" not in c for c in shown)


def test_request_flags_are_read_as_vllm_reads_them():
    """vLLM's pydantic models read ``"true"``, ``1``, ``2.0`` and ``"2"``; a null
    ``stream_options`` is no options."""
    options = {"include_usage": "false", "include_internal_content": 1}
    body = {"model": "k3", "messages": [], "stream": "true", "n": "2",
            "stream_options": options}  # fmt: skip
    upstream, asked = rewrite_request(body)
    assert asked.choices == 2 and not asked.usage and asked.internal_content
    assert upstream["stream_options"]["include_usage"] is True
    _, asked = rewrite_request({**body, "n": 2.0, "stream_options": None})
    assert asked.choices == 2
    upstream, _ = rewrite_request({**body, "stream": "false"})
    assert (
        "stream_options" not in upstream
        or upstream["stream_options"] == (body["stream_options"])
    )


def test_invalid_utf8_is_left_to_the_parsed_path():
    rewrite = StreamRewrite()
    rewrite.chunk(json.loads(json.dumps(FIRST)))
    data = b'{"id":"a","choices":[{"index":0,"delta":{"reasoning":"\xff"}}]}'
    assert rewrite.raw(data) is None


def test_a_streams_usage_headers_come_from_the_engines_first_output():
    """P0.18: the response start is held until the first frame, by when vLLM has
    read the engine's first output (the serving hook records it, ``facts.py``)."""
    frames_app, _ = streaming_app(FRAMES, 100_000)

    async def app(scope, receive, send):
        engine_facts.record(12, 4)  # what the serving hook does
        await frames_app(scope, receive, send)

    start, _ = serve(app, "/v1/chat/completions", {"model": "k3", "stream": True})
    headers = dict(start["headers"])
    assert headers[PROMPT_TOKENS_HEADER] == b"12"
    assert headers[CACHED_TOKENS_HEADER] == b"4"
    # Without the hook nothing is known: no headers rather than wrong ones.
    start, _ = serve(
        frames_app, "/v1/chat/completions", {"model": "k3", "stream": True}
    )
    assert PROMPT_TOKENS_HEADER not in dict(start["headers"])
    assert engine_facts.CURRENT.get() is None  # the request's facts went with it


def test_a_whole_replys_usage_headers_come_from_its_usage():
    usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    reply = {"choices": [], "usage": usage}

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": json.dumps(reply).encode()})

    start, _ = serve(app, "/v1/chat/completions", {"model": "k3"})
    headers = dict(start["headers"])
    assert (headers[PROMPT_TOKENS_HEADER], headers[CACHED_TOKENS_HEADER]) == (
        b"9",
        b"8",
    )
