"""Latent fused MoE for Kimi-K3 (FP8 activations, the checkpoint's MXFP4 expert
weights): the GEMM kernels and the launcher; the PyTorch reference is ``naive.py``.

On the latent ``z`` ``[T, L]`` (K3: ``L`` = 3584) with routing ``ids`` / ``weights``
``[T, top_k]``:

1. one launch (``grouping.prepare_rows``): the (token, slot) pairs are grouped by
   expert and padded per ``BLOCK_M`` block, and beside the grouping program, one a
   token, the activations are quantized to FP8 (``scale = max|z_t| / fp8_max``) and
   the output rows zeroed (past 1,024 pairs, and on AMD, a second launch places the
   pairs);
2. the gate/up GEMM, per block, against ``w13`` (``[E, 2I, L]`` values; one dot over
   gate and up rows interleaved), SiTU-GLU -> ``h`` ``[pairs, I]``;
3. ``h`` is requantized to FP8 per row (``fp8_rows.quantize_rows``);
4. the down GEMM, per block, against ``w2`` (``[E, L, I]`` values), times the
   routing weight, added into the token's output row.

Four launches at decode sizes (five on AMD): each launch costs a few microseconds
of its own even in a CUDA graph, next to GEMMs of about 130 µs at one token on an
H200 (a grouping and a quantization of one token took 5-6 µs each in a graph
replay, ``benchmarks/results/moe_tiles_h200.txt``).

FP8 is OCP ``float8_e4m3fn`` (MI355X, CUDA) or ``float8_e4m3fnuz`` (gfx94x, max 240):
the caller names the activations' dtype (``fp8_dtype``, the platform's FP8).

The weights are the checkpoint's ``weight_packed`` e2m1 pairs with UE8M0 scales per
32 inputs. FP8 expert checkpoints are vLLM's ``FusedMoE``'s to run: this kernel
with FP8 per-channel weights measured 0.72-0.93x of vLLM's ``fused_moe`` GEMMs on an
H200 (``benchmarks/results/kernels_h200.md``).

MXFP4 weights (W4A8): ``tl.dot_scaled`` takes the packed e2m1 bytes and their e8m0
scales as they are stored, and the FP8 activations, in K tiles of whole scale
groups. On gfx950 (MI355X) that is the matrix cores' own scaled MFMA (e4m3 x
e2m1, ``v_mfma_scale_f32_*_f8f6f4``); on Hopper and gfx94x Triton decodes both
to bf16 in registers and runs a bf16 MMA. Either way each product (an FP8 value
times an e2m1 value times a power of two) is exact in fp32 and the sums are
fp32, as the reference computes; a scale byte of 255 is NaN on both sides (OCP
MX). One difference: the bf16 path builds each scale from the byte's exponent
bits, so byte 0 (2^-127) scales its 32 values (at most 6 · 2^-127) to 0. Decoding
to e4m3 instead (every e2m1 value is
exact there, but a value times its scale is not) needs a rescale of the
accumulator at every 32-wide scale group: 9-13x slower than FP8 weights on an
H200 (``kernels_h200.md``).
"""

from __future__ import annotations

import torch

from k3_triton_kernels import runtime
from k3_triton_kernels.moe.fp8_rows import quantize_rows
from k3_triton_kernels.moe.grouping import prepare_rows
from k3_triton_kernels.moe.naive import (
    ExpertWeights,
    activation_dtype,
    latent_moe_reference,
)
from k3_triton_kernels.mxfp4 import MXFP4_BLOCK
from k3_triton_kernels.runtime import log_path, triton_blocker

# -- Triton kernels -------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _load_weight_tile(
        w_ptr,
        s_ptr,
        expert,
        n,
        k0,
        k_limit,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        n_mask,
        BLOCK_K: tl.constexpr,
    ):
        """One expert's tile of ``BLOCK_K`` inputs for rows ``n``, as stored: the
        ``[BLOCK_N, BLOCK_K / 2]`` packed e2m1 bytes and ``[BLOCK_N, BLOCK_K / 32]``
        e8m0 scale bytes, which ``tl.dot_scaled`` decodes (``BLOCK_K`` covers
        whole scale groups; past K, zero bytes and unit scales)."""
        pair = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        values = tl.load(
            w_ptr + expert * stride_we + n[:, None] * stride_wn + pair[None, :],
            mask=n_mask[:, None] & (pair < k_limit // 2)[None, :],
            other=0,
        )
        group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale = tl.load(
            s_ptr + expert * stride_se + n[:, None] * stride_sn + group[None, :],
            mask=n_mask[:, None] & (group < k_limit // 32)[None, :],
            other=127,
        )
        return values, scale

    @triton.jit
    def _accumulate(acc, x, w, scale, SWAP_AB: tl.constexpr, X_FORMAT: tl.constexpr):
        """``acc`` plus ``x @ w^T``: ``tl.dot_scaled`` of the activations as
        ``X_FORMAT`` ("e4m3": OCP FP8; "bf16": another FP8, whose values bf16 holds
        exactly) and the packed e2m1 weights with their e8m0 scales. ``SWAP_AB``:
        ``acc`` is held transposed and the dot runs as ``w @ x^T``, the weight rows
        its M (Hopper's wgmma needs M of 64 or more)."""
        if X_FORMAT == "bf16":
            x = x.to(tl.bfloat16)
        if SWAP_AB:
            acc = tl.dot_scaled(w, scale, "e2m1", tl.trans(x), None, X_FORMAT, acc)
        else:
            acc = tl.dot_scaled(x, None, X_FORMAT, tl.trans(w), scale, "e2m1", acc)
        return acc

    @triton.jit
    def _block_rows(rows_ptr, block_expert_ptr, block, top_k, BLOCK_M: tl.constexpr):
        """Row block ``block``'s padded rows: (row, pair, valid, token, expert)."""
        m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(rows_ptr + m)
        valid = pair >= 0
        token = tl.where(valid, pair // top_k, 0)
        # int64 offsets: an expert's weights start past 2^31 bytes at K3's sizes.
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        return m.to(tl.int64), pair, valid, token.to(tl.int64), expert

    @triton.jit
    def _gate_up_situ(
        a_ptr,
        a_scale_ptr,
        rows_ptr,
        block_expert_ptr,
        used_rows_ptr,
        w_ptr,
        s_ptr,
        h_ptr,
        top_k,
        latent,
        inner,
        stride_am,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_hm,
        beta,
        linear_beta,
        X_FORMAT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr,
    ):
        block = tl.program_id(0)
        if block * BLOCK_M >= tl.load(used_rows_ptr):
            return  # past the used rows: no pair here
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m, _pair, valid, token, expert = _block_rows(
            rows_ptr, block_expert_ptr, block, top_k, BLOCK_M
        )
        n_mask = n < inner
        # One dot of 2 x BLOCK_N columns, gate and up interleaved (column 2j is
        # gate channel n_j, 2j + 1 its up channel n_j + inner): a wider MMA than two
        # dots of BLOCK_N, and each thread's accumulator holds both halves of a
        # pair, so splitting them after the loop moves no data.
        j = tl.arange(0, 2 * BLOCK_N)
        pair_channel = tl.program_id(1) * BLOCK_N + j // 2
        w_rows = pair_channel + (j % 2) * inner
        w_mask = pair_channel < inner
        if SWAP_AB:
            acc = tl.zeros((2 * BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), tl.float32)
        for k0 in range(0, latent, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < latent
            a = tl.load(
                a_ptr + token[:, None] * stride_am + k[None, :],
                mask=valid[:, None] & k_mask[None, :],
                other=0.0,
            )
            w, s = _load_weight_tile(
                w_ptr, s_ptr, expert, w_rows, k0, latent,
                stride_we, stride_wn, stride_se, stride_sn, w_mask, BLOCK_K,
            )  # fmt: skip
            acc = _accumulate(acc, a, w, s, SWAP_AB, X_FORMAT)
        if SWAP_AB:
            acc = tl.trans(acc)
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        a_scale = tl.load(a_scale_ptr + token, mask=valid, other=0.0)
        gate = gate * a_scale[:, None]
        up = up * a_scale[:, None]
        # SiTU-GLU: beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta)
        tanh_g = 2.0 * tl.sigmoid(2.0 * gate / beta) - 1.0
        tanh_u = 2.0 * tl.sigmoid(2.0 * up / linear_beta) - 1.0
        h = beta * tanh_g * tl.sigmoid(gate) * linear_beta * tanh_u
        tl.store(
            h_ptr + m[:, None] * stride_hm + n[None, :],
            h,
            mask=valid[:, None] & n_mask[None, :],
        )

    @triton.jit
    def _down_combine(
        h_ptr,
        h_scale_ptr,
        rows_ptr,
        block_expert_ptr,
        used_rows_ptr,
        w_ptr,
        s_ptr,
        routing_ptr,
        out_ptr,
        top_k,
        latent,
        inner,
        stride_hm,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_om,
        X_FORMAT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SWAP_AB: tl.constexpr,
        ROWS_FIRST: tl.constexpr,
    ):
        # The launch order: by default a row block's column programs run side by
        # side (see ``latent_moe``'s ``down_rows_first``).
        if ROWS_FIRST:
            block, column = tl.program_id(0), tl.program_id(1)
        else:
            block, column = tl.program_id(1), tl.program_id(0)
        if block * BLOCK_M >= tl.load(used_rows_ptr):
            return  # past the used rows: no pair here
        n = column * BLOCK_N + tl.arange(0, BLOCK_N)
        m, pair, valid, token, expert = _block_rows(
            rows_ptr, block_expert_ptr, block, top_k, BLOCK_M
        )
        n_mask = n < latent
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, inner, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < inner
            h = tl.load(
                h_ptr + m[:, None] * stride_hm + k[None, :],
                mask=valid[:, None] & k_mask[None, :],
                other=0.0,
            )
            w, w_scale = _load_weight_tile(
                w_ptr, s_ptr, expert, n, k0, inner,
                stride_we, stride_wn, stride_se, stride_sn, n_mask, BLOCK_K,
            )  # fmt: skip
            acc = _accumulate(acc, h, w, w_scale, SWAP_AB, X_FORMAT)
        if SWAP_AB:
            acc = tl.trans(acc)
        h_scale = tl.load(h_scale_ptr + m, mask=valid, other=0.0)
        routing = tl.load(routing_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
        acc = acc * (h_scale * routing)[:, None]
        tl.atomic_add(
            out_ptr + token[:, None] * stride_om + n[None, :],
            acc,
            mask=valid[:, None] & n_mask[None, :],
        )


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """``sort_by_expert`` in Triton (``grouping.prepare_rows`` without a latent):
    the same ``(rows, block_expert, used_rows)`` except the order of the pairs
    within an expert's group (which the GEMMs do not depend on); ``rows`` is
    int32."""
    return prepare_rows(ids, num_experts, block_m)[:3]


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis (the first: 2^31 - 1)


def down_grid(
    row_blocks: int, column_blocks: int, rows_first: bool
) -> tuple[tuple[int, int], bool]:
    """The down GEMM's grid and whether its row blocks come first: column blocks
    first unless asked, or unless the row blocks outnumber what the grid's second
    axis holds."""
    rows_first = rows_first or row_blocks > MAX_GRID_Y
    if rows_first:
        return (row_blocks, column_blocks), True
    return (column_blocks, row_blocks), False


def _check_block_k(block_k: int) -> None:
    """A K tile holds whole MXFP4 scale groups."""
    if block_k < MXFP4_BLOCK or block_k & (block_k - 1):
        raise ValueError(
            f"block_k {block_k}: a power of two ≥ {MXFP4_BLOCK} (whole MXFP4 scale "
            "groups a K tile)"
        )


def default_tiles(tokens: int) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)`` of the two GEMMs: the 64 x 128 tiles that
    sweeps and benchmark runs on an H200 found fastest for this kernel with FP8
    weights at K3's shapes (112 experts a device, top-16, latent 3584, inner 3072;
    ``benchmarks/sweep_moe_tiles.py``, ``benchmarks/results/moe_tiles_h200.txt``,
    ``kernels_h200.md``): block_m 16 under 256 tokens, 64 from 256; 128-wide tiles
    for one token measured 7% faster in the sweep and 6% slower in the benchmark
    run after it: not taken. MXFP4's own tiles are untimed: its K tile of 128
    covers four scale groups; from 256 tokens it takes K tiles of 64, two groups.
    There, at 128, sm90's gate/up GEMM (the weights decoded to bf16 for the dot)
    holds 255 registers, on the cap: Triton 3.5, 3.6 and 3.8 (vLLM 0.33's) spill
    16 bytes, 3.9 none. At 64 it holds 248 (3.8) and 226 (3.9), two programs a
    multiprocessor, and the down GEMM fits three where 128 fits two
    (``tests/kernels/cross_compile.py``)."""
    block_m = 64 if tokens >= 256 else 16
    block_k = 64 if tokens >= 256 else 128
    return block_m, 64, block_k


def latent_moe(
    z: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertWeights,
    *,
    beta: float = 4.0,
    linear_beta: float = 25.0,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    fp8_dtype: torch.dtype | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    swap_ab: bool | None = None,
    down_rows_first: bool = False,
) -> torch.Tensor:
    """The routed experts' weighted sum ``[T, L]`` in fp32 (Triton where it runs, else
    the reference). Both leave out pairs routed outside ``[0, E)``: another rank's
    experts. ``fp8_dtype``: the activations' FP8 dtype. Tiles:
    ``default_tiles`` unless given. ``swap_ab``: run the GEMMs' dots as weights
    times activations (see ``_accumulate``); by default under 64-row blocks off
    AMD (whose MFMA takes 16 rows as they are).
    ``down_rows_first``: the down GEMM's programs in the gate/up GEMM's order, row
    blocks first. Each column block then sweeps every row block, so once the FP8
    intermediate outgrows the L2 it is read from HBM once per column block (4,096
    tokens: 201 MB, 56 times, 11 GB against the weights' 1.2 GB); by default a
    row block's column programs run side by side and share its rows in the L2,
    and consecutive row blocks (one expert's) share that expert's weights."""
    tiles = default_tiles(z.shape[0])
    block_m, block_n, block_k = (
        given or default
        for given, default in zip((block_m, block_n, block_k), tiles, strict=True)
    )
    _check_block_k(block_k)
    dtype = activation_dtype(fp8_dtype)
    if z.shape[1] % 32 or experts.w2.shape[2] % 16:
        raise ValueError(
            f"MXFP4 experts need latent and inner sizes that are multiples of 32 "
            f"(one scale per 32 inputs); got {z.shape[1]} and {experts.w2.shape[2] * 2}"
        )
    reason = triton_blocker(z.device)
    log_path("Latent MoE", reason)
    if reason is not None:
        return latent_moe_reference(
            z, ids, weights, experts, beta=beta, linear_beta=linear_beta,
            fp8_dtype=dtype,
        )  # fmt: skip
    tokens, latent = z.shape
    top_k = ids.shape[1]
    num_experts = experts.w13.shape[0]
    inner = experts.w13.shape[1] // 2
    if ids.numel() == 0:  # no pair: nothing to group, quantize or add
        return torch.zeros(tokens, latent, dtype=torch.float32, device=z.device)
    rows, block_expert, used_rows, z_q, z_scale, out = prepare_rows(
        ids, num_experts, block_m, z, dtype
    )
    # Padding rows of h are never written, quantized or read.
    h = torch.empty(rows.numel(), inner, dtype=torch.float32, device=z.device)
    if swap_ab is None:
        swap_ab = block_m < 64 and not runtime.on_rocm()
    launch = {
        "num_warps": num_warps,
        "SWAP_AB": swap_ab,
        "X_FORMAT": "e4m3" if dtype == torch.float8_e4m3fn else "bf16",
    }
    if num_stages is not None:  # else Triton's default for the platform
        launch["num_stages"] = num_stages
    w13, s13 = experts.w13, experts.w13_scale
    grid = (rows.numel() // block_m, triton.cdiv(inner, block_n))
    _gate_up_situ[grid](
        z_q, z_scale, rows, block_expert, used_rows, w13, s13, h, top_k, latent, inner,
        z_q.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        h.stride(0), beta, linear_beta,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        **launch,
    )  # fmt: skip
    h_q, h_scale = quantize_rows(h, dtype, rows=rows, used_rows=used_rows)
    w2, s2 = experts.w2, experts.w2_scale
    routing = weights.reshape(-1).float().contiguous()
    grid, down_rows_first = down_grid(
        rows.numel() // block_m, triton.cdiv(latent, block_n), down_rows_first
    )
    _down_combine[grid](
        h_q, h_scale, rows, block_expert, used_rows, w2, s2, routing, out, top_k,
        latent, inner,
        h_q.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        ROWS_FIRST=down_rows_first,
        **launch,
    )  # fmt: skip
    return out


__all__ = ["default_tiles", "group_by_expert", "latent_moe", "prepare_rows"]
