"""MLA decode attention in PyTorch over the paged latent cache (the reference the
Triton decode is tested against), and the latent write into that cache. Shapes as in
``decode.py``."""

from __future__ import annotations

import torch

from k3_triton_kernels.runtime import FP8_DTYPES


def mla_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int,
    softmax_scale: float,
    kv_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, rows, heads, _ = q.shape
    page_size = cache.shape[1]
    out = torch.zeros(
        batch, rows, heads, value_dim, dtype=torch.float32, device=q.device
    )
    lse = torch.full((batch, rows, heads), float("-inf"), device=q.device)
    for b in range(batch):
        length = int(seq_lens[b])
        tokens = torch.arange(length, device=q.device)
        pages = block_table[b, tokens // page_size].long()
        latent = cache[pages, tokens % page_size].float() * kv_scale  # [L, D]
        for r in range(rows):
            visible = length - (rows - 1 - r)
            if visible <= 0:
                continue
            keys = latent[:visible]
            scores = (q[b, r].float() @ keys.T) * softmax_scale  # [H, visible]
            lse[b, r] = torch.logsumexp(scores, dim=-1)
            out[b, r] = torch.softmax(scores, dim=-1) @ keys[:, :value_dim]
    return out, lse


def write_latent(
    cache: torch.Tensor,
    slots: torch.Tensor,
    latent: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Store ``latent`` ``[T, D]`` at flat ``slots`` (``page * page_size + offset``),
    quantized to the cache dtype with the layer's scale."""
    flat = cache.view(-1, cache.shape[-1])
    values = latent.float() / kv_scale
    if cache.dtype in FP8_DTYPES:
        limit = torch.finfo(cache.dtype).max
        values = values.clamp(-limit, limit)
    flat[slots.long()] = values.to(cache.dtype)
