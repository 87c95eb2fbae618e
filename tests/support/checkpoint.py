"""A tiny checkpoint that carries the real K3 tokenizer, for serving tests.

The network is a one-layer Llama (head size 32, which vLLM's CPU attention supports)
over the full K3 vocabulary; its weights are random and never matter, because the
tests force every output token (``support.force``). What matters is real: the
tokenizer (the Kimi BPE ranks with the K3 control ids), the stop token, and a chat
template that ends the prompt with the K3 generation prefix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools.tokenizer import chat_template, write_hf_tokenizer

MARKER_FILE = "vllm_k3_tiny.json"


def write_tiny_checkpoint(out_dir: Path, *, seed: int = 0) -> Path:
    """Write the checkpoint into ``out_dir`` (reused if complete and current)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    template = chat_template()
    marker = json.dumps(
        {"seed": seed, "template": hashlib.sha256(template.encode()).hexdigest()}
    )
    marker_path = out_dir / MARKER_FILE
    if marker_path.exists() and marker_path.read_text() == marker:
        return out_dir
    config = LlamaConfig(
        vocab_size=vocab.VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=vocab.BOS_ID,
        eos_token_id=vocab.END_OF_MSG_ID,
        pad_token_id=vocab.PAD_ID,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_hf_tokenizer(out_dir, template)
    generation = {
        "bos_token_id": vocab.BOS_ID,
        "eos_token_id": vocab.END_OF_MSG_ID,
        "pad_token_id": vocab.PAD_ID,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    marker_path.write_text(marker)
    return out_dir


# The output projections of every sublayer: attention (KDA and MLA), the dense MLP,
# the MoE's latent up-projection and its shared experts.
SUBLAYER_OUTPUTS = (
    "self_attn.o_proj.weight",
    "mlp.down_proj.weight",
    "routed_expert_up_proj.weight",
    "shared_experts.down_proj.weight",
)


def write_repeating_k3_checkpoint(
    out_dir: Path, *, sublayer_scale: float = 0.3, mtp_layers: int = 0
) -> Path:
    """The tiny Kimi-K3 checkpoint (``tools.tiny``) changed so that its greedy
    output repeats itself, for drafts to be proposed and accepted: the LM head is
    the embedding (a token's own logit stands out) and every sublayer's output
    projection is scaled by ``sublayer_scale``, so that the embedding leads the
    final mix while the KDA, MLA and MoE layers still move every logprob. With
    ``mtp_layers`` MTP draft layers, each predicts the same way: ``eh_proj`` passes
    the normalized embedding through, with half the normalized hidden state the
    target gave, to the head, which vLLM makes the target's."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_k3_plugin.reference.checkpoint_format import LANGUAGE_MODEL_PREFIX
    from vllm_k3_plugin.reference.checkpoint_format import mtp_layers as draft_layers
    from vllm_k3_plugin.tools.tiny import tiny_text_config, write_tiny_k3_checkpoint

    out_dir = write_tiny_k3_checkpoint(Path(out_dir), mtp_layers=mtp_layers)
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    model = LANGUAGE_MODEL_PREFIX + "model."
    tensors[LANGUAGE_MODEL_PREFIX + "lm_head.weight"] = tensors[
        model + "embed_tokens.weight"
    ].clone()
    for layer in draft_layers(tiny_text_config(mtp_layers)):
        p = f"{model}layers.{layer}."
        eh_proj = tensors[p + "eh_proj.weight"]
        hidden = eh_proj.shape[0]
        passing = torch.zeros(hidden, 2 * hidden)
        passing[:, :hidden] = torch.eye(hidden)
        passing[:, hidden:] = 0.5 * torch.eye(hidden)
        tensors[p + "eh_proj.weight"] = passing.to(eh_proj.dtype)
    for name, tensor in tensors.items():
        if name.endswith(SUBLAYER_OUTPUTS):
            tensors[name] = (tensor.float() * sublayer_scale).to(tensor.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir


def write_fixed_routing_k3_checkpoint(out_dir: Path) -> Path:
    """The tiny Kimi-K3 checkpoint (``tools.tiny``) with every MoE layer's
    selection-only correction bias a ramp of whole units (expert ``e`` gets ``-e``):
    sigmoid scores lie in (0, 1), so every token selects the same top-k experts,
    weighted by its own scores. A random router's near-ties flip under bf16
    rounding and move a logprob by whole nats; with the selection fixed, a bf16
    server can be held to the fp32 reference within bf16's precision."""
    import torch
    from safetensors.torch import load_file, save_file

    from vllm_k3_plugin.tools.tiny import write_tiny_k3_checkpoint

    out_dir = write_tiny_k3_checkpoint(Path(out_dir))
    path = out_dir / "model.safetensors"
    tensors = load_file(str(path))
    for name, tensor in tensors.items():
        if name.endswith("gate.e_score_correction_bias"):
            ramp = -torch.arange(tensor.shape[0], dtype=torch.float32)
            tensors[name] = ramp.to(tensor.dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out_dir
