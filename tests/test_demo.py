"""The README's first command: the built-in shapes through both parsers."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

from vllm_k3_plugin import demo


def test_demo_recovers_skipped_replies_and_agrees_with_itself(capsys):
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    summary = re.search(
        r"(\d+) readings: (\d+) replies lost .* differ in (\d+) for vLLM's parser, "
        r"(\d+) for the plugin's",
        out,
    )
    assert summary, out[-500:]
    readings, lost, _, ours_split = map(int, summary.groups())
    assert readings == 2 * len(demo.SHAPES)
    assert lost >= 1
    assert ours_split == 0
    assert "skipped-channel (stop)" in out
