"""Kimi-K3.1 in the class on GPUs, built in process: vLLM's own K3.1 layers where
the installed vLLM has them for the platform, a refusal naming
``VLLM_K3_MODEL_CLASS=vllm`` elsewhere.

There is no GPU here. The class is built for the tiny K3.1 checkpoint with the
platform its modules read (``current_platform`` in ``model``, ``mla`` and
``dsa_vllm``) answering CUDA or ROCm; vLLM's layers keep the CPU platform, and
vLLM's attention selector answers a sparse MLA request with FlashInfer's SM90
sparse MLA, one of the backends vLLM's CUDA platform ranks for Hopper and the one
of them whose layer builds without a device (FlashMLA's and FlashAttention's need
the GPU to build). vLLM's kernels themselves, and the cache sizing the engine does
on a GPU, need a GPU and are not run here.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from safetensors.torch import load_file

from tests.support.in_process import engine_config, kernel_settings
from tests.support.one_rank import one_rank
from vllm_k3_plugin.envs import MODEL_CLASS_ENV
from vllm_k3_plugin.model.dsa_vllm import installed_indexer_class

HAS_K31_LAYERS = installed_indexer_class() is not None
NEEDS_K31_LAYERS = pytest.mark.skipif(
    not HAS_K31_LAYERS, reason="this vLLM has no Kimi-K3.1 layers (0.34 has)"
)


def test_vllm_has_k31_layers_from_034():
    """The GPU path's tests below skip without vLLM's K3.1 layers: they must be
    found on the vLLM that has them, or the class would refuse K3.1 there too."""
    import vllm

    from vllm_k3_plugin.compat import release

    assert (release(vllm.__version__) >= (0, 34)) == HAS_K31_LAYERS, vllm.__version__


# The tiny K3.1 checkpoint's DSA layers (from 0): its two MLA layers.
DSA_LAYERS = (2, 5)
SPARSE_BACKEND = "FLASHINFER_MLA_SPARSE_SM90"
# The layout vLLM's K3.1 indexer cache supports (block-outermost), which the engine
# resolves for it on a GPU.
GPU_CACHE_LAYOUT = "BLHNC"


class PlatformReading:
    """The platform as the class's modules read it: ``kind`` (cuda or rocm) for
    the questions the class asks, vLLM's platform for the rest."""

    def __init__(self, platform, kind: str) -> None:
        self._platform, self._kind = platform, kind

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return self._kind == "cuda"

    def is_rocm(self) -> bool:
        return self._kind == "rocm"

    def is_cuda_alike(self) -> bool:
        return True


def build_on(kind: str, checkpoint, monkeypatch):
    """The class vLLM resolves for ``checkpoint``, built with its modules reading
    a ``kind`` platform; returns ``(model, config, selector requests)``, or raises
    what the build raises. Runs inside ``one_rank``."""
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_k3_plugin.model import dsa_vllm, mla, model
    from vllm_k3_plugin.registration import register_all

    register_all()
    config = engine_config(checkpoint)
    model_cls, _ = config.model_config.registry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    if HAS_K31_LAYERS:
        # Imported on the CPU platform, as on the GPU before the class is built.
        import vllm.models.kimi_k3.nvidia.dsa  # noqa: F401
    reading = PlatformReading(current_platform, kind)
    for module in (model, mla, dsa_vllm):
        monkeypatch.setattr(module, "current_platform", reading)
    requests = []
    choose = current_platform.get_attn_backend_cls

    def select(selected_backend, attn_selector_config, num_heads=None):
        if not attn_selector_config.use_sparse:
            return choose(selected_backend, attn_selector_config, num_heads)
        requests.append(attn_selector_config)
        return AttentionBackendEnum[SPARSE_BACKEND].get_path()

    monkeypatch.setattr(current_platform, "get_attn_backend_cls", select)
    # vLLM caches its selector's answers: this build asks afresh.
    selector._cached_get_attn_backend.cache_clear()
    config.compilation_config.static_forward_context.clear()
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config), kernel_settings("pytorch"):
        return model_cls(vllm_config=config), config, requests


@pytest.fixture
def on_cuda(tiny_k31_checkpoint, monkeypatch):
    config = engine_config(tiny_k31_checkpoint)
    with one_rank(config):
        yield build_on("cuda", tiny_k31_checkpoint, monkeypatch)
    forget_sparse_answers()


def forget_sparse_answers() -> None:
    """Leave no answer of the stand-in selector in vLLM's cache."""
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


def _dsa_attention(model, layer: int):
    return model.language_model.model.layers[layer].self_attn


@NEEDS_K31_LAYERS
def test_on_cuda_a_k31_layer_is_built_on_vllms_indexer_and_sparse_mla(on_cuda):
    from vllm.models.kimi_k3.nvidia.dsa import KimiK3DSAIndexer
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model, config, requests = on_cuda
    backend = AttentionBackendEnum[SPARSE_BACKEND].get_class()
    # vLLM's selector was asked for a sparse MLA backend (it caches its answer).
    assert requests
    assert all(request.use_mla and request.use_sparse for request in requests)
    buffers = set()
    for layer in DSA_LAYERS:
        attn = _dsa_attention(model, layer)
        assert isinstance(attn.indexer, KimiK3DSAIndexer)
        assert attn.attn.use_sparse and attn.attn.attn_backend is backend
        assert isinstance(attn.attn.impl, backend.get_impl_cls())
        assert attn.attn.indexer is attn.indexer
        assert attn.indexer.dense_mha_metadata_layer_name == attn.attn.layer_name
        buffers.add(id(attn.indexer.topk_indices_buffer))
        buffer = attn.indexer.topk_indices_buffer
    # One buffer for every DSA layer, one row per scheduled token.
    assert len(buffers) == 1
    topk = config.model_config.hf_text_config.dsa_config.index_topk
    rows = config.scheduler_config.max_num_batched_tokens
    assert buffer.shape == (rows, topk) and buffer.dtype == torch.int32


@NEEDS_K31_LAYERS
def test_on_cuda_the_loader_fills_vllms_indexer_from_the_k31_names(
    on_cuda, tiny_k31_checkpoint
):
    model, _, _ = on_cuda
    weights = load_file(str(tiny_k31_checkpoint / "model.safetensors"))
    assert model.load_weights(weights.items()) == {
        name for name, _ in model.named_parameters()
    }
    for layer in DSA_LAYERS:
        stored = f"language_model.model.layers.{layer}.self_attn.indexer."
        indexer = _dsa_attention(model, layer).indexer
        expected = {
            "wq_index.weight": weights[stored + "wq_b.weight"],
            "wkv_index.weight": torch.cat(
                [weights[stored + "wk.weight"], weights[stored + "weights_proj.weight"]]
            ),
            "k_index_norm.weight": weights[stored + "k_norm.weight"],
            "k_index_norm.bias": weights[stored + "k_norm.bias"],
        }
        loaded = dict(indexer.named_parameters())
        for name, tensor in expected.items():
            assert torch.equal(loaded[name].data, tensor.to(loaded[name].dtype)), name


@NEEDS_K31_LAYERS
def test_on_cuda_a_k31_layer_scores_then_marks_the_top_k_then_attends(
    on_cuda, tiny_k31_checkpoint, monkeypatch
):
    """The layer's forward as vLLM's own K3.1 layer orders it: vLLM's indexer on
    the hidden states and the normalized query latent, the impl told the top-k is
    ready, then the sparse MLA; its output gated and projected. vLLM's kernels are
    recorded, not run."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model, config, _ = on_cuda
    weights = load_file(str(tiny_k31_checkpoint / "model.safetensors"))
    model.load_weights(weights.items())
    with set_current_vllm_config(config):
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    attn = _dsa_attention(model, DSA_LAYERS[0])
    calls = []

    def recorded(name, method):
        """``method`` recorded, called as its own signature takes it."""
        signature = inspect.signature(method)

        def record(*args, **kwargs):
            signature.bind(*args, **kwargs)
            calls.append((name, args))

        return record

    monkeypatch.setattr(
        attn.indexer, "forward", recorded("indexer", attn.indexer.forward)
    )
    impl = attn.attn.impl
    monkeypatch.setattr(
        impl,
        "record_logical_topk_ready",
        recorded("topk ready", impl.record_logical_topk_ready),
    )
    attended = torch.randn(3, attn.local_heads * attn.v_dim)

    def sparse_mla(q, c_kv, k_pe, output_shape):
        calls.append(("sparse mla", (q, c_kv, k_pe)))
        return attended

    monkeypatch.setattr(attn.attn, "forward", sparse_mla)
    hidden = torch.randn(3, attn.q_a_proj.input_size)
    out = attn(hidden)
    assert [name for name, _ in calls] == ["indexer", "topk ready", "sparse mla"]
    indexer_hidden, q_latent = calls[0][1]
    assert torch.equal(indexer_hidden, hidden)
    assert torch.equal(q_latent, attn.q_a_layernorm(attn.q_a_proj(hidden)[0]))
    gate = torch.sigmoid(attn.g_proj(hidden)[0])
    assert torch.allclose(out, attn.o_proj(attended * gate)[0], atol=1e-6)


@NEEDS_K31_LAYERS
def test_on_cuda_vllm_groups_each_indexer_cache_with_its_latent(on_cuda):
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups

    _, config, _ = on_cuda
    context = config.compilation_config.static_forward_context
    specs = {
        name: layer.get_kv_cache_spec(config)
        for name, layer in context.items()
        if isinstance(layer, AttentionLayerBase)
    }
    config.cache_config.kv_cache_layout = GPU_CACHE_LAYOUT
    groups = [set(group.layer_names) for group in get_kv_cache_groups(config, specs)]
    for layer in DSA_LAYERS:
        attn = f"language_model.model.layers.{layer}.self_attn"
        pair = {f"{attn}.attn", f"{attn}.indexer.k_cache"}
        assert any(pair <= group for group in groups), groups


@pytest.mark.parametrize(
    "kind",
    [
        "rocm",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                HAS_K31_LAYERS, reason="this vLLM has Kimi-K3.1 layers for CUDA"
            ),
        ),
    ],
)
def test_where_vllm_has_no_k31_layers_the_class_refuses_naming_vllms_class(
    kind, tiny_k31_checkpoint, monkeypatch
):
    """vLLM's K3.1 layers are CUDA kernels (0.34 refuses ROCm too); before 0.34
    vLLM has none."""
    config = engine_config(tiny_k31_checkpoint)
    with one_rank(config), pytest.raises(ValueError) as refusal:
        build_on(kind, tiny_k31_checkpoint, monkeypatch)
    forget_sparse_answers()
    assert re.search(rf"Kimi-K3\.1.*{MODEL_CLASS_ENV}=vllm", str(refusal.value))


def test_the_indexer_names_map_as_vllms_own_k31_loader_maps_them():
    from vllm_k3_plugin.model.dsa_vllm import indexer_parameter

    stem = "model.layers.2.self_attn.indexer."
    assert indexer_parameter(stem + "wq_b.weight") == (stem + "wq_index.weight", None)
    assert indexer_parameter(stem + "wk.weight") == (stem + "wkv_index.weight", 0)
    assert indexer_parameter(stem + "weights_proj.weight") == (
        stem + "wkv_index.weight",
        1,
    )
    assert indexer_parameter(stem + "k_norm.bias") == (stem + "k_index_norm.bias", None)
    assert indexer_parameter("model.layers.2.self_attn.kv_b_proj.weight") is None
    assert indexer_parameter(stem + "k_cache.weight") is None
    if HAS_K31_LAYERS:
        from vllm.models.kimi_k3.nvidia import model

        from vllm_k3_plugin.model.dsa_vllm import INDEXER_PARAMETERS

        def tail(name: str) -> str:
            return name.rpartition("indexer.")[2].strip(".")

        theirs = {
            tail(name): (tail(param), shard)
            for param, name, shard in model._DSA_STACKED_PARAMS_MAPPING
        } | {
            tail(name): (tail(param), None)
            for param, name in model._DSA_RENAME_PARAMS_MAPPING
            if tail(name)
        }
        assert theirs == INDEXER_PARAMETERS
