"""What the model class checks and says as vLLM builds it: Kimi-K3.1's sparse
attention config, refused where the class cannot serve it (``sparse_attention``); a
CUDA graph mode a block cannot be captured in, refused at load naming the block
(``check_cuda_graphs``); the one log line naming the class and its layers
(``report_class``) and the quantization note (``note_quantization``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode

from vllm_k3_plugin.envs import MODEL_CLASS_ENV
from vllm_k3_plugin.model.logs import logger
from vllm_k3_plugin.model.mla import GatedMlaAttention
from vllm_k3_plugin.reference.checkpoint_format import dsa_settings, is_kda_layer


def sparse_attention(
    config, *, on_cpu: bool, vllm_layers: bool
) -> dict[str, Any] | None:
    """Kimi-K3.1's ``dsa_config`` (sparse attention on the MLA layers), checked:
    ``None`` for a dense K3. The class serves it on the CPU with its own layers
    (``dsa.py``) and, where ``vllm_layers`` (the installed vLLM has K3.1 layers for
    this GPU), with vLLM's (``dsa_vllm.py``). Elsewhere attending densely would be
    wrong past ``index_topk`` tokens, so it refuses, naming vLLM's own K3.1 class. A
    ``dsa_config`` the reference cannot honour is refused everywhere
    (``DsaConfigError``)."""
    dsa = getattr(config, "dsa_config", None)
    if dsa is None:
        return None
    if not (on_cpu or vllm_layers):
        raise ValueError(
            "Kimi-K3.1 (dsa_config: DeepSeek Sparse Attention on the MLA layers) is "
            "served by the vllm-k3-plugin model class on the CPU, and on CUDA GPUs "
            "with vLLM's Kimi-K3.1 layers (vLLM 0.34 or later); this vLLM has none "
            "for this platform, and attending densely would be wrong past "
            f"index_topk tokens. vLLM's own class ({MODEL_CLASS_ENV}=vllm) serves "
            "Kimi-K3.1 on CUDA GPUs with vLLM 0.34 or later; its ROCm Kimi-K3 class "
            "has no sparse attention"
        )
    layout = ("num_hidden_layers", "linear_attn_config")
    return dsa_settings(
        {"dsa_config": dsa, **{key: getattr(config, key, None) for key in layout}}
    )


def report_class(model: nn.Module, config) -> None:
    text = config.to_dict()
    kinds = [
        "KDA" if is_kda_layer(text, i) else "MLA"
        for i in range(config.num_hidden_layers)
    ]
    dsa = dsa_settings(text)
    # The indexers built (this pipeline stage's), not the config's count.
    indexers = sum(
        isinstance(module, GatedMlaAttention) and module.sparse
        for module in model.modules()
    )
    sparse = "" if dsa is None else f"; DSA on {indexers} (top-{dsa['index_topk']})"
    logger.info(
        "Kimi-K3 model class %s.%s: %d layers (%d KDA, %d MLA%s), attention-residual "
        "block %d, %d experts (top-%d)",
        type(model).__module__,
        type(model).__qualname__,
        len(kinds),
        kinds.count("KDA"),
        kinds.count("MLA"),
        sparse,
        config.attn_res_block_size,
        config.num_experts,
        config.num_experts_per_token,
    )


def note_quantization(vllm_config: VllmConfig) -> None:
    quant = vllm_config.quant_config
    if quant is not None:
        logger.info(
            "Kimi-K3: the checkpoint's %s routed experts are decoded on load; the "
            "other layers are BF16 as published",
            quant.get_name(),
        )


def check_cuda_graphs(vllm_config: VllmConfig, model: nn.Module, *, on_gpu: bool):
    """Refuse at load, naming the block, a CUDA graph configuration a block of this
    model cannot be captured in, rather than fail at capture.

    vLLM captures K3 two ways (it never compiles it): full graphs of uniform decode
    batches (both vendors; vLLM's decorated ops run inside them), and on NVIDIA,
    where vLLM turns breakable graphs on for K3 (``VLLM_USE_BREAKABLE_CUDAGRAPH``;
    0.34 keeps the decision in ``CompilationConfig.use_breakable_cudagraph``),
    breakable graphs of the other batches. What each block is in them:

    - KDA: the delta rule is an eager break (it reads a prefill's layout on the
      host); a decode-only step, with or without draft tokens, reads nothing back
      and is captured whole in a full graph (``KdaAttention._decode_only``,
      ``_windows``). Its metadata is vLLM's GDN builder's (uniform batches).
    - Kimi-K3.1's indexer (vLLM's, CUDA): vLLM's ``sparse_attn_indexer`` op, an
      eager break in breakable graphs and inside full decode graphs, as in vLLM's
      own K3.1 class.
    - MLA: vLLM's ``MLAAttention``, a break. Under ``K3_TRITON_MLA`` (metadata:
      vLLM's Triton MLA builder, uniform batches) our decode kernel splits each
      row's own length on the device, its split count fixed at capture from the
      capture's ``max_seq_len`` (vLLM's ``max_model_len``); under
      ``VLLM_K3_MLA=auto``, vLLM's backend and its builder's declared support.
    - MoE on the kernels or on vLLM's FusedMoE, the attention residuals, norms,
      projections and the embedding: captured; they read nothing back (vLLM runs
      the LM head outside the graph). The MoE's PyTorch path groups tokens on
      the host: refused here, naming the layer and why it took that path."""
    mode = vllm_config.compilation_config.cudagraph_mode
    if not on_gpu or mode is None or mode == CUDAGraphMode.NONE:
        return
    blocked = [
        (name, module.graph_blocker)
        for name, module in model.named_modules()
        if getattr(module, "graph_blocker", None)
    ]
    if blocked:
        name, reason = blocked[0]
        more = f" (and {len(blocked) - 1} more layers)" if len(blocked) > 1 else ""
        raise ValueError(
            f"Kimi-K3: {name}{more} cannot be captured in CUDA graphs "
            f"(cudagraph_mode {mode.name}): {reason}. Serve with --enforce-eager"
        )
