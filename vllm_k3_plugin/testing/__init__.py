"""Test support shipped with the package.

A tiny checkpoint with the real tokenizer, a logits processor that forces chosen
output ids, and a runner for one real ``vllm serve`` process.
"""
