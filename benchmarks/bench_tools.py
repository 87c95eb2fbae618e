"""Per-token cost of reasoning + tool calls: our ``kimi_k3`` parsers against vLLM's
in-tree ``kimi_k3`` reasoning and tool parsers, driven as vLLM's chat serving drives
them, in one process.

Each output is a thought, a reply and a tools channel: 1 to 200 calls with small
arguments, or one ``write_file`` call whose ``content`` string is 10 KB to 1 MB.

- **stream**: one ``parse_delta`` per token (text from the incremental detokenizer,
  prepared before timing), ``finished`` on the last, for outputs both parsers can
  stream whole in reasonable time; the in-tree one is quadratic, so beyond
  ``--max-full-tokens`` only the tail is timed.
- **tail**: everything but the last ``--tail`` tokens in one ``parse_delta``, then the
  rest one token at a time: the per-token cost late in a long output.
- **first args at**: the fraction of the output already generated when the client got
  its first argument text (ours streams it; the in-tree parser sends a call whole).

Both parsers' calls are checked to agree (names and arguments) on every output.

    python benchmarks/bench_tools.py [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

from bench_reasoning import think_text

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_tools
from vllm_k3_plugin.tools import compare
from vllm_k3_plugin.tools.shapes import TOOLS

REPLY = "On it."


def output_ids(tokenizer, calls) -> list[int]:
    head = think_text(tokenizer, 512)
    tail = vocab.THINK_END + vocab.RESPONSE_START + REPLY + vocab.RESPONSE_END
    tail += render_tools(calls) + vocab.MESSAGE_END
    return [
        *head,
        *tokenizer.encode(tail, add_special_tokens=False),
        vocab.END_OF_MSG_ID,
    ]


def many_calls(n: int) -> list:
    return [
        ("get_weather", {"city": f"City number {i}", "days": i % 7, "metric": True})
        for i in range(n)
    ]


def big_argument(size: int) -> list:
    line = 'def f(x):  # "quoted" \\ path\n    return x * 2\n'
    content = (line * (size // len(line) + 1))[:size]
    return [("write_file", {"path": "src/big.py", "content": content})]


class Run:
    """One request's parser, stepped as the serving layer steps it."""

    def __init__(self, parser_cls, tokenizer, request, prompt) -> None:
        self.parser = compare.new_parser(parser_cls, tokenizer, request, thinking=True)
        self.request = request
        self.prompt = prompt
        # Argument pieces kept in lists: joining a growing string per token would
        # time the harness, not the parser.
        self.names: dict[int, str] = {}
        self.pieces: dict[int, list[str]] = {}
        self.first_args_step: int | None = None

    def step(self, index: int, text: str, ids: list[int], finished: bool) -> None:
        delta = self.parser.parse_delta(
            text, ids, self.request, prompt_token_ids=self.prompt, finished=finished
        )
        for call in (delta.tool_calls if delta else None) or ():
            pieces = self.pieces.setdefault(call.index, [])
            function = call.function
            if function is None:
                continue
            if function.name:
                self.names[call.index] = self.names.get(call.index, "") + function.name
            if function.arguments:
                pieces.append(function.arguments)
                if self.first_args_step is None:
                    self.first_args_step = index

    def result(self) -> list[tuple[str, str]]:
        return [
            (self.names.get(i, ""), "".join(self.pieces[i]))
            for i in sorted(self.pieces)
        ]


def stream(parser_cls, bench, ids, deltas, request, *, tail: int | None) -> dict:
    """Seconds per token over the timed steps; ``tail`` times only the last ones."""
    run = Run(parser_cls, bench.tokenizer, request, bench.prompt)
    last = len(ids) - 1
    start_at = 0 if tail is None else max(0, len(ids) - tail)
    if start_at:
        run.step(0, "".join(deltas[:start_at]), list(ids[:start_at]), False)
    clock = time.perf_counter
    begin = clock()
    for i in range(start_at, len(ids)):
        run.step(i, deltas[i], [ids[i]], i == last)
    elapsed = clock() - begin
    return {
        "us_per_token": elapsed / (len(ids) - start_at) * 1e6,
        "calls": run.result(),
        "first_args_at": (
            None if run.first_args_step is None else run.first_args_step / len(ids)
        ),
    }


class Bench:
    def __init__(self, max_full_tokens: int, tail: int) -> None:
        self.tokenizer = compare.load_tokenizer()
        self.ours = compare.our_parser_cls("kimi_k3")
        self.ours_text = compare.text_only(self.ours)
        self.in_tree = compare.in_tree_parser_cls("kimi_k3")
        self.prompt = compare.prompt_ids(self.tokenizer, True)
        self.max_full_tokens = max_full_tokens
        self.tail = tail

    def measure(self, label: str, calls: list) -> dict:
        ids = output_ids(self.tokenizer, calls)
        deltas = compare.delta_texts(self.tokenizer, ids)
        request = compare.chat_request(len(ids) + 16, tools=TOOLS)
        expected = [
            (name, json.dumps(args, ensure_ascii=False)) for name, args in calls
        ]
        row = {"output": label, "tokens": len(ids), "characters": len("".join(deltas))}
        parsers = (
            ("ours", self.ours),
            ("ours_text", self.ours_text),
            ("in_tree", self.in_tree),
        )
        for name, cls in parsers:
            tail = stream(cls, self, ids, deltas, request, tail=self.tail)
            full = (
                stream(cls, self, ids, deltas, request, tail=None)
                if name != "in_tree" or len(ids) <= self.max_full_tokens
                else None
            )
            for reading in (tail, full):
                if reading is not None and reading["calls"] != expected:
                    raise SystemExit(f"{name} misread {label}")
            row[f"{name}_tail_us"] = tail["us_per_token"]
            row[f"{name}_stream_us"] = full["us_per_token"] if full else None
            row[f"{name}_first_args_at"] = (full or tail)["first_args_at"]
        return row


def print_table(rows: list[dict], header: str, tail: int) -> None:
    print(header + "\n")
    print(
        "Reasoning + tool calls, one `parse_delta` per token, µs per token "
        f"(whole stream; and the last {tail} tokens):\n"
    )
    print(
        "| output | tokens | in-tree stream | ours stream | ours, text alone "
        "| ids / text | in-tree tail | ours tail "
        "| tail in-tree / ours | first argument text at (in-tree / ours) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        tree_stream = r["in_tree_stream_us"]
        print(
            f"| {r['output']} | {r['tokens']} "
            f"| {'-' if tree_stream is None else f'{tree_stream:.1f}'} "
            f"| {r['ours_stream_us']:.1f} | {r['ours_text_stream_us']:.1f} "
            f"| {r['ours_stream_us'] / r['ours_text_stream_us']:.2f} "
            f"| {r['in_tree_tail_us']:.1f} "
            f"| {r['ours_tail_us']:.1f} "
            f"| {r['in_tree_tail_us'] / r['ours_tail_us']:.1f}x "
            f"| {r['in_tree_first_args_at']:.1%} / {r['ours_first_args_at']:.1%} |"
        )
    print(
        "\n'-': not streamed whole (quadratic; see the tail). 'first argument text "
        "at': how much of the output was generated when the client saw its first "
        "argument text. 'text alone': ours reading the structure from the text, not "
        "the ids. All returned the same calls for every output."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 10, 50, 200])
    parser.add_argument(
        "--argument-bytes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000]
    )
    parser.add_argument("--max-full-tokens", type=int, default=50_000)
    parser.add_argument("--tail", type=int, default=1000)
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args(argv)

    # The argument pieces are kept to check the calls: time with the collector off.
    gc.disable()
    bench = Bench(args.max_full_tokens, args.tail)
    cases = [(f"{n} call{'s' if n != 1 else ''}", many_calls(n)) for n in args.calls]
    cases += [
        (f"1 call, {size:,} B string", big_argument(size))
        for size in args.argument_bytes
    ]
    rows = []
    for label, calls in cases:
        rows.append(bench.measure(label, calls))
        print(f"  measured {label}", file=sys.stderr, flush=True)
    import vllm

    header = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, vLLM {vllm.__version__}"
    )
    print_table(rows, header, args.tail)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": header, "rows": rows}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
