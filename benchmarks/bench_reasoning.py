"""Per-token cost of reading K3 outputs: our ``kimi_k3`` parser against vLLM's in-tree
one, driven as vLLM's chat serving drives them, in one process.

Streaming: one ``parse_delta`` per token (text from the incremental detokenizer,
prepared before timing), ``finished`` on the last, for outputs whose think channel is
2k to 128k tokens long; ours reads the structure from the token ids, and is timed
beside itself reading from text alone (what reading the ids costs). The garbage
collector is off while timing. Whole: ``parse`` of the same output, against the sans-I/O
reader alone and against one bare ``finditer`` pass of a compiled regex of the markers
over the same text.

    python benchmarks/bench_reasoning.py [--sizes 2048 8192 32768 131072] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import ReasoningReader, read_whole
from vllm_k3_plugin.tools import compare

THOUGHT_WORDS = (
    "the answer is we need to check whether first then consider case value sum of "
    "each term so it follows that hence result equals two four 12 37 , . ; :"
)
WORDS = THOUGHT_WORDS.split()
REPLY = "The answer is 4."
MARKER_PATTERN = re.compile(
    "|".join(
        re.escape(marker)
        for marker in sorted(set(vocab.REASONING_MARKERS), key=len, reverse=True)
    )
)


def think_text(tokenizer, n_tokens: int, seed: int = 0) -> list[int]:
    """Ids of a think channel of about ``n_tokens`` tokens, lines of random words."""
    rng = random.Random(seed)
    lines = []
    ids: list[int] = []
    while len(ids) < n_tokens:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "\n"
        lines.append(line)
        if len(lines) % 256 == 0:
            ids = tokenizer.encode("".join(lines), add_special_tokens=False)
    return tokenizer.encode("".join(lines), add_special_tokens=False)[:n_tokens]


def output_ids(tokenizer, n_think: int) -> list[int]:
    tail = vocab.THINK_END + vocab.RESPONSE_START + REPLY + vocab.RESPONSE_END
    tail += vocab.MESSAGE_END
    return [
        *think_text(tokenizer, n_think),
        *tokenizer.encode(tail, add_special_tokens=False),
        vocab.END_OF_MSG_ID,
    ]


def streamed_output(tokenizer, n_think: int) -> tuple[list[int], list[str], Any]:
    """A think channel of about ``n_think`` tokens and the reply: its ids, the text
    the incremental detokenizer hands over per token, and a request that fits it."""
    ids = output_ids(tokenizer, n_think)
    deltas = compare.delta_texts(tokenizer, ids)
    return ids, deltas, compare.chat_request(len(ids) + 16)


def time_stream(
    parser_cls, tokenizer, ids, deltas, request, prompt
) -> tuple[float, float]:
    """Seconds for the whole stream, and for its last 10% of steps."""
    parser = compare.new_parser(parser_cls, tokenizer, request, thinking=True)
    last = len(ids) - 1
    tail_from = int(len(ids) * 0.9)
    clock = time.perf_counter
    start = clock()
    tail_start = start
    for i in range(len(ids)):
        if i == tail_from:
            tail_start = clock()
        parser.parse_delta(
            deltas[i], [ids[i]], request, prompt_token_ids=prompt, finished=i == last
        )
    end = clock()
    return end - start, end - tail_start


def feed_reader(deltas: list[str]) -> None:
    """The sans-I/O reader alone, fed the same per-token text."""
    reader = ReasoningReader(start=Channel.THINK)
    for text in deltas:
        reader.feed(text)
    reader.finish(stopped=True)


def best_of(repeats: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def bare_regex_pass(text: str) -> int:
    count = 0
    for _ in MARKER_PATTERN.finditer(text):
        count += 1
    return count


class Bench:
    """Both parsers on one tokenizer, the prompt prepared once."""

    def __init__(self) -> None:
        self.tokenizer = compare.load_tokenizer()
        self.in_tree = compare.in_tree_parser_cls()
        self.ours = compare.our_parser_cls()
        self.ours_text = compare.text_only(self.ours)
        self.prompt = compare.prompt_ids(self.tokenizer, True)

    def parse(self, parser_cls, text, ids, request) -> None:
        compare.parse_text(
            parser_cls, self.tokenizer, text, ids, request, prompt=self.prompt
        )

    def time_stream(self, parser_cls, ids, deltas, request) -> tuple[float, float]:
        return time_stream(
            parser_cls, self.tokenizer, ids, deltas, request, self.prompt
        )

    def streaming(self, size: int) -> dict:
        ids, deltas, request = streamed_output(self.tokenizer, size)
        ours, ours_tail = self.time_stream(self.ours, ids, deltas, request)
        # Best of two each, alternating: the ids/text ratio is the figure to trust.
        text_only, _ = self.time_stream(self.ours_text, ids, deltas, request)
        ours = min(ours, self.time_stream(self.ours, ids, deltas, request)[0])
        text_only = min(
            text_only, self.time_stream(self.ours_text, ids, deltas, request)[0]
        )
        tree, tree_tail = self.time_stream(self.in_tree, ids, deltas, request)
        reader = best_of(3, partial(feed_reader, deltas))
        n, n_tail = len(ids), len(ids) - int(len(ids) * 0.9)
        text = "".join(deltas)
        return {
            "think_tokens": size,
            "output_tokens": n,
            "in_tree_us": tree / n * 1e6,
            "in_tree_tail_us": tree_tail / n_tail * 1e6,
            "ours_us": ours / n * 1e6,
            "ours_tail_us": ours_tail / n_tail * 1e6,
            "ours_text_only_us": text_only / n * 1e6,
            "reader_streamed_us": reader / n * 1e6,
            **self.whole(text, ids, request, per=n),
        }

    def whole(self, text, ids, request, *, per: int) -> dict:
        """Whole-output reads, best of 5, in µs divided by ``per``."""
        scale = 1e6 / per
        return {
            "regex_whole_us": best_of(5, partial(bare_regex_pass, text)) * scale,
            "reader_whole_us": best_of(5, partial(read_whole, text, stopped=True))
            * scale,
            "ours_whole_us": best_of(
                5, partial(self.parse, self.ours, text, ids, request)
            )
            * scale,
            "in_tree_whole_us": best_of(
                3, partial(self.parse, self.in_tree, text, ids, request)
            )
            * scale,
        }

    def dense_markers(self) -> dict:
        """A whole output of about 1.08M characters holding 32,768 framing markers."""
        unit = "some words in the thought " + vocab.SEP
        text = unit * 32768 + vocab.THINK_END + vocab.RESPONSE_START + REPLY
        text += vocab.RESPONSE_END + vocab.MESSAGE_END
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids.append(vocab.END_OF_MSG_ID)
        request = compare.chat_request(len(ids) + 16)
        return {"characters": len(text), **self.whole(text, ids, request, per=1000)}


def print_tables(rows: list[dict], dense: dict, header: str) -> None:
    print(header + "\n")
    print("Streaming, one `parse_delta` per token, µs per token:\n")
    print(
        "| think tokens | in-tree | in-tree, last 10% | ours | ours, last 10% "
        "| in-tree / ours | ours, text alone | ids / text | our reader alone |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['think_tokens']} | {r['in_tree_us']:.1f} "
            f"| {r['in_tree_tail_us']:.1f} | {r['ours_us']:.1f} "
            f"| {r['ours_tail_us']:.1f} "
            f"| {r['in_tree_us'] / r['ours_us']:.1f}x | {r['ours_text_only_us']:.1f} "
            f"| {r['ours_us'] / r['ours_text_only_us']:.2f} "
            f"| {r['reader_streamed_us']:.2f} |"
        )
    print("\nWhole output, best of 5, µs per token:\n")
    print(
        "| think tokens | bare regex pass | our reader | our `parse` | in-tree `parse` "
        "| reader / regex | `parse` / regex |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['think_tokens']} | {r['regex_whole_us']:.4f} "
            f"| {r['reader_whole_us']:.4f} | {r['ours_whole_us']:.4f} "
            f"| {r['in_tree_whole_us']:.4f} "
            f"| {r['reader_whole_us'] / r['regex_whole_us']:.1f}x "
            f"| {r['ours_whole_us'] / r['regex_whole_us']:.1f}x |"
        )
    print(
        f"\nWhole output of {dense['characters']:,} characters holding 32,768 framing "
        "markers, ms:\n"
    )
    print("| bare regex pass | our reader | our `parse` | in-tree `parse` |")
    print("|---:|---:|---:|---:|")
    print(
        f"| {dense['regex_whole_us']:.1f} | {dense['reader_whole_us']:.1f} "
        f"| {dense['ours_whole_us']:.1f} | {dense['in_tree_whole_us']:.1f} |"
    )
    print(
        "\nAll read the same prepared text. `parse` is the whole combined parser "
        "(prompt state, stop detection, reader); 'reader' is the sans-I/O reader alone."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[2048, 8192, 32768, 131072]
    )
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args(argv)

    gc.disable()
    bench = Bench()
    rows = []
    for size in args.sizes:
        rows.append(bench.streaming(size))
        print(f"  measured {size} think tokens", file=sys.stderr, flush=True)
    dense = bench.dense_markers()
    import vllm

    header = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, vLLM {vllm.__version__}"
    )
    print_tables(rows, dense, header)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": header, "rows": rows, "dense": dense}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
