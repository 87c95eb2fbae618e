"""The channels of a K3 output as the reasoning reader moves through them
(K3_FORMAT.md, rules 1-7): the channel a caller sees (``Channel``), the reader's
states within the channels (``State``), the markers that move it, spelled as the
readers read them (marked text, ``marked``), and which of them matter in each
state. Data only: the transitions are ``transitions.ChannelTransitions``'s.
"""

from __future__ import annotations

import enum
import re

from vllm_k3_plugin.format import marked as m
from vllm_k3_plugin.format import vocab


class Channel(enum.Enum):
    THINK = "think"
    RESPONSE = "response"
    TOOLS = "tools"
    DONE = "done"


class State(enum.Enum):
    """Where the reader stands: the channel, and what in it is still undecided."""

    THINK = "a think channel or block"
    THINK_AFTER_CLOSER = (
        "the output's think channel after an answer closer: the reply, unless words "
        "follow"
    )
    REPLY_START = (
        "the reply, nothing read yet: a think opener here opens the output's own "
        "think channel"
    )
    REPLY = "the reply"
    TOOLS = "the tools channel"
    DONE = "finished"


CHANNEL_OF = {
    State.THINK: Channel.THINK,
    State.THINK_AFTER_CLOSER: Channel.THINK,
    State.REPLY_START: Channel.RESPONSE,
    State.REPLY: Channel.RESPONSE,
    State.TOOLS: Channel.TOOLS,
    State.DONE: Channel.DONE,
}
"""The channel each state is in."""

# Markers as the readers spell them (marked text).
THINK_START = m.marked(vocab.THINK_START)
THINK_END = m.marked(vocab.THINK_END)
RESPONSE_START = m.marked(vocab.RESPONSE_START)
RESPONSE_END = m.marked(vocab.RESPONSE_END)
TOOLS_START = m.marked(vocab.TOOLS_START)
TOOLS_END = m.marked(vocab.TOOLS_END)
CALL_START = m.marked(vocab.CALL_START_UNWRAPPED)
CALL_START_BARE = m.marked(vocab.opener(vocab.CALL))
THINK_EXITS = frozenset(m.marked_all(vocab.THINK_EXITS))
CALL_STARTS = frozenset({CALL_START, CALL_START_BARE})
MARKERS = (
    *m.marked_all(vocab.REASONING_MARKERS),
    CALL_START_BARE,
)
# Markers that change the state (an opener or closer atom starts a tag); all other
# framing there is dropped.
TAG_ATOMS = frozenset({m.OPEN, m.CLOSE})
_THINK_STATE_MARKERS = THINK_EXITS | TAG_ATOMS | {TOOLS_START, RESPONSE_END, CALL_START}
_RESPONSE_STATE_MARKERS = CALL_STARTS | TAG_ATOMS | {TOOLS_START, THINK_START}
# The states where only these markers matter (in the others each part is read).
STATE_MARKERS = {
    State.THINK: _THINK_STATE_MARKERS,
    State.REPLY: _RESPONSE_STATE_MARKERS,
}
# The thought's exit as a tag inside a tools channel: at its separator, and (the
# closer only) at any other atom; at most this long.
EXIT_TAG = re.compile(
    rf"(?:{re.escape(m.CLOSE)}{vocab.THINK}|{re.escape(m.OPEN)}{vocab.RESPONSE})\s*"
)
EXIT_CLOSER = re.compile(rf"{re.escape(m.CLOSE)}{vocab.THINK}\s*")
EXIT_TAG_CHARS = 1 + len(vocab.RESPONSE) + vocab.TOOLS_OPENER_MAX_GAP
# Complete tags read as the channel markers they spell: (is an opener, name).
TAG_MARKERS = {
    (True, vocab.THINK): THINK_START,
    (False, vocab.THINK): THINK_END,
    (True, vocab.RESPONSE): RESPONSE_START,
    (False, vocab.RESPONSE): RESPONSE_END,
    (True, vocab.TOOLS): TOOLS_START,
    (False, vocab.TOOLS): TOOLS_END,
}
