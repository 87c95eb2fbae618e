"""Kimi-K3.1's sparse attention in the model class, in process: the indexer's
selection over a paged key cache (``dsa.select_slots``) and the sparse MLA over the
selected latent rows (``mla_backend.k3_sparse_mla``), each against the reference
(``reference.dsa``) on one sequence read whole; the class vLLM resolves for a K3.1
checkpoint, its sparse layers and key caches, and its loader.

A prompt whose keys arrive over several prefill chunks, then decode steps, in a
batch with other requests and pages in scattered order (which a served run leaves
to vLLM's allocator), selects what the whole read selects.
Selections are compared exactly (sets of positions); attention outputs within 1e-5
(fp32, another summation order).
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.support.in_process import engine_config, kernel_settings
from tests.support.one_rank import one_rank
from tests.support.tensors import assert_close
from vllm_k3_plugin.model import dsa
from vllm_k3_plugin.model.dsa import (
    NO_SLOT,
    IndexKeyMetadata,
    check_shared_pages,
    select_slots,
)
from vllm_k3_plugin.model.mla_backend import SPARSE_ROWS, k3_sparse_mla
from vllm_k3_plugin.reference.checkpoint_format import (
    K31_WRAPPER,
    LANGUAGE_MODEL_PREFIX,
    WeightShapeError,
)
from vllm_k3_plugin.reference.dsa import causal_topk, index_scores

HEADS, DIM, TOPK = 4, 16, 8
PREFIX = "language_model.model.layers."  # as the forward context names layers
# The tiny K3.1 checkpoint's DSA layers (from 0): its two MLA layers.
DSA_LAYERS = (2, 5)
PAGE = 16
PAGES = 12


def _sequence(length: int, seed: int):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return randn(length, HEADS, DIM), randn(length, HEADS).abs(), randn(length, DIM)


class PagedKeys:
    """A key cache of ``PAGES`` pages (unwritten rows NaN), and the block tables."""

    def __init__(self, requests: int) -> None:
        self.pages = torch.full((PAGES, PAGE, DIM), float("nan"))
        # Each request's pages, scattered over the cache in descending order.
        self.tables = [
            [page for page in range(PAGES) if page % requests == request][::-1]
            for request in range(requests)
        ]

    def slots(self, request: int, positions: range) -> list[int]:
        table = self.tables[request]
        return [table[p // PAGE] * PAGE + p % PAGE for p in positions]

    def step(self, spans: list[tuple[int, range]], keys: dict[int, torch.Tensor]):
        """``spans``: each request's new positions this step; ``keys``: its keys."""
        slot_mapping, starts, lengths = [], [0], []
        for request, positions in spans:
            slots = self.slots(request, positions)
            for slot, key in zip(
                slots, keys[request][positions.start : positions.stop]
            ):
                self.pages[slot // PAGE, slot % PAGE] = key
            slot_mapping += slots
            starts.append(starts[-1] + len(positions))
            lengths.append(positions.stop)
        width = max(len(table) for table in self.tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        return IndexKeyMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(lengths),
            block_table=table[[request for request, _ in spans]],
            num_tokens=starts[-1],
        )


def _whole_selection(length: int, seed: int) -> list[set[int]]:
    q, w, k = _sequence(length, seed)
    chosen = causal_topk(index_scores(q, k, w), 0, TOPK)
    return [set(torch.nonzero(row).flatten().tolist()) for row in chosen]


def _positions_of(selected: torch.Tensor, slots: list[int]) -> list[set[int]]:
    position = {slot: p for p, slot in enumerate(slots)}
    return [{position[s] for s in row.tolist() if s != NO_SLOT} for row in selected]


@pytest.mark.parametrize(
    ("chunks", "score_elements"),
    [((40,), None), ((7, 16, 17), None), ((1, 30, 9), None), ((7, 16, 17), 1)],
    ids=["whole", "3-chunks", "1-30-9", "3-chunks-row-by-row"],
)
def test_chunked_prefill_then_decode_selects_what_the_whole_read_selects(
    chunks, score_elements, monkeypatch
):
    """Request 1 prefills in ``chunks`` then decodes 3 steps; request 0 (23 tokens,
    whole) and request 2 (decoding from 9) share each step. ``score_elements``: the
    bound on scores computed at once (1: each query row scored alone)."""
    if score_elements is not None:
        monkeypatch.setattr(dsa, "SCORE_ELEMENTS", score_elements)
    lengths = {0: 23, 1: sum(chunks) + 3, 2: 12}
    data = {r: _sequence(n, seed=r) for r, n in lengths.items()}
    keys = {r: data[r][2] for r in data}
    cache = PagedKeys(requests=3)
    cache.step([(2, range(9))], keys)  # request 2's prompt, before these steps
    plan = [[(1, range(0, chunks[0])), (0, range(23))]]
    done = chunks[0]
    for size in chunks[1:]:
        plan.append([(1, range(done, done + size))])
        done += size
    for _ in range(3):
        plan.append([(1, range(done, done + 1))])
        done += 1
    decoded = 9
    for step_spans in plan:
        if decoded < lengths[2]:
            step_spans = [*step_spans, (2, range(decoded, decoded + 1))]
            decoded += 1
        step = cache.step(step_spans, keys)
        q = torch.cat([data[r][0][p.start : p.stop] for r, p in step_spans])
        w = torch.cat([data[r][1][p.start : p.stop] for r, p in step_spans])
        selected = select_slots(q, w, cache.pages, step, TOPK)
        first = 0
        for request, positions in step_spans:
            rows = selected[first : first + len(positions)]
            first += len(positions)
            slots = cache.slots(request, range(positions.stop))
            want = _whole_selection(lengths[request], seed=request)
            got = _positions_of(rows, slots)
            assert got == want[positions.start : positions.stop], (request, positions)
            seen = [min(p + 1, TOPK) for p in positions]
            assert [int((row != NO_SLOT).sum()) for row in rows] == seen


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-cache", "fp8-cache"])
def test_sparse_attention_over_selected_slots_equals_attention_over_those_rows(fp8):
    """Rows past one block of ``SPARSE_ROWS``; an FP8 cache read with its scale."""
    torch.manual_seed(0)
    tokens, heads, width, value = SPARSE_ROWS + 6, 2, 24, 16
    cache = torch.randn(PAGES, PAGE, width)
    layer = SimpleNamespace(_k_scale_float=0.5)
    if fp8:
        cache = (cache / layer._k_scale_float).to(torch.float8_e4m3fn)
    q = torch.randn(tokens, heads, width)
    topk_slots = torch.full((tokens, TOPK), NO_SLOT, dtype=torch.int32)
    for t in range(tokens):
        count = min(t + 1, TOPK)
        topk_slots[t, :count] = torch.randperm(PAGES * PAGE)[:count]
    impl = SimpleNamespace(topk_slots=topk_slots, kv_lora_rank=value, scale=0.3)
    out, lse = k3_sparse_mla(impl, q, cache, None, layer)
    flat = cache.reshape(-1, width).float() * (layer._k_scale_float if fp8 else 1.0)
    for t in range(tokens):
        rows = flat[topk_slots[t][topk_slots[t] >= 0].long()]
        scores = torch.einsum("hc,kc->hk", q[t], rows) * 0.3
        assert_close(lse[t], torch.logsumexp(scores, -1), atol=1e-5, what="lse")
        want = torch.softmax(scores, -1) @ rows[:, :value]
        assert_close(out[t], want, atol=1e-5, what=f"row {t}")


def test_a_key_cache_apart_from_its_latent_is_refused_by_name():
    latent = torch.tensor([5, 6, 7])
    check_shared_pages("keys", "latent", {"keys": latent, "latent": latent})
    check_shared_pages("keys", "latent", {"keys": latent.clone(), "latent": latent})
    with pytest.raises(RuntimeError, match=r"keys: .* different KV cache groups"):
        check_shared_pages("keys", "latent", {"keys": latent + 1, "latent": latent})


# -- the class on a K3.1 checkpoint --------------------------------------------------


@pytest.fixture(scope="module")
def k31_model(tiny_k31_checkpoint):
    """The class as ``vllm serve`` resolves and builds it for the K3.1 checkpoint."""
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.registration import register_all

    register_all()
    config = engine_config(tiny_k31_checkpoint)
    assert config.model_config.architecture == K31_WRAPPER[1]
    model_cls, _ = config.model_config.registry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    with one_rank(config):
        config.compilation_config.static_forward_context.clear()
        with set_current_vllm_config(config), kernel_settings("pytorch"):
            yield model_cls(vllm_config=config), config


def get_kv_cache_groups(config, specs):
    """vLLM's grouping of the layers' cache specs (moved out of ``kv_cache_utils``
    after 0.32)."""
    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups as group
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups as group
    return group(config, specs)


def _k31_weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def test_the_k31_checkpoint_builds_sparse_layers_and_loads_every_tensor(
    k31_model, tiny_k31_checkpoint
):
    from vllm_k3_plugin.model.mla_backend import K3CpuSparseMlaImpl
    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    model, config = k31_model
    assert type(model) is KimiK3ForConditionalGeneration
    assert model.load_weights(_k31_weights(tiny_k31_checkpoint).items()) == {
        name for name, _ in model.named_parameters()
    }
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    context = config.compilation_config.static_forward_context
    specs = {
        name: layer.get_kv_cache_spec(config)
        for name, layer in context.items()
        if isinstance(layer, AttentionLayerBase)
    }
    if config.cache_config.kv_cache_layout is None:
        # What the engine core resolves for these backends (the server logs it).
        config.cache_config.kv_cache_layout = "LBNHC"
    groups = [set(group.layer_names) for group in get_kv_cache_groups(config, specs)]
    for layer in DSA_LAYERS:
        attn = f"{PREFIX}{layer}.self_attn"
        assert isinstance(context[f"{attn}.attn"].impl, K3CpuSparseMlaImpl)
        # vLLM's own grouping puts each key cache with its latent.
        pair = {f"{attn}.attn", f"{attn}.indexer.k_cache"}
        assert any(pair <= group for group in groups), groups


@pytest.mark.parametrize("tensor", ["wq_b.weight", "k_norm.bias"])
def test_a_missing_or_misshapen_indexer_tensor_is_named(
    k31_model, tiny_k31_checkpoint, tensor
):
    from vllm_k3_plugin.model.loader import MissingWeightsError

    model, _ = k31_model
    name = f"model.layers.{DSA_LAYERS[0]}.self_attn.indexer.{tensor}"
    weights = _k31_weights(tiny_k31_checkpoint)
    stored = LANGUAGE_MODEL_PREFIX + name
    misshapen = {**weights, stored: weights[stored][:-1]}
    with pytest.raises(WeightShapeError, match=re.escape(name)):
        model.load_weights(misshapen.items())
    del weights[stored]
    with pytest.raises(MissingWeightsError, match=re.escape(name)):
        model.load_weights(weights.items())
