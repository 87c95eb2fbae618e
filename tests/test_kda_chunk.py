"""The chunked KDA delta rule against the token-at-a-time definition.

Tolerance: 1e-5 of the largest magnitude of the output and of the final state. Both
run in fp32; the chunked form reorders the sums and goes through two triangular
solves per chunk (measured: under 1e-6), and ``e^{G_t} · e^{−G_i}`` stays finite
because the chunk is short enough for the gate's lower bound.
"""

from __future__ import annotations

import pytest
import torch

from vllm_k3_plugin.model import reference as ref
from vllm_k3_plugin.model.kda_chunk import chunk_size_for, kda_chunked


def _inputs(tokens, heads, key_dim, value_dim, lower_bound=-5.0, saturate=False):
    generator = torch.Generator().manual_seed(tokens * 7 + key_dim)
    q = ref.l2_normalize(torch.randn(tokens, heads, key_dim, generator=generator))
    k = ref.l2_normalize(torch.randn(tokens, heads, key_dim, generator=generator))
    v = torch.randn(tokens, heads, value_dim, generator=generator)
    u = torch.randn(tokens, heads, key_dim, generator=generator)
    if saturate:  # every gate at its lower bound: the largest exponents there are
        u = u.abs() * 50 + 50
    g = ref.kda_gate(u, torch.zeros(heads), lower_bound)
    beta = torch.rand(tokens, heads, generator=generator)
    return q / key_dim**0.5, k, v, g, beta


def _close(got, expected, fraction=1e-5):
    return (got - expected).abs().max() <= fraction * expected.abs().max()


def test_chunk_length_keeps_the_exponents_finite():
    assert chunk_size_for(-5.0) == 16
    assert chunk_size_for(-1.0) == 64
    assert chunk_size_for(-0.0) == 64
    assert chunk_size_for(-30.0) == 2
    assert chunk_size_for(-1000.0) == 1


@pytest.mark.parametrize(
    ("tokens", "heads", "key_dim", "value_dim"),
    [
        (1, 2, 8, 8),  # a single token
        (15, 2, 16, 16),  # one partial chunk
        (16, 2, 16, 16),  # exactly one chunk
        (17, 3, 16, 8),  # a chunk boundary plus one
        (100, 2, 128, 128),  # K3's head dims, several chunks
    ],
)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_the_recurrence(tokens, heads, key_dim, value_dim, with_state):
    inputs = _inputs(tokens, heads, key_dim, value_dim)
    state = (
        torch.randn(
            heads, key_dim, value_dim, generator=torch.Generator().manual_seed(1)
        )
        if with_state
        else None
    )
    out, final = kda_chunked(*inputs, state)
    expected_out, expected_final = ref.kda_recurrence(*inputs, state)
    assert out.shape == expected_out.shape
    assert _close(out, expected_out) and _close(final, expected_final)


@pytest.mark.parametrize("lower_bound", [-5.0, -20.0, -0.5])
def test_gates_at_their_lower_bound_stay_finite_and_exact(lower_bound):
    inputs = _inputs(70, 2, 32, 32, lower_bound=lower_bound, saturate=True)
    assert inputs[3].min() < 0.99 * lower_bound
    state = torch.randn(2, 32, 32)
    out, final = kda_chunked(*inputs, state, lower_bound=lower_bound)
    expected_out, expected_final = ref.kda_recurrence(*inputs, state)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert _close(out, expected_out) and _close(final, expected_final)


def test_a_prompt_split_anywhere_carries_its_state():
    inputs = _inputs(53, 2, 16, 16)
    whole, whole_state = ref.kda_recurrence(*inputs)
    state, pieces = None, []
    for lo, hi in ((0, 5), (5, 21), (21, 22), (22, 53)):
        out, state = kda_chunked(*(x[lo:hi] for x in inputs), state)
        pieces.append(out)
    assert _close(torch.cat(pieces), whole) and _close(state, whole_state)


@pytest.mark.parametrize("window_tokens", [16, 40, 1])
def test_a_long_prompt_runs_in_bounded_windows_with_the_same_result(window_tokens):
    """Windows of whole chunks (40 rounds down to 32; 1 rounds up to one chunk)."""
    inputs = _inputs(75, 2, 16, 16)
    whole, whole_state = kda_chunked(*inputs)
    windowed, windowed_state = kda_chunked(*inputs, window_tokens=window_tokens)
    assert _close(windowed, whole, 1e-6) and _close(windowed_state, whole_state, 1e-6)


def test_no_tokens_returns_the_state_unchanged():
    q, k, v, g, beta = _inputs(3, 2, 8, 4)
    state = torch.randn(2, 8, 4)
    out, final = kda_chunked(q[:0], k[:0], v[:0], g[:0], beta[:0], state)
    assert out.shape == (0, 2, 4) and torch.equal(final, state)
