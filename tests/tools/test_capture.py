"""``vllm-k3 capture`` against the real ``vllm serve``, then ``replay`` on it."""

from __future__ import annotations

import json

import pytest

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.tools import cli
from vllm_k3_plugin.tools.capture import (
    API_KEY_ENV,
    CaptureError,
    done_ids,
    read_requests,
)
from vllm_k3_plugin.tools.shapes import SHAPES, TOOLS

pytestmark = pytest.mark.server

# shape, ending -> the shape replay must find
FORCED = {
    ("think-then-reply", "stop"): "answered",
    ("thinking-off", "stop"): "answered",
    ("skipped-channel", "stop"): "skipped channel recovered",
    ("closer-whitespace", "stop"): "skipped channel recovered",
    ("no-closer", "stop"): "thought only",
    ("skipped-channel", "cut"): "cut at max_tokens",
    ("closer-cut-mid-marker", "cut"): "cut at max_tokens",
    ("reply-then-calls", "stop"): "tool calls",
    ("thinking-off-tools", "stop"): "tool calls",
}


def _requests(hf_tokenizer) -> list[dict]:
    lines = []
    for (shape, ending), _ in FORCED.items():
        output, thinking, _ = SHAPES[shape]
        ids = hf_tokenizer.encode(output, add_special_tokens=False)
        if ending == "stop":
            ids.append(vocab.END_OF_MSG_ID)
        lines.append(
            {
                "id": f"{shape}/{ending}",
                "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                "tools": TOOLS,
                "chat_template_kwargs": {"thinking": thinking},
                "max_tokens": len(ids) + (8 if ending == "stop" else 0),
                "temperature": 0,
                "vllm_xargs": {"k3_force_ids": ids},
            }
        )
    return lines


@pytest.fixture(scope="module")
def captured(k3_server, hf_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("capture")
    requests = folder / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in _requests(hf_tokenizer)))
    raw = folder / "raw.jsonl"
    argv = ["capture", "--base-url", k3_server, "--requests", str(requests)]
    assert cli.main([*argv, "--out", str(raw), "--concurrency", "4"]) == 0
    return folder, argv, raw


def test_capture_keeps_every_marker_and_the_ending(captured, hf_tokenizer):
    _, _, raw = captured
    records = [json.loads(line) for line in raw.read_text().splitlines()]
    assert [r["id"] for r in records] == [f"{s}/{e}" for s, e in FORCED]
    for record in records:
        shape, ending = record["id"].split("/")
        output, thinking, _ = SHAPES[shape]
        assert record["text"] == output
        assert record["finish_reason"] == ("stop" if ending == "stop" else "length")
        assert record["thinking"] is thinking
        forced = hf_tokenizer.encode(output, add_special_tokens=False)
        assert record["token_ids"][: len(forced)] == forced


def test_replay_counts_the_forced_shapes(captured, capsys):
    folder, _, raw = captured
    report = folder / "report.json"
    assert cli.main(["replay", str(raw), "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    expected: dict[str, int] = {}
    for shape in FORCED.values():
        expected[shape] = expected.get(shape, 0) + 1
    assert {k: v for k, v in data["shapes"].items() if v} == expected
    assert data["streamed_vs_whole_disagree"] == 0
    assert f"{len(FORCED)} outputs from {raw}" in capsys.readouterr().out


def test_interrupted_capture_resumed_gives_the_same_file(captured):
    folder, argv, raw = captured
    full = raw.read_bytes()
    lines = full.splitlines(keepends=True)
    torn = folder / "torn.jsonl"
    # Three lines written, the fourth cut off mid-write.
    torn.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    assert done_ids(torn) == [json.loads(line)["id"] for line in lines[:3]]
    assert cli.main([*argv, "--out", str(torn), "--no-progress"]) == 0
    assert torn.read_bytes() == full
    # Run again on a complete file: nothing is redone.
    assert cli.main([*argv, "--out", str(torn), "--no-progress"]) == 0
    assert torn.read_bytes() == full


def test_capture_sends_the_api_key(
    keyed_server, hf_tokenizer, tmp_path, monkeypatch, capsys
):
    """Against a server started with ``--api-key``: the key given with
    ``--api-key`` or in ``OPENAI_API_KEY`` captures; none, or a wrong one, is a
    one-line error naming the option, and nothing is written."""
    url, key = keyed_server
    requests = tmp_path / "requests.jsonl"
    lines = _requests(hf_tokenizer)[:2]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["capture", "--base-url", url, "--requests", str(requests), "--no-progress"]
    flag, env = tmp_path / "flag.jsonl", tmp_path / "env.jsonl"
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert cli.main([*argv, "--out", str(flag), "--api-key", key]) == 0
    records = [json.loads(line) for line in flag.open()]
    assert [r["id"] for r in records] == [line["id"] for line in lines]
    assert records[0]["text"] == SHAPES["think-then-reply"].output
    monkeypatch.setenv(API_KEY_ENV, key)
    assert cli.main([*argv, "--out", str(env)]) == 0
    assert env.read_bytes() == flag.read_bytes()

    for given, said in ((None, "wants an API key"), ("wrong", "refused the API key")):
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        if given is not None:
            monkeypatch.setenv(API_KEY_ENV, given)
        out = tmp_path / f"refused-{given}.jsonl"
        capsys.readouterr()
        assert cli.main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"{url}/v1/models answered 401 Unauthorized: the server {said}" in err
        assert "--api-key" in err
        assert not out.exists()


def test_bad_request_files(tmp_path):
    path = tmp_path / "requests.jsonl"
    with pytest.raises(CaptureError, match="no such file"):
        read_requests(path)
    path.write_text('{"messages": []}\n{"id": "x"}\n')
    with pytest.raises(CaptureError, match=r"requests.jsonl:2: needs a 'messages'"):
        read_requests(path)
    path.write_text("\n")
    with pytest.raises(CaptureError, match="no requests"):
        read_requests(path)


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    code = cli.main(
        [
            "capture",
            "--base-url",
            "http://127.0.0.1:9",
            "--requests",
            str(requests),
            "--out",
            str(tmp_path / "raw.jsonl"),
            "--no-progress",
        ]
    )
    assert code == 2
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err


def test_capture_killed_midway_and_resumed(k3_server, hf_tokenizer, tmp_path):
    """A real interruption: the capture process is killed once it has written a
    line, then run again; the file equals an uninterrupted capture's."""
    import subprocess
    import sys
    import time

    lines = []
    for n in range(4):
        ids = hf_tokenizer.encode(
            f"Step {n}. " + "slow " * 300, add_special_tokens=False
        )
        lines.append(
            {
                "id": f"slow-{n}",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": len(ids),
                "vllm_xargs": {"k3_force_ids": ids},
            }
        )
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["capture", "--base-url", k3_server, "--requests", str(requests)]
    whole = tmp_path / "whole.jsonl"
    assert cli.main([*argv, "--out", str(whole), "--no-progress"]) == 0

    resumed = tmp_path / "resumed.jsonl"
    command = [sys.executable, "-m", "vllm_k3_plugin.tools.cli", *argv]

    def run_and_kill_after_a_line() -> int:
        resumed.unlink(missing_ok=True)
        child = subprocess.Popen(
            [*command, "--out", str(resumed), "--no-progress", "--concurrency", "1"],
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None:
            if resumed.exists() and resumed.read_bytes().count(b"\n") >= 1:
                child.kill()
                break
            time.sleep(0.02)
        child.wait()
        return resumed.read_bytes().count(b"\n") if resumed.exists() else 0

    # On a loaded machine this test's process can wake too late to stop the
    # child before its last line; such a run interrupted nothing, so run again.
    for _ in range(5):
        written = run_and_kill_after_a_line()
        if written < len(lines):
            break
    assert 1 <= written < len(lines)  # it really was interrupted midway
    assert cli.main([*argv, "--out", str(resumed), "--no-progress"]) == 0
    assert resumed.read_bytes() == whole.read_bytes()


def test_resume_cuts_a_torn_utf8_line_and_refuses_a_bad_middle_line(tmp_path):
    out = tmp_path / "raw.jsonl"
    line = json.dumps({"id": "a", "text": "é"}, ensure_ascii=False).encode() + b"\n"
    torn = json.dumps({"id": "b", "text": "é"}, ensure_ascii=False).encode()
    out.write_bytes(line + b"\n" + torn[: torn.index("é".encode()) + 1])
    assert done_ids(out) == ["a"]
    assert out.read_bytes() == line + b"\n"
    out.write_bytes(line + b'{"no": "id"}\n' + line.replace(b'"a"', b'"c"'))
    with pytest.raises(CaptureError, match=r"raw.jsonl:2: not a captured output"):
        done_ids(out)
