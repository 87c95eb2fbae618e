"""The SiTU MLP (layer 0 and the shared experts) and the stable latent MoE.

Tensor parallelism shards every SiTU MLP's intermediate dimension (gate/up by rows,
down by columns, one all-reduce); SiTU is element-wise over that dimension, so each
rank's slice is exact. The routed experts are sharded the same way: each rank holds a
slice of every expert, and the weighted per-rank partial sums are all-reduced before
the latent norm. The router, the latent down/up projections and the norm are
replicated.

The routed experts arrive MXFP4-packed; the loader decodes them to the model dtype
(the PyTorch path), every e2m1 value times its power-of-two scale exactly.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import (
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from vllm_k3_plugin.model import reference as ref


def situ_betas(config) -> dict[str, float]:
    return {
        "beta": config.activation_situ_beta,
        "linear_beta": config.activation_situ_linear_beta,
    }


class SituMlp(nn.Module):
    """``gate_proj up_proj down_proj`` with SiTU-GLU."""

    def __init__(self, hidden: int, inner: int, betas: dict, prefix: str) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(
            hidden, inner, bias=False, prefix=f"{prefix}.gate_proj"
        )
        self.up_proj = ColumnParallelLinear(
            hidden, inner, bias=False, prefix=f"{prefix}.up_proj"
        )
        self.down_proj = RowParallelLinear(
            inner, hidden, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.betas = betas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)[0]
        up = self.up_proj(x)[0]
        return self.down_proj(ref.situ_glu(gate, up, **self.betas))[0]


class _ShardedWeight(nn.Module):
    def __init__(self, rows: int, cols: int, shard_dim: int, dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), False)
        set_weight_attrs(
            self.weight, {"weight_loader": sharded_weight_loader(shard_dim)}
        )


class RoutedExpert(nn.Module):
    """``w1`` (gate) and ``w3`` (up) ``[inner, latent]``, ``w2`` (down)
    ``[latent, inner]``, this rank's slice of ``inner``."""

    def __init__(self, latent: int, local_inner: int, dtype) -> None:
        super().__init__()
        self.w1 = _ShardedWeight(local_inner, latent, 0, dtype)
        self.w3 = _ShardedWeight(local_inner, latent, 0, dtype)
        self.w2 = _ShardedWeight(latent, local_inner, 1, dtype)


class Router(nn.Module):
    """``gate.weight`` ``[experts, hidden]`` and ``gate.e_score_correction_bias``,
    both kept in fp32: the router's logits are fp32."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(experts, dtype=torch.float32)
        )
        for param in (self.weight, self.e_score_correction_bias):
            param.requires_grad_(False)


class LatentMoe(nn.Module):
    """``block_sparse_moe``: sigmoid router with a selection-only correction bias,
    top-k renormalized; routed path ``up(norm(Σ w_e · expert_e(down(x))))`` on the
    latent; plus the shared experts on ``x``."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        hidden, latent = config.hidden_size, config.routed_expert_hidden_size
        inner = config.moe_intermediate_size
        tp_size = get_tensor_model_parallel_world_size()
        if inner % tp_size:
            raise ValueError(
                f"{prefix}: expert intermediate size {inner} does not split over "
                f"tensor parallel size {tp_size}"
            )
        self.tp_size = tp_size
        self.top_k = config.num_experts_per_token
        self.renormalize = config.moe_renormalize
        self.scaling = config.routed_scaling_factor
        self.betas = situ_betas(config)
        self.gate = Router(config.num_experts, hidden)
        self.routed_expert_down_proj = ReplicatedLinear(
            hidden, latent, bias=False, prefix=f"{prefix}.routed_expert_down_proj"
        )
        self.routed_expert_norm = RMSNorm(latent, eps=config.rms_norm_eps)
        self.routed_expert_up_proj = ReplicatedLinear(
            latent, hidden, bias=False, prefix=f"{prefix}.routed_expert_up_proj"
        )
        dtype = torch.get_default_dtype()
        self.experts = nn.ModuleList(
            RoutedExpert(latent, inner // tp_size, dtype)
            for _ in range(config.num_experts)
        )
        self.shared_experts = SituMlp(
            hidden,
            inner * config.num_shared_experts,
            self.betas,
            f"{prefix}.shared_experts",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = ref.route(
            x.float() @ self.gate.weight.T,
            self.gate.e_score_correction_bias,
            self.top_k,
            renormalize=self.renormalize,
            scaling_factor=self.scaling,
        )
        z = self.routed_expert_down_proj(x)[0]
        routed = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        for expert_id in ids.unique().tolist():
            expert = self.experts[expert_id]
            rows, slot = (ids == expert_id).nonzero(as_tuple=True)
            h = z[rows]
            activated = ref.situ_glu(
                h @ expert.w1.weight.T, h @ expert.w3.weight.T, **self.betas
            )
            routed.index_add_(
                0,
                rows,
                weights[rows, slot, None] * (activated @ expert.w2.weight.T).float(),
            )
        if self.tp_size > 1:
            routed = tensor_model_parallel_all_reduce(routed)
        routed = self.routed_expert_up_proj(
            self.routed_expert_norm(routed.to(x.dtype))
        )[0]
        return routed + self.shared_experts(x)
