"""The Kimi Vendor Verifier's tool schemas (tests/data/kvv), wrapped as KVV does.

Each case becomes the schema of a tool's arguments: an object with one required
property ``value`` holding the case, ``additionalProperties: false``. The case's
``$defs`` / ``definitions`` move to the wrapper's root and its local references are
rewritten to point into ``value``, so every reference means what it meant.

``hypothesis-jsonschema`` cannot generate for recursive references, so generation
uses a copy with references inlined ``RECURSION_DEPTH`` levels deep and ``false``
below; every generated value is still validated against the real wrapped schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

DATA = Path(__file__).parents[1] / "data" / "kvv"
RECURSION_DEPTH = 3
_DEFINITIONS = ("$defs", "definitions")


class Case(NamedTuple):
    name: str
    """``Suite:line``."""
    schema: dict[str, Any]


def cases() -> Iterator[Case]:
    for path in sorted(DATA.glob("*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                yield Case(f"{path.stem}:{number}", json.loads(line))


def _rewrite_refs(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                hoisted = value.startswith(tuple(f"#/{d}/" for d in _DEFINITIONS))
                out[key] = value if hoisted else "#/properties/value" + value[1:]
            else:
                out[key] = _rewrite_refs(value)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(item) for item in node]
    return node


def wrap(case: dict[str, Any]) -> dict[str, Any]:
    case = dict(case)
    hoisted = {key: case.pop(key) for key in _DEFINITIONS if key in case}
    case.pop("$id", None)  # a plain-name identifier; refs resolve from the wrapper
    wrapped = {
        "type": "object",
        "properties": {"value": _rewrite_refs(case)},
        "required": ["value"],
        "additionalProperties": False,
    }
    wrapped.update(_rewrite_refs(hoisted))
    return wrapped


def _pointer(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def inline_refs(root: dict[str, Any], depth: int = RECURSION_DEPTH) -> dict[str, Any]:
    """``root`` with local references inlined; a reference already expanded
    ``depth`` times on the current path becomes ``false`` (no value)."""

    def walk(node: Any, seen: dict[str, int]) -> Any:
        if isinstance(node, list):
            return [walk(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        rest = {
            k: walk(v, seen)
            for k, v in node.items()
            if k != "$ref" and k not in _DEFINITIONS
        }
        if not (isinstance(ref, str) and ref.startswith("#")):
            return rest
        if seen.get(ref, 0) >= depth:
            return False
        target = walk(_pointer(root, ref), {**seen, ref: seen.get(ref, 0) + 1})
        return {"allOf": [target, rest]} if rest else target

    return walk(root, {})
