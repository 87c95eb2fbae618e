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
