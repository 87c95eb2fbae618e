"""KDA decode step: the Triton kernel against the PyTorch reference (the model's own
reference conv, gate and delta rule), states updated in place in their cache slots.

Tolerance: 1e-5 absolute and relative on the output and both states. Everything is
fp32 (the conv state in fp32 or the model dtype, copied exactly); kernel and
reference differ only in summation order over K = 128 terms.
"""

from __future__ import annotations

import pytest
import torch

from k3_triton_kernels.kda import decode as kernel
from tests.kernels.placement import DEVICE
from tests.support.tensors import assert_close


def _case(
    tokens, heads, dim, *, conv=4, slots_total=6, conv_dtype=torch.float32, seed=0
):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    channels = heads * dim
    slots = torch.randperm(slots_total, generator=generator)[:tokens]
    case = dict(
        qkv=randn(tokens, 3 * channels),
        conv_weight=randn(3 * channels, conv) / 2,
        conv_state=randn(slots_total, 3 * channels, conv - 1).to(conv_dtype),
        decay=randn(tokens, channels),
        dt_bias=randn(channels),
        a_log=randn(heads) / 2,
        beta=torch.sigmoid(randn(tokens, heads)),
        recurrent_state=randn(slots_total, heads, dim, dim) / dim**0.5,
        slots=slots,
    )
    return {name: t.to(DEVICE) for name, t in case.items()}


def _run(fn, case):
    mine = {name: t.clone() for name, t in case.items()}
    out = fn(**mine)
    return out, mine["conv_state"], mine["recurrent_state"]


@pytest.mark.parametrize(
    ("tokens", "heads", "dim"),
    [(1, 1, 16), (3, 2, 32), (5, 12, 128), (2, 4, 64)],  # (5, 12, 128): K3 at TP8
)
def test_kernel_matches_reference(tokens, heads, dim):
    case = _case(tokens, heads, dim)
    assert (
        kernel._unsupported(case["qkv"], case["recurrent_state"], case["conv_weight"])
        is None
    )
    got = _run(kernel.kda_decode, case)
    want = _run(kernel.kda_decode_reference, case)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b, atol=1e-5, rtol=1e-5, what="step", same_dtype=True)


def test_a_bf16_conv_state_is_read_and_written_like_the_reference():
    case = _case(3, 2, 32, conv_dtype=torch.bfloat16)
    case["qkv"] = case["qkv"].to(torch.bfloat16)
    got = _run(kernel.kda_decode, case)
    want = _run(kernel.kda_decode_reference, case)
    assert_close(got[0], want[0], atol=1e-5, rtol=1e-5, what="out", same_dtype=True)
    assert torch.equal(got[1], want[1])  # the shifted taps and the new input, exact
    assert_close(got[2], want[2], atol=1e-5, rtol=1e-5, what="state", same_dtype=True)


def test_slots_not_in_the_batch_are_untouched():
    case = _case(2, 2, 32, slots_total=5)
    _, conv_state, state = _run(kernel.kda_decode, case)
    others = [s for s in range(5) if s not in case["slots"].tolist()]
    assert torch.equal(conv_state[others], case["conv_state"][others])
    assert torch.equal(state[others], case["recurrent_state"][others])


def test_a_transposed_conv_state_and_several_steps():
    """vLLM may keep the conv state as [slot, W-1, C]; steps chain through it."""
    case = _case(3, 2, 32, seed=1)
    transposed = case["conv_state"].transpose(1, 2).contiguous()
    kernel_case = {**case, "conv_state": transposed.transpose(1, 2)}
    ref_case = {name: t.clone() for name, t in case.items()}
    for step in range(3):
        step_input = torch.randn(
            case["qkv"].shape, generator=torch.Generator().manual_seed(step)
        ).to(DEVICE)
        kernel_case["qkv"] = ref_case["qkv"] = step_input
        got = kernel.kda_decode(**kernel_case)
        want = kernel.kda_decode_reference(**ref_case)
        assert_close(got, want, atol=1e-5, rtol=1e-5, what="out", same_dtype=True)
    assert torch.equal(kernel_case["conv_state"], ref_case["conv_state"])
    assert_close(
        kernel_case["recurrent_state"],
        ref_case["recurrent_state"],
        atol=1e-5,
        rtol=1e-5,
        what="recurrent state",
        same_dtype=True,
    )


@pytest.mark.falls_back
def test_a_head_dim_the_kernel_cannot_tile_falls_back_and_says_why(caplog):
    case = _case(2, 2, 24)
    with caplog.at_level("INFO", logger="vllm.k3_plugin.kernels"):
        got = _run(kernel.kda_decode, case)
    want = _run(kernel.kda_decode_reference, case)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert "KDA decode: PyTorch path (head dim (24, 24)" in caplog.text
