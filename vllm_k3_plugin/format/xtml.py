"""XTML text: attribute escaping, tags, and calls as the renderer writes them.

Attribute values are escaped ``&`` -> ``&amp;`` then ``"`` -> ``&quot;``, and
unescaped in the reverse order. ``TagText`` reads a tag as it streams (the text
between a control opener or closer atom and its separator) and says as soon as it
stops reading as one. ``render_tools`` writes a tools channel the way the K3
chat renderer does (typed ``argument`` elements, string values raw, a ``json`` block
for arguments that are not a JSON object); tests, the benchmarks and the corpus use it.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_k3_plugin.format import vocab

_ATTRIBUTE = re.compile(r'([A-Za-z_][\w.-]*)\s*=\s*"([^"]*)"')

MAX_TAG_CHARS = 16_384
"""The longest tag a reader holds: longer text after an atom is not a tag."""


class _Shape(enum.Enum):
    """Where a tag's text stands: ``NAME key="value" ...`` for an opener, ``NAME``
    for a closer, either followed by whitespace."""

    START = "start"
    NAME = "name"
    GAP = "gap"  # whitespace after the name or a value: a key may follow
    KEY = "key"
    KEY_GAP = "key-gap"  # whitespace after a key: only "=" may follow
    EQUALS = "equals"  # after "=": only the opening quote may follow
    VALUE = "value"
    VALUE_END = "value-end"  # after the closing quote: whitespace must follow
    TRAIL = "trail"  # a closer's whitespace after its name
    BROKEN = "broken"  # not a tag


_SPACE = re.compile(r"\s")
_NAME_START = re.compile(r"[A-Za-z_]")
# The run of characters that keeps each shape; the character after it moves on.
_RUN = {
    _Shape.START: re.compile(""),
    _Shape.NAME: re.compile(r"[\w.:-]*"),
    _Shape.GAP: re.compile(r"\s*"),
    _Shape.KEY: re.compile(r"[\w.-]*"),
    _Shape.KEY_GAP: re.compile(r"\s*"),
    _Shape.EQUALS: re.compile(r"\s*"),
    _Shape.VALUE: re.compile(r'[^"]*'),
    _Shape.VALUE_END: re.compile(""),
    _Shape.TRAIL: re.compile(r"\s*"),
}
_COMPLETE = frozenset({_Shape.NAME, _Shape.GAP, _Shape.VALUE_END, _Shape.TRAIL})
_OPENER_MOVES = {
    _Shape.START: ((_NAME_START, _Shape.NAME),),
    _Shape.NAME: ((_SPACE, _Shape.GAP),),
    _Shape.GAP: ((_NAME_START, _Shape.KEY),),
    _Shape.KEY: ((_SPACE, _Shape.KEY_GAP), (re.compile("="), _Shape.EQUALS)),
    _Shape.KEY_GAP: ((re.compile("="), _Shape.EQUALS),),
    _Shape.EQUALS: ((re.compile('"'), _Shape.VALUE),),
    _Shape.VALUE: ((re.compile('"'), _Shape.VALUE_END),),
    _Shape.VALUE_END: ((_SPACE, _Shape.GAP),),
}
_CLOSER_MOVES = {
    _Shape.START: ((_NAME_START, _Shape.NAME),),
    _Shape.NAME: ((_SPACE, _Shape.TRAIL),),
}


class TagText:
    """The text of one tag while it streams in, checked piece by piece: ``add``
    says whether it may still be a tag. Linear in its length however it is fed;
    at most ``MAX_TAG_CHARS`` characters."""

    __slots__ = ("_chars", "_moves", "_pieces", "_shape", "opener")

    def __init__(self, *, opener: bool) -> None:
        self.opener = opener
        """An opener's tag (``<|open|>``), else a closer's (``<|close|>``)."""
        self._moves = _OPENER_MOVES if opener else _CLOSER_MOVES
        self._shape = _Shape.START
        self._pieces: list[str] = []
        self._chars = 0

    def add(self, text: str) -> bool:
        """Append ``text``; whether the tag so far may still be a tag."""
        self._pieces.append(text)
        self._chars += len(text)
        if self._shape is _Shape.BROKEN or self._chars > MAX_TAG_CHARS:
            self._shape = _Shape.BROKEN
            return False
        shape, at, end = self._shape, 0, len(text)
        while True:
            at = _RUN[shape].match(text, at).end()
            if at == end:
                self._shape = shape
                return True
            for pattern, after in self._moves.get(shape, ()):
                if pattern.match(text, at):
                    shape = after
                    at += 1
                    break
            else:
                self._shape = _Shape.BROKEN
                return False

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def ends_whole(self, *, at_separator: bool) -> bool:
        """Whether the tag is a whole element's tag when the next atom comes: at
        its separator, or (a closer, seen in the wild without one) at any other."""
        return self.complete and (at_separator or not self.opener)

    @property
    def complete(self) -> bool:
        """Whether the tag so far is a whole tag: a name, and only whole
        attributes after it."""
        return self._shape in _COMPLETE


def escape_attribute(value: str) -> str:
    for raw, escaped in vocab.ATTRIBUTE_ESCAPES:
        value = value.replace(raw, escaped)
    return value


def unescape_attribute(value: str) -> str:
    for raw, escaped in reversed(vocab.ATTRIBUTE_ESCAPES):
        value = value.replace(escaped, raw)
    return value


def parse_tag(tag: str) -> tuple[str, dict[str, str]]:
    """``'call tool="f" index="1"'`` -> ``("call", {"tool": "f", "index": "1"})``.

    The name is the text up to the first whitespace. Attributes that do not have the
    form ``key="value"`` are ignored; a repeated attribute keeps its first value.
    """
    parts = tag.split(None, 1)
    if not parts:
        return "", {}
    attributes: dict[str, str] = {}
    for match in _ATTRIBUTE.finditer(parts[1] if len(parts) > 1 else ""):
        attributes.setdefault(match[1], unescape_attribute(match[2]))
    return parts[0], attributes


def argument_type(value: Any) -> str:
    """The ``type`` attribute the renderer writes for a JSON value."""
    if isinstance(value, str):
        return vocab.STRING_TYPE
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "object"
    if isinstance(value, (list, tuple)):
        return "array"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def render_argument(key: str, value: Any) -> str:
    kind = argument_type(value)
    text = value if kind == vocab.STRING_TYPE else json.dumps(value, ensure_ascii=False)
    attrs = f'key="{escape_attribute(key)}" type="{kind}"'
    return vocab.opener(vocab.ARGUMENT, attrs) + text + vocab.ARGUMENT_END


def render_call(name: str, arguments: Mapping[str, Any] | str, index: int) -> str:
    """One ``call`` element; ``arguments`` not a mapping goes in a ``json`` block."""
    attrs = f'tool="{escape_attribute(name)}" index="{index}"'
    if isinstance(arguments, Mapping):
        body = "".join(render_argument(k, v) for k, v in arguments.items())
    else:
        body = (
            vocab.opener(vocab.JSON_BLOCK, 'type="object"') + arguments + vocab.JSON_END
        )
    return vocab.opener(vocab.CALL, attrs) + body + vocab.CALL_END


def render_tools(calls: Iterable[tuple[str, Mapping[str, Any] | str]]) -> str:
    """A whole tools channel, calls numbered from 1."""
    body = "".join(
        render_call(name, arguments, index)
        for index, (name, arguments) in enumerate(calls, start=1)
    )
    return vocab.TOOLS_START + body + vocab.TOOLS_END
