"""Served runs that more than one module of these tests reads."""

from __future__ import annotations

import pytest

from tests.support.model_checks import (
    FP8_CACHE,
    TRITON_UNDER_INTERPRETER,
    ServedRun,
    kernel_prompts,
    served_run,
)


@pytest.fixture(scope="session")
def triton_kernel_run(tiny_k3_checkpoint, tmp_path_factory) -> ServedRun:
    """The tiny K3 checkpoint served with ``TRITON_UNDER_INTERPRETER`` and
    ``FP8_CACHE``, on ``kernel_prompts()``."""
    log = tmp_path_factory.mktemp("k3-triton-kernels") / "vllm-serve.log"
    return served_run(
        tiny_k3_checkpoint,
        log,
        *FP8_CACHE,
        env=TRITON_UNDER_INTERPRETER,
        batch=kernel_prompts(),
    )
