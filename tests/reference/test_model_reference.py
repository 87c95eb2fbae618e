"""The PyTorch reference blocks against direct formulas and independent implementations.

Tolerances: float64 comparisons of the same math in another order are held to 1e-12
relative; the fp32 KDA paths to 1e-5 absolute on unit-scale inputs (the recurrence
sums at most T products of magnitude <= 1 per step).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.tensors import assert_close
from vllm_k3_plugin.reference import reference as ref

torch.manual_seed(0)


# -- SiTU -----------------------------------------------------------------------------


def test_situ_glu_is_the_formula():
    g = torch.linspace(-60, 60, 241, dtype=torch.float64)
    u = torch.linspace(-200, 200, 241, dtype=torch.float64)
    got = ref.situ_glu(g, u)
    for gi, ui, out in zip(g.tolist(), u.tolist(), got.tolist()):
        expected = 4 * math.tanh(gi / 4) / (1 + math.exp(-gi)) * 25 * math.tanh(ui / 25)
        assert out == pytest.approx(expected, rel=1e-12, abs=1e-12)
    # Bounded: |gate part| < 4, |linear part| < 25.
    assert got.abs().max() < 100


def test_situ_mlp_takes_the_gate_half_first():
    x = torch.randn(3, 8, dtype=torch.float64)
    gate_up = torch.randn(12, 8, dtype=torch.float64)
    down = torch.randn(8, 6, dtype=torch.float64)
    gate, up = x @ gate_up[:6].T, x @ gate_up[6:].T
    expected = ref.situ_glu(gate, up) @ down.T
    assert_close(
        ref.situ_mlp(x, gate_up, down),
        expected,
        atol=1e-08,
        rtol=1e-12,
        what="ref.situ_mlp(x, gate_up, down)",
    )


# -- MXFP4 ----------------------------------------------------------------------------


def _decode_directly(packed, scale):
    """Bit by bit: sign, two exponent bits, one mantissa bit, then the block scale."""
    rows, half = packed.shape
    out = torch.empty(rows, half * 2, dtype=torch.float64)
    for r in range(rows):
        for c in range(half * 2):
            byte = int(packed[r, c // 2])
            nibble = byte & 0xF if c % 2 == 0 else byte >> 4
            sign = -1.0 if nibble & 0x8 else 1.0
            exponent, mantissa = (nibble >> 1) & 0x3, nibble & 0x1
            if exponent == 0:
                magnitude = 0.5 * mantissa
            else:
                magnitude = 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)
            out[r, c] = sign * magnitude * 2.0 ** (int(scale[r, c // 32]) - 127)
    return out


def test_mxfp4_decode_matches_the_bit_layout():
    packed = torch.randint(0, 256, (4, 32), dtype=torch.uint8)
    scale = torch.randint(110, 140, (4, 2), dtype=torch.uint8)
    got = ref.mxfp4_decode(packed, scale).double()
    assert torch.equal(got, _decode_directly(packed, scale))


def test_an_mxfp4_scale_byte_of_255_is_nan():
    """OCP MX: the e8m0 byte 255 is NaN, and so is each value it scales (zero
    nibbles too); a finite scale keeps them finite."""
    packed = torch.tensor([[0x00, 0x71] + [0x22] * 14], dtype=torch.uint8)
    got = ref.mxfp4_decode(packed, torch.tensor([[255]], dtype=torch.uint8))
    assert got.isnan().all()
    got = ref.mxfp4_decode(packed, torch.tensor([[200]], dtype=torch.uint8))
    assert got.isfinite().all()


def test_mxfp4_encode_round_trips_representable_weights():
    packed = torch.randint(0, 256, (8, 64), dtype=torch.uint8)
    # Each block's peak must be 6.0 x its scale for the encoder to choose that scale.
    packed[:, ::16] = 0x77
    scale = torch.randint(100, 150, (8, 4), dtype=torch.uint8)
    weight = ref.mxfp4_decode(packed, scale)
    again_packed, again_scale = ref.mxfp4_encode(weight)
    assert torch.equal(again_scale, scale)
    assert torch.equal(ref.mxfp4_decode(again_packed, again_scale), weight)


def test_mxfp4_encode_error_is_within_half_a_step():
    weight = torch.randn(16, 128)
    packed, scale = ref.mxfp4_encode(weight)
    decoded = ref.mxfp4_decode(packed, scale)
    blocks = weight.reshape(16, 4, 32)
    # The coarsest e2m1 step is 2.0 (between 4 and 6), times the block's scale,
    # and the scale is the smallest power of two that fits the block's peak in 6.0.
    step = 2.0 * torch.pow(2.0, scale.float() - 127)[..., None]
    assert ((decoded.reshape(16, 4, 32) - blocks).abs() <= step / 2 + 1e-6).all()
    peak = blocks.abs().amax(-1)
    assert (peak <= 6.0 * torch.pow(2.0, scale.float() - 127)).all()
    assert (peak > 3.0 * torch.pow(2.0, scale.float() - 127)).all()


def test_mxfp4_rejects_bad_inputs():
    with pytest.raises(TypeError):
        ref.mxfp4_decode(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="does not match"):
        ref.mxfp4_decode(
            torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
        )


# -- router ---------------------------------------------------------------------------


def test_router_picks_by_biased_score_and_weighs_by_the_unbiased_one():
    logits = torch.randn(5, 32)
    bias = torch.randn(32)
    weights, ids = ref.route(logits, bias, 4)
    for t in range(5):
        scores = [1 / (1 + math.exp(-float(x))) for x in logits[t]]
        chosen = sorted(range(32), key=lambda e: scores[e] + float(bias[e]))[-4:]
        assert set(ids[t].tolist()) == set(chosen)
        total = sum(scores[e] for e in chosen)
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            assert w == pytest.approx(scores[e] / total, rel=1e-6)


def test_router_top16_of_896():
    weights, ids = ref.route(torch.randn(3, 896), torch.zeros(896), 16)
    assert ids.shape == (3, 16) and torch.allclose(weights.sum(-1), torch.ones(3))


# -- KDA ------------------------------------------------------------------------------


def _kda_inputs(tokens=6, heads=3, key_dim=8, value_dim=8, dtype=torch.float64):
    q = ref.l2_normalize(torch.randn(tokens, heads, key_dim, dtype=dtype)) / math.sqrt(
        key_dim
    )
    k = ref.l2_normalize(torch.randn(tokens, heads, key_dim, dtype=dtype))
    v = torch.randn(tokens, heads, value_dim, dtype=dtype)
    u = torch.randn(tokens, heads, key_dim, dtype=dtype)
    g = ref.kda_gate(u, torch.randn(heads, dtype=dtype)).to(dtype)
    beta = torch.sigmoid(torch.randn(tokens, heads, dtype=dtype))
    return q, k, v, g, beta


def _kda_elementwise(q, k, v, g, beta):
    """The rule written out element by element in float64."""
    tokens, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    s = [[[0.0] * value_dim for _ in range(key_dim)] for _ in range(heads)]
    out = torch.zeros(tokens, heads, value_dim, dtype=torch.float64)
    for t in range(tokens):
        for h in range(heads):
            for i in range(key_dim):
                decay = math.exp(float(g[t, h, i]))
                s[h][i] = [x * decay for x in s[h][i]]
            for j in range(value_dim):
                predicted = sum(s[h][i][j] * float(k[t, h, i]) for i in range(key_dim))
                err = float(beta[t, h]) * (float(v[t, h, j]) - predicted)
                for i in range(key_dim):
                    s[h][i][j] += float(k[t, h, i]) * err
            for j in range(value_dim):
                out[t, h, j] = sum(
                    s[h][i][j] * float(q[t, h, i]) for i in range(key_dim)
                )
    return out, torch.tensor(s, dtype=torch.float64)


def test_kda_gate_is_bounded_below():
    g = ref.kda_gate(torch.tensor([[[-1e4, 0.0, 1e4]]]), torch.tensor([0.5]))
    assert g.min() >= -5.0 and g.max() <= 0.0
    assert g[0, 0, 1].item() == pytest.approx(-2.5)


def test_kda_recurrence_matches_the_elementwise_rule():
    inputs = _kda_inputs()
    out, state = ref.kda_recurrence(*inputs)
    expected_out, expected_state = _kda_elementwise(*inputs)
    assert_close(
        out.double(), expected_out, atol=1e-05, rtol=1e-05, what="out.double()"
    )
    assert_close(
        state.double(), expected_state, atol=1e-05, rtol=1e-05, what="state.double()"
    )


def test_kda_state_carries_across_chunks():
    inputs = _kda_inputs(tokens=11)
    whole, whole_state = ref.kda_recurrence(*inputs)
    state, pieces = None, []
    for lo, hi in ((0, 4), (4, 9), (9, 10), (10, 11)):
        chunk = [x[lo:hi] for x in inputs]
        out, state = ref.kda_recurrence(*chunk, state=state)
        pieces.append(out)
    assert_close(
        torch.cat(pieces), whole, atol=1e-06, rtol=1e-05, what="torch.cat(pieces)"
    )
    assert_close(state, whole_state, atol=1e-06, rtol=1e-05, what="state")


def test_kda_matches_transformers_kimi_linear():
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    q, k, v, g, beta = _kda_inputs(tokens=9, heads=2, key_dim=16, value_dim=8)
    ours, ours_state = ref.kda_recurrence(q, k, v, g, beta)
    # transformers scales q by K^-½ itself and takes unnormalized-q of the same form.
    theirs, theirs_state = kimi.recurrent_kimi_delta_attention(
        (q * math.sqrt(16)).float()[None],
        k.float()[None],
        v.float()[None],
        g.float()[None],
        beta.float()[None],
        None,
        True,
    )
    assert_close(ours, theirs[0].float(), atol=1e-05, rtol=1e-05, what="ours")
    assert_close(ours_state, theirs_state[0], atol=1e-05, rtol=1e-05, what="ours_state")


def test_causal_conv_carries_its_state():
    x = torch.randn(10, 6, dtype=torch.float64)
    weight = torch.randn(6, 1, 4, dtype=torch.float64)
    whole, whole_state = ref.causal_conv_silu(x, weight)
    # Directly: y[t, c] = silu(Σ_j w[c, j] · x[t - 3 + j, c]), zeros before the start.
    padded = torch.cat([torch.zeros(3, 6, dtype=torch.float64), x])
    direct = torch.stack(
        [(padded[t : t + 4] * weight[:, 0].T).sum(0) for t in range(10)]
    )
    assert_close(
        whole, torch.nn.functional.silu(direct), atol=1e-08, rtol=1e-12, what="whole"
    )
    first, state = ref.causal_conv_silu(x[:7], weight)
    rest, state = ref.causal_conv_silu(x[7:], weight, state)
    assert_close(
        torch.cat([first, rest]),
        whole,
        atol=1e-08,
        rtol=1e-12,
        what="torch.cat([first, rest])",
    )
    assert torch.equal(state, whole_state)


# -- attention residuals --------------------------------------------------------------


def test_attn_res_mix_is_a_softmax_over_scaled_dot_products():
    sources = [torch.randn(2, 16, dtype=torch.float64) for _ in range(3)]
    norm_w, proj_w = torch.rand(16, dtype=torch.float64), torch.randn(1, 16).double()
    got = ref.attn_res_mix(sources, norm_w, proj_w, eps=1e-5)
    for t in range(2):
        logits = []
        for s in sources:
            rms = math.sqrt(float((s[t] ** 2).mean()) + 1e-5)
            logits.append(float((s[t] * norm_w * proj_w[0]).sum()) / rms)
        top = max(logits)
        e = [math.exp(z - top) for z in logits]
        expected = sum(w / sum(e) * s[t] for w, s in zip(e, sources))
        assert_close(got[t], expected, atol=1e-08, rtol=1e-12, what="got[t]")


@pytest.mark.parametrize(("layers", "block_size"), [(7, 3), (12, 4), (5, 12), (9, 1)])
def test_attn_res_stack_matches_a_literal_transcription(layers, block_size):
    """The bank-and-partial-sum form against the rule spelled out over every
    sublayer's output: block j > 0 is the sum of the outputs of layers
    [(j-1)·b, j·b); block 0 is the embedding; the partial sum is the sum of the
    outputs since the current block began."""
    dim = 8
    embedding = torch.randn(3, dim, dtype=torch.float64)
    weights = {
        site: (torch.rand(dim, dtype=torch.float64), torch.randn(1, dim).double())
        for site in [
            (layer, kind) for layer in range(layers) for kind in ("attn", "mlp")
        ]
        + ["final"]
    }
    attn_w = [torch.randn(dim, dim, dtype=torch.float64) / dim for _ in range(layers)]
    mlp_w = [torch.randn(dim, dim, dtype=torch.float64) / dim for _ in range(layers)]

    def mix(site, sources):
        return ref.attn_res_mix(sources, *weights[site], eps=1e-5)

    def attn(layer, x):
        return torch.tanh(x @ attn_w[layer])

    def mlp(layer, x):
        return torch.tanh(x @ mlp_w[layer])

    got = ref.attn_res_forward(
        embedding, layers, block_size, attn=attn, mlp=mlp, mix=mix
    )

    outputs: dict[int, list[torch.Tensor]] = {}  # layer -> [attention, mlp] outputs

    def span(lo, hi, *, extra=()):
        """The sum of every sublayer output of layers [lo, hi), plus ``extra``."""
        terms = [out for layer in range(lo, hi) for out in outputs[layer]]
        return sum([*terms, *extra])

    def block(j):
        return embedding if j == 0 else span((j - 1) * block_size, j * block_size)

    def start_of(layer):
        return (layer // block_size) * block_size

    for layer in range(layers):
        before = -(-layer // block_size)  # blocks stored before this layer
        partial = embedding if layer == 0 else span(start_of(layer - 1), layer)
        x = mix((layer, "attn"), [*(block(j) for j in range(before)), partial])
        a = attn(layer, x)
        outputs[layer] = [a]
        mlp_partial = span(start_of(layer), layer, extra=[a])
        stored = [block(j) for j in range(layer // block_size + 1)]
        outputs[layer].append(mlp(layer, mix((layer, "mlp"), [*stored, mlp_partial])))
    complete = -(-layers // block_size)
    final_partial = span(start_of(layers - 1), layers)
    expected = mix("final", [*(block(j) for j in range(complete)), final_partial])
    assert_close(got, expected, atol=1e-12, rtol=1e-10, what="got")


def test_attn_res_layer_plan():
    assert ref.attn_res_layer(0, 12) == (True, 0, 0)
    assert ref.attn_res_layer(11, 12) == (False, 0, 1)
    assert ref.attn_res_layer(12, 12) == (True, 1, 1)
    assert ref.attn_res_layer(13, 12) == (False, 1, 2)


@pytest.mark.parametrize(("layers", "block_size"), [(6, 2), (7, 3), (9, 1), (5, 12)])
def test_attn_res_stack_split_into_stages_equals_the_whole(layers, block_size):
    """Pipeline stages: the carry handed on as vLLM's intermediate tensors (the
    partial sum, the bank stacked ``[T, blocks, D]``) and picked up by the next
    stage gives the whole stack's output, at every stage boundary; the bank holds
    ``blocks_before(boundary)`` vectors there."""
    dim = 8
    torch.manual_seed(layers * 31 + block_size)
    embedding = torch.randn(3, dim, dtype=torch.float64)
    sites = [(layer, kind) for layer in range(layers) for kind in ("attn", "mlp")]
    weights = {
        site: (torch.rand(dim, dtype=torch.float64), torch.randn(1, dim).double())
        for site in [*sites, "final"]
    }
    attn_w = [torch.randn(dim, dim, dtype=torch.float64) / dim for _ in range(layers)]
    mlp_w = [torch.randn(dim, dim, dtype=torch.float64) / dim for _ in range(layers)]
    parts = {
        "attn": lambda layer, x: torch.tanh(x @ attn_w[layer]),
        "mlp": lambda layer, x: torch.tanh(x @ mlp_w[layer]),
        "mix": lambda site, sources: ref.attn_res_mix(
            sources, *weights[site], eps=1e-5
        ),
    }
    whole = ref.attn_res_forward(embedding, layers, block_size, **parts)
    for boundary in range(1, layers):
        first = ref.attn_res_layers(
            ref.AttnResCarry([], embedding), range(boundary), block_size, **parts
        )
        sent = torch.stack(first.bank, dim=1)
        assert sent.shape == (3, ref.blocks_before(boundary, block_size), dim)
        received = ref.AttnResCarry(list(sent.unbind(1)), first.partial)
        second = ref.attn_res_layers(
            received, range(boundary, layers), block_size, **parts
        )
        split = parts["mix"]("final", [*second.bank, second.partial])
        assert torch.equal(split, whole), f"boundary before layer {boundary}"
