"""The KDA delta rule over a whole prompt, chunk by chunk (the WY form), in fp32.

Same result as ``kda_recurrence`` (the token-at-a-time definition) up to fp32
rounding, with ``T / C`` sequential steps of batched matmuls instead of ``T``. The
chunk terms and the state pass, and their derivation, are the prefill kernels'
references (``k3_triton_kernels.kda.naive``); this module runs them over a prompt in
windows of bounded memory, from the state a sequence carries.

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

import torch

from k3_triton_kernels.kda.naive import ChunkTerms as ChunkTerms
from k3_triton_kernels.kda.naive import chunk_size_for as chunk_size_for
from k3_triton_kernels.kda.naive import chunk_terms as chunk_terms
from k3_triton_kernels.kda.naive import starting_state
from k3_triton_kernels.kda.naive import state_pass as state_pass

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
