"""Triton kernels for Kimi-K3, installed as ``k3_triton_kernels``.

vLLM imports a package named ``triton_kernels``; this folder is mapped to another import
name in ``pyproject.toml`` so it never shadows it. The kernels themselves are not
written yet (see the issue "Triton FP8 kernels for Kimi-K3").
"""
