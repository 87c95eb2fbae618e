"""Which vLLM the plugin supports, checked when vLLM loads it.

The plugin replaces parser classes and wraps one private step of vLLM
(``ParserManager._compose_parser``); their contracts are those of vLLM 0.32, 0.33
and 0.34, each tested. On another version it refuses to load, at server start,
naming the tested range and the override, rather than misbehaving inside a request.
Under the override it loads and says in the log that the version is untested.
"""

from __future__ import annotations

import re

from vllm_k3_plugin.envs import ALLOW_UNSUPPORTED_VLLM_ENV, allow_unsupported_vllm

OLDEST_TESTED = (0, 32)
NEWEST_TESTED = (0, 34)
SUPPORTED_VLLM = (
    f">={OLDEST_TESTED[0]}.{OLDEST_TESTED[1]}, "
    f"<{NEWEST_TESTED[0]}.{NEWEST_TESTED[1] + 1}"
)


class UnsupportedVLLMError(RuntimeError):
    pass


def release(version: str) -> tuple[int, int] | None:
    """``"0.33.1rc2+rocm"`` -> ``(0, 33)``; ``None`` when it is not a version."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _named(series: tuple[int, int]) -> str:
    return f"{series[0]}.{series[1]}"


def unsupported_reason(version: str) -> str | None:
    """Why ``version`` of vLLM is not supported, or ``None`` if it is."""
    found = release(version)
    if found is not None and OLDEST_TESTED <= found <= NEWEST_TESTED:
        return None
    from vllm_k3_plugin.version import __version__

    newer = found is not None and found > NEWEST_TESTED
    return (
        f"vllm-k3-plugin {__version__} supports vLLM {SUPPORTED_VLLM} (tested on "
        f"{_named(OLDEST_TESTED)} to {_named(NEWEST_TESTED)}, the newest tested "
        f"{_named(NEWEST_TESTED)}); this is vLLM {version!r}"
        + (", newer than any tested" if newer else "")
        + ". Install a supported vLLM, or leave the plugin out (VLLM_PLUGINS set to "
        "the plugins to load, without 'kimi_k3') to serve with vLLM's own parsers; "
        f"{ALLOW_UNSUPPORTED_VLLM_ENV}=1 loads it anyway, untested."
    )


def check_vllm_version(version: str, warn) -> None:
    """Raise ``UnsupportedVLLMError`` for an unsupported ``version``, unless the
    operator allowed it, in which case ``warn`` is called saying the version is
    untested and why it loads."""
    reason = unsupported_reason(version)
    if reason is None:
        return
    if allow_unsupported_vllm():
        warn(
            f"vLLM {version!r} is untested with this plugin; loading it because "
            f"{ALLOW_UNSUPPORTED_VLLM_ENV} is set. {reason}"
        )
        return
    raise UnsupportedVLLMError(reason)
