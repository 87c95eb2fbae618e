"""The latent MoE in PyTorch: SiTU-GLU, the routed experts on FP8 activations and
MXFP4 weights (the reference ``latent_moe`` is tested against), the grouping of
routed pairs by expert, and the MXFP4 expert weights from fp32 ones."""

from __future__ import annotations

from typing import NamedTuple

import torch

from k3_triton_kernels.mxfp4 import mxfp4_decode, mxfp4_encode
from k3_triton_kernels.runtime import FP8_DTYPES


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or wider if it already is (float64 tests stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """``beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta)``, in fp32."""
    g = _wide(gate)
    u = _wide(up)
    activated = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (activated * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


FP8 = torch.float8_e4m3fn


class ExpertWeights(NamedTuple):
    """MXFP4 experts as the checkpoint stores them: ``w13`` ``[E, 2I, L/2]`` uint8
    (two e2m1 values a byte, gate rows then up rows) and ``w13_scale`` ``[E, 2I,
    L/32]`` uint8 (e8m0); ``w2`` ``[E, L, I/2]`` and ``w2_scale`` ``[E, L, I/32]``."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor


def quantize_per_row(
    x: torch.Tensor, dtype: torch.dtype = FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 with one scale per row (the last dim): ``(values, scale [...])``."""
    fp8_max = float(torch.finfo(dtype).max)
    peak = x.float().abs().amax(dim=-1).clamp_min(1e-12)
    scale = peak / fp8_max
    return (x.float() / scale[..., None]).clamp(-fp8_max, fp8_max).to(dtype), scale


def activation_dtype(fp8_dtype: torch.dtype | None = None) -> torch.dtype:
    """The FP8 dtype of the activations: ``fp8_dtype``, by default OCP e4m3fn."""
    dtype = FP8 if fp8_dtype is None else fp8_dtype
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{dtype} is not an FP8 dtype the MoE reads ({FP8_DTYPES})")
    return dtype


def dequantize(weights: ExpertWeights, which: str) -> torch.Tensor:
    """One projection of every expert in fp32."""
    values = getattr(weights, which)
    scale = getattr(weights, which + "_scale")
    experts, rows, half = values.shape
    flat = mxfp4_decode(values.reshape(-1, half), scale.reshape(experts * rows, -1))
    return flat.reshape(experts, rows, half * 2)


def latent_moe_reference(
    z: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: ExpertWeights,
    *,
    beta: float = 4.0,
    linear_beta: float = 25.0,
    fp8_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return routed_experts_reference(
        z, ids, weights, dequantize(experts, "w13"), dequantize(experts, "w2"),
        beta=beta, linear_beta=linear_beta, fp8_dtype=fp8_dtype,
    )  # fmt: skip


def routed_experts_reference(
    z: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    beta: float = 4.0,
    linear_beta: float = 25.0,
    fp8_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The kernel's job on expert weights given in fp32 (``w13`` ``[E, 2I, L]``,
    ``w2`` ``[E, L, I]``), whatever format they were decoded from: the latent and
    the intermediate quantized to FP8 per row, the routed experts' weighted sum
    ``[T, L]`` in fp32."""
    tokens, latent = z.shape
    dtype = activation_dtype(fp8_dtype)
    inner = w13.shape[1] // 2
    z_q, z_scale = quantize_per_row(z, dtype)
    z_deq = z_q.float() * z_scale[:, None]
    out = torch.zeros(tokens, latent, dtype=torch.float32, device=z.device)
    for expert in ids.unique().tolist():
        if not 0 <= expert < w13.shape[0]:
            continue  # another rank's expert (expert parallelism): not here
        rows, slots = (ids == expert).nonzero(as_tuple=True)
        gate_up = z_deq[rows] @ w13[expert].T
        h = situ_glu(gate_up[:, :inner], gate_up[:, inner:], beta, linear_beta)
        h_q, h_scale = quantize_per_row(h, dtype)
        down = (h_q.float() * h_scale[:, None]) @ w2[expert].T
        out.index_add_(0, rows, weights[rows, slots, None].float() * down)
    return out


def group_capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Rows that hold any routing of ``pairs`` pairs grouped by expert: each used
    expert's group pads by at most ``block_m - 1`` rows."""
    capacity = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)
    return capacity * block_m


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int):
    """``(rows, block_expert, used_rows)``: the (token, slot) pairs grouped by expert,
    each group padded to a multiple of ``block_m``. ``rows`` holds each padded row's
    pair index or -1, ``block_expert`` each block's expert.

    Tensor ops only, nothing read back from the device (no sync; a CUDA graph can
    hold it): ``rows`` has a capacity fixed by the shapes (each used expert's group
    pads by at most ``block_m - 1`` rows), ``used_rows`` (one element, on the
    device) says how much of it is used; the blocks past it hold no pair and the
    kernels skip them."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    capacity = group_capacity(pairs, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int64))
    padded = ((counts + block_m - 1) // block_m) * block_m
    ends = torch.cumsum(padded, 0)
    sorted_starts = torch.cumsum(counts, 0) - counts
    experts_in_order = flat[order]
    rank_in_expert = (
        torch.arange(pairs, device=ids.device) - sorted_starts[experts_in_order]
    )
    rows = torch.full((capacity,), -1, dtype=torch.int64, device=ids.device)
    rows[(ends - padded)[experts_in_order] + rank_in_expert] = order
    block_first_rows = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, block_first_rows, right=True)
    return rows, block_expert.clamp_(max=num_experts - 1), ends[-1:]


def mxfp4_experts_from(w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
    """fp32 expert weights rounded to MXFP4, in the checkpoint's packed layout."""

    def pack(w):
        # One expert at a time: the encoder's temporaries are several times the
        # weights' size.
        packed, scale = zip(*(mxfp4_encode(expert) for expert in w))
        return torch.stack(packed), torch.stack(scale)

    return ExpertWeights(*pack(w13), *pack(w2))
