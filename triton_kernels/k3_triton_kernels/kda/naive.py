"""The KDA references in PyTorch, beside their kernels: the gate, the short causal
convolution, the gated delta rule token by token (``kda_recurrence``, the
definition) and in chunks (``chunk_terms`` then ``state_pass``, the WY form the
prefill kernels compute), and one decode step over vLLM's cache slots
(``kda_decode_reference``). The recurrent state is ``[H, K, V]`` (key channel first,
as flash-linear-attention keeps it). Everything is fp32.

Within a chunk of ``C`` tokens let ``G_t = Σ_{i≤t} g_i`` (per head and key channel,
from the chunk start) and ``S0`` the state entering the chunk. Unrolling
``S_t = (I − β_t k_t k_tᵀ) diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ`` gives

    S_t = diag(e^{G_t}) S0 + Σ_{i≤t} (e^{G_t − G_i} ⊙ k_i) w_iᵀ,
    w   = (I + A)⁻¹ β (v − (e^{G} ⊙ k) S0),
    A_ti = β_t Σ_c k_tc k_ic e^{G_tc − G_ic}  (i < t, else 0),
    o_t = (e^{G_t} ⊙ q_t) S0 + Σ_{i≤t} [Σ_c q_tc k_ic e^{G_tc − G_ic}] w_i.

``(I + A)⁻¹ β v`` and ``(I + A)⁻¹ β (e^G ⊙ k)`` do not depend on ``S0``, so every
chunk's are computed at once; only the state pass runs chunk after chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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


def delta_rule_inputs(
    mixed: torch.Tensor,
    decay: torch.Tensor,
    dt_bias: torch.Tensor,
    a_log: torch.Tensor,
    lower_bound: float = -5.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q̂, k̂, v, g)`` ``[T, H, D]`` of the delta rule from the conv's output
    ``mixed`` ``[T, 3C]`` (q, k, v) and the decay projection ``decay`` ``[T, C]``:
    ``q̂`` and ``k̂`` L2-normalized (``q̂`` scaled by ``D^-½``), ``g`` the log decay."""
    heads = a_log.shape[0]
    channels = mixed.shape[-1] // 3
    shaped = (mixed.shape[0], heads, channels // heads)
    # Token-major, so each token's head rows are contiguous for the kernels.
    q, k, v = (
        part.reshape(shaped) for part in mixed.contiguous().split(channels, dim=-1)
    )
    g = kda_gate((decay.float() + dt_bias.float()).reshape(shaped), a_log, lower_bound)
    return l2_normalize(q) / shaped[-1] ** 0.5, l2_normalize(k), v, g


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
        out[t], s = kda_step(q[t], k[t], v[t], g[t], beta[t], s)
    return out, s


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ``kda_recurrence`` for any leading batch dims: ``q, k, g``
    ``[..., H, K]``, ``v`` ``[..., H, V]``, ``beta`` ``[..., H]``, ``state``
    ``[..., H, K, V]`` fp32. Returns ``(o [..., H, V], new state)``."""
    s = state * g.float().exp()[..., None]
    k = k.float()
    predicted = torch.einsum("...hkv,...hk->...hv", s, k)
    correction = beta.float()[..., None] * (v.float() - predicted)
    s = s + k[..., None] * correction[..., None, :]
    return torch.einsum("...hkv,...hk->...hv", s, q.float()), s


EXPONENT_SPAN = 80.0


MAX_CHUNK = 64


def chunk_size_for(lower_bound: float) -> int:
    """The largest power-of-two chunk (≤ 64) over which a log decay bounded below by
    ``lower_bound`` per token keeps ``e^{±G}`` finite in fp32."""
    chunk = MAX_CHUNK
    while chunk > 1 and chunk * abs(lower_bound) > EXPONENT_SPAN:
        chunk //= 2
    return chunk


def _chunked(x: torch.Tensor, chunk: int, pad_value: float = 0.0) -> torch.Tensor:
    """``[T, H, ...]`` to ``[N, H, C, ...]`` fp32, padded at the end."""
    tokens = x.shape[0]
    padded_tokens = -(-tokens // chunk) * chunk
    x = x.float()
    if padded_tokens != tokens:
        pad = x.new_full((padded_tokens - tokens, *x.shape[1:]), pad_value)
        x = torch.cat([x, pad])
    x = x.reshape(padded_tokens // chunk, chunk, *x.shape[1:])
    return x.transpose(1, 2).contiguous()


class ChunkTerms(NamedTuple):
    """Every chunk's state-independent terms, ``N`` chunks of ``C`` tokens, fp32:
    ``pseudo_values`` ``(I + A)⁻¹ β v`` ``[N, H, C, V]``, ``state_weights``
    ``(I + A)⁻¹ β (e^G ⊙ k)`` ``[N, H, C, K]``, ``q_grow`` ``e^G ⊙ q`` ``[N, H, C, K]``,
    ``readout`` ``[N, H, C, C]`` (lower triangular), ``k_to_end``
    ``e^{G_C − G} ⊙ k`` ``[N, H, C, K]``, ``chunk_decay`` ``e^{G_C}`` ``[N, H, K]``."""

    pseudo_values: torch.Tensor
    state_weights: torch.Tensor
    q_grow: torch.Tensor
    readout: torch.Tensor
    k_to_end: torch.Tensor
    chunk_decay: torch.Tensor


def chunk_terms(q, k, v, g, beta, chunk: int) -> ChunkTerms:
    """The terms of every chunk at once (``kda_chunked``'s inputs, ``T ≥ 1``)."""
    device = q.device
    # Padding tokens have k = v = β = 0 and g = 0: they neither decay nor write.
    q_c, k_c, v_c, g_c = (_chunked(x, chunk) for x in (q, k, v, g))
    beta_c = _chunked(beta, chunk)[..., None]  # [N, H, C, 1]
    cumulative = g_c.cumsum(dim=2)
    grow, shrink = cumulative.exp(), (-cumulative).exp()
    k_grow, k_shrink, q_grow = k_c * grow, k_c * shrink, q_c * grow
    strictly_lower = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril(-1)
    lower = strictly_lower | torch.eye(chunk, dtype=torch.bool, device=device)
    interactions = (beta_c * (k_grow @ k_shrink.transpose(-1, -2))).masked_fill(
        ~strictly_lower, 0.0
    )
    unit_lower = interactions + torch.eye(chunk, device=device)
    pseudo_values = torch.linalg.solve_triangular(
        unit_lower, beta_c * v_c, upper=False, unitriangular=True
    )
    state_weights = torch.linalg.solve_triangular(
        unit_lower, beta_c * k_grow, upper=False, unitriangular=True
    )
    readout = (q_grow @ k_shrink.transpose(-1, -2)).masked_fill(~lower, 0.0)
    total = cumulative[:, :, -1:, :]  # [N, H, 1, K]
    return ChunkTerms(
        pseudo_values=pseudo_values.contiguous(),
        state_weights=state_weights.contiguous(),
        q_grow=q_grow,
        readout=readout,
        k_to_end=k_c * (total - cumulative).exp(),
        chunk_decay=total[:, :, 0, :].exp().contiguous(),
    )


def state_pass(
    terms: ChunkTerms, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks in order: each one's output ``[N, H, C, V]`` from the state it
    enters with, and the state it leaves."""
    s = state
    out = torch.empty_like(terms.pseudo_values)
    for index in range(out.shape[0]):
        w = terms.pseudo_values[index] - terms.state_weights[index] @ s
        out[index] = terms.q_grow[index] @ s + terms.readout[index] @ w
        s = (
            terms.chunk_decay[index][..., None] * s
            + terms.k_to_end[index].transpose(-1, -2) @ w
        )
    return out, s


def kda_decode_reference(
    qkv,
    conv_weight,
    conv_state,
    decay,
    dt_bias,
    a_log,
    beta,
    recurrent_state,
    slots,
    *,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    tokens = qkv.shape[0]
    heads = a_log.shape[0]
    dim = qkv.shape[1] // 3 // heads
    out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=qkv.device)
    for n, slot in enumerate(slots.tolist()):
        mixed, new_conv = causal_conv_silu(
            qkv[n : n + 1].float(), conv_weight[:, None, :].float(), conv_state[slot]
        )
        q, k, v, g = delta_rule_inputs(
            mixed, decay[n : n + 1], dt_bias, a_log, lower_bound
        )
        o, new_state = kda_recurrence(
            q, k, v, g, beta[n : n + 1].float(), recurrent_state[slot]
        )
        out[n] = o[0]
        conv_state[slot] = new_conv.to(conv_state.dtype)
        recurrent_state[slot] = new_state.to(recurrent_state.dtype)
    return out
