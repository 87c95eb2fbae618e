"""What the plugin's metrics cost a streamed output: the kimi_k3 parser driven as
vLLM's chat serving drives it (one ``parse_delta`` a token, ``finished`` on the last,
the output then counted), with ``VLLM_K3_METRICS=1`` beside ``0``, alternating in one
process, the collector off (nothing is kept between outputs).

    python benchmarks/bench_metrics.py [--sizes 64 512 4096]

Prints µs per token with the metrics on and off and their ratio; short outputs show
the per-output counting most.
"""

from __future__ import annotations

import argparse
import gc
import os

from bench_reasoning import streamed_output, time_stream

from vllm_k3_plugin.envs import METRICS_ENV
from vllm_k3_plugin.tools import compare


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    tokenizer = compare.load_tokenizer()
    ours = compare.our_parser_cls()
    prompt = compare.prompt_ids(tokenizer, True)
    print(
        "| think tokens | output tokens | metrics off µs/token | on µs/token | on/off |"
    )
    print("|---:|---:|---:|---:|---:|")
    gc.disable()
    for size in args.sizes:
        ids, deltas, request = streamed_output(tokenizer, size)
        best = {"0": float("inf"), "1": float("inf")}
        for _ in range(args.repeats):
            for setting in best:
                os.environ[METRICS_ENV] = setting
                seconds, _ = time_stream(ours, tokenizer, ids, deltas, request, prompt)
                best[setting] = min(best[setting], seconds)
        off, on = (best[s] / len(ids) * 1e6 for s in ("0", "1"))
        print(f"| {size} | {len(ids)} | {off:.2f} | {on:.2f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
