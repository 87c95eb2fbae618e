"""Streaming lag: the most characters the model has written that the client has not
been sent, over the project's corpora, read one token at a time as the engine hands
them over.

After each token the reader says what it holds that may still reach the client
(``OutputReader.held_chars``: a tag being read, a marker's start, whitespace whose
place is undecided, a call's name before the call is confirmed) and, apart, a typed
argument value held to its closer (``held_value_chars``: rule 8 sends it as JSON once
whole). Not counted: think text held under the ``hold-back`` policy (the documented
decision; the default policy is run here) and the control atoms themselves.

Corpora: the built-in shapes (``vllm_k3_plugin.tools.shapes``, the wild shapes, the
contract's edge cases and the other engines' runaway openers), the tool outputs of
``bench_tools.py`` (50 calls with small typed arguments; one 10 KB string argument)
and a 2048-token thought. The goal is a lag no longer than the longest tag K3
writes (``xtml.MAX_TAG_CHARS``).

    python benchmarks/bench_lag.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Iterator

from bench_tools import big_argument, many_calls

from vllm_k3_plugin.format import marked, vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.output import OutputReader
from vllm_k3_plugin.format.xtml import MAX_TAG_CHARS, render_tools
from vllm_k3_plugin.tools.shapes import SHAPES, output_ids
from vllm_k3_plugin.tools.tokenizer import load_tiktoken_encoding

WORDS = ("the", "weather", "in", "each", "city", "then", "compare", "the", "days")


def token_chunks(encoding, ids: list[int]) -> Iterator[tuple[str, list[int]]]:
    """One ``(text, [id])`` per token; a character split across tokens comes with
    the token that completes it (as the engine's incremental detokenizer)."""
    pending = b""
    for token in ids:
        if token == vocab.END_OF_MSG_ID:
            yield "", [token]
            continue
        pending += encoding.decode_single_token_bytes(token)
        try:
            text = pending.decode("utf-8")
        except UnicodeDecodeError:
            yield "", [token]
            continue
        pending = b""
        yield text, [token]


def corpus() -> Iterator[tuple[str, str, Channel]]:
    """``(name, output, start)``: outputs as the model writes them."""
    for name, shape in SHAPES.items():
        yield name, shape.output, Channel.THINK if shape.thinking else Channel.RESPONSE
    thought = " ".join(WORDS[i % len(WORDS)] for i in range(2048)) + "."
    head = thought + vocab.THINK_END + vocab.RESPONSE_START + "On it."
    head += vocab.RESPONSE_END
    for name, calls in (
        ("50 calls", many_calls(50)),
        ("1 call, 10,000 B string", big_argument(10_000)),
    ):
        yield name, head + render_tools(calls) + vocab.MESSAGE_END, Channel.THINK
    yield "2048-word thought", head + vocab.MESSAGE_END, Channel.THINK


def lag(encoding, atoms_for, output: str, start: Channel) -> tuple[int, int]:
    """The most characters held at once, but typed values; and typed values."""
    reader = OutputReader(start, atoms=atoms_for())
    most = most_value = 0
    for text, ids in token_chunks(encoding, output_ids(output, stop=True)):
        reader.feed(text, ids)
        most = max(most, reader.held_chars)
        most_value = max(most_value, reader.held_value_chars)
    reader.finish(stopped=True)
    return most, most_value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    encoding = load_tiktoken_encoding()
    tokens = marked.AtomTokens(lambda ids: encoding.decode(list(ids)))

    def atoms_for():
        return marked.IdAtoms(tokens)

    rows = []
    for name, output, start in corpus():
        held, held_value = lag(encoding, atoms_for, output, start)
        rows.append({"output": name, "held": held, "typed_value_held": held_value})
    print(f"{platform.machine()}, Python {platform.python_version()}")
    print(f"\nLongest tag K3 writes: {MAX_TAG_CHARS} characters.\n")
    print("| output | most characters held | typed argument value held |")
    print("|---|---:|---:|")
    for row in rows:
        print(f"| {row['output']} | {row['held']} | {row['typed_value_held']} |")
    worst = max(rows, key=lambda row: row["held"])
    print(f"\nMost held over the corpora: {worst['held']} ({worst['output']}).")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"max_tag_chars": MAX_TAG_CHARS, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
