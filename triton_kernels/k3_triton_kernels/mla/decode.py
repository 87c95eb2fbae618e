"""MLA decode attention over a paged latent cache (FP8 or BF16), split-KV with an LSE
merge: the Triton kernels and their launcher; the PyTorch reference and the latent
write are ``naive.py``.

Shapes (Kimi-K3: ``H`` = 96 heads before TP, latent ``DV`` = 512, ``DPE`` = 64):

- ``q``: ``[B, Q, H, DV + DPE]``, queries absorbed into the latent; ``Q`` rows per
  request (1, or up to 8 for speculative decoding): row ``r`` sees the first
  ``seq_len - (Q - 1 - r)`` tokens.
- ``cache``: ``[num_pages, page_size, DV + DPE]``, ``float8_e4m3fn`` /
  ``float8_e4m3fnuz`` with one scale per layer, or ``bfloat16`` / ``float16`` /
  ``float32`` (scale 1).
- ``block_table``: ``[B, max_pages]`` int32; ``seq_lens``: ``[B]`` int32.
- returns ``(out [B, Q, H, DV] fp32, lse [B, Q, H] fp32)``; the values are the first
  ``DV`` channels of the cache (the normalized ``c_kv``).

Dots (``dot_format``): with a ``bfloat16`` query over an FP8 cache (the model's case
on a GPU), both dots run on fp16 tensor cores with fp32 accumulation: every e4m3
value is exact in fp16 (and a GPU converts e4m3 to fp16 in one instruction a pair,
where bf16 takes a detour through fp16 or fp32), the query enters scaled by the
power of two that puts its largest magnitude in [2^14, 2^15) (finite in fp16, and
exact down to 2^-31 of that largest; a smaller component rounds by at most 2^-40
of it), the layer's scale is applied to the scores and the output instead of the
values, and the softmax weights, as
``p · 2^15``, are rounded to fp16 (ties to even) for the value dot while their sum
stays fp32. The output then differs from the reference by at most
``2^-11 · max|value|`` plus fp32 summation order; the LSE by summation order only.
Over a ``bfloat16`` cache the same holds with bf16 operands and ``2^-8``. Any other
dtype pair runs fp32 dots (``ieee``), differing from the reference by summation
order only; on a GPU they run without tensor cores, several times slower. Under
``TRITON_INTERPRET=1`` (whose bf16 and fp16 ``tl.dot`` are not usable) the
operands are rounded the same way and multiplied as exact fp32 values, which is
what the tensor cores compute.

One job, kept in one module: the partial kernel, the merge, their device helpers
and the launcher's split and tile choices are one split-KV decode, each part
written for the others' layout (the partial results' strides, the splits the grid
is sized for, the dot format both dots take).
"""

from __future__ import annotations

import functools
import math

import torch

from k3_triton_kernels.mla.naive import mla_decode_reference
from k3_triton_kernels.runtime import (
    FP8_DTYPES,
    interpreted,
    log_path,
    triton_blocker,
)
from k3_triton_kernels.runtime import (
    num_warps as platform_warps,
)

CACHE_DTYPES = (*FP8_DTYPES, torch.bfloat16, torch.float16, torch.float32)


# -- Triton kernels -------------------------------------------------------------------

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU path needs no Triton
    triton = None


if triton is not None:
    FP16_WEIGHT_SCALE = tl.constexpr(2.0**15)

    @triton.jit
    def _round_to_bf16(x):
        """``x`` (fp32, finite) rounded to the nearest bf16, ties to even, as fp32. Bit
        arithmetic, so the interpreter rounds as a GPU does."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _load_keys(token_base, first, WIDTH: tl.constexpr, n_mask):
        """Cache columns ``[first, first + WIDTH)`` of the tile's tokens, as stored
        (unscaled)."""
        return tl.load(
            token_base[:, None] + first + tl.arange(0, WIDTH)[None, :],
            mask=n_mask[:, None],
            other=0.0,
        )

    @triton.jit
    def _tile_keys(
        cache_ptr,
        block_table_ptr,
        b,
        stride_bt,
        stride_cp,
        stride_cs,
        tile,
        end,
        page_size: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_TILES: tl.constexpr,
        DV: tl.constexpr,
        DPE: tl.constexpr,
    ):
        """The tile starting at ``tile``: its latent and rope columns as stored
        (unscaled: the layer's scale goes on scores and output), and which of its
        tokens are before ``end`` (none when ``tile >= end``: nothing is read)."""
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < end
        if PAGE_TILES:
            # The tile lies in one page: one block-table read, and the tile's
            # tokens are consecutive rows of that page.
            page = tl.load(
                block_table_ptr + b * stride_bt + tile // page_size,
                mask=tile < end,
                other=0,
            )
            token_base = (
                cache_ptr
                + page.to(tl.int64) * stride_cp
                + ((tile % page_size) + tl.arange(0, BLOCK_N)) * stride_cs
            )
        else:
            page = tl.load(
                block_table_ptr + b * stride_bt + n // page_size, mask=n_mask, other=0
            )
            token_base = (
                cache_ptr + page.to(tl.int64) * stride_cp + (n % page_size) * stride_cs
            )
        k_latent = _load_keys(token_base, 0, DV, n_mask)
        k_pe = _load_keys(token_base, DV, DPE, n_mask)
        return k_latent, k_pe, n_mask

    @triton.jit
    def _dot(a, b, DOTS: tl.constexpr, INTERPRETED: tl.constexpr):
        """``a @ b`` into fp32. ``DOTS`` 1: every operand value is exact in bf16, and
        on a GPU the dot runs on bf16 tensor cores; 2: the operands are rounded to
        fp16 (ties to even) and multiplied on fp16 tensor cores; 0: fp32. The
        interpreter multiplies the same rounded operands as exact fp32 values
        (fp16 and bf16 products are exact in fp32), as the tensor cores do."""
        if DOTS == 1 and not INTERPRETED:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        if DOTS == 2:
            if INTERPRETED:
                a = a.to(tl.float16).to(tl.float32)
                b = b.to(tl.float16).to(tl.float32)
            else:
                return tl.dot(a.to(tl.float16), b.to(tl.float16))
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")

    @triton.jit
    def _mla_decode_partial(
        q_ptr,
        cache_ptr,
        block_table_ptr,
        seq_lens_ptr,
        mid_out_ptr,
        mid_lse_ptr,
        kv_scale,
        softmax_scale,
        stride_qb,
        stride_qr,
        stride_qh,
        stride_cp,
        stride_cs,
        stride_bt,
        stride_mo_row,
        stride_mo_h,
        stride_mo_s,
        stride_ml_row,
        stride_ml_h,
        heads,
        rows: tl.constexpr,
        page_size: tl.constexpr,
        num_splits,
        DV: tl.constexpr,
        DPE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_TILES: tl.constexpr,
        DOTS: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        row = tl.program_id(0)  # b * rows + r
        head_block = tl.program_id(1)
        split = tl.program_id(2)
        b = row // rows
        r = row % rows
        visible = tl.load(seq_lens_ptr + b) - (rows - 1 - r)
        # Each row splits its own length (read here, on the device), so the grid
        # may be sized from any upper bound of the lengths.
        tokens_per_split = tl.cdiv(tl.cdiv(tl.maximum(visible, 0), num_splits), BLOCK_N)
        tokens_per_split = tokens_per_split * BLOCK_N
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, visible)

        h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < heads
        dv = tl.arange(0, DV)
        dpe = tl.arange(0, DPE)
        q_base = q_ptr + b * stride_qb + r * stride_qr + h[:, None] * stride_qh
        q_latent = tl.load(q_base + dv[None, :], mask=h_mask[:, None], other=0.0)
        q_pe = tl.load(q_base + DV + dpe[None, :], mask=h_mask[:, None], other=0.0)
        score_scale = softmax_scale * kv_scale
        if DOTS == 2:
            # fp16 dots: the query enters scaled by the power of two that puts its
            # largest magnitude (over this program's heads) in [2^14, 2^15), so it
            # stays finite in fp16 and exact down to 2^-31 of that largest; the
            # scores are scaled back (powers of two: exact).
            q_latent = q_latent.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
            largest = tl.maximum(
                tl.max(tl.max(tl.abs(q_latent), axis=1), axis=0),
                tl.max(tl.max(tl.abs(q_pe), axis=1), axis=0),
            )
            exponent = ((largest.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
            shift = tl.minimum(tl.maximum(141 - exponent, -100), 100)  # 14 - (e - 127)
            q_scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
            q_latent = (q_latent * q_scale).to(tl.float16)
            q_pe = (q_pe * q_scale).to(tl.float16)
            score_scale = score_scale / q_scale

        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, DV), tl.float32)
        for tile in range(start, end, BLOCK_N):
            k_latent, k_pe, n_mask = _tile_keys(
                cache_ptr, block_table_ptr, b, stride_bt, stride_cp, stride_cs,
                tile, end, page_size, BLOCK_N, PAGE_TILES, DV, DPE,
            )  # fmt: skip
            scores = _dot(q_latent, tl.trans(k_latent), DOTS, INTERPRETED)
            scores += _dot(q_pe, tl.trans(k_pe), DOTS, INTERPRETED)
            scores = tl.where(n_mask[None, :], scores * score_scale, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=1))
            rescale = tl.exp(m - new_m)
            p = tl.exp(scores - new_m[:, None])
            denom = denom * rescale + tl.sum(p, axis=1)
            if DOTS == 1:
                p = _round_to_bf16(p)
            if DOTS == 2:
                # Weights in (0, 1] as p * 2^15: none is lost below fp16's
                # smallest subnormal (2^-24) above 2^-39.
                p = p * FP16_WEIGHT_SCALE
            acc = acc * rescale[:, None]
            acc += _dot(p, k_latent, DOTS, INTERPRETED)
            m = new_m

        has_tokens = end > start
        safe_denom = tl.where(has_tokens, denom, 1.0)
        lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
        out_scale = kv_scale / safe_denom[:, None]
        if DOTS == 2:
            out_scale = out_scale / FP16_WEIGHT_SCALE
        out_base = (
            mid_out_ptr
            + row * stride_mo_row
            + h[:, None] * stride_mo_h
            + split * stride_mo_s
            + dv[None, :]
        )
        tl.store(out_base, acc * out_scale, mask=h_mask[:, None])
        tl.store(
            mid_lse_ptr + row * stride_ml_row + h * stride_ml_h + split,
            lse,
            mask=h_mask,
        )

    @triton.jit
    def _mla_decode_merge(
        mid_out_ptr,
        mid_lse_ptr,
        out_ptr,
        lse_ptr,
        stride_mo_row,
        stride_mo_h,
        stride_mo_s,
        stride_ml_row,
        stride_ml_h,
        stride_o_row,
        stride_o_h,
        stride_l_row,
        splits,
        DV: tl.constexpr,
    ):
        row = tl.program_id(0)
        h = tl.program_id(1)
        dv = tl.arange(0, DV)
        m = tl.full((), float("-inf"), tl.float32)
        denom = tl.zeros((), tl.float32)
        acc = tl.zeros((DV,), tl.float32)
        for s in range(splits):
            part_lse = tl.load(mid_lse_ptr + row * stride_ml_row + h * stride_ml_h + s)
            if part_lse > float("-inf"):
                part = tl.load(
                    mid_out_ptr
                    + row * stride_mo_row
                    + h * stride_mo_h
                    + s * stride_mo_s
                    + dv
                )
                new_m = tl.maximum(m, part_lse)
                rescale = tl.exp(m - new_m)
                weight = tl.exp(part_lse - new_m)
                denom = denom * rescale + weight
                acc = acc * rescale + weight * part
                m = new_m
        has = denom > 0
        safe_denom = tl.where(has, denom, 1.0)
        tl.store(out_ptr + row * stride_o_row + h * stride_o_h + dv, acc / safe_denom)
        tl.store(
            lse_ptr + row * stride_l_row + h, tl.where(has, m + tl.log(safe_denom), m)
        )


# -- launcher -------------------------------------------------------------------------


def _unsupported(q: torch.Tensor, cache: torch.Tensor, value_dim: int) -> str | None:
    blocker = triton_blocker(q.device)
    if blocker is not None:
        return blocker
    if cache.dtype not in CACHE_DTYPES:
        return f"cache dtype {cache.dtype}"
    rope = q.shape[-1] - value_dim
    # Each goes through the dots whole: at least a dot's 16 deep.
    for name, size, least in (("latent dim", value_dim, 16), ("rope dim", rope, 16)):
        if size < least or size & (size - 1):
            return f"{name} {size} (needs a power of two >= {least})"
    if cache.shape[-1] != q.shape[-1]:
        return f"cache width {cache.shape[-1]} != query width {q.shape[-1]}"
    return None


MIN_SPLIT_TOKENS = 256
# Warps of the partial kernel a multiprocessor keeps busy at once: at about 255
# registers a thread (sm90: 4 warps; the fp32 dots of the tests take 8), 64K
# registers hold 8 warps: two programs of 4 side by side, which the kernel needs
# in flight to hide the cache reads' latency, or one of 8.
WARPS_PER_MULTIPROCESSOR = 8


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(
    longest: int, programs_per_split: int, device, num_warps: int = 4
) -> int:
    """KV splits of a decode batch on a GPU: as many as keep every program in one
    wave of ``WARPS_PER_MULTIPROCESSOR`` warps a multiprocessor (a second, partial
    wave costs nearly a whole one), each split at least ``MIN_SPLIT_TOKENS`` of the
    longest sequence. Off a GPU, up to 16.

    Measured on an H200 (``benchmarks/sweep_mla.py``, 16 heads, 4 warps, 2 stages;
    ``benchmarks/results/mla_sweep_h200.txt``): one 128k sequence, 264 splits 150 µs,
    132 splits 163 µs; 32 sequences of 32k, 8 splits 633 µs, 9 splits 959 µs; 128
    sequences of 32k, 2 to 48 splits within 1% (2451-2459 µs), 3 splits 2819 µs."""
    most = max(1, math.ceil(longest / MIN_SPLIT_TOKENS))
    if device.type != "cuda":
        return min(16, most)
    programs = max(1, WARPS_PER_MULTIPROCESSOR // num_warps)
    slots = programs * _multiprocessors(device)
    return max(1, min(most, slots // max(1, programs_per_split)))


DEFAULT_BLOCK_N = 32
DEFAULT_STAGES = 2


def default_block_n(page_size: int) -> int:
    """Tokens a tile: ``DEFAULT_BLOCK_N``, or the page when a page is shorter and
    still a power of two ≥ 16 (one block-table read a tile)."""
    if 16 <= page_size < DEFAULT_BLOCK_N and page_size & (page_size - 1) == 0:
        return page_size
    return DEFAULT_BLOCK_N


DOTS = {"fp32": 0, "bf16": 1, "fp16": 2}


def dot_format(q: torch.Tensor, cache: torch.Tensor) -> str:
    """The operands of the kernel's dots: ``"fp16"`` for a bf16 query over an FP8
    cache (every e4m3 value is exact in fp16, and the GPU converts e4m3 to fp16 in
    one instruction per pair), ``"bf16"`` for a bf16 query over a bf16 cache, else
    ``"fp32"``. bf16 dots over an FP8 cache measured 1.1-1.3x slower than fp16 on
    an H200 (``benchmarks/results/mla_sweep_h200.txt``)."""
    if q.dtype != torch.bfloat16:
        return "fp32"
    if cache.dtype in FP8_DTYPES:
        return "fp16"
    return "bf16" if cache.dtype == torch.bfloat16 else "fp32"


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    value_dim: int = 512,
    softmax_scale: float | None = None,
    kv_scale: float = 1.0,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    reference_because: str | None = None,
    block_h: int = 16,
    block_n: int | None = None,
    num_stages: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention; the Triton kernels where they apply, else the reference with
    a one-time log line naming why. ``max_seq_len`` (a host int, at least
    ``seq_lens.max()``) sizes the split-KV grid without reading ``seq_lens`` back
    from the device. ``reference_because``: take the reference, logging this
    reason (the caller's setting). The dots take ``dot_format``'s operands."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(192)
    reason = reference_because or _unsupported(q, cache, value_dim)
    log_path("MLA decode", reason)
    if reason is not None:
        return mla_decode_reference(
            q,
            cache,
            block_table,
            seq_lens,
            value_dim=value_dim,
            softmax_scale=softmax_scale,
            kv_scale=kv_scale,
        )
    batch, rows, heads, _ = q.shape
    rope = q.shape[-1] - value_dim
    page_size = cache.shape[1]
    if block_n is None:
        block_n = default_block_n(page_size)
    if max_seq_len is not None:
        longest = max_seq_len
    else:
        longest = int(seq_lens.max()) if batch else 0
    # fp32 dots hold twice the registers: at 4 warps they spill 11 KB on sm90 and
    # ptxas takes minutes over them.
    dots = dot_format(q, cache)
    num_warps = num_warps or platform_warps(nvidia=8 if dots == "fp32" else 4, amd=4)
    if num_splits is None:
        num_splits = default_num_splits(
            longest, batch * rows * triton.cdiv(heads, block_h), q.device, num_warps
        )
    # No split shorter than one tile.
    num_splits = max(1, min(num_splits, math.ceil(max(longest, 1) / block_n)))
    device = q.device
    out = torch.empty(batch * rows, heads, value_dim, device=device)
    lse = torch.empty(batch * rows, heads, device=device)
    if num_splits == 1:
        # One split's partial result is the result (normalized, with its LSE):
        # the partial kernel writes it in place and the merge does not run.
        mid_out, mid_lse = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        mid_out = torch.empty(batch * rows, heads, num_splits, value_dim, device=device)
        mid_lse = torch.empty(batch * rows, heads, num_splits, device=device)
    if batch:
        grid = (batch * rows, triton.cdiv(heads, block_h), num_splits)
        _mla_decode_partial[grid](
            q,
            cache,
            block_table,
            seq_lens,
            mid_out,
            mid_lse,
            kv_scale,
            softmax_scale,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            cache.stride(0),
            cache.stride(1),
            block_table.stride(0),
            mid_out.stride(0),
            mid_out.stride(1),
            mid_out.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            heads,
            rows,
            page_size,
            num_splits,
            DV=value_dim,
            DPE=rope,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            PAGE_TILES=page_size % block_n == 0,
            DOTS=DOTS[dots],
            INTERPRETED=interpreted(),
            num_warps=num_warps,
            num_stages=num_stages or DEFAULT_STAGES,
        )
    if batch and num_splits > 1:
        _mla_decode_merge[(batch * rows, heads)](
            mid_out,
            mid_lse,
            out,
            lse,
            mid_out.stride(0),
            mid_out.stride(1),
            mid_out.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            num_splits,
            DV=value_dim,
        )
    return out.view(batch, rows, heads, value_dim), lse.view(batch, rows, heads)
