"""Triton kernels for Kimi-K3, installed as ``k3_triton_kernels``.

vLLM imports a package named ``triton_kernels``; this folder is mapped to another import
name in ``pyproject.toml`` so it never shadows it.

- ``mla_decode``: MLA decode attention over the paged (FP8 or BF16) latent cache;
- ``latent_moe``: the latent fused MoE, FP8 activations, FP8 or MXFP4 experts.

Each launcher takes its Triton kernel where it applies and otherwise its PyTorch
reference; which one a process uses is logged once per kernel and reason
(``runtime.log_path``), under the ``vllm.k3_plugin.kernels`` logger.
"""
