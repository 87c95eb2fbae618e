"""Plain PyTorch references for every Kimi-K3 block (``K3_MODEL.md``), no vLLM import.

They are the CPU compute path and the ground truth the model class is tested
against. The blocks a Triton kernel computes (the KDA gate, convolution and delta
rule, SiTU-GLU, MXFP4) are defined beside their kernels, in ``k3_triton_kernels``'s
``naive`` modules, and read here under the same names. Shapes use ``T`` tokens, ``H``
heads, ``K`` key and ``V`` value head dims, ``D`` the hidden size. The recurrent KDA
state is ``[H, K, V]`` (key channel first, as flash-linear-attention and
``transformers`` keep it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Blocks the kernels share, defined beside them as their references.
from k3_triton_kernels.kda.naive import causal_conv_silu as causal_conv_silu
from k3_triton_kernels.kda.naive import kda_gate as kda_gate
from k3_triton_kernels.kda.naive import kda_recurrence as kda_recurrence
from k3_triton_kernels.kda.naive import l2_normalize as l2_normalize
from k3_triton_kernels.moe.naive import situ_glu
from k3_triton_kernels.mxfp4 import MXFP4_BLOCK as MXFP4_BLOCK
from k3_triton_kernels.mxfp4 import mxfp4_decode as mxfp4_decode
from k3_triton_kernels.mxfp4 import mxfp4_encode as mxfp4_encode


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or wider if it already is (float64 tests stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def situ_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, **betas):
    """``down · SiTU-GLU(gate_up · x)``; ``gate_up`` is ``[2I, D]``, gate half first."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return situ_glu(gate, up, **betas) @ down.T


def routed_experts(
    z: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert,
    **betas,
) -> torch.Tensor:
    """``Σ_k weights[t, k] · expert_{ids[t, k]}(z_t)`` in fp32, for the latent ``z``
    ``[T, L]``. ``expert(e)`` gives expert ``e``'s ``(w1, w3, w2)`` weights (``[I,
    L]``, ``[I, L]``, ``[L, I]``), multiplied as they come, with ``z``'s dtype.
    Pairs with a negative id (another rank's expert) are left out."""
    routed = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
    for expert_id in ids.unique().tolist():
        if expert_id < 0:
            continue
        w1, w3, w2 = expert(expert_id)
        rows, slot = (ids == expert_id).nonzero(as_tuple=True)
        h = z[rows]
        activated = situ_glu(h @ w1.T, h @ w3.T, **betas)
        routed.index_add_(
            0, rows, weights[rows, slot, None] * (activated @ w2.T).float()
        )
    return routed


# -- router ---------------------------------------------------------------------------


def route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    *,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias: ``(weights, expert ids)``,
    each ``[T, top_k]``. Scores are fp32; the bias picks experts but does not weigh."""
    scores = torch.sigmoid(router_logits.float())
    _, ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1)
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling_factor, ids


# -- RMSNorm --------------------------------------------------------------------------


def causal_mask(tokens: int, positions: int, past: int) -> torch.Tensor:
    """``[tokens, positions]``: which cached positions each new query (at positions
    ``past ..``) may see."""
    return torch.arange(positions)[None, :] <= (past + torch.arange(tokens))[:, None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(x.dtype)


# -- attention residuals --------------------------------------------------------------


def attn_res_mix(
    sources: list[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Softmax mix of ``sources`` (each ``[T, D]``) scored by
    ``⟨v, norm_w ⊙ proj_w⟩ / rms(v)`` in fp32: the weighted sum of the raw sources."""
    stacked = torch.stack([_wide(s) for s in sources])  # [S, T, D]
    query = _wide(norm_weight) * _wide(proj_weight).reshape(-1)
    reciprocal_rms = torch.rsqrt(stacked.pow(2).mean(dim=-1) + eps)  # [S, T]
    logits = (stacked @ query) * reciprocal_rms
    weights = torch.softmax(logits, dim=0)
    return (weights[..., None] * stacked).sum(dim=0).to(sources[-1].dtype)


class AttnResLayer(NamedTuple):
    """Where one layer stands in the block bookkeeping."""

    writes_block: bool
    """The layer starts a new block: the partial sum so far is stored and restarts."""
    block_index: int
    blocks_before: int
    """Blocks stored before this layer (the attention mix reads these and the sum)."""


def attn_res_layer(layer: int, block_size: int) -> AttnResLayer:
    return AttnResLayer(
        writes_block=layer % block_size == 0,
        block_index=layer // block_size,
        blocks_before=-(-layer // block_size),
    )


class AttnResCarry(NamedTuple):
    """What the layer stack hands on between layers (and pipeline stages): the
    block vectors stored so far and the partial sum, each ``[T, D]``."""

    bank: list[torch.Tensor]
    partial: torch.Tensor


def blocks_before(layer: int, block_size: int) -> int:
    """Block vectors stored before ``layer`` runs: what a pipeline stage starting
    at ``layer`` receives."""
    return attn_res_layer(layer, block_size).blocks_before


def attn_res_layers(
    carry: AttnResCarry,
    layers: range,
    block_size: int,
    *,
    attn,
    mlp,
    mix,
) -> AttnResCarry:
    """Layers ``layers`` of the stack with attention residuals, kept as vLLM keeps
    them: a bank of block vectors and a partial sum ``P``.

    ``attn(layer, x)`` and ``mlp(layer, x)`` are the sublayers (input norms included);
    ``mix(site, sources)`` mixes with the weights of ``site`` — ``(layer, "attn")``
    or ``(layer, "mlp")``. Returns the carry after the last of ``layers``.
    """
    bank = list(carry.bank)
    partial = carry.partial
    for layer in layers:
        plan = attn_res_layer(layer, block_size)
        if plan.writes_block:
            bank.append(partial)
        x = mix((layer, "attn"), [*bank[: plan.blocks_before], partial])
        out = attn(layer, x)
        partial = out if plan.writes_block else partial + out
        blocks = plan.blocks_before + (1 if plan.writes_block else 0)
        partial = partial + mlp(layer, mix((layer, "mlp"), [*bank[:blocks], partial]))
    return AttnResCarry(bank, partial)


def attn_res_forward(
    embedding: torch.Tensor,
    num_layers: int,
    block_size: int,
    *,
    attn,
    mlp,
    mix,
) -> torch.Tensor:
    """The whole stack (``attn_res_layers`` from the embedding), then the final mix
    (``mix("final", ...)``, before the final norm)."""
    carry = attn_res_layers(
        AttnResCarry([], embedding),
        range(num_layers),
        block_size,
        attn=attn,
        mlp=mlp,
        mix=mix,
    )
    return mix("final", [*carry.bank, carry.partial])
