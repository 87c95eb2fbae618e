"""The chunked KDA prefill's chunk terms: the Triton kernel against the batched PyTorch
terms, and the whole prefill on both kernels against the per-token definition.

Tolerance: 1e-5 of each term's largest magnitude (measured: under 3e-7). Both compute
in fp32 from the same inputs (the kernel's dots in ``ieee`` fp32); they differ in
summation order and in the triangular solve (forward substitution on a ``C × C``
tile here, a library solve there). ``|A| ≤ 1`` below the diagonal (normalized keys,
``G`` non-increasing), so the solve does not amplify rounding.
"""

from __future__ import annotations

import pytest
import torch

from k3_triton_kernels.kda.chunk_state import kda_state_pass
from k3_triton_kernels.kda.chunk_terms import (
    kda_chunk_terms,
    kda_chunk_terms_reference,
)
from tests.kernels.placement import on_device
from tests.support.kda_inputs import kda_inputs
from tests.support.tensors import assert_close
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.kda_chunk import kda_chunked


def _inputs(*shape, **options):
    return on_device(*kda_inputs(*shape, **options))


def _assert_terms_close(got, expected, fraction=1e-5):
    for name, a, b in zip(got._fields, got, expected, strict=True):
        assert_close(a, b, of_peak=fraction, peak_floor=1e-30, what=name)


@pytest.mark.parametrize(
    ("tokens", "heads", "key_dim", "value_dim"),
    [
        (1, 2, 16, 16),  # one token, one padded chunk
        (16, 1, 32, 32),  # exactly one chunk
        (45, 3, 32, 40),  # a partial last chunk; V masked to its 64-wide block
        (100, 2, 128, 128),  # K3's head dims (K3 has 96 heads before TP)
    ],
)
def test_kernel_matches_the_pytorch_terms(tokens, heads, key_dim, value_dim):
    inputs = _inputs(tokens, heads, key_dim, value_dim)
    got = kda_chunk_terms(*inputs, chunk=16)
    _assert_terms_close(got, kda_chunk_terms_reference(*inputs, chunk=16))


@pytest.mark.parametrize("lower_bound", [-5.0, -2.5, -1.0])
def test_gates_at_their_lower_bound(lower_bound):
    """Every gate at its bound: ``|G|`` reaches ``16 · |lower_bound|`` at the chunk
    end (80 for K3's -5). The kernels take 16-token chunks whatever the bound allows
    (a chunk shorter than the bound's is exact too)."""
    inputs = _inputs(150, 2, 32, 32, lower_bound=lower_bound, saturate=True)
    got = kda_chunk_terms(*inputs, chunk=16)
    expected = kda_chunk_terms_reference(*inputs, chunk=16)
    assert all(torch.isfinite(term).all() for term in got)
    _assert_terms_close(got, expected)


def test_bf16_inputs_and_strided_heads():
    """q, k, v as the model's projections give them: bf16, and heads strided inside
    a wider row (the last dim contiguous)."""
    q, k, v, g, beta = _inputs(37, 4, 64, 64)
    wide = torch.cat([q, k], dim=-1).to(torch.bfloat16)
    q_view, k_view = wide[..., :64], wide[..., 64:]
    assert not q_view.is_contiguous() and q_view.stride(-1) == 1
    inputs = (q_view, k_view, v.to(torch.bfloat16), g, beta)
    got = kda_chunk_terms(*inputs, chunk=16)
    _assert_terms_close(got, kda_chunk_terms_reference(*inputs, chunk=16))


def test_prefill_on_both_kernels_matches_the_per_token_definition():
    inputs = _inputs(70, 3, 64, 64)
    state = on_device(torch.randn(3, 64, 64))[0]
    got, got_state = kda_chunked(
        *inputs,
        state,
        run_chunk_terms=kda_chunk_terms,
        run_state_pass=kda_state_pass,
        window_tokens=32,  # and across windows
    )
    expected, expected_state = ref.kda_recurrence(*inputs, state)
    for a, b in ((got, expected), (got_state, expected_state)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_a_gate_that_allows_long_chunks_runs_the_kernels_on_chunks_of_16():
    """A lower bound of -1 allows 64-token chunks; the kernels take 16 and match
    the per-token definition."""
    inputs = _inputs(100, 2, 32, 32, lower_bound=-1.0, saturate=True)
    state = on_device(torch.randn(2, 32, 32))[0]
    got, got_state = kda_chunked(
        *inputs,
        state,
        lower_bound=-1.0,
        chunk=16,
        run_chunk_terms=kda_chunk_terms,
        run_state_pass=kda_state_pass,
    )
    expected, expected_state = ref.kda_recurrence(*inputs, state)
    for a, b in ((got, expected), (got_state, expected_state)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    with pytest.raises(ValueError, match="chunk 128: must be 1 to 64"):
        kda_chunked(*inputs, state, lower_bound=-1.0, chunk=128)


@pytest.mark.falls_back
@pytest.mark.parametrize(
    ("key_dim", "chunk", "why"),
    [
        (24, 16, "key head dim 24 is not a power of 2"),
        (16, 8, "chunk length 8"),
        (16, 32, "chunk length 32 is over 16"),
    ],
)
def test_shapes_the_kernel_does_not_tile_run_the_reference_and_say_why(
    key_dim, chunk, why, caplog
):
    inputs = _inputs(10, 2, key_dim, 16)
    with caplog.at_level("INFO", logger="vllm.k3_plugin.kernels"):
        got = kda_chunk_terms(*inputs, chunk=chunk)
    expected = kda_chunk_terms_reference(*inputs, chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert f"KDA prefill chunk terms: PyTorch path ({why}" in caplog.text
