"""The sans-I/O reader of another checkout against this one, in one process.

The format package imports only itself, so the other checkout's copy is loaded under
another name beside ours, and both read the same outputs one token at a time,
interleaved (A B, B A, ...) with the collector off, in CPU time: the best of
``--repeats`` each, and the median ratio of the pairs. Machine drift falls on both
alike, which two runs of ``bench_reasoning.py`` or
``bench_tools.py`` apart do not give. Outputs: the benchmarks' 32,768-token thought,
their 50- and 200-call tools channels (and 50 calls in a tools channel that
interrupts the thought) and a 100 KB string argument.

    python benchmarks/compare_readers.py OTHER_CHECKOUT [--repeats N]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_lag import token_chunks
from bench_tools import big_argument, many_calls

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_tools
from vllm_k3_plugin.tools.shapes import output_ids
from vllm_k3_plugin.tools.tokenizer import load_tiktoken_encoding

_PACKAGE = "vllm_k3_plugin.format"
_OTHER = "k3_format_other"


def load_other(checkout: Path):
    """The other checkout's format package, importable as ``k3_format_other``."""
    root = Path(tempfile.mkdtemp(prefix="k3_other_"))
    target = root / _OTHER
    shutil.copytree(checkout / "vllm_k3_plugin" / "format", target)
    for source in target.glob("*.py"):
        text = source.read_text()
        source.write_text(re.sub(rf"\b{re.escape(_PACKAGE)}\b", _OTHER, text))
    sys.path.insert(0, str(root))
    return importlib.import_module(f"{_OTHER}.output"), importlib.import_module(
        f"{_OTHER}.marked"
    )


def outputs() -> dict[str, tuple[str, bool]]:
    words = " ".join(("the", "weather", "in", "each", "city", "then")) + "\n"
    thought = words * 4000
    head = thought[:20_000] + vocab.THINK_END + vocab.RESPONSE_START + "On it."
    head += vocab.RESPONSE_END
    return {
        "32k-token thought": (thought + vocab.THINK_END + "Done.", True),
        "50 calls": (head + render_tools(many_calls(50)), True),
        "200 calls": (head + render_tools(many_calls(200)), True),
        "50 calls inside the thought": (
            thought[:20_000] + render_tools(many_calls(50)),
            True,
        ),
        "100 KB string argument": (head + render_tools(big_argument(100_000)), True),
    }


def time_reader(output_module, marked_module, tokens, chunks) -> float:
    reader = output_module.OutputReader(
        output_module.Channel.THINK, atoms=marked_module.IdAtoms(tokens)
    )
    feed = reader.feed
    start = time.process_time()
    for text, ids in chunks:
        feed(text, ids)
    reader.finish(stopped=True)
    return time.process_time() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other checkout's root")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    from vllm_k3_plugin.format import marked, output

    other_output, other_marked = load_other(args.other)
    encoding = load_tiktoken_encoding()
    print(
        "| output | tokens | other, µs/token | this, µs/token | this / other, best "
        "| this / other, median of pairs |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, (text, _) in outputs().items():
        chunks = list(token_chunks(encoding, output_ids(text, stop=False)))
        readers = {
            "other": (other_output, other_marked),
            "this": (output, marked),
        }
        tokens = {
            key: module.AtomTokens(lambda ids: encoding.decode(list(ids)))
            for key, (_, module) in readers.items()
        }
        best = dict.fromkeys(readers, float("inf"))
        ratios = []
        order = list(readers)
        gc.disable()
        try:
            for _ in range(args.repeats):
                took = {}
                for key in order:
                    output_module, marked_module = readers[key]
                    took[key] = time_reader(
                        output_module, marked_module, tokens[key], chunks
                    )
                    best[key] = min(best[key], took[key])
                    gc.collect()
                ratios.append(took["this"] / took["other"])
                order.reverse()  # A B, B A, ...: neither goes always first
        finally:
            gc.enable()
        per = {key: best[key] / len(chunks) * 1e6 for key in best}
        print(
            f"| {name} | {len(chunks)} | {per['other']:.2f} | {per['this']:.2f} "
            f"| {per['this'] / per['other']:.2f} | {statistics.median(ratios):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
