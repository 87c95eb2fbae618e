"""The plain-PyTorch Kimi-K3 model on the tiny checkpoint: every weight loads by its
checkpoint name, and the state carries across steps.

Tolerance: logits agree to 1e-4 (absolute, on logits of magnitude ~1): the same fp32
math summed in a different order (one prefill against chunks and single steps).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support.tensors import assert_close
from vllm_k3_plugin.reference.torch_model import (
    K3TextModel,
    SequenceState,
    WeightShapeError,
)
from vllm_k3_plugin.tools import tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-k3-model")
    tiny.write_tiny_k3_checkpoint(out)
    return out


@pytest.fixture(scope="module")
def model(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())["text_config"]
    model = K3TextModel(config)
    weights = load_file(str(checkpoint / "model.safetensors"))
    loaded = model.load_weights(weights.items())
    assert loaded == {name for name, _ in model.named_parameters()}
    return model


PROMPT = torch.tensor([163587, 1634, 163589, 15, 2000, 77, 9, 31337, 163588, 5, 6, 7])


def test_one_prefill_equals_chunks_then_single_steps(model):
    whole = model(PROMPT, SequenceState())
    state = SequenceState()
    pieces = [model(PROMPT[:5], state), model(PROMPT[5:9], state)]
    pieces += [model(PROMPT[i : i + 1], state) for i in range(9, len(PROMPT))]
    assert_close(
        torch.cat(pieces), whole, atol=0.0001, rtol=1e-05, what="torch.cat(pieces)"
    )
    assert state.length == len(PROMPT)
    # 4 KDA layers hold state; 2 MLA layers hold one latent per token.
    assert len(state.kda) == 4
    assert {tuple(c.shape) for c in state.mla.values()} == {(len(PROMPT), 576)}


def test_two_sequences_do_not_share_state(model):
    other = torch.tensor([163584, 42, 43, 44])
    alone = model(PROMPT, SequenceState())
    first, second = SequenceState(), SequenceState()
    interleaved = [model(PROMPT[:6], first), model(other[:2], second)]
    interleaved += [model(PROMPT[6:], first), model(other[2:], second)]
    assert_close(
        torch.cat([interleaved[0], interleaved[2]]),
        alone,
        atol=0.0001,
        rtol=1e-05,
        what="torch.cat([interleaved[0], interleaved[2]])",
    )
    assert_close(
        torch.cat([interleaved[1], interleaved[3]]),
        model(other, SequenceState()),
        atol=0.0001,
        rtol=1e-05,
        what="torch.cat([interleaved[1], interleaved[3]])",
    )


def test_greedy_tokens_are_deterministic(model):
    def greedy(steps):
        state, ids, out = SequenceState(), PROMPT, []
        for _ in range(steps):
            token = model(ids, state)[-1].argmax().view(1)
            out.append(int(token))
            ids = token
        return out

    assert greedy(6) == greedy(6)


def test_shape_mismatch_names_the_tensor(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())["text_config"]
    model = K3TextModel(config)
    bad = {"language_model.model.norm.weight": torch.ones(3)}
    with pytest.raises(
        WeightShapeError, match=r"model\.norm\.weight: checkpoint shape"
    ):
        model.load_weights(bad.items())


@pytest.mark.parametrize("bound", [None, 0.0, 2.0, "-5", True])
def test_a_kda_gate_without_a_negative_lower_bound_is_refused_at_build(
    checkpoint, bound
):
    """vLLM reads a missing bound as an unbounded softplus gate, which these models
    do not run (their chunk length is set by the bound): a clear error, not a
    default."""
    config = json.loads((checkpoint / "config.json").read_text())["text_config"]
    kda = config["linear_attn_config"]
    if bound is None:
        del kda["gate_lower_bound"]
    else:
        kda["gate_lower_bound"] = bound
    with pytest.raises(ValueError, match="gate_lower_bound must be a negative number"):
        K3TextModel(config)
