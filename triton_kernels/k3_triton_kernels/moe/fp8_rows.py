"""Rows quantized to FP8 per row, for the latent MoE (``latent_moe.py``): ``scale =
max(max|x|, 1e-12) / fp8_max`` a row, ``x / scale`` rounded to the nearest e4m3
value (``naive.quantize_per_row``). ``quantize_row`` is the device function the
grouping launch (``grouping.py``) quantizes the latent with; ``quantize_rows``
launches it over a 2-D tensor, as the MoE requantizes its intermediate.

FP8 is OCP ``float8_e4m3fn`` or ``float8_e4m3fnuz`` (gfx94x, max 240): the caller
names the dtype.
"""

from __future__ import annotations

import torch

from k3_triton_kernels.runtime import E4M3_EXPONENT_BIAS, E4M3_NAN_BYTE

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
    def quantize_row(
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
        """``quantize_row`` of each row, a program a row. ``SKIP_UNUSED``: a
        padding row (``rows`` -1, or past ``used_rows``) is left as it is; the down
        GEMM masks it."""
        row = tl.program_id(0)
        if SKIP_UNUSED:
            if row >= tl.load(used_rows_ptr):
                return
            if tl.load(rows_ptr + row) < 0:
                return
        quantize_row(
            x_ptr + row.to(tl.int64) * stride_x,
            out_ptr + row.to(tl.int64) * stride_out,
            scale_ptr + row, cols, fp8_max,
            MIN_NORMAL, SUBNORMAL_STEPS, NAN_BYTE, BLOCK, ONE_PASS,
        )  # fmt: skip


# Rows up to this wide are quantized from one read (the whole row in registers).
ONE_PASS_COLS = 8192


def row_blocking(cols: int) -> dict:
    block = triton.next_power_of_2(max(1, cols))
    if block <= ONE_PASS_COLS:
        return {"BLOCK": block, "ONE_PASS": True}
    return {"BLOCK": 1024, "ONE_PASS": False}


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
        SKIP_UNUSED=skip, **row_blocking(cols), **E4M3_RANGES[dtype],
    )  # fmt: skip
    return values, scale
