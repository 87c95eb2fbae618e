"""The example clients, run against the real ``vllm serve`` with forced outputs: a
server started with ``--api-key``, given the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.format.xtml import render_tools

pytestmark = pytest.mark.server

EXAMPLES = Path(__file__).parents[2] / "examples"
CALL = "Need the weather." + render_tools([("get_weather", {"city": "Paris"})])
ANSWER = "Checked." + vocab.THINK_END + vocab.RESPONSE_START + "Clear in Paris."
ANSWER += vocab.RESPONSE_END + vocab.MESSAGE_END


def _force(hf_tokenizer, text: str) -> str:
    ids = [*hf_tokenizer.encode(text, add_special_tokens=False), vocab.END_OF_MSG_ID]
    return json.dumps({"vllm_xargs": {"k3_force_ids": ids}})


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (
            "client_chat.py",
            [
                "reasoning: 'Need the weather.'",
                'tool call: functions.get_weather:0 get_weather({"city": "Paris"})',
                "finish:    tool_calls",
                "-- next turn --",
                "content:   'Clear in Paris.'",
            ],
        ),
        (
            "client_responses.py",
            [
                'call:      functions.get_weather:0 get_weather({"city": "Paris"})',
                "-- next turn --",
                "text:      'Clear in Paris.'",
            ],
        ),
        (
            "client_messages.py",
            [
                "thinking:  'Need the weather.'",
                'tool_use:  functions.get_weather:0 get_weather({"city": "Paris"})',
                "stop:      tool_use",
                "-- next turn --",
                "text:      'Clear in Paris.'",
                "stop:      end_turn",
            ],
        ),
    ],
)
def test_example_client(keyed_server, hf_tokenizer, script, expected):
    url, key = keyed_server
    run = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / script),
            "--base-url",
            url,
            "--api-key",
            key,
            "--extra-body",
            _force(hf_tokenizer, CALL + vocab.MESSAGE_END),
            "--next-extra-body",
            _force(hf_tokenizer, ANSWER),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    positions = [lines.index(line) for line in expected]
    assert positions == sorted(positions), run.stdout
