"""The K3 text checkpoint's tensors: every name and its full (unsharded) shape, read
from the text config. The tiny checkpoint writer, the PyTorch reference model and the
vLLM model class's loader all take the format from here.

Names are the text model's (``model.layers.{i}...``, ``lm_head.weight``); the published
checkpoint prefixes them with ``language_model.``.
"""

from __future__ import annotations

from typing import Any

LANGUAGE_MODEL_PREFIX = "language_model."
# The published checkpoints' wrapper configs: ``model_type`` and architecture.
K3_WRAPPER = ("kimi_k3", "KimiK3ForConditionalGeneration")
K31_WRAPPER = ("kimi_k31", "KimiK31ForConditionalGeneration")
MXFP4_SUFFIXES = (".weight_packed", ".weight_scale")
# SiTU-GLU's arguments and the text config keys that hold them.
SITU_BETAS = {
    "beta": "activation_situ_beta",
    "linear_beta": "activation_situ_linear_beta",
}


def situ_betas(text: dict[str, Any]) -> dict[str, float]:
    """SiTU-GLU's betas from the text config, as ``situ_glu`` takes them."""
    return {arg: text[key] for arg, key in SITU_BETAS.items()}


def attn_res_site(site) -> tuple[str, str]:
    """The norm and projection (module names under ``model.``) that mix the block
    vectors at ``site``: ``(layer, "attn")``, ``(layer, "mlp")`` or ``"final"``."""
    if site == "final":
        return "output_attn_res_norm", "output_attn_res_proj"
    layer, kind = site
    stem = f"layers.{layer}." + ("self_attention_res" if kind == "attn" else "mlp_res")
    return f"{stem}_norm", f"{stem}_proj"


class Mxfp4Halves:
    """A checkpoint's MXFP4 tensors (``STEM.weight_packed``, ``STEM.weight_scale``)
    collected by stem until both halves of one have arrived, in any order."""

    def __init__(self) -> None:
        self._pending: dict[str, dict[str, Any]] = {}

    def add(self, name: str, tensor) -> tuple[str, Any, Any] | None:
        """``(stem, packed, scale)`` once ``name`` completes its pair, else ``None``."""
        stem, _, kind = name.rpartition(".")
        halves = self._pending.setdefault(stem, {})
        halves[kind] = tensor
        if len(halves) < 2:
            return None
        del self._pending[stem]
        return stem, halves["weight_packed"], halves["weight_scale"]

    def unpaired(self) -> str | None:
        """A message naming a half whose other half never came, or ``None``."""
        if not self._pending:
            return None
        stem, halves = next(iter(self._pending.items()))
        (have,) = halves
        other = "weight_scale" if have == "weight_packed" else "weight_packed"
        return (
            f"{stem}.{have} has no matching {other} ({len(self._pending)} MXFP4 "
            "tensor(s) without their other half)"
        )


class WeightShapeError(ValueError):
    """A checkpoint tensor whose shape is not the one the config implies."""


def gate_lower_bound(kda: dict[str, Any], where: str) -> float:
    """The KDA gate's lower bound from ``linear_attn_config``: a negative number.
    Without one the gate is an unbounded softplus, which these models do not run."""
    bound = kda.get("gate_lower_bound")
    if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not bound < 0:
        raise ValueError(
            f"{where}: linear_attn_config.gate_lower_bound must be a negative number "
            f"(Kimi-K3 uses -5.0), got {bound!r}"
        )
    return float(bound)


def is_kda_layer(text: dict[str, Any], layer: int) -> bool:
    return layer + 1 in text["linear_attn_config"]["kda_layers"]


_K_NORMS = ("rmsnorm", "layernorm")


class DsaConfigError(ValueError):
    """A ``dsa_config`` this reference cannot honour (it never reads one as dense)."""


def dsa_settings(config: dict[str, Any]) -> dict[str, Any] | None:
    """The text config's ``dsa_config`` (a dict, or an object with its fields),
    checked; ``None`` for a dense model."""
    dsa = config.get("dsa_config")
    if dsa is None:
        return None
    # A dict as stored; vLLM 0.34's config holds a dataclass.
    dsa = dict(dsa) if isinstance(dsa, dict) else dict(vars(dsa))
    if "dsa_layers" not in dsa and "layers" in dsa:
        dsa["dsa_layers"] = dsa.pop("layers")
    problems = []
    if dsa.get("index_rope_dim", 0) != 0:
        problems.append(f"index_rope_dim {dsa['index_rope_dim']} (K3.1 has 0)")
    if dsa.get("index_topk_freq", 1) != 1:
        problems.append(f"index_topk_freq {dsa['index_topk_freq']} (index share)")
    if dsa.get("index_k_norm_type", "rmsnorm") not in _K_NORMS:
        problems.append(f"index_k_norm_type {dsa['index_k_norm_type']!r}")
    if int(dsa.get("index_topk", 2048)) < 1:
        problems.append(f"index_topk {dsa['index_topk']}")
    layers = dsa.get("dsa_layers")
    if not _is_layer_list(layers):
        # vLLM requires the list: a model read without it would be dense.
        problems.append(
            f"dsa_layers {layers!r} (the MLA layers with DSA, a list counted from 1)"
        )
    elif not_mla := sorted(_not_mla_layers(config, layers)):
        problems.append(f"dsa_layers {not_mla} (counted from 1) are not MLA layers")
    if problems:
        raise DsaConfigError("dsa_config not supported: " + "; ".join(problems))
    return {
        "dsa_layers": frozenset(layers),
        "index_topk": int(dsa.get("index_topk", 2048)),
        "index_head_dim": int(dsa.get("index_head_dim", 64)),
        "index_num_heads": int(dsa.get("index_num_heads", 16)),
        "index_k_norm_type": dsa.get("index_k_norm_type", "rmsnorm"),
    }


def _is_layer_list(layers: Any) -> bool:
    return isinstance(layers, list | tuple) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in layers
    )


def _not_mla_layers(config: dict[str, Any], dsa_layers) -> set[int]:
    """The entries of ``dsa_layers`` (from 1) that are no MLA layer of ``config``:
    KDA layers and numbers past the last layer; none where the layout is not
    given."""
    layers, linear = config.get("num_hidden_layers"), config.get("linear_attn_config")
    if layers is None or not linear:
        return set()
    kda = set(linear.get("kda_layers") or ())
    return {n for n in dsa_layers if n in kda or not 1 <= n <= layers}


def is_dsa_layer(config: dict[str, Any], layer: int) -> bool:
    """Whether layer ``layer`` (from 0) has DSA: ``dsa_layers`` counts from 1."""
    dsa = dsa_settings(config)
    return dsa is not None and layer + 1 in dsa["dsa_layers"]


def dense_weight_shapes(text: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every BF16 tensor of the text model, by checkpoint name (without the prefix);
    the MTP draft layers' are ``mtp_weight_shapes``."""
    d = text["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (text["vocab_size"], d),
        "model.norm.weight": (d,),
        "model.output_attn_res_norm.weight": (d,),
        "model.output_attn_res_proj.weight": (1, d),
        "lm_head.weight": (text["vocab_size"], d),
    }
    for layer in range(text["num_hidden_layers"]):
        shapes.update(_layer_shapes(text, layer))
    return shapes


def mtp_layers(text: dict[str, Any]) -> range:
    """The multi-token-prediction draft layers, numbered after the text model's
    (``num_nextn_predict_layers`` of them, as vLLM's in-tree ``KimiK3MTP`` reads
    the config); empty for a checkpoint without them."""
    first = text["num_hidden_layers"]
    return range(first, first + (text.get("num_nextn_predict_layers") or 0))


# An MTP layer's own tensors beside its decoder block's, under ``model.layers.{i}.``.
MTP_INPUT_NORMS = ("enorm", "hnorm")
# Copies of the target's embedding and LM head an MTP layer may carry, under
# ``model.layers.{i}.``: vLLM's proposer gives an MTP drafter the target's own.
MTP_EMBEDDING = "embed_tokens.weight"
MTP_HEAD = "shared_head.head.weight"


def mtp_weight_shapes(text: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every BF16 tensor of the MTP draft layers: per layer the input norms, the
    projection of the joined ``[embedding, hidden]`` back to the hidden size, the
    shared head's norm and a decoder block without attention residuals (an MLA
    layer, as the layer's index is not a KDA layer's). The copies of the target's
    embedding and LM head are not listed (``MTP_EMBEDDING``, ``MTP_HEAD``)."""
    d = text["hidden_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in mtp_layers(text):
        p = f"model.layers.{layer}."
        for norm in MTP_INPUT_NORMS:
            shapes[f"{p}{norm}.weight"] = (d,)
        shapes[f"{p}eh_proj.weight"] = (d, 2 * d)
        shapes[f"{p}shared_head.norm.weight"] = (d,)
        shapes.update(_layer_shapes(text, layer, attention_residuals=False))
    return shapes


def _layer_shapes(
    text: dict[str, Any], layer: int, *, attention_residuals: bool = True
) -> dict[str, tuple[int, ...]]:
    """One decoder layer's BF16 tensors (its routed experts aside)."""
    d = text["hidden_size"]
    kda = text["linear_attn_config"]
    kda_heads, kda_dim = kda["num_heads"], kda["head_dim"]
    kda_width = kda_heads * kda_dim
    conv = kda["short_conv_kernel_size"]
    heads = text["num_attention_heads"]
    q_head = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    latent = text["routed_expert_hidden_size"]
    shared = text["moe_intermediate_size"] * text["num_shared_experts"]
    shapes: dict[str, tuple[int, ...]] = {}
    p = f"model.layers.{layer}."
    for norm in ("input_layernorm", "post_attention_layernorm"):
        shapes[f"{p}{norm}.weight"] = (d,)
    if attention_residuals:
        for norm in ("self_attention_res_norm", "mlp_res_norm"):
            shapes[f"{p}{norm}.weight"] = (d,)
        shapes[f"{p}self_attention_res_proj.weight"] = (1, d)
        shapes[f"{p}mlp_res_proj.weight"] = (1, d)
    a = f"{p}self_attn."
    if is_kda_layer(text, layer):
        for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
            shapes[f"{a}{name}.weight"] = (kda_width, d)
        for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
            shapes[f"{a}{name}.weight"] = (kda_width, 1, conv)
        shapes[f"{a}b_proj.weight"] = (kda_heads, d)
        shapes[f"{a}f_a_proj.weight"] = (kda_dim, d)
        shapes[f"{a}f_b_proj.weight"] = (kda_width, kda_dim)
        shapes[f"{a}A_log"] = (kda_heads,)
        shapes[f"{a}dt_bias"] = (kda_width,)
        shapes[f"{a}o_norm.weight"] = (kda_dim,)
        shapes[f"{a}o_proj.weight"] = (d, kda_width)
    else:
        shapes[f"{a}q_a_proj.weight"] = (text["q_lora_rank"], d)
        shapes[f"{a}q_a_layernorm.weight"] = (text["q_lora_rank"],)
        shapes[f"{a}q_b_proj.weight"] = (heads * q_head, text["q_lora_rank"])
        shapes[f"{a}kv_a_proj_with_mqa.weight"] = (
            text["kv_lora_rank"] + text["qk_rope_head_dim"],
            d,
        )
        shapes[f"{a}kv_a_layernorm.weight"] = (text["kv_lora_rank"],)
        shapes[f"{a}kv_b_proj.weight"] = (
            heads * (text["qk_nope_head_dim"] + text["v_head_dim"]),
            text["kv_lora_rank"],
        )
        shapes[f"{a}g_proj.weight"] = (heads * text["v_head_dim"], d)
        shapes[f"{a}o_proj.weight"] = (d, heads * text["v_head_dim"])
        if is_dsa_layer(text, layer):
            shapes.update(_indexer_shapes(text, dsa_settings(text), f"{a}indexer."))
    if layer < text["first_k_dense_replace"]:
        m = f"{p}mlp."
        shapes[f"{m}gate_proj.weight"] = (text["intermediate_size"], d)
        shapes[f"{m}up_proj.weight"] = (text["intermediate_size"], d)
        shapes[f"{m}down_proj.weight"] = (d, text["intermediate_size"])
    else:
        m = f"{p}block_sparse_moe."
        shapes[f"{m}gate.weight"] = (text["num_experts"], d)
        shapes[f"{m}gate.e_score_correction_bias"] = (text["num_experts"],)
        shapes[f"{m}routed_expert_down_proj.weight"] = (latent, d)
        shapes[f"{m}routed_expert_norm.weight"] = (latent,)
        shapes[f"{m}routed_expert_up_proj.weight"] = (d, latent)
        shapes[f"{m}shared_experts.gate_proj.weight"] = (shared, d)
        shapes[f"{m}shared_experts.up_proj.weight"] = (shared, d)
        shapes[f"{m}shared_experts.down_proj.weight"] = (d, shared)
    return shapes


def _indexer_shapes(
    text: dict[str, Any], dsa: dict[str, Any], p: str
) -> dict[str, tuple[int, ...]]:
    """A K3.1 DSA layer's lightning indexer (``self_attn.indexer.``)."""
    heads, dim = dsa["index_num_heads"], dsa["index_head_dim"]
    shapes = {
        f"{p}wq_b.weight": (heads * dim, text["q_lora_rank"]),
        f"{p}wk.weight": (dim, text["hidden_size"]),
        f"{p}weights_proj.weight": (heads, text["hidden_size"]),
        f"{p}k_norm.weight": (dim,),
    }
    if dsa["index_k_norm_type"] == "layernorm":
        shapes[f"{p}k_norm.bias"] = (dim,)
    return shapes


def expert_weight_shapes(
    text: dict[str, Any], layers: range | None = None
) -> dict[str, tuple[int, int]]:
    """Every routed expert projection's unpacked ``[out, in]`` shape, by the name
    its ``weight_packed`` / ``weight_scale`` pair carries (without the suffix), for
    ``layers`` (default: the text model's MoE layers)."""
    latent = text["routed_expert_hidden_size"]
    inner = text["moe_intermediate_size"]
    if layers is None:
        layers = range(text["first_k_dense_replace"], text["num_hidden_layers"])
    shapes = {}
    for layer in layers:
        for expert in range(text["num_experts"]):
            e = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
            shapes[f"{e}w1"] = (inner, latent)
            shapes[f"{e}w3"] = (inner, latent)
            shapes[f"{e}w2"] = (latent, inner)
    return shapes
