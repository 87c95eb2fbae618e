"""``vllm-k3``: capture raw Kimi-K3 outputs from a server, and replay them through the
readers (ours, and vLLM's in-tree ones).

    vllm-k3 capture --base-url URL --requests FILE.jsonl --out RAW.jsonl
    vllm-k3 replay [RAW.jsonl] [--against vllm] [--show N] [--report OUT.json]

``replay`` with no file replays the built-in corpus of recorded shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

DESCRIPTION = (
    "Capture what a Kimi-K3 server's model wrote (every marker kept), and replay "
    "it through the plugin's readers and, with --against vllm, vLLM's in-tree "
    "ones: where each reply's reasoning, content and tool calls land, streamed "
    "and whole. 'vllm-k3 replay' with no file replays a built-in corpus."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-k3",
        description=DESCRIPTION,
        epilog="'vllm-k3 capture --help' and 'vllm-k3 replay --help' list each "
        "command's options.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    capture = commands.add_parser(
        "capture", help="the model's raw K3 text for chat requests, from a server"
    )
    capture.add_argument("--base-url", required=True, help="e.g. http://localhost:8000")
    capture.add_argument(
        "--requests", required=True, type=Path, help="JSONL of chat bodies"
    )
    capture.add_argument("--out", required=True, type=Path, help="JSONL to append to")
    capture.add_argument("--concurrency", type=int, default=8)
    capture.add_argument("--model", help="served model name (default: the server's)")
    capture.add_argument("--no-progress", action="store_true")

    replay = commands.add_parser(
        "replay", help="read raw outputs through the readers and summarize"
    )
    replay.add_argument(
        "file", nargs="?", type=Path, help="capture JSONL (default: built-in)"
    )
    replay.add_argument(
        "--against", choices=["vllm"], help="also read with vLLM's in-tree parsers"
    )
    replay.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="print the first N outputs vLLM reads differently",
    )
    replay.add_argument(
        "--report",
        type=Path,
        help="write the summary as JSON here (default for a file: FILE.replay.json)",
    )
    replay.add_argument(
        "--tokenizer",
        type=Path,
        help="checkpoint directory whose tokenizer vLLM's parsers use (default: the "
        "built-in one with the real K3 tokenizer)",
    )
    return parser


def _capture(args: argparse.Namespace) -> int:
    from vllm_k3_plugin.tools.capture import CaptureError, capture

    try:
        count = asyncio.run(
            capture(
                args.base_url,
                args.requests,
                args.out,
                concurrency=args.concurrency,
                model=args.model,
                progress=not args.no_progress,
            )
        )
    except CaptureError as error:
        print(f"vllm-k3 capture: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vllm-k3 capture: interrupted; run again to resume", file=sys.stderr)
        return 130
    print(f"captured {count} outputs into {args.out}", file=sys.stderr)
    return 0


def _replay(args: argparse.Namespace) -> int:
    from vllm_k3_plugin.tools import replay

    summary = replay.Summary(args.against == "vllm")
    if args.file is None:
        outputs = replay.builtin_corpus()
        source = "the built-in corpus"
    else:
        outputs = replay.file_outputs(args.file, summary.malformed)
        source = str(args.file)
    try:
        against = replay.VllmReader(args.tokenizer) if args.against else None
        replay.replay(outputs, against=against, show=args.show, summary=summary)
    except replay.ReplayError as error:
        print(f"vllm-k3 replay: {error}", file=sys.stderr)
        return 2
    print(replay.format_summary(summary, source))
    report = args.report
    if report is None and args.file is not None:
        report = args.file.with_name(args.file.name + ".replay.json")
    if report is not None:
        replay.write_report(summary, report)
        print(f"report: {report}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "capture":
        return _capture(args)
    return _replay(args)


if __name__ == "__main__":
    raise SystemExit(main())
