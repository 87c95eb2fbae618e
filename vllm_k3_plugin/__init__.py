"""vllm-k3-plugin: Kimi-K3 parsers for vLLM, loaded as a ``vllm.general_plugins`` entry.

``register()`` runs in every vLLM process (API server, engine core, workers). It is
cheap and idempotent: it imports only vLLM's registries and ``registration``, and
registers each thing once per process (``registration`` says what and why).
"""

from __future__ import annotations

from vllm_k3_plugin.version import __version__

__all__ = ["__version__", "register"]

_registered = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group."""
    global _registered
    if _registered:
        return
    from vllm_k3_plugin.registration import register_all

    register_all()
    _registered = True
