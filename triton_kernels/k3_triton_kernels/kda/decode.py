"""One KDA decode step for a batch of sequences, each reading and writing its state in
vLLM's cache slots: the Triton kernel and its launcher; the PyTorch reference is
``naive.kda_decode_reference``.

Per sequence ``n`` (one new token) and head ``h`` (``K`` = ``V`` = head dim):

1. causal depthwise conv (kernel ``W``) of the raw ``q|k|v`` projections against the
   ``W-1`` previous inputs in the conv state, then SiLU; the state shifts by one;
2. ``q̂ = q / sqrt(Σq² + 1e-6) · K^-½``, ``k̂ = k / sqrt(Σk² + 1e-6)``;
3. ``g = lower_bound · sigmoid(e^{A_log[h]} · (decay + dt_bias))`` per key channel;
4. ``S ← diag(e^g) S``; ``S ← S + β k̂ (v − Sᵀk̂)ᵀ``; ``o = Sᵀ q̂`` (``S`` ``[K, V]``
   fp32, in place in the recurrent cache).

The output gate and RMSNorm need the whole ``V`` row of every head and are left to
the caller; the kernel tiles ``V`` so that one program holds a ``[K, BLOCK_V]`` slice
of the state.

Shapes: ``qkv`` ``[N, 3C]`` (``C`` = heads · K, this rank), ``conv_weight``
``[3C, W]``, ``conv_state`` ``[slots, 3C, W-1]`` (any strides), ``decay`` ``[N, C]``,
``dt_bias`` ``[C]``, ``a_log`` ``[H]``, ``beta`` ``[N, H]``, ``recurrent_state``
``[slots, H, K, V]`` fp32, ``slots`` ``[N]``. Returns ``o`` ``[N, H, V]`` fp32.
"""

from __future__ import annotations

import torch

from k3_triton_kernels.kda.naive import kda_decode_reference
from k3_triton_kernels.runtime import log_path, triton_blocker

# -- Triton kernel --------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _conv_silu(
        x_ptr,
        w_ptr,
        state_ptr,
        stride_wc,
        stride_sc,
        stride_sw,
        channel,
        CONV: tl.constexpr,
    ):
        """Conv + SiLU of ``channel`` (a vector of channel indices). Reads the conv
        state only: a later launch shifts it, after every program has read it."""
        x = tl.load(x_ptr + channel).to(tl.float32)
        acc = x * tl.load(w_ptr + channel * stride_wc + (CONV - 1)).to(tl.float32)
        for tap in tl.static_range(CONV - 1):
            past = tl.load(state_ptr + channel * stride_sc + tap * stride_sw)
            acc += past.to(tl.float32) * tl.load(w_ptr + channel * stride_wc + tap).to(
                tl.float32
            )
        return acc * tl.sigmoid(acc)

    @triton.jit
    def _kda_decode_step(
        qkv_ptr,
        conv_w_ptr,
        conv_state_ptr,
        decay_ptr,
        dt_bias_ptr,
        a_log_ptr,
        beta_ptr,
        state_ptr,
        slots_ptr,
        out_ptr,
        stride_qkv,
        stride_wc,
        stride_cs_slot,
        stride_cs_c,
        stride_cs_w,
        stride_decay,
        stride_beta,
        stride_s_slot,
        stride_s_h,
        stride_s_k,
        stride_o_n,
        stride_o_h,
        channels,
        heads,
        lower_bound,
        DIM: tl.constexpr,
        BLOCK_V: tl.constexpr,
        CONV: tl.constexpr,
    ):
        n = tl.program_id(0)
        h = tl.program_id(1)
        v_block = tl.program_id(2)
        slot = tl.load(slots_ptr + n).to(tl.int64)
        d = tl.arange(0, DIM)
        v_idx = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
        x_ptr = qkv_ptr + n * stride_qkv
        cs_ptr = conv_state_ptr + slot * stride_cs_slot
        # Every V block recomputes q and k.
        q = _conv_silu(
            x_ptr, conv_w_ptr, cs_ptr, stride_wc, stride_cs_c, stride_cs_w,
            h * DIM + d, CONV,
        )  # fmt: skip
        k = _conv_silu(
            x_ptr, conv_w_ptr, cs_ptr, stride_wc, stride_cs_c, stride_cs_w,
            channels + h * DIM + d, CONV,
        )  # fmt: skip
        v = _conv_silu(
            x_ptr, conv_w_ptr, cs_ptr, stride_wc, stride_cs_c, stride_cs_w,
            2 * channels + h * DIM + v_idx, CONV,
        )  # fmt: skip
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6) / tl.sqrt(DIM * 1.0)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        u = tl.load(decay_ptr + n * stride_decay + h * DIM + d).to(tl.float32)
        u += tl.load(dt_bias_ptr + h * DIM + d).to(tl.float32)
        a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        g = lower_bound * tl.sigmoid(a * u)
        beta = tl.load(beta_ptr + n * stride_beta + h).to(tl.float32)

        s_ptr = (
            state_ptr
            + slot * stride_s_slot
            + h * stride_s_h
            + d[:, None] * stride_s_k
            + v_idx[None, :]
        )
        s = tl.load(s_ptr) * tl.exp(g)[:, None]
        predicted = tl.sum(s * k[:, None], axis=0)
        s += k[:, None] * (beta * (v - predicted))[None, :]
        tl.store(s_ptr, s)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + n * stride_o_n + h * stride_o_h + v_idx, o)

    @triton.jit
    def _shift_conv_state(
        qkv_ptr,
        conv_state_ptr,
        slots_ptr,
        stride_qkv,
        stride_cs_slot,
        stride_cs_c,
        stride_cs_w,
        channels,
        BLOCK_C: tl.constexpr,
        CONV: tl.constexpr,
    ):
        """The conv state of all ``3C`` channels, shifted once per sequence: a launch
        of its own, so no program of the step reads a tap already shifted."""
        n = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = c < 3 * channels
        slot = tl.load(slots_ptr + n).to(tl.int64)
        base = conv_state_ptr + slot * stride_cs_slot + c * stride_cs_c
        for tap in tl.static_range(CONV - 2):
            shifted = tl.load(base + (tap + 1) * stride_cs_w, mask=mask)
            tl.store(base + tap * stride_cs_w, shifted, mask=mask)
        x = tl.load(qkv_ptr + n * stride_qkv + c, mask=mask)
        tl.store(
            base + (CONV - 2) * stride_cs_w,
            x.to(conv_state_ptr.dtype.element_ty),
            mask=mask,
        )


# -- launcher -------------------------------------------------------------------------


def _unsupported(qkv, recurrent_state, conv_weight) -> str | None:
    blocker = triton_blocker(qkv.device)
    if blocker is not None:
        return blocker
    dim = recurrent_state.shape[-1]
    if dim < 16 or dim & (dim - 1) or recurrent_state.shape[-2] != dim:
        shape = tuple(recurrent_state.shape[-2:])
        return f"head dim {shape} (needs K = V, a power of two)"
    if recurrent_state.dtype != torch.float32:
        return f"recurrent state dtype {recurrent_state.dtype}"
    if recurrent_state.stride(-1) != 1:
        return "recurrent state not contiguous in V"
    for name, tensor in (("qkv", qkv), ("conv weight", conv_weight)):
        if tensor.stride(-1) != 1:
            return f"{name} not contiguous in its last dim"
    if conv_weight.shape[-1] < 2:
        return f"conv kernel {conv_weight.shape[-1]}"
    return None


def kda_decode(
    qkv,
    conv_weight,
    conv_state,
    decay,
    dt_bias,
    a_log,
    beta,
    recurrent_state,
    slots,
    *,
    lower_bound: float = -5.0,
    block_v: int = 32,
) -> torch.Tensor:
    """One decode step (Triton where it applies, else the reference); updates
    ``conv_state`` and ``recurrent_state`` at ``slots`` in place."""
    reason = _unsupported(qkv, recurrent_state, conv_weight)
    for name, tensor in (("decay", decay), ("dt_bias", dt_bias), ("beta", beta)):
        if reason is None and tensor.stride(-1) != 1:
            reason = f"{name} not contiguous in its last dim"
    log_path("KDA decode", reason)
    args = (qkv, conv_weight, conv_state, decay, dt_bias, a_log, beta)
    if reason is not None:
        return kda_decode_reference(
            *args, recurrent_state, slots, lower_bound=lower_bound
        )
    tokens = qkv.shape[0]
    heads = a_log.shape[0]
    dim = recurrent_state.shape[-1]
    channels = qkv.shape[1] // 3
    block_v = min(block_v, dim)
    conv = conv_weight.shape[-1]
    out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=qkv.device)
    if tokens == 0:
        return out
    slots = slots.to(torch.int32)
    _kda_decode_step[(tokens, heads, dim // block_v)](
        qkv, conv_weight, conv_state, decay, dt_bias, a_log, beta, recurrent_state,
        slots, out,
        qkv.stride(0), conv_weight.stride(0),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        decay.stride(0), beta.stride(0),
        recurrent_state.stride(0), recurrent_state.stride(1), recurrent_state.stride(2),
        out.stride(0), out.stride(1),
        channels, heads, lower_bound,
        DIM=dim, BLOCK_V=block_v, CONV=conv,
    )  # fmt: skip
    block_c = 128
    _shift_conv_state[(tokens, triton.cdiv(3 * channels, block_c))](
        qkv, conv_state, slots,
        qkv.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        channels, BLOCK_C=block_c, CONV=conv,
    )  # fmt: skip
    return out


__all__ = ["kda_decode", "kda_decode_reference"]
