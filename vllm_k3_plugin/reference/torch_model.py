"""The Kimi-K3 text model in plain PyTorch, one sequence at a time, with its state.

Module and parameter names are the checkpoint's (without ``language_model.``), so a
checkpoint loads by name; the routed experts keep their MXFP4 tensors and are decoded
on load. The per-sequence state (``SequenceState``) holds what vLLM's hybrid cache will
hold: each KDA layer's conv taps and recurrent matrix, each MLA layer's 576-wide (here
``kv_lora_rank + qk_rope_head_dim``) latent per token.

This is the reference the vLLM model class is checked against; it favours clarity
over speed (no batching, no paging).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import (
    MXFP4_SUFFIXES,
    Mxfp4Halves,
    WeightShapeError,
    attn_res_site,
    dsa_settings,
    gate_lower_bound,
    is_dsa_layer,
    situ_betas,
)
from vllm_k3_plugin.reference.dsa import (
    causal_topk,
    index_scores,
    selection_margin,
)


@dataclass
class SequenceState:
    """One sequence's cache: per KDA layer ``(conv state, recurrent state)`` and per
    MLA layer the latent of every token so far."""

    kda: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = field(
        default_factory=dict
    )
    mla: dict[int, torch.Tensor] = field(default_factory=dict)
    index_keys: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per DSA layer, the indexer key of every token so far (K3.1)."""
    selection_margins: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per DSA layer, each token's ``dsa.selection_margin`` so far: where it is
    near zero, another order of summation may select otherwise."""
    length: int = 0


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ref.rms_norm(x, self.weight, self.eps)


def _linear(inputs: int, outputs: int) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=False)


class SituMlp(nn.Module):
    def __init__(self, hidden: int, inner: int, betas: dict[str, float]) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inner)
        self.up_proj = _linear(hidden, inner)
        self.down_proj = _linear(inner, hidden)
        self.betas = betas

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(
            ref.situ_glu(self.gate_proj(x), self.up_proj(x), **self.betas)
        )


class KdaAttention(nn.Module):
    """Kimi Delta Attention: short convs, normalized q/k, bounded decay, delta rule,
    gated output norm."""

    def __init__(self, config: dict[str, Any], layer: int) -> None:
        super().__init__()
        kda = config["linear_attn_config"]
        hidden = config["hidden_size"]
        self.layer = layer
        self.heads, self.head_dim = kda["num_heads"], kda["head_dim"]
        self.lower_bound = gate_lower_bound(kda, f"layer {layer}")
        width = self.heads * self.head_dim
        conv = kda["short_conv_kernel_size"]
        for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
            setattr(self, name, _linear(hidden, width))
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            setattr(self, name, nn.Conv1d(width, width, conv, groups=width, bias=False))
        self.b_proj = _linear(hidden, self.heads)
        self.f_a_proj = _linear(hidden, self.head_dim)
        self.f_b_proj = _linear(self.head_dim, width)
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.o_norm = RMSNorm(self.head_dim, config["rms_norm_eps"])
        self.o_proj = _linear(width, hidden)

    def forward(self, x: torch.Tensor, state: SequenceState) -> torch.Tensor:
        tokens = x.shape[0]
        conv_states, recurrent = state.kda.get(self.layer, (None, None))
        conv_states = conv_states or (None, None, None)
        shaped = (tokens, self.heads, self.head_dim)
        q, k, v, new_conv = [], [], [], []
        for proj, conv, previous, out in (
            (self.q_proj, self.q_conv1d, conv_states[0], q),
            (self.k_proj, self.k_conv1d, conv_states[1], k),
            (self.v_proj, self.v_conv1d, conv_states[2], v),
        ):
            y, taps = ref.causal_conv_silu(
                proj(x).float(), conv.weight.float(), previous
            )
            out.append(y.reshape(shaped))
            new_conv.append(taps)
        q_hat = ref.l2_normalize(q[0]) / self.head_dim**0.5
        k_hat = ref.l2_normalize(k[0])
        u = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        g = ref.kda_gate(u.reshape(shaped), self.A_log, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        o, recurrent = ref.kda_recurrence(q_hat, k_hat, v[0], g, beta, recurrent)
        state.kda[self.layer] = (tuple(new_conv), recurrent)
        gate = torch.sigmoid(self.g_proj(x).float()).reshape(shaped)
        o = ref.rms_norm(o, self.o_norm.weight, self.o_norm.eps) * gate
        return self.o_proj(o.reshape(tokens, -1).to(x.dtype))


class LayerNormK(nn.Module):
    """The bias-full fp32 LayerNorm of the indexer key (``index_k_norm_type``
    ``layernorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        )


class Indexer(nn.Module):
    """``self_attn.indexer.*`` of a K3.1 MLA layer, names as in the checkpoint."""

    def __init__(self, config: dict[str, Any], dsa: dict[str, Any]) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.heads, self.dim = dsa["index_num_heads"], dsa["index_head_dim"]
        self.topk = dsa["index_topk"]
        self.wq_b = _linear(config["q_lora_rank"], self.heads * self.dim)
        self.wk = _linear(hidden, self.dim)
        self.weights_proj = _linear(hidden, self.heads)
        norm = LayerNormK if dsa["index_k_norm_type"] == "layernorm" else RMSNorm
        self.k_norm = norm(self.dim, eps)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """The keys of new positions, to cache (``[T, D]``, fp32)."""
        return self.k_norm(self.wk(x)).float()

    def scores(
        self, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """The ``[T, S]`` scores of the new queries against every cached key
        (``keys``, ``[S, D]``, the new ones last)."""
        tokens = x.shape[0]
        index_q = self.wq_b(q_latent).reshape(tokens, self.heads, self.dim)
        return index_scores(index_q, keys, self.weights_proj(x))


class GatedMla(nn.Module):
    """Multi-head latent attention without positions, with a sigmoid output gate;
    on a K3.1 DSA layer, each query attends to the positions its indexer picks."""

    def __init__(self, config: dict[str, Any], layer: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.layer = layer
        self.heads = config["num_attention_heads"]
        self.nope, self.rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.v_dim, self.kv_rank = config["v_head_dim"], config["kv_lora_rank"]
        self.q_a_proj = _linear(hidden, config["q_lora_rank"])
        self.q_a_layernorm = RMSNorm(config["q_lora_rank"], eps)
        self.q_b_proj = _linear(
            config["q_lora_rank"], self.heads * (self.nope + self.rope)
        )
        self.kv_a_proj_with_mqa = _linear(hidden, self.kv_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, eps)
        self.kv_b_proj = _linear(self.kv_rank, self.heads * (self.nope + self.v_dim))
        self.g_proj = _linear(hidden, self.heads * self.v_dim)
        self.o_proj = _linear(self.heads * self.v_dim, hidden)
        if is_dsa_layer(config, layer):
            self.indexer = Indexer(config, dsa_settings(config))

    def forward(self, x: torch.Tensor, state: SequenceState) -> torch.Tensor:
        tokens = x.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent)
        q = q.float().reshape(tokens, self.heads, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa(x).float()
        c_kv = ref.rms_norm(
            latent[:, : self.kv_rank],
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
        )
        new = torch.cat([c_kv, latent[:, self.kv_rank :]], dim=-1)
        previous = state.mla.get(self.layer)
        cache = new if previous is None else torch.cat([previous, new])
        state.mla[self.layer] = cache
        kv = (cache[:, : self.kv_rank] @ self.kv_b_proj.weight.float().T).reshape(
            cache.shape[0], self.heads, self.nope + self.v_dim
        )
        k = torch.cat(
            [
                kv[..., : self.nope],
                cache[:, None, self.kv_rank :].expand(-1, self.heads, -1),
            ],
            dim=-1,
        )
        v = kv[..., self.nope :]
        scores = torch.einsum("thd,shd->hts", q, k) * (self.nope + self.rope) ** -0.5
        past = cache.shape[0] - tokens
        if hasattr(self, "indexer"):
            keys = self.indexer.keys(x)
            previous_keys = state.index_keys.get(self.layer)
            if previous_keys is not None:
                keys = torch.cat([previous_keys, keys])
            state.index_keys[self.layer] = keys
            scores_k = self.indexer.scores(x, q_latent, keys)
            allowed = causal_topk(scores_k, past, self.indexer.topk)
            margins = selection_margin(scores_k, past, self.indexer.topk)
            before = state.selection_margins.get(self.layer)
            state.selection_margins[self.layer] = (
                margins if before is None else torch.cat([before, margins])
            )
        else:
            allowed = ref.causal_mask(tokens, cache.shape[0], past)
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v)
        gate = torch.sigmoid(self.g_proj(x).float()).reshape(
            tokens, self.heads, self.v_dim
        )
        return self.o_proj((o * gate).reshape(tokens, -1).to(x.dtype))


class MxfpExpert(nn.Module):
    """One routed expert; its projections arrive MXFP4-packed and are decoded."""

    def __init__(self, latent: int, inner: int) -> None:
        super().__init__()
        self.w1 = _linear(latent, inner)
        self.w3 = _linear(latent, inner)
        self.w2 = _linear(inner, latent)


class LatentMoe(nn.Module):
    def __init__(self, config: dict[str, Any], betas: dict[str, float]) -> None:
        super().__init__()
        hidden, latent = config["hidden_size"], config["routed_expert_hidden_size"]
        inner = config["moe_intermediate_size"]
        experts = config["num_experts"]
        self.top_k = config["num_experts_per_token"]
        self.renormalize = config["moe_renormalize"]
        self.scaling = config["routed_scaling_factor"]
        self.betas = betas
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(experts))
        self.routed_expert_down_proj = _linear(hidden, latent)
        self.routed_expert_norm = RMSNorm(latent, config["rms_norm_eps"])
        self.routed_expert_up_proj = _linear(latent, hidden)
        self.experts = nn.ModuleList(MxfpExpert(latent, inner) for _ in range(experts))
        self.shared_experts = SituMlp(
            hidden, inner * config["num_shared_experts"], betas
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.gate.weight.float().T
        weights, ids = ref.route(
            logits,
            self.gate.e_score_correction_bias,
            self.top_k,
            renormalize=self.renormalize,
            scaling_factor=self.scaling,
        )
        z = self.routed_expert_down_proj(x).float()

        def expert(e: int):
            module = self.experts[e]
            return (
                module.w1.weight.float(),
                module.w3.weight.float(),
                module.w2.weight.float(),
            )

        routed = ref.routed_experts(z, ids, weights, expert, **self.betas)
        routed = self.routed_expert_up_proj(
            ref.rms_norm(
                routed, self.routed_expert_norm.weight, self.routed_expert_norm.eps
            ).to(x.dtype)
        )
        return routed + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any], layer: int) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        betas = situ_betas(config)
        kda = layer + 1 in config["linear_attn_config"]["kda_layers"]
        self.self_attn = KdaAttention(config, layer) if kda else GatedMla(config, layer)
        if layer < config["first_k_dense_replace"]:
            self.mlp = SituMlp(hidden, config["intermediate_size"], betas)
        else:
            self.block_sparse_moe = LatentMoe(config, betas)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attention_res_norm",
            "mlp_res_norm",
        ):
            setattr(self, norm, RMSNorm(hidden, eps))
        self.self_attention_res_proj = _linear(hidden, 1)
        self.mlp_res_proj = _linear(hidden, 1)
        self.eps = eps

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "mlp"):
            return self.mlp(x)
        return self.block_sparse_moe(x)


class K3TextModel(nn.Module):
    """``model.*`` and ``lm_head`` of the checkpoint."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config["vocab_size"], hidden)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config["num_hidden_layers"])
        )
        self.model.norm = RMSNorm(hidden, eps)
        self.model.output_attn_res_norm = RMSNorm(hidden, eps)
        self.model.output_attn_res_proj = _linear(hidden, 1)
        self.lm_head = _linear(hidden, config["vocab_size"])

    def _mix(self, site, sources):
        norm, proj = (self.model.get_submodule(name) for name in attn_res_site(site))
        return ref.attn_res_mix(sources, norm.weight, proj.weight, norm.eps)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """Logits of ``ids`` (the sequence's next tokens), carrying ``state``."""
        layers = self.model.layers

        def attn(layer, x):
            return layers[layer].self_attn(layers[layer].input_layernorm(x), state)

        def mlp(layer, x):
            return layers[layer].feed_forward(layers[layer].post_attention_layernorm(x))

        hidden = ref.attn_res_forward(
            self.model.embed_tokens(ids),
            len(layers),
            self.config["attn_res_block_size"],
            attn=attn,
            mlp=mlp,
            mix=self._mix,
        )
        state.length += ids.shape[0]
        return self.lm_head(self.model.norm(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by name; returns the names loaded. MXFP4 pairs are
        decoded; a shape mismatch is an error naming the tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        halves = Mxfp4Halves()
        for name, tensor in weights:
            name = name.removeprefix("language_model.")
            if name.endswith(MXFP4_SUFFIXES):
                pair = halves.add(name, tensor)
                if pair is None:
                    continue
                stem, packed, scale = pair
                tensor = ref.mxfp4_decode(packed, scale)
                name = stem + ".weight"
            target = params.get(name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightShapeError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects "
                    f"{tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            loaded.add(name)
        return loaded
