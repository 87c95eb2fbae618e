"""Shared test helpers: chunkings, and outputs built from every marker."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
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


@pytest.fixture
def chunk_all():
    return chunkings


@pytest.fixture(scope="session")
def k3_tokenizer():
    """The real Kimi BPE with the K3 control ids (tiktoken)."""
    from vllm_k3_plugin.tokenizer import load_tiktoken_encoding

    return load_tiktoken_encoding()
