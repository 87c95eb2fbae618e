"""What Moonshot's wire-spec switch costs a streamed reply, per token: the parsers'
per-token benchmark (``bench_metrics.py``'s drive of the kimi_k3 parser) carried on
to the wire as vLLM 0.32's chat stream generator carries it (each delta into vLLM's
chunk models, dumped, framed as a server-sent event and sent through ASGI), served
without the switch and through ``MoonshotWireSpec``, alternating in one process, the
collector off (nothing sent is kept).

    python benchmarks/bench_wire.py [--sizes 512 4096] [--repeats 7]
    python benchmarks/bench_wire.py --served [--sizes 2048] [--repeats 9]

Prints µs per token without and with the switch and their ratio, for a plain
request, one that asked for the usage summary and one that asked for continuous
usage (every frame then carries usage, whose counts the switch reads and to which it
adds the cached tokens). The app honours the request it is handed, as vLLM does:
behind the switch a plain request is served with the usage summary the switch asks
for.

``--served``: the same requests streamed from two real ``vllm serve`` processes of
the tests' tiny checkpoint (outputs forced; on vLLM 0.33 the tests' stand-in
engine), one with the switch as the README sets it up (with
``--enable-prompt-tokens-details``, and each request upgraded to the usage summary:
both are part of what is measured), alternating, and the CPU time each API server
process spends (all its threads, ``/proc/PID/task/*/schedstat``) divided by the
tokens: what a deployment pays per streamed token, detokenizing, parsing and
serving included, and the run-to-run spread beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time

from bench_reasoning import output_ids, streamed_output

from vllm_k3_plugin.tools import compare
from vllm_k3_plugin.wire import MoonshotWireSpec

CONFIGURATIONS = {
    "plain": None,
    "usage summary": {"include_usage": True},
    "continuous usage": {"include_usage": True, "continuous_usage_stats": True},
}
PROMPT_TOKENS = 12


def serving_app(parser_cls, tokenizer, ids, deltas, chat_request, prompt):
    """An ASGI app streaming one K3 output as vLLM 0.32's chat stream generator
    does (its models, its dump, its framing), honouring the request's stream
    options as vLLM reads them."""
    from vllm.entrypoints.generate.base.protocol import DeltaMessage
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponseStreamChoice,
        ChatCompletionStreamResponse,
    )
    from vllm.entrypoints.serve.engine.protocol import UsageInfo

    envelope = {
        "id": "chatcmpl-0123456789abcdef01234567",
        "object": "chat.completion.chunk",
        "created": 1765000000,
        "model": "moonshotai/Kimi-K3",
    }
    last = len(ids) - 1

    def event(chunk, **dump) -> bytes:
        return f"data: {chunk.model_dump_json(exclude_unset=True, **dump)}\n\n".encode()

    def usage(completion: int) -> UsageInfo:
        return UsageInfo(
            prompt_tokens=PROMPT_TOKENS,
            completion_tokens=completion,
            total_tokens=PROMPT_TOKENS + completion,
        )

    async def app(scope, receive, send):
        request = json.loads((await receive())["body"])
        options = request.get("stream_options") or {}
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip

        async def send_event(data: bytes) -> None:
            await send({"type": "http.response.body", "body": data, "more_body": True})

        first = DeltaMessage(role="assistant", content="")
        choice = ChatCompletionResponseStreamChoice(
            index=0, delta=first, logprobs=None, finish_reason=None
        )
        chunk = ChatCompletionStreamResponse(**envelope, choices=[choice])
        if continuous:
            chunk.usage = usage(0)
        await send_event(event(chunk))
        parser = compare.new_parser(parser_cls, tokenizer, chat_request, thinking=True)
        for i in range(len(ids)):
            delta = parser.parse_delta(
                deltas[i], [ids[i]], chat_request, prompt_token_ids=prompt,
                finished=i == last,
            )  # fmt: skip
            if i == last:
                delta = delta or DeltaMessage()
                finish = "stop"
            elif delta is None:
                continue
            else:
                finish = None
            choice = ChatCompletionResponseStreamChoice(
                index=0, delta=delta, logprobs=None, finish_reason=finish,
                token_ids=None,
            )  # fmt: skip
            chunk = ChatCompletionStreamResponse(**envelope, choices=[choice])
            if continuous:
                chunk.usage = usage(i + 1)
            await send_event(event(chunk))
        if include_usage:
            chunk = ChatCompletionStreamResponse(
                **envelope, choices=[], usage=usage(len(ids))
            )
            await send_event(event(chunk, exclude_none=True))
        await send_event(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def seconds(loop, app, options) -> float:
    request = {"model": "moonshotai/Kimi-K3", "stream": True, "messages": []}
    if options is not None:
        request["stream_options"] = options
    body = json.dumps(request).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        return None  # nothing sent is kept

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": []}  # fmt: skip
    started = time.perf_counter()
    loop.run_until_complete(app(scope, receive, send))
    return time.perf_counter() - started


def run_served(sizes: list[int], repeats: int) -> None:
    """The served comparison (``--served``): API server CPU time per token."""
    import tempfile
    from pathlib import Path

    sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.support
    tokenizer = compare.load_tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as scratch:
        _served_table(Path(scratch), tokenizer, sizes, repeats)


def _served_table(root, tokenizer, sizes: list[int], repeats: int) -> None:
    import statistics

    import httpx

    from tests.support.checkpoint import write_tiny_checkpoint
    from tests.support.server import running_server

    checkpoint = write_tiny_checkpoint(root / "k3-tiny")
    switch = ("--middleware", "vllm_k3_plugin.wire.MoonshotWireSpec",
              "--enable-prompt-tokens-details")  # fmt: skip
    print("| request | output tokens | without µs/token (min–max) "
          "| with µs/token (min–max) | with/without (medians) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    with (
        running_server(checkpoint, root / "without.log") as without_url,
        running_server(checkpoint, root / "with.log", *switch) as with_url,
    ):
        urls = {"without": without_url, "with": with_url}
        pids = {key: api_server_pid(url) for key, url in urls.items()}
        for size in sizes:
            ids = output_ids(tokenizer, size)
            for name, options in CONFIGURATIONS.items():
                body = {
                    "model": "k3-tiny",
                    "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                    "max_tokens": len(ids) + 16,
                    "temperature": 0,
                    "stream": True,
                    "vllm_xargs": {"k3_force_ids": ids},
                }
                if options is not None:
                    body["stream_options"] = options
                per_token = {key: [] for key in urls}
                for repeat in range(repeats):
                    order = list(urls) if repeat % 2 == 0 else list(urls)[::-1]
                    for key in order:
                        url = urls[key]
                        before = cpu_nanoseconds(pids[key])
                        stream(httpx, url, body)
                        spent = cpu_nanoseconds(pids[key]) - before
                        per_token[key].append(spent / len(ids) / 1e3)
                medians = {k: statistics.median(v) for k, v in per_token.items()}
                cells = [
                    f"{medians[k]:.1f} ({min(v):.1f}–{max(v):.1f})"
                    for k, v in per_token.items()
                ]
                print(
                    f"| {name} | {len(ids)} | {cells[0]} | {cells[1]} "
                    f"| {medians['with'] / medians['without']:.3f} |"
                )


def stream(httpx, url: str, body: dict) -> None:
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=body, timeout=600
    ) as response:
        response.raise_for_status()
        for _ in response.iter_raw():
            pass


def api_server_pid(url: str) -> int:
    """The process serving ``url``: this process's child started with its
    ``--port`` (a forked engine core keeps that command line, but is its child)."""
    port = url.rsplit(":", 1)[1].encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                arguments = file.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as file:
                parent = int(file.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == os.getpid() and b"--port" in arguments and port in arguments:
            return int(entry)
    raise RuntimeError(f"no child process of this one serves {url}")


def cpu_nanoseconds(pid: int) -> int:
    """CPU time of the process's threads so far (the scheduler's count, in ns; a
    thread that ends between two readings takes its time with it)."""
    total = 0
    read = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as file:
                total += int(file.read().split()[0])
            read += 1
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
    if not read:
        raise RuntimeError(f"no /proc/{pid}/task/*/schedstat to read (schedstats?)")
    return total


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--served", action="store_true")
    args = parser.parse_args(argv)
    if args.served:
        run_served(args.sizes, args.repeats)
        return
    tokenizer = compare.load_tokenizer()
    ours = compare.our_parser_cls()
    prompt = compare.prompt_ids(tokenizer, True)
    loop = asyncio.new_event_loop()
    print("| request | think tokens | output tokens | without the switch µs/token "
          "| with it µs/token | with/without |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    gc.disable()
    for size in args.sizes:
        ids, deltas, chat_request = streamed_output(tokenizer, size)
        app = serving_app(ours, tokenizer, ids, deltas, chat_request, prompt)
        for name, options in CONFIGURATIONS.items():
            best = {"without": float("inf"), "with": float("inf")}
            served = {"without": app, "with": MoonshotWireSpec(app)}
            for repeat in range(args.repeats):
                order = list(best) if repeat % 2 == 0 else list(best)[::-1]
                for key in order:
                    elapsed = seconds(loop, served[key], options)
                    best[key] = min(best[key], elapsed)
            without, with_ = (best[k] / len(ids) * 1e6 for k in ("without", "with"))
            print(
                f"| {name} | {size} | {len(ids)} | {without:.2f} | {with_:.2f} "
                f"| {with_ / without:.3f} |"
            )
    gc.enable()
    loop.close()


if __name__ == "__main__":
    main()
