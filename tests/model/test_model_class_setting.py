"""Which Kimi-K3 model class the plugin registers, by platform and setting."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_k3_plugin.envs import MODEL_CLASS_ENV, model_class


def test_ours_by_default_on_the_cpu_only(monkeypatch):
    monkeypatch.delenv(MODEL_CLASS_ENV, raising=False)
    assert model_class(on_cpu=True) == "plugin"
    assert model_class(on_cpu=False) == "vllm"


@pytest.mark.parametrize("value", ["plugin", "vllm", " VLLM "])
def test_the_setting_wins_everywhere(monkeypatch, value):
    monkeypatch.setenv(MODEL_CLASS_ENV, value)
    assert (
        model_class(on_cpu=True) == model_class(on_cpu=False) == value.strip().lower()
    )


def test_a_bad_value_names_the_choices(monkeypatch):
    monkeypatch.setenv(MODEL_CLASS_ENV, "mine")
    with pytest.raises(ValueError, match="plugin, vllm"):
        model_class(on_cpu=True)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "FULL"])
def test_cuda_graphs_are_refused_at_load_only_where_a_layer_reads_the_host(mode):
    """On a GPU with CUDA graphs a layer that reads the host (``graph_blocker``) is
    refused at load, naming the layer, the reason and the fix; without such a
    layer, on the CPU, or without graphs, the model loads."""
    from torch import nn
    from vllm.config.compilation import CUDAGraphMode

    from vllm_k3_plugin.model.build_checks import check_cuda_graphs

    def config(name):
        return SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[name])
        )

    def layer(blocker):
        module = nn.Module()
        module.graph_blocker = blocker
        return module

    model = nn.Sequential(layer(None), layer("reads ids back"), layer("reads ids back"))
    with pytest.raises(ValueError, match=r"^Kimi-K3: 1 \(and 1 more layers\)") as err:
        check_cuda_graphs(config(mode), model, on_gpu=True)
    assert "reads ids back" in str(err.value)
    assert "--enforce-eager" in str(err.value)
    check_cuda_graphs(config(mode), model, on_gpu=False)
    check_cuda_graphs(config("NONE"), model, on_gpu=True)
    check_cuda_graphs(config(mode), nn.Sequential(layer(None)), on_gpu=True)


def test_each_block_defaults_to_vllms_layer_where_it_has_one(monkeypatch):
    """Unset: the MoE on vLLM's FusedMoE everywhere, MLA on vLLM's backend off the
    CPU, KDA on vLLM's ops on GPUs and PyTorch on the CPU. ``VLLM_K3_KERNELS`` set:
    every unset block follows it, but no PyTorch MoE or MLA off the CPU (vLLM's
    layers there)."""
    from vllm_k3_plugin.envs import (
        KDA_ENV,
        KERNELS_ENV,
        MLA_ENV,
        MOE_ENV,
        kda,
        kernels,
        mla,
        moe,
        setting_source,
    )

    for env in (KERNELS_ENV, MOE_ENV, MLA_ENV, KDA_ENV):
        monkeypatch.delenv(env, raising=False)

    def blocks(on_gpu: bool) -> tuple[str, str, str]:
        return moe(not on_gpu), mla(not on_gpu), kda(on_gpu)

    assert blocks(on_gpu=True) == ("auto", "auto", "auto")
    assert blocks(on_gpu=False) == ("auto", "torch", "torch")
    assert setting_source(MOE_ENV, "auto") == "VLLM_K3_MOE=auto, its default here"
    assert setting_source(KDA_ENV, "torch") == "VLLM_K3_KDA=torch, its default here"
    monkeypatch.setenv(KERNELS_ENV, " PyTorch ")
    assert kernels() == "pytorch"
    assert blocks(on_gpu=True) == ("auto", "auto", "torch")
    assert blocks(on_gpu=False) == ("torch", "torch", "torch")
    assert setting_source(MOE_ENV, "torch") == "VLLM_K3_KERNELS=pytorch"
    monkeypatch.setenv(KERNELS_ENV, "triton")
    assert blocks(on_gpu=False) == ("triton", "triton", "triton")
    monkeypatch.setenv(MOE_ENV, " Auto ")
    monkeypatch.setenv(KDA_ENV, "torch")
    assert blocks(on_gpu=True) == ("auto", "triton", "torch")
    assert setting_source(KDA_ENV, "torch") == "VLLM_K3_KDA=torch"
    for env, value, choices, read in (
        (MOE_ENV, "fused", "auto, triton, torch", lambda: moe(on_cpu=False)),
        (KDA_ENV, "fla", "auto, triton, torch", lambda: kda(True)),
        (KERNELS_ENV, "cuda", "triton, pytorch", kernels),
    ):
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError, match=f"{env}='{value}' .*{choices}"):
            read()


def test_the_mla_setting_picks_the_backend_and_refuses_torch_on_gpus(monkeypatch):
    """``VLLM_K3_MLA``: ``auto`` leaves the backend to vLLM, ``triton`` is ours,
    ``torch`` on a GPU is refused naming the setting."""
    from vllm.platforms import current_platform

    from vllm_k3_plugin.envs import KERNELS_ENV, MLA_ENV, mla
    from vllm_k3_plugin.model import mla_backend as backends
    from vllm_k3_plugin.model.mla_backend import (
        K3CpuMlaBackend,
        mla_backend_for_platform,
    )

    monkeypatch.delenv(MLA_ENV, raising=False)
    monkeypatch.setenv(KERNELS_ENV, "pytorch")
    assert (mla(on_cpu=True), mla(on_cpu=False)) == ("torch", "auto")
    monkeypatch.setenv(KERNELS_ENV, "triton")
    assert (mla(on_cpu=True), mla(on_cpu=False)) == ("triton", "triton")
    assert mla_backend_for_platform("auto") is None
    assert mla_backend_for_platform("torch") is K3CpuMlaBackend
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(backends, "gpu_mla_backend", lambda: "K3_TRITON_MLA")
    assert mla_backend_for_platform("triton") == "K3_TRITON_MLA"
    monkeypatch.setenv(MLA_ENV, "torch")
    with pytest.raises(ValueError, match="VLLM_K3_MLA=torch has no backend on"):
        mla_backend_for_platform("torch")
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: False)
    monkeypatch.setenv(MLA_ENV, "triton")
    with pytest.raises(ValueError, match="serves CUDA and ROCm only"):
        mla_backend_for_platform("triton")
    monkeypatch.setenv(MLA_ENV, "flash")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        mla(on_cpu=False)


K31_DSA = {
    "dsa_layers": [3, 6],
    "index_topk": 4,
    "index_head_dim": 16,
    "index_num_heads": 4,
    "index_k_norm_type": "layernorm",
}


@pytest.mark.parametrize("as_dataclass", [False, True])
def test_sparse_attention_is_served_on_the_cpu_and_with_vllms_layers_else_refused(
    as_dataclass,
):
    """Kimi-K3.1's ``dsa_config`` (a dict on vLLM without K3.1, a dataclass on
    0.34): read and checked on the CPU and where vLLM has K3.1 layers for the GPU;
    elsewhere the class has no sparse MLA, and refuses rather than attend densely,
    naming the way out."""
    from dataclasses import make_dataclass

    from vllm_k3_plugin.model.build_checks import sparse_attention

    dsa = K31_DSA
    if as_dataclass:
        dsa = make_dataclass("DsaConfig", list(K31_DSA))(**K31_DSA)
    config = SimpleNamespace(dsa_config=dsa)
    for on_cpu, vllm_layers in ((True, False), (False, True)):
        settings = sparse_attention(config, on_cpu=on_cpu, vllm_layers=vllm_layers)
        assert settings["dsa_layers"] == {3, 6} and settings["index_topk"] == 4
    with pytest.raises(ValueError, match=rf"Kimi-K3\.1.*{MODEL_CLASS_ENV}=vllm"):
        sparse_attention(config, on_cpu=False, vllm_layers=False)
    for dense in (SimpleNamespace(dsa_config=None), SimpleNamespace()):
        assert sparse_attention(dense, on_cpu=True, vllm_layers=False) is None
        assert sparse_attention(dense, on_cpu=False, vllm_layers=False) is None


def test_a_sparse_attention_config_it_cannot_honour_is_refused_on_the_cpu():
    from vllm_k3_plugin.model.build_checks import sparse_attention
    from vllm_k3_plugin.reference.checkpoint_format import DsaConfigError

    shared_index = SimpleNamespace(dsa_config={**K31_DSA, "index_topk_freq": 2})
    with pytest.raises(DsaConfigError, match="index_topk_freq 2"):
        sparse_attention(shared_index, on_cpu=True, vllm_layers=False)
    # DSA named on a KDA layer (1) and past the last layer (7), of the tiny layout.
    misplaced = SimpleNamespace(
        dsa_config={**K31_DSA, "dsa_layers": [1, 3, 7]},
        num_hidden_layers=6,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6]},
    )
    with pytest.raises(DsaConfigError, match=r"dsa_layers \[1, 7\]"):
        sparse_attention(misplaced, on_cpu=True, vllm_layers=False)


@pytest.mark.parametrize("architecture", ["ConditionalGeneration", "CausalLM"])
def test_on_a_gpu_without_vllms_k31_layers_the_class_refuses_a_sparse_config_first(
    architecture, monkeypatch
):
    """Both registered classes refuse before building anything (a platform that
    is neither the CPU nor CUDA: vLLM's K3.1 layers are CUDA's)."""
    from vllm.platforms import current_platform

    from vllm_k3_plugin.model import model

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    text = SimpleNamespace(dsa_config=K31_DSA)
    config = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=text))
    with pytest.raises(ValueError, match=r"Kimi-K3\.1"):
        getattr(model, f"KimiK3For{architecture}")(vllm_config=config)
