"""The KDA delta rule over a whole prompt, chunk by chunk (the WY form), in fp32.

Same result as ``reference.kda_recurrence`` (the token-at-a-time definition) up to
fp32 rounding, with ``T / C`` sequential steps of batched matmuls instead of ``T``.

Within a chunk of ``C`` tokens let ``G_t = Σ_{i≤t} g_i`` (per head and key channel,
from the chunk start) and ``S0`` the state entering the chunk. Unrolling
``S_t = (I − β_t k_t k_tᵀ) diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ`` gives

    S_t = diag(e^{G_t}) S0 + Σ_{i≤t} (e^{G_t − G_i} ⊙ k_i) w_iᵀ,
    w   = (I + A)⁻¹ β (v − (e^{G} ⊙ k) S0),
    A_ti = β_t Σ_c k_tc k_ic e^{G_tc − G_ic}  (i < t, else 0),
    o_t = (e^{G_t} ⊙ q_t) S0 + Σ_{i≤t} [Σ_c q_tc k_ic e^{G_tc − G_ic}] w_i.

``(I + A)⁻¹ β v`` and ``(I + A)⁻¹ β (e^G ⊙ k)`` do not depend on ``S0``, so every
chunk's are computed at once; only the state pass runs chunk after chunk.

``e^{G_t − G_i}`` is formed as ``e^{G_t} · e^{−G_i}``. That stays finite in fp32 while
``|G| ≤ 80`` across a chunk, so the chunk length is bounded by the gate's lower bound:
``C · |lower_bound| ≤ 80`` (K3's −5 gives 16). A ``g`` below the bound breaks that;
``kda_chunked`` reads it as the bound (the gate ``lb · sigmoid(·)`` never goes below).

The terms feed a state carried across the whole prompt, so their matmuls run in full
fp32 whatever precision the process set (vLLM may set TF32 process-wide).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from vllm_k3_plugin.reference.reference import starting_state

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


StatePass = Callable[[ChunkTerms, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
TermsFn = Callable[..., ChunkTerms]

# The terms of one window are held at once: at the peak of ``chunk_terms`` about
# TERM_TENSORS fp32 tensors of ``window · H · max(K, V)``. WINDOW_BYTES bounds them
# (vLLM's memory profile does not run this path, so it must stay small next to the
# memory vLLM leaves free).
WINDOW_BYTES = 256 * 2**20
TERM_TENSORS = 16


def window_tokens_for(heads: int, key_dim: int, value_dim: int, chunk: int) -> int:
    """Whole chunks whose terms fit ``WINDOW_BYTES`` (at least one chunk)."""
    per_token = TERM_TENSORS * 4 * heads * max(key_dim, value_dim)
    return max(chunk, WINDOW_BYTES // per_token // chunk * chunk)


@contextmanager
def full_fp32_matmuls() -> Iterator[None]:
    """fp32 matmuls in IEEE fp32 (not TF32 / bf16) on CUDA and the CPU, restored on
    exit."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, precision in zip(backends, saved):
            backend.fp32_precision = precision


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    *,
    lower_bound: float = -5.0,
    run_chunk_terms: TermsFn = chunk_terms,
    run_state_pass: StatePass = state_pass,
    window_tokens: int | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_recurrence``'s contract (``q, k`` ``[T, H, K]`` normalized, ``v``
    ``[T, H, V]``, ``g`` ``[T, H, K]`` log decay in ``[lower_bound, 0]``, ``beta``
    ``[T, H]``, ``state`` ``[H, K, V]``), computed per chunk. ``run_chunk_terms`` and
    ``run_state_pass``: ``chunk_terms`` and ``state_pass``, or kernels with their
    contracts. The terms of at most ``window_tokens`` (rounded down to whole chunks;
    default ``window_tokens_for``) are held at once, so a long prompt's memory stays
    bounded. ``chunk``: the chunk length, at most (and by default)
    ``chunk_size_for(lower_bound)``. Returns ``(o [T, H, V], final state)``."""
    tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    s = starting_state(state, heads, key_dim, value_dim, q.device)
    out = torch.empty(tokens, heads, value_dim, dtype=torch.float32, device=q.device)
    longest = chunk_size_for(lower_bound)
    if chunk is None:
        chunk = longest
    elif not 1 <= chunk <= longest:
        raise ValueError(
            f"chunk {chunk}: must be 1 to {longest} for lower bound {lower_bound}"
        )
    if window_tokens is None:
        window_tokens = window_tokens_for(heads, key_dim, value_dim, chunk)
    window = max(chunk, window_tokens // chunk * chunk)
    with full_fp32_matmuls():
        for begin in range(0, tokens, window):
            end = min(begin + window, tokens)
            q_w, k_w, v_w, g_w, beta_w = (x[begin:end] for x in (q, k, v, g, beta))
            terms = run_chunk_terms(
                q_w, k_w, v_w, g_w.clamp(min=lower_bound), beta_w, chunk
            )
            chunk_out, s = run_state_pass(terms, s)
            del terms
            out[begin:end] = chunk_out.transpose(1, 2).reshape(-1, heads, value_dim)[
                : end - begin
            ]
    return out, s


__all__ = [
    "ChunkTerms",
    "chunk_size_for",
    "chunk_terms",
    "full_fp32_matmuls",
    "kda_chunked",
    "state_pass",
    "window_tokens_for",
]
