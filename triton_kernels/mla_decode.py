"""MLA decode attention over a paged latent cache (FP8 or BF16), split-KV with an LSE
merge: the Triton kernels, their launcher, and the PyTorch reference.

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

``latent_halves=True`` takes the latent through both dots in two halves (256 +
256, and the 64 rope channels): fewer registers and instructions on sm90, yet
4-5% slower on an H200 (``benchmarks/results/variants_h200.txt``), so the default
takes it whole. With fp16-pairs dots the accumulator is rescaled only on the
tiles where some row's running maximum grows (the factor is exactly 1 on the
others); the other formats rescale every tile, which on sm90 holds fewer
registers there (bf16 over a bf16 cache: 130 against 179) or spills less.

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
"""

from __future__ import annotations

import functools
import math

import torch

from k3_triton_kernels import runtime
from k3_triton_kernels.runtime import (
    E4M3_EXPONENT_BIAS,
    FP8_DTYPES,
    interpreted,
    log_path,
    triton_blocker,
)
from k3_triton_kernels.runtime import (
    num_warps as platform_warps,
)

CACHE_DTYPES = (*FP8_DTYPES, torch.bfloat16, torch.float16, torch.float32)


# -- PyTorch reference ----------------------------------------------------------------


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
    def _e4m3_pairs_to_fp16(words, ROWS: tl.constexpr, COLS: tl.constexpr):
        """``[ROWS, COLS / 2]`` 16-bit words, each two stored e4m3 bytes (the low
        byte the even column), as ``[ROWS, COLS]`` fp16 values divided by
        ``PAIR_SCALE``: each byte's exponent and mantissa bits move into fp16's
        fields, whose exponent bias is larger by 8 (e4m3fn; 7 for e4m3fnuz) —
        exact, subnormals included. NaN bytes (which a cache never holds: its
        writes clamp) come out finite."""
        word = words.to(tl.int32) & 0xFFFF
        low = ((word & 0x7F) << 7) | ((word & 0x80) << 8)
        high = ((word >> 1) & 0x3F80) | (word & 0x8000)
        bits = tl.reshape(tl.join(low, high), (ROWS, COLS)).to(tl.int16)
        return bits.to(tl.float16, bitcast=True)

    @triton.jit
    def _e4m3fn_pairs_to_fp16_sm89(words, ROWS: tl.constexpr, COLS: tl.constexpr):
        """As ``_e4m3_pairs_to_fp16`` for ``float8_e4m3fn`` on NVIDIA sm89 and
        later, by the hardware conversion (``cvt.rn.f16x2.e4m3x2``, one a pair),
        values unscaled (NaN stays NaN). Not pure to Triton: a pure conversion is
        recomputed for each dot that reads the tile, in each dot's layout; this
        way it runs once and both dots read its fp16 tile from shared memory."""
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h",
            [words],
            dtype=(tl.float16, tl.float16),
            is_pure=False,
            pack=1,
        )
        return tl.reshape(tl.join(low, high), (ROWS, COLS))

    @triton.jit
    def _load_keys(
        token_base,
        first,
        WIDTH: tl.constexpr,
        n_mask,
        BLOCK_N: tl.constexpr,
        DOTS: tl.constexpr,
        HARDWARE_CVT: tl.constexpr,
    ):
        """Cache columns ``[first, first + WIDTH)`` of the tile's tokens as the dots
        take them: stored values (unscaled); for ``DOTS`` 3, the bytes read in
        16-bit words and made fp16 in registers (by ``HARDWARE_CVT``, else bit
        moves, divided by ``PAIR_SCALE``)."""
        if DOTS == 3:
            words = token_base.to(tl.pointer_type(tl.int16)) + first // 2
            pairs = tl.load(
                words[:, None] + tl.arange(0, WIDTH // 2)[None, :],
                mask=n_mask[:, None],
                other=0,
            )
            if HARDWARE_CVT:
                keys = _e4m3fn_pairs_to_fp16_sm89(pairs, BLOCK_N, WIDTH)
            else:
                keys = _e4m3_pairs_to_fp16(pairs, BLOCK_N, WIDTH)
        else:
            keys = tl.load(
                token_base[:, None] + first + tl.arange(0, WIDTH)[None, :],
                mask=n_mask[:, None],
                other=0.0,
            )
        return keys

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
        DH: tl.constexpr,
        DPE: tl.constexpr,
        DOTS: tl.constexpr,
        HARDWARE_CVT: tl.constexpr,
    ):
        """The tile starting at ``tile``: its first ``DH`` latent columns and its
        rope columns as the dots take them (stored values, unscaled: the layer's
        scale goes on scores and output), which of its tokens are before ``end``
        (none when ``tile >= end``: nothing is read), and the tokens' cache rows."""
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
        k_lo = _load_keys(token_base, 0, DH, n_mask, BLOCK_N, DOTS, HARDWARE_CVT)
        k_pe = _load_keys(token_base, DV, DPE, n_mask, BLOCK_N, DOTS, HARDWARE_CVT)
        return k_lo, k_pe, n_mask, token_base

    @triton.jit
    def _dot(a, b, DOTS: tl.constexpr, INTERPRETED: tl.constexpr):
        """``a @ b`` into fp32. ``DOTS`` 1: every operand value is exact in bf16, and
        on a GPU the dot runs on bf16 tensor cores; 2: the operands are rounded to
        fp16 (ties to even) and multiplied on fp16 tensor cores; 0: fp32. The
        interpreter multiplies the same rounded operands as exact fp32 values
        (fp16 and bf16 products are exact in fp32), as the tensor cores do."""
        if DOTS == 1 and not INTERPRETED:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        if DOTS >= 2:
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
        PAIR_SCALE: tl.constexpr,
        HARDWARE_CVT: tl.constexpr,
        PARTS: tl.constexpr,
        PREFETCH: tl.constexpr,
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
        # PARTS 2: the latent goes through the dots in two halves (the "hi" half's
        # query, keys and accumulator exist only then; at PARTS 1 q_hi repeats
        # q_lo and acc_hi is a 16-wide stand-in, both unused).
        DH: tl.constexpr = DV // PARTS
        dh = tl.arange(0, DH)
        dpe = tl.arange(0, DPE)
        q_base = q_ptr + b * stride_qb + r * stride_qr + h[:, None] * stride_qh
        q_lo = tl.load(q_base + dh[None, :], mask=h_mask[:, None], other=0.0)
        q_hi = q_lo
        if PARTS == 2:
            q_hi = tl.load(q_base + DH + dh[None, :], mask=h_mask[:, None], other=0.0)
        q_pe = tl.load(q_base + DV + dpe[None, :], mask=h_mask[:, None], other=0.0)
        score_scale = softmax_scale * kv_scale
        if DOTS >= 2:
            # fp16 dots: the query enters scaled by the power of two that puts its
            # largest magnitude (over this program's heads) in [2^14, 2^15), so it
            # stays finite in fp16 and exact down to 2^-31 of that largest; the
            # scores are scaled back (powers of two: exact).
            q_lo = q_lo.to(tl.float32)
            q_hi = q_hi.to(tl.float32)
            q_pe = q_pe.to(tl.float32)
            largest = tl.maximum(
                tl.maximum(
                    tl.max(tl.max(tl.abs(q_lo), axis=1), axis=0),
                    tl.max(tl.max(tl.abs(q_hi), axis=1), axis=0),
                ),
                tl.max(tl.max(tl.abs(q_pe), axis=1), axis=0),
            )
            exponent = ((largest.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32)
            shift = tl.minimum(tl.maximum(141 - exponent, -100), 100)  # 14 - (e - 127)
            q_scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
            q_lo = (q_lo * q_scale).to(tl.float16)
            q_hi = (q_hi * q_scale).to(tl.float16)
            q_pe = (q_pe * q_scale).to(tl.float16)
            score_scale = score_scale / q_scale
        if DOTS == 3:
            score_scale = score_scale * PAIR_SCALE

        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_H,), tl.float32)
        acc_lo = tl.zeros((BLOCK_H, DH), tl.float32)
        acc_hi = tl.zeros((BLOCK_H, DH if PARTS == 2 else 16), tl.float32)
        if PREFETCH:
            lo_next, pe_next, mask_next, _ = _tile_keys(
                cache_ptr, block_table_ptr, b, stride_bt, stride_cp, stride_cs,
                start, end, page_size, BLOCK_N, PAGE_TILES, DV, DH, DPE, DOTS,
                HARDWARE_CVT,
            )  # fmt: skip
        for tile in range(start, end, BLOCK_N):
            if PREFETCH:
                # This tile's keys were loaded an iteration ago; the next tile's
                # loads go out now, ahead of this tile's dots.
                k_lo, k_pe, n_mask = lo_next, pe_next, mask_next
                lo_next, pe_next, mask_next, _ = _tile_keys(
                    cache_ptr, block_table_ptr, b, stride_bt, stride_cp, stride_cs,
                    tile + BLOCK_N, end, page_size, BLOCK_N, PAGE_TILES, DV, DH, DPE,
                    DOTS, HARDWARE_CVT,
                )  # fmt: skip
            else:
                k_lo, k_pe, n_mask, token_base = _tile_keys(
                    cache_ptr, block_table_ptr, b, stride_bt, stride_cp, stride_cs,
                    tile, end, page_size, BLOCK_N, PAGE_TILES, DV, DH, DPE, DOTS,
                    HARDWARE_CVT,
                )  # fmt: skip
            scores = _dot(q_lo, tl.trans(k_lo), DOTS, INTERPRETED)
            if PARTS == 2:
                k_hi = _load_keys(
                    token_base, DH, DH, n_mask, BLOCK_N, DOTS, HARDWARE_CVT
                )
                scores += _dot(q_hi, tl.trans(k_hi), DOTS, INTERPRETED)
            scores += _dot(q_pe, tl.trans(k_pe), DOTS, INTERPRETED)
            scores = tl.where(n_mask[None, :], scores * score_scale, float("-inf"))
            new_m = tl.maximum(m, tl.max(scores, axis=1))
            rescale = tl.exp(m - new_m)
            p = tl.exp(scores - new_m[:, None])
            denom = denom * rescale + tl.sum(p, axis=1)
            if DOTS == 1:
                p = _round_to_bf16(p)
            if DOTS >= 2:
                # Weights in (0, 1] as p * 2^15: none is lost below fp16's
                # smallest subnormal (2^-24) above 2^-39.
                p = p * FP16_WEIGHT_SCALE
            if DOTS == 3:
                # Only where a row's maximum grew (elsewhere the factor is 1).
                if tl.max((new_m > m).to(tl.int32), axis=0) > 0:
                    acc_lo = acc_lo * rescale[:, None]
                    acc_hi = acc_hi * rescale[:, None]
            else:
                acc_lo = acc_lo * rescale[:, None]
                acc_hi = acc_hi * rescale[:, None]
            acc_lo += _dot(p, k_lo, DOTS, INTERPRETED)
            if PARTS == 2:
                acc_hi += _dot(p, k_hi, DOTS, INTERPRETED)
            m = new_m

        has_tokens = end > start
        safe_denom = tl.where(has_tokens, denom, 1.0)
        lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
        out_scale = kv_scale / safe_denom[:, None]
        if DOTS >= 2:
            out_scale = out_scale / FP16_WEIGHT_SCALE
        if DOTS == 3:
            out_scale = out_scale * PAIR_SCALE
        out_base = (
            mid_out_ptr
            + row * stride_mo_row
            + h[:, None] * stride_mo_h
            + split * stride_mo_s
            + dh[None, :]
        )
        tl.store(out_base, acc_lo * out_scale, mask=h_mask[:, None])
        if PARTS == 2:
            tl.store(out_base + DH, acc_hi * out_scale, mask=h_mask[:, None])
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
    # The latent goes through the dots in halves, each at least a dot's 16.
    for name, size, least in (("latent dim", value_dim, 32), ("rope dim", rope, 16)):
        if size < least or size & (size - 1):
            return f"{name} {size} (needs a power of two >= {least})"
    if cache.shape[-1] != q.shape[-1]:
        return f"cache width {cache.shape[-1]} != query width {q.shape[-1]}"
    return None


MIN_SPLIT_TOKENS = 256
# Warps of the partial kernel a multiprocessor keeps busy at once: at about 255
# registers a thread (sm90: 4 warps, and prefetch at 8; the fp32 dots of the tests
# take 8 too), 64K registers hold 8 warps: two programs of 4 side by side, which
# the kernel needs in flight to hide the cache reads' latency, or one of 8.
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


DOTS = {"fp32": 0, "bf16": 1, "fp16": 2, "fp16-pairs": 3}


# Other formats a bf16 query over an FP8 cache may take: bf16 (e4m3 is exact there
# too; on sm90 it costs a second conversion per value, e4m3 -> fp16 -> bf16), and
# "fp16-pairs": fp16 from the cache read as 16-bit words, each word's two bytes
# made fp16 in registers once (NVIDIA, e4m3fn: one hardware conversion a word;
# else bit moves), both dots then reading that fp16 tile from shared memory by
# ldmatrix. In the "fp16" format Triton converts the bytes once for each dot, in
# each dot's layout, through shared-memory byte loads. Static counts on sm90
# (``python -m tests.kernels.cross_compile sm90``, the loop over tiles of 32
# tokens, 4 warps, latent in halves): "fp16" 1,035 instructions a warp, 128 bytes
# of spill; "fp16-pairs" 571 (506 when no row's maximum grows), no spill. Yet on
# an H200 fp16-pairs ran 3% faster than halved fp16 and 1-8% slower than whole
# fp16, the default (benchmarks/results/variants_h200.txt): this kernel is not
# bound by its instructions.
FP8_ALTERNATIVES = {"fp16": ("bf16", "fp16-pairs")}


def dot_format(q: torch.Tensor, cache: torch.Tensor) -> str:
    """The operands of the kernel's dots: ``"fp16"`` for a bf16 query over an FP8
    cache (every e4m3 value is exact in fp16, and the GPU converts e4m3 to fp16 in
    one instruction per pair), ``"bf16"`` for a bf16 query over a bf16 cache, else
    ``"fp32"``."""
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
    dots: str | None = None,
    max_registers: int | None = None,
    latent_halves: bool = False,
    prefetch: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention; the Triton kernels where they apply, else the reference with
    a one-time log line naming why. ``max_seq_len`` (a host int, at least
    ``seq_lens.max()``) sizes the split-KV grid without reading ``seq_lens`` back
    from the device. ``reference_because``: take the reference, logging this
    reason (the caller's setting). ``dots``: the dots' operand format, by default
    ``dot_format``'s; an FP8 cache under a bf16 query also takes ``"bf16"`` (its
    values are exact there too), and any pair ``"fp32"``. ``max_registers``: a
    cap on the partial kernel's registers a thread (NVIDIA only; ptxas spills
    what does not fit), for more programs a multiprocessor. ``prefetch``: each
    iteration issues the next tile's cache reads (and its block-table read)
    before this tile's dots, so their latency overlaps the dots instead of
    preceding them (Triton's pipeliner stages only loads that reach a dot
    unconverted; the FP8 tile is converted on the way); latent whole only, not
    with fp16-pairs dots; 8 warps on NVIDIA unless given (at 4 the second tile
    spills). Untimed on a GPU."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(192)
    # A dot format the pair cannot take is refused on either path.
    fitting = dot_format(q, cache)
    if dots is None:
        dots = fitting
    elif dots not in {"fp32", fitting, *FP8_ALTERNATIVES.get(fitting, ())}:
        raise ValueError(
            f"{dots} dots for a {q.dtype} query over a {cache.dtype} cache"
        )
    if dots == "fp16-pairs" and any(
        x % 2 for x in (cache.storage_offset(), cache.stride(0), cache.stride(1))
    ):
        raise ValueError("fp16-pairs dots read the cache as 16-bit words: unaligned")
    if prefetch and (latent_halves or dots == "fp16-pairs"):
        raise ValueError(
            "prefetch takes the latent whole, in dots other than fp16-pairs"
        )
    if max_registers is not None and runtime.on_rocm():
        raise ValueError("max_registers caps NVIDIA registers (ptxas maxnreg); not AMD")
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
    # ptxas takes minutes over them; prefetch holds a second tile: 376 bytes
    # spilled at 4 warps, none at 8.
    num_warps = num_warps or platform_warps(
        nvidia=8 if dots == "fp32" or prefetch else 4, amd=4
    )
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
    # NVIDIA converts e4m3fn pairs to fp16 in one instruction (the interpreter
    # and AMD take the bit moves).
    hardware_cvt = (
        dots == "fp16-pairs"
        and cache.dtype == torch.float8_e4m3fn
        and not interpreted()
        and not runtime.on_rocm()
    )
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
            # The byte moves divide by 2^(fp16's exponent bias 15 - e4m3's).
            PAIR_SCALE=1.0
            if hardware_cvt
            else 2.0 ** (15 - E4M3_EXPONENT_BIAS.get(cache.dtype, 7)),
            HARDWARE_CVT=hardware_cvt,
            PARTS=2 if latent_halves else 1,
            PREFETCH=prefetch,
            INTERPRETED=interpreted(),
            num_warps=num_warps,
            num_stages=num_stages or DEFAULT_STAGES,
            **({} if max_registers is None else {"maxnreg": max_registers}),
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
