"""ReasoningReader: pinned (reasoning, content) for every K3 shape and rule 1-7.

Each case is read whole and streamed at 1 character, 3 characters and a random split;
all must give the pinned result.
"""

from __future__ import annotations

import pytest

from tests.conftest import chunkings, read_streamed
from tests.support.k3_ids import Control, encode, id_atoms, token_chunks
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.marked import unmarked
from vllm_k3_plugin.format.reasoning import ReasoningReader, collect, read_whole
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy
from vllm_k3_plugin.format.vocab import (
    MESSAGE_END,
    RESPONSE_END,
    RESPONSE_START,
    SEP,
    THINK_END,
    THINK_END_UNSEPARATED,
    THINK_START,
    TOOLS_END,
    TOOLS_START,
)

THINK, RESPONSE = Channel.THINK, Channel.RESPONSE
CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
TOOLS = TOOLS_START + CALL + TOOLS_END
ANSWER_END = RESPONSE_END + MESSAGE_END

# name: (output, start, stopped, (reasoning, content), hold-back (reasoning, content))
CASES = {
    "answered normally": (
        f"Let me think.{THINK_END}{RESPONSE_START}Hi!{ANSWER_END}",
        THINK,
        True,
        ("Let me think.", "Hi!"),
        ("Let me think.", "Hi!"),
    ),
    "skipped channel: the closer at the end": (
        "The answer is 42." + RESPONSE_END,
        THINK,
        True,
        ("The answer is 42.", "The answer is 42."),
        ("", "The answer is 42."),
    ),
    "skipped channel: closer + framing": (
        "The answer is 42." + ANSWER_END,
        THINK,
        True,
        ("The answer is 42.", "The answer is 42."),
        ("", "The answer is 42."),
    ),
    "skipped channel: closer + whitespace": (
        f"Reply.{RESPONSE_END}\n{MESSAGE_END}\n",
        THINK,
        True,
        ("Reply.\n\n", "Reply.\n\n"),
        ("", "Reply.\n\n"),
    ),
    "skipped channel: closer cut mid-marker": (
        f"Reply.{RESPONSE_END}<|close|>mes",
        THINK,
        True,
        ("Reply.", "Reply."),
        ("", "Reply."),
    ),
    "closer then the think exit": (
        f"CoT ...{RESPONSE_END}{THINK_END}{RESPONSE_START}Final answer.{ANSWER_END}",
        THINK,
        True,
        ("CoT ...", "Final answer."),
        ("CoT ...", "Final answer."),
    ),
    "closer then a model-opened response": (
        f"CoT ...{RESPONSE_END}{RESPONSE_START}Final answer.{ANSWER_END}",
        THINK,
        True,
        ("CoT ...", "Final answer."),
        ("CoT ...", "Final answer."),
    ),
    "a quoted closer": (
        f"closes with {RESPONSE_END} so{THINK_END}{RESPONSE_START}ok{ANSWER_END}",
        THINK,
        True,
        (f"closes with {RESPONSE_END} so", "ok"),
        (f"closes with {RESPONSE_END} so", "ok"),
    ),
    "a self-opened channel with thinking off": (
        f"{THINK_START}Reply.{ANSWER_END}",
        RESPONSE,
        True,
        ("Reply.", "Reply."),
        ("", "Reply."),
    ),
    "a self-opened channel answered normally": (
        f"{THINK_START}hmm{THINK_END}{RESPONSE_START}Yes.{ANSWER_END}",
        RESPONSE,
        True,
        ("hmm", "Yes."),
        ("hmm", "Yes."),
    ),
    "a duplicate think opener": (
        f"{THINK_START}hmm{THINK_END}{RESPONSE_START}Yes.{ANSWER_END}",
        THINK,
        True,
        ("hmm", "Yes."),
        ("hmm", "Yes."),
    ),
    "tools at offset 0 with thinking off": (
        TOOLS + MESSAGE_END,
        RESPONSE,
        True,
        ("", ""),
        ("", ""),
    ),
    "thinking off: declined to think at offset 0": (
        f"{THINK_END}Hello.{ANSWER_END}",
        RESPONSE,
        True,
        ("", "Hello."),
        ("", "Hello."),
    ),
    "length cut after the closer": (
        f"I will end with {RESPONSE_END}\n",
        THINK,
        False,
        ("I will end with \n", ""),
        ("I will end with \n", ""),
    ),
    "stop after the closer": (
        f"I will end with {RESPONSE_END}\n",
        THINK,
        True,
        ("I will end with \n", "I will end with \n"),
        ("", "I will end with \n"),
    ),
    "EOS with no closer stays reasoning": (
        "thinking and thinking" + MESSAGE_END,
        THINK,
        True,
        ("thinking and thinking", ""),
        ("thinking and thinking", ""),
    ),
    "empty output": ("", THINK, True, ("", ""), ("", "")),
    "empty output, thinking off": ("", RESPONSE, True, ("", ""), ("", "")),
    "tools channel inside think, no exit": (
        "I should call." + TOOLS + MESSAGE_END,
        THINK,
        True,
        ("I should call.", ""),
        ("I should call.", ""),
    ),
    "skipped channel followed by tools": (
        "Here you go." + RESPONSE_END + TOOLS + MESSAGE_END,
        THINK,
        True,
        ("Here you go.", "Here you go."),
        ("", "Here you go."),
    ),
    "skipped channel followed by tools, then a length cut": (
        "Here you go." + RESPONSE_END + TOOLS_START + CALL[:20],
        THINK,
        False,
        ("Here you go.", "Here you go."),
        ("", "Here you go."),
    ),
    "the think closer without its separator": (
        f"hmm{THINK_END_UNSEPARATED}{RESPONSE_START}Yes.{ANSWER_END}",
        THINK,
        True,
        ("hmm", "Yes."),
        ("hmm", "Yes."),
    ),
    "a call after the reply": (
        f"plan{THINK_END}{RESPONSE_START}Calling.{RESPONSE_END}{TOOLS}{MESSAGE_END}",
        THINK,
        True,
        ("plan", "Calling."),
        ("plan", "Calling."),
    ),
    "a length cut mid-marker in content": (
        f"plan{THINK_END}{RESPONSE_START}Answer<|close|>resp",
        THINK,
        False,
        ("plan", "Answer"),
        ("plan", "Answer"),
    ),
    "a skipped channel that quoted a closer replays without it": (
        f"It ends with {RESPONSE_END} here.{RESPONSE_END}{MESSAGE_END}",
        THINK,
        True,
        (f"It ends with {RESPONSE_END} here.", "It ends with  here."),
        ("", "It ends with  here."),
    ),
    "a reply ending in a bare prefix of an atom keeps it": (
        f"plan{THINK_END}{RESPONSE_START}Use a <",
        THINK,
        False,
        ("plan", "Use a <"),
        ("plan", "Use a <"),
    ),
    "framing inside the thought is dropped": (
        f"a{MESSAGE_END}b<|sep|>c{THINK_END}{RESPONSE_START}d{SEP}e",
        THINK,
        True,
        ("abc", "de"),
        ("abc", "de"),
    ),
    "a closer the channel goes on past, then EOS": (
        f"draft{RESPONSE_END}\nmore thought{MESSAGE_END}",
        THINK,
        True,
        (f"draft{RESPONSE_END}\nmore thought", ""),
        (f"draft{RESPONSE_END}\nmore thought", ""),
    ),
    "two closers at the end": (
        f"Reply.{RESPONSE_END}{RESPONSE_END}{MESSAGE_END}",
        THINK,
        True,
        ("Reply.", "Reply."),
        ("", "Reply."),
    ),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("policy", list(ReplayPolicy), ids=lambda p: p.value)
def test_pinned_shape(name, policy):
    output, start, stopped, replayed, held = CASES[name]
    expected = replayed if policy is ReplayPolicy.REPLAY else held
    whole = read_whole(output, start=start, stopped=stopped, policy=policy)
    assert (whole.reasoning, whole.content) == expected
    for chunking, chunks in chunkings(output).items():
        streamed = read_streamed(chunks, start, stopped, policy)
        assert streamed == whole, chunking


def test_tool_markup_is_handed_over_raw():
    reading = read_whole(
        "x" + RESPONSE_END + TOOLS + MESSAGE_END, start=THINK, stopped=True
    )
    assert unmarked(reading.tool_markup) == TOOLS


def test_stopped_is_required():
    reader = ReasoningReader()
    with pytest.raises(TypeError):
        reader.finish()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        read_whole("x")  # type: ignore[call-arg]


def test_reasoning_streams_live_under_replay_and_is_held_under_hold_back():
    live = ReasoningReader(policy=ReplayPolicy.REPLAY)
    held = ReasoningReader(policy=ReplayPolicy.HOLD_BACK)
    assert collect(live.feed("step one, ")).reasoning == "step one, "
    assert collect(held.feed("step one, ")).reasoning == ""
    assert collect(held.feed(THINK_END)).reasoning == "step one, "


def test_the_kept_channel_is_dropped_when_decided():
    reader = ReasoningReader()
    reader.feed("x" * 10_000)
    assert reader._kept is not None
    reader.feed(THINK_END)
    assert reader._kept is None


def test_text_on_two_sides_of_dropped_framing_is_joined_as_written():
    """Dropped control framing leaves the model's text as it wrote it: BPE pieces on
    its two sides that spell an atom together are text (structure comes from ids)."""
    text, ids = encode(
        "x<|close|",
        Control(THINK_END),
        ">y",
        Control(RESPONSE_END + MESSAGE_END),
    )
    for chunks in ([(text, ids)], token_chunks(ids)):
        reader = ReasoningReader(start=Channel.RESPONSE, atoms=id_atoms())
        events = [e for chunk in chunks for e in reader.feed(*chunk)]
        events += reader.finish(stopped=True)
        assert collect(events).content == "x<|close|>y"
