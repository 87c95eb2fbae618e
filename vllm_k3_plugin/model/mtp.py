"""Kimi-K3's multi-token-prediction (MTP) draft layers as vLLM's drafter model,
registered as ``KimiK3MTPModel`` (the architecture vLLM's speculative config gives a
``kimi_k3`` checkpoint for ``--speculative-config '{"method": "mtp", ...}'``).

Draft layer ``i`` (``model.layers.{num_hidden_layers + i}``, as vLLM's in-tree
``KimiK3MTP`` reads the checkpoint) takes a token's embedding (zero at position 0)
and the hidden state the target gave the token before it, normalizes each
(``enorm``, ``hnorm``), projects the pair back to the hidden size (``eh_proj``) and
runs one decoder block without attention residuals (MLA and the latent MoE, each
added to its input). It returns the block's output normalized for the shared head
(``shared_head.norm``, then ``shared_head.head`` in ``compute_logits``) and
unnormalized, the hidden state of its next draft step. The target's forward returns
its hidden states before the final norm, as the in-tree class does.

vLLM's proposer gives an MTP drafter the target's embedding and LM head without
pipeline parallelism (it replaces ``model.embed_tokens`` and every
``shared_head.head``), as for the in-tree class; the drafter loads the copies the
checkpoint carries, or the target's tensors, so that it holds them either way.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.platforms import current_platform

from vllm_k3_plugin.model.build_checks import check_cuda_graphs
from vllm_k3_plugin.model.loader import load_k3_tensors
from vllm_k3_plugin.model.logs import logger
from vllm_k3_plugin.model.model import DecoderLayer
from vllm_k3_plugin.reference.checkpoint_format import (
    LANGUAGE_MODEL_PREFIX,
    MTP_EMBEDDING,
    MTP_HEAD,
    expert_weight_shapes,
    is_kda_layer,
    mtp_layers,
    mtp_weight_shapes,
)


class SharedHead(nn.Module):
    """``shared_head``: the draft layer's final norm and LM head."""

    def __init__(self, config, prefix: str) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.head = ParallelLMHead(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.head"
        )


class MtpLayer(DecoderLayer):
    """``model.layers.{i}`` of a draft layer: the decoder block's modules under
    their checkpoint names, and ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head``."""

    def __init__(self, config, vllm_config: VllmConfig, layer: int, prefix: str):
        if is_kda_layer(config.to_dict(), layer):
            raise ValueError(
                f"{prefix}: the config lists MTP draft layer {layer + 1} as a KDA "
                "layer; vLLM's Kimi-K3 MTP drafts with MLA layers only"
            )
        super().__init__(
            config,
            vllm_config,
            layer,
            prefix,
            attention_residuals=False,
            load_balanced=False,
        )
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        self.eh_proj = ReplicatedLinear(
            2 * hidden, hidden, bias=False, prefix=f"{prefix}.eh_proj"
        )
        self.shared_head = SharedHead(config, f"{prefix}.shared_head")

    def forward(
        self,
        positions: torch.Tensor,
        embeddings: torch.Tensor,
        previous: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = torch.where((positions == 0)[:, None], 0.0, embeddings)
        joined = torch.cat([self.enorm(embeddings), self.hnorm(previous)], dim=-1)
        x = self.eh_proj(joined)[0]
        x = x + self.attention(x)
        x = x + self.feed_forward(x)
        return self.shared_head.norm(x), x


class MtpPredictor(nn.Module):
    """``model.*`` of the drafter: the embedding and the draft layers by index."""

    def __init__(self, *, vllm_config: VllmConfig, config, prefix: str) -> None:
        super().__init__()
        self.layer_indices = mtp_layers(config.to_dict())
        if not self.layer_indices:
            raise ValueError(
                "Kimi-K3 MTP drafting needs the checkpoint's draft layers, and its "
                "text config sets no num_nextn_predict_layers"
            )
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens"
        )
        self.layers = nn.ModuleDict(
            {
                str(i): MtpLayer(config, vllm_config, i, f"{prefix}.layers.{i}")
                for i in self.layer_indices
            }
        )

    def layer(self, spec_step_idx: int) -> MtpLayer:
        """Draft step ``spec_step_idx``'s layer (the layers in turn)."""
        indices = self.layer_indices
        return self.layers[str(indices[spec_step_idx % len(indices)])]


class KimiK3Mtp(nn.Module):
    """vLLM's drafter interface: ``forward`` returns ``(hidden states normalized for
    the head, hidden states for the next draft step)`` (vLLM's proposer reads a
    tuple from ``KimiK3MTPModel``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = MtpPredictor(
            vllm_config=vllm_config,
            config=config,
            prefix=f"{prefix}.model" if prefix else "model",
        )
        self.logits_processor = LogitsProcessor(config.vocab_size)
        logger.info(
            "Kimi-K3 MTP drafter %s.%s: draft layer(s) %s",
            type(self).__module__,
            type(self).__qualname__,
            list(self.model.layer_indices),
        )
        # vLLM captures the drafter in the target's graph forms.
        check_cuda_graphs(vllm_config, self, on_gpu=current_platform.is_cuda_alike())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        spec_step_idx: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        layer = self.model.layer(spec_step_idx)
        return layer(positions, inputs_embeds, hidden_states)

    def compute_logits(
        self, hidden_states: torch.Tensor, spec_step_idx: int = 0
    ) -> torch.Tensor | None:
        head = self.model.layer(spec_step_idx).shared_head.head
        return self.logits_processor(head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The draft layers' tensors (the published checkpoint's names, with or
        without ``language_model.``). The embedding (the first draft layer's copy)
        and each draft layer's LM head (its ``shared_head.head``) come from the
        layer's copies, or from the target's own tensors where the checkpoint has
        no copy: vLLM replaces both with the target's modules only without
        pipeline parallelism. The target's other tensors are skipped."""
        text = self.config.to_dict()
        layers = mtp_layers(text)
        drafts = tuple(f"model.layers.{i}." for i in layers)
        vocab = (text["vocab_size"], text["hidden_size"])
        embedding = "model.embed_tokens.weight"
        heads = [f"model.layers.{i}.{MTP_HEAD}" for i in layers]
        dense = {**mtp_weight_shapes(text), **dict.fromkeys([embedding, *heads], vocab)}
        # Per parameter: the draft layer's copy, else the target's tensor.
        sources = {
            embedding: (f"model.layers.{layers[0]}.{MTP_EMBEDDING}", embedding),
            **{head: (head, "lm_head.weight") for head in heads},
        }
        wanted = {name for pair in sources.values() for name in pair}

        def draft_weights():
            found = {}
            for name, tensor in weights:
                name = name.removeprefix(LANGUAGE_MODEL_PREFIX)
                if name in wanted:
                    found[name] = tensor
                elif name.startswith(drafts) and not name.endswith(MTP_EMBEDDING):
                    yield name, tensor
            for param, (copy, target) in sources.items():
                tensor = found.get(copy, found.get(target))
                if tensor is not None:
                    yield param, tensor

        return load_k3_tensors(
            self, draft_weights(), dense, expert_weight_shapes(text, layers)
        )
