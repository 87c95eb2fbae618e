"""``vllm-k3``: capture raw Kimi-K3 outputs from a server, and replay them through the
readers (ours, and vLLM's in-tree ones).

    vllm-k3 capture --base-url URL --requests FILE.jsonl --out RAW.jsonl [--api-key KEY]
    vllm-k3 replay [RAW.jsonl] [--against vllm] [--show N] [--report OUT.json]

``replay`` with no file replays the built-in corpus of recorded shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from vllm_k3_plugin.tools.capture import API_KEY_ENV, CaptureError, capture

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
        "capture",
        help="the model's raw K3 text for chat requests, from a server",
        description="Send each saved chat request to a running vLLM server and "
        "write what its model generated, every K3 marker kept, one JSON line per "
        "request. Run again to resume an interrupted capture.",
    )
    capture.add_argument("--base-url", required=True, help="e.g. http://localhost:8000")
    capture.add_argument(
        "--requests",
        required=True,
        type=Path,
        metavar="FILE.jsonl",
        help="the requests to capture: one chat completions request body per line, "
        "as a client sent it to /v1/chat/completions (messages, tools, sampling "
        "options; an optional 'id' names the line). vLLM keeps no record of the "
        "requests it served: save them from your clients or gateway",
    )
    capture.add_argument("--out", required=True, type=Path, help="JSONL to append to")
    capture.add_argument("--concurrency", type=int, default=8)
    capture.add_argument("--model", help="served model name (default: the server's)")
    capture.add_argument("--no-progress", action="store_true")
    capture.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        metavar="KEY",
        help="the key of a server started with --api-key, sent as 'Authorization: "
        f"Bearer KEY' (default: {API_KEY_ENV} from the environment; unset: no key)",
    )

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
    try:
        count = asyncio.run(
            capture(
                args.base_url,
                args.requests,
                args.out,
                concurrency=args.concurrency,
                model=args.model,
                progress=not args.no_progress,
                api_key=args.api_key,
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
