"""Which kernels this process's model class runs, block by block (``VLLM_K3_MOE``,
``VLLM_K3_MLA``, ``VLLM_K3_KDA``; ``VLLM_K3_KERNELS`` for all three)."""

from __future__ import annotations

from vllm.platforms import current_platform

from vllm_k3_plugin.envs import (
    KDA_ENV,
    MLA_ENV,
    MOE_ENV,
    kda,
    mla,
    moe,
    setting_source,
)


def kda_backend() -> str:
    """``auto``, ``triton`` or ``torch`` (``envs.kda``)."""
    return kda(on_gpu=current_platform.is_cuda_alike())


def kda_setting() -> str:
    """The setting that chose the KDA backend, as a log line names it."""
    return setting_source(KDA_ENV, kda_backend())


def moe_backend() -> str:
    """``auto``, ``triton`` or ``torch`` (``envs.moe``)."""
    return moe(on_cpu=current_platform.is_cpu())


def mla_backend() -> str:
    """``auto``, ``triton`` or ``torch`` (``envs.mla``)."""
    return mla(on_cpu=current_platform.is_cpu())


def moe_setting() -> str:
    """The setting that chose the MoE backend, as a log line names it."""
    return setting_source(MOE_ENV, moe_backend())


def mla_setting() -> str:
    """The setting that chose the MLA backend, as a log line names it."""
    return setting_source(MLA_ENV, mla_backend())
