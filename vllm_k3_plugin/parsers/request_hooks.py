"""The request's ``thinking`` object on chat completions switches K3's thinking.

Moonshot's API and its clients switch thinking per request with a ``thinking``
object, ``{"type": "enabled"}`` or ``{"type": "disabled"}``. vLLM's Messages endpoint
reads Anthropic's field of that name; its chat completions keep it as an ignored
extra field, so a request that says disabled still gets a prompt that opens the think
channel, and the reply is read as reasoning.

Installed with the serving hooks (API server, the first composition of a parser that
reads with the ``kimi_k3`` reasoning parser: a deployment serving another model with
the plugin installed keeps vLLM's behaviour),
a wrapper of ``ChatCompletionRequest.build_chat_params`` reads the object before the
prompt is rendered and sets the K3 template's own switch, ``chat_template_kwargs``
``thinking`` (which vLLM's K3 renderer reads too): ``disabled`` to ``False``,
``enabled`` and ``adaptive`` to ``True``. The request's ``chat_template_kwargs``
``thinking`` or ``enable_thinking``, where given, win; the object wins over
``reasoning_effort`` (which vLLM turns into ``enable_thinking``: the K3 template,
vLLM's K3 renderer and our reading take ``thinking`` first), whose level still reaches
the template. The parsers then read the start
state from the rendered prompt as for any request. Any other value of ``thinking``
changes nothing (vLLM logs it as an ignored field, as before).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "_vllm_k3_plugin_thinking_hook"
THINKING_BY_TYPE = {"enabled": True, "adaptive": True, "disabled": False}


def thinking_switch(request: Any) -> bool | None:
    """What the request's ``thinking`` object asks of the template, or ``None``."""
    thinking = (getattr(request, "model_extra", None) or {}).get("thinking")
    if not isinstance(thinking, dict):
        return None
    kind = thinking.get("type")
    return THINKING_BY_TYPE.get(kind) if isinstance(kind, str) else None


def apply_thinking_object(request: Any) -> None:
    """Set ``chat_template_kwargs["thinking"]`` from the request's ``thinking``
    object, unless the request's own template kwargs already switch thinking."""
    switch = thinking_switch(request)
    if switch is None:
        return
    kwargs = dict(request.chat_template_kwargs or {})
    if "thinking" in kwargs or "enable_thinking" in kwargs:
        return
    kwargs["thinking"] = switch
    request.chat_template_kwargs = kwargs


def install() -> None:
    """Wrap chat completions' ``build_chat_params`` (idempotent)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    original = ChatCompletionRequest.build_chat_params
    if getattr(original, _MARK, False):
        return
    ChatCompletionRequest.build_chat_params = _applying_thinking_object(original)


def _applying_thinking_object(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def build_chat_params(self, *args: Any, **kwargs: Any) -> Any:
        apply_thinking_object(self)
        return original(self, *args, **kwargs)

    setattr(build_chat_params, _MARK, True)
    return build_chat_params
