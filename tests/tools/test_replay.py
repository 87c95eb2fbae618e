"""``vllm-k3 replay``: the built-in corpus, capture files, bad files, a large file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools import cli
from vllm_k3_plugin.tools.replay import (
    SHAPES_IN_ORDER,
    Output,
    builtin_corpus,
    read_output,
    replay,
    whole,
)
from vllm_k3_plugin.tools.shapes import SHAPES, output_ids

# The built-in corpus's replies vLLM's in-tree parser loses and ours recovers.
LOST_BY_VLLM = {
    "skipped-channel (stop)",
    "closer-at-end (stop)",
    "closer-whitespace (stop)",
    "skipped-then-tools (stop)",
    "skipped-then-tools (length)",
    "prose-between-calls (stop)",
    "prose-between-calls (length)",
}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_builtin_replay_against_vllm(capsys, tmp_path):
    pytest.importorskip("vllm")
    report = tmp_path / "report.json"
    code, out, _ = _run(
        capsys, "replay", "--against", "vllm", "--show", "50", "--report", str(report)
    )
    assert code == 0
    data = json.loads(report.read_text())
    assert data["outputs"] == 2 * len(SHAPES)
    assert data["streamed_vs_whole_disagree"] == 0
    assert sum(data["shapes"].values()) == data["outputs"]
    assert data["shapes"]["cut at max_tokens"] == len(SHAPES)
    assert data["shapes"]["skipped channel recovered"] == 3
    assert data["vllm"]["by_kind"]["reply lost"] == len(LOST_BY_VLLM)
    lost = {
        line.split(": reply lost")[0]
        for line in out.splitlines()
        if ": reply lost" in line
    }
    assert lost == LOST_BY_VLLM
    assert "| skipped channel recovered | 3 |" in out
    # The side by side: each field of a differing output, the readings one under
    # the other, a field both read alike once; the terms explained.
    block = out.split("skipped-channel (stop): reply lost\n", 1)[1].split("\n\n")[0]
    assert block.splitlines() == [
        "  reasoning:",
        "    vLLM in-tree    'The answer is 4.<|close|>response<|sep|><|close|>message"
        "<|sep|>'",
        "    vllm-k3-plugin  'The answer is 4.'",
        "  content:",
        "    vLLM in-tree    ''",
        "    vllm-k3-plugin  'The answer is 4.'",
        "  tool calls: the same, -",
    ]
    assert "Terms: an output ends by 'stop'" in out
    # The README quotes the summary: each line it quotes is the replay's own.
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    block = readme.split("\n```\n52 outputs from", 1)[1].split("```", 1)[0]
    quoted = ("52 outputs from" + block).strip().splitlines()
    assert len(quoted) == 3
    assert [line for line in quoted if line not in out] == []


def test_a_long_field_is_shown_to_its_limit_and_says_how_long_it_is():
    from vllm_k3_plugin.tools.replay import SHOWN_CHARACTERS, _shown

    shown = _shown("x" * 1000)
    assert shown.startswith("'" + "x" * (SHOWN_CHARACTERS - 1))
    assert shown.endswith("... (1000 characters in all)")
    assert _shown("short") == "'short'"


def test_shapes_of_the_corpus_without_vllm(capsys):
    code, out, _ = _run(capsys, "replay")
    assert code == 0
    for shape in SHAPES_IN_ORDER:
        assert f"| {shape} |" in out
    assert "ours: 0 disagree" in out


def _write(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_capture_file_with_malformed_lines_is_read_around_them(capsys, tmp_path):
    raw = tmp_path / "raw.jsonl"
    good = {"id": "a", "text": "Hi." + vocab.RESPONSE_END, "finish_reason": "stop"}
    raw.write_text(
        json.dumps(good)
        + "\n{not json\n\n"
        + json.dumps({"id": "b"})
        + "\n"
        + json.dumps({**good, "id": "c", "thinking": False})
        + "\n"
    )
    code, out, _ = _run(capsys, "replay", str(raw))
    assert code == 0
    assert out.startswith("2 outputs from")
    assert f"skipped malformed line {raw}:2: not JSON" in out
    assert f"skipped malformed line {raw}:4: needs a 'text' string" in out
    report = json.loads((tmp_path / "raw.jsonl.replay.json").read_text())
    assert report["outputs"] == 2 and len(report["malformed_lines"]) == 2


@pytest.mark.parametrize("problem", ["missing", "empty", "directory"])
def test_bad_files_are_clear_errors(capsys, tmp_path, problem):
    path = tmp_path / "raw.jsonl"
    if problem == "empty":
        path.write_text("\n")
    elif problem == "directory":
        path.mkdir()
    code, out, err = _run(capsys, "replay", str(path))
    assert code == 2
    assert out == ""
    assert err.startswith("vllm-k3 replay: ") and str(path) in err
    assert {"missing": "no such file", "empty": "empty", "directory": "directory"}[
        problem
    ] in err


def test_replay_reads_every_shape_like_the_reader():
    outputs = list(builtin_corpus())
    summary = replay(outputs)
    assert summary.outputs == len(outputs) and summary.ours_split == []
    skipped = Output("x", SHAPES["skipped-channel"].output, "stop", True)
    read = read_output(skipped, whole(skipped))
    assert read.replayed and read.content == read.reasoning


def test_an_output_ended_by_a_stop_string_reads_the_same_streamed():
    """vLLM drops a stop string's text but keeps its tokens' ids: the streamed
    reads stop where the recorded text does."""
    text = "Thinking." + vocab.THINK_END + vocab.RESPONSE_START + "Yes. DONE and more"
    recorded = text[: text.index(" DONE")]
    output = Output("s", recorded, "stop", True, output_ids(text, stop=False))
    summary = replay([output])
    assert summary.ours_split == []
    assert read_output(output, whole(output)).content == "Yes."


def test_replay_counts_what_the_contract_reads():
    summary = replay(builtin_corpus())
    report = summary.report()
    assert report["read_from_ids"] == summary.outputs
    # Outputs showing each, every shape ended by a stop and by a cut: BPE-spelled
    # markers in two shapes, think blocks in two, content in a tools channel in
    # four (text between calls, and the three shapes whose call opener opened
    # nothing: the words after it, or the reply after the thought's exit). No
    # shape ends inside a call (a cut there is served in test_server_tools).
    assert report["features"] == {
        "quoted markers": 4,
        "cut calls": 0,
        "resumed think channels": 4,
        "content in a tools channel": 8,
    }


# A child that writes a large capture file, replays it through the CLI, and reports
# the time and its own peak memory.
LARGE = textwrap.dedent(
    """
    import json, sys, time
    from vllm_k3_plugin.format import vocab

    def high_water_kb():
        # VmHWM belongs to this address space (ru_maxrss is inherited across exec).
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    from vllm_k3_plugin.tools.cli import main
    path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    words = "the answer is we need to check whether first then ".split()
    with open(path, "w") as out:
        for i in range(count):
            body = " ".join(words[(i + k) % len(words)] for k in range(size // 5))
            body = body[:size - 64]
            kind = i % 3
            if kind == 0:
                text = body + vocab.THINK_END + vocab.RESPONSE_START + "Ok."
            elif kind == 1:
                text = body + vocab.RESPONSE_END + vocab.MESSAGE_END
            else:
                text = body
            record = {"id": f"o{i}", "text": text, "thinking": True,
                      "finish_reason": "length" if kind == 2 else "stop"}
            out.write(json.dumps(record) + "\\n")
    before = high_water_kb()
    began = time.perf_counter()
    code = main(["replay", path, "--report", path + ".report.json"])
    elapsed = time.perf_counter() - began
    peak = high_water_kb()
    print(json.dumps({"code": code, "elapsed_s": elapsed, "rss_before_kb": before,
                      "rss_peak_kb": peak}), file=sys.stderr)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc")
def test_ten_thousand_outputs_of_20_kb(tmp_path):
    """Prints the time; memory stays bounded because the file is streamed."""
    path = tmp_path / "large.jsonl"
    began = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-c", LARGE, str(path), "10000", "20000"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stderr.strip().splitlines()[-1])
    print(
        f"\nreplay of 10,000 outputs x 20 KB ({path.stat().st_size / 1e6:.0f} MB): "
        f"{figures['elapsed_s']:.1f} s, peak RSS "
        f"{figures['rss_peak_kb'] / 1024:.0f} MB "
        f"({time.perf_counter() - began:.1f} s with writing the file)"
    )
    assert figures["code"] == 0
    report = json.loads((tmp_path / "large.jsonl.report.json").read_text())
    assert report["outputs"] == 10_000
    assert report["streamed_vs_whole_disagree"] == 0
    assert report["shapes"]["answered"] == 3334
    assert report["shapes"]["skipped channel recovered"] == 3333
    assert report["shapes"]["cut at max_tokens"] == 3333
    # The file is 200 MB; the replay holds one output at a time.
    assert figures["rss_peak_kb"] - figures["rss_before_kb"] < 64 * 1024
    assert path.stat().st_size > 190e6


def test_invalid_utf8_is_a_malformed_line(capsys, tmp_path):
    raw = tmp_path / "raw.jsonl"
    good = json.dumps({"id": "a", "text": "Hi.", "thinking": "false"}) + "\n"
    raw.write_bytes(good.encode() + b'{"id": "b", "text": "\xff"}\n' + good.encode())
    code, out, _ = _run(capsys, "replay", str(raw))
    assert code == 0
    assert out.startswith("2 outputs from")
    assert f"skipped malformed line {raw}:2: not UTF-8" in out
    # "thinking": "false" is read as false: the text is the reply, not a thought.
    assert "| answered | 2 |" in out
