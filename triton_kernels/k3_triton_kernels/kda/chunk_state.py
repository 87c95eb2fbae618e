"""The state pass of the chunked KDA prefill: the Triton kernel, its launcher, and the
PyTorch reference.

The chunked KDA (``naive.chunk_terms``) computes every chunk's state-independent terms
at once (batched matmuls and two triangular solves); what is left runs chunk after
chunk, per head, on the ``[K, V]`` fp32 state:

    w = pseudo_values − state_weights · S         [C, V]
    o = q_grow · S + readout · w                  [C, V]
    S = diag(chunk_decay) · S + k_toᵀ_end · w      [K, V]

One program holds a ``[K, BLOCK_V]`` slice of one head's state in registers for the
whole prompt (the columns of ``V`` are independent), so the state is read and written
once per prompt instead of once per chunk, and there is one launch instead of one
per chunk. Dots are fp32 (``ieee``): the state carries over the whole prompt, and the
reference is fp32.

Supported: ``C``, ``K`` powers of two ≥ 16 (``tl.dot``), ``V`` ≥ 16, fp32 contiguous
terms; otherwise the reference runs and says why once.
"""

from __future__ import annotations

import torch

from k3_triton_kernels.kda.naive import ChunkTerms, state_pass
from k3_triton_kernels.runtime import (
    chunked_kda_tile_blocker,
    log_path,
    num_warps,
    triton_blocker,
)

kda_state_pass_reference = state_pass

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _state_pass(
        pv_ptr,
        sw_ptr,
        qg_ptr,
        ro_ptr,
        kte_ptr,
        decay_ptr,
        state_ptr,
        out_ptr,
        num_chunks,
        heads,
        value_dim,
        CHUNK: tl.constexpr,
        KEY_DIM: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_mask = cols < value_dim
        t = tl.arange(0, CHUNK)
        c = tl.arange(0, KEY_DIM)
        state_at = state_ptr + head * KEY_DIM * value_dim
        s = tl.load(
            state_at + c[:, None] * value_dim + cols[None, :],
            mask=col_mask[None, :],
            other=0.0,
        )
        for chunk in range(num_chunks):
            row = (chunk * heads + head).to(tl.int64)  # the [N, H] index
            kv_tile = row * CHUNK * value_dim + t[:, None] * value_dim + cols[None, :]
            kk_tile = row * CHUNK * KEY_DIM + t[:, None] * KEY_DIM + c[None, :]
            pv = tl.load(pv_ptr + kv_tile, mask=col_mask[None, :], other=0.0)
            sw = tl.load(sw_ptr + kk_tile)
            w = pv - tl.dot(sw, s, input_precision="ieee")
            qg = tl.load(qg_ptr + kk_tile)
            ro = tl.load(ro_ptr + row * CHUNK * CHUNK + t[:, None] * CHUNK + t[None, :])
            o = tl.dot(qg, s, input_precision="ieee") + tl.dot(
                ro, w, input_precision="ieee"
            )
            tl.store(out_ptr + kv_tile, o, mask=col_mask[None, :])
            kte = tl.load(kte_ptr + kk_tile)
            decay = tl.load(decay_ptr + row * KEY_DIM + c)
            s = decay[:, None] * s + tl.dot(tl.trans(kte), w, input_precision="ieee")
        tl.store(
            state_at + c[:, None] * value_dim + cols[None, :], s, mask=col_mask[None, :]
        )


def _unsupported(terms: ChunkTerms, state: torch.Tensor) -> str | None:
    _, _, chunk, key_dim = terms.state_weights.shape
    value_dim = terms.pseudo_values.shape[-1]
    reason = chunked_kda_tile_blocker(chunk, key_dim, value_dim)
    if reason is not None:
        return reason
    tensors = (*terms, state)
    if any(x.dtype != torch.float32 or not x.is_contiguous() for x in tensors):
        return "terms or state not contiguous fp32"
    return triton_blocker(state.device)


def kda_state_pass(
    terms: ChunkTerms, state: torch.Tensor, *, block_v: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``state_pass``'s contract: ``(out [N, H, C, V], final state [H, K, V])``;
    ``state`` is updated in place and returned (on the fallback too)."""
    reason = _unsupported(terms, state)
    log_path("KDA prefill state pass", reason)
    if reason is not None:
        out, final = kda_state_pass_reference(terms, state)
        state.copy_(final)
        return out, state
    num_chunks, heads, chunk, key_dim = terms.state_weights.shape
    value_dim = terms.pseudo_values.shape[-1]
    out = torch.empty_like(terms.pseudo_values)
    block_v = min(block_v, triton.next_power_of_2(value_dim))
    grid = (heads, triton.cdiv(value_dim, block_v))
    _state_pass[grid](
        terms.pseudo_values, terms.state_weights, terms.q_grow, terms.readout,
        terms.k_to_end, terms.chunk_decay, state, out,
        num_chunks, heads, value_dim,
        CHUNK=chunk, KEY_DIM=key_dim, BLOCK_V=block_v,
        num_warps=num_warps(nvidia=8, amd=4),  # 4 spill on sm90 (cross-compiled)
    )  # fmt: skip
    return out, state


__all__ = ["kda_state_pass", "kda_state_pass_reference"]
