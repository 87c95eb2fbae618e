"""Moonshot's wire spec for chat completions, switched on with
``vllm serve ... --middleware vllm_k3_plugin.wire.MoonshotWireSpec`` (standard
library only: it imports nothing of vLLM or the rest of the plugin)."""

from vllm_k3_plugin.wire.middleware import MoonshotWireSpec

__all__ = ["MoonshotWireSpec"]
