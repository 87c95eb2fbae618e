"""Per-token cost of reading K3 outputs: our ``kimi_k3`` parser against vLLM's in-tree
one, driven as vLLM's chat serving drives them, in one process.

Streaming: one ``parse_delta`` per token (text from the incremental detokenizer,
prepared before timing), ``finished`` on the last, for outputs whose think channel is
2k to 128k tokens long. Whole: ``parse`` of the same output, against the sans-I/O
reader alone and against one bare ``finditer`` pass of a compiled regex of the markers
over the same text.

    python benchmarks/bench_reasoning.py [--sizes 2048 8192 32768 131072] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import time
from collections.abc import Callable
from functools import partial

from vllm_k3_plugin import compare, vocab
from vllm_k3_plugin.reasoning_reader import read_whole

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


def time_stream(parser_cls, tokenizer, ids, deltas, request) -> tuple[float, float]:
    """Seconds for the whole stream, and for its last 10% of steps."""
    parser = parser_cls(tokenizer, None, chat_template_kwargs={"thinking": True})
    prompt = compare.prompt_ids(tokenizer, True)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[2048, 8192, 32768, 131072]
    )
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args(argv)

    tokenizer = compare.load_tokenizer()
    in_tree = compare.in_tree_parser_cls()
    ours = compare.our_parser_cls()
    print(
        f"# {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, vLLM {_vllm_version()}\n"
    )
    print("Streaming (one parse_delta per token), µs per token:\n")
    print(
        "| think tokens | in-tree | in-tree, last 10% | ours | ours, last 10% "
        "| in-tree / ours |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    outputs = {}
    for size in args.sizes:
        ids = output_ids(tokenizer, size)
        deltas = compare.delta_texts(tokenizer, ids)
        request = compare.chat_request(len(ids) + 16)
        outputs[size] = (ids, "".join(deltas), request)
        ours_total, ours_tail = time_stream(ours, tokenizer, ids, deltas, request)
        tree_total, tree_tail = time_stream(in_tree, tokenizer, ids, deltas, request)
        n, n_tail = len(ids), len(ids) - int(len(ids) * 0.9)
        row = {
            "think_tokens": size,
            "output_tokens": n,
            "in_tree_us_per_token": tree_total / n * 1e6,
            "in_tree_tail_us_per_token": tree_tail / n_tail * 1e6,
            "ours_us_per_token": ours_total / n * 1e6,
            "ours_tail_us_per_token": ours_tail / n_tail * 1e6,
        }
        rows.append(row)
        print(
            f"| {size} | {row['in_tree_us_per_token']:.1f} "
            f"| {row['in_tree_tail_us_per_token']:.1f} "
            f"| {row['ours_us_per_token']:.1f} | {row['ours_tail_us_per_token']:.1f} "
            f"| {tree_total / ours_total:.1f}x |",
            flush=True,
        )

    print("\nWhole output, µs per token (best of 5):\n")
    print(
        "| think tokens | bare regex pass | our reader | our parse | in-tree parse "
        "| reader / regex | parse / regex |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ids, text, request = outputs[row["think_tokens"]]
        n = len(ids)
        regex = best_of(5, partial(bare_regex_pass, text))
        reader = best_of(5, partial(read_whole, text, stopped=True))
        ours_parse = best_of(
            5, partial(compare.parse_text, ours, tokenizer, text, ids, request)
        )
        tree_parse = best_of(
            5, partial(compare.parse_text, in_tree, tokenizer, text, ids, request)
        )
        row.update(
            regex_us_per_token=regex / n * 1e6,
            reader_us_per_token=reader / n * 1e6,
            ours_parse_us_per_token=ours_parse / n * 1e6,
            in_tree_parse_us_per_token=tree_parse / n * 1e6,
        )
        print(
            f"| {row['think_tokens']} | {regex / n * 1e6:.3f} "
            f"| {reader / n * 1e6:.3f} | {ours_parse / n * 1e6:.3f} "
            f"| {tree_parse / n * 1e6:.3f} | {reader / regex:.1f}x "
            f"| {ours_parse / regex:.1f}x |"
        )
    print(
        "\nAll four read the same decoded text; 'parse' is the whole parser "
        "(prompt state, stop detection, reader), 'reader' the sans-I/O reader alone."
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    raise SystemExit(main())
