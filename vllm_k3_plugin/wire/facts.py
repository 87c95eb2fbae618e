"""What the engine knows of a request before the response says it: the prompt's
token count and how many of its tokens came from the prefix cache. vLLM's stream
reports the cached count only in its closing usage summary; the spec wants it in
the response headers (P0.18) and on every continuous usage frame.

The switch's middleware puts an ``EngineFacts`` in ``CURRENT`` for each chat
completion it rewrites; the plugin's serving hook (``parsers/serving_hooks.py``)
fills it from the engine's first output, which vLLM reads before it sends the
stream's first frame. The request's tasks share it through the context they copy.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass


@dataclass
class EngineFacts:
    prompt_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def known(self) -> bool:
        return self.prompt_tokens is not None and self.cached_tokens is not None


CURRENT: contextvars.ContextVar[EngineFacts | None] = contextvars.ContextVar(
    "vllm_k3_plugin_engine_facts", default=None
)


def record(prompt_tokens: int, cached_tokens: int | None) -> None:
    """Called with the engine's first output for the request being served."""
    facts = CURRENT.get()
    if facts is not None and facts.prompt_tokens is None:
        facts.prompt_tokens = prompt_tokens
        facts.cached_tokens = cached_tokens or 0
