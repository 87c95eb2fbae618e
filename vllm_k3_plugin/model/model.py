"""The Kimi-K3 text model as a vLLM model class, and the published checkpoint's wrapper.

- ``KimiK3ForCausalLM``: the text model (a ``kimi_linear`` config). Module names are
  the checkpoint's (``model.layers.{i}.self_attn.q_proj`` ...).
- ``KimiK3ForConditionalGeneration``: the published checkpoint (a ``kimi_k3`` config
  wrapping the text config): the text model under ``language_model.``; the vision
  tower and projector weights are recognised and skipped with one log line.

The layer stack has no additive residual stream: attention residuals keep a bank of
block vectors and a partial sum (``reference.attn_res_layers``, the single statement
of that bookkeeping). KDA layers keep mamba-style state in vLLM's hybrid cache, MLA
layers a paged latent cache.

Pipeline parallelism (``SupportsPP``): each stage builds its own layers (vLLM's
``make_layers``); a stage boundary carries the bank, stacked ``[T, blocks, D]`` as
``residual``, and the partial sum as ``hidden_states`` (the intermediate tensors
vLLM's in-tree K3 sends). The embedding lives on the first stage; the final mix, norm
and LM head on the last. Tensor parallelism goes through vLLM's parallel layers.

The checkpoint's tensors load through ``loader.py``; what the class checks and logs
as vLLM builds it is ``build_checks.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateCopyFuncCalculator,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.interfaces import (
    HasInnerState,
    IsHybrid,
    MixtureOfExperts,
    SupportsPP,
)
from vllm.model_executor.models.utils import (
    PPMissingLayer,
    is_pp_missing_parameter,
    make_layers,
)
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from vllm_k3_plugin.model import cpu_pipeline
from vllm_k3_plugin.model.build_checks import (
    check_cuda_graphs,
    note_quantization,
    report_class,
    sparse_attention,
)
from vllm_k3_plugin.model.dsa import topk_slot_buffer
from vllm_k3_plugin.model.dsa_vllm import (
    model_topk_buffer,
    vllm_indexer_class,
)
from vllm_k3_plugin.model.expert_balance import (
    FromLanguageModel,
    K3MixtureOfExperts,
    redundant_experts,
)
from vllm_k3_plugin.model.kda import KdaAttention
from vllm_k3_plugin.model.kda_cache import kda_state_dtypes, kda_state_shapes
from vllm_k3_plugin.model.kernel_choice import moe_backend
from vllm_k3_plugin.model.loader import load_k3_tensors
from vllm_k3_plugin.model.logs import logger
from vllm_k3_plugin.model.mla import GatedMlaAttention
from vllm_k3_plugin.model.moe import LatentMoe, SituMlp
from vllm_k3_plugin.model.one_class import announce, check_peers
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import (
    LANGUAGE_MODEL_PREFIX,
    attn_res_site,
    dense_weight_shapes,
    expert_weight_shapes,
    is_kda_layer,
    mtp_layers,
    situ_betas,
)

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


class ResidualProjection(nn.Module):
    """``*_res_proj.weight`` ``[1, hidden]``: the query of an attention-residual mix."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden), requires_grad=False)


class DecoderLayer(nn.Module):
    """``model.layers.{i}``: KDA or MLA, then the dense MLP or the latent MoE, each
    behind its norm; with ``attention_residuals`` (every layer of the text model,
    not an MTP draft layer's block) the norms and queries of the two mixes. With
    ``load_balanced`` (not in a draft layer) the MoE's experts are balanced if vLLM
    balances experts (``--enable-eplb``). An MLA layer that ``dsa`` lists is sparse,
    its indexer writing the model's ``topk_slots``."""

    def __init__(
        self,
        config,
        vllm_config: VllmConfig,
        layer: int,
        prefix: str,
        *,
        attention_residuals: bool = True,
        load_balanced: bool = True,
        dsa: dict[str, Any] | None = None,
        topk_slots: torch.Tensor | None = None,
    ):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        if is_kda_layer(config.to_dict(), layer):
            self.self_attn = KdaAttention(config, vllm_config, f"{prefix}.self_attn")
        else:
            sparse = dsa is not None and layer + 1 in dsa["dsa_layers"]
            self.self_attn = GatedMlaAttention(
                config,
                vllm_config.cache_config,
                f"{prefix}.self_attn",
                dsa=dsa if sparse else None,
                topk_slots=topk_slots if sparse else None,
            )
        if layer < config.first_k_dense_replace:
            self.mlp = SituMlp(
                hidden,
                config.intermediate_size,
                situ_betas(config.to_dict()),
                f"{prefix}.mlp",
            )
        else:
            self.block_sparse_moe = LatentMoe(
                config,
                f"{prefix}.block_sparse_moe",
                backend=moe_backend(),
                redundant_experts=(
                    redundant_experts(vllm_config) if load_balanced else None
                ),
            )
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        if attention_residuals:
            self.self_attention_res_norm = RMSNorm(hidden, eps=eps)
            self.mlp_res_norm = RMSNorm(hidden, eps=eps)
            self.self_attention_res_proj = ResidualProjection(hidden)
            self.mlp_res_proj = ResidualProjection(hidden)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x))

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(x)
        if hasattr(self, "mlp"):
            return self.mlp(x)
        return self.block_sparse_moe(x)


class K3Model(nn.Module):
    """``model.*``: embeddings, this stage's layers, the final mix; the final norm
    (applied by ``KimiK3ForCausalLM.compute_logits``)."""

    def __init__(
        self,
        *,
        vllm_config: VllmConfig,
        config,
        dsa: dict[str, Any] | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        pp = get_pp_group()
        topk_slots = None
        if dsa is not None and current_platform.is_cpu():
            topk_slots = topk_slot_buffer(dsa["index_topk"])
        elif dsa is not None:
            topk_slots = model_topk_buffer(vllm_config, dsa["index_topk"])
        if pp.is_first_rank:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, hidden, prefix=f"{prefix}.embed_tokens"
            )
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: DecoderLayer(
                config,
                vllm_config,
                int(prefix.rpartition(".")[2]),
                prefix,
                dsa=dsa,
                topk_slots=topk_slots,
            ),
            prefix=f"{prefix}.layers",
        )
        if pp.is_last_rank:
            self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
            self.output_attn_res_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
            self.output_attn_res_proj = ResidualProjection(hidden)
        else:
            self.norm = PPMissingLayer()
            self.output_attn_res_norm = PPMissingLayer()
            self.output_attn_res_proj = PPMissingLayer()

    def fused_moe_runners(self) -> list:
        """This stage's routed experts on vLLM's ``FusedMoE``, layer by layer."""
        return [
            layer.block_sparse_moe.experts
            for layer in self.layers[self.start_layer : self.end_layer]
            if hasattr(layer, "block_sparse_moe")
            and layer.block_sparse_moe.on_vllm_layer
        ]

    def mix(self, site, sources: list[torch.Tensor]) -> torch.Tensor:
        norm, proj = (self.get_submodule(name) for name in attn_res_site(site))
        return ref.attn_res_mix(
            sources, norm.weight, proj.weight, norm.variance_epsilon
        )

    def forward(
        self,
        embeddings: torch.Tensor | None,
        intermediate_tensors: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        pp = get_pp_group()
        if pp.is_first_rank:
            carry = ref.AttnResCarry([], embeddings)
        else:
            carry = ref.AttnResCarry(
                list(intermediate_tensors["residual"].unbind(1)),
                intermediate_tensors["hidden_states"],
            )
        carry = ref.attn_res_layers(
            carry,
            range(self.start_layer, self.end_layer),
            self.config.attn_res_block_size,
            attn=lambda layer, x: self.layers[layer].attention(x),
            mlp=lambda layer, x: self.layers[layer].feed_forward(x),
            mix=self.mix,
        )
        if not pp.is_last_rank:
            return IntermediateTensors(
                {
                    "hidden_states": carry.partial,
                    "residual": torch.stack(carry.bank, dim=1),
                }
            )
        # Before the final norm (``KimiK3ForCausalLM.compute_logits`` applies it):
        # an MTP drafter takes these hidden states, as vLLM's in-tree K3 gives them.
        return self.mix("final", [*carry.bank, carry.partial])

    def make_empty_intermediate_tensors(
        self, batch_size: int, dtype: torch.dtype, device: torch.device
    ) -> IntermediateTensors:
        """The buffers this stage receives into: the partial sum and the block
        vectors stored before its first layer."""
        hidden = self.config.hidden_size
        blocks = ref.blocks_before(self.start_layer, self.config.attn_res_block_size)
        return IntermediateTensors(
            {
                "hidden_states": torch.zeros(
                    batch_size, hidden, dtype=dtype, device=device
                ),
                "residual": torch.zeros(
                    batch_size, blocks, hidden, dtype=dtype, device=device
                ),
            }
        )


class KimiK3ForCausalLM(
    nn.Module, HasInnerState, IsHybrid, SupportsPP, K3MixtureOfExperts
):
    """The K3 text model (``kimi_linear`` config)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        dsa = sparse_attention(
            config,
            on_cpu=current_platform.is_cpu(),
            vllm_layers=vllm_indexer_class() is not None,
        )
        self.config = config
        self.model = K3Model(
            vllm_config=vllm_config,
            config=config,
            dsa=dsa,
            prefix=_join(prefix, "model"),
        )
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size, config.hidden_size, prefix=_join(prefix, "lm_head")
            )
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = (
            self.model.make_empty_intermediate_tensors
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        if not prefix:
            report_class(self, config)
            announce(self, vllm_config)
        if current_platform.is_cpu() and get_pp_group().world_size > 1:
            cpu_pipeline.install()
        note_quantization(vllm_config)
        check_cuda_graphs(vllm_config, self, on_gpu=current_platform.is_cuda_alike())
        self._count_experts(config, self.model.fused_moe_runners())
        if redundant_experts(vllm_config) is not None and not self.num_moe_layers:
            # vLLM's EPLB steps every stage and fails on one without MoE layers.
            raise ValueError(
                f"--enable-eplb: this pipeline stage (layers {self.model.start_layer}"
                f" to {self.model.end_layer - 1}) holds no MoE layer, and vLLM's "
                "expert load balancing needs one on every stage; split the layers "
                "otherwise or leave EPLB off"
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank and inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.model(inputs_embeds, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, self.model.norm(hidden_states))

    # -- hybrid cache -----------------------------------------------------------------

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return kda_state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        text = vllm_config.model_config.hf_text_config
        return kda_state_shapes(
            text.linear_attn_config,
            vllm_config.parallel_config.tensor_parallel_size,
            vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.kda_state_copy_func()

    # -- weights ----------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the text model's tensors (names without ``language_model.``); the
        MTP draft layers' are left to the drafter (``mtp.KimiK3Mtp``)."""
        text = self.config.to_dict()
        dense = dense_weight_shapes(text)
        experts = expert_weight_shapes(text)
        drafter = tuple(f"model.layers.{layer}." for layer in mtp_layers(text))
        # Tensors of layers and heads another pipeline stage holds.
        elsewhere = {
            name for name in (*dense, *experts) if is_pp_missing_parameter(name, self)
        }
        kept = ((name, t) for name, t in weights if not name.startswith(drafter))
        loaded = load_k3_tensors(self, kept, dense, experts, elsewhere=elsewhere)
        check_peers(self)
        return loaded


class KimiK3ForConditionalGeneration(
    nn.Module, HasInnerState, IsHybrid, SupportsPP, MixtureOfExperts
):
    """The published checkpoint: ``kimi_k3`` config, text model under
    ``language_model.``. Only the text path is served; vision inputs are not
    accepted and the vision weights are skipped."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.language_model = KimiK3ForCausalLM(
            vllm_config=vllm_config, prefix=_join(prefix, "language_model")
        )
        if not prefix:
            report_class(self, self.language_model.config)
            announce(self, vllm_config)
        self.make_empty_intermediate_tensors = (
            self.language_model.make_empty_intermediate_tensors
        )
        self.expert_weights = []

    # vLLM's drafters read a text-only target's embedding and LM head as
    # ``target.model.embed_tokens`` and ``target.lm_head``.
    @property
    def model(self) -> K3Model:
        return self.language_model.model

    @property
    def lm_head(self) -> nn.Module:
        return self.language_model.lm_head

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    # vLLM's EPLB takes this wrapper for the MixtureOfExperts (it unwraps only a
    # SupportsMultiModal model): the text model's MoE counts, read through.
    moe_layers = FromLanguageModel()
    num_moe_layers = FromLanguageModel()
    num_expert_groups = FromLanguageModel()
    num_logical_experts = FromLanguageModel()
    num_physical_experts = FromLanguageModel()
    num_local_physical_experts = FromLanguageModel()
    num_routed_experts = FromLanguageModel()
    num_shared_experts = FromLanguageModel()
    num_redundant_experts = FromLanguageModel()

    def update_physical_experts_metadata(
        self, num_physical_experts: int, num_local_physical_experts: int
    ) -> None:
        self.language_model.update_physical_experts_metadata(
            num_physical_experts, num_local_physical_experts
        )

    def forward(self, input_ids, positions, intermediate_tensors=None, **kwargs):
        return self.language_model(input_ids, positions, intermediate_tensors, **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden_states)

    get_mamba_state_dtype_from_config = (
        KimiK3ForCausalLM.get_mamba_state_dtype_from_config
    )
    get_mamba_state_shape_from_config = (
        KimiK3ForCausalLM.get_mamba_state_shape_from_config
    )
    get_mamba_state_copy_func = KimiK3ForCausalLM.get_mamba_state_copy_func

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skipped = 0

        def text_weights():
            nonlocal skipped
            for name, tensor in weights:
                if name.startswith(VISION_PREFIXES):
                    skipped += 1
                    continue
                yield name.removeprefix(LANGUAGE_MODEL_PREFIX), tensor

        loaded = self.language_model.load_weights(text_weights())
        check_peers(self)
        if skipped:
            logger.info(
                "Kimi-K3: skipped %d vision tower / projector tensor(s); this model "
                "class serves the text path only",
                skipped,
            )
        return {LANGUAGE_MODEL_PREFIX + name for name in loaded}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
