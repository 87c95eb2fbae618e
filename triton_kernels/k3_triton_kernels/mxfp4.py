"""MXFP4 (OCP MX, e2m1 values in blocks of 32 sharing one UE8M0 scale) in PyTorch:
the checkpoint's expert format, decoded and encoded; the reference of the MXFP4
expert kernels."""

from __future__ import annotations

import torch

# The 16 e2m1 values by nibble: sign bit 3, exponent bits 2-1, mantissa bit 0.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


MXFP4_BLOCK = 32


def _e2m1_table(device=None) -> torch.Tensor:
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def mxfp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight_packed`` ``[N, K/2]`` (low nibble = even column) and UE8M0
    ``weight_scale`` ``[N, K/32]`` -> fp32 ``[N, K]``: ``e2m1 · 2^(s - 127)``; a
    scale byte of 255 is NaN (OCP MX), and so is every value it scales."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError("MXFP4 weights and scales are uint8")
    rows, half = packed.shape
    if scale.shape != (rows, half * 2 // MXFP4_BLOCK):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed "
            f"{tuple(packed.shape)}"
        )
    table = _e2m1_table(packed.device)
    low = table[(packed & 0x0F).long()]
    high = table[(packed >> 4).long()]
    values = torch.stack([low, high], dim=-1).reshape(rows, half * 2)
    exponents = scale.to(torch.int32) - 127
    factors = torch.pow(2.0, exponents.float())
    factors = torch.where(scale == 255, torch.nan, factors)
    factors = factors.repeat_interleave(MXFP4_BLOCK, dim=1)
    return values * factors


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round ``weight`` ``[N, K]`` to MXFP4 (nearest e2m1, one power-of-two scale per
    32 values, chosen so the block's largest magnitude fits in 6.0)."""
    rows, cols = weight.shape
    if cols % MXFP4_BLOCK:
        raise ValueError(f"K={cols} is not a multiple of {MXFP4_BLOCK}")
    blocks = weight.float().reshape(rows, cols // MXFP4_BLOCK, MXFP4_BLOCK)
    peak = blocks.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.pow(2.0, exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES, device=weight.device)
    # The nearest e2m1 magnitude, a tie to the smaller one.
    nearest = torch.bucketize(scaled.abs(), (magnitudes[1:] + magnitudes[:-1]) / 2)
    nibbles = nearest + 8 * (scaled < 0).long() * (nearest > 0).long()
    nibbles = nibbles.reshape(rows, cols).to(torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)
