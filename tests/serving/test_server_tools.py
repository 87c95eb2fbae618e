"""Tool calls through a real ``vllm serve``: every endpoint, and the next turn.

The model is forced to write each tool shape; all six readings must return the same
calls (names, arguments, ids) and say that tools were called.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.support.endpoints import ENDPOINTS, MODEL, PROMPT, chat, chat_stream
from tests.support.expected_tools import TOOL_SHAPES as EXPECTED
from tests.support.expected_tools import WEATHER as WEATHER_TEXT
from tests.support.expected_tools import (
    assert_results_rendered_in_call_order,
    parsed,
)
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_call, render_tools
from vllm_k3_plugin.parsers.raw_arguments import RAW_ARGUMENTS_KEY
from vllm_k3_plugin.tools.shapes import (
    FILE_ARGUMENTS,
    RAW_ARGUMENTS,
    SHAPES,
    TOOLS,
    output_ids,
)

pytestmark = pytest.mark.server

TOOL_SHAPES = {
    shape: (reasoning, content, parsed(calls))
    for shape, (reasoning, content, calls) in EXPECTED.items()
}
MULTI = TOOL_SHAPES["reply-then-calls"][2]
WEATHER = parsed([WEATHER_TEXT])[0]
TOOLS_CALLED = {"chat": "tool_calls", "responses": "completed", "messages": "tool_use"}


def _ids(hf_tokenizer, output: str) -> list[int]:
    return output_ids(output, stop=True)


def _expected_ids(calls) -> tuple[str, ...]:
    return tuple(f"functions.{name}:{n}" for n, (name, _) in enumerate(calls))


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
@pytest.mark.parametrize("shape", sorted(TOOL_SHAPES))
def test_calls_on_every_endpoint(k3_server, hf_tokenizer, shape, endpoint):
    output, thinking, _ = SHAPES[shape]
    ids = _ids(hf_tokenizer, output)
    reply = ENDPOINTS[endpoint](
        k3_server, ids, max_tokens=len(ids) + 8, thinking=thinking, tools=TOOLS
    )
    reasoning, content, calls = TOOL_SHAPES[shape]
    assert (reply.reasoning, reply.content, reply.tool_calls) == (
        reasoning,
        content,
        calls,
    )
    assert reply.tool_call_ids == _expected_ids(calls)
    assert reply.finish == TOOLS_CALLED[endpoint.removesuffix("-stream")]


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "chat-stream"])
def test_arguments_text_is_byte_identical_streamed_and_not(
    k3_server, hf_tokenizer, read
):
    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    reply = read(k3_server, ids, max_tokens=len(ids) + 8, tools=TOOLS)
    assert reply.raw_arguments == (
        '{"city": "Paris"}',
        json.dumps(FILE_ARGUMENTS, ensure_ascii=False),
        RAW_ARGUMENTS,
    )


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "chat-stream"])
def test_tool_choice_none_returns_no_calls_and_no_markup(k3_server, hf_tokenizer, read):
    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    client_reply = _chat_with(
        k3_server, ids, read is chat_stream, tools=TOOLS, tool_choice="none"
    )
    assert client_reply == ("Two lookups and a file.", "On it.", (), "stop")


@pytest.mark.parametrize("read", [chat, chat_stream], ids=["chat", "chat-stream"])
def test_an_empty_tools_list_reads_as_no_tools(k3_server, hf_tokenizer, read):
    """vLLM 0.34 takes ``tools: []`` as omitted (0.32 and 0.33 answer 400): the
    reply is read exactly as without the field."""
    import vllm

    from vllm_k3_plugin.compat import release

    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    stream = read is chat_stream
    if release(vllm.__version__) < (0, 34):
        with pytest.raises(openai.BadRequestError):
            _chat_with(k3_server, ids, stream, tools=[])
        return
    assert _chat_with(k3_server, ids, stream, tools=[]) == _chat_with(
        k3_server, ids, stream
    )


# What each endpoint reports as the finish of an output that ended inside a call.
CUT_FINISH = {
    "length": {"chat": "length", "responses": "incomplete", "messages": "max_tokens"},
    "stop": {"chat": "stop", "responses": "completed", "messages": "end_turn"},
}


@pytest.mark.parametrize("ended_by", ["length", "stop"])
def test_a_cut_call_is_the_same_streamed_and_whole_on_every_endpoint(
    k3_server, ended_by
):
    """Rule 9: the call as it streamed, arguments verbatim and never closed, on both
    paths of every endpoint; the finish is what ended the output; every Messages
    answer is valid (a call whose arguments are not JSON keeps them as text)."""
    output = "Checking." + render_tools([WEATHER])
    ids = output_ids(output[: output.index("Paris") + 3], stop=ended_by == "stop")
    max_tokens = len(ids) if ended_by == "length" else len(ids) + 8
    for endpoint in ("chat", "responses", "messages"):
        replies = []
        for read in (ENDPOINTS[endpoint], ENDPOINTS[endpoint + "-stream"]):
            reply = read(k3_server, ids, max_tokens=max_tokens, tools=TOOLS)
            (arguments,) = reply.raw_arguments
            if endpoint == "messages" and RAW_ARGUMENTS_KEY in arguments:
                arguments = json.loads(arguments)[RAW_ARGUMENTS_KEY]
            replies.append(
                (
                    reply.reasoning,
                    reply.content,
                    tuple(name for name, _ in reply.tool_calls),
                    arguments,
                    reply.finish,
                )
            )
        whole, streamed = replies
        assert whole == streamed, endpoint
        assert whole == (
            "Checking.",
            "",
            ("get_weather",),
            '{"city": "Par',
            CUT_FINISH[ended_by][endpoint],
        ), endpoint


def _chat_with(url, ids, stream, **fields):
    """(reasoning, content, call names, finish) of one chat request with ``fields``."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    request = {
        "model": MODEL,
        "messages": fields.pop("messages", [{"role": "user", "content": PROMPT}]),
        "temperature": 0,
        "max_tokens": len(ids) + 8,
        "extra_body": {"vllm_xargs": {"k3_force_ids": ids}, **fields.pop("extra", {})},
        **fields,
    }
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        message = choice.message
        names = tuple(c.function.name for c in message.tool_calls or ())
        return (
            getattr(message, "reasoning", None) or "",
            message.content or "",
            names,
            choice.finish_reason,
        )
    reasoning, content, names, finish = "", "", [], ""
    for chunk in client.chat.completions.create(**request, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning", None) or ""
        content += delta.content or ""
        names += [c.function.name for c in delta.tool_calls or () if c.function.name]
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, tuple(names), finish


def test_next_turn_renders_results_matched_to_their_calls(k3_server, hf_tokenizer):
    """The calls and their results go back, results in the opposite order; vLLM's K3
    renderer matches each result to its call by id and renders them in call order."""
    client = openai.OpenAI(base_url=k3_server + "/v1", api_key="none")
    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    first = (
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            tools=TOOLS,
            max_tokens=len(ids) + 8,
            extra_body={"vllm_xargs": {"k3_force_ids": ids}},
        )
        .choices[0]
        .message
    )
    calls = first.tool_calls
    assert [c.id for c in calls] == list(_expected_ids(MULTI))
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": f"result {n}"}
        for n, call in enumerate(calls)
    ]
    history = [
        {"role": "user", "content": PROMPT},
        first.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
        *reversed(results),
    ]
    answer = "Sunny; file written."
    second_ids = _ids(hf_tokenizer, answer + vocab.RESPONSE_END + vocab.MESSAGE_END)
    response = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        max_tokens=len(second_ids) + 8,
        extra_body={
            "vllm_xargs": {"k3_force_ids": second_ids},
            "return_token_ids": True,
        },
    )
    assert response.choices[0].message.content == answer
    prompt = hf_tokenizer.decode(response.prompt_token_ids, skip_special_tokens=False)
    assert_results_rendered_in_call_order(prompt, MULTI)
    # The assistant's calls come back in the K3 format, typed.
    assert render_call(*MULTI[1], 2) in prompt


def test_next_turn_through_anthropic_messages(k3_server, hf_tokenizer):
    client = anthropic.Anthropic(base_url=k3_server, api_key="none")
    tools = [
        {
            "name": tool["function"]["name"],
            "description": tool["function"]["description"],
            "input_schema": tool["function"]["parameters"],
        }
        for tool in TOOLS
    ]
    ids = _ids(hf_tokenizer, SHAPES["tools-in-think"].output)
    first = client.messages.create(
        model=MODEL,
        max_tokens=len(ids) + 8,
        messages=[{"role": "user", "content": PROMPT}],
        tools=tools,
        extra_body={"vllm_xargs": {"k3_force_ids": ids}},
    )
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert (use.id, use.name, use.input) == ("functions.get_weather:0", *WEATHER)
    answer = "It is sunny in Paris."
    second_ids = _ids(hf_tokenizer, answer + vocab.RESPONSE_END + vocab.MESSAGE_END)
    second = client.messages.create(
        model=MODEL,
        max_tokens=len(second_ids) + 8,
        tools=tools,
        messages=[
            {"role": "user", "content": PROMPT},
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
                ],
            },
        ],
        extra_body={"vllm_xargs": {"k3_force_ids": second_ids}},
    )
    assert [b.text for b in second.content if b.type == "text"] == [answer]
    assert second.stop_reason == "end_turn"
