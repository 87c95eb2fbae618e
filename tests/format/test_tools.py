"""ToolCallReader: the tools channel as calls, whole and streamed (rule 8)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.support.k3_ids import Control, encode, id_atoms, token_chunks
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.events import (
    ArgumentsDelta,
    CallClosed,
    CallOpened,
    Dropped,
    Prose,
)
from vllm_k3_plugin.format.tools import (
    ToolCall,
    ToolCallReader,
    collect_calls,
    read_calls,
    read_tools,
    typed_value_json,
)
from vllm_k3_plugin.format.xtml import (
    GENERIC_GRAMMAR,
    MAX_KEY_CHARS,
    MAX_NAME_CHARS,
    MAX_TAG_CHARS,
    MAX_TOOL_NAME_CHARS,
    TagGrammar,
    TagText,
    escape_attribute,
    grammar_for,
    parse_tag,
    render_call,
    render_tools,
    unescape_attribute,
)

OPEN, CLOSE, SEP = vocab.OPEN, vocab.CLOSE, vocab.SEP
EVERY_TYPE = {
    "text": 'He said "hi"\n\tand\\left <tag> 思考 😀',
    "empty": "",
    "int": 42,
    "negative": -7,
    "float": 2.5,
    "yes": True,
    "no": False,
    "nothing": None,
    "object": {"a": [1, {"b": None}], "c": "d"},
    "array": [1, "two", 3.0, False, None, []],
    "empty_object": {},
}


def _arg(key: str, type_: str | None, value: str) -> str:
    attrs = f'key="{key}"' + (f' type="{type_}"' if type_ else "")
    return f"{OPEN}argument {attrs}{SEP}{value}{vocab.ARGUMENT_END}"


def _call(name: str | None, body: str, index: int = 1, end: str = vocab.CALL_END):
    attrs = (f'tool="{name}" ' if name is not None else "") + f'index="{index}"'
    return f"{OPEN}call {attrs}{SEP}{body}{end}"


def _tools(*calls: str) -> str:
    return vocab.TOOLS_START + "".join(calls) + vocab.TOOLS_END


def _streamed(chunks: list[str], grammar: TagGrammar = GENERIC_GRAMMAR) -> list:
    reader = ToolCallReader(grammar=grammar)
    events = []
    for chunk in chunks:
        events += reader.feed(chunk)
    return events + reader.finish()


def _args_of(markup: str) -> list[tuple[str, object]]:
    calls, _ = read_calls(markup)
    return [(call.name, json.loads(call.arguments)) for call in calls]


# -- attributes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw", ["plain", 'q"uote', "a&b", "&quot;", "&amp;quot;", '"&"', ""]
)
def test_attribute_escaping_round_trips(raw):
    assert unescape_attribute(escape_attribute(raw)) == raw


def test_attribute_unescape_order_is_quot_then_amp():
    # "&amp;quot;" is an escaped "&quot;" (the literal text), not a quote.
    assert unescape_attribute("&amp;quot;") == "&quot;"
    assert unescape_attribute("a&quot;b&amp;c") == 'a"b&c'


# The tag grammar, written apart from ``TagText``: a whole tag, and what may still
# grow into one (short texts: the bounds are tested below). A value holds no
# whitespace, but a ``key`` may hold spaces (never a newline).
_NAME = r"[A-Za-z_][\w.:-]*"
_KEY = r"[A-Za-z_][\w.-]*"
_ATTR = rf'(?:key\s*=\s*"[^"\n]*"|{_KEY}\s*=\s*"[^"\s]*")'
_ATTR_PREFIX = (
    rf'(?:key(?:\s*(?:=\s*(?:"[^"\n]*)?)?)?|{_KEY}(?:\s*(?:=\s*(?:"[^"\s]*)?)?)?)'
)
_WHOLE = {
    True: re.compile(rf"{_NAME}(?:\s+{_ATTR})*\s*").fullmatch,
    False: re.compile(rf"{_NAME}\s*").fullmatch,
}
_PREFIX = {
    True: re.compile(
        rf"(?:{_NAME}(?:\s+{_ATTR})*(?:\s*|\s+{_ATTR_PREFIX}))?"
    ).fullmatch,
    False: re.compile(rf"(?:{_NAME}\s*)?").fullmatch,
}


@given(
    st.text(alphabet='toolkey_ =."\n1é-:', max_size=14),
    st.booleans(),
    st.lists(st.integers(1, 4), max_size=14),
)
@example('a b="c d', True, [1])  # a value's whitespace: no tag from there
@example('a key="c d"', True, [2])  # but a key's
def test_tag_text_reads_the_tag_grammar_in_any_chunking(text, opener, sizes):
    tag = TagText(opener=opener)
    at, may_grow = 0, True
    for size in [*sizes, len(text)]:
        if at >= len(text):
            break
        may_grow = tag.add(text[at : at + size])
        at += size
        assert may_grow == (_PREFIX[opener](text[:at]) is not None)
        if not may_grow:
            return
    assert tag.complete == (_WHOLE[opener](text) is not None)
    assert tag.text == text


def _fed(text: str, piece: int, grammar: TagGrammar = GENERIC_GRAMMAR) -> TagText:
    tag = TagText(opener=True, grammar=grammar)
    for at in range(0, len(text), piece):
        if not tag.add(text[at : at + piece]):
            break
    return tag


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_the_longest_legitimate_tags_are_tags(piece):
    call = f'call tool="{"t" * MAX_TOOL_NAME_CHARS}" index="999999"'
    argument = (
        f'argument key="{("k k" * MAX_KEY_CHARS)[:MAX_KEY_CHARS]}" type="boolean"'
    )
    assert max(len(call), len(argument)) == MAX_TAG_CHARS
    for text in (call, argument):
        assert _fed(text, piece).complete


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize(
    ("text", "broken_at"),
    [
        # A tool name, an index, a type: no whitespace.
        ('call tool="search and then', len('call tool="search ')),
        ('call tool="search\nand', len('call tool="search\n')),
        ('call tool="f" index="1 and', len('call tool="f" index="1 ')),
        # A key may hold spaces, never a newline.
        ('argument key="the city\nthen', len('argument key="the city\n')),
        # Every word is bounded.
        ("x" * (MAX_NAME_CHARS + 1), MAX_NAME_CHARS + 1),
        ('call tool="' + "t" * 80, len('call tool="') + MAX_TOOL_NAME_CHARS + 1),
        ('argument key="' + "k" * 200, len('argument key="') + MAX_KEY_CHARS + 1),
        # The whole tag too, however its words are spread.
        ("call" + " " * MAX_TAG_CHARS, MAX_TAG_CHARS + 1),
    ],
)
def test_a_tag_is_decided_within_the_piece_that_shows_it_is_none(
    text, broken_at, piece
):
    tag = TagText(opener=True)
    fed = 0
    while fed < len(text):
        still = tag.add(text[fed : fed + piece])
        fed += piece
        if not still:
            break
    assert not still
    # Decided by the piece that held the first character no tag may have there.
    assert fed - piece < broken_at <= fed


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_declared_names_and_keys_widen_the_grammar(piece):
    name, key = "look up & go", "x" * (MAX_KEY_CHARS + 10)
    grammar = grammar_for([name, "ok"], [key, "city"])
    assert grammar.max_tag_chars > MAX_TAG_CHARS
    tag = f'call tool="{escape_attribute(name)}" index="1"'
    assert _fed(tag, piece, grammar).complete
    assert not _fed(tag, piece).complete
    assert _fed(f'argument key="{key}" type="string"', piece, grammar).complete
    # Undeclared names still read by the generic grammar; a declared name's
    # start that goes elsewhere, or stops early, is no tag.
    assert _fed('call tool="other_tool"', piece, grammar).complete
    assert not _fed('call tool="look up & run"', piece, grammar).complete
    assert not _fed('call tool="look up"', piece, grammar).complete
    # Declarations the generic grammar already reads change nothing.
    assert grammar_for(["get_weather"], ["city", "the city"]) is GENERIC_GRAMMAR


def test_parse_tag_reads_name_and_attributes():
    assert parse_tag('call tool="f&amp;g" index="2"') == (
        "call",
        {"tool": "f&g", "index": "2"},
    )
    assert parse_tag('argument\nkey=\'x\' junk key="k" key="second"') == (
        "argument",
        {"key": "k"},
    )
    assert parse_tag("") == ("", {})


# -- table: every argument type -----------------------------------------------------


def test_every_argument_type_reads_back_exactly():
    markup = render_tools([("do", EVERY_TYPE)])
    (call,), dropped = read_calls(markup)
    assert dropped == []
    assert call.name == "do"
    assert json.loads(call.arguments) == EVERY_TYPE
    # The layout of json.dumps(..., ensure_ascii=False): what vLLM's parsers return.
    assert call.arguments == json.dumps(EVERY_TYPE, ensure_ascii=False)


def test_multi_call_output_with_every_type():
    calls = [
        ("first", {"city": "Paris"}),
        ("second", EVERY_TYPE),
        ("third", {}),
        ("fourth", {"n": 1, "flag": True}),
    ]
    assert _args_of(render_tools(calls)) == calls
    got, _ = read_calls(render_tools(calls))
    assert [call.index for call in got] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("type_", "raw", "expected"),
    [
        ("number", " 12 ", 12),
        ("number", "1e3", 1000.0),
        ("boolean", "true", True),
        ("null", "null", None),
        ("object", '{"a": {"b": [1]}}', {"a": {"b": [1]}}),
        ("array", "[]", []),
        # Not valid JSON: the raw text, as a string.
        ("number", "twelve", "twelve"),
        ("object", '{"a": 1', '{"a": 1'),
        ("number", "NaN", "NaN"),
        ("number", "Infinity", "Infinity"),
        ("array", "[" * 100_000, "[" * 100_000),
        # A type the format does not name is still JSON, with the same fallback.
        ("integer", "5", 5),
        ("weird", "x y", "x y"),
    ],
)
def test_typed_values_are_json_with_raw_string_fallback(type_, raw, expected):
    markup = _tools(_call("f", _arg("v", type_, raw)))
    assert _args_of(markup) == [("f", {"v": expected})]


def test_string_values_are_raw_not_unescaped():
    raw = '&amp; &quot; \\n \\u0041 {"json": 1}'
    assert _args_of(_tools(_call("f", _arg("s", "string", raw)))) == [("f", {"s": raw})]


def test_argument_without_type_is_a_string():
    assert _args_of(_tools(_call("f", _arg("s", None, "12")))) == [("f", {"s": "12"})]


def test_json_block_is_the_arguments_text():
    bad = '{"path": "a.txt", "content": unquoted'
    markup = _tools(render_call("write", bad, 1))
    (call,), _ = read_calls(markup)
    assert call.arguments == bad
    good = '{"a":1,  "b":[2]}'
    (call,), _ = read_calls(_tools(render_call("w", good, 1)))
    assert call.arguments == good


def test_call_without_arguments_has_an_empty_object():
    for body in ("", "\n  ", f'{OPEN}json type="object"{SEP}{vocab.JSON_END}'):
        (call,), _ = read_calls(_tools(_call("ping", body)))
        assert call.arguments == "{}"


def test_attribute_values_are_unescaped():
    markup = _tools(
        render_call('we"ird&name', {'k"e&y': 1}, 1),
    )
    assert _args_of(markup) == [('we"ird&name', {'k"e&y': 1})]


def test_repeated_key_is_written_again_and_the_last_wins():
    markup = _tools(_call("f", _arg("a", "number", "1") + _arg("a", "number", "2")))
    (call,), _ = read_calls(markup)
    assert call.arguments == '{"a": 1, "a": 2}'
    assert json.loads(call.arguments) == {"a": 2}


# -- table: lenient and dropped markup ----------------------------------------------


def test_call_without_a_name_is_dropped_and_reported():
    markup = _tools(
        _call(None, _arg("x", "string", "lost")),
        _call("", _arg("x", "string", "lost")),
        _call("kept", _arg("x", "string", "ok"), index=3),
    )
    calls, dropped = read_calls(markup)
    assert [(c.index, c.name) for c in calls] == [(0, "kept")]
    assert [d.reason for d in dropped] == ["a call without a name"] * 2


def test_call_closer_without_separator_is_read():
    markup = _tools(
        _call("a", _arg("x", "number", "1"), end=vocab.CALL_END_UNSEPARATED),
        _call("b", "", index=2, end=vocab.CALL_END_UNSEPARATED + "\n"),
    )
    assert _args_of(markup) == [("a", {"x": 1}), ("b", {})]


@pytest.mark.parametrize(
    "ending",
    [vocab.TOOLS_END, vocab.MESSAGE_END, _call("next", "")],
    ids=["tools-closer", "message-closer", "next-call"],
)
def test_an_enclosing_closer_or_the_next_call_closes_an_open_call(ending):
    markup = vocab.TOOLS_START + f'{OPEN}call tool="a"{SEP}' + _arg("x", None, "v")
    calls, _ = read_calls(markup + ending)
    assert (calls[0].name, json.loads(calls[0].arguments)) == ("a", {"x": "v"})


def test_value_missing_its_closer_ends_at_the_call_closer():
    markup = _tools(
        f'{OPEN}call tool="a"{SEP}{OPEN}argument key="x"{SEP}v{vocab.CALL_END}'
    )
    assert _args_of(markup) == [("a", {"x": "v"})]


@pytest.mark.parametrize("value", ["<|open", "<|close|", "|>", "<|", "a|>b<"])
def test_partial_atoms_inside_a_string_value_are_text(value):
    markup = _tools(_call("f", _arg("s", "string", f"a{value}b")))
    assert _args_of(markup) == [("f", {"s": f"a{value}b"})]


@pytest.mark.parametrize(
    "value",
    [
        f'{OPEN}call tool="evil"{SEP}',
        f"{OPEN}{CLOSE}{SEP}",
        vocab.TOOLS_START,
        vocab.CALL_END_UNSEPARATED + "ing",
        vocab.JSON_END,
        vocab.ARGUMENT_END + SEP,
        f'{OPEN}argument key="y"{SEP}',
        vocab.END_OF_MSG,
        vocab.RESPONSE_END + vocab.MESSAGE_END,
    ],
)
def test_bpe_spelled_markers_inside_a_string_value_are_text(value):
    text, ids = encode(
        Control(vocab.TOOLS_START + f'{OPEN}call tool="f"{SEP}'),
        Control(f'{OPEN}argument key="s" type="string"{SEP}'),
        f"a{value}b",
        Control(vocab.ARGUMENT_END + vocab.CALL_END + vocab.TOOLS_END),
    )
    for chunks in ([(text, ids)], token_chunks(ids)):
        reader = ToolCallReader(id_atoms())
        events = [e for chunk in chunks for e in reader.feed(*chunk)] + reader.finish()
        (call,) = collect_calls(events)
        assert json.loads(call.arguments) == {"s": f"a{value}b"}


def test_a_control_closer_inside_a_value_ends_it_and_the_call():
    value = "2;" + vocab.RESPONSE_END + vocab.MESSAGE_END
    markup = vocab.TOOLS_START + _call("f", _arg("s", "string", value))
    read = read_tools(markup)
    assert [(c.name, c.arguments, c.complete) for c in read.calls] == [
        ("f", '{"s": "2;"}', True)
    ]
    assert read.prose == ""


def test_a_control_opener_inside_a_value_ends_it():
    second = f'{OPEN}argument key="t"{SEP}u{vocab.ARGUMENT_END}'
    markup = _tools(_call("f", f'{OPEN}argument key="s"{SEP}Par' + second))
    assert _args_of(markup) == [("f", {"s": "Par", "t": "u"})]
    # A tools channel and a call opened inside a value: a second call.
    inner = vocab.TOOLS_START + _call("g", _arg("x", "number", "1"), index=2)
    markup = _tools(_call("f", f'{OPEN}argument key="s"{SEP}Par' + inner))
    assert _args_of(markup) == [("f", {"s": "Par"}), ("g", {"x": 1})]


def test_stop_token_spelling_inside_a_typed_value_is_text():
    value = json.dumps({vocab.END_OF_MSG: [vocab.OPEN]})
    text, ids = encode(
        Control(vocab.TOOLS_START + f'{OPEN}call tool="f"{SEP}'),
        Control(f'{OPEN}argument key="o" type="object"{SEP}'),
        value,
        Control(vocab.ARGUMENT_END + vocab.CALL_END + vocab.TOOLS_END),
    )
    reader = ToolCallReader(id_atoms())
    (call,) = collect_calls(reader.feed(text, ids) + reader.finish())
    assert json.loads(call.arguments) == {"o": json.loads(value)}


def test_argument_without_key_and_mixed_forms_open_nothing_their_text_is_prose():
    json_block = f'{OPEN}json type="object"{SEP}{{"z": 1}}{vocab.JSON_END}'
    markup = _tools(
        _call("f", f'{OPEN}argument type="string"{SEP}kept{vocab.ARGUMENT_END}'),
        _call("g", _arg("a", "number", "1") + json_block, index=2),
        _call("h", json_block + _arg("a", "number", "2"), index=3),
    )
    read = read_tools(markup)
    calls, dropped = read.calls, read.dropped
    assert [(c.name, c.arguments) for c in calls] == [
        ("f", "{}"),
        ("g", '{"a": 1}'),
        ("h", '{"z": 1}'),
    ]
    assert read.prose == 'kept{"z": 1}2'
    assert [d.reason for d in dropped] == [
        "an argument without a key",
        "a json block after other arguments",
        "an argument after a json block",
    ]


def test_text_outside_calls_is_prose_and_unknown_elements_are_dropped():
    markup = _tools(
        f'junk {OPEN}note x="1"{SEP}kept{CLOSE}note{SEP}\n',
        _call("f", _arg("a", None, "1") + f" text {OPEN}hint{SEP}h{CLOSE}hint{SEP}"),
        f"\n  {vocab.ARGUMENT_END}{SEP}{CLOSE}",
    )
    read = read_tools(markup)
    assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [
        ("f", {"a": "1"})
    ]
    # Whitespace alone between elements is framing; runs with words keep theirs.
    assert read.prose == "junk kept text h"
    assert [d.reason for d in read.dropped] == [
        "an unknown element 'note'",
        "an unknown element 'hint'",
    ]


@pytest.mark.parametrize(
    ("cut_at", "arguments"),
    [
        (f'{OPEN}call tool="f" ind', None),
        (f'{OPEN}call tool="f"{SEP}', None),
        (
            f'{OPEN}call tool="f"{SEP}{OPEN}argument key="a"{SEP}half a val',
            '{"a": "half a val',
        ),
        (
            f'{OPEN}call tool="f"{SEP}{OPEN}argument key="a"{SEP}v{CLOSE}argu',
            '{"a": "v',
        ),
        (
            f'{OPEN}call tool="f"{SEP}{OPEN}argument key="a"{SEP}v{vocab.ARGUMENT_END}',
            '{"a": "v"',
        ),
        (
            f'{OPEN}call tool="f"{SEP}{OPEN}argument key="n" type="number"{SEP}1.',
            '{"n": 1.',
        ),
        (f'{OPEN}call tool="f"{SEP}{OPEN}json type="object"{SEP}{{"a":', '{"a":'),
    ],
)
def test_a_call_cut_off_is_a_cut_call_as_it_streamed(cut_at, arguments):
    markup = vocab.TOOLS_START + _call("done", "") + cut_at
    calls, dropped = read_calls(markup)
    expected = [("done", "{}", True)]
    if arguments is not None:
        expected.append(("f", arguments, False))
    assert [(c.name, c.arguments, c.complete) for c in calls] == expected
    assert collect_calls(_streamed(list(markup))) == calls
    named_only = cut_at.endswith(SEP) and "argument" not in cut_at
    assert [d.reason for d in dropped] == (
        ["a call cut off before its first argument"] if named_only else []
    )


def test_opener_interrupted_by_a_marker_is_text():
    markup = _tools(f'{OPEN}call tool="a"{OPEN}call tool="b"{SEP}{vocab.CALL_END}')
    read = read_tools(markup)
    assert [c.name for c in read.calls] == ["b"]
    assert read.prose == 'call tool="a"'
    assert [d.reason for d in read.dropped] == ["an opener that never completed"]


def test_an_opener_running_into_prose_is_text_at_once():
    reader = ToolCallReader()
    events = reader.feed(vocab.TOOLS_START + f'{OPEN}call tool="f" and then')
    assert events[-1] == Prose('call tool="f" and then')


def test_overlong_opener_is_text():
    markup = _tools(_call("x" * (MAX_TAG_CHARS + 1), ""), _call("ok", "", index=2))
    read = read_tools(markup)
    assert [c.name for c in read.calls] == ["ok"]
    assert read.prose.startswith('call tool="xxx')
    assert read.dropped[0].reason == "an opener that never completed"


def test_second_tools_channel_continues_the_numbering():
    markup = _tools(_call("a", "")) + "words" + _tools(_call("b", ""))
    calls, _ = read_calls(markup)
    assert [(c.index, c.name) for c in calls] == [(0, "a"), (1, "b")]


def test_duplicate_index_attributes_do_not_matter():
    markup = _tools(_call("a", "", index=1), _call("b", "", index=1))
    calls, _ = read_calls(markup)
    assert [(c.index, c.name) for c in calls] == [(0, "a"), (1, "b")]


def test_typed_value_json_rejects_non_json_constants():
    assert typed_value_json("-Infinity") == '"-Infinity"'
    assert typed_value_json("[1, 2]") == "[1, 2]"


# -- streaming ----------------------------------------------------------------------


def test_name_goes_out_when_the_first_argument_opener_completes():
    reader = ToolCallReader()
    assert reader.feed(vocab.TOOLS_START + f'{OPEN}call tool="write" index="1"') == []
    assert reader.feed(SEP + "\n" + f'{OPEN}argument key="a"') == []
    assert reader.feed(SEP) == [CallOpened(0, "write"), ArgumentsDelta(0, '{"a": "')]
    reader = ToolCallReader()
    reader.feed(vocab.TOOLS_START + f'{OPEN}call tool="ping"{SEP}')
    assert reader.feed(vocab.CALL_END) == [
        CallOpened(0, "ping"),
        ArgumentsDelta(0, "{}"),
        CallClosed(0),
    ]


def test_long_string_value_streams_in_pieces_as_it_arrives():
    value = ('line "quoted" \\ 思\n' * 6000)[:100_000]
    head = vocab.TOOLS_START + f'{OPEN}call tool="write"{SEP}'
    head += f'{OPEN}argument key="content" type="string"{SEP}'
    reader = ToolCallReader()
    events = reader.feed(head)
    assert events == [CallOpened(0, "write"), ArgumentsDelta(0, '{"content": "')]
    pieces = []
    for start in range(0, len(value), 1000):
        step = reader.feed(value[start : start + 1000])
        # Each piece goes out in the step it arrives in, JSON-escaped.
        assert all(type(event) is ArgumentsDelta for event in step)
        pieces += [event.text for event in step]
    assert len(pieces) >= 99
    tail = reader.feed(vocab.ARGUMENT_END + vocab.CALL_END) + reader.finish()
    assert tail == [ArgumentsDelta(0, '"}'), CallClosed(0)]
    streamed = '{"content": "' + "".join(pieces) + '"}'
    assert json.loads(streamed) == {"content": value}
    (whole,), _ = read_calls(head + value + vocab.ARGUMENT_END + vocab.CALL_END)
    assert streamed == whole.arguments


def test_every_chunking_gives_the_same_events_joined(chunk_all):
    markup = render_tools([("a", EVERY_TYPE), ("b", "{bad"), ("c", {})])
    whole, _ = read_calls(markup)
    for name, chunks in chunk_all(markup).items():
        assert collect_calls(_streamed(chunks)) == whole, name


# A tools channel built from every marker the reader knows, values and noise.
PIECES = [
    vocab.TOOLS_START,
    vocab.TOOLS_END,
    vocab.CALL_END,
    vocab.CALL_END_UNSEPARATED,
    vocab.ARGUMENT_END,
    vocab.JSON_END,
    vocab.MESSAGE_END,
    OPEN,
    CLOSE,
    SEP,
    'call tool="f"',
    'call tool="g&quot;" index="2"',
    "call",
    'argument key="k" type="string"',
    'argument key="n" type="number"',
    'argument key="o" type="object"',
    'argument type="array"',
    'json type="object"',
    "1",
    '{"a": [1',
    "]}",
    "text ",
    '"',
    "\\",
    "思",
    "\n",
    "<|",
    "|>",
]
MARKUP = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


def _cuts(text: str, data) -> list[str]:
    cuts = sorted(
        data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12))
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@given(MARKUP, st.data())
def test_any_markup_reads_the_same_at_any_chunking(markup, data):
    whole_events = _streamed([markup])
    chunked_events = _streamed(_cuts(markup, data))
    assert collect_calls(chunked_events) == collect_calls(whole_events)

    # The joined deltas of every call, closed or cut, agree too.
    def joined(events):
        out: dict[int, str] = {}
        for event in events:
            if type(event) is ArgumentsDelta:
                out[event.index] = out.get(event.index, "") + event.text
        return out

    assert joined(chunked_events) == joined(whole_events)


def _representable(max_size: int | None = None, min_size: int = 0):
    """Text the renderer can write raw: names, keys and string values that spell no
    K3 atom (in text a spelled atom is one; the renderer's token-level escape of
    user text has no text form)."""
    return st.text(min_size=min_size, max_size=max_size).filter(
        lambda text: not any(atom in text for atom in vocab.ADDED_TOKENS)
    )


@given(
    st.lists(
        st.tuples(
            _representable(min_size=1, max_size=8),
            st.dictionaries(
                _representable(max_size=6),
                st.recursive(
                    st.none()
                    | st.booleans()
                    | st.integers()
                    | st.floats(allow_nan=False, allow_infinity=False)
                    | _representable(),
                    lambda inner: (
                        st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=4), inner, max_size=3)
                    ),
                    max_leaves=8,
                ),
                max_size=5,
            ),
        ),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_rendered_calls_read_back_equal_at_any_chunking(calls, data):
    # The request declares the tools called, with their keys.
    grammar = grammar_for(
        [name for name, _ in calls],
        [key for _, arguments in calls for key in arguments],
    )
    markup = render_tools(calls)
    for chunks in ([markup], _cuts(markup, data)):
        got = collect_calls(_streamed(chunks, grammar))
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls


# -- bad input ----------------------------------------------------------------------


def test_ten_thousand_calls():
    markup = render_tools([(f"f{i}", {"i": i}) for i in range(10_000)])
    calls, dropped = read_calls(markup)
    assert len(calls) == 10_000 and dropped == []
    assert calls[-1] == ToolCall(9999, "f9999", '{"i": 9999}')


@given(st.text(max_size=200))
def test_arbitrary_text_never_raises(text):
    calls, _ = read_calls(vocab.TOOLS_START + text)
    for call in calls:
        assert isinstance(call.arguments, str)


@given(st.lists(st.sampled_from([*PIECES, "&amp;", "=", "'", " "]), max_size=60))
def test_garbage_attributes_never_raise(pieces):
    read_calls(vocab.TOOLS_START + "".join(pieces))


def test_feed_after_finish_is_an_error():
    reader = ToolCallReader()
    reader.finish()
    assert reader.finish() == []
    with pytest.raises(RuntimeError):
        reader.feed("x")


def test_dropped_events_name_their_call():
    markup = vocab.TOOLS_START + _call("f", f"{OPEN}argument{SEP}x{vocab.ARGUMENT_END}")
    _, dropped = read_calls(markup)
    assert dropped == [Dropped(0, "an argument without a key", "argument_without_key")]


# -- found in review ----------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1e400", "-1e999", '{"a": [1e400]}'])
def test_numbers_that_overflow_are_raw_strings(raw):
    markup = _tools(_call("f", _arg("x", "number", raw)))
    (call,), _ = read_calls(markup)
    assert "Infinity" not in call.arguments
    assert json.loads(call.arguments) == {"x": raw}


def test_escaped_lone_surrogates_stay_escaped():
    markup = _tools(_call("f", _arg("o", "object", '{"s": "\\ud800"}')))
    (call,), _ = read_calls(markup)
    call.arguments.encode("utf-8")  # a raw surrogate would not encode
    assert json.loads(call.arguments) == {"o": {"s": "\ud800"}}


def test_a_closer_that_begins_like_the_call_closer_is_an_unknown_element():
    body = _arg("a", "number", "1") + f"{OPEN}call_meta{SEP}x{CLOSE}call_meta{SEP}"
    body += _arg("b", "number", "2")
    assert _args_of(_tools(_call("f", body))) == [("f", {"a": 1, "b": 2})]
    # Fed one character at a time, the same.
    markup = _tools(_call("f", body))
    assert collect_calls(_streamed(list(markup))) == read_calls(markup)[0]


def test_an_overlong_call_opener_is_text_inside_the_open_call():
    markup = (
        vocab.TOOLS_START
        + f'{OPEN}call tool="a"{SEP}'
        + _arg("x", "number", "1")
        + f'{OPEN}call tool="{"y" * (MAX_TAG_CHARS + 1)}"{SEP}'
        + _arg("z", "number", "2")
        + vocab.CALL_END
        + vocab.TOOLS_END
    )
    read = read_tools(markup)
    assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [
        ("a", {"x": 1, "z": 2})
    ]
    assert read.dropped[0].reason == "an opener that never completed"


def test_a_tag_of_many_attributes_is_decided_without_retrying_them():
    """``tool`` and ``key`` attributes have their own patterns: were they also read
    as any attribute, a refused tag of 21 of them would be retried 2^21 ways (a
    stall of seconds per tag, which the slowest-tests list of each run shows)."""
    for attribute, count in (('key=""', 21), ('tool="a"', 16)):
        tag = TagText(opener=True)
        assert not tag.add("call" + f" {attribute}" * count + " !")
        tag = TagText(opener=True)
        assert tag.add("call" + f" {attribute}" * count + " k") and not tag.complete


def test_a_long_declared_name_is_read():
    name, key = "x" * 1000, "k " * 1500
    grammar = grammar_for([name], [key])
    assert grammar.max_tag_chars >= len(key) + 30
    assert _fed(f'call tool="{name}" index="1"', 7, grammar).complete
    assert _fed(f'argument key="{key}" type="string"', 7, grammar).complete
    assert not _fed(f'call tool="{name}y" index="1"', 7, grammar).complete
