"""One regression test per defect family of the reading contract (K3_FORMAT rules 3,
6, 8 and 9), each the shrunk form of a shape other engines test on: the output as the
model writes it (structure in control ids, quoted markers in BPE pieces), read whole
and one token at a time, with how it ended.
"""

from __future__ import annotations

import pytest

from tests.support.expected_tools import NO_CALL_SHAPES
from tests.support.k3_ids import Control, encode, id_atoms, token_chunks
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.events import Content
from vllm_k3_plugin.format.marked import TextAtoms
from vllm_k3_plugin.format.output import (
    OutputReader,
    OutputReading,
    collect_output,
    finish_reason,
)
from vllm_k3_plugin.format.tools import ToolCall
from vllm_k3_plugin.tools.shapes import RUNAWAY_PROSE, SHAPES, output_ids

OPEN, CLOSE, SEP = vocab.OPEN, vocab.CLOSE, vocab.SEP
THINK, RESPONSE = Channel.THINK, Channel.RESPONSE
END = Control(vocab.RESPONSE_END + vocab.MESSAGE_END)


def call_opener(name: str) -> Control:
    return Control(f'{OPEN}call tool="{name}" index="1"{SEP}')


def argument(key: str) -> Control:
    return Control(f'{OPEN}argument key="{key}" type="string"{SEP}')


def _read_chunks(start: Channel, chunks, atoms, stopped: bool = True) -> OutputReading:
    reader = OutputReader(start, atoms=atoms)
    events = [event for chunk in chunks for event in reader.feed(*chunk)]
    return collect_output(events + reader.finish(stopped=stopped))


def read(start: Channel, *pieces, stopped: bool = True) -> tuple[OutputReading, str]:
    """The reading, checked equal whole and token by token, and its finish reason."""
    text, ids = encode(*pieces)
    if stopped:
        ids.append(vocab.END_OF_MSG_ID)
    whole, streamed = (
        _read_chunks(start, chunks, id_atoms(), stopped)
        for chunks in ([(text, ids)], token_chunks(ids))
    )
    assert streamed == whole
    closed = sum(call.complete for call in whole.calls)
    reason = finish_reason(
        "stop" if stopped else "length", closed, len(whole.calls) - closed
    )
    return whole, reason


def test_1_a_cut_call_is_the_same_streamed_and_whole():
    reading, reason = read(
        THINK,
        "Listing.",
        Control(vocab.THINK_END + vocab.RESPONSE_START),
        "Sure.",
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("list_dir"),
        argument("path"),
        "/srv/da",
        stopped=False,
    )
    assert (reading.reasoning, reading.content) == ("Listing.", "Sure.")
    assert reading.calls == [ToolCall(0, "list_dir", '{"path": "/srv/da', False)]
    assert reason == "length"


def test_1_a_stop_inside_a_call_is_no_tool_calls_finish():
    reading, reason = read(
        RESPONSE,
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("run"),
        argument("cmd"),
        "rm -rf /tmp/build",
        Control(CLOSE + "argument"),
        stopped=True,
    )
    assert reading.calls == [ToolCall(0, "run", '{"cmd": "rm -rf /tmp/build', False)]
    assert reason == "stop"


def test_2_text_after_a_quoted_tools_opener_is_kept():
    reading, _ = read(
        RESPONSE,
        "The section starts with ",
        Control(vocab.TOOLS_START),
        " and lists the calls.",
        END,
    )
    assert reading.content == "The section starts with  and lists the calls."
    assert reading.calls == []
    # Inside reasoning, the thought goes on after it.
    reading, _ = read(
        THINK,
        "Quoting ",
        Control(vocab.TOOLS_START),
        " here.",
        Control(vocab.THINK_END + vocab.RESPONSE_START),
        "Done.",
        END,
    )
    assert (reading.reasoning, reading.content) == ("Quoting  here.", "Done.")


def test_3_text_in_a_tools_channel_outside_calls_is_content():
    call = [
        argument("city"),
        "Paris",
        Control(vocab.ARGUMENT_END + vocab.CALL_END),
    ]
    reading, reason = read(
        RESPONSE,
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("get_weather"),
        *call,
        "Then Lyon:",
        call_opener("get_weather"),
        *call,
        "\nDone.",
        END,
    )
    assert reading.content == "Then Lyon:\nDone."
    assert [call.name for call in reading.calls] == ["get_weather"] * 2
    assert reason == "tool_calls"


def test_4_a_think_block_anywhere_is_reasoning_and_an_interrupted_one_resumes():
    reading, _ = read(
        THINK,
        "Need data.",
        Control(vocab.TOOLS_START),
        call_opener("get_weather"),
        argument("city"),
        "Paris",
        Control(vocab.ARGUMENT_END + vocab.CALL_END + vocab.THINK_START),
        " Between calls.",
        Control(vocab.THINK_END + vocab.TOOLS_END),
        " Resumed.",
        Control(vocab.THINK_END + vocab.RESPONSE_START),
        "Answer.",
        END,
    )
    assert reading.reasoning == "Need data. Between calls. Resumed."
    assert reading.content == "Answer."
    assert [call.arguments for call in reading.calls] == ['{"city": "Paris"}']


def test_5_marker_characters_in_bpe_pieces_are_text():
    reading, _ = read(
        RESPONSE,
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("bash"),
        argument("cmd"),
        "grep -n '<|close|>argument<|sep|>' src/",
        Control(vocab.ARGUMENT_END + vocab.CALL_END + vocab.TOOLS_END),
        END,
    )
    assert reading.calls[0].arguments == (
        '{"cmd": "grep -n \'<|close|>argument<|sep|>\' src/"}'
    )
    reading, _ = read(RESPONSE, '{"open": "<|open|>response<|sep|>"}', END)
    assert reading.content == '{"open": "<|open|>response<|sep|>"}'


def test_6_control_markup_inside_a_value_ends_it():
    reading, _ = read(
        RESPONSE,
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("calc"),
        argument("expr"),
        "1+2;",
        END,
    )
    assert reading.calls == [ToolCall(0, "calc", '{"expr": "1+2;"}')]
    assert reading.content == ""
    reading, _ = read(
        RESPONSE,
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("search"),
        argument("q"),
        "Par",
        Control(vocab.TOOLS_START),
        call_opener("get_weather"),
        argument("city"),
        "Paris",
        Control(vocab.ARGUMENT_END + vocab.CALL_END + vocab.TOOLS_END),
        END,
    )
    assert reading.calls == [
        ToolCall(0, "search", '{"q": "Par"}'),
        ToolCall(1, "get_weather", '{"city": "Paris"}'),
    ]


def test_6_an_element_outside_the_tools_channel_is_dropped_whole():
    """Its tags are framing (names and attributes included); the text inside stays
    in the channel it was written in."""
    block = (
        Control(f'{OPEN}json type="object"{SEP}'),
        '{"a": 1}',
        Control(vocab.JSON_END),
    )
    reading, _ = read(RESPONSE, "Here:", *block, " done.", END)
    assert reading.content == 'Here:{"a": 1} done.'
    reading, _ = read(
        THINK,
        "Plan:",
        argument("path"),
        "/srv",
        Control(vocab.ARGUMENT_END + f'{OPEN}note id="1"{SEP}'),
        " then",
        Control(f"{CLOSE}note{SEP}" + vocab.THINK_END),
        "Yes.",
        END,
    )
    assert (reading.reasoning, reading.content) == ("Plan:/srv then", "Yes.")


def test_6_the_unseparated_think_exit_needs_the_next_element():
    """``<|close|>think`` with no separator ends the think channel only when the
    next element follows it; words after it are the thought's own."""
    reading, _ = read(THINK, "Hm", Control(CLOSE), "thinking about it.", stopped=False)
    assert (reading.reasoning, reading.content) == ("Hmthinking about it.", "")
    reading, _ = read(
        THINK,
        "Hm",
        Control(vocab.THINK_END_UNSEPARATED + vocab.RESPONSE_START),
        "Yes.",
        END,
    )
    assert (reading.reasoning, reading.content) == ("Hm", "Yes.")
    reading, _ = read(
        THINK, "Hm", Control(f"{CLOSE}thinking{SEP}"), " more.", stopped=False
    )
    assert (reading.reasoning, reading.content) == ("Hm more.", "")


def test_6_a_channel_marker_spelled_with_a_space_is_that_marker():
    """``<|open|>think <|sep|>`` at the start of a thinking-off output opens the
    output's own think channel, replayed as the reply like the plain opener."""
    for opener in (vocab.THINK_START, f"{OPEN}think {SEP}"):
        reading, _ = read(RESPONSE, Control(opener), "The answer.", END)
        assert (reading.reasoning, reading.content) == ("The answer.", "The answer.")


def test_6_the_stop_token_text_never_completes_a_tag():
    """With ``include_stop_str_in_output`` the stop token's text follows the output;
    a tag it interrupts is still a tag cut off at the end, as without that text."""
    for start, pieces in (
        (
            THINK,
            ("The answer.", Control(vocab.RESPONSE_END + vocab.THINK_END_UNSEPARATED)),
        ),
        (RESPONSE, ("Use ", Control(OPEN), "foo bar")),
    ):
        text, ids = encode(*pieces)
        ids.append(vocab.END_OF_MSG_ID)
        readings = []
        for stop_text in ("", vocab.END_OF_MSG):
            reader = OutputReader(start, atoms=id_atoms())
            events = reader.feed(text + stop_text, ids) + reader.finish(stopped=True)
            readings.append(collect_output(events))
        assert readings[0] == readings[1]


def test_9_the_stop_token_text_never_closes_a_call():
    """With ``include_stop_str_in_output`` vLLM keeps the stop token's text; the call
    is still cut there, as it is when the text is dropped."""
    text, ids = encode(
        Control(vocab.RESPONSE_END + vocab.TOOLS_START),
        call_opener("run"),
        argument("cmd"),
        "rm -rf /",
    )
    ids.append(vocab.END_OF_MSG_ID)
    reader = OutputReader(RESPONSE, atoms=id_atoms())
    events = reader.feed(text + vocab.END_OF_MSG, ids) + reader.finish(stopped=True)
    (call,) = collect_output(events).calls
    assert (call.arguments, call.complete) == ('{"cmd": "rm -rf /', False)


# -- rule 6: openers that open nothing, read every way ------------------------------


@pytest.mark.parametrize("stopped", [True, False], ids=["stop", "cut"])
@pytest.mark.parametrize("shape", sorted(NO_CALL_SHAPES))
def test_6_an_opener_that_opens_nothing_reads_the_same_every_way(shape, stopped):
    output, thinking, _ = SHAPES[shape]
    start = THINK if thinking else RESPONSE
    want = NO_CALL_SHAPES[shape]
    ids = output_ids(output, stop=stopped)
    tokens = token_chunks(ids)
    text = "".join(chunk for chunk, _ in tokens)
    ways = {"whole": [(text, ids)], "token by token": tokens}
    # Every split of the ids in two (as the engine hands over tokens), and every
    # split of the text in two read from the text alone (a saved output).
    for at in range(1, len(tokens)):
        ways[f"ids split at token {at}"] = [
            ("".join(t for t, _ in tokens[:at]), ids[:at]),
            ("".join(t for t, _ in tokens[at:]), ids[at:]),
        ]
    for way, chunks in ways.items():
        reading = _read_chunks(start, chunks, id_atoms(), stopped)
        assert (reading.reasoning, reading.content, reading.calls) == (*want, []), way
    plain = output  # atoms as their strings: structure read from the text
    for at in range(len(plain) + 1):
        chunks = [(plain[:at], None), (plain[at:], None)]
        reading = _read_chunks(start, chunks, TextAtoms(), stopped)
        assert (reading.reasoning, reading.content, reading.calls) == (*want, []), at
    reading = _read_chunks(start, [(ch, None) for ch in plain], TextAtoms(), stopped)
    assert (reading.reasoning, reading.content, reading.calls) == (*want, [])


@pytest.mark.parametrize(
    "shape", ["runaway-call-opener", "runaway-call-opener-in-tools"]
)
def test_6_prose_after_a_runaway_opener_streams_as_it_comes(shape):
    """The text after a call opener whose tool name runs into prose streams as it
    is written (the tag is decided within the token that shows it is none), never
    held to the end of the output."""
    ids = output_ids(SHAPES[shape].output, stop=True)
    reader = OutputReader(RESPONSE, atoms=id_atoms())
    written, sent = "", []
    for chunk_text, chunk_ids in token_chunks(ids):
        written += chunk_text
        sent += [
            e.text for e in reader.feed(chunk_text, chunk_ids) if type(e) is Content
        ]
        if written.endswith(RUNAWAY_PROSE):
            break
    assert "".join(sent).endswith('call tool="search' + RUNAWAY_PROSE)


def test_held_chars_is_what_may_still_reach_the_client():
    """The lag measure (``benchmarks/bench_lag.py``): a tag being read is held
    until it is decided, then its text is sent or it is framing."""
    reader = OutputReader(RESPONSE)
    reader.feed("Hi." + OPEN + 'call tool="sea')
    assert reader.held_chars == len('call tool="sea')
    reader.feed("rch")
    assert reader.held_chars == len('call tool="search')
    sent = reader.feed(" and then")
    assert reader.held_chars == 0
    assert [e.text for e in sent if type(e) is Content] == [
        'call tool="search and then'
    ]
    reader.feed(OPEN + 'call tool="f" index="1"' + SEP)
    assert reader.held_chars == len("f")  # the name, until the call is confirmed
    reader.feed(OPEN + 'argument key="a" type="number"' + SEP + "12")
    assert (reader.held_chars, reader.held_value_chars) == (0, 2)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("stopped", [True, False])
def test_every_built_in_shape_reads_alike_in_every_text_chunking(shape, stopped):
    """Read from the text alone (a saved output), in the chunkings every streaming
    comparison uses: each tag is then fed a character or a few at a time."""
    from tests.conftest import chunkings

    output, thinking, _ = SHAPES[shape]
    start = THINK if thinking else RESPONSE
    readings = {
        way: _read_chunks(start, [(c, None) for c in chunks], TextAtoms(), stopped)
        for way, chunks in chunkings(output).items()
    }
    assert all(reading == readings["whole"] for reading in readings.values())


def test_6_text_a_think_exit_releases_in_a_tools_channel_is_the_thoughts():
    """An opener that never completes, interrupted by the think exit inside a
    tools channel that interrupted the thought: its text was written in the
    thought."""
    reading, _ = read(
        THINK,
        "thought ",
        Control(vocab.TOOLS_START),
        call_opener("f"),
        "more thought ",
        Control(OPEN),
        "foo ",
        Control(vocab.THINK_END),
        "answer",
        Control(vocab.TOOLS_END),
    )
    assert (reading.reasoning, reading.content) == (
        "thought more thought foo ",
        "answer",
    )


@pytest.mark.parametrize(
    "exit_then_close",
    [
        vocab.THINK_END + vocab.TOOLS_END,
        CLOSE + "think" + vocab.TOOLS_END,  # the closer without its separator
        CLOSE + "think " + SEP + vocab.TOOLS_END,
        OPEN + "response " + SEP,
    ],
)
def test_6_a_think_exit_in_the_tools_channel_ends_the_thought(exit_then_close):
    """However the thought's exit is spelled inside the tools channel that
    interrupted it, the reply follows."""
    reading, _ = read(
        THINK,
        "thought ",
        Control(vocab.TOOLS_START),
        call_opener("f"),
        "more ",
        Control(exit_then_close),
        "Answer.",
    )
    assert (reading.reasoning, reading.content) == ("thought more ", "Answer.")
