"""A kernel compared with its reference must not pass because its launcher took the
reference: here every launcher that falls back fails the test, naming the kernel and
why, unless the test is marked ``falls_back`` (the tests of the fallbacks)."""

from __future__ import annotations

import pytest

from k3_triton_kernels.kda import chunk_state as kda_chunk_state
from k3_triton_kernels.kda import chunk_terms as kda_chunk_terms
from k3_triton_kernels.kda import decode as kda_decode
from k3_triton_kernels.mla import decode as mla_decode
from k3_triton_kernels.moe import latent_moe
from k3_triton_kernels.runtime import log_path

KERNEL_MODULES = (kda_chunk_state, kda_chunk_terms, kda_decode, latent_moe, mla_decode)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "falls_back: the test expects a launcher to take its reference"
    )


@pytest.fixture(autouse=True)
def kernels_must_run(request, monkeypatch):
    if request.node.get_closest_marker("falls_back"):
        return

    def refuse_fallback(kernel: str, fallback_reason: str | None) -> None:
        if fallback_reason is not None:
            raise AssertionError(f"{kernel} fell back: {fallback_reason}")
        log_path(kernel, fallback_reason)

    for module in KERNEL_MODULES:
        monkeypatch.setattr(module, "log_path", refuse_fallback)
