"""Property tests of the reading contract on (text, ids), with the real Kimi BPE.

Outputs come from a grammar: think and response text, channel markers in any order
and repeated, tools channels with calls of every value type, prose and think blocks
between calls, control markup inside values, quoted openers and closers, lone atoms,
and marker characters spelled in BPE pieces anywhere. Each is cut at a random token
position (``max_tokens``) or ended by the stop token, and read whole, one token at a
time, in random multi-token steps, and with the text lagging its ids (vLLM holds text
back for stop strings). For every output:

(a) every streamed reading equals the whole reading: reasoning, content, calls (names,
    arguments, cut or closed) and the finish reason;
(b) conservation: the characters of the model's text (every piece not written as
    control structure, cut where the output was cut) are exactly what the client got,
    each once: reasoning + content + the argument values. A whitespace character may
    be consumed as framing (whitespace alone between elements: whether it is depends
    on the channel the reader is in, which the grammar does not track), but is never
    sent twice or invented; every other character arrives. Accounting: the hold-back
    policy is used, so a skipped channel is sent once (replay sends it twice by
    design); a quoted answer closer is control structure the model went on past and
    may reach reasoning as its atom strings; argument values are read back from the
    JSON (strings unescaped; typed values are integers, which JSON writes unchanged;
    a ``json`` block, keyed ``jk``, is the arguments text itself);
(c) no control markup reaches content or arguments: no internal mark anywhere, and
    no atom string in content or arguments unless the model's text spelled one.
"""

from __future__ import annotations

import codecs
import collections
import json
import random
from typing import NamedTuple

from hypothesis import given
from hypothesis import strategies as st

from tests.support.k3_ids import atom_tokens, encoding
from vllm_k3_plugin.format import marked, vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.output import (
    OutputReader,
    OutputReading,
    collect_output,
    finish_reason,
)
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy
from vllm_k3_plugin.format.xtml import escape_attribute, grammar_for

OPEN, CLOSE, SEP = vocab.OPEN, vocab.CLOSE, vocab.SEP
ATOMS = (OPEN, CLOSE, SEP, vocab.END_OF_MSG)
ELEMENT_KEYS = ("path", "n", "q")
JSON_BLOCK_KEY = "jk"


class Piece(NamedTuple):
    text: str
    kind: str  # "text": the model's words; "framing": whitespace between elements;
    # "control": structure, its atoms control ids


def text(value: str) -> Piece:
    return Piece(value, "text")


def framing(value: str) -> Piece:
    return Piece(value, "framing")


def control(value: str) -> Piece:
    return Piece(value, "control")


# -- the grammar --------------------------------------------------------------------

BPE_MARKERS = [
    vocab.THINK_END,
    vocab.RESPONSE_START,
    vocab.RESPONSE_END,
    vocab.TOOLS_START,
    vocab.TOOLS_END,
    vocab.CALL_END,
    vocab.ARGUMENT_END,
    vocab.MESSAGE_END,
    '<|open|>call tool="evil" index="1"<|sep|>',
    '<|open|>argument key="x" type="string"<|sep|>',
    *ATOMS,
    "<|clo",
    "se|>",
]
words = st.text(alphabet='ab \n\t"\\é思😀<|>', max_size=6)
prose = st.lists(st.one_of(words, st.sampled_from(BPE_MARKERS)), max_size=4).map(
    "".join
)
prose_with_words = prose.map(lambda value: value + "w" if value.isspace() else value)
spaces = st.sampled_from(["\n", " ", "\n  "])

CHANNEL_MARKERS = [
    vocab.THINK_END,
    vocab.RESPONSE_START,
    vocab.RESPONSE_END,
    vocab.THINK_START,
    vocab.MESSAGE_END,
    vocab.TOOLS_END,
    vocab.TOOLS_START,  # quoted: words follow
    vocab.CALL_END,
    vocab.ASSISTANT_START,
    vocab.THINK_END_UNSEPARATED + vocab.RESPONSE_START,
]


STRAY_ELEMENTS = [
    (f'{OPEN}json type="object"{SEP}', vocab.JSON_END),
    (f'{OPEN}argument key="k" type="string"{SEP}', vocab.ARGUMENT_END),
    (f'{OPEN}note id="1"{SEP}', f"{CLOSE}note{SEP}"),
    (f"{CLOSE}thinking{SEP}", ""),
]


class Segment(NamedTuple):
    pieces: list[Piece]


@st.composite
def loose_segment(draw):
    """Text or a channel marker outside any tools channel the grammar opens."""
    choice = draw(st.integers(0, 6))
    if choice <= 1:
        return Segment([text(draw(prose))])
    if choice <= 3:
        pieces = [control(draw(st.sampled_from(CHANNEL_MARKERS)))]
        if pieces[0].text == vocab.TOOLS_START:
            pieces.append(text(draw(prose_with_words).lstrip() or "w"))
        return Segment(pieces)
    if choice == 4:
        # A lone atom, or an opener that runs into prose (a space right after a lone
        # atom means no tag can start there).
        atom = draw(st.sampled_from(ATOMS))
        tail = draw(st.sampled_from([" then", ' call tool="x" then', " "]))
        if atom == OPEN and draw(st.booleans()):
            return Segment([control(OPEN), text('call tool="x" and then')])
        if atom == CLOSE and draw(st.booleans()):
            # A closer's name that runs into words: not a tag.
            return Segment([control(CLOSE), text("thinking about it")])
        return Segment([control(atom), text(tail)])
    if choice == 5:
        opener, closer = draw(st.sampled_from(STRAY_ELEMENTS))
        body = draw(prose)
        if opener.startswith(f"{OPEN}json"):
            # Written as the calls' json blocks are: after a call the output left
            # open, it is that call's arguments.
            body = json.dumps({JSON_BLOCK_KEY: body}, ensure_ascii=False)
        pieces = [control(opener), text(body)]
        if closer:
            pieces.append(control(closer))
        return Segment(pieces)
    return Segment(draw(tools_channel()))


@st.composite
def value_element(draw):
    kind = draw(st.sampled_from(["string", "number", "json", "untyped"]))
    key = draw(st.sampled_from(ELEMENT_KEYS))
    if kind == "json":
        raw = json.dumps({JSON_BLOCK_KEY: draw(prose)}, ensure_ascii=False)
        return (
            [
                control(f'{OPEN}json type="object"{SEP}'),
                text(raw),
                control(vocab.JSON_END),
            ],
            True,
        )
    if kind == "number":
        opener = f'{OPEN}argument key="{key}" type="number"{SEP}'
        value = str(draw(st.integers(-(10**6), 10**6)))
    else:
        type_attr = ' type="string"' if kind == "string" else ""
        opener = f'{OPEN}argument key="{key}"{type_attr}{SEP}'
        value = draw(prose)
    pieces = [control(opener), text(value)]
    ending = draw(st.integers(0, 9))
    closed = ending != 1
    if ending == 0:
        # Control markup inside the value (it ends the value, and maybe the call).
        pieces.append(
            control(
                draw(
                    st.sampled_from(
                        [
                            vocab.RESPONSE_END + vocab.MESSAGE_END,
                            vocab.TOOLS_START,
                            vocab.CALL_END,
                            SEP,
                        ]
                    )
                )
            )
        )
        closed = pieces[-1].text != SEP  # a lone separator is dropped, not an end
    elif closed:
        pieces.append(control(vocab.ARGUMENT_END))
    return pieces, closed


# The tools the outputs call, all declared by the request (one has a name the generic
# tag grammar refuses: it holds spaces).
CALLED_TOOLS = ("get_weather", "write", 'say "hi" & go')
GRAMMAR = grammar_for(CALLED_TOOLS, ())


@st.composite
def call(draw, number):
    name = draw(st.sampled_from(CALLED_TOOLS))
    pieces = [
        control(f'{OPEN}call tool="{escape_attribute(name)}" index="{number}"{SEP}')
    ]
    if draw(st.booleans()):
        pieces.append(framing(draw(spaces)))
    # Argument elements, json blocks, or both mixed (the openers that mix them are
    # dropped, their text is content).
    elements = draw(st.lists(value_element(), max_size=3))
    for element, closed in elements:
        pieces += element
        # Whitespace after a value still open is the value's text: none there.
        if closed and draw(st.booleans()):
            pieces.append(framing(draw(spaces)))
    if draw(st.integers(0, 5)):
        pieces.append(control(vocab.CALL_END))
    return pieces


@st.composite
def tools_channel(draw):
    pieces = [control(vocab.TOOLS_START)]
    if draw(st.booleans()):
        pieces.append(framing(draw(spaces)))
    for number in range(1, draw(st.integers(1, 3)) + 1):
        pieces += draw(call(number))
        between = draw(st.integers(0, 4))
        if between == 1:
            pieces.append(framing(draw(spaces)))
        elif between == 2:
            pieces.append(text(draw(prose_with_words)))
        elif between == 3:
            pieces += [
                control(vocab.THINK_START),
                text(draw(prose)),
                control(vocab.THINK_END),
            ]
    if draw(st.booleans()):
        pieces.append(control(vocab.TOOLS_END))
    return pieces


@st.composite
def outputs(draw):
    segments = draw(st.lists(loose_segment(), max_size=6))
    return [piece for segment in segments for piece in segment.pieces]


# -- encoding, cutting, reading -----------------------------------------------------


class Output(NamedTuple):
    ids: list[int]
    text_chars: str  # the model's text, as cut
    framing_chars: str  # whitespace written between elements: may arrive as text
    has_atom_text: bool  # whether the model's text spells any atom character
    quoted_closers: int  # control answer closers: each may reach reasoning as text
    stopped: bool


def build(pieces: list[Piece], cut: int | None) -> Output:
    enc = encoding()
    ids: list[int] = []
    spans = []
    for piece in pieces:
        if piece.kind == "control":
            piece_ids = enc.encode(piece.text, allowed_special="all")
        else:
            piece_ids = enc.encode(piece.text, disallowed_special=())
        spans.append((piece, len(ids), len(ids) + len(piece_ids)))
        ids += piece_ids
    stopped = cut is None
    end = len(ids) if stopped else min(cut, len(ids))
    for index, (_, start, stop) in enumerate(spans):
        if start < end < stop and index and spans[index - 1][0].text in (OPEN, CLOSE):
            # Cut inside the words after a lone atom, they may be the start of an
            # element's tag (a cut marker, dropped): cut before them.
            end = start
    chars = []
    for index, (piece, start, stop) in enumerate(spans):
        if start >= end:
            break
        counts = piece.kind == "text"
        if (
            piece.kind == "framing"
            and spans[index - 1][0].text == vocab.TOOLS_START
            and index + 1 < len(spans)
        ):
            # Whitespace after a tools opener is framing once a call opener follows;
            # cut before that, the opener was quoted and the whitespace is text.
            _, next_start, next_stop = spans[index + 1]
            after = enc.decode(ids[next_start : min(next_stop, end)])
            counts = not after.startswith(vocab.CALL_START_UNWRAPPED)
        if counts:
            chars.append(enc.decode(ids[start : min(stop, end)]))
    model_text = "".join(chars)
    framing_text = "".join(
        piece.text
        for piece, start, _ in spans
        if piece.kind == "framing" and start < end
    )
    closers = sum(
        piece.text.count(vocab.RESPONSE_END)
        for piece, start, _ in spans
        if piece.kind == "control" and start < end
    )
    out_ids = ids[:end] + ([vocab.END_OF_MSG_ID] if stopped else [])
    return Output(
        out_ids,
        model_text,
        framing_text,
        any(ch in model_text for ch in "<|>"),
        closers,
        stopped,
    )


def detokenize(ids: list[int], steps: list[int], stopped: bool, lag: int = 0):
    """``(text, ids)`` per engine step as vLLM hands them over: characters split across
    tokens come whole; the stop token ending the output has no text; with ``lag``, the
    text of the last ``lag`` characters waits a step (a stop string's hold-back)."""
    enc = encoding()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chunks, pending, at = [], "", 0
    for index, size in enumerate(steps):
        step_ids = ids[at : at + size]
        at += size
        for position, token in enumerate(step_ids, at - size):
            if not (stopped and position == len(ids) - 1):
                pending += decoder.decode(enc.decode_single_token_bytes(token))
        last = index == len(steps) - 1
        if last:
            pending += decoder.decode(b"", final=True)
        release = len(pending) if last else max(0, len(pending) - lag)
        chunks.append((pending[:release], step_ids))
        pending = pending[release:]
    return chunks


def read(chunks, start, policy, stopped) -> OutputReading:
    reader = OutputReader(start, policy, marked.IdAtoms(atom_tokens()), grammar=GRAMMAR)
    events = []
    for chunk_text, chunk_ids in chunks:
        events += reader.feed(chunk_text, chunk_ids)
    events += reader.finish(stopped=stopped)
    return collect_output(events)


def random_steps(total: int, rng: random.Random) -> list[int]:
    steps = []
    while total > 0:
        size = min(total, rng.randint(1, 6))
        steps.append(size)
        total -= size
    return steps or [0]


def argument_values(arguments: str) -> str:
    """The model's text inside one call's arguments (see the module docstring):
    ``{"key": value, ...}``, possibly cut anywhere after a value's first character."""
    block_start = '{"' + JSON_BLOCK_KEY + '"'
    if block_start.startswith(arguments[: len(block_start)]):
        return arguments  # a json block (an element's key is written whole)
    decoder = json.JSONDecoder()
    values, at = [], 1
    assert arguments[0] == "{", arguments
    while at < len(arguments) and arguments[at] != "}":
        at = arguments.index('"', at)
        _, at = decoder.raw_decode(arguments, at)  # the key: framing
        assert arguments[at : at + 2] == ": ", arguments
        at += 2
        try:
            value, end = decoder.raw_decode(arguments, at)
            complete = arguments[end:] in ("", "}") or arguments[end : end + 2] == ", "
        except ValueError:
            complete = False
        if not complete:  # cut inside the last value: a typed one's raw text
            rest = arguments[at:]
            values.append(json.loads(rest + '"') if rest.startswith('"') else rest)
            break
        values.append(value if isinstance(value, str) else json.dumps(value))
        at = end + 2 if arguments[end : end + 2] == ", " else end
    return "".join(values)


def reply_finish_reason(reading: OutputReading, stopped: bool) -> str:
    closed = sum(call.complete for call in reading.calls)
    return finish_reason(
        "stop" if stopped else "length", closed, len(reading.calls) - closed
    )


# -- the properties -----------------------------------------------------------------


@given(
    outputs(),
    st.sampled_from([Channel.THINK, Channel.RESPONSE]),
    st.one_of(st.none(), st.integers(0, 400)),
    st.sampled_from(list(ReplayPolicy)),
    st.randoms(use_true_random=False),
)
def test_streamed_equals_whole_and_every_character_arrives_once(
    pieces, start, cut, policy, rng
):
    output = build(pieces, cut)
    ids = output.ids
    stopped = output.stopped
    whole = read(detokenize(ids, [len(ids)], stopped), start, policy, stopped)
    chunkings = {
        "token": detokenize(ids, [1] * len(ids), stopped),
        "random": detokenize(ids, random_steps(len(ids), rng), stopped),
        "lagged": detokenize(
            ids, random_steps(len(ids), rng), stopped, lag=rng.randint(1, 9)
        ),
    }
    for name, chunks in chunkings.items():
        streamed = read(chunks, start, policy, output.stopped)
        assert streamed == whole, name
    assert reply_finish_reason(whole, output.stopped) == reply_finish_reason(
        streamed, output.stopped
    )
    if whole.calls and any(not call.complete for call in whole.calls):
        assert reply_finish_reason(whole, output.stopped) != "tool_calls"

    # (c) no mark escapes; no atom string unless the model's text spelled one.
    values = "".join(argument_values(call.arguments) for call in whole.calls)
    delivered = [whole.reasoning, whole.content, values]
    delivered += [call.arguments for call in whole.calls]
    delivered += [call.name for call in whole.calls]
    assert not any(mark in field for field in delivered for mark in marked.MARKS)
    if not output.has_atom_text:
        for field in (whole.content, values):
            assert not any(atom in field for atom in ATOMS)

    if policy is not ReplayPolicy.HOLD_BACK:
        return
    # (b) conservation, once each.
    got = collections.Counter(whole.reasoning + whole.content + values)
    want = collections.Counter(output.text_chars)
    lost = want - got
    assert all(ch.isspace() for ch in lost), f"lost: {''.join(lost.elements())!r}"
    # Anything more is whole quoted answer closers, at most one per control closer.
    extra = got - want - collections.Counter(output.framing_chars)
    closer = collections.Counter(vocab.RESPONSE_END)
    assert any(
        extra == collections.Counter({ch: n * k for ch, n in closer.items()})
        for k in range(output.quoted_closers + 1)
    ), f"sent twice or invented: {extra}"
