"""The SiTU MLP (layer 0 and the shared experts) and the stable latent MoE.

Tensor parallelism shards every SiTU MLP's intermediate dimension (gate/up by rows,
down by columns, one all-reduce); SiTU is element-wise over that dimension, so each
rank's slice is exact. The routed experts are sharded the same way: each rank holds a
slice of every expert, and the weighted per-rank partial sums are all-reduced before
the latent norm. The router, the latent down/up projections and the norm are
replicated.

The routed experts arrive MXFP4-packed. Three paths, chosen when the layer is built
(``VLLM_K3_MOE``, ``auto`` unless it or ``VLLM_K3_KERNELS`` says otherwise):

- ``auto``: vLLM's ``FusedMoE`` layer (``fused_moe``): vLLM's router, expert
  parameters, loader and expert parallelism, the experts kernel vLLM picks (on the
  CPU, PyTorch experts on weights decoded on load); its output is reduced over
  the tensor and expert parallel ranks by the layer;
- ``torch``: the loader decodes each expert to the model dtype (every e2m1 value
  times its power-of-two scale, exactly) and the experts run as PyTorch matmuls;
  the CPU only (decoded, the real model's experts would not fit a GPU's memory);
- ``triton``: the packed bytes and scales stay as they are, stacked per projection
  (``w13`` = gate rows then up rows), and ``k3_triton_kernels.moe.latent_moe`` runs them
  as W4A8 (activations in the platform's FP8, ``float8_e4m3fn`` or gfx94x's
  ``float8_e4m3fnuz``, with per-token scales). It needs this rank's slice of the
  intermediate dimension to be a whole number of 32-wide MXFP4 scale blocks; where
  it is not, the layer keeps the PyTorch path and says why once (on the CPU; on a
  GPU it is refused, as ``torch`` is).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.distributed import (
    get_tensor_model_parallel_rank,
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
from vllm.platforms import current_platform

from k3_triton_kernels.moe.latent_moe import latent_moe
from k3_triton_kernels.moe.naive import ExpertWeights
from k3_triton_kernels.runtime import log_path
from vllm_k3_plugin.model.fused_moe import fused_routed_experts, load_fused_expert
from vllm_k3_plugin.model.kernel_choice import moe_setting
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import situ_betas


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


class StackedMxfp4Experts(nn.Module):
    """Every expert's MXFP4 weights as the latent MoE kernel reads them, this rank's
    slice of the intermediate dimension ``I``: ``w13_packed`` ``[E, 2I, L/2]`` and
    ``w13_scale`` ``[E, 2I, L/32]`` (gate rows, then up rows), ``w2_packed``
    ``[E, L, I/2]`` and ``w2_scale`` ``[E, L, I/32]``, all uint8."""

    def __init__(self, num_experts: int, latent: int, local_inner: int) -> None:
        super().__init__()
        block = ref.MXFP4_BLOCK
        shapes = {
            "w13_packed": (num_experts, 2 * local_inner, latent // 2),
            "w13_scale": (num_experts, 2 * local_inner, latent // block),
            "w2_packed": (num_experts, latent, local_inner // 2),
            "w2_scale": (num_experts, latent, local_inner // block),
        }
        for name, shape in shapes.items():
            self.register_parameter(
                name, nn.Parameter(torch.empty(shape, dtype=torch.uint8), False)
            )
        self.local_inner = local_inner

    def load(self, expert: int, proj: str, packed, scale) -> list[str]:
        """Copy this rank's slice of one projection's packed bytes and scales."""
        inner = self.local_inner
        rank = get_tensor_model_parallel_rank()
        if proj == "w2":
            byte_cols = slice(rank * inner // 2, (rank + 1) * inner // 2)
            scale_cols = slice(
                rank * inner // ref.MXFP4_BLOCK, (rank + 1) * inner // ref.MXFP4_BLOCK
            )
            self.w2_packed[expert].copy_(packed[:, byte_cols])
            self.w2_scale[expert].copy_(scale[:, scale_cols])
            return ["w2_packed", "w2_scale"]
        rows = slice(rank * inner, (rank + 1) * inner)
        half = slice(0, inner) if proj == "w1" else slice(inner, 2 * inner)
        self.w13_packed[expert, half].copy_(packed[rows])
        self.w13_scale[expert, half].copy_(scale[rows])
        return ["w13_packed", "w13_scale"]

    def weights(self) -> ExpertWeights:
        return ExpertWeights(
            self.w13_packed, self.w13_scale, self.w2_packed, self.w2_scale
        )


def kernel_path_blocker(local_inner: int, latent: int) -> str | None:
    """Why the latent MoE kernel cannot hold these shapes, or ``None``."""
    block = ref.MXFP4_BLOCK
    if local_inner % block:
        return (
            f"the per-rank expert intermediate size {local_inner} is not a multiple "
            f"of the {block}-wide MXFP4 scale block"
        )
    if latent % block:
        return f"the latent size {latent} is not a multiple of {block}"
    return None


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
    latent; plus the shared experts on ``x``. ``redundant_experts``: ``None``
    unless vLLM balances the experts (``expert_balance``)."""

    def __init__(
        self,
        config,
        prefix: str,
        backend: str = "torch",
        redundant_experts: int | None = None,
    ) -> None:
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
        self.betas = situ_betas(config.to_dict())
        self.gate = Router(config.num_experts, hidden)
        self.routed_expert_down_proj = ReplicatedLinear(
            hidden, latent, bias=False, prefix=f"{prefix}.routed_expert_down_proj"
        )
        self.routed_expert_norm = RMSNorm(latent, eps=config.rms_norm_eps)
        self.routed_expert_up_proj = ReplicatedLinear(
            latent, hidden, bias=False, prefix=f"{prefix}.routed_expert_up_proj"
        )
        local_inner = inner // tp_size
        self.on_vllm_layer = backend == "auto"
        if redundant_experts is not None and not self.on_vllm_layer:
            raise ValueError(
                f"{prefix}: --enable-eplb balances the routed experts of vLLM's "
                f"FusedMoE (VLLM_K3_MOE=auto), not the {backend} path "
                f"({moe_setting()}) on {current_platform.device_type}"
            )
        self.graph_blocker = None
        if self.on_vllm_layer:
            self.use_kernels = False
            self.experts = fused_routed_experts(
                config,
                prefix=f"{prefix}.experts",
                quant_config=get_current_vllm_config().quant_config,
                router_bias=self.gate.e_score_correction_bias,
                redundant_experts=redundant_experts,
            )
        else:
            self._own_experts(prefix, backend, local_inner, latent, config.num_experts)
        self.shared_experts = SituMlp(
            hidden,
            inner * config.num_shared_experts,
            self.betas,
            f"{prefix}.shared_experts",
        )

    def _own_experts(self, prefix, backend, local_inner, latent, num_experts):
        """The experts of the ``triton`` and ``torch`` paths."""
        blocker = (
            kernel_path_blocker(local_inner, latent)
            if backend == "triton"
            else moe_setting()
        )
        if blocker is not None and not current_platform.is_cpu():
            raise ValueError(
                f"{prefix}: the routed experts' PyTorch path ({blocker}) decodes the "
                "MXFP4 experts to the model dtype, which the real model cannot "
                f"afford on this platform ({current_platform.device_type}); use "
                "VLLM_K3_MOE=auto (vLLM's FusedMoE)"
                + ("" if backend == "triton" else " or triton")
            )
        if blocker is not None:
            log_path("Latent MoE", blocker)
        self.use_kernels = blocker is None
        if self.use_kernels:
            self.experts = StackedMxfp4Experts(num_experts, latent, local_inner)
        else:
            # The PyTorch path groups tokens by expert on the host
            # (``ref.routed_experts`` reads the ids back): no CUDA graph holds it.
            self.graph_blocker = (
                f"the routed experts take the PyTorch path ({blocker}), which reads "
                "the expert ids back to the host"
                + ("" if backend == "triton" else ", unlike VLLM_K3_MOE=auto or triton")
            )
            dtype = torch.get_default_dtype()
            self.experts = nn.ModuleList(
                RoutedExpert(latent, local_inner, dtype) for _ in range(num_experts)
            )

    def load_expert(self, expert: int, proj: str, packed, scale) -> list[str]:
        """Load one expert projection (``w1``/``w3``/``w2``) from its MXFP4 pair;
        returns the parameter names (relative to this layer) it wrote."""
        if self.on_vllm_layer:
            return load_fused_expert(
                self.experts, "experts", expert, proj, packed, scale
            )
        if self.use_kernels:
            return [
                f"experts.{name}"
                for name in self.experts.load(expert, proj, packed, scale)
            ]
        param = getattr(self.experts[expert], proj).weight
        param.weight_loader(param, ref.mxfp4_decode(packed, scale))
        return [f"experts.{expert}.{proj}.weight"]

    def routed_experts(self, z, ids, weights) -> torch.Tensor:
        """``Σ_k w_k · expert_k(z)`` in fp32 (this rank's partial sum under TP)."""
        if self.use_kernels:
            return latent_moe(
                z,
                ids,
                weights,
                self.experts.weights(),
                fp8_dtype=current_platform.fp8_dtype(),
                **self.betas,
            )

        def expert(e: int):
            module = self.experts[e]
            return module.w1.weight, module.w3.weight, module.w2.weight

        return ref.routed_experts(z, ids, weights, expert, **self.betas)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.gate.weight.T
        z = self.routed_expert_down_proj(x)[0]
        if self.on_vllm_layer:
            # vLLM's layer routes and reduces over the ranks itself.
            routed = self.experts(z, logits)
        else:
            weights, ids = ref.route(
                logits,
                self.gate.e_score_correction_bias,
                self.top_k,
                renormalize=self.renormalize,
                scaling_factor=self.scaling,
            )
            routed = self.routed_experts(z, ids, weights)
            if self.tp_size > 1:
                routed = tensor_model_parallel_all_reduce(routed)
        routed = self.routed_expert_up_proj(
            self.routed_expert_norm(routed.to(x.dtype))
        )[0]
        return routed + self.shared_experts(x)
