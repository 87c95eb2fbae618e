"""XTML text: attribute escaping, opener tags, and calls as the renderer writes them.

Attribute values are escaped ``&`` -> ``&amp;`` then ``"`` -> ``&quot;``, and
unescaped in the reverse order. ``render_tools`` writes a tools channel the way the K3
chat renderer does (typed ``argument`` elements, string values raw, a ``json`` block
for arguments that are not a JSON object); tests, the benchmarks and the corpus use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_k3_plugin import vocab

_ATTRIBUTE = re.compile(r'([A-Za-z_][\w.-]*)\s*=\s*"([^"]*)"')


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
