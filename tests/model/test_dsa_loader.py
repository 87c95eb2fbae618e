"""Kimi-K3.1's indexer tensors at the real sizes: the class's indexer, built on the
meta device, takes each checkpoint tensor under its checkpoint name and shape; vLLM
0.34's in-tree K3.1 loader takes the same names (its renames and its merged
``wkv_index`` read from its module), into parameters of the same sizes.

Real sizes: hidden 7168, ``q_lora_rank`` 1536 (``K3_MODEL.md``); the indexer's 64
heads of 128 (vLLM's K3.1 cache rows are 128 FP8 values and a scale), a LayerNorm
key norm.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.in_process import engine_config
from tests.support.one_rank import one_rank
from vllm_k3_plugin.reference.checkpoint_format import dense_weight_shapes
from vllm_k3_plugin.tools.tiny import tiny_text_config

LAYER = 2  # a DSA layer of the tiny K3.1 layout (from 0)
INDEXER = f"model.layers.{LAYER}.self_attn.indexer."
REAL_DSA = {
    "dsa_layers": [3, 6],
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_num_heads": 64,
    "index_rope_dim": 0,
    "index_k_norm_type": "layernorm",
}


def _real_text() -> dict:
    text = tiny_text_config(dsa_topk=4)
    text.update(hidden_size=7168, q_lora_rank=1536, rms_norm_eps=1e-5)
    text["dsa_config"] = REAL_DSA
    return text


@pytest.fixture(scope="module")
def checkpoint_tensors() -> dict[str, tuple[int, ...]]:
    """The real checkpoint's indexer tensors of layer ``LAYER``, by name."""
    shapes = dense_weight_shapes(_real_text())
    return {name: shape for name, shape in shapes.items() if name.startswith(INDEXER)}


@pytest.fixture(scope="module")
def vllm_config(tiny_k31_checkpoint):
    from vllm_k3_plugin.registration import register_all

    register_all()
    with one_rank(engine_config(tiny_k31_checkpoint)) as config:
        config.compilation_config.static_forward_context.clear()
        yield config


def test_the_checkpoint_names_every_indexer_tensor(checkpoint_tensors):
    assert sorted(checkpoint_tensors) == [
        f"{INDEXER}{name}"
        for name in (
            "k_norm.bias",
            "k_norm.weight",
            "weights_proj.weight",
            "wk.weight",
            "wq_b.weight",
        )
    ]


def test_the_class_loads_every_real_indexer_tensor(vllm_config, checkpoint_tensors):
    from types import SimpleNamespace

    from vllm_k3_plugin.model.dsa import K3Indexer, topk_slot_buffer
    from vllm_k3_plugin.model.loader import load_k3_tensors
    from vllm_k3_plugin.reference.checkpoint_format import dsa_settings

    text = _real_text()
    config = SimpleNamespace(**text)
    with torch.device("meta"):
        indexer = K3Indexer(
            config,
            dsa_settings(text),
            latent_layer=SimpleNamespace(),
            topk_slots=topk_slot_buffer(REAL_DSA["index_topk"]),
            prefix=INDEXER.rstrip("."),
        )
    shapes = {name.removeprefix(INDEXER): s for name, s in checkpoint_tensors.items()}
    tensors = [(name, torch.empty(s, device="meta")) for name, s in shapes.items()]
    loaded = load_k3_tensors(indexer, tensors, shapes, {})
    assert loaded == {name for name, _ in indexer.named_parameters()} == set(shapes)


def test_vllms_in_tree_k31_loader_takes_the_same_names_into_the_same_sizes(
    vllm_config, checkpoint_tensors
):
    try:
        from vllm.models.kimi_k3.nvidia import dsa, model
    except ImportError:
        pytest.skip("this vLLM has no Kimi-K3.1 class (0.34 and later have)")
    with torch.device("meta"):
        theirs = dsa.KimiK3DSAIndexer(
            vllm_config=vllm_config,
            hidden_size=7168,
            index_q_input_size=1536,
            index_head_dim=REAL_DSA["index_head_dim"],
            index_num_heads=REAL_DSA["index_num_heads"],
            index_topk=REAL_DSA["index_topk"],
            rms_norm_eps=1e-5,
            index_k_norm_type=REAL_DSA["index_k_norm_type"],
            cache_config=vllm_config.cache_config,
            prefix=f"model.layers.{LAYER}.self_attn.dsa_indexer",
        )
    params = {
        f"model.layers.{LAYER}.self_attn.dsa_indexer.{name}": p.shape
        for name, p in theirs.named_parameters()
    }
    # Each parameter's rows, filled shard by shard in the order the loader names.
    filled: dict[str, int] = {}
    for name, shape in sorted(checkpoint_tensors.items()):
        target = None
        for param, shard_name, shard in model._DSA_STACKED_PARAMS_MAPPING:
            if shard_name in name:
                target = name.replace(shard_name, param)
                rows = [
                    REAL_DSA["index_head_dim"],
                    REAL_DSA["index_num_heads"],
                ][shard]
                assert shape == (rows, 7168), name
                break
        else:
            for param, weight_name in model._DSA_RENAME_PARAMS_MAPPING:
                if weight_name in name:
                    target = name.replace(weight_name, param)
                    break
            assert params.get(target) == torch.Size(shape), (name, target)
            rows = shape[0]
        assert target in params, name
        filled[target] = filled.get(target, 0) + rows
    assert filled == {name: shape[0] for name, shape in params.items()}
