"""The chunked KDA prefill's state pass: the Triton kernel against the PyTorch loop.

Tolerance: 1e-5 of the largest magnitude of the output and of the final state. Both
run fp32 arithmetic on the same terms (the kernel's dots in ``ieee`` fp32); they
differ in summation order only.
"""

from __future__ import annotations

import pytest
import torch

from k3_triton_kernels.kda.chunk_state import kda_state_pass, kda_state_pass_reference
from tests.kernels.placement import on_device
from tests.support.kda_inputs import kda_inputs
from tests.support.tensors import assert_close
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.kda_chunk import chunk_terms, kda_chunked


def _inputs(tokens, heads, key_dim, value_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    state = torch.randn(heads, key_dim, value_dim, generator=generator)
    inputs = kda_inputs(tokens, heads, key_dim, value_dim, seed=seed + 1)
    *inputs, state = on_device(*inputs, state)
    return tuple(inputs), state


@pytest.mark.parametrize(
    ("tokens", "heads", "key_dim", "value_dim"),
    [
        (1, 2, 16, 16),  # one token, one padded chunk
        (16, 1, 32, 32),  # exactly one chunk
        (45, 3, 32, 40),  # V not a multiple of the V block: masked columns
        (100, 2, 128, 128),  # K3's head dims (K3 has 96 heads before TP)
    ],
)
def test_kernel_matches_the_pytorch_state_pass(tokens, heads, key_dim, value_dim):
    inputs, state = _inputs(tokens, heads, key_dim, value_dim)
    terms = chunk_terms(*inputs, chunk=16)
    expected_out, expected_state = kda_state_pass_reference(terms, state.clone())
    got_out, got_state = kda_state_pass(terms, state.clone())
    assert_close(got_out, expected_out, of_peak=1e-5, what="out")
    assert_close(got_state, expected_state, of_peak=1e-5, what="state")


def test_kernel_prefill_matches_the_per_token_definition():
    inputs, state = _inputs(37, 2, 64, 64, seed=3)
    got, got_state = kda_chunked(*inputs, state, run_state_pass=kda_state_pass)
    expected, expected_state = ref.kda_recurrence(*inputs, state)
    assert_close(got, expected, of_peak=1e-5, what="out")
    assert_close(got_state, expected_state, of_peak=1e-5, what="state")


def test_kernel_updates_the_state_in_place():
    inputs, state = _inputs(20, 2, 16, 16)
    terms = chunk_terms(*inputs, chunk=16)
    given = state.clone()
    _, final = kda_state_pass(terms, given)
    assert final.data_ptr() == given.data_ptr()
    assert not torch.equal(given, state)


@pytest.mark.falls_back
@pytest.mark.parametrize(
    ("key_dim", "chunk", "why"),
    [
        (24, 16, "key head dim 24 is not a power of 2"),
        (16, 8, "chunk length 8"),
    ],
)
def test_shapes_the_kernel_does_not_tile_run_the_reference_and_say_why(
    key_dim, chunk, why, caplog
):
    inputs, state = _inputs(10, 2, key_dim, 16)
    terms = chunk_terms(*inputs, chunk=chunk)
    given = state.clone()
    with caplog.at_level("INFO", logger="vllm.k3_plugin.kernels"):
        got_out, got_state = kda_state_pass(terms, given)
    expected_out, expected_state = kda_state_pass_reference(terms, state.clone())
    assert torch.equal(got_out, expected_out) and torch.equal(got_state, expected_state)
    # The fallback updates the given state in place, as the kernel does.
    assert got_state.data_ptr() == given.data_ptr()
    assert f"KDA prefill state pass: PyTorch path ({why}" in caplog.text
