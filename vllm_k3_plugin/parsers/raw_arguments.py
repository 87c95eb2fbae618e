"""Tool-call arguments where an endpoint needs a JSON object (``/v1/messages``).

Anthropic's ``tool_use`` input is an object; a K3 call's arguments need not be one
(a ``json`` block is the text the model wrote, and a call the end of the output cut
off ends mid-value). Such arguments are kept as text, in an object:
``{RAW_ARGUMENTS_KEY: "<the text>"}``. The non-streamed conversion
(``serving_hooks``) and the stream's whole calls (``messages_stream``) both read
arguments so; this module sits below both.
"""

from __future__ import annotations

import json

from vllm_k3_plugin.parsers import metrics

RAW_ARGUMENTS_KEY = "_raw_arguments"


def json_object_text(arguments: str, *, stream: bool) -> str:
    """``arguments`` if it is a JSON object; else an object keeping it as text
    (counted: ``vllm_k3_arguments_kept_as_text_total``)."""
    try:
        if isinstance(json.loads(arguments), dict):
            return arguments
    except (ValueError, RecursionError):
        pass
    metrics.count_kept_as_text("messages", stream)
    return json.dumps({RAW_ARGUMENTS_KEY: arguments}, ensure_ascii=False)
