"""Whether this process's model class runs the Triton kernels (``VLLM_K3_KERNELS``)."""

from __future__ import annotations

from vllm.platforms import current_platform

from vllm_k3_plugin.envs import kernels


def use_triton_kernels() -> bool:
    return kernels(on_gpu=current_platform.is_cuda_alike()) == "triton"
