"""Bad input: no exception escapes, the stream ends, no text is lost.

"No text lost" is checked as: every character of the output that is not part of a
marker the reader consumed reaches reasoning, content or the tools markup. The
check strips markers from the output (``words_of``: every atom, and the tag of every
element, written here as regular expressions apart from the reader's own code) and
requires what is left to appear, in order, in the three fields together.
"""

from __future__ import annotations

import random
import re

from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import read_streamed
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import ReasoningReader, collect, read_whole
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy

STARTS = (Channel.THINK, Channel.RESPONSE)


_OPEN, _CLOSE, _SEP = map(re.escape, (vocab.OPEN, vocab.CLOSE, vocab.SEP))
_ATOM = "|".join(map(re.escape, vocab.CONTROL_ATOMS))
_NAME = r"[A-Za-z_][\w.:-]*"
_KEY = r"[A-Za-z_][\w.-]*"
_ATTRIBUTES = rf'(?:\s+{_KEY}\s*=\s*"[^"]*")*'
# An opener's tag up to its separator; a closer's up to its separator or the next
# atom; a tag cut off by the end of the output (the start of one).
_MARKUP = re.compile(
    rf"{_OPEN}{_NAME}{_ATTRIBUTES}\s*{_SEP}"
    rf"|{_CLOSE}{_NAME}\s*(?:{_SEP}|(?=(?:{_ATOM})))"
    rf'|{_OPEN}(?:{_NAME}{_ATTRIBUTES}(?:\s+{_KEY}(?:\s*=\s*(?:"[^"]*)?)?)?\s*)?\Z'
    rf"|{_CLOSE}(?:{_NAME}\s*)?\Z"
    rf"|{_ATOM}"
)


def words_of(text: str) -> str:
    """The output with every marker (an atom, an element's tag, a tag cut off at
    the end) removed."""
    return _MARKUP.sub("", text)


def is_subsequence(needle: str, haystack: str) -> bool:
    it = iter(haystack)
    return all(ch in it for ch in needle)


def emitted(text, *, start, stopped, policy=ReplayPolicy.REPLAY) -> str:
    """Everything the reader sends, in the order it sends it, all fields together."""
    reader = ReasoningReader(start=start, policy=policy)
    events = reader.feed(text) + reader.finish(stopped=stopped)
    return "".join(event.text for event in events)


@given(st.binary(max_size=400), st.sampled_from(STARTS), st.booleans())
def test_arbitrary_bytes(raw, start, stopped):
    text = raw.decode("utf-8", errors="surrogateescape")
    for policy in ReplayPolicy:
        reading = read_whole(text, start=start, stopped=stopped, policy=policy)
        assert is_subsequence(
            words_of(text), emitted(text, start=start, stopped=stopped, policy=policy)
        )
        assert read_streamed(
            list(text), start=start, stopped=stopped, policy=policy
        ) == (reading)


UNBALANCED = [
    vocab.OPEN,
    vocab.CLOSE,
    vocab.SEP,
    vocab.OPEN + vocab.OPEN + vocab.SEP,
    vocab.CLOSE + "think",
    vocab.CLOSE + "response",
    vocab.TOOLS_END,
    vocab.TOOLS_START,
    vocab.RESPONSE_END * 3,
    vocab.THINK_END * 2,
    vocab.MESSAGE_END,
    "<|open",
    "|>",
]


@given(
    st.lists(st.sampled_from(UNBALANCED) | st.text(max_size=4), max_size=40).map(
        "".join
    ),
    st.sampled_from(STARTS),
    st.booleans(),
)
def test_unbalanced_markers(text, start, stopped):
    assert is_subsequence(words_of(text), emitted(text, start=start, stopped=stopped))


def test_a_megabyte_of_markers():
    rng = random.Random(7)
    pieces = [*vocab.REASONING_MARKERS, "x", " "]
    text = "".join(rng.choice(pieces) for _ in range(80_000))[: 1 << 20]
    assert len(text) > 900_000
    for start in STARTS:
        whole = read_whole(text, start=start, stopped=True)
        chunks = [text[i : i + 4093] for i in range(0, len(text), 4093)]
        assert read_streamed(chunks, start=start, stopped=True) == whole
        assert is_subsequence(words_of(text), emitted(text, start=start, stopped=True))


def test_an_output_that_never_closes_anything():
    thought = "still thinking " * 20_000
    for stopped in (True, False):
        # The marker cut off at the end is dropped.
        text = thought + vocab.OPEN + "think"
        reading = read_whole(text, start=Channel.THINK, stopped=stopped)
        assert reading.reasoning == thought
        assert reading.content == ""
    # A tools opener followed by words is quoted: dropped, the words are the reply.
    reading = read_whole(
        vocab.TOOLS_START + "call", start=Channel.RESPONSE, stopped=True
    )
    assert (reading.content, reading.tool_markup) == ("call", "")


def test_finish_twice_and_feed_after_finish():
    reader = ReasoningReader()
    events = reader.feed("a") + reader.finish(stopped=True)
    assert collect(events).reasoning == "a"
    assert reader.finish(stopped=True) == []
    try:
        reader.feed("b")
    except RuntimeError as error:
        assert "finish" in str(error)
    else:
        raise AssertionError("feed after finish must be refused")
