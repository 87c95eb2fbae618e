"""Each streamed output is counted once on ``vllm_k3_outputs_total``: by how it
ended when its last delta is read, ``aborted`` when its stream closes first. Driven
in process as vLLM's serving layer drives it: the endpoint hook (``metrics.serving``,
in the handler's task) wraps the stream (``metrics.tallied``), the combined parser
reads one delta a chunk, and the stream is read directly or through vLLM's own
``with_sse_keep_alive`` (``--sse-keep-alive-interval``), which advances it in a new
task for each chunk. The served storm is ``tests/serving/test_metrics_storm.py``."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from vllm_k3_plugin.parsers import metrics
from vllm_k3_plugin.tools import compare
from vllm_k3_plugin.tools.shapes import SHAPES, output_ids


def _outputs(ending: str) -> float:
    value = REGISTRY.get_sample_value(
        "vllm_k3_outputs_total",
        {"endpoint": "chat_completions", "stream": "true", "ending": ending},
    )
    return value or 0.0


def _keep_alive():
    try:
        from vllm.entrypoints.serve.utils.sse_keep_alive import with_sse_keep_alive
    except ImportError:  # a vLLM without SSE keep-alive: read directly only
        return None
    return with_sse_keep_alive


async def _serve(hf_tokenizer, *, n: int, leave_after: int | None, keep_alive):
    """One streamed request of ``n`` outputs; the client reads ``leave_after``
    chunks and closes the stream (``None``: reads it to its end)."""
    request = ChatCompletionRequest(
        model="k3-tiny",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        n=n,
    )
    ids = output_ids(SHAPES["think-then-reply"].output, stop=True)
    deltas = compare.delta_texts(hf_tokenizer, ids)
    prompt = compare.prompt_ids(hf_tokenizer, True)
    parser_cls = compare.our_parser_cls("kimi_k3")

    async def chunks():
        # vLLM's stream generator: one parser per output, one delta a step.
        parsers = [
            compare.new_parser(parser_cls, hf_tokenizer, request, True)
            for _ in range(n)
        ]
        yield "data: the role\n\n"  # sent before the first delta is read
        for step, (token, text) in enumerate(zip(ids, deltas)):
            for parser in parsers:
                parser.parse_delta(
                    text,
                    [token],
                    request,
                    prompt_token_ids=prompt,
                    finished=step == len(ids) - 1,
                )
            yield f"data: step {step}\n\n"
            await asyncio.sleep(0)
        yield "data: [DONE]\n\n"

    # The handler runs in a task of its own (vLLM's ``with_cancellation``).
    handler = contextvars.copy_context()
    tally = handler.run(metrics.serving, "chat_completions", True, request)
    stream = metrics.tallied(chunks(), tally)
    if keep_alive is not None:
        stream = keep_alive(stream, 30.0)
    read = 0
    async for _ in stream:
        read += 1
        if leave_after is not None and read >= leave_after:
            break
    await stream.aclose()
    await asyncio.sleep(0)


@pytest.mark.parametrize("keep_alive", [False, True], ids=["direct", "keep-alive"])
@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_is_counted_once_however_it_is_read(hf_tokenizer, keep_alive, n):
    wrapper = _keep_alive() if keep_alive else None
    if keep_alive and wrapper is None:
        pytest.skip("this vLLM has no SSE keep-alive")
    before = {ending: _outputs(ending) for ending in ("answered", "aborted")}

    asyncio.run(_serve(hf_tokenizer, n=n, leave_after=None, keep_alive=wrapper))
    after_whole = {ending: _outputs(ending) for ending in before}
    assert after_whole["answered"] - before["answered"] == n
    assert after_whole["aborted"] == before["aborted"]

    asyncio.run(_serve(hf_tokenizer, n=n, leave_after=3, keep_alive=wrapper))
    after_left = {ending: _outputs(ending) for ending in before}
    assert after_left["aborted"] - after_whole["aborted"] == n
    assert after_left["answered"] == after_whole["answered"]


def test_a_stream_left_before_its_first_delta_counts_nothing(hf_tokenizer):
    """Left after the role chunk: no output began, nothing is counted."""
    before = _outputs("aborted"), _outputs("answered")
    asyncio.run(_serve(hf_tokenizer, n=1, leave_after=1, keep_alive=None))
    assert (_outputs("aborted"), _outputs("answered")) == before
