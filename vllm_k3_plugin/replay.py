"""``vllm-k3 replay``: raw K3 outputs through our readers, and optionally vLLM's.

Every output is read whole and streamed at several chunkings by our readers (plain
Python, no vLLM import), classified by how it ended, and checked for streamed/whole
agreement. With ``against_vllm`` it is also read by vLLM's in-tree ``kimi_k3``
reasoning and tool parsers, driven as chat completions drives them (streamed one
token at a time, and whole), and the differences are counted by kind.

The file is streamed: memory does not grow with the number of outputs.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from vllm_k3_plugin import vocab
from vllm_k3_plugin.capture import iter_records
from vllm_k3_plugin.reasoning_reader import (
    Channel,
    ReasoningReader,
    ToolMarkup,
    collect,
)
from vllm_k3_plugin.tool_reader import ToolCallReader, collect_calls

SHAPES_IN_ORDER = (
    "answered",
    "skipped channel recovered",
    "thought only",
    "cut at max_tokens",
    "tool calls",
    "empty",
)
_LEAKS = (vocab.OPEN, vocab.CLOSE, vocab.SEP, vocab.END_OF_MSG)


class ReplayError(Exception):
    """A clear, user-facing failure (missing or empty file)."""


class Output(NamedTuple):
    id: str
    text: str
    finish_reason: str
    thinking: bool
    token_ids: list[int] | None = None


class Read(NamedTuple):
    reasoning: str
    content: str
    calls: tuple[tuple[str, str], ...]
    replayed: bool


def read_output(output: Output, chunks: Iterable[str]) -> Read:
    """Our readers, fed ``chunks`` of ``output.text``."""
    start = Channel.THINK if output.thinking else Channel.RESPONSE
    reader = ReasoningReader(start=start)
    tools = ToolCallReader()
    events: list = []
    tool_events: list = []
    for chunk in chunks:
        events += reader.feed(chunk)
    events += reader.finish(stopped=output.finish_reason == "stop")
    for event in events:
        if type(event) is ToolMarkup:
            tool_events += tools.feed(event.text)
    tool_events += tools.finish()
    reading = collect(events)
    calls = tuple((c.name, c.arguments) for c in collect_calls(tool_events))
    return Read(reading.reasoning, reading.content, calls, reader.replayed)


SMALL_CHUNKS_UP_TO = 4096


def chunkings(text: str, seed: int) -> Iterator[list[str]]:
    """The streamed chunkings every output is read at, besides whole: 64-character
    chunks, 5-character chunks (outputs up to ``SMALL_CHUNKS_UP_TO`` characters, to
    keep a large replay fast), and 31 random cuts."""
    yield [text[i : i + 64] for i in range(0, len(text), 64)] or [""]
    if len(text) <= SMALL_CHUNKS_UP_TO:
        yield [text[i : i + 5] for i in range(0, len(text), 5)] or [""]
    if len(text) > 1:
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 31)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def shape_of(output: Output, read: Read) -> str:
    if output.finish_reason == "length":
        return "cut at max_tokens"
    if read.calls:
        return "tool calls"
    if read.replayed:
        return "skipped channel recovered"
    if read.content:
        return "answered"
    if read.reasoning:
        return "thought only"
    return "empty"


def builtin_corpus() -> Iterator[Output]:
    """The recorded shapes of ``shapes.py``, each ended by a stop and by a cut."""
    from vllm_k3_plugin.shapes import SHAPES

    for name, shape in SHAPES.items():
        for finish in ("stop", "length"):
            yield Output(f"{name} ({finish})", shape.output, finish, shape.thinking)


def file_outputs(path: Path, malformed: list[str]) -> Iterator[Output]:
    if not path.exists():
        raise ReplayError(f"{path}: no such file")
    if path.is_dir():
        raise ReplayError(f"{path}: is a directory, not a capture file")
    count = 0
    for number, record, error in iter_records(path):
        if error is not None:
            malformed.append(f"{path}:{number}: {error}")
            continue
        count += 1
        yield Output(
            str(record.get("id", f"line-{number}")),
            record["text"],
            str(record.get("finish_reason") or "stop"),
            _flag(record.get("thinking", True)),
            record.get("token_ids"),
        )
    if count == 0 and not malformed:
        raise ReplayError(f"{path}: empty (no outputs to replay)")


def _flag(value: Any) -> bool:
    """A JSON boolean; the strings "true"/"false" read as such."""
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "")
    return bool(value)


class VllmReader:
    """vLLM's in-tree ``kimi_k3`` parsers, streamed per token and whole."""

    def __init__(self, tokenizer_dir: Path | None = None) -> None:
        from vllm_k3_plugin import compare

        self._compare = compare
        self.tokenizer = compare.load_tokenizer(tokenizer_dir)
        self.parser_cls = compare.in_tree_parser_cls("kimi_k3")

    def read(self, output: Output, called: Iterable[str]) -> tuple[Read, Read]:
        compare = self._compare
        ids = output.token_ids
        if not ids:
            ids = self.tokenizer.encode(output.text, add_special_tokens=False)
            if output.finish_reason == "stop":
                ids = [*ids, vocab.END_OF_MSG_ID]
        # The request declares the tools the output calls, as the client's would.
        tools = [
            {"type": "function", "function": {"name": name, "parameters": {}}}
            for name in dict.fromkeys(called)
        ]
        max_tokens = len(ids) if output.finish_reason == "length" else len(ids) + 16
        request = compare.chat_request(max_tokens, tools=tools or None)
        args = (self.parser_cls, self.tokenizer, ids, request)
        whole = compare.parse_whole(*args, thinking=output.thinking)
        streamed = compare.parse_streamed(*args, thinking=output.thinking)
        return _as_read(whole), _as_read(streamed)


def _as_read(parsed: Any) -> Read:
    return Read(parsed.reasoning, parsed.content, tuple(parsed.tool_calls), False)


def difference(ours: Read, theirs: Read) -> str | None:
    """How vLLM's reading differs from ours, or ``None``."""
    if ours[:3] == theirs[:3]:
        return None
    if ours.content.strip() and not theirs.content.strip():
        return "reply lost"
    leaked = any(m in theirs.content or m in theirs.reasoning for m in _LEAKS)
    if leaked and not any(m in ours.content or m in ours.reasoning for m in _LEAKS):
        return "markers in reasoning or content"
    if ours.calls != theirs.calls:
        return "tool calls differ"
    if ours.reasoning.strip() and not theirs.reasoning.strip():
        return "reasoning lost"
    return "other"


class Summary:
    def __init__(self, against_vllm: bool) -> None:
        self.outputs = 0
        self.shapes: Counter[str] = Counter()
        self.ours_split: list[str] = []
        self.against_vllm = against_vllm
        self.vllm_differs: Counter[str] = Counter()
        self.vllm_split: list[str] = []
        self.shown: list[tuple[Output, Read, Read, str]] = []
        self.malformed: list[str] = []
        self.elapsed_s = 0.0

    def report(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "outputs": self.outputs,
            "shapes": {shape: self.shapes[shape] for shape in SHAPES_IN_ORDER},
            "streamed_vs_whole_disagree": len(self.ours_split),
            "disagreeing_ids": self.ours_split,
            "malformed_lines": self.malformed,
            "elapsed_s": round(self.elapsed_s, 3),
        }
        if self.against_vllm:
            report["vllm"] = {
                "differ_from_ours": sum(self.vllm_differs.values()),
                "by_kind": dict(self.vllm_differs),
                "streamed_vs_whole_disagree": len(self.vllm_split),
            }
        return report


def replay(
    outputs: Iterable[Output],
    *,
    against: VllmReader | None = None,
    show: int = 0,
    summary: Summary | None = None,
) -> Summary:
    summary = summary or Summary(against is not None)
    began = time.perf_counter()
    for number, output in enumerate(outputs):
        summary.outputs += 1
        whole = read_output(output, [output.text])
        if any(
            read_output(output, chunks) != whole
            for chunks in chunkings(output.text, seed=number)
        ):
            summary.ours_split.append(output.id)
        summary.shapes[shape_of(output, whole)] += 1
        if against is None:
            continue
        theirs, theirs_streamed = against.read(output, (n for n, _ in whole.calls))
        if theirs_streamed[:3] != theirs[:3]:
            summary.vllm_split.append(output.id)
        kind = difference(whole, theirs)
        if kind is not None:
            summary.vllm_differs[kind] += 1
            if len(summary.shown) < show:
                summary.shown.append((output, whole, theirs, kind))
    summary.elapsed_s += time.perf_counter() - began
    return summary


def _clip(text: str, width: int) -> str:
    shown = repr(text)
    return shown if len(shown) <= width else shown[: width - 4] + "...'"


def format_summary(summary: Summary, source: str, width: int = 36) -> str:
    lines = [
        f"{summary.outputs} outputs from {source}, read in {summary.elapsed_s:.2f} s"
    ]
    lines.append("")
    lines.append("| shape (our reading) | outputs |")
    lines.append("|---|---:|")
    for shape in SHAPES_IN_ORDER:
        lines.append(f"| {shape} | {summary.shapes[shape]} |")
    lines.append("")
    lines.append(
        f"Streamed vs whole, ours: {len(summary.ours_split)} disagree "
        "(chunks of 64 and 5 characters and 31 random cuts, against the whole read)."
    )
    if summary.against_vllm:
        kinds = ", ".join(f"{k}: {n}" for k, n in summary.vllm_differs.most_common())
        lines.append(
            f"vLLM's in-tree parsers: {sum(summary.vllm_differs.values())} differ from "
            f"ours ({kinds or 'none'}); their streamed and whole readings disagree "
            f"in {len(summary.vllm_split)}."
        )
    for output, ours, theirs, kind in summary.shown:
        lines += ["", f"{output.id}: {kind}"]
        lines.append(f"  {'':16}{'reasoning':{width}} {'content':{width}} tool calls")
        for who, read in (("vLLM in-tree", theirs), ("vllm-k3-plugin", ours)):
            calls = ", ".join(f"{n}({a})" for n, a in read.calls) or "-"
            if len(calls) > width:
                calls = calls[: width - 3] + "..."
            lines.append(
                f"  {who:16}{_clip(read.reasoning, width):{width}} "
                f"{_clip(read.content, width):{width}} {calls}"
            )
    for problem in summary.malformed:
        lines.append(f"skipped malformed line {problem}")
    return "\n".join(lines)


def write_report(summary: Summary, path: Path) -> None:
    path.write_text(json.dumps(summary.report(), indent=2) + "\n")
