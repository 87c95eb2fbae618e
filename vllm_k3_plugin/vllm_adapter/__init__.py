"""Thin bindings of the sans-I/O readers to vLLM's parser APIs and registries.

Everything vLLM-specific lives here; ``vllm_k3_plugin`` outside this package imports
no vLLM module.
"""
