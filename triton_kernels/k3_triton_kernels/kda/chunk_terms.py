"""The chunk terms of the chunked KDA prefill: the Triton kernel, its launcher, and the
PyTorch reference.

The chunked KDA (``naive.chunk_terms``) splits the prompt into chunks of ``C`` tokens
and computes, per chunk and head, the terms that do not depend on the state entering the
chunk (``G`` the cumulative log decay from the chunk start):

    A          = β ⊙ strictly_lower((e^G ⊙ k)(e^{−G} ⊙ k)ᵀ)     [C, C]
    X          = (I + A)⁻¹                                     (unit lower triangular)
    pseudo_values = X (β ⊙ v)        state_weights = X (β ⊙ e^G ⊙ k)
    q_grow     = e^G ⊙ q             readout = lower((e^G ⊙ q)(e^{−G} ⊙ k)ᵀ)
    k_to_end   = e^{G_C − G} ⊙ k     chunk_decay = e^{G_C}

The reference is batched PyTorch (about fifteen passes over ``[T, H, K]`` tensors and
two triangular solves); here one program per chunk and head reads its ``q, k, v, g,
β`` tiles once, keeps every intermediate in registers, inverts ``I + A`` by forward
substitution (``C`` row steps on a ``[C, C]`` tile) and writes the six terms. Dots are
fp32 (``ieee``), like the reference's.

Supported: ``C`` = 16 (longer chunks spill registers), ``K`` a power of two ≥ 16
(``tl.dot``), ``V`` ≥ 16, inputs in any float dtype with their last dim contiguous;
otherwise the reference runs and says why once.
"""

from __future__ import annotations

import torch

from k3_triton_kernels.kda.naive import ChunkTerms, chunk_terms
from k3_triton_kernels.runtime import (
    chunked_kda_tile_blocker,
    log_path,
    num_warps,
    triton_blocker,
)

kda_chunk_terms_reference = chunk_terms

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _chunk_terms(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        pv_ptr,
        sw_ptr,
        qg_ptr,
        ro_ptr,
        kte_ptr,
        decay_ptr,
        tokens,
        heads,
        value_dim,
        stride_qk_t,
        stride_qk_h,
        stride_g_t,
        stride_g_h,
        stride_v_t,
        stride_v_h,
        stride_beta_t,
        stride_beta_h,
        CHUNK: tl.constexpr,
        KEY_DIM: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        chunk = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        t = tl.arange(0, CHUNK)
        c = tl.arange(0, KEY_DIM)
        cv = tl.arange(0, BLOCK_V)
        token = chunk * CHUNK + t
        # Padding tokens read as k = v = β = 0 and g = 0: they neither decay nor write.
        live = token < tokens
        qk_at = token[:, None] * stride_qk_t + head * stride_qk_h + c[None, :]
        q = tl.load(q_ptr + qk_at, mask=live[:, None], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_at, mask=live[:, None], other=0.0).to(tl.float32)
        g_at = token[:, None] * stride_g_t + head * stride_g_h + c[None, :]
        g = tl.load(g_ptr + g_at, mask=live[:, None], other=0.0).to(tl.float32)
        v_mask = live[:, None] & (cv[None, :] < value_dim)
        v_at = token[:, None] * stride_v_t + head * stride_v_h + cv[None, :]
        v = tl.load(v_ptr + v_at, mask=v_mask, other=0.0).to(tl.float32)
        beta_at = token * stride_beta_t + head * stride_beta_h
        beta = tl.load(beta_ptr + beta_at, mask=live, other=0.0).to(tl.float32)

        cumulative = tl.cumsum(g, axis=0)
        grow = tl.exp(cumulative)
        k_grow = k * grow
        k_shrink = k * tl.exp(-cumulative)
        q_grow = q * grow
        rows = t[:, None]
        cols = t[None, :]
        a = tl.dot(k_grow, tl.trans(k_shrink), input_precision="ieee")
        a = tl.where(cols < rows, beta[:, None] * a, 0.0)
        readout = tl.dot(q_grow, tl.trans(k_shrink), input_precision="ieee")
        readout = tl.where(cols <= rows, readout, 0.0)

        # (I + A)⁻¹ = I + L, L strictly lower: row i of L is n_i + n_i L with n = −A,
        # and n_i reads only rows j < i of L, which are final by then.
        n = -a
        lower = n
        for i in tl.static_range(1, CHUNK):
            n_i = tl.sum(tl.where(rows == i, n, 0.0), axis=0)
            row_i = n_i + tl.sum(n_i[:, None] * lower, axis=0)
            lower = tl.where(rows == i, row_i[None, :], lower)
        inverse = lower + tl.where(rows == cols, 1.0, 0.0)

        pseudo_values = tl.dot(inverse, beta[:, None] * v, input_precision="ieee")
        state_weights = tl.dot(inverse, beta[:, None] * k_grow, input_precision="ieee")
        total = tl.sum(tl.where(rows == CHUNK - 1, cumulative, 0.0), axis=0)  # [K]
        k_to_end = k * tl.exp(total[None, :] - cumulative)

        row = chunk * heads + head  # the [N, H] index
        out_kk = row * CHUNK * KEY_DIM + t[:, None] * KEY_DIM + c[None, :]
        tl.store(sw_ptr + out_kk, state_weights)
        tl.store(qg_ptr + out_kk, q_grow)
        tl.store(kte_ptr + out_kk, k_to_end)
        out_kv = row * CHUNK * value_dim + t[:, None] * value_dim + cv[None, :]
        tl.store(pv_ptr + out_kv, pseudo_values, mask=cv[None, :] < value_dim)
        tl.store(ro_ptr + row * CHUNK * CHUNK + rows * CHUNK + cols, readout)
        tl.store(decay_ptr + row * KEY_DIM + c, tl.exp(total))


def _unsupported(q, k, v, g, beta, chunk: int) -> str | None:
    reason = chunked_kda_tile_blocker(chunk, k.shape[-1], v.shape[-1])
    if reason is not None:
        return reason
    named = {"q": q, "k": k, "v": v, "g": g}
    for name, x in named.items():
        if not x.is_floating_point() or x.stride(-1) != 1:
            return f"{name} is not a float tensor contiguous in its last dim"
    if q.stride() != k.stride():
        return "q and k have different strides"
    if not beta.is_floating_point():
        return "beta is not a float tensor"
    return triton_blocker(q.device)


def kda_chunk_terms(q, k, v, g, beta, chunk: int) -> ChunkTerms:
    """``chunk_terms``' contract: ``q, k, g`` ``[T, H, K]``, ``v`` ``[T, H, V]``,
    ``beta`` ``[T, H]`` (``T ≥ 1``); the terms of every chunk, fp32, ``N = ⌈T / C⌉``
    chunks, the last one padded."""
    reason = _unsupported(q, k, v, g, beta, chunk)
    log_path("KDA prefill chunk terms", reason)
    if reason is not None:
        return kda_chunk_terms_reference(q, k, v, g, beta, chunk)
    tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    num_chunks = triton.cdiv(tokens, chunk)

    def empty(*shape):
        return torch.empty(*shape, dtype=torch.float32, device=q.device)

    terms = ChunkTerms(
        pseudo_values=empty(num_chunks, heads, chunk, value_dim),
        state_weights=empty(num_chunks, heads, chunk, key_dim),
        q_grow=empty(num_chunks, heads, chunk, key_dim),
        readout=empty(num_chunks, heads, chunk, chunk),
        k_to_end=empty(num_chunks, heads, chunk, key_dim),
        chunk_decay=empty(num_chunks, heads, key_dim),
    )
    _chunk_terms[(num_chunks, heads)](
        q, k, v, g, beta,
        terms.pseudo_values, terms.state_weights, terms.q_grow, terms.readout,
        terms.k_to_end, terms.chunk_decay,
        tokens, heads, value_dim,
        q.stride(0), q.stride(1), g.stride(0), g.stride(1),
        v.stride(0), v.stride(1), beta.stride(0), beta.stride(1),
        CHUNK=chunk, KEY_DIM=key_dim, BLOCK_V=triton.next_power_of_2(value_dim),
        num_warps=num_warps(nvidia=8, amd=4),  # 4 spill on sm90 (cross-compiled)
    )  # fmt: skip
    return terms


__all__ = ["kda_chunk_terms", "kda_chunk_terms_reference"]
