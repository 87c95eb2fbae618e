"""KDA windows in vLLM's speculative layout against the decode step's reference fed
one token at a time (``naive.kda_decode_reference``, the per-token definition).

Tolerance: 1e-5 absolute and relative, fp32 throughout (the same conv, gate and
delta rule, batched over rows instead of looped over tokens).
"""

from __future__ import annotations

import pytest
import torch

from k3_triton_kernels.kda.naive import kda_decode_reference
from k3_triton_kernels.kda.windows import kda_windows
from tests.kernels.placement import DEVICE
from tests.support.tensors import assert_close

CONV = 4
HISTORY = CONV - 1


def _layer(heads, dim, drafts, slots_total, seed):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE)

    channels = heads * dim
    return dict(
        conv_weight=randn(3 * channels, CONV) / 2,
        conv_state=randn(slots_total, 3 * channels, HISTORY + drafts),
        dt_bias=randn(channels),
        a_log=randn(heads) / 2,
        recurrent_state=randn(slots_total, heads, dim, dim) / dim**0.5,
    ), randn


def _one_by_one(layer, qkv, decay, beta, history, state):
    """Each token fed alone from ``history`` and ``state``: per token its output,
    the state and the conv history after it."""
    conv = history[None].clone()
    recurrent = state[None].clone()
    after = []
    for t in range(qkv.shape[0]):
        o = kda_decode_reference(
            qkv[t : t + 1], layer["conv_weight"], conv, decay[t : t + 1],
            layer["dt_bias"], layer["a_log"], beta[t : t + 1], recurrent,
            torch.zeros(1, dtype=torch.long, device=DEVICE),
        )  # fmt: skip
        after.append((o[0], recurrent[0].clone(), conv[0].clone()))
    return after


@pytest.mark.parametrize(("heads", "dim"), [(2, 16), (12, 128)])  # K3 at TP8
@pytest.mark.parametrize("accepted", [1, 2, 4])
def test_windows_keep_the_state_after_each_token_of_every_row(heads, dim, accepted):
    """Three rows: a full window resuming after ``accepted`` tokens of its last
    step, a shorter window (fewer drafts), and a padded row (no tokens, the null
    block). Each row's outputs, the state in each of its slots and the conv history
    at each column equal its tokens fed one by one; nothing else is written but
    vLLM's null block, slot 0."""
    drafts = 3
    length = drafts + 1
    layer, randn = _layer(heads, dim, drafts, slots_total=10, seed=accepted)
    channels = heads * dim
    counts = [length, 2, 0]
    slots = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0]], device=DEVICE)
    skip = torch.tensor([accepted - 1, 0, 0], device=DEVICE)
    # Batch positions: row 0's tokens, then row 1's; the padded row's are stale.
    tokens = torch.tensor([[0, 1, 2, 3], [4, 5, 5, 5], [5, 5, 5, 5]], device=DEVICE)
    valid = (
        torch.arange(length, device=DEVICE)
        < torch.tensor(counts, device=DEVICE)[:, None]
    )
    qkv = randn(6, 3 * channels)
    decay = randn(6, channels)
    beta = torch.sigmoid(randn(6, heads))
    before = {name: layer[name].clone() for name in ("conv_state", "recurrent_state")}

    got = kda_windows(
        qkv, layer["conv_weight"], layer["conv_state"], decay, layer["dt_bias"],
        layer["a_log"], beta, layer["recurrent_state"], tokens, valid, slots, skip,
    )  # fmt: skip

    for row, count in enumerate(counts[:2]):
        start = int(skip[row])
        first = slots[row, 0]
        history = before["conv_state"][first, :, start : start + HISTORY]
        state = before["recurrent_state"][slots[row, start]]
        span = tokens[row, :count]
        want = _one_by_one(layer, qkv[span], decay[span], beta[span], history, state)
        for t, (out, state_after, history_after) in enumerate(want):
            what = f"row {row} token {t}"
            assert_close(got[row, t], out, atol=1e-5, what=what)
            assert_close(
                layer["recurrent_state"][slots[row, t]], state_after, atol=1e-5,
                what=f"{what} state",
            )  # fmt: skip
            assert_close(
                layer["conv_state"][first, :, t : t + HISTORY], history_after,
                atol=1e-6, what=f"{what} conv history",
            )  # fmt: skip
    # The short row's unused positions and the padded row write slot 0 only; the
    # conv buffer lives in each row's first slot.
    untouched = {"recurrent_state": [7, 8, 9], "conv_state": [2, 3, 4, 6, 7, 8, 9]}
    for name, unused in untouched.items():
        assert torch.equal(layer[name][unused], before[name][unused]), name
