"""Every Kimi-K3 marker string and control token id, spelled once.

The element grammar is ``<|open|>NAME attrs<|sep|> ... <|close|>NAME<|sep|>``. The three
atoms are added, non-special tokens; element names are ordinary BPE text, so a marker
such as ``<|close|>think<|sep|>`` is several tokens. Everything else in the package
imports these names instead of writing the literals.
"""

from __future__ import annotations

OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
END_OF_MSG = "<|end_of_msg|>"

BOS_TOKEN = "[BOS]"
EOS_TOKEN = "[EOS]"
EOT_TOKEN = "[EOT]"
UNK_TOKEN = "[UNK]"
PAD_TOKEN = "[PAD]"


def opener(name: str, attrs: str = "") -> str:
    """``<|open|>name attrs<|sep|>``."""
    return f"{OPEN}{name}{' ' + attrs if attrs else ''}{SEP}"


def closer(name: str) -> str:
    """``<|close|>name<|sep|>``."""
    return f"{CLOSE}{name}{SEP}"


# Element names: the channels and the message around them; inside the tools channel,
# ``call tool= index=`` holds ``argument key= type=`` elements or one
# ``json type="object"`` block.
THINK = "think"
RESPONSE = "response"
TOOLS = "tools"
MESSAGE = "message"
CALL = "call"
ARGUMENT = "argument"
JSON_BLOCK = "json"
STRING_TYPE = "string"

THINK_START = opener(THINK)
THINK_END = closer(THINK)
# Seen in the wild: the think closer without its separator, then the next channel
# (read as a closer the next atom completes).
THINK_END_UNSEPARATED = CLOSE + THINK
RESPONSE_START = opener(RESPONSE)
RESPONSE_END = closer(RESPONSE)
TOOLS_START = opener(TOOLS)
TOOLS_END = closer(TOOLS)
CALL_END = closer(CALL)
# Seen in the wild: the call closer without its separator.
CALL_END_UNSEPARATED = CLOSE + CALL
ARGUMENT_END = closer(ARGUMENT)
# A call opener written in the reply without the tools channel around it (its
# attributes follow the space): read as the start of a tools channel.
CALL_START_UNWRAPPED = f"{OPEN}{CALL} "
JSON_END = closer(JSON_BLOCK)
ASSISTANT_START = opener(MESSAGE, 'role="assistant"')
MESSAGE_END = closer(MESSAGE)
# Attribute values are escaped ``&`` first, then ``"``; unescaped in reverse.
ATTRIBUTE_ESCAPES = (("&", "&amp;"), ('"', "&quot;"))

# Generation prefixes the chat template writes at the end of the prompt.
THINKING_ON_PREFIX = ASSISTANT_START + THINK_START
THINKING_OFF_PREFIX = ASSISTANT_START + RESPONSE_START

# Control token ids (the 256 slots from 163584 are control ids; unnamed ones are
# reserved).
BOS_ID = 163584
EOS_ID = 163585
END_OF_MSG_ID = 163586  # the model's stop token (config ``eos_token_id``)
OPEN_ID = 163587
CLOSE_ID = 163588
SEP_ID = 163589
EOT_ID = 163593
UNK_ID = 163838
PAD_ID = 163839
CONTROL_ID_BASE = 163584
CONTROL_ID_COUNT = 256
BPE_RANK_COUNT = 163584
VOCAB_SIZE = CONTROL_ID_BASE + CONTROL_ID_COUNT

# Added (not special) tokens: the renderer disallows them in user text, so they reach
# the model only from the template or from the model itself.
ADDED_TOKENS: dict[str, int] = {OPEN: OPEN_ID, CLOSE: CLOSE_ID, SEP: SEP_ID}
SPECIAL_TOKENS: dict[str, int] = {
    BOS_TOKEN: BOS_ID,
    EOS_TOKEN: EOS_ID,
    END_OF_MSG: END_OF_MSG_ID,
    EOT_TOKEN: EOT_ID,
    UNK_TOKEN: UNK_ID,
    PAD_TOKEN: PAD_ID,
}

# Ids after which the model has stopped itself (the stop token, and EOS for safety).
MODEL_STOP_IDS = frozenset({END_OF_MSG_ID, EOS_ID, EOT_ID})

# Markers that end the think channel: the model answered in its own channel.
THINK_EXITS = (THINK_END, RESPONSE_START)
# A tools opener in the think channel is decided by what follows it, whitespace
# aside; more whitespace than this (in characters) means it was quoted.
TOOLS_OPENER_MAX_GAP = 16

# Framing: structure that never reaches content, and reaches reasoning only as quoted
# text. Longest forms first so a bare atom never shadows the element it begins.
FRAMING = (
    ASSISTANT_START,
    MESSAGE_END,
    THINK_START,
    TOOLS_END,
    CALL_END,
    END_OF_MSG,
    OPEN,
    CLOSE,
    SEP,
)

# The single-token atoms of the framing (as control ids, never content).
CONTROL_ATOMS = (OPEN, CLOSE, SEP, END_OF_MSG)

# Every marker the reasoning reader distinguishes.
REASONING_MARKERS = (
    THINK_END,
    RESPONSE_START,
    RESPONSE_END,
    TOOLS_START,
    CALL_START_UNWRAPPED,
    *FRAMING,
)

# Every marker the tool-call reader distinguishes inside the tools channel. Openers
# carry attributes, so they are read as ``OPEN`` ... ``SEP``.
TOOL_MARKERS = (
    TOOLS_START,
    TOOLS_END,
    CALL_END,
    CALL_END_UNSEPARATED,
    ARGUMENT_END,
    JSON_END,
    MESSAGE_END,
    END_OF_MSG,
    OPEN,
    CLOSE,
    SEP,
)
