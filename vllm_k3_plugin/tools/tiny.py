"""``python -m vllm_k3_plugin.tools.tiny OUT_DIR``: a tiny random Kimi-K3 checkpoint in
the real format.

``config.json`` is a ``kimi_k3`` config wrapping a ``kimi_linear`` text config (the
published checkpoint's layout, with every field the text model reads), the weights
carry the checkpoint's names under ``language_model.`` with the routed experts
MXFP4-packed (``weight_packed`` + UE8M0 ``weight_scale``) and everything else BF16,
and the tokenizer is the real K3 one (the Kimi BPE ranks and control ids) with a chat
template that ends the prompt with the K3 generation prefix.

The default geometry mixes KDA and MLA layers, uses an attention-residual block of 2
so the bank holds several blocks, and has 8 experts (2 per token, 1 shared).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.reference.checkpoint_format import (
    K3_WRAPPER,
    K31_WRAPPER,
    LANGUAGE_MODEL_PREFIX,
    MTP_EMBEDDING,
    MTP_HEAD,
    dense_weight_shapes,
    expert_weight_shapes,
    mtp_weight_shapes,
)
from vllm_k3_plugin.reference.checkpoint_format import mtp_layers as draft_layers

PREFIX = LANGUAGE_MODEL_PREFIX


def tiny_text_config(
    mtp_layers: int = 0, *, dsa_topk: int | None = None
) -> dict[str, Any]:
    """``mtp_layers``: MTP draft layers after the text model's
    (``num_nextn_predict_layers``). ``dsa_topk``: a Kimi-K3.1 text config, DSA on
    every MLA layer with that ``index_topk`` (small, so sparse differs from dense
    on short prompts)."""
    layers = 6
    full_attn = [3, 6]  # 1-based, as the published config numbers them
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": vocab.VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "bos_token_id": vocab.BOS_ID,
        "eos_token_id": vocab.END_OF_MSG_ID,
        "pad_token_id": vocab.PAD_ID,
        "q_lora_rank": 32,
        # The latent keeps K3's 512 + 64 = 576 width: vLLM's CPU MLA decode kernel
        # is built for that size only.
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": 32,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "attn_res_block_size": 2,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, layers + 1) if i not in full_attn],
            "full_attn_layers": full_attn,
            "num_heads": 2,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        "num_nextn_predict_layers": mtp_layers,
        "torch_dtype": "bfloat16",
    }
    if dsa_topk is not None:
        # K3.1's indexer: no RoPE, a LayerNorm on its shared key, no index share.
        text["dsa_config"] = {
            "dsa_layers": full_attn,
            "index_topk": dsa_topk,
            "index_head_dim": 16,
            "index_num_heads": 4,
            "index_rope_dim": 0,
            "index_k_norm_type": "layernorm",
            "indexer_use_fp8": False,
            "index_topk_freq": 1,
        }
    return text


def quantization_config() -> dict[str, Any]:
    """compressed-tensors MXFP4 for the routed experts only."""
    return {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "group_size": 32,
                    "strategy": "group",
                    "symmetric": True,
                    "scale_dtype": "uint8",
                },
                "input_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


def k3_config(text: dict[str, Any]) -> dict[str, Any]:
    """The published wrapper: Kimi-K3's, or Kimi-K3.1's for a text config with
    ``dsa_config``."""
    model_type, architecture = K31_WRAPPER if "dsa_config" in text else K3_WRAPPER
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "text_config": text,
        "bos_token_id": vocab.BOS_ID,
        "eos_token_id": vocab.END_OF_MSG_ID,
        "pad_token_id": vocab.PAD_ID,
        "tie_word_embeddings": False,
        "quantization_config": quantization_config(),
        "torch_dtype": "bfloat16",
    }


def text_only_config(text: dict[str, Any]) -> dict[str, Any]:
    """A text-only checkpoint's config: the ``kimi_linear`` text config itself."""
    return {
        **text,
        "architectures": ["KimiK3ForCausalLM"],
        "quantization_config": quantization_config(),
    }


def write_tiny_k3_checkpoint(
    out_dir: Path,
    *,
    seed: int = 0,
    text_only: bool = False,
    mtp_layers: int = 0,
    dsa_topk: int | None = None,
) -> Path:
    """``text_only``: a ``KimiK3ForCausalLM`` checkpoint (text config, names without
    the ``language_model.`` prefix) instead of the published wrapper.
    ``mtp_layers``: that many MTP draft layers too, each with copies of an
    embedding and an LM head (random: vLLM's proposer replaces them with the
    target's). ``dsa_topk``: a Kimi-K3.1 checkpoint (``tiny_text_config``)."""
    import torch
    from safetensors.torch import save_file

    from vllm_k3_plugin.reference.reference import mxfp4_encode

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = tiny_text_config(mtp_layers, dsa_topk=dsa_topk)
    prefix = "" if text_only else PREFIX
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    drafts = draft_layers(text)
    mtp_dense = mtp_weight_shapes(text)
    for layer in drafts:
        for copy in (MTP_EMBEDDING, MTP_HEAD):
            mtp_dense[f"model.layers.{layer}.{copy}"] = (
                text["vocab_size"],
                text["hidden_size"],
            )
    # The text model's tensors first: its weights do not depend on ``mtp_layers``.
    parts = (
        (dense_weight_shapes(text), expert_weight_shapes(text)),
        (mtp_dense, expert_weight_shapes(text, drafts)),
    )
    for dense, experts in parts:
        for name, shape in dense.items():
            if name.endswith(("norm.weight", "layernorm.weight")):
                value = torch.ones(shape)
            elif name.endswith(
                ("A_log", "dt_bias", "e_score_correction_bias", "norm.bias")
            ):
                value = torch.zeros(shape)
            else:
                fan_in = shape[-1]
                value = torch.randn(shape, generator=generator) / fan_in**0.5
            tensors[prefix + name] = value.to(torch.bfloat16).contiguous()
        for name, shape in experts.items():
            weight = torch.randn(shape, generator=generator) / shape[1] ** 0.5
            packed, scale = mxfp4_encode(weight)
            tensors[f"{prefix}{name}.weight_packed"] = packed.contiguous()
            tensors[f"{prefix}{name}.weight_scale"] = scale.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return write_tiny_k3_config(
        out_dir, text_only=text_only, mtp_layers=mtp_layers, dsa_topk=dsa_topk
    )


def write_tiny_k3_config(
    out_dir: Path,
    *,
    text_only: bool = False,
    mtp_layers: int = 0,
    dsa_topk: int | None = None,
) -> Path:
    """The tiny checkpoint without its weights: config, generation config and
    tokenizer, what vLLM's tokenizer loader reads (the replay's tokenizer folder)."""
    import transformers

    from vllm_k3_plugin.tools.tokenizer import chat_template, write_hf_tokenizer

    out_dir = Path(out_dir)
    text = tiny_text_config(mtp_layers, dsa_topk=dsa_topk)
    config = text_only_config(text) if text_only else k3_config(text)
    # As every saved config carries it (transformers reads a config without it as
    # possibly a Mistral tokenizer's, and warns).
    config["transformers_version"] = transformers.__version__
    write_hf_tokenizer(out_dir, chat_template())
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": vocab.BOS_ID,
        "eos_token_id": vocab.END_OF_MSG_ID,
        "pad_token_id": vocab.PAD_ID,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--text-only",
        action="store_true",
        help="a KimiK3ForCausalLM checkpoint (text config, no language_model. prefix)",
    )
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        help="MTP draft layers after the text model's (for --speculative-config "
        '\'{"method": "mtp"}\')',
    )
    parser.add_argument(
        "--dsa-topk",
        type=int,
        help="a Kimi-K3.1 checkpoint: DSA on the MLA layers with this index_topk",
    )
    args = parser.parse_args(argv)
    path = write_tiny_k3_checkpoint(
        args.out_dir,
        seed=args.seed,
        text_only=args.text_only,
        mtp_layers=args.mtp_layers,
        dsa_topk=args.dsa_topk,
    )
    model = "Kimi-K3.1" if args.dsa_topk is not None else "Kimi-K3"
    print(f"wrote a tiny {model} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
