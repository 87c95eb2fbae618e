"""The vLLM adapter, driven in-process as vLLM's serving layer drives it.

Registration resolves ``kimi_k3`` to our classes; ``parse`` (whole output) and
``parse_delta`` (one call per token, with ``finished`` on the last) return the same
reasoning and content for outputs encoded with the checkpoint's real tokenizer.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
)
from vllm.parser.parser_manager import ParserManager
from vllm.reasoning import ReasoningParserManager

import vllm_k3_plugin
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.reasoning import read_whole
from vllm_k3_plugin.format.vocab import RESPONSE_END
from vllm_k3_plugin.parsers.parser import K3Parser
from vllm_k3_plugin.parsers.reasoning_parser import (
    K3ReasoningParser,
)
from vllm_k3_plugin.parsers.request_state import start_channel
from vllm_k3_plugin.tools import compare

ELEMENTS = [
    vocab.THINK_END,
    vocab.THINK_END_UNSEPARATED,
    vocab.RESPONSE_START,
    vocab.RESPONSE_END,
    vocab.MESSAGE_END,
    vocab.TOOLS_START,
    vocab.TOOLS_END,
    vocab.THINK_START,
    vocab.CLOSE,
    vocab.SEP,
]
WORDS = ["The", " answer", " is", " 4.", "\n", " ", "思", "<", "|", "close"]
OUTPUTS = st.lists(st.sampled_from(ELEMENTS + WORDS), max_size=24).map("".join)


@pytest.fixture(scope="module", autouse=True)
def registered():
    vllm_k3_plugin.register()


def _parser_cls(tool_parser: str | None = "kimi_k3"):
    return compare.our_parser_cls(tool_parser)


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="k3-tiny", messages=[{"role": "user", "content": "hi"}], **fields
    )


_prompt = compare.prompt_ids


def _whole(parser_cls, hf_tokenizer, prompt, ids, request, thinking=True):
    return compare.parse_whole(
        parser_cls, hf_tokenizer, ids, request, thinking=thinking, prompt=prompt
    )


def _streamed(parser_cls, hf_tokenizer, prompt, ids, request, thinking=True):
    """One ``parse_delta`` per token, text from the incremental detokenizer."""
    return compare.parse_streamed(
        parser_cls, hf_tokenizer, ids, request, thinking=thinking, prompt=prompt
    )


def _encode(hf_tokenizer, text: str) -> list[int]:
    return hf_tokenizer.encode(text, add_special_tokens=False)


# -- registration ---------------------------------------------------------------------


def test_reasoning_parser_name_resolves_to_ours():
    assert ReasoningParserManager.get_reasoning_parser("kimi_k3") is K3ReasoningParser


@pytest.mark.parametrize("tool_parser", ["kimi_k3", None], ids=["tools", "no-tools"])
def test_composed_parser_is_ours(tool_parser):
    parser_cls = _parser_cls(tool_parser)
    assert issubclass(parser_cls, K3Parser)
    assert parser_cls.reasoning_parser_cls is K3ReasoningParser


def test_register_is_idempotent():
    compose = ParserManager.__dict__["_compose_parser"].__func__
    vllm_k3_plugin.register()
    from vllm_k3_plugin.registration import register_all

    register_all()
    assert ParserManager.__dict__["_compose_parser"].__func__ is compose
    assert _parser_cls().__bases__ == (K3Parser,)


def test_other_reasoning_parsers_pass_through():
    parser_cls = ParserManager.get_parser(reasoning_parser_name="deepseek_r1")
    assert parser_cls is not None
    assert not issubclass(parser_cls, K3Parser)


def test_parser_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        K3ReasoningParser(None)


# -- parse versus parse_delta ---------------------------------------------------------


@given(OUTPUTS, st.booleans(), st.booleans())
def test_streamed_equals_whole(hf_tokenizer, text, stopped, thinking):
    ids = _encode(hf_tokenizer, text) + ([vocab.END_OF_MSG_ID] if stopped else [])
    if not ids:
        return
    prompt = _prompt(hf_tokenizer, thinking)
    request = _request(max_tokens=len(ids))
    parser_cls = _parser_cls(tool_parser=None)
    whole = _whole(parser_cls, hf_tokenizer, prompt, ids, request, thinking)
    streamed = _streamed(parser_cls, hf_tokenizer, prompt, ids, request, thinking)
    assert streamed[:2] == whole[:2]
    reading = read_whole(
        compare.engine_text(hf_tokenizer, ids),
        start=start_channel(prompt, K3ReasoningParser(hf_tokenizer).decode, thinking),
        stopped=stopped,
        tools_as_content=True,
    )
    assert whole[:2] == (reading.reasoning, reading.content)


SKIPPED = "The answer is 4." + vocab.RESPONSE_END
ANSWERED = "Thinking." + vocab.THINK_END + vocab.RESPONSE_START + "Hi." + RESPONSE_END

# name: (output, ends with the stop token, request fields, thinking prompt, expected)
ENDINGS = {
    "stop-token-replays": (SKIPPED, True, {}, True, ("The answer is 4.",) * 2),
    "length-cut-keeps-reasoning": (SKIPPED, False, {}, True, ("The answer is 4.", "")),
    "stop-string-replays": (
        SKIPPED,
        False,
        {"stop": ["STOP"], "max_tokens": 64},
        True,
        ("The answer is 4.",) * 2,
    ),
    "include-reasoning-false": (
        ANSWERED,
        True,
        {"include_reasoning": False},
        True,
        ("", "Hi."),
    ),
    # A thinking-off prompt starts in the response channel whatever kwargs say.
    "prompt-decides-start": ("Hi." + RESPONSE_END, True, {}, False, ("", "Hi.")),
}


@pytest.mark.parametrize("name", ENDINGS)
@pytest.mark.parametrize("read", [_whole, _streamed], ids=["whole", "streamed"])
def test_how_the_output_ended(hf_tokenizer, read, name):
    text, stop_token, fields, thinking_prompt, expected = ENDINGS[name]
    ids = _encode(hf_tokenizer, text) + ([vocab.END_OF_MSG_ID] if stop_token else [])
    request = _request(**{"max_tokens": len(ids), **fields})
    prompt = _prompt(hf_tokenizer, thinking_prompt)
    assert read(_parser_cls(None), hf_tokenizer, prompt, ids, request)[:2] == expected


# -- the engine's question ------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_tail", "ended"),
    [
        (vocab.THINKING_ON_PREFIX, False),
        (vocab.THINKING_OFF_PREFIX, True),
        (vocab.THINKING_ON_PREFIX + "x" + vocab.THINK_END, True),
    ],
    ids=["thinking-on", "thinking-off", "think-closed-in-prompt"],
)
def test_is_reasoning_end_on_the_prompt(hf_tokenizer, prompt_tail, ended):
    parser = K3ReasoningParser(hf_tokenizer)
    assert parser.is_reasoning_end(_encode(hf_tokenizer, "Q" + prompt_tail)) is ended


@pytest.mark.parametrize(
    "exit_marker",
    [
        vocab.THINK_END,
        vocab.RESPONSE_START,
        vocab.TOOLS_START + '<|open|>call tool="f"',
    ],
    ids=["think-closer", "response-open", "tools-open"],
)
def test_is_reasoning_end_streaming_fires_on_the_exit(hf_tokenizer, exit_marker):
    parser = K3ReasoningParser(hf_tokenizer)
    before = _encode(hf_tokenizer, "Thinking hard.")
    exit_ids = _encode(hf_tokenizer, exit_marker)
    ids = before + exit_ids + _encode(hf_tokenizer, "Answer")
    fired = [
        i
        for i in range(1, len(ids) + 1)
        if parser.is_reasoning_end_streaming(ids[:i], ids[i - 1 : i])
    ]
    if exit_marker.startswith(vocab.TOOLS_START):
        # A tools channel is decided when ``call `` follows its opener.
        decided = _encode(hf_tokenizer, vocab.TOOLS_START + "<|open|>call tool")
        assert fired == [len(before) + len(decided)]
    else:
        assert fired == [len(before) + len(exit_ids)]


def test_answer_closer_is_not_a_reasoning_end(hf_tokenizer):
    parser = K3ReasoningParser(hf_tokenizer)
    ids = _encode(hf_tokenizer, "Reply." + vocab.RESPONSE_END)
    assert not any(
        parser.is_reasoning_end_streaming(ids[:i], ids[i - 1 : i])
        for i in range(1, len(ids) + 1)
    )


def test_bad_replay_policy_fails_at_registration(monkeypatch):
    from vllm_k3_plugin.registration import register_all

    monkeypatch.setenv("VLLM_K3_REPLAY_POLICY", "sometimes")
    with pytest.raises(ValueError, match="replay, hold-back"):
        register_all()


def test_hold_back_policy_is_read_from_the_environment(monkeypatch, hf_tokenizer):
    monkeypatch.setenv("VLLM_K3_REPLAY_POLICY", "hold-back")
    ids = _encode(hf_tokenizer, "The answer is 4." + RESPONSE_END)
    ids.append(vocab.END_OF_MSG_ID)
    prompt = _prompt(hf_tokenizer, True)
    request = _request(max_tokens=64)
    parser_cls = _parser_cls(None)
    streamed_reasoning = []
    parser = compare.new_parser(parser_cls, hf_tokenizer, request, thinking=True)
    before_stop = ids[:-1]
    for token, text in zip(before_stop, compare.delta_texts(hf_tokenizer, before_stop)):
        delta = parser.parse_delta(text, [token], request, prompt, finished=False)
        streamed_reasoning.append(delta.reasoning if delta else None)
    assert not any(streamed_reasoning), "hold-back streams no reasoning live"
    assert _whole(parser_cls, hf_tokenizer, prompt, ids, request)[:2] == (
        "",
        "The answer is 4.",
    )


def test_parser_built_without_template_arguments(hf_tokenizer):
    """vLLM builds some parsers with the tokenizer alone: no tools, no
    chat_template_kwargs, no prompt ids. The thinking default (on) decides the start."""
    parser_cls = _parser_cls()
    text = "Hmm." + vocab.THINK_END + vocab.RESPONSE_START + "Hi." + RESPONSE_END
    ids = [*_encode(hf_tokenizer, text), vocab.END_OF_MSG_ID]
    request = _request()
    whole = parser_cls(hf_tokenizer).parse(text, request, model_output_token_ids=ids)
    assert whole[:2] == ("Hmm.", "Hi.")
    streamed = parser_cls(hf_tokenizer)
    reasoning, content = "", ""
    deltas = compare.delta_texts(hf_tokenizer, ids)
    for i, (token, delta_text) in enumerate(zip(ids, deltas)):
        delta = streamed.parse_delta(
            delta_text, [token], request, finished=i == len(ids) - 1
        )
        if delta is not None:
            reasoning += delta.reasoning or ""
            content += delta.content or ""
    assert (reasoning, content) == ("Hmm.", "Hi.")


@pytest.mark.parametrize("shape", ["think-then-reply", "tools-in-think"])
def test_a_streamed_delta_carries_only_the_fields_it_has(hf_tokenizer, shape):
    """vLLM writes each chunk with ``exclude_unset``: a field the parser set to
    ``None`` would go out as ``null`` (one more key a frame, and a frame Moonshot's
    spec reads as two kinds)."""
    from vllm_k3_plugin.tools.shapes import SHAPES, TOOLS, output_ids

    output, thinking, _ = SHAPES[shape]
    ids = output_ids(output, stop=True)
    request = _request(stream=True, tools=TOOLS)
    parser = compare.new_parser(_parser_cls(), hf_tokenizer, request, thinking)
    prompt = _prompt(hf_tokenizer, thinking)
    texts = compare.delta_texts(hf_tokenizer, ids)
    sent = 0
    for step, (token, text) in enumerate(zip(ids, texts)):
        delta = parser.parse_delta(
            text, [token], request, prompt, finished=step == len(ids) - 1
        )
        if delta is None:
            continue
        written = delta.model_dump(exclude_unset=True)
        assert written and all(
            value not in (None, "", []) for value in written.values()
        )
        sent += 1
    assert sent > 0
