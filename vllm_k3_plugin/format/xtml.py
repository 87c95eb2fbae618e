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


def escape_attribute(value: str) -> str:
    for raw, escaped in vocab.ATTRIBUTE_ESCAPES:
        value = value.replace(raw, escaped)
    return value


def unescape_attribute(value: str) -> str:
    for raw, escaped in reversed(vocab.ATTRIBUTE_ESCAPES):
        value = value.replace(escaped, raw)
    return value


# The tag grammar K3 writes, bounded (K3_FORMAT.md; the chat renderer writes single
# spaces and these attributes). Element and attribute names are short words; a tool
# name (``tool=``), an index, a type or a role holds no whitespace; an argument's
# ``key=`` is a JSON property name and may hold spaces, never a newline.
MAX_NAME_CHARS = 16
"""The longest element or attribute name read (K3's longest is ``argument``)."""
MAX_TOOL_NAME_CHARS = 64
"""The longest tool name read unless the request declares a longer one (the OpenAI
API's limit for a function name); also the bound of an index, a type or a role."""
MAX_KEY_CHARS = 128
"""The longest argument key read unless the request declares a longer one."""
_INDEX_DIGITS = 6
_KEY_ATTRIBUTE = "key"
_TOOL_ATTRIBUTE = "tool"


def _longest_tag(tool_name_chars: int, key_chars: int) -> int:
    """The longest tag K3 writes with names and keys of these lengths: a call
    opener, a tool message's opener or an argument opener."""
    index = "9" * _INDEX_DIGITS
    tool = "x" * tool_name_chars
    return max(
        len(f'{vocab.CALL} tool="{tool}" index="{index}"'),
        len(f'{vocab.MESSAGE} role="tool" tool="{tool}" index="{index}"'),
        len(f'{vocab.ARGUMENT} key="{"x" * key_chars}" type="boolean"'),
    )


MAX_TAG_CHARS = _longest_tag(MAX_TOOL_NAME_CHARS, MAX_KEY_CHARS)
"""The longest tag a reader holds when the request declares nothing longer: longer
text after an atom is not a tag."""

_TOKEN_VALUE = re.compile(r'[^"\s]*')
_KEY_VALUE = re.compile(r'[^"\n]*')
_ANY_VALUE = re.compile(r'[^"]*')


class TagGrammar:
    """What a tag may hold for one request: the generic bounds, widened by the
    tools it declares (a declared name or key the generic grammar refuses: with
    whitespace, or longer than its bound, as vLLM accepts any string)."""

    __slots__ = ("_key_values", "_tool_names", "max_tag_chars")

    def __init__(
        self, tool_names: Iterable[str] = (), keys: Iterable[str] = ()
    ) -> None:
        self._tool_names = _widening(tool_names, _TOKEN_VALUE, MAX_TOOL_NAME_CHARS)
        self._key_values = _widening(keys, _KEY_VALUE, MAX_KEY_CHARS)
        self.max_tag_chars = _longest_tag(
            max([MAX_TOOL_NAME_CHARS, *map(len, self._tool_names)]),
            max([MAX_KEY_CHARS, *map(len, self._key_values)]),
        )

    def value_run(self, attribute: str) -> re.Pattern[str]:
        """The characters a value of ``attribute`` may hold, read as it streams."""
        if attribute == _TOOL_ATTRIBUTE:
            return _ANY_VALUE if self._tool_names else _TOKEN_VALUE
        if attribute == _KEY_ATTRIBUTE:
            return _ANY_VALUE if self._key_values else _KEY_VALUE
        return _TOKEN_VALUE

    def value_fits(self, attribute: str, value: str, *, whole: bool) -> bool:
        """Whether ``value`` (whole, or so far) is a tool name or key this request
        allows (asked only where ``value_run`` widened the run)."""
        if attribute == _TOOL_ATTRIBUTE:
            run, bound, declared = _TOKEN_VALUE, MAX_TOOL_NAME_CHARS, self._tool_names
        else:
            run, bound, declared = _KEY_VALUE, MAX_KEY_CHARS, self._key_values
        if len(value) <= bound and run.fullmatch(value) is not None:
            return True
        if whole:
            return value in declared
        return any(name.startswith(value) for name in declared)

    @property
    def widened(self) -> bool:
        """Whether a declared name or key widens the generic grammar."""
        return bool(self._tool_names or self._key_values)


def _widening(
    values: Iterable[str], run: re.Pattern[str], bound: int
) -> tuple[str, ...]:
    """The escaped values the generic grammar (``run``, ``bound``) refuses."""
    return tuple(
        escaped
        for escaped in dict.fromkeys(map(escape_attribute, values))
        if len(escaped) > bound or run.fullmatch(escaped) is None
    )


GENERIC_GRAMMAR = TagGrammar()
"""The grammar of a request that declares nothing the generic bounds refuse."""


def grammar_for(tool_names: Iterable[str], keys: Iterable[str]) -> TagGrammar:
    """The grammar of a request declaring these tool names and argument keys."""
    grammar = TagGrammar(tool_names, keys)
    return grammar if grammar.widened else GENERIC_GRAMMAR


class _Shape(enum.IntEnum):
    """Where a tag's text stands: ``NAME key="value" ...`` for an opener, ``NAME``
    for a closer, either followed by whitespace. (Ints: the shapes key the tables
    below, read per character run; an int hashes in C, an ``Enum`` in Python.)"""

    START = 0
    NAME = 1
    GAP = 2  # whitespace after the name or a value: a key may follow
    KEY = 3
    KEY_GAP = 4  # whitespace after a key: only "=" may follow
    EQUALS = 5  # after "=": only the opening quote may follow
    VALUE = 6
    VALUE_END = 7  # after the closing quote: whitespace must follow
    TRAIL = 8  # a closer's whitespace after its name
    BROKEN = 9  # not a tag


_SPACE = re.compile(r"\s")
_NAME_START = re.compile(r"[A-Za-z_]")
# The run of characters that keeps each shape; the character after it moves on. A
# value's run depends on its attribute (``TagGrammar.value_run``).
_RUN = {
    _Shape.START: re.compile(""),
    _Shape.NAME: re.compile(r"[\w.:-]*"),
    _Shape.GAP: re.compile(r"\s*"),
    _Shape.KEY: re.compile(r"[\w.-]*"),
    _Shape.KEY_GAP: re.compile(r"\s*"),
    _Shape.EQUALS: re.compile(r"\s*"),
    _Shape.VALUE_END: re.compile(""),
    _Shape.TRAIL: re.compile(r"\s*"),
}
# Shapes whose text is bounded on its own: a name, an attribute's name, a value.
_IS_WORD = tuple(
    shape in (_Shape.NAME, _Shape.KEY, _Shape.VALUE) for shape in sorted(_Shape)
)
# The bound of a value by its run; a widened run's values are checked whole.
_VALUE_BOUNDS = {_TOKEN_VALUE: MAX_TOOL_NAME_CHARS, _KEY_VALUE: MAX_KEY_CHARS}
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
    """The text of one tag while it streams in, checked piece by piece against a
    request's ``TagGrammar``: ``add`` says whether it may still be a tag, so a tag
    running into prose is decided within the piece that shows it. Linear in its
    length however it is fed; at most ``grammar.max_tag_chars`` characters."""

    __slots__ = (
        "_attribute",
        "_chars",
        "_grammar",
        "_max_chars",
        "_moves",
        "_pieces",
        "_shape",
        "_value_run",
        "_word_bound",
        "_word_start",
        "opener",
    )

    def __init__(self, *, opener: bool, grammar: TagGrammar = GENERIC_GRAMMAR) -> None:
        self.opener = opener
        """An opener's tag (``<|open|>``), else a closer's (``<|close|>``)."""
        self._moves = _OPENER_MOVES if opener else _CLOSER_MOVES
        self._grammar = grammar
        self._shape = _Shape.START
        self._pieces: list[str] = []
        self._chars = 0
        # Where the current name, attribute name or value starts, and the attribute
        # whose value is read.
        self._word_start = 0
        self._word_bound = MAX_NAME_CHARS
        self._max_chars = grammar.max_tag_chars
        self._attribute = ""
        self._value_run = _TOKEN_VALUE

    def add(self, text: str) -> bool:
        """Append ``text``; whether the tag so far may still be a tag."""
        base = self._chars
        self._pieces.append(text)
        self._chars = chars = base + len(text)
        shape = self._shape
        if shape is _Shape.BROKEN or chars > self._max_chars:
            self._shape = _Shape.BROKEN
            return False
        at, end = 0, len(text)
        while True:
            run = self._value_run if shape is _Shape.VALUE else _RUN[shape]
            at = run.match(text, at).end()
            if at == end:
                break
            for pattern, after in self._moves.get(shape, ()):
                if pattern.match(text, at):
                    if (_IS_WORD[shape] or _IS_WORD[after]) and not self._move(
                        shape, after, base + at
                    ):
                        self._shape = _Shape.BROKEN
                        return False
                    shape = after
                    at += 1
                    break
            else:
                self._shape = _Shape.BROKEN
                return False
        self._shape = shape
        if _IS_WORD[shape] and not self._word_fits(chars, whole=False):
            self._shape = _Shape.BROKEN
            return False
        return True

    def _move(self, shape: _Shape, after: _Shape, at: int) -> bool:
        """Leave ``shape`` at the character ``at`` (absolute) for ``after``; whether
        the word ``shape`` read (if it read one) fits the grammar."""
        if _IS_WORD[shape] and not self._word_fits(at, whole=True):
            return False
        if shape is _Shape.KEY:
            self._attribute = self.text[self._word_start : at]
        if after is _Shape.VALUE:
            self._word_start = at + 1
            run = self._value_run = self._grammar.value_run(self._attribute)
            self._word_bound = _VALUE_BOUNDS.get(run, -1)
        elif _IS_WORD[after]:
            self._word_start = at  # the move's character starts the word
            self._word_bound = MAX_NAME_CHARS
        return True

    def _word_fits(self, end: int, *, whole: bool) -> bool:
        """Whether the word read up to ``end`` (absolute) fits; its run already
        kept its characters to the grammar's, but a value a declaration widened."""
        bound = self._word_bound
        if bound >= 0:
            return end - self._word_start <= bound
        value = self.text[self._word_start : end]
        return self._grammar.value_fits(self._attribute, value, whole=whole)

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
