"""The chunked KDA delta rule against the token-at-a-time definition.

Tolerance: 1e-5 of the largest magnitude of the output and of the final state. Both
run in fp32; the chunked form reorders the sums and goes through two triangular
solves per chunk (measured: under 1e-6), and ``e^{G_t} · e^{−G_i}`` stays finite
because the chunk is short enough for the gate's lower bound.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.kda_inputs import kda_inputs
from tests.support.tensors import assert_close
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.kda_chunk import (
    WINDOW_BYTES,
    chunk_size_for,
    chunk_terms,
    kda_chunked,
    state_pass,
    window_tokens_for,
)


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
    inputs = kda_inputs(tokens, heads, key_dim, value_dim)
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
    assert_close(out, expected_out, of_peak=1e-5, what="out")
    assert_close(final, expected_final, of_peak=1e-5, what="state")


@pytest.mark.parametrize("lower_bound", [-5.0, -20.0, -0.5])
def test_gates_at_their_lower_bound_stay_finite_and_exact(lower_bound):
    inputs = kda_inputs(70, 2, 32, 32, lower_bound=lower_bound, saturate=True)
    assert inputs[3].min() < 0.99 * lower_bound
    state = torch.randn(2, 32, 32)
    out, final = kda_chunked(*inputs, state, lower_bound=lower_bound)
    expected_out, expected_final = ref.kda_recurrence(*inputs, state)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert_close(out, expected_out, of_peak=1e-5, what="out")
    assert_close(final, expected_final, of_peak=1e-5, what="state")


def test_a_prompt_split_anywhere_carries_its_state():
    inputs = kda_inputs(53, 2, 16, 16)
    whole, whole_state = ref.kda_recurrence(*inputs)
    state, pieces = None, []
    for lo, hi in ((0, 5), (5, 21), (21, 22), (22, 53)):
        out, state = kda_chunked(*(x[lo:hi] for x in inputs), state)
        pieces.append(out)
    assert_close(torch.cat(pieces), whole, of_peak=1e-5, what="out")
    assert_close(state, whole_state, of_peak=1e-5, what="state")


@pytest.mark.parametrize("window_tokens", [16, 40, 1])
def test_a_long_prompt_runs_in_bounded_windows_with_the_same_result(window_tokens):
    """Windows of whole chunks (40 rounds down to 32; 1 rounds up to one chunk)."""
    inputs = kda_inputs(75, 2, 16, 16)
    whole, whole_state = kda_chunked(*inputs)
    windowed, windowed_state = kda_chunked(*inputs, window_tokens=window_tokens)
    assert_close(windowed, whole, of_peak=1e-6, what="out")
    assert_close(windowed_state, whole_state, of_peak=1e-6, what="state")


def test_no_tokens_returns_the_state_unchanged():
    q, k, v, g, beta = kda_inputs(3, 2, 8, 4)
    state = torch.randn(2, 8, 4)
    out, final = kda_chunked(q[:0], k[:0], v[:0], g[:0], beta[:0], state)
    assert out.shape == (0, 2, 4) and torch.equal(final, state)


def test_gates_below_the_bound_are_read_at_the_bound():
    """A ``g`` under the lower bound would overflow ``e^{−G}``; it is read as the
    bound, the value K3's gate ``lb · sigmoid(·)`` saturates at."""
    q, k, v, g, beta = kda_inputs(40, 2, 16, 16)
    g = g.clone()
    g[5:30:3] = -60.0
    out, final = kda_chunked(q, k, v, g, beta)
    expected_out, expected_final = ref.kda_recurrence(q, k, v, g.clamp(min=-5.0), beta)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert_close(out, expected_out, of_peak=1e-5, what="out")
    assert_close(final, expected_final, of_peak=1e-5, what="state")


@pytest.fixture
def tf32_everywhere():
    """What vLLM may set process-wide."""
    backends = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    saved = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = "tf32"
    yield
    for backend, precision in zip(backends, saved):
        backend.fp32_precision = precision


def test_the_terms_and_state_pass_run_in_ieee_fp32_and_the_setting_is_restored(
    tf32_everywhere,
):
    seen = []

    def recording(name, fn):
        def run(*args, **kwargs):
            seen.append(
                (
                    name,
                    torch.backends.cuda.matmul.fp32_precision,
                    torch.backends.mkldnn.matmul.fp32_precision,
                )
            )
            return fn(*args, **kwargs)

        return run

    kda_chunked(
        *kda_inputs(40, 2, 16, 16),
        run_chunk_terms=recording("terms", chunk_terms),
        run_state_pass=recording("state", state_pass),
        window_tokens=16,
    )
    assert len(seen) == 6
    assert all(cuda == cpu == "ieee" for _, cuda, cpu in seen)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.mkldnn.matmul.fp32_precision == "tf32"


def test_after_vllms_legacy_precision_call_the_terms_still_run_in_ieee_fp32():
    """vLLM sets the precision with the legacy call
    (``torch.set_float32_matmul_precision``); inside, the per-backend setting is
    IEEE, and afterwards the legacy setting reads as it was."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    seen = []

    def recording(*args):
        seen.append(torch.backends.cuda.matmul.fp32_precision)
        return chunk_terms(*args)

    try:
        kda_chunked(*kda_inputs(20, 2, 16, 16), run_chunk_terms=recording)
        assert seen == ["ieee"]
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(saved)


@pytest.mark.parametrize("heads", [96, 12, 1])  # K3 at TP 1 and 8, and one head
def test_the_default_window_bounds_the_terms_memory(heads):
    window = window_tokens_for(heads, 128, 128, chunk=16)
    assert window % 16 == 0 and window >= 16
    assert window * heads * 128 * 4 * 16 <= max(WINDOW_BYTES, 16 * heads * 128 * 64)


def test_a_prompt_longer_than_the_window_is_fed_a_window_at_a_time():
    inputs = kda_inputs(100, 2, 16, 16)
    sizes = []

    def terms(q, *rest):
        sizes.append(q.shape[0])
        return chunk_terms(q, *rest)

    kda_chunked(*inputs, run_chunk_terms=terms, window_tokens=40)
    assert sizes == [32, 32, 32, 4]
