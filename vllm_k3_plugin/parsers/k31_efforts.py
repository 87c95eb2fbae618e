"""Kimi-K3.1's thinking efforts on vLLM before 0.34.

vLLM 0.34's K3 renderer takes ``reasoning_effort`` (or ``chat_template_kwargs``
``thinking_effort``) ``low``, ``high`` or ``max`` for Kimi-K3 and adds ``medium`` for
a ``kimi_k31`` model. 0.32 and 0.33 know K3 only and refuse ``medium`` for every
model ("Kimi K3 supports thinking_effort values: low, high, max"), K3.1 included,
which the plugin serves there. On those versions, the renderer of a ``kimi_k31``
model reads the efforts as 0.34's does (an effort K3.1 has not either is refused
with vLLM's validation error, a 400, naming K3.1's); any other model keeps vLLM's
own check.

Installed with the model classes, when the plugin loads: before the API server
builds its renderer, which binds its template method then. Where vLLM's renderer
already knows K3.1, nothing is changed.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from vllm_k3_plugin.reference.checkpoint_format import K31_WRAPPER

# vLLM 0.34's ``_K31_THINKING_EFFORTS``.
K31_EFFORTS = ("low", "medium", "high", "max")
_MARK = "_vllm_k3_plugin_k31_efforts"
_rendering_k31 = contextvars.ContextVar("rendering_k31", default=False)


def install() -> None:
    """Wrap vLLM's K3 renderer where it knows no K3.1 (idempotent)."""
    from vllm.renderers import kimi_k3 as renderer

    if hasattr(renderer, "_K31_THINKING_EFFORTS"):
        return
    if getattr(renderer._apply_k3_thinking_kwargs, _MARK, False):
        return
    renderer._apply_k3_thinking_kwargs = _taking_k31_efforts(
        renderer._apply_k3_thinking_kwargs
    )
    template = renderer.KimiK3Renderer._apply_chat_template
    renderer.KimiK3Renderer._apply_chat_template = _marking_k31(template)


def _marking_k31(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        k31 = self.model_config.hf_config.model_type == K31_WRAPPER[0]
        token = _rendering_k31.set(k31)
        try:
            return original(self, *args, **kwargs)
        finally:
            _rendering_k31.reset(token)

    return _apply_chat_template


def _taking_k31_efforts(original: Callable[[dict], None]) -> Callable[[dict], None]:
    @functools.wraps(original)
    def _apply_k3_thinking_kwargs(kwargs: dict[str, Any]) -> None:
        if not _rendering_k31.get():
            return original(kwargs)
        # vLLM's reading of the other switches, then the efforts as 0.34 reads
        # them for K3.1: the template's own kwarg wins, "none" turns thinking off.
        thinking_effort = kwargs.pop("thinking_effort", None)
        reasoning_effort = kwargs.pop("reasoning_effort", None)
        original(kwargs)
        if reasoning_effort == "none":
            kwargs.setdefault("thinking", False)
        elif thinking_effort is None:
            thinking_effort = reasoning_effort
        if thinking_effort is None:
            return
        if thinking_effort not in K31_EFFORTS:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(
                "This model supports thinking_effort values: " + ", ".join(K31_EFFORTS),
                parameter="thinking_effort",
                value=thinking_effort,
            )
        kwargs["thinking_effort"] = thinking_effort

    setattr(_apply_k3_thinking_kwargs, _MARK, True)
    return _apply_k3_thinking_kwargs
