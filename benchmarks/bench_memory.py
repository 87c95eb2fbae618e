"""What one request's ``ReasoningReader`` holds while a long thought streams.

A thought of ``--tokens`` tokens (default 1M, one word per token) is fed one token at
a time, under each replay policy, and ends one of two ways: the think exit (a thought)
or the answer closer and a stop (a skipped channel, the reply). ``tracemalloc``
measures, with the input prepared before tracing and every returned event dropped as a
client would after sending it:

- **held while undecided**: memory the reader holds just before the channel is
  decided, against the channel's size in characters (the replay copy);
- **held after**: what it still holds once the channel is decided;
- **one late step**: the most one streaming step allocates at its peak, late in the
  thought, against the output so far (a step that copied the output would show it).

    python benchmarks/bench_memory.py [--tokens 1000000] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tracemalloc

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.reasoning import ReasoningReader
from vllm_k3_plugin.format.skipped_channel import ReplayPolicy

WORDS = [
    "the",
    "answer",
    "is",
    "we",
    "need",
    "to",
    "check",
    "whether",
    "first",
    "then",
    "consider",
    "case",
]


def thought(tokens: int) -> list[str]:
    rng = random.Random(0)
    return [" " + rng.choice(WORDS) for _ in range(tokens)]


def measure(policy: ReplayPolicy, deltas: list[str], ending: str) -> dict:
    late = len(deltas) - 2
    ReasoningReader()  # compile the marker set before tracing (once per process)
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    reader = ReasoningReader(start=Channel.THINK, policy=policy)
    step_peak = 0
    for index, delta in enumerate(deltas):
        if index == late:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            reader.feed(delta)
            step_peak = tracemalloc.get_traced_memory()[1] - before
        else:
            reader.feed(delta)
    held_undecided = tracemalloc.get_traced_memory()[0] - baseline
    if ending == "thought":
        reader.feed(vocab.THINK_END + vocab.RESPONSE_START + "Done.")
        reader.finish(stopped=True)
    else:
        reader.feed(vocab.RESPONSE_END + vocab.MESSAGE_END)
        reader.finish(stopped=True)
    held_after = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    del reader
    channel_chars = sum(map(len, deltas))
    return {
        "policy": policy.value,
        "ending": ending,
        "tokens": len(deltas),
        "channel_chars": channel_chars,
        "held_undecided_bytes": held_undecided,
        "held_per_channel_char": held_undecided / channel_chars,
        "held_after_bytes": held_after,
        "late_step_peak_bytes": step_peak,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    deltas = thought(args.tokens)
    rows = []
    for policy in ReplayPolicy:
        for ending in ("thought", "skipped-channel"):
            rows.append(measure(policy, deltas, ending))
            print(f"  measured {policy.value}, {ending}", file=sys.stderr, flush=True)
    chars = rows[0]["channel_chars"]
    print(
        f"A {args.tokens:,}-token thought ({chars:,} characters) fed one token at "
        "a time; tracemalloc:\n"
    )
    print(
        "| policy | ending | held while undecided | per channel character "
        "| held after | one late step, peak |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['ending']} "
            f"| {r['held_undecided_bytes'] / 1e6:.2f} MB "
            f"| {r['held_per_channel_char']:.2f} B "
            f"| {r['held_after_bytes']:,} B | {r['late_step_peak_bytes']:,} B |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
