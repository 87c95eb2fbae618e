"""FP8 MLA decode: the Triton kernels against the PyTorch reference.

Tolerance (kernel vs reference on the same cache): 1e-4 absolute and relative. Both
dequantize the same stored values exactly (fp8 -> fp32 is exact); they differ only in
fp32 summation order (tiles, splits, the LSE merge) over at most a few hundred tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from k3_triton_kernels.mla import decode as kernel
from k3_triton_kernels.mla import naive
from tests.kernels.placement import (
    DEVICE,
    FP8_DTYPES_HERE,
    on_device,
)
from tests.support.tensors import assert_close

SCALE = 1 / math.sqrt(192)
FP8 = FP8_DTYPES_HERE


def _setup(
    lens, *, heads, rows, page_size, dtype, dv=512, dpe=64, kv_scale=1.0, seed=0
):
    torch.manual_seed(seed)
    batch = len(lens)
    pages_per_seq = max(1, math.ceil(max(lens) / page_size))
    pages = batch * pages_per_seq + 3
    cache = torch.zeros(pages, page_size, dv + dpe, dtype=dtype)
    table = torch.randperm(pages)[: batch * pages_per_seq].view(batch, -1).int()
    for b, length in enumerate(lens):
        t = torch.arange(length)
        slots = table[b, t // page_size].long() * page_size + t % page_size
        naive.write_latent(cache, slots, torch.randn(length, dv + dpe), kv_scale)
    q = torch.randn(batch, rows, heads, dv + dpe)
    return on_device(q, cache, table, torch.tensor(lens, dtype=torch.int32))


def _compare(q, cache, table, lens, *, dv=512, kv_scale=1.0, **launch):
    assert (
        kernel._unsupported(q, cache, dv) is None
    )  # the Triton path, not the fallback
    out, lse = kernel.mla_decode(
        q, cache, table, lens, value_dim=dv, kv_scale=kv_scale, **launch
    )
    ref_out, ref_lse = naive.mla_decode_reference(
        q, cache, table, lens, value_dim=dv, softmax_scale=SCALE, kv_scale=kv_scale
    )
    assert_close(out, ref_out, atol=0.0001, rtol=0.0001, what="out")
    assert_close(lse, ref_lse, atol=0.0001, rtol=0.0001, what="lse")


@pytest.mark.parametrize("dtype", [*FP8, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    ("lens", "heads", "page_size"),
    [
        ([1], 16, 16),  # a single token
        ([17, 64, 33], 12, 16),  # ragged, across page boundaries (96 heads / TP8)
        ([100], 96, 64),  # all K3 heads on one device
        ([40, 7], 5, 1),  # page size 1, heads not a multiple of the block
    ],
)
def test_decode_matches_reference(dtype, lens, heads, page_size):
    q, cache, table, seq_lens = _setup(
        lens, heads=heads, rows=1, page_size=page_size, dtype=dtype, kv_scale=0.25
    )
    _compare(q, cache, table, seq_lens, kv_scale=0.25)


@pytest.mark.parametrize(
    ("page_size", "block_n"),
    [(16, 32), (16, 64), (48, 16), (64, 64), (64, 16)],
)
def test_tiles_within_a_page_and_across_pages(page_size, block_n):
    """A tile inside one page reads the block table once; a tile longer than a
    page, or a page not a multiple of the tile, reads it per token."""
    q, cache, table, lens = _setup(
        [130, 64, 1], heads=16, rows=2, page_size=page_size, dtype=FP8[0]
    )
    _compare(q, cache, table, lens, block_n=block_n, num_splits=3)


def test_one_split_is_written_in_place_without_the_merge(monkeypatch):
    """With one split the partial kernel's result is final: the merge kernel is
    not launched, and the output still matches the reference."""
    q, cache, table, lens = _setup(
        [150, 90], heads=16, rows=1, page_size=16, dtype=FP8[0]
    )

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("the merge ran for a single split")

    monkeypatch.setattr(kernel, "_mla_decode_merge", NotLaunched())
    _compare(q, cache, table, lens, num_splits=1)


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_kv_merge(splits):
    q, cache, table, lens = _setup(
        [150, 90], heads=16, rows=1, page_size=16, dtype=FP8[0]
    )
    _compare(q, cache, table, lens, num_splits=splits, block_n=16)


@pytest.mark.parametrize("bound", [150, 400, 4096])
def test_any_upper_bound_of_the_lengths_sizes_the_grid(bound):
    """Each row splits its own length on the device: a grid sized from a loose
    bound (as a captured graph would hold) reads every token exactly once."""
    q, cache, table, lens = _setup(
        [150, 3, 77], heads=16, rows=2, page_size=16, dtype=FP8[0]
    )
    _compare(q, cache, table, lens, max_seq_len=bound, num_splits=4, block_n=16)


def test_eight_speculative_rows_see_their_own_prefix():
    q, cache, table, lens = _setup(
        [20, 9], heads=12, rows=8, page_size=16, dtype=FP8[0]
    )
    _compare(q, cache, table, lens)
    out, _ = kernel.mla_decode(q, cache, table, lens)
    # Row r of the 9-token request sees 9 - (7 - r) tokens: row 0 sees 2.
    alone, _ = kernel.mla_decode(
        q[1:, :1], cache, table[1:], torch.tensor([2], dtype=torch.int32, device=DEVICE)
    )
    assert_close(out[1, 0], alone[0, 0], atol=1e-05, rtol=1e-05, what="out[1, 0]")


def test_fp8_cache_stays_close_to_the_unquantized_one():
    """e4m3 keeps 3 mantissa bits: each stored value is within 2^-4 relative."""
    lens = [64]
    q, fp8_cache, table, seq_lens = _setup(
        lens, heads=8, rows=1, page_size=16, dtype=FP8[0], kv_scale=0.5
    )
    _, exact_cache, _, _ = _setup(
        lens, heads=8, rows=1, page_size=16, dtype=torch.float32, kv_scale=0.5
    )
    fp8_out, _ = kernel.mla_decode(q, fp8_cache, table, seq_lens, kv_scale=0.5)
    exact_out, _ = kernel.mla_decode(q, exact_cache, table, seq_lens, kv_scale=0.5)
    error = (fp8_out - exact_out).abs().max() / exact_out.abs().max()
    assert error < 0.15


def test_write_latent_applies_the_scale():
    cache = torch.zeros(2, 4, 32, dtype=FP8[0], device=DEVICE)
    latent = torch.randn(3, 32, device=DEVICE)
    slots = torch.tensor([0, 5, 7], device=DEVICE)
    naive.write_latent(cache, slots, latent, kv_scale=2.0)
    stored = cache.view(-1, 32)[[0, 5, 7]].float() * 2.0
    assert_close(stored, latent, atol=2.0 * 2 ** (-9), rtol=2 ** (-4), what="stored")


def test_the_narrowest_latent_a_dot_takes_runs_on_the_kernel():
    """A 16-wide latent (and rope) goes through the dots whole, on the kernel."""
    q, cache, table, lens = _setup(
        [40, 7], heads=4, rows=2, page_size=16, dtype=torch.float32, dv=16, dpe=16
    )
    assert kernel._unsupported(q, cache, 16) is None
    out, lse = kernel.mla_decode(q, cache, table, lens, value_dim=16)
    ref_out, ref_lse = naive.mla_decode_reference(
        q, cache, table, lens, value_dim=16, softmax_scale=SCALE
    )
    assert_close(out, ref_out, atol=1e-4, rtol=1e-4, what="out", same_dtype=True)
    assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4, what="lse", same_dtype=True)


@pytest.mark.falls_back
def test_unsupported_shapes_fall_back_to_pytorch_and_say_why(caplog):
    q, cache, table, lens = _setup(
        [10], heads=4, rows=1, page_size=4, dtype=torch.float32, dv=48, dpe=16
    )
    with caplog.at_level("INFO", logger="vllm.k3_plugin.kernels"):
        out, lse = kernel.mla_decode(q, cache, table, lens, value_dim=48)
    ref_out, ref_lse = naive.mla_decode_reference(
        q, cache, table, lens, value_dim=48, softmax_scale=SCALE
    )
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert "latent dim 48" in caplog.text
    bad = torch.zeros(2, 4, 576, dtype=torch.int8, device=DEVICE)
    query = torch.zeros(1, 1, 1, 576, device=DEVICE)
    assert "cache dtype" in kernel._unsupported(query, bad, 512)
    # An 8-wide latent: narrower than a dot takes.
    narrow = torch.zeros(2, 4, 24, dtype=torch.bfloat16, device=DEVICE)
    why = kernel._unsupported(query[..., :24].bfloat16(), narrow, 8)
    assert "latent dim 8 (needs a power of two >= 16)" in why


# -- the bf16 tensor-core path --------------------------------------------------------
#
# A bf16 query over an FP8 or bf16 cache runs both dots on bf16 operands: the query
# and the cache values are exact, the softmax weights are rounded to bf16 (2^-8
# relative) for the value dot. Tolerance: 2^-8 of the largest value magnitude for the
# output (the weights sum to one), plus the fp32 bound above; 1e-4 for the LSE (its
# sum of weights stays fp32).


@pytest.mark.parametrize("dtype", [*FP8, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("lens", "heads", "rows"),
    [([17, 64, 33], 12, 1), ([100], 96, 1), ([20, 9], 12, 8)],
)
def test_bf16_queries_run_tensor_core_dots_within_the_weight_rounding(
    dtype, lens, heads, rows
):
    """A bf16 query: over an FP8 cache, fp16 dots (weights within 2^-11); over a
    bf16 cache, bf16 dots (2^-8)."""
    q, cache, table, seq_lens = _setup(
        lens, heads=heads, rows=rows, page_size=16, dtype=dtype, kv_scale=0.25
    )
    q = q.to(torch.bfloat16)
    fmt = "bf16" if dtype == torch.bfloat16 else "fp16"
    assert kernel.dot_format(q, cache) == fmt
    assert kernel._unsupported(q, cache, 512) is None
    out, lse = kernel.mla_decode(q, cache, table, seq_lens, kv_scale=0.25)
    ref_out, ref_lse = naive.mla_decode_reference(
        q, cache, table, seq_lens, value_dim=512, softmax_scale=SCALE, kv_scale=0.25
    )
    largest_value = cache[..., :512].float().abs().max() * 0.25
    bound = 2**-8 if fmt == "bf16" else 2**-11
    assert (out - ref_out).abs().max() <= bound * largest_value + 1e-4
    assert_close(lse, ref_lse, atol=0.0001, rtol=0.0001, what="lse")
    # The weights really are rounded: the fp32 path on the same values differs.
    fp32_out, _ = kernel.mla_decode(q.float(), cache, table, seq_lens, kv_scale=0.25)
    assert kernel.dot_format(q.float(), cache) == "fp32"
    assert not torch.equal(out, fp32_out)


def test_fp16_and_fp32_caches_keep_fp32_dots():
    q = torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16)
    for dtype in (torch.float16, torch.float32):
        assert kernel.dot_format(q, torch.zeros(1, 1, 576, dtype=dtype)) == "fp32"


@pytest.mark.parametrize("overall", [2.0**-40, 2.0**-13, 1.0, 2.0**60])
def test_fp16_dots_keep_bf16_queries_of_any_magnitude(overall):
    """The query enters the fp16 dots scaled by a power of two chosen from its
    largest magnitude: queries whose components span 2^-30 to 1 of their largest,
    at overall magnitudes from 2^-40 to 2^60, give the fp32 path's LSE (to fp32
    summation order) and stay within the fp16 output bound, at a kv scale of 16."""
    q, cache, table, lens = _setup(
        [40], heads=16, rows=1, page_size=16, dtype=FP8[0], kv_scale=16.0
    )
    magnitudes = torch.logspace(-30, 0, q.shape[-1], base=2, device=q.device)
    q = (q / q.abs() * magnitudes * overall).to(torch.bfloat16)
    out, lse = kernel.mla_decode(q, cache, table, lens, kv_scale=16.0)
    ref_out, ref_lse = kernel.mla_decode(q.float(), cache, table, lens, kv_scale=16.0)
    assert_close(lse, ref_lse, atol=1e-05, rtol=1e-05, what="lse")
    largest = cache[..., :512].float().abs().max() * 16.0
    assert (out - ref_out).abs().max() <= 2**-11 * largest + 1e-4 * largest


def test_weights_round_to_bf16_ties_to_even():
    """The kernel's bf16 rounding against torch's, on random values and exact
    ties (the low 16 bits 0x8000, with even and odd bf16 mantissas)."""
    import triton
    import triton.language as tl

    @triton.jit
    def round_all(x_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out_ptr + i, kernel._round_to_bf16(tl.load(x_ptr + i)))

    values = torch.rand(1024) * torch.logspace(-30, 3, 1024)
    ties = (torch.randint(0x3000, 0x4000, (1024,), dtype=torch.int32) << 16) | 0x8000
    x = torch.cat([values, ties.view(torch.float32)]).to(DEVICE)
    out = torch.empty_like(x)
    round_all[(1,)](x, out, BLOCK=x.numel())
    assert torch.equal(out, x.to(torch.bfloat16).float())


@pytest.mark.parametrize(
    ("cache_dtype", "weight", "bound"),
    [(torch.bfloat16, 0.5019, 2**-8), (FP8[0], 0.50024, 2**-11)],
    ids=["bf16 dots", "fp16 dots"],
)
def test_the_weight_rounding_bound_is_reached(cache_dtype, weight, bound):
    """200 tokens whose softmax weight (relative to the top token's) sits just
    under a rounding midpoint of the dots' format and rounds down to 0.5, all with
    value +1, and the top token with value -1: the output moves by nearly the
    bound (bf16: 2^-8 of the largest value; fp16: 2^-11), past half of it."""
    tokens, page = 201, 16
    pages = -(-tokens // page)
    stored = torch.zeros(tokens, 576)
    stored[0, 512] = 1.0  # the score channel: token 0 scores highest
    stored[:, 0] = 1.0
    stored[0, 0] = -1.0
    cache = torch.zeros(pages * page, 576, dtype=cache_dtype)
    cache[:tokens] = stored.to(cache_dtype)
    cache = cache.view(pages, page, 576)
    table = torch.arange(pages, dtype=torch.int32)[None]
    lens = torch.tensor([tokens], dtype=torch.int32)
    q = torch.zeros(1, 1, 16, 576)
    q[..., 512] = 8.0
    kv_scale = -math.log(weight) / (8.0 * SCALE)  # weight e^{-8·scale·kv}
    q, cache, table, lens = (x.to(DEVICE) for x in (q.bfloat16(), cache, table, lens))
    out, _ = kernel.mla_decode(q, cache, table, lens, kv_scale=kv_scale)
    ref_out, _ = naive.mla_decode_reference(
        q, cache, table, lens, value_dim=512, softmax_scale=SCALE, kv_scale=kv_scale
    )
    error = (out - ref_out).abs().max() / kv_scale  # the largest value is kv_scale
    assert bound / 2 < error <= bound


def test_the_default_split_count_fills_one_wave_of_eight_warps_a_multiprocessor(
    monkeypatch,
):
    """On a GPU of 132 multiprocessors (an H200), at 4 warps a program: at most 264
    programs in all (132 at 8 warps), the
    counts the H200 sweep found fastest (one 128k sequence: 264 splits; 32
    sequences: 8 splits, where 9 were 1.5x slower; 128 sequences: 2, where 3 were
    1.15x slower); at least one split a sequence; no split under 256 tokens. Off a
    GPU, at most 16."""
    monkeypatch.setattr(kernel, "_multiprocessors", lambda device: 132)
    gpu = torch.device("cuda")
    assert kernel.default_num_splits(131072, 1, gpu) == 264
    assert kernel.default_num_splits(131072, 32, gpu) == 8
    assert kernel.default_num_splits(32768, 128, gpu) == 2
    assert kernel.default_num_splits(32768, 1024, gpu) == 1
    assert kernel.default_num_splits(600, 1, gpu) == 3  # 256-token splits at least
    assert kernel.default_num_splits(100, 1, gpu) == 1
    # Programs of 8 warps (fp32 dots): one a multiprocessor.
    assert kernel.default_num_splits(131072, 1, gpu, num_warps=8) == 132
    assert kernel.default_num_splits(131072, 32, gpu, num_warps=8) == 4
    cpu = torch.device("cpu")
    assert kernel.default_num_splits(131072, 1, cpu) == 16
    assert kernel.default_num_splits(300, 1, cpu) == 2
