"""The latent MoE's expert activation in PyTorch: SiTU-GLU."""

from __future__ import annotations

import torch


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
