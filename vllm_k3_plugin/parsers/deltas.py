"""The ``DeltaMessage`` a streamed step sends: only the fields the step has.

vLLM writes each chunk with ``exclude_unset=True``, so a field passed as ``None`` is
sent as ``null`` (``"content": null`` beside a reasoning piece: one more key in every
frame, and a frame that Moonshot's spec reads as two kinds). Built with
``model_construct``: the values are built by the plugin and valid, and pydantic
validation of every per-token object would cost more than reading the token.
"""

from __future__ import annotations

from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage


def delta_message(
    reasoning: str = "", content: str = "", tool_calls: list[Any] | None = None
) -> DeltaMessage | None:
    """The step's delta, or ``None`` when it shows nothing."""
    shown = set()
    if reasoning:
        shown.add("reasoning")
    if content:
        shown.add("content")
    if tool_calls:
        shown.add("tool_calls")
    if not shown:
        return None
    # Every field given: pydantic reads a missing field's default factory's
    # signature on each construction (hundreds of µs); ``_fields_set`` says which
    # are sent.
    return DeltaMessage.model_construct(
        _fields_set=shown,
        role=None,
        reasoning=reasoning or None,
        content=content or None,
        tool_calls=tool_calls or [],
    )
