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
