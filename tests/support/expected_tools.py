"""What each tool shape of ``vllm_k3_plugin.tools.shapes`` reads as when the model
stopped itself: ``(reasoning, content, calls)``, each call ``(name, arguments
text)``; and a conversation whose first turn made calls, for the ids of the next."""

from __future__ import annotations

import json

from vllm_k3_plugin.tools.shapes import (
    FILE_ARGUMENTS,
    RAW_ARGUMENTS,
    RUNAWAY_PROSE,
    SKIPPED_REPLY,
    UNFINISHED_CALL_THOUGHT,
)

WEATHER = ("get_weather", '{"city": "Paris"}')
MULTI = (
    WEATHER,
    ("write_file", json.dumps(FILE_ARGUMENTS, ensure_ascii=False)),
    ("get_weather", RAW_ARGUMENTS),
)
TOOL_SHAPES = {
    "reply-then-calls": ("Two lookups and a file.", "On it.", MULTI),
    "skipped-then-tools": (SKIPPED_REPLY, SKIPPED_REPLY, (WEATHER,)),
    "tools-in-think": ("Need the weather.", "", (WEATHER,)),
    "thinking-off-tools": ("", "", (WEATHER,)),
    "prose-between-calls": ("", "Then again:\nDone.", (WEATHER, WEATHER)),
    "think-between-calls": ("Need data. Between. Resumed.", "Final.", (WEATHER,)),
    "markup-in-value": ("", "", (("get_weather", '{"city": "Par"}'), WEATHER)),
}


# Shapes with a call opener that opens no call: ``(reasoning, content)``. The
# opener's atom is dropped; the text after it stays where it was written.
NO_CALL_SHAPES = {
    "runaway-call-opener": ("", 'Let me answer.call tool="search' + RUNAWAY_PROSE),
    "runaway-call-opener-in-tools": (
        "",
        'Let me answer.call tool="search' + RUNAWAY_PROSE,
    ),
    "think-text-in-unfinished-call": (
        "I could emit " + UNFINISHED_CALL_THOUGHT,
        "Answer.",
    ),
}


def parsed(calls) -> tuple:
    """``calls`` as a client reads them: arguments parsed."""
    return tuple((name, json.loads(arguments)) for name, arguments in calls)


def history_with_calls(count: int) -> list[dict]:
    """A first turn that called ``get_weather`` ``count`` times (ids
    ``functions.get_weather:0`` on), and the results: the next call is number
    ``count``."""
    ids = [f"functions.get_weather:{n}" for n in range(count)]
    return [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": "{}"},
                }
                for call_id in ids
            ],
        },
        *({"role": "tool", "tool_call_id": call_id, "content": "x"} for call_id in ids),
    ]


def assert_results_rendered_in_call_order(prompt: str, calls) -> None:
    """The next turn's prompt holds each call's result (``result N`` for call ``N``,
    sent in any order) as the K3 template renders a tool message, in call order."""
    from vllm_k3_plugin.format import vocab

    rendered = [
        f'<|open|>message role="tool" tool="{name}" index="{n}"<|sep|>'
        f"{vocab.RESPONSE_START}result {n - 1}{vocab.RESPONSE_END}"
        for n, (name, _) in enumerate(calls, start=1)
    ]
    assert all(part in prompt for part in rendered), prompt[-1500:]
    positions = [prompt.index(part) for part in rendered]
    assert positions == sorted(positions)
