"""Our MLA backends' decode and latent write, called as vLLM's ``MLAAttention``
calls them: flattened query rows (``Q`` per request for speculative decoding), the
decode metadata's block table and sequence lengths, an FP8 cache allocated as
uint8, and the layer's KV scale.

Tolerance against the reference per request: 1e-4 (the kernel's own bound; both
read the same FP8 values exactly)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from k3_triton_kernels.mla import naive
from tests.support.host_reads import no_host_reads
from tests.support.tensors import assert_close
from vllm_k3_plugin.model.mla_backend import (
    K3CpuMlaBackend,
    K3CpuMlaImpl,
    gpu_mla_backend,
    k3_mla_decode,
)

SCALE = 1 / math.sqrt(192)
HEADS, WIDTH, LATENT, PAGE = 8, 576, 512, 16


def _fp8_cache(lens, kv_scale, seed=0):
    """A uint8 cache (as vLLM allocates ``--kv-cache-dtype fp8``), its table."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = math.ceil(max(lens) / PAGE)
    cache = torch.zeros(len(lens) * pages_per_seq + 2, PAGE, WIDTH, dtype=torch.uint8)
    table = torch.randperm(cache.shape[0], generator=generator)
    table = table[: len(lens) * pages_per_seq].view(len(lens), -1).int()
    fp8 = cache.view(torch.float8_e4m3fn)
    for b, length in enumerate(lens):
        t = torch.arange(length)
        slots = table[b, t // PAGE].long() * PAGE + t % PAGE
        latent = torch.randn(length, WIDTH, generator=generator)
        naive.write_latent(fp8, slots, latent, kv_scale)
    return cache, table


def _decode(q, cache, table, lens, *, causal=True, kv_scale=0.5):
    impl = SimpleNamespace(kv_lora_rank=LATENT, scale=SCALE)
    layer = SimpleNamespace(_k_scale_float=kv_scale)
    metadata = SimpleNamespace(
        decode=SimpleNamespace(block_table=table, seq_lens=torch.tensor(lens)),
        causal=causal,
        max_seq_len=max(lens),
    )
    return k3_mla_decode(impl, q, cache, metadata, layer)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_flattened_speculative_rows_each_see_their_prefix(rows):
    lens = [20, 37]
    cache, table = _fp8_cache(lens, kv_scale=0.5)
    q = torch.randn(len(lens) * rows, HEADS, WIDTH)
    out, lse = _decode(q, cache, table, lens)
    want_out, want_lse = naive.mla_decode_reference(
        q.view(len(lens), rows, HEADS, WIDTH),
        cache.view(torch.float8_e4m3fn),
        table,
        torch.tensor(lens, dtype=torch.int32),
        value_dim=LATENT,
        softmax_scale=SCALE,
        kv_scale=0.5,
    )
    want_out, want_lse = want_out.view(-1, HEADS, LATENT), want_lse.view(-1, HEADS)
    assert_close(out, want_out, atol=1e-4, rtol=1e-4, what="out", same_dtype=True)
    assert_close(lse, want_lse, atol=1e-4, rtol=1e-4, what="lse", same_dtype=True)


def test_non_causal_rows_all_see_the_whole_sequence():
    lens = [25]
    cache, table = _fp8_cache(lens, kv_scale=0.5)
    q = torch.randn(4, HEADS, WIDTH)
    out, _ = _decode(q, cache, table, lens, causal=False)
    for r in range(4):
        alone, _ = _decode(q[r : r + 1], cache, table, lens)
        assert_close(
            out[r : r + 1], alone, atol=1e-4, rtol=1e-4, what="row", same_dtype=True
        )


@pytest.mark.parametrize(("rows", "causal"), [(1, True), (4, True), (4, False)])
def test_decode_reads_nothing_back_from_the_device(rows, causal):
    """No sync per MLA layer, and what a CUDA graph needs: the split-KV grid is
    sized from the metadata's host-side bound, each row's length read on the
    device."""
    lens = [20, 37]
    cache, table = _fp8_cache(lens, kv_scale=0.5)
    q = torch.randn(len(lens) * rows, HEADS, WIDTH)
    want, _ = _decode(q, cache, table, lens, causal=causal)
    with no_host_reads():
        got, _ = _decode(q, cache, table, lens, causal=causal)
    assert torch.equal(got, want)


def test_rows_that_do_not_split_over_the_requests_are_refused():
    cache, table = _fp8_cache([10, 12], kv_scale=1.0)
    with pytest.raises(ValueError, match="3 query rows do not split evenly over 2"):
        _decode(torch.randn(3, HEADS, WIDTH), cache, table, [10, 12])


def test_the_cpu_backend_writes_the_fp8_latent_with_the_layer_scale():
    assert "fp8" in K3CpuMlaBackend.supported_kv_cache_dtypes
    impl = object.__new__(K3CpuMlaImpl)
    cache = torch.zeros(2, PAGE, WIDTH, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(3, LATENT), torch.randn(3, 1, WIDTH - LATENT)
    slots = torch.tensor([5, -1, 17])  # -1: a padding row, not written
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "fp8", torch.tensor(0.25))
    stored = cache.view(torch.float8_e4m3fn).view(-1, WIDTH).float() * 0.25
    latent = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
    # e4m3 keeps 3 mantissa bits: 2^-4 relative, plus the subnormal step.
    for slot, row in ((5, 0), (17, 2)):
        assert_close(
            stored[slot],
            latent[row],
            rtol=2**-4,
            atol=2**-7,
            what="slot",
            same_dtype=True,
        )
    untouched = torch.ones(stored.shape[0], dtype=torch.bool)
    untouched[[5, 17]] = False
    assert not stored[untouched].any()


def test_the_gpu_backend_is_vllms_triton_mla_with_our_decode():
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    backend = gpu_mla_backend()
    assert backend is gpu_mla_backend()  # one class for every layer
    assert issubclass(backend, TritonMLABackend)
    assert backend.get_name() == "K3_TRITON_MLA"
    assert backend.get_impl_cls().forward_mqa is k3_mla_decode
    assert {"fp8", "fp8_e4m3"} <= set(backend.supported_kv_cache_dtypes)
    assert backend.get_impl_cls().supports_dcp is False
