"""Plain PyTorch references for every Kimi-K3 block (``K3_MODEL.md``), no vLLM import.

They are the CPU compute path and the ground truth the Triton kernels are tested
against. Shapes use ``T`` tokens, ``H`` heads, ``K`` key and ``V`` value head dims,
``D`` the hidden size. The recurrent KDA state is ``[H, K, V]`` (key channel first, as
flash-linear-attention and ``transformers`` keep it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or wider if it already is (float64 tests stay exact)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


# -- SiTU-GLU -------------------------------------------------------------------------


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """``beta·tanh(g/beta)·sigmoid(g) · linear_beta·tanh(u/linear_beta)``, in fp32."""
    g = _wide(gate)
    u = _wide(up)
    activated = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    return (activated * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


def situ_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, **betas):
    """``down · SiTU-GLU(gate_up · x)``; ``gate_up`` is ``[2I, D]``, gate half first."""
    gate, up = (x @ gate_up.T).chunk(2, dim=-1)
    return situ_glu(gate, up, **betas) @ down.T


# -- MXFP4 ----------------------------------------------------------------------------

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        normed = normed * weight.float()
    return normed.to(x.dtype)


# -- KDA ------------------------------------------------------------------------------


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dim (the flash-linear-attention form)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(
    u: torch.Tensor, a_log: torch.Tensor, lower_bound: float = -5.0
) -> torch.Tensor:
    """Log decay per key channel in ``(lower_bound, 0)``: ``lb · sigmoid(e^{A} · u)``.

    ``u`` is ``[T, H, K]`` (``f_b(f_a(x)) + dt_bias``), ``a_log`` ``[H]``."""
    return lower_bound * torch.sigmoid(a_log.float().exp()[:, None] * u.float())


def causal_conv_silu(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) then SiLU. ``x`` ``[T, C]``, ``weight``
    ``[C, 1, W]``, ``state`` ``[C, W-1]``: the previous ``W-1`` inputs (zeros at the
    start). Returns ``(y [T, C], new state)``."""
    channels, _, width = weight.shape
    if state is None:
        state = x.new_zeros(channels, width - 1)
    padded = torch.cat([state.to(x.dtype), x.T], dim=1)  # [C, W-1+T]
    windows = padded.unfold(1, width, 1)  # [C, T, W]
    y = (windows * weight[:, 0, None, :].to(x.dtype)).sum(dim=-1).T
    return torch.nn.functional.silu(y), padded[:, -(width - 1) :].clone()


def starting_state(state, heads: int, key_dim: int, value_dim: int, device):
    """A fp32 copy of ``state`` ``[H, K, V]`` to update, or zeros for a new sequence."""
    if state is None:
        return torch.zeros(
            heads, key_dim, value_dim, dtype=torch.float32, device=device
        )
    return state.float().clone()


def kda_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, in fp32.

    ``q, k`` ``[T, H, K]`` already L2-normalized (``q`` also scaled by ``K^-½``),
    ``v`` ``[T, H, V]``, ``g`` ``[T, H, K]`` log decay, ``beta`` ``[T, H]``, ``state``
    ``[H, K, V]``. For each token: ``S ← diag(e^g) S``; ``S ← S + β k (v − Sᵀk)ᵀ``;
    ``o = Sᵀ q``. Returns ``(o [T, H, V], final state)``."""
    tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    s = starting_state(state, heads, key_dim, value_dim, q.device)
    out = torch.empty(tokens, heads, value_dim, dtype=torch.float32, device=q.device)
    for t in range(tokens):
        s = s * g[t].float().exp()[..., None]
        k_t = k[t].float()
        predicted = torch.einsum("hkv,hk->hv", s, k_t)
        correction = beta[t].float()[:, None] * (v[t].float() - predicted)
        s = s + k_t[..., None] * correction[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t].float())
    return out, s


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


def attn_res_forward(
    embedding: torch.Tensor,
    num_layers: int,
    block_size: int,
    *,
    attn,
    mlp,
    mix,
) -> torch.Tensor:
    """The layer stack with attention residuals, kept as vLLM keeps it: a bank of
    block vectors and a partial sum ``P``.

    ``attn(layer, x)`` and ``mlp(layer, x)`` are the sublayers (input norms included);
    ``mix(site, sources)`` mixes with the weights of ``site`` — ``(layer, "attn")``,
    ``(layer, "mlp")`` or ``"final"``. Returns the final mix (before the final norm).
    """
    bank: list[torch.Tensor] = []
    partial = embedding
    delta: torch.Tensor | None = None
    for layer in range(num_layers):
        plan = attn_res_layer(layer, block_size)
        if delta is not None:
            partial = partial + delta
        if plan.writes_block:
            bank.append(partial)
        x = mix((layer, "attn"), [*bank[: plan.blocks_before], partial])
        out = attn(layer, x)
        partial = out if plan.writes_block else partial + out
        blocks = plan.blocks_before + (1 if plan.writes_block else 0)
        delta = mlp(layer, mix((layer, "mlp"), [*bank[:blocks], partial]))
    if delta is not None:
        partial = partial + delta
    return mix("final", [*bank, partial])
