"""MarkerScanner: the same events whatever the chunking, linear in one feed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.scanner import (
    Cut,
    Marker,
    MarkerScanner,
    MarkerSetError,
    Text,
)

MARKERS = vocab.REASONING_MARKERS


def scan(chunks, markers=MARKERS):
    scanner = MarkerScanner(markers)
    events = []
    for chunk in chunks:
        events += scanner.feed(chunk)
    events += scanner.finish()
    return merged(events)


def merged(events):
    """Adjacent Text events joined: text splits depend on the chunking."""
    out = []
    for event in events:
        if type(event) is Text and out and type(out[-1]) is Text:
            out[-1] = Text(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def pieces():
    partial = [m[:i] for m in MARKERS for i in range(1, len(m))]
    return st.lists(
        st.one_of(
            st.sampled_from(MARKERS),
            st.sampled_from(partial),
            st.text(alphabet="ab <|>\n think", max_size=6),
        ),
        max_size=25,
    ).map("".join)


def test_whole_feed_finds_leftmost_longest():
    text = f"a{vocab.CLOSE}think{vocab.SEP}b{vocab.CLOSE}thinkc{vocab.CLOSE}"
    assert scan([text]) == [
        Text("a"),
        Marker(vocab.THINK_END),
        Text("b"),
        Marker(vocab.CLOSE),
        Text("thinkc"),
        # A bare atom at the very end could still have grown into an element: cut.
        Cut(vocab.CLOSE),
    ]


def test_a_complete_marker_that_could_grow_is_held_until_the_next_chunk():
    scanner = MarkerScanner(MARKERS)
    assert scanner.feed(f"x{vocab.CLOSE}think") == [Text("x")]
    assert scanner.held == f"{vocab.CLOSE}think"
    assert scanner.feed(vocab.SEP + "y") == [Marker(vocab.THINK_END), Text("y")]
    assert scanner.finish() == []


def test_a_marker_cut_at_the_end_is_reported_as_cut():
    assert scan(["abc<|clo"]) == [Text("abc"), Cut("<|clo")]
    assert scan(["abc<|close|>resp"]) == [Text("abc"), Cut("<|close|>resp")]


def test_a_held_tail_that_is_not_a_marker_is_released_as_text():
    assert scan(["a <", "b"]) == [Text("a <b")]
    assert scan(["<|", "x"]) == [Text("<|x")]


@given(pieces(), st.data())
def test_events_do_not_depend_on_the_chunking(text, data):
    whole = scan([text])
    assert scan(list(text)) == whole
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert scan(chunks) == whole


@given(pieces())
def test_nothing_is_lost(text):
    events = scan([text])
    rebuilt = "".join(e.text if type(e) in (Text, Cut) else e.marker for e in events)
    assert rebuilt == text


def test_a_marker_straddling_a_4096_boundary():
    text = "x" * 4093 + vocab.THINK_END + "y" * 5000
    assert scan([text[:4096], text[4096:]]) == scan([text])


def test_markers_nested_in_the_middle_are_refused():
    with pytest.raises(MarkerSetError, match="occurs inside"):
        MarkerScanner(["<a<b>a>", "<b>"])


def test_one_feed_is_linear_in_the_marker_count():
    # 32,768 markers in one feed: each search starts at the cursor, so the number of
    # regex calls is the number of markers plus one, not quadratic.
    text = (vocab.MESSAGE_END + "ab") * 32768
    events = MarkerScanner(MARKERS).feed(text)
    assert sum(type(e) is Marker for e in events) == 32768
