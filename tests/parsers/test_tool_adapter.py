"""The ``kimi_k3`` tool parser in-process, driven as vLLM's serving layer drives it.

Outputs are encoded with the checkpoint's real tokenizer; ``parse`` (whole) and
``parse_delta`` (one call per token) must give the same calls, ids included.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager

import vllm_k3_plugin
from tests.support.expected_tools import (
    NO_CALL_SHAPES,
    TOOL_SHAPES,
    WEATHER,
    history_with_calls,
)
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_tools
from vllm_k3_plugin.parsers.tool_parser import K3ToolParser
from vllm_k3_plugin.tools import compare
from vllm_k3_plugin.tools.shapes import SHAPES, TOOLS, output_ids

WEATHER_CALL_ARGS = ("get_weather", {"city": "Paris"})


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_k3_plugin.register()


def _request(**fields) -> ChatCompletionRequest:
    fields.setdefault("tools", TOOLS)
    return ChatCompletionRequest(
        model="k3-tiny",
        messages=fields.pop("messages", [{"role": "user", "content": "hi"}]),
        **fields,
    )


def _ids(hf_tokenizer, text: str, *, stop: bool = True) -> list[int]:
    return output_ids(text, stop=stop)


def _both(hf_tokenizer, ids, request, thinking=True):
    cls = compare.our_parser_cls("kimi_k3")
    whole = compare.parse_whole(cls, hf_tokenizer, ids, request, thinking=thinking)
    streamed = compare.parse_streamed(
        cls, hf_tokenizer, ids, request, thinking=thinking
    )
    return whole, streamed


def test_registry_resolves_kimi_k3_to_our_tool_parser():
    assert ToolParserManager.get_tool_parser("kimi_k3") is K3ToolParser
    assert compare.our_parser_cls("kimi_k3").tool_parser_cls is K3ToolParser


@pytest.mark.parametrize("shape", sorted(TOOL_SHAPES))
def test_tools_channel_anywhere(hf_tokenizer, shape):
    output, thinking, _ = SHAPES[shape]
    whole, streamed = _both(
        hf_tokenizer, _ids(hf_tokenizer, output), _request(), thinking
    )
    reasoning, content, calls = TOOL_SHAPES[shape]
    assert (whole.reasoning, whole.content, whole.tool_calls) == (
        reasoning,
        content,
        calls,
    )
    assert streamed == whole


@pytest.mark.parametrize("shape", sorted(NO_CALL_SHAPES))
def test_an_opener_that_opens_nothing_keeps_its_text(hf_tokenizer, shape):
    output, thinking, _ = SHAPES[shape]
    whole, streamed = _both(
        hf_tokenizer, _ids(hf_tokenizer, output), _request(), thinking
    )
    assert (whole.reasoning, whole.content, whole.tool_calls) == (
        *NO_CALL_SHAPES[shape],
        (),
    )
    assert streamed == whole


def test_ids_are_unique_and_the_same_streamed_and_not(hf_tokenizer):
    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    whole, streamed = _both(hf_tokenizer, ids, _request())
    assert whole.tool_call_ids == (
        "functions.get_weather:0",
        "functions.write_file:1",
        "functions.get_weather:2",
    )
    assert streamed.tool_call_ids == whole.tool_call_ids


def test_ids_continue_after_the_calls_in_the_history(hf_tokenizer):
    history = history_with_calls(2)
    ids = _ids(hf_tokenizer, SHAPES["tools-in-think"].output)
    whole, streamed = _both(hf_tokenizer, ids, _request(messages=history))
    assert whole.tool_call_ids == streamed.tool_call_ids == ("functions.get_weather:2",)


@pytest.mark.parametrize("history_in_messages", [False, True])
def test_ids_continue_the_count_the_server_gives(hf_tokenizer, history_in_messages):
    """vLLM 0.33's scale-out generate server parses a request without messages and
    says the conversation's earlier calls through ``set_history_tool_call_count``,
    called after the parser is built, before it parses; the count it gives wins
    over the request's own history."""
    base = compare.our_parser_cls("kimi_k3")

    class SeededByTheServer(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.set_history_tool_call_count(5)

    messages = history_with_calls(2) if history_in_messages else []
    request = ChatCompletionRequest.model_construct(
        messages=messages, tools=_request().tools, tool_choice="auto"
    )
    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    whole = compare.parse_whole(SeededByTheServer, hf_tokenizer, ids, request)
    streamed = compare.parse_streamed(SeededByTheServer, hf_tokenizer, ids, request)
    assert whole.tool_call_ids == streamed.tool_call_ids
    assert whole.tool_call_ids == (
        "functions.get_weather:5",
        "functions.write_file:6",
        "functions.get_weather:7",
    )


def test_tool_choice_none_gives_no_calls_and_no_markup(hf_tokenizer):
    ids = _ids(hf_tokenizer, SHAPES["reply-then-calls"].output)
    whole, streamed = _both(hf_tokenizer, ids, _request(tool_choice="none"))
    assert whole == streamed
    assert whole.tool_calls == ()
    assert (whole.reasoning, whole.content) == ("Two lookups and a file.", "On it.")


def test_tool_choice_required_parses_the_calls(hf_tokenizer):
    ids = _ids(hf_tokenizer, SHAPES["tools-in-think"].output)
    whole, streamed = _both(hf_tokenizer, ids, _request(tool_choice="required"))
    assert whole.tool_calls == streamed.tool_calls == (WEATHER,)


def test_undeclared_tool_is_returned_and_logged(hf_tokenizer, caplog):
    output = render_tools([("delete_everything", {"really": True})]) + vocab.MESSAGE_END
    ids = _ids(hf_tokenizer, output)
    # vLLM's loggers may not propagate to the root, where caplog listens.
    logger = logging.getLogger("vllm.k3_plugin.tool_parser")
    with caplog.at_level(logging.WARNING):
        if not logger.propagate:
            logger.addHandler(caplog.handler)
        try:
            whole, streamed = _both(hf_tokenizer, ids, _request())
        finally:
            logger.removeHandler(caplog.handler)
    assert (
        whole.tool_calls
        == streamed.tool_calls
        == (("delete_everything", '{"really": true}'),)
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # once per request: the whole one and the streamed one
    assert all("'delete_everything'" in w and "not declare" in w for w in warnings)


def test_invalid_json_block_is_returned_verbatim(hf_tokenizer):
    bad = '{"city": Paris'
    output = "x" + render_tools([("get_weather", bad)]) + vocab.MESSAGE_END
    whole, streamed = _both(hf_tokenizer, _ids(hf_tokenizer, output), _request())
    assert whole.tool_calls == streamed.tool_calls == (("get_weather", bad),)


def test_call_cut_by_max_tokens(hf_tokenizer):
    """Rule 9: the cut call is in the reply on both paths, as it streamed: its name
    and its arguments as far as they arrived, never closed into JSON."""
    output = (
        "Checking."
        + render_tools([("get_weather", {"city": "Paris"})])[: -len(vocab.TOOLS_END)]
    )
    cut = output[: output.index("Paris") + 3]
    ids = _ids(hf_tokenizer, cut, stop=False)
    whole, streamed = _both(hf_tokenizer, ids, _request(max_tokens=len(ids)))
    assert whole == streamed
    assert (whole.reasoning, whole.content) == ("Checking.", "")
    assert whole.tool_calls == (("get_weather", '{"city": "Par'),)


@pytest.mark.parametrize("stop", [True, False], ids=["stopped", "cut"])
def test_reply_before_a_cut_call_keeps_its_content(hf_tokenizer, stop):
    output = (
        "T." + vocab.THINK_END + vocab.RESPONSE_START + "Sure." + vocab.RESPONSE_END
    )
    output += vocab.TOOLS_START + '<|open|>call tool="get_weather"<|sep|>'
    whole, streamed = _both(
        hf_tokenizer, _ids(hf_tokenizer, output, stop=stop), _request()
    )
    # A call cut before its first argument streamed nothing and is no call.
    assert whole == streamed
    assert (whole.content, whole.tool_calls) == ("Sure.", ())


def test_no_tool_parser_keeps_the_channel_as_content(hf_tokenizer):
    ids = _ids(hf_tokenizer, SHAPES["tools-in-think"].output)
    cls = compare.our_parser_cls(None)
    request = _request()
    whole = compare.parse_whole(cls, hf_tokenizer, ids, request)
    assert whole.tool_calls == ()
    assert vocab.TOOLS_START in whole.content


PIECES = [
    vocab.TOOLS_START,
    vocab.TOOLS_END,
    vocab.CALL_END,
    vocab.ARGUMENT_END,
    vocab.MESSAGE_END,
    vocab.THINK_END,
    vocab.RESPONSE_START,
    vocab.RESPONSE_END,
    '<|open|>call tool="get_weather"<|sep|>',
    '<|open|>argument key="city" type="string"<|sep|>',
    '<|open|>argument key="n" type="number"<|sep|>',
    "Paris",
    " 12",
    '"',
    "思",
    "\n",
]


@settings(max_examples=60)
@given(st.lists(st.sampled_from(PIECES), max_size=20).map("".join), st.booleans())
def test_parse_equals_parse_delta_on_any_output(hf_tokenizer, output, stop):
    ids = _ids(hf_tokenizer, output, stop=stop)
    if not ids:
        return
    whole, streamed = _both(hf_tokenizer, ids, _request(max_tokens=len(ids) + stop))
    assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
    assert streamed.tool_call_ids[: len(whole.tool_call_ids)] == whole.tool_call_ids
    # Complete calls agree byte for byte; only a call cut off at the end differs.
    assert streamed.tool_calls[: len(whole.tool_calls)] == whole.tool_calls
    assert len(streamed.tool_calls) - len(whole.tool_calls) in (0, 1)
    for text in (whole.content, whole.reasoning):
        assert vocab.TOOLS_START not in text and vocab.CALL_END not in text


def test_bare_tool_parser_reads_content_and_calls(hf_tokenizer):
    request = _request()
    output = "Sure." + vocab.RESPONSE_END + render_tools([WEATHER_CALL_ARGS]) + "\n"
    whole = K3ToolParser(hf_tokenizer, request.tools).extract_tool_calls(
        output, request
    )
    assert whole.tools_called
    assert whole.content == "Sure.\n"
    assert [
        (c.id, c.function.name, c.function.arguments) for c in whole.tool_calls
    ] == [("functions.get_weather:0", "get_weather", '{"city": "Paris"}')]
    parser = K3ToolParser(hf_tokenizer, request.tools)
    content, names, arguments = "", "", ""
    for char in output:
        delta = parser.extract_tool_calls_streaming("", "", char, (), (), (), request)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls:
            names += call.function.name or ""
            arguments += call.function.arguments or ""
    assert (content, names, arguments) == (
        "Sure.\n",
        "get_weather",
        '{"city": "Paris"}',
    )


# -- found in review ----------------------------------------------------------------


def test_bare_tool_parser_sends_a_skipped_channel_once(hf_tokenizer):
    request = _request()
    output = vocab.THINK_START + "Hello." + vocab.RESPONSE_END + vocab.MESSAGE_END
    whole = K3ToolParser(hf_tokenizer, request.tools).extract_tool_calls(
        output, request
    )
    assert whole.content == "Hello."
    parser = K3ToolParser(hf_tokenizer, request.tools)
    streamed = ""
    for char in output:
        delta = parser.extract_tool_calls_streaming("", "", char, (), (), (), request)
        streamed += (delta.content or "") if delta else ""
    assert streamed == "Hello."


def test_whitespace_before_a_cut_call_is_the_same_streamed_and_not(hf_tokenizer):
    output = "  " + vocab.RESPONSE_END + vocab.TOOLS_START
    output += (
        '<|open|>call tool="get_weather"<|sep|><|open|>argument key="city"<|sep|>Pa'
    )
    ids = _ids(hf_tokenizer, output, stop=False)
    whole, streamed = _both(
        hf_tokenizer, ids, _request(max_tokens=len(ids)), thinking=False
    )
    assert streamed.content == whole.content


def test_a_call_written_without_its_tools_channel_is_a_call(hf_tokenizer):
    output = "Sure." + vocab.RESPONSE_END
    output += render_tools([WEATHER_CALL_ARGS])[
        len(vocab.TOOLS_START) : -len(vocab.TOOLS_END)
    ]
    output += vocab.MESSAGE_END
    whole, streamed = _both(
        hf_tokenizer, _ids(hf_tokenizer, output), _request(), thinking=False
    )
    assert (whole.content, whole.tool_calls) == ("Sure.", (WEATHER,))
    assert streamed == whole


def test_a_declared_tool_name_with_spaces_is_a_call_and_an_undeclared_one_prose(
    hf_tokenizer,
):
    spaced = {
        "type": "function",
        "function": {
            "name": "look up",
            "parameters": {
                "type": "object",
                "properties": {"the city": {"type": "string"}},
            },
        },
    }
    output = vocab.RESPONSE_END + render_tools([("look up", {"the city": "Paris"})])
    ids = _ids(hf_tokenizer, output)
    whole, streamed = _both(hf_tokenizer, ids, _request(tools=[*TOOLS, spaced]))
    assert whole.tool_calls == (("look up", '{"the city": "Paris"}'),)
    assert streamed == whole
    # Not declared, the name is no tool name: the opener is dropped, its text kept.
    whole, streamed = _both(hf_tokenizer, ids, _request())
    assert whole.tool_calls == ()
    assert whole.content.startswith('call tool="look up"')
    assert streamed == whole
