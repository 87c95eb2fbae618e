"""Latent fused MoE for Kimi-K3 (FP8 activations, the checkpoint's MXFP4 expert
weights): the Triton kernels and their launcher; the PyTorch reference is
``naive.py``.

On the latent ``z`` ``[T, L]`` (K3: ``L`` = 3584) with routing ``ids`` / ``weights``
``[T, top_k]``:

1. one launch (``prepare_rows``): the (token, slot) pairs are grouped by expert and
   padded per ``BLOCK_M`` block, and beside the grouping program, one a token, the
   activations are quantized to FP8 (``scale = max|z_t| / fp8_max``) and the
   output rows zeroed (past 1,024 pairs, and on AMD, a second launch places the
   pairs);
2. the gate/up GEMM, per block, against ``w13`` (``[E, 2I, L]`` values; one dot over
   gate and up rows interleaved), SiTU-GLU -> ``h`` ``[pairs, I]``;
3. ``h`` is requantized to FP8 per row;
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

from typing import NamedTuple

import torch

from k3_triton_kernels import runtime
from k3_triton_kernels.moe.naive import (
    ExpertWeights,
    activation_dtype,
    group_capacity,
    latent_moe_reference,
)
from k3_triton_kernels.mxfp4 import MXFP4_BLOCK
from k3_triton_kernels.runtime import (
    E4M3_EXPONENT_BIAS,
    E4M3_NAN_BYTE,
    FP8_DTYPES,
    log_path,
    triton_blocker,
)

# -- Triton kernels -------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Where each e4m3 flavour's subnormals end (2^(1 - bias)), their steps per unit
# (2^(bias + 2): three mantissa bits below the smallest normal), and its NaN byte.
E4M3_RANGES = {
    dtype: {
        "MIN_NORMAL": 2.0 ** (1 - bias),
        "SUBNORMAL_STEPS": 2.0 ** (bias + 2),
        "NAN_BYTE": E4M3_NAN_BYTE[dtype],
    }
    for dtype, bias in E4M3_EXPONENT_BIAS.items()
}

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
    def _plan_groups(
        ids_ptr,
        rows_ptr,
        block_expert_ptr,
        cursor_ptr,
        used_rows_ptr,
        pairs,
        capacity,
        num_experts,
        BLOCK_M: tl.constexpr,
        BINS: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCKS_A_STEP: tl.constexpr,
    ):
        """In one program: count the pairs of each expert, pad each group to
        ``BLOCK_M`` rows, and write where each group starts (``cursor``), the rows
        used, every block's expert, and -1 in every row."""
        counts = tl.zeros((BINS,), tl.int32)
        for p0 in range(0, pairs, CHUNK):
            p = p0 + tl.arange(0, CHUNK)
            expert = tl.load(ids_ptr + p, mask=p < pairs, other=num_experts)
            # Out-of-range ids (checked before any narrowing) and the tail count in
            # a spare bin: never placed.
            in_range = (expert >= 0) & (expert < num_experts)
            expert = tl.where(in_range, expert, BINS - 1).to(tl.int32)
            counts += tl.histogram(expert, BINS)
        bins = tl.arange(0, BINS)
        counts = tl.where(bins < num_experts, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, 0)
        tl.store(cursor_ptr + bins, ends - padded)
        tl.store(used_rows_ptr, tl.sum(padded, 0))
        for r0 in range(0, capacity, CHUNK):
            r = r0 + tl.arange(0, CHUNK)
            tl.store(rows_ptr + r, tl.full((CHUNK,), -1, tl.int32), mask=r < capacity)
        blocks = capacity // BLOCK_M
        for b0 in range(0, blocks, BLOCKS_A_STEP):
            b = b0 + tl.arange(0, BLOCKS_A_STEP)
            # The block's expert: how many groups end at or before its first row.
            ended = (ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32)
            expert = tl.minimum(tl.sum(ended, axis=1), num_experts - 1)
            tl.store(block_expert_ptr + b, expert, mask=b < blocks)

    @triton.jit
    def _place_chunk(ids_ptr, rows_ptr, cursor_ptr, p, pairs, num_experts):
        """Pairs ``p`` each take the next row of their expert's group (in no set
        order within the group: each row's GEMM result does not depend on its
        place)."""
        expert = tl.load(ids_ptr + p, mask=p < pairs, other=0)
        placed = (p < pairs) & (expert >= 0) & (expert < num_experts)
        expert = tl.where(placed, expert, 0).to(tl.int32)
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=placed)
        tl.store(rows_ptr + row, p, mask=placed)

    @triton.jit
    def _place_pairs(
        ids_ptr, rows_ptr, cursor_ptr, pairs, num_experts, CHUNK: tl.constexpr
    ):
        p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        _place_chunk(ids_ptr, rows_ptr, cursor_ptr, p, pairs, num_experts)

    @triton.jit
    def _round_to_e4m3(x, MIN_NORMAL: tl.constexpr, SUBNORMAL_STEPS: tl.constexpr):
        """``x`` (fp32, within the format's range) rounded to the nearest e4m3 value,
        ties to even, as fp32 (so the cast that follows is exact). Exact integer and
        power-of-two arithmetic: the interpreter's own fp32 -> fp8 cast loses the
        carry into the next binade (124.3 becomes 64). ``MIN_NORMAL``: the smallest
        normal value; ``SUBNORMAL_STEPS``: subnormal steps per unit."""
        magnitude = tl.abs(x)
        bits = magnitude.to(tl.uint32, bitcast=True)
        # Normal: keep 3 of fp32's 23 mantissa bits.
        normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = normal.to(tl.float32, bitcast=True)
        steps = magnitude * SUBNORMAL_STEPS  # exact: a power of two, below 2^4
        whole = steps.to(tl.int32)
        fraction = steps - whole.to(tl.float32)
        up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))
        subnormal = (whole + up.to(tl.int32)).to(tl.float32) * (1.0 / SUBNORMAL_STEPS)
        rounded = tl.where(magnitude >= MIN_NORMAL, normal, subnormal)
        rounded = tl.where(x < 0, -rounded, rounded)
        return tl.where(x != x, x, rounded)  # NaN stays NaN

    @triton.jit
    def _max_with_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _quantize_row(
        x_row,
        out_row,
        scale_at,
        cols,
        fp8_max,
        MIN_NORMAL: tl.constexpr,
        SUBNORMAL_STEPS: tl.constexpr,
        NAN_BYTE: tl.constexpr,
        BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr,
    ):
        """``quantize_per_row`` of the row at ``x_row`` into ``out_row`` and
        ``scale_at``: ``scale = max(max|x|, 1e-12) / fp8_max``, ``x / scale``
        clamped and rounded to FP8 (IEEE division, as the reference). ``ONE_PASS``:
        the row fits one ``BLOCK``, read once."""
        # NaN propagates as in the reference (a NaN row quantizes to NaN).
        peak = tl.zeros((BLOCK,), tl.float32)
        x = tl.zeros((BLOCK,), tl.float32)
        for c0 in range(0, cols, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + c, mask=c < cols, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        peak = tl.reduce(peak, 0, _max_with_nan)
        scale = tl.math.div_rn(
            tl.maximum(peak, 1e-12, propagate_nan=tl.PropagateNan.ALL), fp8_max
        )
        for c0 in range(0, cols, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            if not ONE_PASS:
                x = tl.load(x_row + c, mask=c < cols, other=0.0).to(tl.float32)
            q = tl.math.div_rn(x, scale)
            q = tl.maximum(q, -fp8_max, propagate_nan=tl.PropagateNan.ALL)
            q = tl.minimum(q, fp8_max, propagate_nan=tl.PropagateNan.ALL)
            q = _round_to_e4m3(q, MIN_NORMAL, SUBNORMAL_STEPS)
            if NAN_BYTE == 0x80:
                # float8_e4m3fnuz has no negative zero: that byte is its NaN. A
                # negative value that rounds to zero is stored as +0, not left to
                # the cast (Triton 3.8's interpreter casts -0.0 to the NaN byte).
                q = tl.where(q == 0.0, 0.0, q)
            # The cast is exact (q is an e4m3 value); NaN gets the format's NaN
            # byte explicitly (the interpreter's cast turns it into a number).
            bits = q.to(out_row.dtype.element_ty).to(tl.uint8, bitcast=True)
            bits = tl.where(q != q, NAN_BYTE, bits)
            tl.store(out_row.to(tl.pointer_type(tl.uint8)) + c, bits, mask=c < cols)
        tl.store(scale_at, scale)

    @triton.jit
    def _quantize_rows(
        x_ptr,
        out_ptr,
        scale_ptr,
        rows_ptr,
        used_rows_ptr,
        cols,
        stride_x,
        stride_out,
        fp8_max,
        SKIP_UNUSED: tl.constexpr,
        MIN_NORMAL: tl.constexpr,
        SUBNORMAL_STEPS: tl.constexpr,
        NAN_BYTE: tl.constexpr,
        BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr,
    ):
        """``_quantize_row`` of each row, a program a row. ``SKIP_UNUSED``: a
        padding row (``rows`` -1, or past ``used_rows``) is left as it is; the down
        GEMM masks it."""
        row = tl.program_id(0)
        if SKIP_UNUSED:
            if row >= tl.load(used_rows_ptr):
                return
            if tl.load(rows_ptr + row) < 0:
                return
        _quantize_row(
            x_ptr + row.to(tl.int64) * stride_x,
            out_ptr + row.to(tl.int64) * stride_out,
            scale_ptr + row, cols, fp8_max,
            MIN_NORMAL, SUBNORMAL_STEPS, NAN_BYTE, BLOCK, ONE_PASS,
        )  # fmt: skip

    @triton.jit
    def _group_and_quantize(
        ids_ptr,
        rows_ptr,
        block_expert_ptr,
        cursor_ptr,
        used_rows_ptr,
        pairs,
        capacity,
        num_experts,
        z_ptr,
        z_q_ptr,
        z_scale_ptr,
        out_ptr,
        cols,
        fp8_max,
        BLOCK_M: tl.constexpr,
        BINS: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCKS_A_STEP: tl.constexpr,
        PLACE: tl.constexpr,
        QUANTIZE: tl.constexpr,
        MIN_NORMAL: tl.constexpr,
        SUBNORMAL_STEPS: tl.constexpr,
        NAN_BYTE: tl.constexpr,
        BLOCK: tl.constexpr,
        ONE_PASS: tl.constexpr,
    ):
        """What the GEMMs need, in one launch. Program 0 groups the pairs by
        expert (``_plan_groups``), and with ``PLACE`` places them too (else
        ``_place_pairs`` follows); program ``1 + t`` quantizes token ``t``'s
        latent to FP8 and zeroes its output row, which the down GEMM adds into
        (``z``, its FP8 copy and the output: contiguous rows of ``cols``)."""
        program = tl.program_id(0)
        if program == 0:
            _plan_groups(
                ids_ptr, rows_ptr, block_expert_ptr, cursor_ptr, used_rows_ptr,
                pairs, capacity, num_experts, BLOCK_M, BINS, CHUNK, BLOCKS_A_STEP,
            )  # fmt: skip
            if PLACE:
                # The rows' -1 and the cursor, stored by any of the program's
                # threads, seen by all before the placing: on NVIDIA the
                # barrier (bar.sync) orders global memory too; on AMD it orders
                # only shared memory, and the launcher does not place here.
                tl.debug_barrier()
                for p0 in range(0, pairs, CHUNK):
                    p = p0 + tl.arange(0, CHUNK)
                    _place_chunk(ids_ptr, rows_ptr, cursor_ptr, p, pairs, num_experts)
        elif QUANTIZE:  # (without a latent, no such program; nor its code)
            token = (program - 1).to(tl.int64)
            _quantize_row(
                z_ptr + token * cols, z_q_ptr + token * cols,
                z_scale_ptr + token, cols, fp8_max,
                MIN_NORMAL, SUBNORMAL_STEPS, NAN_BYTE, BLOCK, ONE_PASS,
            )  # fmt: skip
            out_row = out_ptr + token * cols
            for c0 in range(0, cols, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                tl.store(out_row + c, tl.zeros((BLOCK,), tl.float32), mask=c < cols)

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


# Pairs the grouping program places itself (one chunk); past that a launch of
# ``_place_pairs`` places them, a program a chunk.
GROUPING_CHUNK = 1024
# Rows up to this wide are quantized from one read (the whole row in registers).
ONE_PASS_COLS = 8192


def _row_blocking(cols: int) -> dict:
    block = triton.next_power_of_2(max(1, cols))
    if block <= ONE_PASS_COLS:
        return {"BLOCK": block, "ONE_PASS": True}
    return {"BLOCK": 1024, "ONE_PASS": False}


class Prepared(NamedTuple):
    """``prepare_rows``' results: the groups (``sort_by_expert``'s ``rows``,
    ``block_expert`` and ``used_rows``, int32, the pairs in no set order within an
    expert's group), the FP8 latent and its scales, and the zeroed output."""

    rows: torch.Tensor
    block_expert: torch.Tensor
    used_rows: torch.Tensor
    z_q: torch.Tensor | None
    z_scale: torch.Tensor | None
    out: torch.Tensor | None


def prepare_rows(
    ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    z: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> Prepared:
    """The pairs grouped by expert and, with ``z``, its rows quantized to
    ``dtype`` (an FP8 dtype) and a zeroed fp32 output of its shape: one launch
    (two past ``GROUPING_CHUNK`` pairs, and on AMD), nothing read back. A pair
    routed outside ``[0, num_experts)`` (another rank's expert) is not placed."""
    if z is not None and dtype not in FP8_DTYPES:
        raise ValueError(f"the latent's FP8 dtype: one of {FP8_DTYPES}, not {dtype}")
    flat = ids.reshape(-1).contiguous()
    pairs = flat.numel()
    capacity = group_capacity(pairs, num_experts, block_m)
    device = ids.device
    rows = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    bins = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=device)
    used_rows = torch.empty(1, dtype=torch.int32, device=device)
    # Without a latent: no quantizing program, and stand-ins for its arguments.
    tokens, cols, fp8_max, z_q, z_scale, out = 0, 0, 1.0, None, None, None
    quantizing = {"MIN_NORMAL": 1.0, "SUBNORMAL_STEPS": 1.0, "NAN_BYTE": 0}
    if z is not None:
        z = z.contiguous()
        tokens, cols = z.shape
        z_q = torch.empty(tokens, cols, dtype=dtype, device=device)
        z_scale = torch.empty(tokens, dtype=torch.float32, device=device)
        out = torch.empty(tokens, cols, dtype=torch.float32, device=device)
        fp8_max = float(torch.finfo(dtype).max)
        quantizing = E4M3_RANGES[dtype]
    # On AMD a barrier orders shared memory only: the placing, which must see
    # the grouping program's stores, runs as a launch of its own there.
    place = pairs <= GROUPING_CHUNK and not runtime.on_rocm()
    latent_args = [used_rows if t is None else t for t in (z, z_q, z_scale, out)]
    _group_and_quantize[(1 + tokens,)](
        flat, rows, block_expert, cursor, used_rows, pairs, capacity, num_experts,
        *latent_args, cols, fp8_max,
        BLOCK_M=block_m, BINS=bins, CHUNK=GROUPING_CHUNK,
        BLOCKS_A_STEP=max(1, min(64, 8192 // bins)), PLACE=place,
        QUANTIZE=z is not None,
        **quantizing, **_row_blocking(cols),
    )  # fmt: skip
    if pairs and not place:
        _place_pairs[(triton.cdiv(pairs, GROUPING_CHUNK),)](
            flat, rows, cursor, pairs, num_experts, CHUNK=GROUPING_CHUNK
        )
    return Prepared(rows, block_expert, used_rows, z_q, z_scale, out)


def group_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """``sort_by_expert`` in Triton (``prepare_rows`` without a latent): the same
    ``(rows, block_expert, used_rows)`` except the order of the pairs within an
    expert's group (which the GEMMs do not depend on); ``rows`` is int32."""
    return prepare_rows(ids, num_experts, block_m)[:3]


def quantize_rows(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    rows: torch.Tensor | None = None,
    used_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_per_row`` of a 2-D ``x`` in one Triton pass. With ``rows`` and
    ``used_rows`` (``sort_by_expert``'s), padding rows are skipped: their values
    and scales are left unset."""
    count, cols = x.shape
    values = torch.empty(count, cols, dtype=dtype, device=x.device)
    scale = torch.empty(count, dtype=torch.float32, device=x.device)
    if count == 0:
        return values, scale
    skip = rows is not None
    _quantize_rows[(count,)](
        x, values, scale, rows if skip else scale, used_rows if skip else scale,
        cols, x.stride(0), values.stride(0), float(torch.finfo(dtype).max),
        SKIP_UNUSED=skip, **_row_blocking(cols), **E4M3_RANGES[dtype],
    )  # fmt: skip
    return values, scale


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
