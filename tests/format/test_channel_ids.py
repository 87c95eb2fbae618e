"""Channel boundaries on token ids agree with the text reader.

The engine core asks, on ids, whether reasoning has ended; the API server reads the
text. On outputs whose markers are the real control ids (how the model writes them),
both must name the same token as the end of the think channel, whatever the deltas.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channel_ids import (
    ReasoningCount,
    count_reasoning_ids,
    reasoning_end,
    reasoning_ends_in_delta,
    reasoning_open_after,
    reasoning_span_end,
)
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import ReasoningReader

# Elements as the model writes them: whole markers, ids for the atoms.
ELEMENTS = [
    vocab.THINK_START,
    vocab.THINK_END,
    vocab.RESPONSE_START,
    vocab.RESPONSE_END,
    vocab.TOOLS_START,
    vocab.TOOLS_END,
    vocab.CALL_END,
    vocab.ASSISTANT_START,
    vocab.MESSAGE_END,
    vocab.opener("call", 'tool="f" index="1"'),
    vocab.THINK_END_UNSEPARATED,
]
CALL_OPENER = vocab.opener("call", 'tool="f" index="1"')
# Whitespace runs long enough to pass ``vocab.TOOLS_OPENER_MAX_GAP`` after a tools
# opener; "ing" after an unseparated think closer.
WORDS = ["Hello", " world", ".", "\n", " think", "ing", "response", " 42", " " * 9]

id_outputs = st.lists(
    st.sampled_from(ELEMENTS) | st.sampled_from(WORDS), max_size=25
).map("".join)


@pytest.fixture(scope="module")
def codec(k3_tokenizer):
    def encode(text: str) -> list[int]:
        return k3_tokenizer.encode(text, allowed_special="all")

    def decode(ids) -> str:
        return k3_tokenizer.decode(list(ids))

    return encode, decode


def reader_exit(ids: list[int], decode) -> int:
    """Ids consumed when the text reader leaves the think channel, fed id by id."""
    reader = ReasoningReader(start=Channel.THINK)
    for i in range(len(ids)):
        reader.feed(decode(ids[i : i + 1]))
        if not reader.in_reasoning:
            return i + 1
    return len(ids)


@given(id_outputs)
def test_span_end_is_where_the_reader_leaves_the_think_channel(codec, text):
    encode, decode = codec
    ids = encode(text)
    # The reader leaves the channel at the id that decides its end (for a tools
    # opener, the call opener after it); the reasoning ends where the element does.
    end = reasoning_end(ids, decode)
    exit_at, decided = end if end is not None else (len(ids), len(ids) - 1)
    assert reader_exit(ids, decode) == decided + 1
    assert reasoning_span_end(ids, decode, starts_in_think=True) == exit_at


@given(id_outputs, st.data())
def test_streaming_question_fires_on_the_delta_that_ends_reasoning(codec, text, data):
    encode, decode = codec
    ids = encode(text)
    end = reasoning_end(ids, decode)
    cuts = data.draw(st.lists(st.integers(1, max(1, len(ids) - 1)), max_size=8))
    bounds = sorted({0, len(ids), *cuts})
    deltas = list(itertools.pairwise(bounds))
    fired = [
        hi for lo, hi in deltas if reasoning_ends_in_delta(ids[:hi], hi - lo, decode)
    ]
    if end is None:
        assert not fired
    else:
        decided = end[1]
        holding_decision = next(hi for lo, hi in deltas if lo <= decided < hi)
        assert fired[:1] == [holding_decision]


@given(id_outputs)
def test_incremental_count_equals_the_full_count(codec, text):
    encode, decode = codec
    ids = encode(text)
    counter = ReasoningCount()
    for i in range(len(ids) + 1):
        prefix = ids[:i]
        assert counter.update(prefix, decode, starts_in_think=True) == (
            count_reasoning_ids(prefix, decode, starts_in_think=True)
        )


def test_count_restarts_on_a_list_that_is_not_an_extension(codec):
    encode, decode = codec
    counter = ReasoningCount()
    long = encode("a b c" + vocab.THINK_END + "reply")
    assert (
        counter.update(long, decode, starts_in_think=True) == len(encode("a b c")) + 3
    )
    short = encode("x")
    assert counter.update(short, decode, starts_in_think=True) == 1


@pytest.mark.parametrize(
    ("prompt", "open_think"),
    [
        ("user text", None),
        (vocab.THINKING_ON_PREFIX, True),
        (vocab.THINKING_OFF_PREFIX, False),
        (vocab.THINK_START + "old" + vocab.THINK_END + vocab.ASSISTANT_START, False),
        (vocab.RESPONSE_START + "x" + vocab.RESPONSE_END + vocab.THINK_START, True),
        (vocab.ASSISTANT_START + vocab.TOOLS_START, False),
    ],
)
def test_open_think_after_a_prompt(codec, prompt, open_think):
    encode, decode = codec
    assert reasoning_open_after(encode(prompt), decode) is open_think


@pytest.mark.parametrize(
    "output",
    [
        "thought" + vocab.THINK_END + "reply",
        "thought" + vocab.RESPONSE_START + "reply",
        "thought" + vocab.TOOLS_START + "\n" + CALL_OPENER,
        "thought" + vocab.THINK_END_UNSEPARATED + vocab.RESPONSE_START + "reply",
    ],
)
def test_each_think_exit_ends_reasoning(codec, output):
    encode, decode = codec
    ids = encode(output)
    end = reasoning_span_end(ids, decode, starts_in_think=True)
    assert decode(ids[end:]) in (
        "reply",
        "\n" + CALL_OPENER,
        vocab.RESPONSE_START + "reply",
    )
    # The lenient exit is known when the next element's first id arrives; a tools
    # opener when ``call `` follows it.
    known_at = reasoning_end(ids, decode)[1] + 1
    assert known_at == (end if ids[end - 1] == vocab.SEP_ID else end + 1) or (
        vocab.TOOLS_START in output
    )
    assert reasoning_ends_in_delta(ids[:known_at], 1, decode)
    assert not reasoning_ends_in_delta(ids[: known_at - 1], 1, decode)


def test_a_tools_opener_followed_by_words_is_quoted(codec):
    encode, decode = codec
    ids = encode("thought" + vocab.TOOLS_START + " and more" + vocab.THINK_END)
    end = reasoning_span_end(ids, decode, starts_in_think=True)
    assert end == len(ids)


def test_answer_closer_does_not_end_reasoning(codec):
    """``<|close|>response<|sep|>`` in the think channel is undecided, not an exit."""
    encode, decode = codec
    ids = encode("Reply." + vocab.RESPONSE_END + vocab.MESSAGE_END)
    assert reasoning_span_end(ids, decode, starts_in_think=True) == len(ids)
    assert not any(
        reasoning_ends_in_delta(ids[:i], 1, decode) for i in range(1, len(ids))
    )


def test_not_in_think_counts_nothing(codec):
    encode, decode = codec
    ids = encode("reply" + vocab.THINK_END)
    assert count_reasoning_ids(ids, decode, starts_in_think=False) == 0
    assert ReasoningCount().update(ids, decode, starts_in_think=False) == 0
