"""A built-in corpus of K3 output shapes: the ones seen in the wild and the contract's
edge cases (K3_FORMAT.md). `vllm-k3 replay` replays them; the server tests force them.

Each output is the model's text with every marker kept and without the stop token;
how it ended (stop token or ``max_tokens`` cut) is chosen by whoever replays it. Its
atom strings are control tokens, except inside ``BPE_TEXT``: text a model quotes,
written in BPE pieces (``output_ids`` encodes them so).
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.vocab import (
    CLOSE,
    MESSAGE_END,
    RESPONSE_END,
    RESPONSE_START,
    THINK_END,
    THINK_END_UNSEPARATED,
    THINK_START,
    TOOLS_END,
    TOOLS_START,
)
from vllm_k3_plugin.format.xtml import render_tools


class Shape(NamedTuple):
    output: str
    thinking: bool
    """The request's thinking switch: the prompt ends inside ``think`` or not."""
    note: str


SKIPPED_REPLY = "The answer is 4."
WEATHER_CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    "<|close|>call<|sep|>"
)
# The tool the tool shapes call, as a request declares it.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# A tool whose arguments take every JSON type.
FILE_TOOL = {
    "type": "function",
    "function": {
        "name": "write_file",
        "description": "Write a file",
        "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string"},
                "content": {"type": "string"},
                "overwrite": {"type": "boolean"},
                "mode": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "meta": {"type": "object"},
                "owner": {"type": "null"},
            },
            "required": ["path", "content"],
        },
    },
}
TOOLS = [WEATHER_TOOL, FILE_TOOL]
FILE_ARGUMENTS = {
    "path": "notes/a&b.txt",
    "content": 'line one\n  "quoted" \\ 思考\n<|close|>response (quoted)',
    "overwrite": True,
    "mode": 420,
    "tags": ["x", "y"],
    "meta": {"by": "k3", "n": [1, 2.5, None]},
    "owner": None,
}
# A ``json`` block (the renderer's form for arguments it could not type): read back
# verbatim as the arguments text.
RAW_ARGUMENTS = '{"city":"Lyon","days":3}'
QUOTED_JSON = '{"open": "<|open|>response<|sep|>"}'
# Text of the shapes that a model writes in BPE pieces although it spells markers.
BPE_TEXT = (FILE_ARGUMENTS["content"], QUOTED_JSON)
MULTI_CALLS = render_tools(
    [
        ("get_weather", {"city": "Paris"}),
        ("write_file", FILE_ARGUMENTS),
        ("get_weather", RAW_ARGUMENTS),
    ]
)
_FINAL = RESPONSE_START + "Final." + RESPONSE_END + MESSAGE_END
# A call opener whose tool name runs into prose (other engines' test shapes).
RUNAWAY_OPENER = '<|open|>call tool="search'
RUNAWAY_PROSE = (
    " and then the parameters. I will look the city up first, then compare the"
    " forecasts for the next three days, and only after that decide which of the"
    " two trips makes sense; nothing here is a tool call, it is the plan written"
    " out in words, long enough that a reader waiting for the tag to finish would"
    " hold all of it back."
)
UNFINISHED_CALL_THOUGHT = "… but no."
_CALL_OPEN = '<|open|>call tool="get_weather" index="1"<|sep|>'
_CITY_OPEN = '<|open|>argument key="city" type="string"<|sep|>'

SHAPES: dict[str, Shape] = {
    "think-then-reply": Shape(
        "Let me think."
        + THINK_END
        + RESPONSE_START
        + "Hello!"
        + RESPONSE_END
        + MESSAGE_END,
        True,
        "the well-formed reply",
    ),
    "skipped-channel": Shape(
        SKIPPED_REPLY + RESPONSE_END + MESSAGE_END,
        True,
        "the reply written inside the think channel (about 1 in 5 at 1M context)",
    ),
    "closer-at-end": Shape(
        "Reply." + RESPONSE_END, True, "a skipped channel without the message closer"
    ),
    "closer-whitespace": Shape(
        "Reply." + RESPONSE_END + "\n" + MESSAGE_END,
        True,
        "a skipped channel, whitespace after its closer",
    ),
    "quoted-closer": Shape(
        "He wrote " + RESPONSE_END + " then more." + THINK_END + _FINAL,
        True,
        "a closer quoted mid-thought",
    ),
    "closer-then-think-exit": Shape(
        "Draft." + RESPONSE_END + THINK_END + _FINAL,
        True,
        "an answer closer, then the think exit: the model answers in its channel",
    ),
    "closer-then-response-open": Shape(
        "Draft." + RESPONSE_END + _FINAL,
        True,
        "an answer closer, then a model-opened response",
    ),
    "unseparated-think-exit": Shape(
        "Thought." + THINK_END_UNSEPARATED + _FINAL,
        True,
        "the think closer missing its separator, then the next channel",
    ),
    "self-opened-response": Shape(
        "Thought." + _FINAL, True, "a model-opened response with no think exit"
    ),
    "no-closer": Shape("Just thinking", True, "thought only, no closer"),
    "closer-cut-mid-marker": Shape(
        "Reply." + CLOSE + "response", True, "the output cut inside the closer"
    ),
    "skipped-then-tools": Shape(
        SKIPPED_REPLY + RESPONSE_END + TOOLS_START + WEATHER_CALL + TOOLS_END,
        True,
        "a skipped channel followed by a tools channel",
    ),
    "reply-then-calls": Shape(
        "Two lookups and a file."
        + THINK_END
        + RESPONSE_START
        + "On it."
        + RESPONSE_END
        + MULTI_CALLS
        + MESSAGE_END,
        True,
        "a reply, then three calls: every argument type and a json block",
    ),
    "tools-in-think": Shape(
        "Need the weather." + TOOLS_START + WEATHER_CALL + TOOLS_END + MESSAGE_END,
        True,
        "a tools channel opened inside think, no think exit",
    ),
    "quoted-tools-opener": Shape(
        "The section starts with "
        + TOOLS_START
        + " and lists the calls."
        + RESPONSE_END
        + MESSAGE_END,
        False,
        "a tools opener quoted in the reply (words follow it, not a call)",
    ),
    "bpe-markers": Shape(
        "Use " + QUOTED_JSON + " here." + RESPONSE_END + MESSAGE_END,
        False,
        "marker characters the model wrote in BPE pieces: text",
    ),
    "prose-between-calls": Shape(
        RESPONSE_END
        + TOOLS_START
        + WEATHER_CALL
        + "Then again:"
        + WEATHER_CALL
        + "\nDone."
        + TOOLS_END
        + MESSAGE_END,
        False,
        "text in the tools channel between and after calls",
    ),
    "think-between-calls": Shape(
        "Need data."
        + TOOLS_START
        + WEATHER_CALL
        + THINK_START
        + " Between."
        + THINK_END
        + TOOLS_END
        + " Resumed."
        + THINK_END
        + _FINAL,
        True,
        "a think block between calls, and the interrupted think channel resumed",
    ),
    "markup-in-value": Shape(
        RESPONSE_END
        + TOOLS_START
        + _CALL_OPEN
        + _CITY_OPEN
        + "Par"
        + TOOLS_START
        + WEATHER_CALL
        + TOOLS_END
        + MESSAGE_END,
        False,
        "control markup inside a value: it ends the value and the call",
    ),
    "runaway-call-opener": Shape(
        "Let me answer." + RUNAWAY_OPENER + RUNAWAY_PROSE,
        False,
        "a call opener in the reply whose tool name runs into prose to the end",
    ),
    "runaway-call-opener-in-tools": Shape(
        "Let me answer."
        + RESPONSE_END
        + TOOLS_START
        + RUNAWAY_OPENER
        + RUNAWAY_PROSE
        + TOOLS_END
        + MESSAGE_END,
        False,
        "the same inside a tools channel",
    ),
    "think-text-in-unfinished-call": Shape(
        "I could emit "
        + TOOLS_START
        + _CALL_OPEN
        + UNFINISHED_CALL_THOUGHT
        + THINK_END
        + RESPONSE_START
        + "Answer."
        + RESPONSE_END
        + MESSAGE_END,
        True,
        "a tools channel in the thought holding a call opener and no argument",
    ),
    "thinking-off": Shape(
        "Hi there." + RESPONSE_END + MESSAGE_END, False, "thinking off, a plain reply"
    ),
    "thinking-off-tools": Shape(
        TOOLS_START + WEATHER_CALL + TOOLS_END + MESSAGE_END,
        False,
        "thinking off, tools at offset 0",
    ),
    "thinking-off-self-opened-think": Shape(
        THINK_START + "hmm" + THINK_END + _FINAL.replace("Final.", "Ok."),
        False,
        "thinking off, the model opens a think channel anyway",
    ),
    "thinking-off-declined-think": Shape(
        THINK_END + _FINAL.replace("Final.", "Ok."),
        False,
        "thinking off, a think closer first",
    ),
}


@functools.cache
def _encoding():
    from vllm_k3_plugin.tools.tokenizer import load_tiktoken_encoding

    return load_tiktoken_encoding()


_BPE_SPLIT = re.compile("(" + "|".join(map(re.escape, BPE_TEXT)) + ")").split


def output_ids(output: str, *, stop: bool) -> list[int]:
    """The token ids the model wrote ``output`` as: atom strings are control ids,
    except inside ``BPE_TEXT``; the stop token last when ``stop``."""
    encoding = _encoding()
    ids: list[int] = []
    for index, part in enumerate(_BPE_SPLIT(output)):
        if index & 1:
            ids += encoding.encode(part, disallowed_special=())
        else:
            ids += encoding.encode(part, allowed_special="all")
    return [*ids, vocab.END_OF_MSG_ID] if stop else ids
