"""The stand-in engine's steps, and which engine the test servers run.

The servers on vLLM 0.33 run it under vLLM's real engine core; here its worker is
stepped directly through the cases a short forced request never reaches: a prompt
prefilled in chunks, a preempted request recomputed, requests finishing between
steps.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support import server
from tests.support.standin_engine import _ForcedTokenWorker
from vllm_k3_plugin.format import vocab


def _new(req_id, prompt_len, forced, computed=0):
    return SimpleNamespace(
        req_id=req_id,
        prompt_token_ids=list(range(prompt_len)),
        sampling_params=SimpleNamespace(extra_args={"k3_force_ids": forced}),
        num_computed_tokens=computed,
    )


def _step(worker, scheduled, new=(), cached=(), finished=()):
    """One step: ``scheduled`` req_id -> tokens; ``cached`` (req_id, computed)."""
    worker.execute_model(
        SimpleNamespace(
            finished_req_ids=set(finished),
            scheduled_new_reqs=list(new),
            scheduled_cached_reqs=SimpleNamespace(
                req_ids=[r for r, _ in cached],
                num_computed_tokens=[c for _, c in cached],
            ),
            num_scheduled_tokens=dict(scheduled),
        )
    )
    output = worker.sample_tokens(None)
    return dict(zip(output.req_ids, output.sampled_token_ids, strict=True))


def test_forced_ids_then_the_stop_token():
    worker = _ForcedTokenWorker(SimpleNamespace())
    assert _step(worker, {"a": 5}, new=[_new("a", 5, [11, 12])]) == {"a": [11]}
    assert _step(worker, {"a": 1}, cached=[("a", 5)]) == {"a": [12]}
    assert _step(worker, {"a": 1}, cached=[("a", 6)]) == {"a": [vocab.END_OF_MSG_ID]}


def test_a_chunked_prefill_samples_only_once_the_prompt_is_computed():
    worker = _ForcedTokenWorker(SimpleNamespace())
    assert _step(worker, {"a": 4}, new=[_new("a", 10, [7])]) == {"a": []}
    assert _step(worker, {"a": 4}, cached=[("a", 4)]) == {"a": []}
    assert _step(worker, {"a": 2}, cached=[("a", 8)]) == {"a": [7]}


def test_a_prefix_cache_hit_counts_as_computed():
    worker = _ForcedTokenWorker(SimpleNamespace())
    assert _step(worker, {"a": 2}, new=[_new("a", 10, [9], computed=8)]) == {"a": [9]}


def test_a_preempted_request_resumes_its_forced_ids_after_recomputing():
    worker = _ForcedTokenWorker(SimpleNamespace())
    _step(worker, {"a": 3}, new=[_new("a", 3, [1, 2, 3])])
    _step(worker, {"a": 1}, cached=[("a", 3)])
    # Preempted: prompt and both outputs recomputed from 0, in two chunks.
    assert _step(worker, {"a": 3}, cached=[("a", 0)]) == {"a": []}
    assert _step(worker, {"a": 2}, cached=[("a", 3)]) == {"a": [3]}


def test_a_preempted_request_back_among_the_new_ones_resumes():
    """vLLM's V2 model runner schedules a resumed request as a new one."""
    worker = _ForcedTokenWorker(SimpleNamespace())
    _step(worker, {"a": 3}, new=[_new("a", 3, [1, 2, 3])])
    _step(worker, {"a": 1}, cached=[("a", 3)])
    assert _step(worker, {"a": 5}, new=[_new("a", 3, [1, 2, 3])]) == {"a": [3]}


def test_requests_finish_and_others_go_on():
    worker = _ForcedTokenWorker(SimpleNamespace())
    _step(worker, {"a": 2, "b": 2}, new=[_new("a", 2, [1]), _new("b", 2, [5, 6])])
    assert _step(worker, {"b": 1}, cached=[("b", 2)], finished=["a"]) == {"b": [6]}
    with pytest.raises(KeyError):
        _step(worker, {"a": 1}, cached=[("a", 3)])


def test_sample_tokens_needs_a_step():
    with pytest.raises(RuntimeError, match="without execute_model"):
        _ForcedTokenWorker(SimpleNamespace()).sample_tokens(None)


@pytest.mark.parametrize(("chosen", "standin"), [("model", False), ("standin", True)])
def test_the_engine_is_chosen_by_the_setting(monkeypatch, tmp_path, chosen, standin):
    monkeypatch.setenv(server.ENGINE_ENV, chosen)
    command = server.serve_command(tmp_path, 8000)
    assert (server.STANDIN_EXECUTOR in command) is standin


def test_an_unknown_engine_setting_is_refused(monkeypatch):
    monkeypatch.setenv(server.ENGINE_ENV, "gpu")
    with pytest.raises(ValueError, match="'model' or 'standin'"):
        server.serves_the_model()


def test_the_forcing_processor_on_model_runner_v2():
    """vLLM 0.34's interface (Model Runner V2): per request slot, the step from the
    row's position and the slot's prompt length; a slot reused by a request
    without forced ids is left alone. (0.32's servers run the V1 class.)"""
    import numpy as np
    import torch

    from tests.support import force

    if not hasattr(force.ForceTokens, "add_request"):
        pytest.skip("this vLLM loads V1 logits processors (0.32, 0.33)")
    prompt_len = SimpleNamespace(np=np.array([5, 3, 4]))
    processor = force.ForceTokens(None, SimpleNamespace(prompt_len=prompt_len))

    def params(ids):
        return SimpleNamespace(extra_args={"k3_force_ids": ids} if ids else {})

    assert processor.add_request(0, params([11, 12]))
    assert processor.add_request(2, params([21]))
    assert not processor.add_request(1, params(None))
    # Rows: slot 0 samples output step 1 (position 5 is its 6th token), slot 1 is
    # free, slot 2 samples step 1 (past its list: the stop token).
    logits = torch.zeros(3, vocab.END_OF_MSG_ID + 1)
    context = SimpleNamespace(
        expanded_idx_mapping=torch.tensor([0, 1, 2]), pos=torch.tensor([5, 9, 4])
    )
    out = processor.apply(logits, context)
    assert out[0].argmax().item() == 12
    assert out[0].isinf().sum() == vocab.END_OF_MSG_ID
    assert not out[1].isinf().any()
    assert out[2].argmax().item() == vocab.END_OF_MSG_ID
    # Slot 0 reused by a request without forced ids: nothing forced there.
    assert not processor.add_request(0, params(None))
    out = processor.apply(torch.zeros(1, 16), SimpleNamespace(
        expanded_idx_mapping=torch.tensor([0]), pos=torch.tensor([5])))  # fmt: skip
    assert not out.isinf().any()
