"""Inputs of the chunked KDA delta rule for the tests, on the CPU."""

from __future__ import annotations

import torch

from vllm_k3_plugin.reference import reference as ref


def kda_inputs(
    tokens, heads, key_dim, value_dim, *, lower_bound=-5.0, saturate=False, seed=None
):
    """``(q, k, v, g, beta)``: normalized q (scaled by ``K^-1/2``) and k, a gate in
    ``(lower_bound, 0)`` (every gate at the bound with ``saturate``: the largest
    exponents there are), β in ``(0, 1)``. ``seed`` defaults to one per shape."""
    generator = torch.Generator().manual_seed(
        tokens * 7 + key_dim if seed is None else seed
    )
    q = ref.l2_normalize(torch.randn(tokens, heads, key_dim, generator=generator))
    k = ref.l2_normalize(torch.randn(tokens, heads, key_dim, generator=generator))
    v = torch.randn(tokens, heads, value_dim, generator=generator)
    u = torch.randn(tokens, heads, key_dim, generator=generator)
    if saturate:
        u = u.abs() * 50 + 50
    g = ref.kda_gate(u, torch.zeros(heads), lower_bound)
    beta = torch.rand(tokens, heads, generator=generator)
    return q / key_dim**0.5, k, v, g, beta
