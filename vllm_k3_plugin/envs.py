"""Every ``VLLM_K3_*`` setting: its name, default, choices and parsing, here only.

Each is read when asked: the parsers read the replay policy when they are built;
registration reads every setting once at process start, so a bad value stops the
server there rather than failing a request.
"""

from __future__ import annotations

import os

from vllm_k3_plugin.format.skipped_channel import ReplayPolicy

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

    The default is ``plugin`` on the CPU and ``vllm`` elsewhere: on GPUs vLLM's
    in-tree class is the production path, and ours has not run on a GPU yet."""
    default = "plugin" if on_cpu else "vllm"
    return _choice(MODEL_CLASS_ENV, default, MODEL_CLASS_CHOICES, "a model class")


KERNELS_ENV = "VLLM_K3_KERNELS"
KERNELS_CHOICES = ("triton", "pytorch")


def kernels() -> str | None:
    """``VLLM_K3_KERNELS``: ``triton`` (the project's kernels for every block whose
    own setting is unset: ``k3_triton_kernels``' MLA decode, latent MoE and KDA),
    ``pytorch`` (their PyTorch paths; MLA on GPUs: vLLM's backend) or, unset,
    ``None``: each block takes its own default (``moe``, ``mla``, ``kda``). On the
    CPU Triton runs only under ``TRITON_INTERPRET=1`` (slow; for tests)."""
    if KERNELS_ENV not in os.environ:
        return None
    return _choice(KERNELS_ENV, "", KERNELS_CHOICES, "a kernels")


MOE_ENV = "VLLM_K3_MOE"
MOE_CHOICES = ("auto", "triton", "torch")


def moe(on_cpu: bool) -> str:
    """``VLLM_K3_MOE``: the routed experts on ``auto`` (vLLM's ``FusedMoE`` layer:
    its router, expert parallelism and the experts kernel and quantization method
    vLLM picks; PyTorch experts inside it on the CPU), ``triton``
    (``k3_triton_kernels.moe.latent_moe``) or ``torch`` (the PyTorch path on
    experts decoded on load: the CPU only). Unset: ``auto``; with
    ``VLLM_K3_KERNELS`` set, ``triton`` for ``triton`` and, for ``pytorch``,
    ``torch`` on the CPU and ``auto`` elsewhere."""
    chosen = kernels()
    default = "auto"
    if chosen == "triton":
        default = "triton"
    elif chosen == "pytorch" and on_cpu:
        default = "torch"
    return _choice(MOE_ENV, default, MOE_CHOICES, "an MoE")


MLA_ENV = "VLLM_K3_MLA"
MLA_CHOICES = ("auto", "triton", "torch")


def mla(on_cpu: bool) -> str:
    """``VLLM_K3_MLA``: the MLA layers' attention backend: ``auto`` (the one vLLM
    selects for the platform), ``triton`` (vLLM's MLA metadata and prefill with
    ``k3_triton_kernels.mla.decode``: ``K3_TRITON_MLA`` on CUDA and ROCm,
    ``K3_CPU_MLA`` on the CPU) or ``torch`` (``K3_CPU_MLA`` with the decode's
    PyTorch reference; the CPU only). Unset: ``auto`` off the CPU and ``torch`` on
    it (vLLM's CPU MLA backends cannot serve K3 in general: ``CPU_MLA`` pages hold
    16 tokens, a hybrid model's hold a KDA state; ``AMX_MLA`` needs an AMX host
    and bf16 weights); with ``VLLM_K3_KERNELS`` set, ``triton`` for ``triton``,
    and the unset defaults for ``pytorch``."""
    default = "torch" if on_cpu else "auto"
    if kernels() == "triton":
        default = "triton"
    return _choice(MLA_ENV, default, MLA_CHOICES, "an MLA")


KDA_ENV = "VLLM_K3_KDA"
KDA_CHOICES = ("auto", "triton", "torch")


def kda(on_gpu: bool) -> str:
    """``VLLM_K3_KDA``: the KDA layers' delta rule on ``auto`` (vLLM's in-tree K3
    KDA ops, GPUs only; the project's kernels where the installed vLLM has none),
    ``triton`` (``k3_triton_kernels.kda``: chunk terms and state pass for
    prefills, the fused decode step) or ``torch`` (their PyTorch paths). Unset:
    ``auto`` on CUDA and ROCm, ``torch`` elsewhere; with ``VLLM_K3_KERNELS`` set,
    ``triton`` for ``triton`` and ``torch`` for ``pytorch``."""
    default = {"triton": "triton", "pytorch": "torch"}.get(
        kernels(), "auto" if on_gpu else "torch"
    )
    return _choice(KDA_ENV, default, KDA_CHOICES, "a KDA")


# The settings that act only on the plugin's model class: vLLM's in-tree class
# ignores them, and registration warns where one is set and the class is off.
MODEL_CLASS_SETTINGS = (KERNELS_ENV, MOE_ENV, MLA_ENV, KDA_ENV)


def setting_source(env: str, value: str) -> str:
    """The setting that chose ``value`` for ``env``, as a log line names it: the
    variable itself, ``VLLM_K3_KERNELS`` where that chose, else the default."""
    if env in os.environ:
        return f"{env}={value}"
    chosen = kernels()
    if chosen is not None:
        return f"{KERNELS_ENV}={chosen}"
    return f"{env}={value}, its default here"


def _choice(env: str, default: str, choices: tuple[str, ...], what: str) -> str:
    raw = os.environ.get(env, default).strip().lower()
    if raw not in choices:
        raise ValueError(
            f"{env}={raw!r} is not {what} choice; choose one of {', '.join(choices)}"
        )
    return raw


ALLOW_UNSUPPORTED_VLLM_ENV = "VLLM_K3_ALLOW_UNSUPPORTED_VLLM"


def allow_unsupported_vllm() -> bool:
    """``VLLM_K3_ALLOW_UNSUPPORTED_VLLM``: load the plugin into a vLLM outside the
    supported range (any value but empty or ``0``), with a warning."""
    return os.environ.get(ALLOW_UNSUPPORTED_VLLM_ENV, "") not in ("", "0")


METRICS_ENV = "VLLM_K3_METRICS"


def metrics() -> bool:
    """``VLLM_K3_METRICS``: ``1`` (default) counts what the kimi_k3 parsers read on
    vLLM's ``/metrics``; ``0`` counts nothing."""
    return _choice(METRICS_ENV, "1", ("0", "1"), "a metrics") == "1"


# Every setting, as vLLM is told of them (``registration``).
SETTINGS = (
    REPLAY_POLICY_ENV,
    MODEL_CLASS_ENV,
    *MODEL_CLASS_SETTINGS,
    ALLOW_UNSUPPORTED_VLLM_ENV,
    METRICS_ENV,
)
