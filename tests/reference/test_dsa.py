"""DeepSeek Sparse Attention in the plain-PyTorch reference (Kimi-K3.1's MLA layers).

The selection is checked on hand-written scores; the indexer's scores against the
formula written out term by term; MLA over a selection against dense MLA over a
sequence holding just the selected positions (K3's MLA has no positions, so the two
are the same attention); and a layer whose top-k covers every position against the
dense layer with the same weights.

Tolerance: 1e-5 absolute on outputs of magnitude ~0.1: the same fp32 math summed in
another order.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.tensors import assert_close
from vllm_k3_plugin.reference import torch_model
from vllm_k3_plugin.reference.checkpoint_format import DsaConfigError, dsa_settings
from vllm_k3_plugin.reference.dsa import causal_topk, index_scores, selection_margin
from vllm_k3_plugin.reference.torch_model import GatedMla, SequenceState
from vllm_k3_plugin.tools.tiny import tiny_text_config

MLA_LAYER = 2  # from 0: the tiny model's first MLA layer (3 counted from 1)


def _config(topk: int | None) -> dict:
    config = tiny_text_config()
    if topk is not None:
        config["dsa_config"] = {
            "dsa_layers": [3, 6],
            "index_topk": topk,
            "index_head_dim": 16,
            "index_num_heads": 4,
            "index_rope_dim": 0,
            "index_k_norm_type": "layernorm",
        }
    return config


def _layer(topk: int | None, seed: int = 0) -> GatedMla:
    torch.manual_seed(seed)
    layer = GatedMla(_config(topk), MLA_LAYER)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.2)
    return layer


def test_causal_topk_on_hand_written_scores():
    # Queries at positions 2, 3, 4 (two earlier positions cached), top 2.
    scores = torch.tensor(
        [
            [0.5, 0.9, 0.1, 9.0, 9.0],  # sees 0..2: 1 and 0
            [0.3, 0.3, 0.3, 0.2, 9.0],  # sees 0..3: a three-way tie, earliest win
            [0.0, 0.1, 0.7, 0.2, 0.6],  # sees 0..4: 2 and 4
        ]
    )
    assert causal_topk(scores, past=2, topk=2).tolist() == [
        [True, True, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, True],
    ]
    # A query that sees fewer positions than top-k attends to all it sees.
    assert causal_topk(scores[:1], past=0, topk=2).tolist() == [
        [True, False, False, False, False]
    ]


def test_index_scores_are_the_formula_term_by_term():
    torch.manual_seed(1)
    q, k, w = torch.randn(3, 4, 8), torch.randn(5, 8), torch.randn(3, 4)
    want = torch.zeros(3, 5)
    for t in range(3):
        for s in range(5):
            for h in range(4):
                want[t, s] += w[t, h] * max(float(q[t, h] @ k[s]), 0.0)
    want *= 8**-0.5 * 4**-0.5
    assert_close(index_scores(q, k, w), want, atol=1e-5, rtol=1e-5, what="scores")


def test_top_k_covering_every_position_is_dense_mla():
    x = torch.randn(12, 64) * 0.5
    dense, sparse = _layer(None), _layer(12)
    sparse.load_state_dict(
        dense.state_dict() | sparse.indexer.state_dict(prefix="indexer.")
    )
    with torch.no_grad():
        want = dense(x, SequenceState())
        got = sparse(x, SequenceState())
        assert_close(got, want, atol=1e-5, rtol=1e-5, what="dsa output")
        # With fewer positions than the prompt's, the two differ: the check can fail.
        narrow = _layer(3)
        narrow.load_state_dict(sparse.state_dict())
        assert not torch.allclose(narrow(x, SequenceState()), want, atol=1e-3)


def test_mla_over_a_selection_is_dense_mla_over_those_positions(monkeypatch):
    x = torch.randn(8, 64) * 0.5
    layer = _layer(3)
    # A hand-built selection: each query attends to itself and to at most two
    # earlier positions, not the ones the indexer would pick.
    chosen = {t: sorted({t, t // 2, max(t - 3, 0)}) for t in range(8)}
    mask = torch.zeros(8, 8, dtype=torch.bool)
    for t, positions in chosen.items():
        mask[t, positions] = True
    monkeypatch.setattr(torch_model, "causal_topk", lambda *args: mask)
    dense = _layer(None)
    dense.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if not k.startswith("indexer.")}
    )
    with torch.no_grad():
        got = layer(x, SequenceState())
        for t, positions in chosen.items():
            # The query is the last of its positions: dense MLA's last output.
            want = dense(x[positions], SequenceState())[-1]
            assert_close(got[t], want, atol=1e-5, rtol=1e-5, what=f"query {t}")


def test_steps_after_a_prefill_read_the_cached_index_keys():
    x = torch.randn(10, 64) * 0.5
    layer = _layer(4)
    with torch.no_grad():
        whole = layer(x, SequenceState())
        state = SequenceState()
        pieces = [layer(x[:6], state)]
        pieces += [layer(x[i : i + 1], state) for i in range(6, 10)]
    assert_close(torch.cat(pieces), whole, atol=1e-5, rtol=1e-5, what="steps")
    assert state.index_keys[MLA_LAYER].shape == (10, 16)


@pytest.mark.parametrize(
    ("field", "value"),
    [("index_rope_dim", 64), ("index_topk_freq", 2), ("index_k_norm_type", "l2")],
)
def test_a_dsa_config_the_reference_cannot_honour_is_refused(field, value):
    config = _config(8)
    config["dsa_config"][field] = value
    with pytest.raises(DsaConfigError, match=field):
        dsa_settings(config)


@pytest.mark.parametrize("layers", [None, "3,6", [3.0, 6], [True]])
def test_dsa_layers_missing_or_not_a_list_of_layers_is_refused(layers):
    """Without a readable ``dsa_layers`` every layer would be read dense."""
    config = _config(8)
    if layers is None:
        del config["dsa_config"]["dsa_layers"]
    else:
        config["dsa_config"]["dsa_layers"] = layers
    with pytest.raises(DsaConfigError, match="dsa_layers"):
        dsa_settings(config)


@pytest.fixture(scope="module")
def k31_checkpoint(tmp_path_factory):
    from vllm_k3_plugin.tools import tiny

    return tiny.write_tiny_k3_checkpoint(
        tmp_path_factory.mktemp("tiny-k31"), dsa_topk=TOPK
    )


TOPK = 4
PROMPT = torch.tensor([163587, 1634, 163589, 15, 2000, 77, 9, 31337, 163588, 5])


def _reference(checkpoint, *, dense: bool):
    import json

    from safetensors.torch import load_file

    from vllm_k3_plugin.reference.torch_model import K3TextModel

    config = json.loads((checkpoint / "config.json").read_text())
    text = config["text_config"]
    weights = load_file(str(checkpoint / "model.safetensors"))
    if dense:
        text = {k: v for k, v in text.items() if k != "dsa_config"}
        weights = {k: v for k, v in weights.items() if ".indexer." not in k}
    model = K3TextModel(text)
    loaded = model.load_weights(weights.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    return config, model


def test_the_tiny_k31_checkpoint_is_read_sparse_and_differs_from_dense_past_topk(
    k31_checkpoint,
):
    config, sparse = _reference(k31_checkpoint, dense=False)
    assert config["model_type"] == "kimi_k31"
    assert config["architectures"] == ["KimiK31ForConditionalGeneration"]
    _, dense = _reference(k31_checkpoint, dense=True)
    got = sparse(PROMPT, SequenceState())
    want = dense(PROMPT, SequenceState())
    # A query sees at most ``index_topk`` positions up to position TOPK - 1: dense
    # there; past it, the indexer's choice.
    assert_close(got[:TOPK], want[:TOPK], atol=1e-4, rtol=1e-5, what="first logits")
    assert (got[TOPK:] - want[TOPK:]).abs().amax(dim=-1).min() > 1e-3


def test_the_selection_margin_is_the_gap_at_the_top_k_boundary():
    scores = torch.tensor(
        [
            [0.5, 0.9, 0.1, 9.0, 9.0],  # sees 3: second best 0.5, third 0.1
            [0.3, 0.7, 0.2, 0.4, 9.0],  # sees 4: second best 0.4, third 0.3
            [0.0, 0.1, 0.7, 0.2, 0.2],  # sees 5: a tie across the boundary
        ]
    )
    margins = selection_margin(scores, past=2, topk=2)
    assert_close(margins, torch.tensor([0.4, 0.1, 0.0]), atol=1e-7, what="margins")
    # A query that sees at most topk positions selects them all.
    assert selection_margin(scores, past=2, topk=3)[0] == float("inf")
    assert selection_margin(scores[:, :2], past=0, topk=2).isinf().all()


def test_the_indexer_reads_the_normed_query_latent_and_the_layer_input(monkeypatch):
    """The selection the layer uses, against one computed here from its weights:
    ``wq_b`` on the query latent after ``q_a_layernorm`` (random norm weights, so a
    latent taken before the norm would pick otherwise), ``wk`` and ``weights_proj``
    on the layer's input, the key through its LayerNorm."""
    x = torch.randn(9, 64) * 0.5
    layer = _layer(3, seed=3)
    used = []
    scores = layer.indexer.scores
    monkeypatch.setattr(
        layer.indexer, "scores", lambda *args: used.append(scores(*args)) or used[-1]
    )
    with torch.no_grad():
        layer(x, SequenceState())
        q_a = x @ layer.q_a_proj.weight.T
        norm = layer.q_a_layernorm
        q_latent = q_a * torch.rsqrt(q_a.pow(2).mean(-1, keepdim=True) + norm.eps)
        q_latent = q_latent * norm.weight
        k_norm = layer.indexer.k_norm
        keys = torch.nn.functional.layer_norm(
            x @ layer.indexer.wk.weight.T, (16,), k_norm.weight, k_norm.bias, k_norm.eps
        )
        weights = x @ layer.indexer.weights_proj.weight.T

        def selection(latent):
            index_q = (latent @ layer.indexer.wq_b.weight.T).reshape(9, 4, 16)
            dots = torch.relu(torch.einsum("thd,sd->ths", index_q, keys))
            return causal_topk(torch.einsum("ths,th->ts", dots, weights), 0, 3)

        want, before_norm = selection(q_latent), selection(q_a)
    assert torch.equal(causal_topk(used[0], 0, 3), want)
    # The latent before its norm picks otherwise here: the check tells them apart.
    assert not torch.equal(want, before_norm)
