"""Latent fused MoE: the Triton kernels against the PyTorch reference, FP8 activations
and MXFP4 weights.

Tolerance (kernel vs reference): 1e-4 of the output's largest magnitude, on all but
a quarter of the tokens; those within 2^-4. Both read the same FP8 activations and the
same MXFP4 weights, converted exactly to fp32; they differ in fp32 summation
order and in SiTU's tanh (computed through sigmoid). The intermediate is requantized
to FP8 per token, so a token whose intermediate (or its row scale) sits on an e4m3
rounding boundary can round one step apart on the two sides, and its whole output row
moves by a fraction of an e4m3 step (measured: 2e-3 of the largest magnitude, on one
or two of 9 tokens in 2 of 27 seeded cases; the other tokens within 1e-6).
"""

from __future__ import annotations

import pytest
import torch

from k3_triton_kernels.moe import latent_moe as moe
from k3_triton_kernels.moe import naive
from tests.kernels.placement import (
    DEVICE,
    FNUZ_RUNS_HERE,
    FP8_DTYPES_HERE,
    on_device,
)
from tests.support.host_reads import HostRead, no_host_reads
from tests.support.tensors import assert_close
from vllm_k3_plugin.reference.reference import mxfp4_decode as ref_mxfp4_decode
from vllm_k3_plugin.reference.reference import route, situ_glu


def _case(tokens, experts, top_k, latent=64, inner=32, seed=0):
    torch.manual_seed(seed)
    z = torch.randn(tokens, latent)
    w13 = torch.randn(experts, 2 * inner, latent) / latent**0.5
    w2 = torch.randn(experts, latent, inner) / inner**0.5
    weights, ids = route(torch.randn(tokens, experts), torch.zeros(experts), top_k)
    return on_device(z, ids, weights, w13, w2)


def _agrees(got, expected):
    """The kernel against its reference: see the module's tolerance."""
    scale = expected.abs().max().clamp_min(1e-6)
    row_error = ((got - expected).abs().amax(dim=-1) / scale).tolist()
    flipped = [error for error in row_error if error > 1e-4]
    return 4 * len(flipped) <= len(row_error) and max(row_error) <= 2**-4


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"),
    [(1, 8, 2), (5, 8, 2), (33, 16, 4), (4, 896, 16)],  # the last: K3's routing
)
def test_kernel_matches_reference(tokens, experts, top_k):
    z, ids, weights, w13, w2 = _case(tokens, experts, top_k)
    packed = naive.mxfp4_experts_from(w13, w2)
    got = moe.latent_moe(z, ids, weights, packed)
    expected = naive.latent_moe_reference(z, ids, weights, packed)
    assert _agrees(got, expected)
    if experts == 896:
        # Most experts receive no token.
        assert len(ids.unique()) <= tokens * top_k < experts


def test_from_256_tokens_k_tiles_of_64_match_the_reference():
    """The default tiles from 256 tokens: several 64-wide K tiles (two scale groups
    each) in both GEMMs."""
    tokens, latent, inner = 260, 256, 128
    assert moe.default_tiles(tokens)[2] == 64
    z, ids, weights, w13, w2 = _case(tokens, 8, 2, latent=latent, inner=inner)
    packed = naive.mxfp4_experts_from(w13, w2)
    got = moe.latent_moe(z, ids, weights, packed)
    expected = naive.latent_moe_reference(z, ids, weights, packed)
    assert _agrees(got, expected)


@pytest.mark.parametrize("swap_ab", [True, False], ids=["weights@x", "x@weights"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(5, 8, 2), (33, 16, 4), (4, 896, 16)]
)
def test_each_stage_matches_the_reference_on_the_same_fp8_values(
    tokens, experts, top_k, swap_ab, monkeypatch
):
    """Each GEMM against the reference on the very FP8 values the kernel had, so no
    rounding boundary can hide a wrong token (tolerance 1e-4 of the largest value:
    fp32 summation order): the gate/up GEMM's SiTU output, before it is requantized,
    for every routed pair; and the down GEMM with the routing weights, from the
    kernel's own requantized intermediate. Both orientations of the dots (16-row
    blocks take weights @ x on NVIDIA, x @ weights on AMD)."""
    z, ids, weights, w13, w2 = _case(tokens, experts, top_k)
    packed = naive.mxfp4_experts_from(w13, w2)
    quantized, quantize = [], moe.quantize_rows

    def recording(x, dtype, **padding):
        values, scale = quantize(x, dtype, **padding)
        quantized.append((x.clone(), values, scale))
        return values, scale

    prepared, prepare = [], moe.prepare_rows

    def recording_preparation(*args):
        prepared.append(prepare(*args))
        return prepared[-1]

    monkeypatch.setattr(moe, "quantize_rows", recording)
    monkeypatch.setattr(moe, "prepare_rows", recording_preparation)
    got = moe.latent_moe(z, ids, weights, packed, swap_ab=swap_ab)
    ((h, h_q, h_scale),) = quantized  # the intermediate's
    # The kernel's own order of the pairs, and the latent's FP8 values.
    ((rows, block_expert, _, z_q, z_scale, _),) = prepared
    rows, block_expert = rows.long(), block_expert.long()
    pairs = rows[rows >= 0]
    expert_of_row = block_expert.repeat_interleave(16)[rows >= 0]
    token = pairs // top_k
    w13_deq, w2_deq = naive.dequantize(packed, "w13"), naive.dequantize(packed, "w2")
    inner = w13.shape[1] // 2
    z_deq = z_q.float() * z_scale[:, None]
    gate_up = torch.einsum("pl,pnl->pn", z_deq[token], w13_deq[expert_of_row])
    want_h = situ_glu(gate_up[:, :inner], gate_up[:, inner:])
    got_h = h[rows >= 0]
    assert (got_h - want_h).abs().max() <= 1e-4 * want_h.abs().max()
    h_deq = (h_q.float() * h_scale[:, None])[rows >= 0]
    down = torch.einsum("pi,pli->pl", h_deq, w2_deq[expert_of_row])
    want = torch.zeros_like(got).index_add_(
        0, token, weights.reshape(-1)[pairs, None].float() * down
    )
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_mxfp4_tiles_past_k_read_no_padding_bytes_or_scales():
    """K tiles of 128 over a latent of 96 and an intermediate of 32: both GEMMs'
    tiles reach past K, where the packed bytes and scales are masked off. The
    weights here are views into wider buffers whose padding holds 0x77 bytes
    (two 6.0s) and scale byte 255 (NaN): read, they would make the output NaN."""
    z, ids, weights, w13, w2 = _case(5, 8, 2, latent=96, inner=32)
    packed = naive.mxfp4_experts_from(w13, w2)

    def in_padding(t: torch.Tensor, fill: int) -> torch.Tensor:
        wider = torch.full(
            (*t.shape[:-1], t.shape[-1] + 16), fill, dtype=t.dtype, device=t.device
        )
        wider[..., : t.shape[-1]] = t
        return wider[..., : t.shape[-1]]

    padded = naive.ExpertWeights(
        in_padding(packed.w13, 0x77),
        in_padding(packed.w13_scale, 255),
        in_padding(packed.w2, 0x77),
        in_padding(packed.w2_scale, 255),
    )
    got = moe.latent_moe(z, ids, weights, padded, block_k=128)
    assert torch.isfinite(got).all()
    assert _agrees(got, naive.latent_moe_reference(z, ids, weights, packed))


def test_the_down_gemms_launch_order_leaves_the_output_as_it_is():
    """Row blocks first or column blocks first (the default), the same sums: only
    the order of the fp32 atomic adds into a token's row differs."""
    z, ids, weights, w13, w2 = _case(33, 16, 4)
    packed = naive.mxfp4_experts_from(w13, w2)
    by_columns = moe.latent_moe(z, ids, weights, packed)
    by_rows = moe.latent_moe(z, ids, weights, packed, down_rows_first=True)
    assert_close(by_rows, by_columns, of_peak=1e-6, peak_floor=1e-6, what="by rows")
    assert _agrees(by_columns, naive.latent_moe_reference(z, ids, weights, packed))


def test_row_blocks_past_the_grids_second_axis_go_first():
    """Column blocks first puts the row blocks on the grid's second axis (at most
    65,535): past that the row blocks go first, on the first axis."""
    assert moe.down_grid(1100, 56, False) == ((56, 1100), False)
    assert moe.down_grid(1100, 56, True) == ((1100, 56), True)
    assert moe.down_grid(65535, 56, False) == ((56, 65535), False)
    assert moe.down_grid(65536, 56, False) == ((65536, 56), True)


FNUZ = torch.float8_e4m3fnuz


@pytest.mark.parametrize("swap_ab", [True, False], ids=["weights@x", "x@weights"])
@pytest.mark.parametrize("dtype", FP8_DTYPES_HERE, ids=str)
def test_the_mxfp4_dot_gives_every_e2m1_value_times_its_scale_exactly(dtype, swap_ab):
    """The MXFP4 dot against identity activations returns each weight: every byte
    (both nibbles, all 16 e2m1 codes each, negative zero included) times its e8m0
    scale (2^-40 to 2^38, one per 32 columns), equal to ``mxfp4_decode``'s value
    (each product is one e2m1 value times a power of two, exact in bf16 and in
    fp32), in both orientations and with either FP8 as the activations' dtype."""
    import triton
    import triton.language as tl

    @triton.jit
    def weights_times_identity(
        x_ptr, w_ptr, s_ptr, out_ptr, SWAP_AB: tl.constexpr, X_FORMAT: tl.constexpr
    ):
        n = tl.arange(0, 16)
        k = tl.arange(0, 64)
        x = tl.load(x_ptr + k[:, None] * 64 + k[None, :])  # [64, 64] identity
        w, s = moe._load_weight_tile(w_ptr, s_ptr, 0, n, 0, 64, 0, 32, 0, 2, n < 16, 64)
        if SWAP_AB:  # out^T = w @ x^T
            acc = moe._accumulate(
                tl.zeros((16, 64), tl.float32), x, w, s, True, X_FORMAT
            )
            tl.store(out_ptr + n[:, None] * 64 + k[None, :], acc)
        else:  # out = x @ w^T
            acc = moe._accumulate(
                tl.zeros((64, 16), tl.float32), x, w, s, False, X_FORMAT
            )
            tl.store(out_ptr + k[:, None] + n[None, :] * 64, acc)

    packed = torch.arange(512).remainder(256).to(torch.uint8).view(16, 32)
    scale = (127 + torch.arange(-40, 40, 2.5).round()).to(torch.uint8).view(16, 2)
    identity = torch.eye(64).to(dtype)
    out = torch.empty(16, 64, device=DEVICE)
    weights_times_identity[(1,)](
        identity.to(DEVICE),
        packed.to(DEVICE),
        scale.to(DEVICE),
        out,
        SWAP_AB=swap_ab,
        X_FORMAT="e4m3" if dtype == torch.float8_e4m3fn else "bf16",
    )
    want = ref_mxfp4_decode(packed, scale)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize(
    "dtype",
    FP8_DTYPES_HERE,
    ids=str,
)
# The interpreter's NumPy casts of the NaN row warn; the result is what is checked.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_row_quantization_keeps_nan_and_inf_as_the_reference_does(dtype):
    """A NaN anywhere in a row makes the whole row and its scale NaN; an inf makes
    the scale inf, itself NaN and the row's finite values 0: as
    ``quantize_per_row``, not a finite number in their place."""
    x = torch.tensor(
        [[float("nan"), 1.0, -1.0, 0.0], [float("inf"), 1.0, -2.0, 0.0], [1, 2, 3, 4]]
    )
    values, scale = moe.quantize_rows(x.to(DEVICE), dtype)
    want_values, want_scale = naive.quantize_per_row(x, dtype)
    assert torch.equal(scale.cpu().isnan(), want_scale.isnan())
    assert torch.equal(scale.cpu().isinf(), want_scale.isinf())
    got, want = values.cpu().float(), want_values.float()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_pairs_routed_to_other_ranks_experts_are_left_out():
    """Ids outside ``[0, E)`` (another rank's experts; -1, E, and 2^32 + 1, which
    an int32 cast would wrap to expert 1) are not placed by the grouping, and the
    kernel and the reference both leave them out."""
    z, ids, weights, w13, w2 = _case(5, 8, 2)
    ids = ids.clone()
    ids[0, 0], ids[1, 1], ids[2, 0] = -1, 8, 2**32 + 1
    ids = ids.to(DEVICE)
    rows, _, _ = moe.group_by_expert(ids, 8, 16)
    placed = rows[rows >= 0].long().cpu()
    assert sorted(placed.tolist()) == sorted(set(range(10)) - {0, 3, 4})
    packed = naive.mxfp4_experts_from(w13, w2)
    got = moe.latent_moe(z, ids, weights, packed)
    expected = naive.latent_moe_reference(z, ids, weights, packed)
    assert _agrees(got, expected)


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "block_m"),
    [
        (0, 8, 2, 16),
        (1, 8, 2, 16),
        (33, 16, 4, 16),
        (4, 896, 16, 16),
        (64, 112, 16, 16),  # 1,024 pairs: the most the grouping program places
        (300, 112, 16, 64),  # past it: a second launch places them
    ],
)
def test_grouping_kernel_forms_the_reference_groups(tokens, experts, top_k, block_m):
    """The Triton grouping gives the reference's blocks: the same rows used, the
    same expert for every block, and in each block the same pairs (their order
    within a group is free: atomics place them)."""
    torch.manual_seed(tokens)
    ids = torch.zeros(tokens, top_k, dtype=torch.int64)
    for token in range(tokens):
        ids[token] = torch.randperm(experts)[:top_k]
    want_rows, want_experts, want_used = naive.sort_by_expert(ids, experts, block_m)
    rows, block_expert, used = (
        t.cpu() for t in moe.group_by_expert(ids.to(DEVICE), experts, block_m)
    )
    assert rows.shape == want_rows.shape and int(used) == int(want_used)
    assert torch.equal(block_expert.long(), want_experts)
    blocks = rows.long().view(-1, block_m).sort(dim=1).values
    assert torch.equal(blocks, want_rows.view(-1, block_m).sort(dim=1).values)


@pytest.mark.parametrize("cols", [1000, 9000], ids=["one read", "two reads"])
@pytest.mark.parametrize(
    "dtype",
    FP8_DTYPES_HERE,
    ids=str,
)
def test_row_quantization_kernel_is_bit_exact(dtype, cols):
    """The Triton row quantizer gives the reference's FP8 values and scales bit for
    bit, across 11 decades (subnormals included, and negative values that round
    to zero: +0 in float8_e4m3fnuz, whose negative-zero byte is NaN), on exact ties
    and on the values that round up into the next binade; alone (the
    intermediate's) and where
    ``prepare_rows`` quantizes the latent, rows read once (up to 8,192 wide) or
    twice. ``prepare_rows`` also gives a zeroed output of the latent's shape."""
    torch.manual_seed(0)
    x = torch.randn(6, cols) * torch.logspace(-8, 3, cols)
    fp8_max = torch.finfo(dtype).max
    grid = torch.arange(-fp8_max, fp8_max + 1, 0.5)
    x[0, : grid.numel()] = grid[:cols]  # every half-step tie from -max up
    x[1, :4] = torch.tensor([fp8_max, 124.3, -124.3, 0.0])
    x[2] = 0.0  # an all-zero row: the 1e-12 floor
    want_values, want_scale = naive.quantize_per_row(x, dtype)
    ids = torch.zeros(6, 1, dtype=torch.int64, device=DEVICE)
    prepared = moe.prepare_rows(ids, 2, 16, x.to(DEVICE), dtype)
    for values, scale in (
        moe.quantize_rows(x.to(DEVICE), dtype),
        (prepared.z_q, prepared.z_scale),
    ):
        assert torch.equal(scale.cpu(), want_scale)
        # Bytes, not values: -0.0 equals 0.0, but float8_e4m3fnuz's 0x80 is NaN.
        assert torch.equal(
            values.cpu().view(torch.uint8), want_values.view(torch.uint8)
        )
    assert torch.equal(prepared.out.cpu(), torch.zeros(6, cols))


@pytest.mark.parametrize(("tokens", "block_m"), [(5, 16), (300, 64)])
def test_buffers_left_unset_are_never_read(tokens, block_m, monkeypatch):
    """Every buffer the launcher allocates without zeroing (the output, which the
    grouping launch zeroes; the intermediate's padding rows) starts as NaN and
    garbage here, and the result is the same as from zeroed buffers. Bit for bit
    on a GPU too: top-2 gives each output value two atomic adds onto zero, whose
    order cannot change the sum (from three it could)."""
    z, ids, weights, w13, w2 = _case(tokens, 8, 2)
    packed = naive.mxfp4_experts_from(w13, w2)
    options = {"block_m": block_m}
    clean = moe.latent_moe(z, ids, weights, packed, **options)
    empty = torch.empty

    def dirty_empty(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        if tensor.dtype.is_floating_point:
            return tensor.fill_(float("nan"))
        return tensor.fill_(2**30 if tensor.dtype != torch.uint8 else 255)

    monkeypatch.setattr(torch, "empty", dirty_empty)
    got = moe.latent_moe(z, ids, weights, packed, **options)
    monkeypatch.setattr(torch, "empty", empty)
    assert not got.isnan().any()
    assert torch.equal(got, clean)


@pytest.mark.skipif(not FNUZ_RUNS_HERE, reason="e4m3fnuz runs on gfx94x only")
def test_fnuz_activations_for_gfx94x():
    """gfx94x's e4m3fnuz (max 240) as the activations' dtype (``fp8_dtype``): the
    kernel still matches the reference to 1e-4, and both stay within e4m3
    rounding of the OCP-e4m3fn result."""
    z, ids, weights, w13, w2 = _case(7, 8, 2)
    packed = naive.mxfp4_experts_from(w13, w2)
    assert naive.activation_dtype(FNUZ) == FNUZ
    got = moe.latent_moe(z, ids, weights, packed, fp8_dtype=FNUZ)
    expected = naive.latent_moe_reference(z, ids, weights, packed, fp8_dtype=FNUZ)
    assert _agrees(got, expected)
    want = naive.latent_moe_reference(z, ids, weights, packed)
    assert_close(got, want, of_peak=0.1, peak_floor=1e-6, what="moe out")
    assert not torch.equal(got, moe.latent_moe(z, ids, weights, packed))


def test_the_activations_take_an_fp8_dtype_only():
    z, ids, weights, w13, w2 = _case(2, 4, 1)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        moe.latent_moe(
            z, ids, weights, naive.mxfp4_experts_from(w13, w2), fp8_dtype=torch.bfloat16
        )


def test_mxfp4_weights_decode_like_the_checkpoint_reader():
    _, _, _, w13, w2 = _case(1, 4, 1)
    packed = naive.mxfp4_experts_from(w13, w2)
    assert packed.w13.dtype == torch.uint8 and packed.w13.shape == (4, 64, 32)
    assert packed.w13_scale.shape == (4, 64, 2)
    decoded = naive.dequantize(packed, "w13")
    assert (decoded - w13).abs().max() < 0.25 * w13.abs().max()


def test_sort_by_expert_groups_and_pads():
    ids = torch.tensor([[3, 1], [1, 0], [3, 3]])
    rows, block_expert, used_rows = naive.sort_by_expert(ids, 5, block_m=2)
    # Capacity: 6 pairs + 5 groups x 1 padding row, in whole blocks: 12 rows.
    assert used_rows.tolist() == [8] and rows.numel() == 12
    assert rows.tolist() == [3, -1, 1, 2, 0, 4, 5, -1] + [-1] * 4
    assert block_expert[:4].tolist() == [0, 1, 3, 3]
    assert (block_expert < 5).all()  # blocks past the used rows name a real expert


def test_sort_by_expert_at_k3_routing():
    """Top-16 of 896 for 37 tokens: every pair once, in its expert's padded group,
    in token order within the group; nothing after the used rows."""
    _, ids, *_ = _case(37, 896, 16)
    rows, block_expert, used_rows = naive.sort_by_expert(ids, 896, block_m=16)
    flat = ids.reshape(-1)
    used = int(used_rows)
    assert (rows[used:] == -1).all() and used % 16 == 0
    rows = rows[:used]
    real = rows[rows >= 0]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    expert_of_row = block_expert[: used // 16].repeat_interleave(16)
    assert torch.equal(flat[real], expert_of_row[rows >= 0])
    for expert in flat.unique().tolist():
        group = rows[(expert_of_row == expert) & (rows >= 0)]
        assert torch.equal(group, group.sort().values)


def test_the_kernel_path_reads_nothing_back_from_the_device():
    """No sync per MoE layer, and what a CUDA graph needs: the routing sort and
    both kernels run without the host reading a device value."""
    z, ids, weights, w13, w2 = _case(9, 896, 16, seed=3)
    packed = naive.mxfp4_experts_from(w13, w2)
    with no_host_reads():
        got = moe.latent_moe(z, ids, weights, packed)
    assert _agrees(got, naive.latent_moe_reference(z, ids, weights, packed))


def test_the_host_read_watch_sees_the_old_sort():
    """The watch above can fail: a read-back of the padded length is caught."""
    ids = torch.tensor([[3, 1], [1, 0]])
    with pytest.raises(HostRead), no_host_reads():
        padded = torch.bincount(ids.reshape(-1), minlength=5)
        torch.full((int(padded.sum()),), -1)
