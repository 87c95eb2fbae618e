"""The (token, slot) pairs of a routing grouped by expert for the latent MoE
(``latent_moe.py``), in one launch with the latent's FP8 copy: ``prepare_rows``.
Each expert's group is padded to whole ``BLOCK_M`` row blocks, as
``naive.sort_by_expert`` pads them, with the pairs in no set order within a group
(the GEMMs do not depend on it); past ``GROUPING_CHUNK`` pairs, and on AMD, a
second launch places the pairs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3_triton_kernels import runtime
from k3_triton_kernels.moe.fp8_rows import E4M3_RANGES, row_blocking
from k3_triton_kernels.moe.naive import group_capacity
from k3_triton_kernels.runtime import FP8_DTYPES

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from k3_triton_kernels.moe.fp8_rows import quantize_row

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
            quantize_row(
                z_ptr + token * cols, z_q_ptr + token * cols,
                z_scale_ptr + token, cols, fp8_max,
                MIN_NORMAL, SUBNORMAL_STEPS, NAN_BYTE, BLOCK, ONE_PASS,
            )  # fmt: skip
            out_row = out_ptr + token * cols
            for c0 in range(0, cols, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                tl.store(out_row + c, tl.zeros((BLOCK,), tl.float32), mask=c < cols)


# Pairs the grouping program places itself (one chunk); past that a launch of
# ``_place_pairs`` places them, a program a chunk.
GROUPING_CHUNK = 1024


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
        **quantizing, **row_blocking(cols),
    )  # fmt: skip
    if pairs and not place:
        _place_pairs[(triton.cdiv(pairs, GROUPING_CHUNK),)](
            flat, rows, cursor, pairs, num_experts, CHUNK=GROUPING_CHUNK
        )
    return Prepared(rows, block_expert, used_rows, z_q, z_scale, out)
