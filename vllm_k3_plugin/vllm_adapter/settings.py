"""Operator settings, read from the environment.

Each parser reads them when it is built; registration reads them once at process
start, so a bad value stops the server there rather than failing a request.
"""

from __future__ import annotations

import os

from vllm_k3_plugin.reasoning_reader import ReplayPolicy

REPLAY_POLICY_ENV = "VLLM_K3_REPLAY_POLICY"


def replay_policy() -> ReplayPolicy:
    """``VLLM_K3_REPLAY_POLICY``: ``replay`` (default) or ``hold-back``."""
    raw = os.environ.get(REPLAY_POLICY_ENV, ReplayPolicy.REPLAY.value).strip().lower()
    try:
        return ReplayPolicy(raw)
    except ValueError:
        choices = ", ".join(policy.value for policy in ReplayPolicy)
        raise ValueError(
            f"{REPLAY_POLICY_ENV}={raw!r} is not a replay policy; choose one of "
            f"{choices}"
        ) from None


MODEL_CLASS_ENV = "VLLM_K3_MODEL_CLASS"
MODEL_CLASS_CHOICES = ("plugin", "vllm")


def model_class(on_cpu: bool) -> str:
    """``VLLM_K3_MODEL_CLASS``: ``plugin`` (the Kimi-K3 architectures load this
    package's model class) or ``vllm`` (keep vLLM's in-tree class).

    The default is ``plugin`` on the CPU and ``vllm`` elsewhere: our class computes
    with PyTorch paths and decodes the MXFP4 experts to BF16, which the real model
    cannot afford on GPUs until the Triton kernels are wired in."""
    default = "plugin" if on_cpu else "vllm"
    raw = os.environ.get(MODEL_CLASS_ENV, default).strip().lower()
    if raw not in MODEL_CLASS_CHOICES:
        raise ValueError(
            f"{MODEL_CLASS_ENV}={raw!r} is not a model class choice; choose one of "
            f"{', '.join(MODEL_CLASS_CHOICES)}"
        )
    return raw
