"""``python -m vllm_k3_plugin.demo``: the built-in K3 output shapes through vLLM's
in-tree ``kimi_k3`` parser and through ours, side by side.

Every shape is encoded with the real Kimi tokenizer, ended once by the stop token and
once by a ``max_tokens`` cut, and read streamed (one ``parse_delta`` per token) and
whole (``parse``), as vLLM's chat completions endpoint reads it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from vllm_k3_plugin import compare, vocab
from vllm_k3_plugin.shapes import SHAPES, TOOLS

ENDINGS = ("stop", "cut")


def _short(text: str, width: int) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 4] + "...'"


def _calls(calls: tuple[tuple[str, str], ...]) -> str:
    return ", ".join(f"{name}({args})" for name, args in calls) or "-"


def read_shape(parser_cls: type, tokenizer: Any, name: str, ending: str):
    output, thinking, _ = SHAPES[name]
    ids = tokenizer.encode(output, add_special_tokens=False)
    if ending == "stop":
        ids.append(vocab.END_OF_MSG_ID)
    request = compare.chat_request(
        len(ids) + 16 if ending == "stop" else len(ids), tools=TOOLS
    )
    whole = compare.parse_whole(parser_cls, tokenizer, ids, request, thinking=thinking)
    streamed = compare.parse_streamed(
        parser_cls, tokenizer, ids, request, thinking=thinking
    )
    return whole, streamed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=30, help="column width")
    args = parser.parse_args(argv)

    tokenizer = compare.load_tokenizer()
    readers = {
        "vLLM in-tree": compare.in_tree_parser_cls("kimi_k3"),
        "vllm-k3-plugin": compare.our_parser_cls("kimi_k3"),
    }
    width = args.width
    header = f"  {'':24}{'reasoning':{width}} {'content':{width}} tool calls"
    lost = 0
    split = dict.fromkeys(readers, 0)
    for name, shape in SHAPES.items():
        for ending in ENDINGS:
            print(f"\n{name} ({ending}): {shape.note}")
            print(header)
            contents = {}
            for label, parser_cls in readers.items():
                whole, streamed = read_shape(parser_cls, tokenizer, name, ending)
                contents[label] = whole.content
                rows = (
                    [("", whole)]
                    if whole == streamed
                    else [
                        (" whole", whole),
                        (" streamed", streamed),
                    ]
                )
                split[label] += whole != streamed
                for suffix, parsed in rows:
                    print(
                        f"  {(label + suffix):24}"
                        f"{_short(parsed.reasoning, width):{width}} "
                        f"{_short(parsed.content, width):{width}} "
                        f"{_calls(parsed.tool_calls)}"
                    )
            if not contents["vLLM in-tree"] and contents["vllm-k3-plugin"]:
                lost += 1
                print("  -> vLLM returns no content; the plugin recovers the reply")
    print(
        f"\n{len(SHAPES) * len(ENDINGS)} readings: {lost} replies lost by vLLM's "
        "in-tree parser and recovered by the plugin; streamed and whole differ in "
        f"{split['vLLM in-tree']} for vLLM's parser, {split['vllm-k3-plugin']} for "
        "the plugin's."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
