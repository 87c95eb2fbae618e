"""XTML text: attribute escaping, tags, and calls as the renderer writes them.

Attribute values are escaped ``&`` -> ``&amp;`` then ``"`` -> ``&quot;``, and
unescaped in the reverse order. ``TagText`` reads a tag as it streams (the text
between a control opener or closer atom and its separator) and says as soon as it
stops reading as one. ``render_tools`` writes a tools channel the way the K3
chat renderer does (typed ``argument`` elements, string values raw, a ``json`` block
for arguments that are not a JSON object); tests, the benchmarks and the corpus use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
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

# The grammar as patterns: a whole tag, and what may still grow into one.
_NAME = rf"[A-Za-z_][\w.:-]{{0,{MAX_NAME_CHARS - 1}}}"
_ATTRIBUTE_NAME = rf"[A-Za-z_][\w.-]{{0,{MAX_NAME_CHARS - 1}}}"
_EQUALS = r'\s*=\s*"'
_TOKEN = rf'[^"\s]{{0,{MAX_TOOL_NAME_CHARS}}}'
_KEY = rf'[^"\n]{{0,{MAX_KEY_CHARS}}}'
_IS_TOKEN = re.compile(_TOKEN).fullmatch
_IS_KEY = re.compile(_KEY).fullmatch


def _value(generic: str, bound: int, declared: tuple[str, ...], *, whole: bool) -> str:
    """A value's pattern: the generic run, or one of ``declared`` (escaped values)
    whole. A value still growing, where a declaration widens the grammar, may be
    any text up to the longest declared value: its closing quote decides."""
    if not declared:
        return generic
    if whole:
        return "(?:" + "|".join([generic, *map(re.escape, declared)]) + ")"
    return f'[^"]{{0,{max(bound, *map(len, declared))}}}'


class TagGrammar:
    """What a tag may hold for one request: the generic bounds, widened by the
    values it declares that they refuse (escaped tool ``names`` and ``keys``: with
    whitespace, or longer than their bound, as vLLM accepts any string). Read as
    patterns: each step of a tag matches its whole text so far (at most
    ``max_tag_chars``) in one pass. ``grammar_for`` builds one for a request."""

    __slots__ = (
        "closer_prefix",
        "closer_whole",
        "max_tag_chars",
        "opener_prefix",
        "opener_whole",
    )

    def __init__(self, names: tuple[str, ...] = (), keys: tuple[str, ...] = ()) -> None:
        self.max_tag_chars = _longest_tag(
            max([MAX_TOOL_NAME_CHARS, *map(len, names)]),
            max([MAX_KEY_CHARS, *map(len, keys)]),
        )
        tool, key = (
            {
                whole: _value(generic, bound, declared, whole=whole)
                for whole in (True, False)
            }
            for generic, bound, declared in (
                (_TOKEN, MAX_TOOL_NAME_CHARS, names),
                (_KEY, MAX_KEY_CHARS, keys),
            )
        )
        # The branches are disjoint (an attribute named ``tool`` or ``key`` takes
        # its own only), so a failed match never retries an attribute two ways.
        other = rf"(?!(?:{_TOOL_ATTRIBUTE}|{_KEY_ATTRIBUTE})\s*=){_ATTRIBUTE_NAME}"
        whole = (
            rf'(?:{_TOOL_ATTRIBUTE}{_EQUALS}{tool[True]}"'
            rf'|{_KEY_ATTRIBUTE}{_EQUALS}{key[True]}"'
            rf'|{other}{_EQUALS}{_TOKEN}")'
        )
        growing = "|".join(
            rf'{name}(?:\s*(?:=\s*(?:"{value})?)?)?'
            for name, value in (
                (_TOOL_ATTRIBUTE, tool[False]),
                (_KEY_ATTRIBUTE, key[False]),
                (other, _TOKEN),
            )
        )
        self.opener_whole = re.compile(rf"{_NAME}(?:\s+{whole})*\s*").fullmatch
        self.opener_prefix = re.compile(
            rf"(?:{_NAME}(?:\s+{whole})*(?:\s*|\s+(?:{growing})))?"
        ).fullmatch
        self.closer_whole = re.compile(rf"{_NAME}\s*").fullmatch
        self.closer_prefix = re.compile(rf"(?:{_NAME}\s*)?").fullmatch


def _refused(
    values: Iterable[str], fits: Callable[[str], re.Match[str] | None]
) -> tuple[str, ...]:
    """The escaped ``values`` the generic pattern (``fits``) refuses."""
    return tuple(
        escaped
        for escaped in dict.fromkeys(map(escape_attribute, values))
        if fits(escaped) is None
    )


GENERIC_GRAMMAR = TagGrammar()
"""The grammar of a request that declares nothing the generic bounds refuse."""


def grammar_for(tool_names: Iterable[str], keys: Iterable[str]) -> TagGrammar:
    """The grammar of a request declaring these tool names and argument keys (the
    generic one, built once, unless a declaration widens it)."""
    names, keys = _refused(tool_names, _IS_TOKEN), _refused(keys, _IS_KEY)
    return TagGrammar(names, keys) if names or keys else GENERIC_GRAMMAR


class TagText:
    """The text of one tag while it streams in, checked against a request's
    ``TagGrammar`` as each piece arrives: ``add`` says whether it may still be a
    tag (an opener ``NAME key="value" ...``, a closer ``NAME``, either followed by
    whitespace), so a tag running into prose is decided within the piece that shows
    it. At most ``grammar.max_tag_chars`` characters, each step one match of the
    tag so far: bounded work per piece."""

    __slots__ = ("_broken", "_max_chars", "_prefix", "_text", "_whole", "opener")

    def __init__(self, *, opener: bool, grammar: TagGrammar = GENERIC_GRAMMAR) -> None:
        self.opener = opener
        """An opener's tag (``<|open|>``), else a closer's (``<|close|>``)."""
        if opener:
            self._prefix, self._whole = grammar.opener_prefix, grammar.opener_whole
        else:
            self._prefix, self._whole = grammar.closer_prefix, grammar.closer_whole
        self._max_chars = grammar.max_tag_chars
        self._text = ""
        self._broken = False

    def add(self, text: str) -> bool:
        """Append ``text``; whether the tag so far may still be a tag."""
        self._text = tag = self._text + text
        if self._broken:
            return False
        if len(tag) > self._max_chars or self._prefix(tag) is None:
            self._broken = True
            return False
        return True

    @property
    def text(self) -> str:
        return self._text

    def ends_whole(self, *, at_separator: bool) -> bool:
        """Whether the tag is a whole element's tag when the next atom comes: at
        its separator, or (a closer, seen in the wild without one) at any other."""
        return self.complete and (at_separator or not self.opener)

    @property
    def complete(self) -> bool:
        """Whether the tag so far is a whole tag: a name, and only whole
        attributes after it."""
        return not self._broken and self._whole(self._text) is not None


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
