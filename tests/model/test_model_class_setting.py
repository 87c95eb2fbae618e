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
def test_cuda_graphs_on_a_gpu_are_refused_at_load_naming_the_fix(mode):
    from vllm.config.compilation import CUDAGraphMode

    from vllm_k3_plugin.model.model import require_eager_on_gpus

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode[mode])
    )
    with pytest.raises(ValueError, match="--enforce-eager"):
        require_eager_on_gpus(config, on_gpu=True)
    require_eager_on_gpus(config, on_gpu=False)
    eager = SimpleNamespace(
        compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE)
    )
    require_eager_on_gpus(eager, on_gpu=True)


def test_kernels_default_to_triton_on_gpus_and_pytorch_on_the_cpu(monkeypatch):
    from vllm_k3_plugin.envs import KERNELS_ENV, kernels

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert kernels(on_gpu=True) == "triton"
    assert kernels(on_gpu=False) == "pytorch"
    monkeypatch.setenv(KERNELS_ENV, " PyTorch ")
    assert kernels(on_gpu=True) == "pytorch"
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="triton, pytorch"):
        kernels(on_gpu=True)
