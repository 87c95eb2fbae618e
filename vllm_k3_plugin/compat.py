"""Which vLLM the plugin supports, checked when vLLM loads it.

The plugin replaces parser classes and wraps one private step of vLLM
(``ParserManager._compose_parser``); their contracts are those of vLLM 0.32 and 0.33.
On another version it refuses to load, at server start, naming the supported range,
rather than misbehaving inside a request.
"""

from __future__ import annotations

import re

from vllm_k3_plugin.envs import ALLOW_UNSUPPORTED_VLLM_ENV, allow_unsupported_vllm

SUPPORTED_VLLM = ">=0.32, <0.34"
_LOWEST = (0, 32)
_BEYOND = (0, 34)


class UnsupportedVLLMError(RuntimeError):
    pass


def release(version: str) -> tuple[int, int] | None:
    """``"0.33.1rc2+rocm"`` -> ``(0, 33)``; ``None`` when it is not a version."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def unsupported_reason(version: str) -> str | None:
    """Why ``version`` of vLLM is not supported, or ``None`` if it is."""
    found = release(version)
    if found is not None and _LOWEST <= found < _BEYOND:
        return None
    from vllm_k3_plugin import __version__

    return (
        f"vllm-k3-plugin {__version__} supports vLLM {SUPPORTED_VLLM}; this is vLLM "
        f"{version!r}. Install a supported vLLM, or leave the plugin out "
        "(VLLM_PLUGINS set to the plugins to load, without 'kimi_k3') to serve with "
        f"vLLM's own parsers; {ALLOW_UNSUPPORTED_VLLM_ENV}=1 loads it anyway."
    )


def check_vllm_version(version: str, warn) -> None:
    """Raise ``UnsupportedVLLMError`` for an unsupported ``version``, unless the
    operator allowed it, in which case ``warn`` is called with the reason."""
    reason = unsupported_reason(version)
    if reason is None:
        return
    if allow_unsupported_vllm():
        warn(reason)
        return
    raise UnsupportedVLLMError(reason)
