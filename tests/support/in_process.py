"""Building the model class in this process: the config ``vllm serve`` builds for
the tests' fp32 tiny-K3 server, and the block settings the layers are built under."""

from __future__ import annotations

import contextlib
import os

from vllm_k3_plugin.envs import KDA_ENV, KERNELS_ENV, MLA_ENV, MOE_ENV

from .cpu_without_triton import allow_cpu_without_triton


def engine_config(checkpoint, **extra):
    """The config ``vllm serve`` builds for the tests' fp32 tiny-K3 server."""
    from vllm.engine.arg_utils import EngineArgs

    allow_cpu_without_triton()
    return EngineArgs(
        model=str(checkpoint),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        enable_prefix_caching=False,
        hf_overrides={"quantization_config": None},
        **extra,
    ).create_engine_config()


@contextlib.contextmanager
def kernel_settings(kernels: str, moe: str | None = None, kda: str | None = None):
    """``VLLM_K3_KERNELS`` (and ``VLLM_K3_MOE`` and ``VLLM_K3_KDA``, unset if
    ``None``; ``VLLM_K3_MLA`` unset) for the layers built inside."""
    settings = {KERNELS_ENV: kernels, MOE_ENV: moe, MLA_ENV: None, KDA_ENV: kda}
    saved = {name: os.environ.get(name) for name in settings}
    for name, value in settings.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
