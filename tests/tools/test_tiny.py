"""``python -m vllm_k3_plugin.tools.tiny``: the tiny checkpoint in the K3 format."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.reference.reference import mxfp4_decode
from vllm_k3_plugin.tools import tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-k3")
    assert tiny.main([str(out)]) == 0
    return out


def test_config_is_read_by_vllm_as_kimi_k3(checkpoint):
    pytest.importorskip("vllm")
    from vllm.transformers_utils.config import get_config

    config = get_config(str(checkpoint), trust_remote_code=False)
    assert type(config).__name__ == "KimiK3Config"
    assert config.architectures == ["KimiK3ForConditionalGeneration"]
    text = config.text_config
    assert type(text).__name__ == "KimiLinearConfig"
    assert text.is_mla and text.is_moe and text.is_linear_attn
    kinds = ["kda" if text.is_kda_layer(i) else "mla" for i in range(6)]
    assert kinds == ["kda", "kda", "mla", "kda", "kda", "mla"]
    # The bank holds several blocks: ceil(6 / 2) = 3.
    assert text.attn_res_block_size == 2
    assert config.quantization_config["format"] == "mxfp4-pack-quantized"


def test_weights_have_the_checkpoint_names_shapes_and_formats(checkpoint):
    text = json.loads((checkpoint / "config.json").read_text())["text_config"]
    dense = tiny.dense_weight_shapes(text)
    experts = tiny.expert_weight_shapes(text)
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        expected = {tiny.PREFIX + n for n in dense} | {
            f"{tiny.PREFIX}{n}.{suffix}"
            for n in experts
            for suffix in ("weight_packed", "weight_scale")
        }
        assert names == expected
        for name, shape in dense.items():
            tensor = f.get_tensor(tiny.PREFIX + name)
            assert tuple(tensor.shape) == shape and tensor.dtype == torch.bfloat16
        for name, (rows, cols) in experts.items():
            packed = f.get_tensor(f"{tiny.PREFIX}{name}.weight_packed")
            scale = f.get_tensor(f"{tiny.PREFIX}{name}.weight_scale")
            assert packed.dtype == scale.dtype == torch.uint8
            assert tuple(packed.shape) == (rows, cols // 2)
            assert tuple(scale.shape) == (rows, cols // 32)
            weight = mxfp4_decode(packed, scale)
            assert torch.isfinite(weight).all() and 0 < weight.abs().max() < 4
    layer_names = {n.split(".")[3] for n in names if ".layers." in n}
    assert layer_names == {str(i) for i in range(6)}
    assert any(".self_attn.A_log" in n for n in names)
    assert any(".self_attn.kv_a_proj_with_mqa." in n for n in names)


def test_tokenizer_is_the_real_k3_one(checkpoint):
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(checkpoint))
    ids = tokenizer.encode(vocab.THINK_END, add_special_tokens=False)
    assert ids[0] == vocab.CLOSE_ID and ids[-1] == vocab.SEP_ID
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith(vocab.THINKING_ON_PREFIX)
