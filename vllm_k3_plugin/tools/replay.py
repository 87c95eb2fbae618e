"""``vllm-k3 replay``: raw K3 outputs through our readers, and optionally vLLM's.

Every output is read whole and streamed at several chunkings by our readers (plain
Python, no vLLM import), classified by how it ended, and checked for streamed/whole
agreement. With ``against_vllm`` it is also read by vLLM's in-tree ``kimi_k3``
reasoning and tool parsers, driven as chat completions drives them (streamed one
token at a time, and whole), and the differences are counted by kind.

The file is streamed: memory does not grow with the number of outputs.
"""

from __future__ import annotations

import codecs
import functools
import json
import random
import textwrap
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from vllm_k3_plugin.format import marked, vocab
from vllm_k3_plugin.format.channels import Channel
from vllm_k3_plugin.format.output import ContentGate, OutputReader, collect_output
from vllm_k3_plugin.tools.capture import iter_records

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
    features: tuple[int, ...] = (0, 0, 0, 0)
    """Counts of ``FEATURES``, in order."""


# What the report counts beside the shapes: outputs showing each.
FEATURES = (
    "quoted markers",
    "cut calls",
    "resumed think channels",
    "content in a tools channel",
)


class Chunk(NamedTuple):
    text: str
    ids: list[int] | None


def read_output(output: Output, chunks: Iterable[Chunk]) -> Read:
    """Our reader, fed ``chunks`` of the output (with its ids where it has them)."""
    start = Channel.THINK if output.thinking else Channel.RESPONSE
    tokens = _atom_tokens() if output.token_ids else None
    atoms = marked.atoms_for(tokens is not None, tokens)
    reader = OutputReader(start, atoms=atoms)
    events: list = []
    for chunk in chunks:
        events += reader.feed(chunk.text, chunk.ids)
    events += reader.finish(stopped=output.finish_reason == "stop")
    reading = collect_output(events)
    calls = tuple((c.name, c.arguments) for c in reading.calls)
    # The content a server returns: whitespace alone beside tool calls is none.
    gate = ContentGate()
    content = gate.pass_through(reading.content) + gate.close(
        tool_calls_made=bool(calls)
    )
    features = (
        getattr(atoms, "quoted_atoms", 0),
        sum(not c.complete for c in reading.calls),
        reader.reasoning_reader.think_blocks,
        reader.prose_chars,
    )
    replayed = reader.reasoning_reader.replayed
    return Read(reading.reasoning, content, calls, replayed, features)


@functools.cache
def _encoding() -> Any:
    """The bundled Kimi BPE (tiktoken, which every vLLM installs); ``None`` without
    tiktoken: outputs are then read from their text alone."""
    try:
        from vllm_k3_plugin.tools.tokenizer import load_tiktoken_encoding

        return load_tiktoken_encoding()
    except ImportError:
        return None


@functools.cache
def _atom_tokens() -> marked.AtomTokens | None:
    encoding = _encoding()
    if encoding is None:
        return None
    return marked.AtomTokens(lambda ids: encoding.decode(list(ids)))


SMALL_CHUNKS_UP_TO = 4096


def whole(output: Output) -> list[Chunk]:
    return [Chunk(output.text, output.token_ids)]


def chunkings(output: Output, seed: int) -> Iterator[list[Chunk]]:
    """The streamed chunkings every output is read at, besides whole. With ids:
    steps of 8 tokens, 1 token (outputs up to ``SMALL_CHUNKS_UP_TO`` ids) and random
    steps of 1 to 16, each step's text as vLLM's detokenizer gives it. Without:
    64-character chunks, 5-character chunks (up to ``SMALL_CHUNKS_UP_TO``
    characters) and 31 random cuts."""
    rng = random.Random(seed)
    ids = output.token_ids
    if ids and _encoding() is not None:
        stop_dropped = (
            output.finish_reason == "stop" and ids[-1] in vocab.MODEL_STOP_IDS
        )
        steps = [[8] * (len(ids) // 8 + 1)]
        if len(ids) <= SMALL_CHUNKS_UP_TO:
            steps.append([1] * len(ids))
        steps.append([rng.randint(1, 16) for _ in range(len(ids))])
        for sizes in steps:
            yield _held_back(detokenized(ids, sizes, stop_dropped), output.text)
        return
    text = output.text
    yield [Chunk(text[i : i + 64], None) for i in range(0, len(text), 64)]
    if len(text) <= SMALL_CHUNKS_UP_TO:
        yield [Chunk(text[i : i + 5], None) for i in range(0, len(text), 5)]
    if len(text) > 1:
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 31)))
        yield [Chunk(text[a:b], None) for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _held_back(chunks: list[Chunk], text: str) -> list[Chunk]:
    """``chunks`` as a stop string leaves them: when the recorded text is a proper
    prefix of what the ids decode to (vLLM dropped the stop string and the text
    after it; the ids keep its tokens), the text past it never streams."""
    decoded = "".join(chunk.text for chunk in chunks)
    if decoded == text or not decoded.startswith(text):
        return chunks
    budget, held = len(text), []
    for chunk in chunks:
        held.append(Chunk(chunk.text[:budget], chunk.ids))
        budget -= len(held[-1].text)
    return held


def detokenized(ids: list[int], sizes: list[int], stop_dropped: bool) -> list[Chunk]:
    """``ids`` in steps of ``sizes`` with each step's text, as vLLM's incremental
    detokenizer hands it over (a character split across tokens comes whole; the
    stop token that ended the output has no text)."""
    encoding = _encoding()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chunks, at = [], 0
    for size in sizes:
        step = ids[at : at + size]
        if not step:
            break
        text = "".join(
            decoder.decode(encoding.decode_single_token_bytes(token))
            for offset, token in enumerate(step, at)
            if not (stop_dropped and offset == len(ids) - 1)
        )
        at += size
        chunks.append(Chunk(text, step))
    if chunks:
        last = chunks[-1]
        chunks[-1] = Chunk(last.text + decoder.decode(b"", final=True), last.ids)
    return chunks or [Chunk("", [])]


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
    from vllm_k3_plugin.tools.shapes import SHAPES, output_ids

    for name, shape in SHAPES.items():
        for finish in ("stop", "length"):
            ids = output_ids(shape.output, stop=finish == "stop")
            yield Output(
                f"{name} ({finish})", shape.output, finish, shape.thinking, ids
            )


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
        from vllm_k3_plugin.tools import compare

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
        self.features: Counter[str] = Counter()
        self.read_from_ids = 0
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
            "features": {feature: self.features[feature] for feature in FEATURES},
            "read_from_ids": self.read_from_ids,
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
        read = read_output(output, whole(output))
        if any(
            read_output(output, chunks) != read
            for chunks in chunkings(output, seed=number)
        ):
            summary.ours_split.append(output.id)
        summary.shapes[shape_of(output, read)] += 1
        summary.read_from_ids += bool(output.token_ids) and _encoding() is not None
        for feature, count in zip(FEATURES, read.features):
            summary.features[feature] += count > 0
        if against is None:
            continue
        theirs, theirs_streamed = against.read(output, (n for n, _ in read.calls))
        if theirs_streamed[:3] != theirs[:3]:
            summary.vllm_split.append(output.id)
        kind = difference(read, theirs)
        if kind is not None:
            summary.vllm_differs[kind] += 1
            if len(summary.shown) < show:
                summary.shown.append((output, read, theirs, kind))
    summary.elapsed_s += time.perf_counter() - began
    return summary


# Shown of each field of an output read differently; the report has them whole.
SHOWN_CHARACTERS = 400

TERMS = textwrap.fill(
    "Terms: an output ends by 'stop' (the model wrote its end-of-message token) or "
    "'length' (max_tokens cut it). The think channel is the model's reasoning; a "
    "skipped channel is a reply the model wrote inside it and closed with the "
    "reply's closer, returned as the content too. Quoted markers: marker text the "
    "model wrote as ordinary text (told apart by its token ids, it stays text). "
    "Cut calls: tool calls the output ended inside. Resumed think channels: the "
    "model thought again after a tools channel, inside its reply or between "
    "calls. Text between calls: text in a tools channel outside any call.",
    width=88,
)


def _shown(text: str) -> str:
    shown = repr(text)
    if len(shown) <= SHOWN_CHARACTERS:
        return shown
    return f"{shown[:SHOWN_CHARACTERS]}... ({len(text)} characters in all)"


def _calls(read: Read) -> str:
    return "; ".join(f"{name}({arguments})" for name, arguments in read.calls) or "-"


def format_summary(summary: Summary, source: str) -> str:
    lines = [
        f"{summary.outputs} outputs from {source}, read in {summary.elapsed_s:.2f} s"
    ]
    lines.append("")
    lines.append("| shape (our reading) | outputs |")
    lines.append("|---|---:|")
    for shape in SHAPES_IN_ORDER:
        lines.append(f"| {shape} | {summary.shapes[shape]} |")
    lines.append("")
    lines.append("| outputs with | outputs |")
    lines.append("|---|---:|")
    for feature in FEATURES:
        lines.append(f"| {feature} | {summary.features[feature]} |")
    lines.append("")
    lines.append(TERMS)
    lines.append("")
    text_only = summary.outputs - summary.read_from_ids
    lines.append(
        f"Markers told from text by their token ids in {summary.read_from_ids} "
        "outputs"
        + (
            f", by their text alone in {text_only} (no token ids recorded)."
            if text_only
            else "."
        )
    )
    lines.append(
        f"Streamed vs whole, ours: {len(summary.ours_split)} disagree (steps of 8 and "
        "1 tokens and random steps, or text chunks where no ids, against the whole "
        "read)."
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
        fields = (
            ("reasoning", _shown(theirs.reasoning), _shown(ours.reasoning)),
            ("content", _shown(theirs.content), _shown(ours.content)),
            ("tool calls", _calls(theirs), _calls(ours)),
        )
        for field, vllm_reads, plugin_reads in fields:
            if vllm_reads == plugin_reads:
                lines.append(f"  {field}: the same, {plugin_reads}")
                continue
            lines.append(f"  {field}:")
            lines.append(f"    vLLM in-tree    {vllm_reads}")
            lines.append(f"    vllm-k3-plugin  {plugin_reads}")
    for problem in summary.malformed:
        lines.append(f"skipped malformed line {problem}")
    return "\n".join(lines)


def write_report(summary: Summary, path: Path) -> None:
    path.write_text(json.dumps(summary.report(), indent=2) + "\n")
