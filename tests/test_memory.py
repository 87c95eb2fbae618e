"""The reader holds one copy of an undecided think channel, and nothing once decided."""

from __future__ import annotations

import tracemalloc

import pytest

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import ReasoningReader
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy

TOKENS = 50_000
DELTAS = [f" w{i % 97}" for i in range(TOKENS)]
CHANNEL_CHARS = sum(map(len, DELTAS))
ENDINGS = {
    "thought": vocab.THINK_END + vocab.RESPONSE_START + "Done." + vocab.RESPONSE_END,
    "skipped-channel": vocab.RESPONSE_END + vocab.MESSAGE_END,
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
@pytest.mark.parametrize("policy", list(ReplayPolicy), ids=lambda p: p.value)
def test_memory_is_the_channel_copy_and_is_released(policy, ending):
    ReasoningReader()  # the marker set compiles once per process, before tracing
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        reader = ReasoningReader(start=Channel.THINK, policy=policy)
        for delta in DELTAS[:-1]:
            reader.feed(delta)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        reader.feed(DELTAS[-1])
        step_peak = tracemalloc.get_traced_memory()[1] - before
        undecided = tracemalloc.get_traced_memory()[0] - base
        reader.feed(ENDINGS[ending])
        reader.finish(stopped=True)
        after = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # One copy of the channel (ASCII: a byte a character), plus a little.
    assert CHANNEL_CHARS <= undecided < CHANNEL_CHARS * 1.1 + 4096
    # A step late in the thought allocates about its delta, not the output so far.
    assert step_peak < 1024
    assert after < 4096
