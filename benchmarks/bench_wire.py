"""What Moonshot's wire-spec switch costs a streamed reply, per frame: vLLM-shaped
server-sent events (a first frame, a thought, a reply, the end frame, the usage
summary) sent one event a message through ``MoonshotWireSpec``, beside the same
events through a middleware that passes them on, in one process (nothing sent is
kept, so the collector runs as in a server): a plain request, and one that asked for
continuous usage (every frame carries usage: each is parsed and written again).

    python benchmarks/bench_wire.py [--tokens 2000 20000]

Prints µs per frame for each and the difference: what the switch adds to every
streamed token (the parsers' own cost is ``bench_reasoning.py``'s). Beside it, where
vLLM is installed, what vLLM itself spends building and serialising one such chunk
(its pydantic models, as its stream generator uses them), timed in the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import timeit

from vllm_k3_plugin.wire import MoonshotWireSpec

ENVELOPE = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
            "created": 1765000000, "model": "moonshotai/Kimi-K3"}  # fmt: skip


def events(tokens: int, continuous: bool = False) -> list[bytes]:
    """A thought and a reply as vLLM writes the kimi_k3 parser's deltas (one field
    a delta); with ``continuous``, vLLM's usage on every frame."""

    def frame(delta, finish=None, done=0):
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is None:
            choice["token_ids"] = None  # as vLLM 0.32 writes a middle chunk
        chunk = {**ENVELOPE, "choices": [choice]}
        if continuous:
            chunk["usage"] = usage(done, min(done, tokens // 2))
        return chunk

    def usage(done, reasoning):
        details = {"reasoning_tokens": reasoning}
        return {
            "prompt_tokens": 12,
            "completion_tokens": done,
            "total_tokens": 12 + done,
            "completion_tokens_details": details,
        }

    frames = [frame({"role": "assistant", "content": ""})]
    frames += [frame({"reasoning": " thought"}, done=n) for n in range(tokens // 2)]
    frames += [frame({"content": " reply"}, done=n) for n in range(tokens // 2, tokens)]
    frames.append(frame({}, "stop", done=tokens))
    frames.append({**ENVELOPE, "choices": [], "usage": usage(tokens, tokens // 2)})
    encoded = [
        b"data: " + json.dumps(f, separators=(",", ":")).encode() + b"\n\n"
        for f in frames
    ]
    return [*encoded, b"data: [DONE]\n\n"]


def app_sending(data: list[bytes]):
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        for piece in data:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


class PassThrough:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        await self.app(scope, receive, send)


def seconds(middleware, data: list[bytes], options: dict) -> float:
    request = {"model": "k3", "stream": True, "messages": [], "stream_options": options}
    body = json.dumps(request).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        return None  # nothing sent is kept: the collector has nothing to chase

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": []}  # fmt: skip
    wrapped = middleware(app_sending(data))
    started = time.perf_counter()
    asyncio.run(wrapped(scope, receive, send))
    return time.perf_counter() - started


def vllm_chunk_seconds(repeats: int = 20000) -> float | None:
    """vLLM's own work for one content chunk: the delta, the choice and the response
    built and dumped as its stream generator does; ``None`` without vLLM."""
    try:
        from vllm.entrypoints.generate.base.protocol import DeltaMessage
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )
    except ImportError:
        return None

    def one() -> str:
        choice = ChatCompletionResponseStreamChoice(
            index=0,
            delta=DeltaMessage(content=" reply"),
            logprobs=None,
            finish_reason=None,
            token_ids=None,
        )
        chunk = ChatCompletionStreamResponse(**ENVELOPE, choices=[choice])
        return chunk.model_dump_json(exclude_unset=True)

    return min(timeit.repeat(one, number=repeats, repeat=3)) / repeats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000, 20000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    print("| request | tokens | pass-through µs/frame | switch µs/frame "
          "| added µs/frame |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    configurations = {
        "plain": {},
        "continuous usage": {"include_usage": True, "continuous_usage_stats": True},
    }
    for name, options in configurations.items():
        for tokens in args.tokens:
            data = events(tokens, continuous=bool(options))
            best = {PassThrough: float("inf"), MoonshotWireSpec: float("inf")}
            for _ in range(args.repeats):
                for middleware in best:
                    elapsed = seconds(middleware, data, options)
                    best[middleware] = min(best[middleware], elapsed)
            per = {m: s / len(data) * 1e6 for m, s in best.items()}
            print(
                f"| {name} | {tokens} | {per[PassThrough]:.2f} "
                f"| {per[MoonshotWireSpec]:.2f} "
                f"| {per[MoonshotWireSpec] - per[PassThrough]:.2f} |"
            )
    vllm_chunk = vllm_chunk_seconds()
    if vllm_chunk is None:
        print("\nvLLM is not installed here: no figure for its own chunk.")
    else:
        print(f"\nvLLM building and dumping one chunk: {vllm_chunk * 1e6:.2f} µs")


if __name__ == "__main__":
    main()
