"""Kimi-K3.1's sparse attention on GPUs: vLLM's own K3.1 layers in the class.

Where the installed vLLM serves K3.1 on this platform (``vllm.models.kimi_k3``, from
0.34, on CUDA), a DSA layer of the class takes vLLM's indexer (``KimiK3DSAIndexer``:
its FP8 key cache in vLLM's cache manager, its DeepGEMM scoring, the top-k written
into one model-level buffer) and the sparse MLA backend vLLM's platform selects for
a sparse MLA layer, as vLLM's own K3.1 class does. vLLM's K3.1 layers refuse ROCm
(FlashMLA sparse and the DeepGEMM indexer are CUDA kernels), and so does the class.

Checkpoint names stay K3.1's (``indexer.{wq_b,wk,weights_proj,k_norm}``); the
loader maps them into vLLM's indexer (``INDEXER_PARAMETERS``), as vLLM's own loader
does: ``wq_b`` is its ``wq_index``, ``wk`` and ``weights_proj`` the two shards of
its ``wkv_index``, ``k_norm`` its ``k_index_norm``.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import CacheConfig, VllmConfig, get_current_vllm_config
from vllm.platforms import current_platform

# Checkpoint name under ``indexer.`` -> (vLLM's parameter under ``indexer.``, shard).
INDEXER_PARAMETERS: dict[str, tuple[str, int | None]] = {
    "wq_b": ("wq_index", None),
    "wk": ("wkv_index", 0),
    "weights_proj": ("wkv_index", 1),
    "k_norm": ("k_index_norm", None),
}
_INDEXER = ".indexer."


def installed_indexer_class() -> type | None:
    """vLLM's K3.1 indexer where the installed vLLM has one (0.34 and later)."""
    try:
        from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAIndexer
    except ImportError:
        return None
    return KimiK3DSAIndexer


def vllm_indexer_class() -> type | None:
    """vLLM's K3.1 indexer where the installed vLLM serves K3.1 on this platform (a
    CUDA GPU, vLLM 0.34 or later), else ``None``."""
    return installed_indexer_class() if current_platform.is_cuda() else None


def vllm_indexer(
    config, dsa: dict[str, Any], cache_config: CacheConfig | None, topk_slots, prefix
):
    """vLLM's indexer for one DSA layer, its query read from the MLA layer's
    normalized query latent (K3.1 has a query LoRA)."""
    indexer_class = vllm_indexer_class()
    if indexer_class is None:
        raise RuntimeError(f"{prefix}: this vLLM has no Kimi-K3.1 indexer here")
    return indexer_class(
        vllm_config=get_current_vllm_config(),
        hidden_size=config.hidden_size,
        index_q_input_size=config.q_lora_rank,
        index_head_dim=dsa["index_head_dim"],
        index_num_heads=dsa["index_num_heads"],
        index_topk=dsa["index_topk"],
        rms_norm_eps=config.rms_norm_eps,
        index_k_norm_type=dsa["index_k_norm_type"],
        cache_config=cache_config,
        topk_indices_buffer=topk_slots,
        prefix=prefix,
    )


def model_topk_buffer(vllm_config: VllmConfig, topk: int) -> torch.Tensor:
    """The top-k buffer every DSA layer shares, shaped as vLLM's K3.1 class shapes
    it: one row per scheduled token, plus the rows decode context parallelism pads
    a gathered prefill with (up to its size less one)."""
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    rows = vllm_config.scheduler_config.max_num_batched_tokens + max(dcp - 1, 0)
    return torch.empty(
        (rows, topk), dtype=torch.int32, device=current_platform.device_type
    )


def indexer_parameter(name: str) -> tuple[str, int | None] | None:
    """The vLLM indexer parameter (and shard) a checkpoint indexer tensor loads
    into; ``None`` for a name that is no indexer tensor."""
    layer, found, tail = name.partition(_INDEXER)
    if not found:
        return None
    tensor, _, field = tail.partition(".")
    if tensor not in INDEXER_PARAMETERS:
        return None
    parameter, shard = INDEXER_PARAMETERS[tensor]
    return f"{layer}{_INDEXER}{parameter}.{field}", shard
