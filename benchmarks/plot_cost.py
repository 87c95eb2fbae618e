"""Per-token cost against output length, ours and vLLM's in-tree parsers, drawn from
the JSON the benchmark scripts write.

    python benchmarks/bench_reasoning.py --json benchmarks/results/reasoning_cpu.json
    python benchmarks/bench_tools.py --json benchmarks/results/tools_cpu.json
    python benchmarks/plot_cost.py    # -> benchmarks/results/cost_per_token.png

Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--reasoning", type=Path, default=RESULTS / "reasoning_cpu.json"
    )
    parser.add_argument("--tools", type=Path, default=RESULTS / "tools_cpu.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "cost_per_token.png")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reasoning = json.loads(args.reasoning.read_text())
    tools = json.loads(args.tools.read_text())
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    tokens = [row["output_tokens"] for row in reasoning["rows"]]
    left.plot(
        tokens, [r["in_tree_us"] for r in reasoning["rows"]], "o-", label="vLLM in-tree"
    )
    left.plot(
        tokens, [r["ours_us"] for r in reasoning["rows"]], "s-", label="vllm-k3-plugin"
    )
    left.set_title("Reasoning: a long thought, then the reply")

    for label, strings in (("calls", False), ("string argument", True)):
        rows = [r for r in tools["rows"] if ("string" in r["output"]) is strings]
        x = [r["tokens"] for r in rows]
        tree = [r["in_tree_stream_us"] or r["in_tree_tail_us"] for r in rows]
        right.plot(x, tree, "o-", label=f"vLLM in-tree, {label}")
        right.plot(
            x,
            [r["ours_stream_us"] for r in rows],
            "s-",
            label=f"vllm-k3-plugin, {label}",
        )
    right.set_title("Tool calls: 1-200 calls, or one 10 KB-1 MB string")

    for axes in (left, right):
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("output tokens")
        axes.set_ylabel("µs per token (one parse_delta per token)")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(reasoning["machine"], fontsize=9)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
